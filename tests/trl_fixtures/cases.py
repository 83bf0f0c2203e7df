"""Every place trl-ext claims parity with TRL 1.16, as one fixture case each: fixed float64 inputs, TRL's own code for
the reference, and trl-ext's path for the same case.

Used by ``record.py`` (writes TRL's numbers into the JSON files next to it) and ``tests/test_trl_fixtures.py``
(recomputes TRL's numbers: drift; runs trl-ext's path against the recorded numbers: parity). TRL's code is called
as the live parity tests call it: its loss methods unbound on a minimal trainer-like object (the GRPO pattern of
tests/test_losses_parity.py, extended to DPO/KTO/reward), its loss functions and kernels directly, and the code TRL
runs inline in ``_generate_and_score_completions`` (advantages, the vLLM importance-sampling factor) on a real tiny
TRL trainer whose generation, log-prob passes and reward functions return the case's tensors. Each case returns
``(loss, {name: gradient})`` as float64 tensors; the gradient is taken w.r.t. the tensor the loss is differentiated
through in training (per-token log-probs, sequence rewards, student hidden states).

A case is ``Case(id, family, trl, make_inputs, run_trl, run_ext)``: ``trl`` holds the TRL config fields the case
sets (recorded in the file), ``make_inputs()`` builds seeded inputs (only at recording time; the test reads the
inputs from the file), ``run_trl(trl, inputs)`` and ``run_ext(inputs)`` compute loss and gradients.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

D = torch.float64
B, T = 4, 6  # GRPO batch: 4 completions of 6 tokens
GRAD_ACCUM, STEPS_PER_GEN, MAX_COMPLETION = 2, 2, 8


@dataclass
class Case:
    id: str
    family: str  # the JSON file: tests/trl_fixtures/<family>.json
    trl: dict  # the TRL config fields this case sets (recorded)
    make_inputs: Callable[[], dict]
    run_trl: Callable[[dict, dict], tuple]  # (trl fields, inputs) -> (loss, {name: grad})
    run_ext: Callable[[dict], tuple]  # inputs -> (loss, {name: grad})
    parity_rtol: float = 1e-9  # trl-ext vs the recorded numbers
    # The installed TRL vs the recorded numbers. 1e-9 catches any change of a float64 computation; a TRL kernel that
    # computes in float32 gets a float32 tolerance, because its matmuls round differently on another CPU's BLAS kernel
    # (AVX2 vs AVX-512 summation order) with the same TRL and torch.
    drift_rtol: float = 1e-9
    note: str = ""  # where TRL's reference comes from, or why a case deviates from the defaults (recorded)


def tensors(inputs: dict) -> dict:
    """JSON lists back to tensors: masks, ids and labels as int64, everything else float64; scalars stay as they are."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, list):
            out[key] = torch.tensor(value, dtype=torch.long if key.endswith("_mask") or key.endswith("_ids")
                                    or key == "label" else D)
        else:
            out[key] = value
    return out


class OneProcess:
    """The accelerator calls TRL's loss code makes, for one process on CPU."""

    num_processes = 1
    device = torch.device("cpu")
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


def _grad(loss, leaves: dict) -> tuple:
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss.detach(), {name: g.detach() for name, g in zip(leaves, grads)}


# -- GRPO family: TRL GRPOTrainer._compute_loss vs ExtGRPOTrainer._plugin_loss -------------------------------------


def grpo_inputs(seed: int = 0) -> dict:
    """Per-token log-probs of 4 completions: row 1 padded after 4 tokens, row 3 a single-token completion, log-ratios
    up to about +-3 (clipped on both sides), a train/inference mismatch for the corrections, a reference for KL."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    theta = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.05
    old = theta + torch.randn(B, T, generator=g, dtype=D) * 0.3
    old[0, 2] = theta[0, 2] - 2.5  # moderately large log-ratios, both signs
    old[2, 4] = theta[2, 4] + 3.0
    # TRL turns the sampling log-probs it receives into a float32 tensor; values exact in float32 keep the case exact
    sampling = (old + torch.randn(B, T, generator=g, dtype=D) * 0.6).float().double()
    ref = theta + torch.randn(B, T, generator=g, dtype=D) * 0.5
    ref[2, 1] = theta[2, 1] + 2.0
    return {"theta": theta.tolist(), "old_per_token_logps": old.tolist(), "sampling_per_token_logps": sampling.tolist(),
            "ref_per_token_logps": ref.tolist(), "completion_mask": mask.tolist(),
            "advantages": [1.2, -0.7, 0.4, -1.5], "num_items_in_batch": int(mask.sum()) * 2}


_GRPO_DEFAULTS = {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": None, "importance_sampling_level": "token",
                  "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "beta": 0.0,
                  "use_bias_correction_kl": False, "use_vllm": False, "off_policy_mask_threshold": None,
                  "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "delta": None, "vespo_k_pos": 2.0,
                  "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0,
                  "use_adaptive_entropy": False, "entropy_target": 0.2}


def grpo_trainer_like(args: dict, theta: torch.Tensor, entropies=None):
    """What TRL's _compute_loss and trl-ext's _plugin_loss read, TRL's defaults overridden by ``args`` (as in
    tests/test_losses_parity.py, with the KL, off-policy mask, entropy and delta fields settable). ``entropies``: a
    function of the current log-probs giving the forward pass's per-token entropies (default zeros)."""
    from trl import GRPOTrainer

    from trl_ext.ops import KLTerm
    from trl_ext.trainers.grpo import ExtGRPOTrainer

    leaf = theta.clone().requires_grad_(True)
    a = {**_GRPO_DEFAULTS, **args}
    entropy_of = entropies or torch.zeros_like
    t = types.SimpleNamespace(
        loss_type=a["loss_type"], epsilon_low=a["epsilon"], epsilon_high=a["epsilon_high"] or a["epsilon"],
        importance_sampling_level=a["importance_sampling_level"], beta=a["beta"],
        top_entropy_quantile=a["top_entropy_quantile"], entropy_coef=a["entropy_coef"],
        use_adaptive_entropy=a["use_adaptive_entropy"], _last_world_entropy=float("inf"), _entropy_window_stats=None,
        off_policy_mask_threshold=a["off_policy_mask_threshold"], use_vllm=a["use_vllm"],
        vllm_importance_sampling_correction=a["use_vllm"],
        aux_loss_enabled=False, _entropy_bonus_enabled=a["entropy_coef"] != 0.0 or a["use_adaptive_entropy"],
        current_gradient_accumulation_steps=GRAD_ACCUM,
        max_completion_length=MAX_COMPLETION, _loss_extra_keys=(), accelerator=OneProcess(),
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)}, temperature=1.0,
        args=types.SimpleNamespace(delta=a["delta"], use_bias_correction_kl=a["use_bias_correction_kl"],
                                   steps_per_generation=STEPS_PER_GEN, top_k=0, top_p=1.0, min_p=None,
                                   sapo_temperature_pos=a["sapo_temperature_pos"],
                                   sapo_temperature_neg=a["sapo_temperature_neg"], entropy_target=a["entropy_target"],
                                   entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0,
                                   **{key: a[key] for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                              "vespo_lambda_neg")}),
        _get_per_token_logps_and_entropies=lambda *_, **__: (leaf, entropy_of(leaf), None),
    )
    t.kl_term = KLTerm("k3", bias_correction=t.args.use_bias_correction_kl)  # what ExtGRPOTrainer.__init__ sets
    for name in ("_plugin_loss", "_masked_global_mean", "_log_plugin_metrics", "_objective_is_ppo_clip",
                 "_clip_ratio_metrics", "_applied_entropy_coef", "_adaptive_entropy_window"):
        setattr(t, name, types.MethodType(getattr(ExtGRPOTrainer, name), t))
    t.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, t)
    t.get_off_policy_mask = GRPOTrainer.get_off_policy_mask  # staticmethods
    t.get_gamma_weights = GRPOTrainer.get_gamma_weights
    return t, leaf


