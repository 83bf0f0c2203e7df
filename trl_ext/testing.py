"""pytest plugin for trl-ext plugin authors (auto-loaded through the ``pytest11`` entry point).

Fixtures:

* ``trl_ext_catalog``: a fresh :class:`~trl_ext.catalog.Catalog` with only the core's built-ins (no entry-point
  autoload), so a test sees exactly the plugins it registers;
* ``register_plugin``: ``register_plugin(PluginClass, catalog=None)`` adds a plugin class to a catalog (default: the
  ``trl_ext_catalog`` fixture) and removes it again when the test ends, even on failure;
* ``tiny_model_dir``: a session-wide folder holding the embedded tiny Qwen2 model and tokenizer (built in code);
* ``tiny_trainer``: ``tiny_trainer(trainer="grpo", plugins=[...], args={...})`` builds a trl-ext trainer with the
  given plugin instances on the tiny model and the embedded arithmetic task, ready for ``.train()``.

Helpers: :func:`check_plugin_conformance` asserts a plugin class meets the host's rules (documented, named, schema
instantiable with defaults, hooks all specified, slots declared for selection hooks); :func:`assert_conforms` checks a
loss objective, token correction, aggregation or advantage plugin against a reference written from its formula, in
float64, value and gradient, through the real loss pipeline; :func:`straight_and_resumed` runs a recipe uninterrupted
and interrupted-then-rerun, to compare a resumed run with one that never stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from trl_ext.catalog import Catalog, check_plugin_class
from trl_ext.plugin import Plugin

_FORMATS = {"sft": "prompt_completion", "grpo": "prompt", "rloo": "prompt", "dpo": "preference",
            "reward": "preference", "kto": "unpaired", "distillation": "prompt"}


def fresh_catalog() -> Catalog:
    """A catalog with the core's built-in models and datasets and no plugins."""
    import trl_ext.builtins

    catalog = Catalog()
    catalog.add_source(trl_ext.builtins, source="builtins", distribution="trl-ext")
    return catalog


def check_plugin_conformance(plugin_cls: type[Plugin]) -> None:
    """Raise AssertionError unless ``plugin_cls`` is a well-formed trl-ext plugin."""
    try:
        check_plugin_class(plugin_cls)
    except TypeError as exc:
        raise AssertionError(str(exc)) from None
    assert plugin_cls.__doc__ and plugin_cls.description(), f"plugin {plugin_cls.name!r} has no docstring"
    assert plugin_cls.family, f"plugin {plugin_cls.name!r} has no family"
    required = [row["name"] for row in plugin_cls.parameter_table() if row["required"]]
    if not required:
        plugin_cls(plugin_cls.Params())  # defaults must form a valid parameter set
    for row in plugin_cls.parameter_table():
        assert row["description"], f"plugin {plugin_cls.name!r}: parameter {row['name']!r} has no description"


@pytest.fixture
def trl_ext_catalog() -> Catalog:
    return fresh_catalog()


