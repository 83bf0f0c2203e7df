"""Corrections and objectives on a real ExtGRPOTrainer with the embedded tiny model (CPU, float32).

* ``rollout_logprobs`` records the sampling log-probs on the transformers path: they equal the log-softmax of the
  processed logits (temperature/top-k) recomputed by a forward pass, and a bfloat16 generation copy creates a real
  mismatch;
* TRL's own vLLM importance-sampling code (``_generate_and_score_completions`` with a stand-in for the vLLM engine)
  gives the same weights as ``tis`` / ``mis`` / ``icepop`` on the same sampling log-probs;
* a matrix objective x correction x aggregation runs the trainer's loss and backward on one generated batch, and one
  full ``trainer.train()`` step runs end to end;
* impossible combinations are refused at validation naming both plugins.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOConfig

from trl_ext.catalog import Catalog
from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.embedded.models import materialize_model
from trl_ext.errors import RecipeError
from trl_ext.host import PluginHost
from trl_ext.metrics import reduce_figures
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext.trainers.grpo import ExtGRPOTrainer
from trl_ext_plugins.corrections import PLUGINS as CORRECTIONS
from trl_ext_plugins.losses.aggregation import Aggregation
from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs

GEN = 8  # generation batch: 4 prompts x 2 completions


def length_reward(completions, **kwargs):
    """A reward that varies within groups even for the untrained model, so advantages (and gradients) are non-zero."""
    return [float(sum(map(ord, c)) % 3) for c in completions]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("corrections")
    model_dir = materialize_model("tiny-qwen2", root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args = GRPOConfig(output_dir=str(root / "out"), per_device_train_batch_size=GEN, num_generations=2,
                      max_completion_length=4, max_steps=1, bf16=False, use_cpu=True, report_to="none",
                      gradient_checkpointing=False, temperature=0.7, top_k=20, logging_steps=1, seed=0,
                      loss_type="grpo")
    t = ExtGRPOTrainer(model=str(model_dir), reward_funcs=[length_reward], args=args,
                       train_dataset=arithmetic_dataset("train", format="prompt", size=16),
                       processing_class=tokenizer,
                       plugin_host=PluginHost([RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))]))
    t.model.train()
    return t


def rows():
    data = arithmetic_dataset("train", format="prompt", size=16)
    return [data[i // 2] for i in range(GEN)]  # each prompt twice, as TRL's sampler repeats them


@pytest.fixture(scope="module")
def rollout(trainer):
    torch.manual_seed(0)
    return trainer._generate_and_score_completions(rows())


def test_sampling_logprobs_are_the_processed_logits_of_the_sampling_step(trainer, rollout):
    logps = rollout["sampling_per_token_logps"]
    mask = rollout["completion_mask"].bool()
    assert logps.shape == rollout["completion_ids"].shape and torch.isfinite(logps[mask]).all()
    # Recompute with the bfloat16 generation copy: log softmax(top_k(logits / T)) at the sampled tokens.
    plugin = trainer.plugin_host.get("rollout_logprobs")
    ids = torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1)
    attn = torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], 1)
    with torch.no_grad():
        logits = plugin._copy(input_ids=ids, attention_mask=attn).logits.float()
    P = rollout["prompt_ids"].size(1)
    logits = logits[:, P - 1:-1] / 0.7
    kth = logits.topk(20, dim=-1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    expected = torch.log_softmax(logits, -1).gather(-1, rollout["completion_ids"].unsqueeze(-1)).squeeze(-1)
    # bf16 KV-cache decoding vs one bf16 forward differ by rounding only
    assert torch.allclose(logps[mask], expected[mask], atol=0.1)
    # ... while the float32 trainer policy differs from the bf16 sampler: a real train/inference mismatch
    policy_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, rollout[
        "completion_ids"].size(1))
    diff = (policy_logps.detach() - logps)[mask].abs()
    assert diff.max() > 1e-4


def test_generation_copy_really_runs_in_bfloat16(trainer):
    # Regression: the trainer patches `forward` on the policy instance, so a deep copy kept running the float32
    # policy (its logits were bit-identical) and no mismatch existed. The copy must compute with its own weights.
    plugin = trainer.plugin_host.get("rollout_logprobs")
    copy_model = plugin._generation_model(trainer, trainer.accelerator.unwrap_model(trainer.model))
    assert next(copy_model.parameters()).dtype == torch.bfloat16
    ids = torch.tensor([[5, 6, 14, 7, 8, 18]])
    with torch.no_grad():
        low = torch.log_softmax(copy_model(ids).logits.float(), -1)
        full = torch.log_softmax(trainer.model(ids).logits.float(), -1)
    assert (low - full).abs().max() > 1e-3


@pytest.mark.parametrize("mode, lo, hi, plugin", [
    ("token_truncate", None, 2.0, "tis"), ("sequence_truncate", None, 2.0, "tis_seq"),
    ("token_mask", 0.5, 2.0, "mis"), ("sequence_mask", None, 2.0, "mis_seq"), ("token_mask", 0.5, 2.0, "icepop"),
])
def test_trl_vllm_importance_sampling_matches_plugin_weights(trainer, mode, lo, hi, plugin):
    from trl_ext_plugins.corrections.icepop import IcePop
    from trl_ext_plugins.corrections.mis import MIS
    from trl_ext_plugins.corrections.tis import TIS

    correction = {
        "tis": TIS(TIS.Params(upper=hi, lower=lo)), "tis_seq": TIS(TIS.Params(upper=hi, level="sequence")),
        "mis": MIS(MIS.Params(upper=hi, lower=lo)), "mis_seq": MIS(MIS.Params(upper=hi, lower=None, level="sequence")),
        "icepop": IcePop(IcePop.Params(beta=hi, lower=lo)),
    }[plugin]
    torch.manual_seed(1)
    engine = FakeVLLM(trainer)
    missing = object()
    saved = {k: getattr(trainer, k, missing) for k in ("use_vllm", "vllm_importance_sampling_correction",
                                              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                                              "vllm_importance_sampling_clip_max", "_last_loaded_step")}
    try:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        trainer.vllm_importance_sampling_mode = mode
        trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = lo, hi
        trainer.vllm_generation, trainer._last_loaded_step = engine, trainer.state.global_step
        trainer.plugin_host = PluginHost([])
        out = trainer._generate_and_score_completions(rows())
    finally:
        for k, v in saved.items():
            if v is missing:
                trainer.__dict__.pop(k, None)
            else:
                setattr(trainer, k, v)
        trainer.plugin_host = PluginHost([RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))])
        trainer.__dict__.pop("vllm_generation", None)
    from test_losses import make_inputs

    mask = (out["completion_mask"]).float()
    li = make_inputs(out["old_per_token_logps"].double(), old=out["old_per_token_logps"].double(), mask=mask,
                     rollout=out["sampling_per_token_logps"].double())
    ours = correction.trl_ext_token_weights(inputs=li).weight
    theirs = out["importance_sampling_ratio"].double()
    valid = mask.bool() if theirs.size(1) > 1 else torch.ones_like(theirs, dtype=torch.bool)
    assert torch.allclose(ours.expand_as(theirs)[valid], theirs[valid], atol=1e-6)
    assert 0 < reduce_figures(li.metrics)[f"{correction.name}/changed_fraction"] < 1 or theirs.size(1) == 1


class FakeVLLM:
    """Stands in for TRL's VLLMGeneration: samples from the policy and reports perturbed per-token log-probs."""

    def __init__(self, trainer):
        self.trainer = trainer

    def generate(self, prompts, images, num_generations, profiler=None):
        ids = [[int(t) for t in torch.randint(5, 20, (3,))] + [self.trainer.eos_token_ids[0]] for _ in prompts]
        logprobs = [[[float(-1.0 - 7.0 * torch.rand(()))] for _ in seq] for seq in ids]  # ratios on both sides of 1
        return None, ids, logprobs, None