def _grpo_batch(inputs: dict, keys=("old_per_token_logps",)) -> dict:
    x = tensors(inputs)
    mask = x["completion_mask"]
    batch = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
             "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
             "advantages": x["advantages"], "num_items_in_batch": torch.tensor(x["num_items_in_batch"])}
    batch.update({k: x[k] for k in keys})
    return batch


def vllm_importance_sampling_ratio(trl: dict, x: dict) -> torch.Tensor:
    """TRL 1.16's own vLLM IS factor for ``vllm_importance_sampling_mode``: GRPOTrainer._generate_and_score_completions
    builds it inline, so that method runs on a real (tiny) GRPOTrainer with generation, log-prob passes and rewards
    replaced by the case's tensors, and ``use_vllm`` / the IS fields set on it (no vLLM is needed or started)."""
    mask = x["completion_mask"]
    lengths = mask.sum(1).tolist()
    trainer = grpo_trainer()
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = trl["vllm_importance_sampling_mode"]
    trainer.vllm_importance_sampling_clip_min = trl["vllm_importance_sampling_clip_min"]
    trainer.vllm_importance_sampling_clip_max = trl["vllm_importance_sampling_clip_max"]
    trainer.scale_rewards = "group"
    try:
        out = _stubbed_rollout(trainer, lengths, [0.0] * len(lengths), x["old_per_token_logps"],
                               sampling=[row[:n] for row, n in zip(x["sampling_per_token_logps"].tolist(), lengths)])
    finally:
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = False
    if not torch.equal(out["completion_mask"], mask):
        raise AssertionError("the stubbed generation did not reproduce the recorded completion mask")
    return out["importance_sampling_ratio"]


def run_trl_grpo(trl: dict, inputs: dict, compute=None):
    from trl import GRPOTrainer

    compute = compute or GRPOTrainer._compute_loss
    x = tensors(inputs)
    keys = ("old_per_token_logps",) + (("ref_per_token_logps",) if trl.get("beta") else ())
    batch = _grpo_batch(inputs, keys)
    args = {k: v for k, v in trl.items() if not k.startswith("vllm_importance")}
    if trl.get("use_vllm"):
        batch["importance_sampling_ratio"] = vllm_importance_sampling_ratio(trl, x)
    t, leaf = grpo_trainer_like(args, x["theta"])
    return _grad(compute(t, None, batch), {"per_token_logps": leaf})


def grpo_ext(plugin_fn: Callable[[], list], user_args: dict | None = None, sampling=False, trl_is: dict | None = None):
    """trl-ext's path: the plugins' ``trl_ext_configure_args`` over the recipe's ``user_args``, the plugins'
    ``trl_ext_trainer_created`` (e.g. grpo's KL term), then ``ExtGRPOTrainer._plugin_loss``. ``sampling``: the batch
    carries the sampling log-probs (trl-ext's corrections); ``trl_is``: TRL's own vLLM IS fields, whose factor the
    batch carries (TRL's correction kept under a loss plugin)."""
    def run(inputs):
        from trl_ext.host import PluginHost

        plugins = plugin_fn()
        args = dict(user_args or {})
        for p in plugins:
            configure = getattr(p, "trl_ext_configure_args", None)
            args.update((configure and configure(trainer="grpo", args={})) or {})
        x = tensors(inputs)
        keys = ("old_per_token_logps",) + (("ref_per_token_logps",) if args.get("beta") else ()) + (
            ("sampling_per_token_logps",) if sampling else ())
        t, leaf = grpo_trainer_like(args, x["theta"])
        t.plugin_host = PluginHost(plugins)
        for p in plugins:
            created = getattr(p, "trl_ext_trainer_created", None)
            if created is not None:
                created(trainer=t)
        batch = _grpo_batch(inputs, keys)
        if trl_is:
            batch["importance_sampling_ratio"] = vllm_importance_sampling_ratio(trl_is, x)
        return _grad(t._plugin_loss(None, batch), {"per_token_logps": leaf})
    return run


