"""The trl-ext hook specification: the whole contract between the host and its plugins.

Every hook is prefixed ``trl_ext_``. Hooks come in two kinds, told apart by who implements them:

* **Registration hooks** are implemented by the *object an entry point of the* ``trl_ext`` *group loads* (a module
  or a class). They run once when the plugin catalog is built, on every rank, before any recipe is read. They
  receive a ``register`` callable; the host owns duplicate and alias policy and names both sides of a clash.

* **Run hooks** are implemented by :class:`trl_ext.plugin.Plugin` subclasses. The host instantiates only the plugins a
  recipe stage selects (with their validated parameters) and registers them, in recipe order, on a plugin manager
  built for that stage. Every rank builds the same manager from the same recipe, so every rank calls the same
  hooks in the same order (hooks that run collectives must rely on that).

Result conventions, chosen per hook and stated in each docstring:

* *selection* hooks are ``firstresult=True``: they fill an exclusive slot (a plugin implementing one must declare
  the slot, and the recipe validator refuses two plugins claiming one slot), and ``None`` means "the host's default,
  which is TRL's behaviour";
* *composition* hooks return one value per plugin and the host combines them in a documented order (weights
  multiply, masks AND, extra loss terms add, lists concatenate, pipeline hooks chain in recipe order);
* ``None`` from a composition hook means "no contribution".

Hooks are grouped by phase, in the order a stage runs them: registration, validation and configuration, data,
trainer construction, rollout (GRPO family), loss, preference loss, after the stage. Each says since which trl-ext
version it exists. Reference documentation is generated from these docstrings (``docs/hooks.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # only for annotations; keeps `import trl_ext` light
    import torch
    from datasets import Dataset

    from trl_ext.batches import LossInputs, PreferenceInputs, RolloutBatch, TokenWeights
    from trl_ext.recipe import StageSpec

PROJECT = "trl_ext"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------------------------------
# Registration (implemented by entry-point objects; run once per process when the catalog is built)
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_register_plugins(register: Callable[[type], None]) -> None:
    """Register selectable plugin classes.

    Called once per process when the catalog is built, on every rank. Call ``register(PluginClass)`` for each
    :class:`trl_ext.plugin.Plugin` subclass the distribution provides; the class's ``name`` and ``aliases`` become
    selectable in recipes. Registering a name (or alias) that another plugin already holds raises
    :class:`trl_ext.errors.PluginConflictError` naming both plugins and their distributions.

    Returns nothing. Since 0.1.
    """


@hookspec
def trl_ext_register_models(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register named models that recipes can use as ``model: embedded:<name>``.

    Called once per process when the catalog is built. Call ``register(name, materialize)`` where
    ``materialize(directory: pathlib.Path, seed: int) -> pathlib.Path`` writes an ordinary Hugging Face model folder
    (weights, config, tokenizer) into ``directory`` and returns it. It must be deterministic in ``seed`` and must not
    download anything. Only the main process materializes; the others wait and read the folder.

    Returns nothing. Since 0.1.
    """