def test_rollout_logprobs_refuses_vllm():
    msgs = RolloutLogprobs().trl_ext_validate_stage(stage=StageSpec(trainer="grpo", model="m", dataset="d",
                                                                    args={"use_vllm": True}), plugins=[])
    assert msgs and "use_vllm" in msgs[0]


OBJECTIVES = ["grpo", "dr_grpo", "dapo", "gspo", "gmpo", "sapo", "cispo", "ce_gppo", "clip_higher", "reinforce"]
MATRIX = [
    # (objective, correction, aggregation mode): every objective, correction and mode at least once
    ("grpo", "icepop", None), ("dr_grpo", "tis", "token-mean"), ("dapo", "mis", None),
    ("gspo", "icepop", "seq-mean-token-mean"), ("gmpo", "tis", None), ("sapo", "m2po", "batch-token-mean"),
    ("cispo", "icepop", "seq-mean-token-sum-norm"), ("ce_gppo", "mis", "token-mean"), ("clip_higher", "m2po", None),
    ("reinforce", "tis", "seq-mean-token-mean"), ("rollout_ratio", "m2po", "token-mean"), ("grpo", None, None),
]


@pytest.mark.parametrize("objective, correction, mode", MATRIX)
def test_composition_matrix_loss_and_gradients(trainer, rollout, objective, correction, mode):
    catalog = Catalog.discover()
    names = [objective] + ([correction] if correction else [])
    plugins = [catalog.resolve(n).cls() for n in names]
    if mode:
        plugins.append(Aggregation(Aggregation.Params(mode=mode)))
    trainer.plugin_host = PluginHost(plugins)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); the matrix calls compute_loss directly
    trainer.model.zero_grad()
    try:
        micro = {k: (v[:4] if isinstance(v, torch.Tensor) and v.dim() and v.size(0) == GEN else v)
                 for k, v in rollout.items()}
        loss = trainer.compute_loss(trainer.model, micro)
        loss.backward()
    finally:
        trainer.plugin_host = PluginHost([RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))])
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
    assert rollout["advantages"][:4].abs().sum() > 0