def grpo_cases() -> list[Case]:
    from trl_ext_plugins.corrections.icepop import IcePop
    from trl_ext_plugins.corrections.mis import MIS
    from trl_ext_plugins.corrections.tis import TIS
    from trl_ext_plugins.losses.aggregation import Aggregation
    from trl_ext_plugins.losses.cispo import CISPO
    from trl_ext_plugins.losses.dapo import DAPO
    from trl_ext_plugins.losses.dr_grpo import DrGRPO
    from trl_ext_plugins.losses.gmpo import GMPO
    from trl_ext_plugins.losses.grpo import GRPO, GRPOParams
    from trl_ext_plugins.losses.gspo import GSPO
    from trl_ext_plugins.losses.sapo import SAPO

    def agg(mode):
        return Aggregation(Aggregation.Params(mode=mode))

    seq = {"importance_sampling_level": "sequence"}
    objectives = [  # (case suffix, TRL fields, trl-ext plugins, recipe args)
        ({"loss_type": "grpo"}, lambda: [GRPO()], None),
        ({"loss_type": "dr_grpo"}, lambda: [DrGRPO()], None),
        ({"loss_type": "dapo", "epsilon_high": 0.28}, lambda: [DAPO()], None),
        ({"loss_type": "bnpo"}, lambda: [GRPO(), agg("batch-token-mean")], None),
        ({"loss_type": "dapo"}, lambda: [GRPO(), agg("token-mean")], None),
        ({"loss_type": "dr_grpo"}, lambda: [GRPO(), agg("seq-mean-token-sum-norm")], None),
        ({"loss_type": "grpo", **seq, "epsilon": 3e-4, "epsilon_high": 4e-4}, lambda: [GSPO()], None),
        ({"loss_type": "grpo", **seq, "epsilon": 0.05}, lambda: [GSPO(GSPO.Params(epsilon_low=0.05,
                                                                                   epsilon_high=0.05))], None),
        ({"loss_type": "grpo", **seq, "epsilon": 0.05},
         lambda: [GSPO(GSPO.Params(form="token", epsilon_low=0.05, epsilon_high=0.05)), agg("seq-mean-token-mean")],
         None),
        ({"loss_type": "sapo"}, lambda: [SAPO()], None),
        ({"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
         lambda: [SAPO(SAPO.Params(tau_pos=2.0, tau_neg=0.5))], None),
        ({"loss_type": "cispo", "epsilon_high": 5.0}, lambda: [CISPO()], None),
        ({"loss_type": "cispo", "epsilon_high": 1.1}, lambda: [CISPO(CISPO.Params(epsilon_high=0.1))], None),
        # KL to the reference (args.beta), TRL's k3 with and without its bias correction
        ({"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True}, lambda: [GRPO()],
         {"beta": 0.04, "use_bias_correction_kl": True}),
        ({"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True},
         lambda: [GRPO(GRPOParams(kl_bias_correction=True))], {"beta": 0.04}),
        ({"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
         lambda: [GRPO(GRPOParams(kl_bias_correction=False))], {"beta": 0.04}),
        ({"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": True}, lambda: [GRPO(), agg("token-mean")],
         {"beta": 0.1, "use_bias_correction_kl": True}),
    ]
    cases = []
    ids = set()
    for trl_fields, plugins, user_args in objectives:
        names = "+".join(p.name if not isinstance(p, Aggregation) else f"aggregation[{p.params.mode}]"
                         for p in plugins())
        case_id = "grpo/" + "/".join(f"{k}={v}" for k, v in trl_fields.items()) + f"/ext={names}"
        if user_args and "use_bias_correction_kl" not in user_args:
            case_id += "[kl_bias_correction]"
        assert case_id not in ids, case_id
        ids.add(case_id)
        cases.append(Case(case_id, "grpo_losses", trl_fields, grpo_inputs, run_trl_grpo, grpo_ext(plugins, user_args)))

    def run_trl_gmpo(trl, inputs):
        from trl.experimental.gmpo import GMPOTrainer

        return run_trl_grpo(trl, inputs, compute=GMPOTrainer._compute_loss)

    gmpo = {"loss_type": "grpo", "epsilon": 0.4, "epsilon_high": 0.4}
    cases.append(Case("grpo/experimental.gmpo/epsilon=0.4/ext=gmpo", "grpo_losses", gmpo, grpo_inputs, run_trl_gmpo,
                      grpo_ext(lambda: [GMPO()]),
                      note="TRL reference: trl.experimental.gmpo.GMPOTrainer._compute_loss"))

    corrections = [  # (TRL vLLM IS mode, clip_min, clip_max, objective fields, trl-ext plugins)
        ("token_truncate", None, 2.0, {"loss_type": "grpo"}, lambda: [GRPO(), TIS()]),
        ("sequence_truncate", None, 1.5, {"loss_type": "dapo", "epsilon_high": 0.28},
         lambda: [DAPO(), TIS(TIS.Params(level="sequence", upper=1.5))]),
        ("token_mask", 0.5, 2.0, {"loss_type": "grpo"}, lambda: [GRPO(), MIS()]),
        ("sequence_mask", None, 1.5, {"loss_type": "grpo"},
         lambda: [GRPO(), MIS(MIS.Params(level="sequence", lower=None, upper=1.5))]),
        ("token_mask", 0.5, 2.0, {"loss_type": "grpo"}, lambda: [GRPO(), IcePop()]),
        ("token_mask", 0.5, 2.0, {"loss_type": "cispo", "epsilon_high": 5.0}, lambda: [CISPO(), IcePop()]),
    ]
    for mode, lo, hi, objective, plugins in corrections:
        trl_fields = {**objective, "use_vllm": True, "vllm_importance_sampling_mode": mode,
                      "vllm_importance_sampling_clip_min": lo, "vllm_importance_sampling_clip_max": hi}
        names = "+".join(p.name for p in plugins())
        case_id = (f"grpo/vllm_importance_sampling_mode={mode}/clip=[{lo},{hi}]/loss_type={objective['loss_type']}"
                   f"/ext={names}")
        cases.append(Case(case_id, "grpo_losses", trl_fields, grpo_inputs, run_trl_grpo,
                          grpo_ext(plugins, sampling=True),
                          note="TRL's IS factor from GRPOTrainer._generate_and_score_completions (generation stubbed), "
                               "then TRL's _compute_loss"))
    # no trl-ext correction: TRL's own vLLM correction (its default mode; the sequence ratios of these inputs lie in
    # [0.33, 1.74], so the bound 1.5 masks one) is kept under a loss plugin, and a correction plugin runs over TRL's
    # default objective when no objective plugin is selected
    trl_is = {"use_vllm": True, "vllm_importance_sampling_mode": "sequence_mask",
              "vllm_importance_sampling_clip_min": None, "vllm_importance_sampling_clip_max": 1.5}
    cases.append(Case("grpo/vllm_importance_sampling_mode=sequence_mask/clip=[None,1.5]/loss_type=grpo"
                      "/ext=grpo+trl-correction", "grpo_losses", {"loss_type": "grpo", **trl_is}, grpo_inputs,
                      run_trl_grpo, grpo_ext(lambda: [GRPO()], {"use_vllm": True}, trl_is=trl_is),
                      note="TRL's own vLLM IS factor (GRPOTrainer._generate_and_score_completions, generation "
                           "stubbed) reaches both paths"))
    for loss_type, extra in (("dapo", {}), ("grpo", {}), ("dr_grpo", {})):
        trl_fields = {"loss_type": loss_type, **extra, "use_vllm": True,
                      "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": None,
                      "vllm_importance_sampling_clip_max": 2.0}
        cases.append(Case(f"grpo/vllm_importance_sampling_mode=token_truncate/clip=[None,2.0]/loss_type={loss_type}"
                          "/ext=tis(no objective plugin)", "grpo_losses", trl_fields, grpo_inputs, run_trl_grpo,
                          grpo_ext(lambda: [TIS()], {"loss_type": loss_type}, sampling=True),
                          note="trl-ext runs TRL's default objective for args.loss_type when only a correction plugin "
                               "is selected"))
    return cases


# -- Preference family: TRL DPOTrainer/KTOTrainer._compute_loss, CPO/ORPO loss functions vs trl-ext's plugins ---------

P, PT = 4, 5  # 4 pairs (DPO) or 4 unpaired examples (KTO), 5 completion positions after the prompt token


def preference_inputs(seed: int = 1) -> dict:
    """Per-token log-probs of chosen rows then rejected rows (``2P x PT``; 0 at masked positions, as TRL's fused LM head
    returns for label -100), a one-token completion, and summed reference log-probs giving log-ratios up to ~+-12."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2 * P, PT + 1, dtype=torch.long)
    mask[:, 0] = 0  # the prompt token
    mask[1, 4:] = 0
    mask[2, 2:] = 0  # a single-token chosen completion
    mask[5, 3:] = 0
    logps = -torch.rand(2 * P, PT, generator=g, dtype=D) * 2.5 - 0.01
    logps = torch.where(mask[:, 1:].bool(), logps, torch.zeros_like(logps))
    ref = logps.sum(1) + torch.randn(2 * P, generator=g, dtype=D) * 2.0
    ref[0] += 12.0  # a large negative chosen log-ratio
    ref[7] -= 9.0  # a large positive rejected log-ratio
    return {"per_token_logps": logps.tolist(), "completion_mask": mask.tolist(),
            "ref_chosen_logps": ref[:P].tolist(), "ref_rejected_logps": ref[P:].tolist()}


def _fused_outputs(leaf, label_mask=None):
    """The fields of TRL's fused-LM-head output that the loss code reads (metrics-only fields are zeros). Like the real
    head (``trl.trainer.utils``' fused forward), positions outside ``label_mask`` are 0 with no gradient."""
    zeros = torch.zeros_like(leaf)
    log_probs = leaf if label_mask is None else leaf.masked_fill(~label_mask.bool(), 0.0)
    return types.SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                                 aux_loss=None)


def dpo_trainer_like(trl: dict, leaf: torch.Tensor):
    defaults = {"beta": 0.1, "loss_type": ["sigmoid"], "loss_weights": None, "label_smoothing": 0.0}
    a = {**defaults, **trl}
    return types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=OneProcess(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0,
        loss_types=a["loss_type"], loss_weights=a["loss_weights"] or [1.0] * len(a["loss_type"]), beta=a["beta"],
        label_smoothing=a["label_smoothing"], use_weighting=False, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1, args=types.SimpleNamespace(discopop_tau=0.05),
        preference_columns=frozenset(),
    )


def _dpo_batch(x: dict) -> dict:
    mask = x["completion_mask"]
    return {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
            "ref_chosen_logps": x["ref_chosen_logps"], "ref_rejected_logps": x["ref_rejected_logps"]}


def run_trl_dpo(trl: dict, inputs: dict):
    from trl import DPOTrainer

    x = tensors(inputs)
    leaf = x["per_token_logps"].clone().requires_grad_(True)
    t = dpo_trainer_like(trl, leaf)
    model = lambda **_: _fused_outputs(leaf, x["completion_mask"][:, 1:])  # noqa: E731
    return _grad(DPOTrainer._compute_loss(t, model, _dpo_batch(x), False), {"per_token_logps": leaf})


def dpo_ext(plugin_fn: Callable, trl: dict):
    """``ExtDPOTrainer._compute_loss`` with the plugin filling the preference-loss slot (TRL's ``beta`` as set)."""
    def run(inputs):
        from trl_ext.host import PluginHost
        from trl_ext.trainers.dpo import ExtDPOTrainer

        x = tensors(inputs)
        leaf = x["per_token_logps"].clone().requires_grad_(True)
        t = dpo_trainer_like(trl, leaf)
        t.plugin_host = PluginHost([plugin_fn()])
        for name in ("_log_preference_metrics", "_log_plugin_metrics"):
            setattr(t, name, types.MethodType(getattr(ExtDPOTrainer, name), t))
        model = lambda **_: _fused_outputs(leaf, x["completion_mask"][:, 1:])  # noqa: E731
        return _grad(ExtDPOTrainer._compute_loss(t, model, _dpo_batch(x), False), {"per_token_logps": leaf})
    return run


def sequence_pair_inputs(seed: int = 2) -> dict:
    """Mean token log-probs of chosen and rejected completions (SimPO/ORPO), including one near 0 (P ~ 1)."""
    g = torch.Generator().manual_seed(seed)
    chosen = -torch.rand(6, generator=g, dtype=D) * 3 - 1e-3
    rejected = -torch.rand(6, generator=g, dtype=D) * 3 - 1e-3
    chosen[0] = -1e-4
    rejected[5] = -6.0
    return {"chosen_logps": chosen.tolist(), "rejected_logps": rejected.tolist()}


def run_trl_cpo(trl: dict, inputs: dict):
    from trl.experimental.cpo import CPOTrainer

    x = tensors(inputs)
    c, r = x["chosen_logps"].clone().requires_grad_(True), x["rejected_logps"].clone().requires_grad_(True)
    t = types.SimpleNamespace(alpha=trl["alpha"], loss_type=trl["loss_type"], beta=trl["beta"],
                              simpo_gamma=trl["simpo_gamma"], label_smoothing=trl["label_smoothing"],
                              accelerator=OneProcess())
    losses, _, _ = CPOTrainer.cpo_loss(t, c, r)
    return _grad(losses.mean(), {"chosen_logps": c, "rejected_logps": r})


def _pref_inputs_from_means(x: dict, beta: float, lengths: int = 1):
    """PreferenceInputs whose mean log-probs are the given ones (length 1: summed == mean)."""
    from trl_ext.batches import PreferenceInputs

    c, r = x["chosen_logps"].clone().requires_grad_(True), x["rejected_logps"].clone().requires_grad_(True)
    n = torch.full_like(c, lengths, dtype=torch.long)
    return PreferenceInputs(chosen_logps=c, rejected_logps=r, chosen_lengths=n, rejected_lengths=n,
                            ref_chosen_logps=None, ref_rejected_logps=None, beta=beta), c, r


def simpo_ext(gamma: float, beta: float):
    def run(inputs):
        from trl_ext_plugins.preference.simpo import SimPO

        pref, c, r = _pref_inputs_from_means(tensors(inputs), beta)
        loss = SimPO(SimPO.Params(gamma=gamma)).trl_ext_preference_loss(pref).mean()
        return _grad(loss, {"chosen_logps": c, "rejected_logps": r})
    return run


def run_trl_orpo_odds_ratio(trl: dict, inputs: dict):
    from trl.experimental.orpo import ORPOTrainer

    x = tensors(inputs)
    c, r = x["chosen_logps"].clone().requires_grad_(True), x["rejected_logps"].clone().requires_grad_(True)
    t = types.SimpleNamespace(beta=trl["beta"], accelerator=OneProcess())
    losses = ORPOTrainer.odds_ratio_loss(t, c, r)[0]  # beta * log sigma(log odds ratio); TRL computes it in float32
    loss = -losses.mean()  # ORPO subtracts it: loss = NLL - mean(beta * log sigma(...))
    return _grad(loss.double(), {"chosen_logps": c, "rejected_logps": r})


def orpo_ext(beta: float):
    """The odds-ratio term of the ``orpo`` plugin (its NLL term is the plugin's own convention, not TRL's)."""
    def run(inputs):
        from trl_ext_plugins.preference.math import orpo_odds_ratio_loss

        x = tensors(inputs)
        c, r = x["chosen_logps"].clone().requires_grad_(True), x["rejected_logps"].clone().requires_grad_(True)
        return _grad(beta * orpo_odds_ratio_loss(c, r).mean(), {"chosen_logps": c, "rejected_logps": r})
    return run


def kto_inputs(seed: int = 3) -> dict:
    """Unpaired examples (labels 1,0,1,0,...), per-token log-probs, summed reference log-probs, and the mismatched
    pairs' (KL) summed log-probs of policy and reference."""
    x = preference_inputs(seed)
    g = torch.Generator().manual_seed(seed + 100)
    n = 2 * P
    kl_logps = -torch.rand(n, generator=g, dtype=D) * 8
    return {"per_token_logps": x["per_token_logps"], "completion_mask": x["completion_mask"],
            "label": [1, 0, 1, 1, 0, 0, 1, 0], "ref_logps": x["ref_chosen_logps"] + x["ref_rejected_logps"],
            "KL_logps": kl_logps.tolist(), "ref_KL_logps": (kl_logps - 0.4 + torch.randn(n, generator=g,
                                                                                          dtype=D) * 0.3).tolist()}


def run_trl_kto(trl: dict, inputs: dict):
    from trl import KTOTrainer

    x = tensors(inputs)
    leaf = x["per_token_logps"].clone().requires_grad_(True)
    mask = x["completion_mask"]
    kl_ids = torch.ones_like(mask)
    t = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=OneProcess(), aux_loss_enabled=False,
        calculate_KL=True, precompute_ref_logps=True, loss_type=trl["loss_type"], beta=trl["beta"],
        desirable_weight=trl["desirable_weight"], undesirable_weight=trl["undesirable_weight"],
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    t._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, t)
    kl_per_token = torch.zeros(mask.shape[0], mask.shape[1] - 1, dtype=D)
    kl_per_token[:, 0] = x["KL_logps"]  # summed by TRL: one non-zero position carries each row's sum

    def model(input_ids, **_):
        return _fused_outputs(kl_per_token if input_ids is kl_ids else leaf)

    batch = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
             "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(mask), "KL_completion_mask": mask,
             "label": x["label"].bool(), "ref_logps": x["ref_logps"], "ref_KL_logps": x["ref_KL_logps"]}
    return _grad(KTOTrainer._compute_loss(t, model, batch, False), {"per_token_logps": leaf})


def kto_ext(trl: dict):
    """``preference.math.kto_loss`` / ``apo_zero_unpaired_loss`` (the formulas the kto/apo plugins document; on the
    KTO trainer both plugins select TRL's own loss_type)."""
    def run(inputs):
        from trl_ext_plugins.preference import math as pm

        x = tensors(inputs)
        leaf = x["per_token_logps"].clone().requires_grad_(True)
        logratios = leaf.sum(1) - x["ref_logps"]
        labels = x["label"].bool()
        if trl["loss_type"] == "kto":
            kl = (x["KL_logps"] - x["ref_KL_logps"]).mean()
            losses = pm.kto_loss(logratios, labels, kl, trl["beta"], trl["desirable_weight"],
                                 trl["undesirable_weight"])
        else:
            weights = torch.where(labels, trl["desirable_weight"], trl["undesirable_weight"])
            losses = weights * pm.apo_zero_unpaired_loss(logratios, labels, trl["beta"])
        return _grad(losses.mean(), {"per_token_logps": leaf})
    return run


def preference_cases() -> list[Case]:
    from trl_ext_plugins.preference.apo import APO
    from trl_ext_plugins.preference.dpo import DPO
    from trl_ext_plugins.preference.ipo import IPO

    cases = []
    dpo = [(["sigmoid"], lambda: DPO()), (["ipo"], lambda: IPO()), (["apo_zero"], lambda: APO()),
           (["apo_down"], lambda: APO(APO.Params(variant="down")))]
    for beta in (0.1, 0.5):
        for loss_type, plugin in dpo:
            trl = {"loss_type": loss_type, "beta": beta}
            name = plugin().name + ("" if plugin().name != "apo" else f"[{plugin().params.variant}]")
            cases.append(Case(f"dpo/loss_type={loss_type[0]}/beta={beta}/ext={name}", "preference_losses", trl,
                              preference_inputs, run_trl_dpo, dpo_ext(plugin, trl)))
    for alpha in (1.0, 0.3):  # DPO + NLL: TRL's sft term is the chosen tokens' mean over the micro-batch
        trl = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, alpha], "beta": 0.1}
        plugin = (lambda a=alpha: DPO(DPO.Params(nll_weight=a, nll_normalization="batch_token_mean")))
        cases.append(Case(f"dpo/loss_type=sigmoid+sft/loss_weights=1,{alpha}/ext=dpo[nll batch_token_mean]",
                          "preference_losses", trl, preference_inputs, run_trl_dpo, dpo_ext(plugin, trl)))
    for beta, gamma in ((0.1, 0.5), (2.0, 1.2)):
        trl = {"loss_type": "simpo", "beta": beta, "simpo_gamma": gamma, "cpo_alpha": 0.0, "alpha": 0.0,
               "label_smoothing": 0.0}
        cases.append(Case(f"cpo/loss_type=simpo/beta={beta}/simpo_gamma={gamma}/ext=simpo", "preference_losses", trl,
                          sequence_pair_inputs, run_trl_cpo, simpo_ext(gamma, beta),
                          note="TRL reference: trl.experimental.cpo.CPOTrainer.cpo_loss (cpo_alpha=0: no NLL term, "
                               "alpha=0: no AlphaPO reward transform)"))
    cases.append(Case("orpo/odds_ratio_loss/beta=0.1/ext=orpo", "preference_losses", {"beta": 0.1},
                      sequence_pair_inputs, run_trl_orpo_odds_ratio, orpo_ext(0.1), parity_rtol=1e-6,
                      note="TRL reference: trl.experimental.orpo.ORPOTrainer.odds_ratio_loss, which casts to float32; "
                           "trl-ext's float64 odds-ratio term agrees to float32 precision"))
    for loss_type, beta, dw, uw in (("kto", 0.1, 1.0, 1.0), ("kto", 0.5, 1.5, 0.8), ("apo_zero_unpaired", 0.1, 1.0,
                                                                                      1.0)):
        trl = {"loss_type": loss_type, "beta": beta, "desirable_weight": dw, "undesirable_weight": uw}
        ext = "kto" if loss_type == "kto" else "apo[zero]"
        cases.append(Case(f"kto/loss_type={loss_type}/beta={beta}/desirable_weight={dw}/undesirable_weight={uw}"
                          f"/ext={ext}", "preference_losses", trl, kto_inputs, run_trl_kto, kto_ext(trl)))
    return cases