@hookspec
def trl_ext_register_datasets(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register named datasets that recipes can use as ``dataset: {source: embedded:<name>, ...}``.

    Called once per process when the catalog is built. Call ``register(name, build)`` where
    ``build(split: str, **params) -> datasets.Dataset`` builds the split offline and deterministically; ``params``
    are the recipe's ``dataset.params`` mapping.

    Returns nothing. Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# Validation and configuration (before any model is loaded)
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_validate_stage(stage: StageSpec, plugins: list[Any]) -> list[str] | None:
    """Check a stage for combinations the schema alone cannot see.

    Called by ``trl-ext validate`` and before a stage starts, on every rank, before any model is loaded, with the
    parsed stage and the instantiated plugins selected for it (in recipe order). Return a list of error messages
    (each should name the plugin and the field at fault), or ``None``/``[]`` when the stage is fine.

    Composition: all messages from all plugins are collected and reported together. Since 0.1.
    """


@hookspec
def trl_ext_configure_args(trainer: str, args: dict[str, Any]) -> dict[str, Any] | None:
    """Return TRL config fields this plugin needs set before the TRL config object is built.

    Called once per stage on every rank, before validation of the TRL config, with the trainer name (``"grpo"``,
    ``"dpo"``, ...) and a read-only copy of the recipe's ``args``. Return a mapping of field -> value (for example
    ``{"importance_sampling_level": "sequence"}``), or ``None`` for no change.

    Composition: the mappings are merged. Two plugins setting one field to different values is a recipe error naming
    both; a plugin setting a field the recipe sets explicitly to another value is an error naming the field and the
    plugin (the recipe is never silently overridden). Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_prepare_dataset(dataset: Dataset, split: str, stage: StageSpec) -> Dataset | None:
    """Transform (filter, re-order, augment, build pairs) a dataset before the trainer sees it.

    Called once per stage and split (``"train"``, ``"eval"``) on every rank, after the dataset is loaded and before
    the trainer is built. Return the new dataset, or ``None`` to leave it unchanged. Must be deterministic (every
    rank must end with the same rows).

    Composition: a pipeline, in recipe order; each plugin sees the previous plugin's output. Since 0.1.
    """


@hookspec
def trl_ext_reward_functions(stage: StageSpec) -> list[Any] | None:
    """Return reward functions for RL trainers (GRPO, RLOO).

    Called once per stage on every rank, before the trainer is built. Return a list of
    :class:`trl_ext.rewards.RewardFunction` (name, callable following TRL's reward-function contract, weight), or
    ``None``. A reward callable may return ``None`` for rows it does not apply to (TRL then ignores it for that row).

    Composition: lists concatenate in recipe order; weights become TRL's ``reward_weights`` (weighted sum). Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# Trainer construction
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_trainer_kwargs(stage: StageSpec, tokenizer: Any) -> dict[str, Any] | None:
    """Return extra keyword arguments for the TRL trainer's constructor (e.g. GRPO's ``environment_factory``).

    Called once per stage on every rank, after the datasets are prepared and the tokenizer is loaded, and before the
    trainer (and so the model) is built, with the stage and its tokenizer (so a plugin can refuse a tokenizer that
    cannot do what its arguments need, before any model loads). Return a mapping of constructor argument -> value, or
    ``None``. Only arguments the stage's TRL trainer class accepts make sense; the trainer kinds pass them through.

    Composition: the mappings are merged; two plugins returning the same argument is an error naming both. Since 0.2.
    """


@hookspec
def trl_ext_trainer_created(trainer: Any) -> None:
    """React to the trainer having been built (add callbacks, wrap or freeze modules, cache references).

    Called once per stage on every rank, right after the trl-ext trainer subclass is constructed and before
    training starts. Returns nothing; side effects only. Since 0.1.
    """


@hookspec(firstresult=True)
def trl_ext_train_sampler(trainer: Any, dataset: Dataset) -> Any:
    """Supply the sampler of the training dataloader (slot ``train_sampler``).

    Called by the GRPO and RLOO trainers on every rank when the training dataloader is built (at the start of
    ``train()``, after ``trl_ext_trainer_created``), with the trainer and the (map-style) train dataset. Return a
    ``torch.utils.data.Sampler`` of row indices, or ``None`` for TRL's ``RepeatSampler``. The sampler must keep
    RepeatSampler's structure (``trainer.num_generations`` copies of each prompt in a row; chunks of
    ``generation_batch_size // num_generations`` prompts, each emitted ``num_iterations * steps_per_generation`` times;
    only whole chunks), must yield the same indices on every rank (accelerate splits the stream across ranks) and must
    have a fixed ``len`` (the trainer derives its epoch length and resume offsets from it). The dataloader fetches one
    batch ahead, so a sampler drawing lazily should say which batches a change can still reach.

    Selection: first non-``None`` result wins; at most one plugin may claim the ``train_sampler`` slot. Since 0.2.
    """


# --------------------------------------------------------------------------------------------------------------------
# Rollout (GRPO family). All tensors here are gathered across ranks unless said otherwise.
# --------------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def trl_ext_generate(trainer: Any, prompts: list[Any], generate: Callable[[list[Any]], tuple]) -> tuple | None:
    """Produce completions for a batch of prompts (slot ``generation``).

    Called on every rank each time the GRPO trainer generates, with this rank's prompts (already repeated
    ``num_generations`` times) and ``generate``, TRL's own generation (``GRPOTrainer._generate``). Return exactly what
    ``generate`` returns (TRL's 8-tuple: prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields,
    images, tool_images), typically by calling ``generate`` and adjusting, or ``None`` for TRL's generation.

    The distillation trainer calls it too, with ``generate`` = ``DistillationTrainer._generate``, whose result is a
    5-tuple (prompt_ids, completion_ids, tool_mask, images, tool_images); there ``trainer.generation_rows`` holds the
    dataset rows of the prompts (e.g. for off-policy completions).

    Selection: first non-``None`` result wins; at most one plugin may claim the ``generation`` slot. Since 0.1.
    """


@hookspec
def trl_ext_model_forward(trainer: Any, model: Any, phase: str, inputs: dict[str, Any]) -> Any:
    """Wrap one pass of the policy (or reference) model in a context manager (e.g. MoE routing capture and replay).

    Called by the GRPO trainer on every rank just before the pass; the returned context is entered around it:

    * ``phase="generate"``: around the rollout generation of a batch (including ``trl_ext_generate``), with
      ``model = trainer.model`` and ``inputs = {"prompts": prompts}``; before the context exits the host sets
      ``inputs["output"]`` to the generation result (TRL's 8-tuple, see ``trl_ext_generate``).
    * ``phase="old_policy"`` / ``phase="reference"``: around TRL's no-grad log-prob forward of the whole generation
      batch with the policy at sampling time, or with the reference (``trainer.ref_model``, or the policy with its PEFT
      adapter disabled / its ``ref`` adapter active). ``inputs`` holds ``input_ids`` and ``attention_mask``
      ``(B, P + C)`` (prompt left-padded, completion right-padded), ``logits_to_keep`` and ``batch_size``: TRL calls
      the model on consecutive chunks of ``batch_size`` rows, in order.
    * ``phase="train"``: around the loss of one micro-batch (``_compute_loss``, in training and evaluation), with the
      micro-batch dict TRL's loss receives as ``inputs`` (``prompt_ids``, ``completion_ids``, masks, and the keys of
      ``RolloutBatch.loss_extras``, split and shuffled with the rows). The backward pass, and any
      gradient-checkpointing recomputation, run after the context has exited.

    Return a context manager, or ``None`` for nothing. ``model`` is the (possibly wrapped) model of the pass.

    Composition: every returned context is entered, in recipe order, and exited in reverse. Since 0.1.
    """


@hookspec
def trl_ext_shape_rewards(rewards_per_func: torch.Tensor, batch: RolloutBatch) -> torch.Tensor | None:
    """Reshape rewards before advantages are computed (length shaping, per-group bonuses, clipping).

    Called on every rank after TRL has scored the completions, with the gathered ``rewards_per_func`` of shape
    ``(N_global, n_reward_functions)`` (NaN where a function did not apply) and the rollout batch. Return a tensor of
    the same shape, or ``None`` for no change. ``batch.reward_names`` names the columns.

    Composition: a pipeline, in recipe order. Since 0.1.
    """


@hookspec
def trl_ext_filter_groups(rewards: torch.Tensor, batch: RolloutBatch) -> torch.Tensor | None:
    """Say which samples keep a learning signal (e.g. drop groups whose rewards all agree).

    Called on every rank after reward shaping with the gathered total rewards ``(N_global,)``. Return a bool tensor
    ``(N_global,)`` (``True`` = keep), or ``None`` to keep everything. Dropped samples get zero advantage and zero
    loss weight; they count in no denominator: their completion mask is zeroed (token counts), and aggregations that
    divide by the row count (``grpo``, ``sapo``, ``dr_grpo``, the ``seq-mean-*`` modes) divide by the kept share of
    it (``LossInputs.kept_row_fraction``), as if the rows had been removed from the batch.

    Composition: the masks are AND-ed. Since 0.1.
    """


@hookspec(firstresult=True)
def trl_ext_refill_groups(trainer: Any, inputs: list[dict[str, Any]],
                          score: Callable[[list[dict[str, Any]]], tuple]) -> dict[str, Any] | None:
    """Build the scored generation batch from one or more generation rounds (slot ``refill``).

    Called on every rank, in training only, once per generation batch, in place of the single round the host would
    run, with this rank's generation batch ``inputs`` (dataset rows, each prompt repeated ``num_generations`` times)
    and ``score``. ``score(rows)`` runs one round on this rank's ``rows`` (same length and layout as ``inputs``):
    TRL's generation and rewards plus the rollout hooks above, and returns ``(output, keep)``: ``output`` is the
    dict TRL's ``_generate_and_score_completions`` returns for this rank (filtered samples already masked), ``keep``
    the gathered bool ``(N_global,)`` mask of samples that passed ``trl_ext_filter_groups`` (``None`` when no
    plugin filters). ``score`` runs collectives: every rank must call it the same number of times, so decide the
    number of rounds from gathered values only (``keep`` is). Return a dict with the same keys and this rank's
    batch size as ``output``, or ``None`` (without having called ``score``) for the host's single round.

    Selection: first non-``None`` result wins; at most one plugin may claim the ``refill`` slot. Since 0.1.
    """


@hookspec(firstresult=True)
def trl_ext_compute_advantages(rewards: torch.Tensor, batch: RolloutBatch) -> torch.Tensor | None:
    """Turn rewards into advantages (slot ``advantage``).

    Called on every rank after reward shaping and group filtering, with the gathered total rewards ``(N_global,)``
    (reward functions already weighted and summed, NaN for unscorable rows) and the rollout batch. Return this
    rank's advantages, shape ``(B_local,)`` (one per sequence) or ``(B_local, T)`` (per token); use
    ``batch.process_slice`` to cut a globally computed tensor. Advantages are treated as constants (detached).

    Filtered rows: ``batch.keep`` is the gathered bool ``(N_global,)`` mask of rows ``trl_ext_filter_groups`` kept
    (``None`` when nothing filters). Filtered rows are still in ``rewards`` and in the token tensors (the host zeroes
    their advantages and completion mask afterwards), so a statistic over the whole batch (global whitening, a batch
    mean, std or running baseline, an advantage metric) must use only the kept rows, as if the filtered ones had been
    removed (verl and slime remove them before computing advantages). Per-group statistics are unaffected by
    filters that drop whole groups.

    Selection: first non-``None`` result wins; ``None`` keeps TRL's group-normalised advantage (TRL computes it
    before the filters run; when rows are filtered the host recomputes TRL's formula without them, so
    ``scale_rewards="batch"`` and ``normalize_then_sum`` take their batch statistics over the kept rows). Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# Loss (GRPO family). Called once per micro-batch, on every rank, with this rank's tensors.
# --------------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def trl_ext_policy_loss(inputs: LossInputs) -> torch.Tensor | None:
    """Return the per-token policy loss, shape ``(B, T)`` or ``(B, 1)`` (slot ``objective``).

    Called once per micro-batch on every rank. ``inputs`` carries the current, old, sampling and reference per-token
    log-probs, the advantages, the loss mask and
    the trainer's clip settings. Return a tensor to be minimised, or ``None`` for TRL's own objective
    (``GRPOConfig.loss_type``). Masking and aggregation happen later; do not apply the mask here.

    Selection: first non-``None`` result wins. Since 0.1.
    """


@hookspec
def trl_ext_token_weights(inputs: LossInputs) -> TokenWeights | None:
    """Return per-token weights and/or a mask for the policy loss (importance corrections, masking schemes).

    Called once per micro-batch on every rank, after the objective. Return :class:`trl_ext.batches.TokenWeights` (``weight`` multiplies the per-token loss
    and must be detached; ``mask`` removes tokens from the loss *and from the aggregation denominator*), or ``None``.

    Composition: weights multiply, masks AND, in recipe order. Since 0.1.
    """


@hookspec(firstresult=True)
def trl_ext_aggregate_loss(per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: LossInputs) -> torch.Tensor | None:
    """Reduce the per-token loss to the scalar that is back-propagated (slot ``aggregation``).

    Called once per micro-batch on every rank, after weights and the KL term are applied. ``mask`` is the final
    loss mask. The returned scalar must already
    account for gradient accumulation (``inputs.grad_accum_steps`` and ``inputs.num_items_in_batch`` are provided),
    because trl-ext, like TRL's GRPO trainer, scales the loss itself. Return ``None`` for TRL's aggregation for the
    configured ``loss_type``; whether it is ``None`` must follow from the plugin's configuration, not the batch (the SFT
    trainer asks once, with a one-token probe, and then keeps TRL's own loss path).

    Selection: first non-``None`` result wins. Also used by the SFT trainer, where ``per_token_loss`` is the token NLL.
    Since 0.1.
    """


@hookspec
def trl_ext_extra_loss(inputs: LossInputs) -> torch.Tensor | None:
    """Return an extra scalar loss term (positive-example NLL, value loss, auxiliary penalties).

    Called once per micro-batch on every rank, after aggregation. The term must already account for gradient
    accumulation like the aggregated loss does. Return ``None`` for no term.

    Composition: terms add. Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# Preference loss (DPO / KTO trainers)
# --------------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def trl_ext_preference_loss(inputs: PreferenceInputs) -> torch.Tensor | None:
    """Return the per-example preference loss, shape ``(B,)`` (slot ``preference_loss``).

    Called once per micro-batch on every rank with the chosen/rejected summed and mean log-probs of the policy, those
    of the reference when a selected plugin declares the ``reference`` need, token counts and any extra dataset columns.
    The host takes the mean over the batch. Return ``None`` for TRL's own ``loss_type``.

    Selection: first non-``None`` result wins. Since 0.1.
    """


# --------------------------------------------------------------------------------------------------------------------
# After the stage
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def trl_ext_after_stage(stage: StageSpec, output_dir: str, trainer: Any) -> dict[str, Any] | None:
    """Post-process a finished stage (average checkpoints, merge, retrain heads, export).

    Called on every rank after training and after the model was saved to ``output_dir`` (an ordinary Hugging Face
    model folder, which the plugin may overwrite on the main process), before the stage is marked complete. Return
    a mapping of summary figures to record in the stage's summary, or ``None``.

    Composition: mappings merge in recipe order. Since 0.1.
    """