# Runs before the validation tests below: building a TRL config there resets accelerate's state, which this
# module-scoped trainer needs.
def test_one_full_training_step(trainer):
    trainer.plugin_host = PluginHost([RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16")),
                                      *[c() for c in CORRECTIONS if c.name == "tis"]])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        result = trainer.train()
    finally:
        trainer.plugin_host = PluginHost([RolloutLogprobs(RolloutLogprobs.Params(dtype="bfloat16"))])
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"tis/logp_diff/mean", "tis/weight/min", "tis/changed_fraction"} <= logged


def stage(*plugins, **args):
    return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                     plugins=list(plugins), args=args)


@pytest.mark.parametrize("plugins, args, both", [
    (["grpo", "dapo", "exact_match"], {}, ("grpo", "dapo")),
    (["rollout_ratio", "tis", "rollout_logprobs", "exact_match"], {}, ("rollout_ratio", "tis")),
    (["rollout_ratio", "gspo", "rollout_logprobs", "exact_match"], {}, ("rollout_ratio", "gspo")),
    (["grpo", "icepop", "exact_match"], {}, ("icepop", "sampling_logprobs")),
    (["dapo", "exact_match"], {"epsilon_high": 0.2}, ("dapo", "epsilon_high")),
    (["grpo", "tis", "rollout_logprobs", "exact_match"], {"use_vllm": True}, ("rollout_logprobs", "use_vllm")),
])
def test_impossible_combinations_rejected_naming_both(plugins, args, both):
    with pytest.raises(RecipeError) as info:
        resolve_stage(stage(*plugins, **args), 0, Catalog.discover())
    text = str(info.value)
    assert all(name in text for name in both), text


def test_valid_combination_resolves_with_plugin_args():
    rs = resolve_stage(stage("dapo", "icepop", "rollout_logprobs", {"aggregation": {"mode": "seq-mean-token-mean"}},
                             "exact_match"), 0, Catalog.discover())
    assert rs.args["epsilon_high"] == 0.28 and rs.args["loss_type"] == "dapo"
    assert rs.args["vllm_importance_sampling_correction"] is False