# -- Reward model (Bradley-Terry): TRL RewardTrainer.compute_loss vs rewards.formulas.bradley_terry_loss --------------


def reward_inputs(seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randn(6, generator=g, dtype=D) * 2
    rejected = torch.randn(6, generator=g, dtype=D) * 2
    chosen[0], rejected[0] = -7.0, 8.0  # a badly ranked pair
    return {"rewards_chosen": chosen.tolist(), "rewards_rejected": rejected.tolist(),
            "margin": [0.0, 0.25, 0.5, 0.75, 1.0, 3.0]}


def run_trl_reward(trl: dict, inputs: dict):
    from trl import RewardTrainer

    x = tensors(inputs)
    c, r = x["rewards_chosen"].clone().requires_grad_(True), x["rewards_rejected"].clone().requires_grad_(True)
    t = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=OneProcess(), _total_train_tokens=0, _tp_size=1,
        _metrics={"train": defaultdict(list)},
        args=types.SimpleNamespace(center_rewards_coefficient=trl["center_rewards_coefficient"]))
    model = lambda **_: types.SimpleNamespace(logits=torch.cat([c, r]).unsqueeze(-1))  # noqa: E731
    batch = {"input_ids": torch.zeros(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3, dtype=torch.long)}
    if trl["margin"]:
        batch["margin"] = x["margin"]
    return _grad(RewardTrainer.compute_loss(t, model, batch), {"rewards_chosen": c, "rewards_rejected": r})