@pytest.fixture
def register_plugin(trl_ext_catalog):
    added: list[tuple[Catalog, str]] = []

    def register(plugin_cls: type[Plugin], catalog: Catalog | None = None) -> type[Plugin]:
        target = catalog if catalog is not None else trl_ext_catalog
        target.add_plugin(plugin_cls)
        added.append((target, plugin_cls.name))
        return plugin_cls

    try:
        yield register
    finally:
        for catalog, name in reversed(added):
            if name in catalog.plugins:
                catalog.remove_plugin(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from trl_ext.embedded.models import materialize_model

    return str(materialize_model("tiny-qwen2", tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2", seed=0))


@pytest.fixture
def tiny_trainer(tiny_model_dir, tmp_path):
    def build(trainer: str = "grpo", plugins: list[Plugin] | None = None, args: dict[str, Any] | None = None,
              dataset=None, reward_funcs=None):
        from transformers import AutoTokenizer

        from trl_ext.embedded.arithmetic import arithmetic_dataset
        from trl_ext.host import PluginHost
        from trl_ext.recipe import StageSpec
        from trl_ext.rewards import collect_reward_functions
        from trl_ext.stage import default_args
        from trl_ext.trainers import TRAINER_KINDS, BuildContext, plugin_trainer_kwargs

        kind = TRAINER_KINDS[trainer]
        host = PluginHost(plugins or [])
        merged = {**default_args(kind), "max_steps": 2, "logging_steps": 1, "save_strategy": "no", "seed": 0,
                  **_small_defaults(trainer)}
        for impl in reversed(host.pm.hook.trl_ext_configure_args.get_hookimpls()):
            merged.update(impl.function(trainer=trainer, args=dict(args or {})) or {})
        merged.update(args or {})
        stage = StageSpec(trainer=trainer, model=tiny_model_dir, dataset={"source": "embedded:arithmetic"})
        rewards = collect_reward_functions(host, stage) if kind.uses_rewards else []
        if kind.uses_rewards and reward_funcs is None and not rewards:
            from trl_ext.embedded.arithmetic import exact_match_reward

            reward_funcs = [exact_match_reward]
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        ctx = BuildContext(
            model=tiny_model_dir, ref_model=None, teacher=tiny_model_dir if trainer == "distillation" else None,
            config=kind.config_cls(output_dir=str(tmp_path / "out"), **merged),
            train_dataset=dataset if dataset is not None else arithmetic_dataset("train", format=_FORMATS[trainer], size=64),
            eval_dataset=None, tokenizer=tokenizer, peft_config=None,
            callbacks=[], host=host,
            reward_funcs=reward_funcs if reward_funcs is not None else [r.as_trl_callable() for r in rewards],
            reward_weights=[],
            trainer_kwargs=plugin_trainer_kwargs(host, stage, tokenizer),
        )
        trainer_obj = kind.build(ctx)
        host.hook.trl_ext_trainer_created(trainer=trainer_obj)
        return trainer_obj

    return build


def _small_defaults(trainer: str) -> dict[str, Any]:
    """Small batch and sequence settings so a tiny-model step takes milliseconds."""
    if trainer in ("grpo", "rloo"):
        return {"per_device_train_batch_size": 8, "num_generations": 4, "max_completion_length": 4,
                "gradient_checkpointing": False}
    if trainer == "distillation":
        return {"per_device_train_batch_size": 4, "max_completion_length": 4, "gradient_checkpointing": False}
    return {"per_device_train_batch_size": 8, "max_length": 32}


# -- numeric conformance ------------------------------------------------------------------------------------------------

CONFORMANCE_RTOL = 1e-9


def _loss_case_inputs(case: dict[str, Any]):
    import torch

    from trl_ext.batches import LossInputs

    d = torch.float64
    theta = torch.as_tensor(case["theta"], dtype=d)
    theta = theta.reshape(1, -1) if theta.dim() == 1 else theta
    as_t = lambda key, default=None: (default if case.get(key) is None  # noqa: E731
                                      else torch.as_tensor(case[key], dtype=d).reshape(theta.shape))
    mask = as_t("mask", torch.ones_like(theta))
    advantages = torch.as_tensor(case.get("advantages", 1.0), dtype=d)
    advantages = advantages.reshape(theta.size(0), -1) if advantages.dim() else advantages.expand(theta.size(0), 1)
    leaf = theta.clone().requires_grad_(True)
    li = LossInputs(
        num_items_in_batch=torch.as_tensor(case.get("num_items_in_batch", float(mask.sum())), dtype=d),
        grad_accum_steps=1, steps_per_generation=1, num_processes=1, training=False,
        loss_type=case.get("loss_type", "bnpo"), max_completion_length=case.get("max_completion_length", theta.size(1)),
        per_token_logps=leaf, old_per_token_logps=as_t("old", theta.clone()), advantages=advantages, mask=mask,
        sampling_per_token_logps=as_t("rollout"), ref_per_token_logps=as_t("ref"), entropies=None,
        epsilon_low=case.get("epsilon_low", 0.2), epsilon_high=case.get("epsilon_high", 0.2), beta=case.get("beta", 0.0),
        extra={"sapo_tau_pos": case.get("sapo_tau_pos", 1.0), "sapo_tau_neg": case.get("sapo_tau_neg", 1.05)},
    )
    return li, leaf


def _close(actual, expected, rtol: float, what: str, plugin, index: int) -> None:
    import torch

    expected = torch.as_tensor(expected, dtype=torch.float64)
    actual = actual.detach().to(torch.float64).reshape(expected.shape)
    scale = expected.abs().clamp(min=1.0)  # relative to |expected|, absolute below 1 (zeros compare to rtol)
    error = ((actual - expected).abs() / scale).max().item() if expected.numel() else 0.0
    assert error <= rtol, (f"plugin {plugin.name!r}, case {index}: {what} differs from the reference by {error:.3e} "
                           f"(relative, tolerance {rtol:.0e})\n  got      {actual.tolist()}\n  expected {expected.tolist()}")


def assert_conforms(plugin, reference_fn, cases, *, rtol: float = CONFORMANCE_RTOL, others=()) -> None:
    """Assert that ``plugin`` computes what ``reference_fn`` says, in float64, value and gradient, on every case.

    The kind is read from the hooks the plugin implements:

    * **loss plugins** (``trl_ext_policy_loss``, ``trl_ext_token_weights``, ``trl_ext_aggregate_loss``): each case is
      a dict of nested lists: ``theta`` (log pi_theta, ``(B, T)`` or ``(T,)``), optional ``old``, ``rollout``,
      ``ref``, ``mask``, ``advantages`` (scalar, ``(B,)`` or ``(B, T)``), ``epsilon_low``/``epsilon_high`` (0.2),
      ``beta`` (0), ``loss_type`` (``bnpo``: TRL's objective and micro-batch token mean fill the slots the plugin
      leaves empty). The plugin, with ``others`` (plugins filling the other slots), runs through the real loss
      pipeline (:func:`trl_ext.trainers.grpo.compose_loss`, k3 KL without bias correction). ``reference_fn(case,
      theta)`` gets ``theta`` as a float64 leaf tensor and returns the scalar loss (its autograd gradient is the
      expected one) or a ``(loss, d loss / d theta)`` pair written out by hand; value and gradient must agree to
      ``rtol`` (relative to |expected|, absolute below 1).
    * **advantage plugins** (``trl_ext_compute_advantages``): each case has ``rewards`` (``(N,)``, NaN = unscorable),
      ``num_generations`` and optionally ``mask`` (``(N, T)``); the plugin sees a one-process rollout batch (no
      trainer). ``reference_fn(case)`` returns the advantages; advantages carry no gradient.
    """
    import torch

    hooks = set(type(plugin).implemented_hooks())
    if "trl_ext_compute_advantages" in hooks:
        from trl_ext.batches import RolloutBatch

        for index, case in enumerate(cases):
            rewards = torch.as_tensor(case["rewards"], dtype=torch.float64)
            n = rewards.numel()
            mask = torch.as_tensor(case.get("mask", [[1.0]] * n), dtype=torch.float64)
            batch = RolloutBatch(
                rewards_per_func=rewards.unsqueeze(-1), reward_names=["reward"], reward_weights=torch.ones(1),
                num_generations=int(case["num_generations"]), process_slice=slice(0, n),
                completion_ids=torch.zeros_like(mask, dtype=torch.long), completion_mask=mask,
                completion_lengths=mask.sum(-1), prompts=[], completions=[], inputs=[{} for _ in range(n)],
            )
            got = plugin.trl_ext_compute_advantages(rewards=rewards, batch=batch)
            _close(got, reference_fn(case), rtol, "advantages", plugin, index)
        return
    if not hooks & {"trl_ext_policy_loss", "trl_ext_token_weights", "trl_ext_aggregate_loss"}:
        raise AssertionError(f"plugin {plugin.name!r} implements no loss or advantage hook assert_conforms can check")

    from trl_ext import ops
    from trl_ext.host import PluginHost
    from trl_ext.trainers.grpo import compose_loss

    host = PluginHost([plugin, *others])
    for index, case in enumerate(cases):
        li, leaf = _loss_case_inputs(case)
        loss, _, _ = compose_loss(host, li, loss_type=li.loss_type, kl=ops.KLTerm("k3", bias_correction=False))
        (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        grad = torch.zeros_like(leaf) if grad is None else grad
        theta = leaf.detach().clone().requires_grad_(True)
        expected = reference_fn(case, theta)
        if isinstance(expected, tuple):  # (value, gradient) written out by hand
            expected, expected_grad = expected
        elif expected.requires_grad:
            (expected_grad,) = torch.autograd.grad(expected, theta, allow_unused=True)
        else:
            expected_grad = None
        expected_grad = torch.zeros_like(theta) if expected_grad is None else torch.as_tensor(expected_grad)
        _close(loss, expected.detach(), rtol, "loss", plugin, index)
        _close(grad, expected_grad, rtol, "gradient", plugin, index)


class Interrupted(Exception):
    """Raised by a test's callback to stop a run part-way, as a crash would (:func:`straight_and_resumed`)."""


def straight_and_resumed(recipe: Callable[[], Any], catalog: Catalog, folder: Path,
                         interrupt) -> tuple[Path, Path, list[str]]:
    """Run ``recipe()`` to the end in ``folder/straight``; in ``folder/resumed`` run it with the trainer callback
    ``interrupt`` (which raises :class:`Interrupted`), then again without it, as a user reruns a killed command.
    Returns both run folders and the messages of the rerun (``resuming from ...``, ``finishing the stage ...``)."""
    from trl_ext.runner import run_recipe

    straight, resumed = folder / "straight", folder / "resumed"
    run_recipe(recipe(), straight, catalog, echo=lambda _m: None)
    with pytest.raises(Interrupted):
        run_recipe(recipe(), resumed, catalog, extra_callbacks=[interrupt], echo=lambda _m: None)
    messages: list[str] = []
    run_recipe(recipe(), resumed, catalog, echo=messages.append)
    return straight, resumed, messages