def reward_ext(trl: dict):
    """``rewards.formulas.bradley_terry_loss`` plus the centering term: the formula the reward_model plugin documents
    (training itself runs TRL's RewardTrainer, with the centering coefficient and margin column the plugin sets)."""
    def run(inputs):
        from trl_ext_plugins.rewards import formulas

        x = tensors(inputs)
        c, r = x["rewards_chosen"].clone().requires_grad_(True), x["rewards_rejected"].clone().requires_grad_(True)
        loss = (formulas.bradley_terry_loss(c, r, x["margin"]) if trl["margin"] else
                formulas.bradley_terry_loss(c, r)).mean()
        if trl["center_rewards_coefficient"] is not None:
            loss = loss + trl["center_rewards_coefficient"] * ((c + r) ** 2).mean()
        return _grad(loss, {"rewards_chosen": c, "rewards_rejected": r})
    return run


def reward_cases() -> list[Case]:
    out = []
    for margin, center in ((False, None), (True, None), (True, 0.01)):
        trl = {"center_rewards_coefficient": center, "margin": margin}
        out.append(Case(f"reward/bradley_terry/margin={margin}/center_rewards_coefficient={center}"
                        "/ext=reward_model", "reward_losses", trl, reward_inputs, run_trl_reward, reward_ext(trl),
                        note="margin: whether the batch carries TRL's `margin` column"))
    return out


# -- Distillation: TRL's chunked divergence kernel (DistillationTrainer) vs distill.math.generalized_jsd --------------


def distill_inputs(seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, h, v = 6, 8, 11
    return {"student_hidden": torch.randn(n, h, generator=g, dtype=D).tolist(),
            "student_lm_head": torch.randn(v, h, generator=g, dtype=D).tolist(),
            "teacher_hidden": torch.randn(n, h, generator=g, dtype=D).tolist(),
            "teacher_lm_head": (torch.randn(v, h, generator=g, dtype=D) * 1.5).tolist()}


def run_trl_distill(trl: dict, inputs: dict):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    x = tensors(inputs)
    h = x["student_hidden"].clone().requires_grad_(True)
    per_token, _ = ChunkedDivergenceFunction.apply(h, x["student_lm_head"], None, x["teacher_hidden"],
                                                   x["teacher_lm_head"], None, trl["beta"], trl["temperature"], 1.0,
                                                   None, 1.0, None)
    return _grad(per_token.sum().double(), {"student_hidden": h})


def distill_ext(trl: dict):
    def run(inputs):
        from trl_ext_plugins.distill import math as dm

        x = tensors(inputs)
        h = x["student_hidden"].clone().requires_grad_(True)
        per_token = dm.generalized_jsd(x["teacher_hidden"] @ x["teacher_lm_head"].T, h @ x["student_lm_head"].T,
                                       trl["beta"], trl["temperature"])
        return _grad(per_token.sum().double(), {"student_hidden": h})
    return run


def distill_cases() -> list[Case]:
    from trl_ext_plugins.distill.gkd import GKDParams

    out = []
    for divergence, beta, temperature in (("forward_kl", None, 1.0), ("reverse_kl", None, 1.0), ("jsd", 0.3, 1.0),
                                          ("jsd", 0.5, 0.7)):
        params = GKDParams(divergence=divergence, **({} if beta is None else {"beta": beta}))
        trl = {"beta": params.trl_beta, "temperature": temperature}
        out.append(Case(f"distillation/beta={params.trl_beta}/temperature={temperature}/ext=gkd[{divergence}]",
                        "distillation_losses", trl, distill_inputs, run_trl_distill, distill_ext(trl),
                        parity_rtol=1e-5, drift_rtol=1e-6,
                        note="TRL reference: trl.kernels.chunked_divergence.ChunkedDivergenceFunction, the kernel "
                             "DistillationTrainer (and so the gkd plugin) trains with; trl-ext side: the full-vocabulary "
                             "reference distill.math.generalized_jsd, summed over tokens (float64 here; rtol 1e-5 "
                             "because the TRL kernel computes in float32)"))
    return out


# -- RLOO advantages: TRL RLOOTrainer._generate_and_score_completions vs the rloo plugin ------------------------------

RG, RT = 8, 4  # 2 prompts x 4 completions of up to 4 tokens


def rloo_inputs(seed: int = 6) -> dict:
    """Rewards with an unscorable row (NaN, stored as null) and a group with one scorable row; per-token log-probs of
    the sampling policy and of the reference (finite at padding, which TRL masks by multiplying)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 2, 1, 3, 4, 4, 2, 1]
    mask = torch.tensor([[1] * n + [0] * (RT - n) for n in lengths])
    old = -torch.rand(RG, RT, generator=g, dtype=D) * 3
    ref = old + torch.randn(RG, RT, generator=g, dtype=D) * 0.7
    return {"rewards": [1.0, 0.0, None, 0.25, 2.0, None, None, None], "completion_mask": mask.tolist(),
            "old_per_token_logps": old.tolist(), "ref_per_token_logps": ref.tolist()}


def _rewards(values) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else v for v in values], dtype=D)


_TRL_TRAINERS: dict[str, object] = {}


def tiny_trl_trainer(kind: str, **config):
    """One TRL ``RLOOTrainer`` or ``GRPOTrainer`` (``kind`` "rloo" / "grpo") on the embedded tiny model, built once
    per kind with a zero reward; each case sets its own fields on it per call."""
    if kind not in _TRL_TRAINERS:
        import atexit
        import shutil
        import tempfile

        import trl
        from transformers import AutoTokenizer

        from trl_ext.embedded.arithmetic import arithmetic_dataset
        from trl_ext.embedded.models import materialize_model

        config_cls, trainer_cls = {"rloo": (trl.RLOOConfig, trl.RLOOTrainer),
                                   "grpo": (trl.GRPOConfig, trl.GRPOTrainer)}[kind]
        root = tempfile.mkdtemp(prefix=f"trl-fixtures-{kind}-")
        atexit.register(shutil.rmtree, root, True)
        model_dir = str(materialize_model("tiny-qwen2", f"{root}/model", seed=0))
        args = config_cls(output_dir=f"{root}/out", num_generations=4, bf16=False, use_cpu=True, report_to="none",
                          gradient_checkpointing=False, save_strategy="no", **config)
        _TRL_TRAINERS[kind] = trainer_cls(
            model=model_dir, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
            train_dataset=arithmetic_dataset("train", format="prompt", size=8),
            processing_class=AutoTokenizer.from_pretrained(model_dir))
    return _TRL_TRAINERS[kind]


def rloo_trainer():
    return tiny_trl_trainer("rloo", per_device_train_batch_size=RG, max_completion_length=RT, beta=0.0)


def run_trl_rloo(trl: dict, inputs: dict):
    """TRL's own advantage code (inside _generate_and_score_completions) with generation, log-prob passes and reward
    functions replaced by the recorded tensors."""
    x = tensors({k: v for k, v in inputs.items() if k != "rewards"})
    trainer = rloo_trainer()
    trainer.beta, trainer.normalize_advantages = trl["beta"], trl["normalize_advantages"]
    reference = object()
    trainer.ref_model = reference if trl["beta"] else None
    lengths = x["completion_mask"].sum(1).tolist()
    eos = trainer.eos_token_ids[0]
    completions = [[7] * (n - 1) + [eos] for n in lengths]
    trainer._generate = lambda prompts: ([[5, 6]] * len(prompts), completions, ["c"] * len(prompts))
    trainer._get_per_token_logps_and_entropies = lambda model, *_, **__: (
        x["ref_per_token_logps"] if model is reference else x["old_per_token_logps"], None, None)
    trainer._calculate_rewards = lambda *_: _rewards(inputs["rewards"]).unsqueeze(1)
    trainer.model.train()
    rows = [{"prompt": "1+1="}] * RG
    out = trainer._generate_and_score_completions(rows)
    if not torch.equal(out["completion_mask"], x["completion_mask"]):
        raise AssertionError("the stubbed generation did not reproduce the recorded completion mask")
    return out["advantages"].to(D), {}


def rloo_ext(trl: dict):
    def run(inputs):
        from trl_ext.batches import RolloutBatch
        from trl_ext_plugins.advantages.rloo import RLOO, RLOOParams

        x = tensors({k: v for k, v in inputs.items() if k != "rewards"})
        rewards = _rewards(inputs["rewards"])
        mask = x["completion_mask"].to(D)
        batch = RolloutBatch(
            rewards_per_func=rewards.unsqueeze(-1), reward_names=["r"], reward_weights=torch.ones(1, dtype=D),
            num_generations=4, process_slice=slice(0, RG), completion_ids=torch.zeros(RG, RT, dtype=torch.long),
            completion_mask=mask, completion_lengths=mask.sum(-1), prompts=["p"] * RG, completions=[""] * RG,
            inputs=[{}] * RG, old_per_token_logps=x["old_per_token_logps"],
            ref_per_token_logps=x["ref_per_token_logps"])
        plugin = RLOO(RLOOParams(kl_coef=trl["beta"], normalize=trl["normalize_advantages"]))
        return plugin.trl_ext_compute_advantages(rewards=rewards, batch=batch).to(D), {}
    return run


def rloo_cases() -> list[Case]:
    out = []
    for beta, normalize in ((0.0, False), (0.0, True), (0.05, False), (0.05, True)):
        trl = {"beta": beta, "normalize_advantages": normalize, "num_generations": 4}
        out.append(Case(f"rloo/beta={beta}/normalize_advantages={normalize}/ext=rloo[kl_coef={beta}]", "rloo_advantages",
                        trl, rloo_inputs, run_trl_rloo, rloo_ext(trl), parity_rtol=1e-7 if beta else 1e-9,
                        note="the recorded 'loss' is the advantage vector (no gradient): TRL's RLOOTrainer builds it "
                             "in _generate_and_score_completions, run here with stubbed generation and log-probs"
                             + ("; trl-ext computes the reward KL in float32 (advantages/rollout.py), hence "
                                "parity_rtol 1e-7" if beta else "")))
    return out


# -- GRPO advantages: TRL GRPOTrainer._generate_and_score_completions vs the group_norm / reinforce plugins -----------

AG = 12  # 3 prompts x 4 completions


def advantage_inputs() -> dict:
    """Rewards of 3 groups of 4: one with an unscorable row (null), one of equal rewards (zero std), one with a large
    spread."""
    return {"rewards": [1.0, 0.0, None, 0.25, 0.5, 0.5, 0.5, 0.5, 40.0, -3.0, 0.125, 7.0]}


def grpo_trainer():
    return tiny_trl_trainer("grpo", per_device_train_batch_size=AG, max_completion_length=T)


def _stubbed_rollout(trainer, lengths, rewards, old_per_token_logps, sampling=None):
    """TRL GRPOTrainer._generate_and_score_completions with its generation (completions of ``lengths`` tokens ending in
    eos, the ``sampling`` log-probs a vLLM engine would return), log-prob passes (``old_per_token_logps``) and reward
    functions (``rewards``, None = unscorable) replaced."""
    eos = trainer.eos_token_ids[0]
    n = len(lengths)
    completions = [[7] * (k - 1) + [eos] for k in lengths]
    trainer._generate = lambda prompts: ([[5, 6]] * n, completions, None, ["c"] * n, sampling, {}, None, None)
    trainer._get_per_token_logps_and_entropies = lambda *_, **__: (old_per_token_logps, None, None)
    trainer._calculate_rewards = lambda *_: _rewards(rewards).unsqueeze(1)
    trainer.model.train()
    return trainer._generate_and_score_completions([{"prompt": "1+1="}] * n)


def run_trl_grpo_advantages(trl: dict, inputs: dict):
    """TRL's own advantage code (inside _generate_and_score_completions), generation and rewards stubbed."""
    trainer = grpo_trainer()
    trainer.scale_rewards = trl["scale_rewards"]
    out = _stubbed_rollout(trainer, [2] * AG, inputs["rewards"], torch.zeros(AG, 2, dtype=D))
    return out["advantages"].to(D), {}


def _advantage_batch(rewards: torch.Tensor, group: int):
    from trl_ext.batches import RolloutBatch

    n = rewards.shape[0]
    mask = torch.ones(n, 2, dtype=D)
    return RolloutBatch(
        rewards_per_func=rewards.unsqueeze(-1), reward_names=["r"], reward_weights=torch.ones(1, dtype=D),
        num_generations=group, process_slice=slice(0, n), completion_ids=torch.zeros(n, 2, dtype=torch.long),
        completion_mask=mask, completion_lengths=mask.sum(-1), prompts=["p"] * n, completions=[""] * n,
        inputs=[{}] * n)


def advantage_ext(plugin_fn: Callable):
    def run(inputs):
        rewards = _rewards(inputs["rewards"])
        return plugin_fn().trl_ext_compute_advantages(rewards=rewards, batch=_advantage_batch(rewards, 4)).to(D), {}
    return run


def grpo_advantage_cases() -> list[Case]:
    from trl_ext_plugins.advantages.group_norm import GroupNorm, GroupNormParams
    from trl_ext_plugins.advantages.reinforce_baseline import ReinforceBaseline

    note = ("the recorded 'loss' is the advantage vector (no gradient): TRL's GRPOTrainer builds it in "
            "_generate_and_score_completions, run here with stubbed generation and rewards")
    # TRL's trl.trainer.utils.nanstd computes Bessel's factor count / (count - 1) from integer tensors, i.e. in
    # float32 (4/3 -> 1.3333333730697632), so its std of a 4-row group is off by ~1.5e-8 relative; trl-ext's float64
    # std is exact, hence parity_rtol 1e-7 where a std divides.
    bessel = "; TRL's nanstd applies Bessel's factor in float32 (~1.5e-8 relative), trl-ext's std is exact float64"
    return [Case(f"grpo_advantages/scale_rewards={scale}/ext={name}", "grpo_advantages", {"scale_rewards": scale,
                                                                                         "num_generations": 4},
                 advantage_inputs, run_trl_grpo_advantages, advantage_ext(plugin),
                 parity_rtol=1e-9 if scale == "none" else 1e-7, note=note + ("" if scale == "none" else bessel))
            for scale, name, plugin in (
                ("group", "group_norm", lambda: GroupNorm()),
                ("batch", "group_norm[scale=batch]", lambda: GroupNorm(GroupNormParams(scale="batch"))),
                ("none", "group_norm[scale=none]", lambda: GroupNorm(GroupNormParams(scale="none"))),
                ("none", "reinforce_baseline[group_mean]", lambda: ReinforceBaseline()))]


def all_cases() -> list[Case]:
    return (grpo_cases() + preference_cases() + reward_cases() + distill_cases() + rloo_cases()
            + grpo_advantage_cases())
