"""mtp_heads / the mtp trainer (ALGORITHMS.md item 54): losses against hand-computed numbers, the trunk frozen bit for
bit, heads saved where transformers' generate(use_mtp=True) finds them, training inputs aligned with transformers'
drafting, and refusal of model classes without MTP support."""

import math

import pytest
import torch
from datasets import Dataset

from trl_ext.host import PluginHost
from trl_ext.recipe import StageSpec
from trl_ext.testing import check_plugin_conformance
from trl_ext.trainers.mtp import (
    ExtMtpTrainer,
    MtpConfig,
    ZERO3_REFUSAL,
    MtpSupportError,
    check_stage,
    depth_outputs,
    draft_target_mask,
    hard_cross_entropy,
    mtp_support_problem,
    soft_cross_entropy,
    trunk_forward,
)
from trl_ext_plugins.mtp.acceptance import measure_acceptance, summarize
from trl_ext_plugins.mtp.mtp_heads import MtpHeads

LN = math.log

# ----------------------------------------------------------------------------------------------------------------------
# Losses: numbers from the formulas, written out by hand
# ----------------------------------------------------------------------------------------------------------------------


def test_soft_cross_entropy_matches_hand_computed_value():
    # Position 0: p = (1/2, 1/4, 1/4), q = (1/4, 1/2, 1/4): -(1/2 ln 1/4 + 1/4 ln 1/2 + 1/4 ln 1/4) = 1.2130076.
    # Position 1: p = (1/2, 0, 1/2) (a -inf target logit), q = (1/2, 0, 1/2) (a -inf draft logit): ln 2 = 0.6931472;
    # 0 * log 0 must count as 0, not NaN. Position 2 is masked out and holds an infinite logit.
    target = torch.tensor([[[LN(.5), LN(.25), LN(.25)], [0.0, -math.inf, 0.0], [math.inf, 0.0, 0.0]]])
    draft = torch.tensor([[[LN(.25), LN(.5), LN(.25)], [0.0, -math.inf, 0.0], [0.0, 0.0, -math.inf]]],
                         requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss = soft_cross_entropy(draft, target, mask)
    assert loss.item() == pytest.approx((1.2130076 + 0.6931472) / 2, abs=1e-6)
    loss.backward()
    # d/d draft_logits of the mean soft CE = (q - p) / (number of counted positions); the masked position gets 0.
    assert torch.allclose(draft.grad[0, 0], torch.tensor([0.25 - 0.5, 0.5 - 0.25, 0.0]) / 2, atol=1e-6)
    assert torch.equal(draft.grad[0, 2], torch.zeros(3))
    assert torch.isfinite(draft.grad).all()


def test_soft_target_is_detached():
    target = torch.tensor([[[1.0, 2.0, 3.0]]], requires_grad=True)
    soft_cross_entropy(torch.zeros(1, 1, 3, requires_grad=True), target, torch.tensor([[True]])).backward()
    assert target.grad is None


def test_hard_cross_entropy_matches_hand_computed_value():
    # q = (1/4, 1/2, 1/4), label 1: -ln 1/2 = 0.6931472; second position masked with an out-of-range label.
    draft = torch.tensor([[[LN(.25), LN(.5), LN(.25)], [0.0, 0.0, 0.0]]])
    loss = hard_cross_entropy(draft, torch.tensor([[1, 99]]), torch.tensor([[True, False]]))
    assert loss.item() == pytest.approx(0.6931472, abs=1e-6)


def test_nothing_counted_gives_zero_not_nan():
    draft = torch.zeros(1, 2, 3)
    none = torch.zeros(1, 2, dtype=torch.bool)
    assert soft_cross_entropy(draft, draft, none).item() == 0.0
    assert hard_cross_entropy(draft, torch.zeros(1, 2, dtype=torch.long), none).item() == 0.0


def test_counted_positions_are_the_drafted_ones():
    # Prompt of 2 tokens, 3 completion tokens (length 5): t = 2 (predicting the 2nd completion token) and t = 3
    # (predicting the 3rd); t = 1 predicts the first completion token (the trunk's own), t = 4 has no next token.
    mask = draft_target_mask(torch.tensor([2]), torch.tensor([5]), width=6)
    assert mask.tolist() == [[False, False, True, True, False, False]]


def test_acceptance_without_drafted_steps_is_undefined_not_zero():
    """No step carried a draft (e.g. every decode ended after the prefill): the ratios are None, not 0.0 (which reads as
    "every draft rejected"; tokens_per_step 0 is impossible), and they stay null in JSON."""
    import json

    figures = summarize([(0, 0), (0, 0)], prompts=2)
    assert (figures.acceptance_length, figures.acceptance_rate, figures.tokens_per_step) == (None, None, None)
    assert (figures.steps, figures.drafted, figures.accepted, figures.prompts) == (0, 0, 0, 2)
    assert json.loads(json.dumps(figures.as_dict()))["acceptance_rate"] is None
    rejected = summarize([(0, 0), (1, 0)], prompts=1)  # one drafted step, rejected: a real 0
    assert (rejected.acceptance_length, rejected.acceptance_rate, rejected.tokens_per_step) == (0.0, 0.0, 1.0)


def test_acceptance_plot_and_summary_take_undefined_figures(tmp_path):
    from types import SimpleNamespace

    from trl_ext_plugins.mtp.acceptance import plot_acceptance
    from trl_ext_plugins.mtp.mtp_heads import MtpHeadsParams

    figures = {"before": summarize([(0, 0)], 1), "after": summarize([(1, 1)], 1)}
    assert plot_acceptance(figures, tmp_path / "a.png", "t").stat().st_size > 0
    assert plot_acceptance({"only": figures["before"]}, tmp_path / "b.png", "t").stat().st_size > 0

    # trl_ext_after_stage's summary for a stage whose "before" measurement drafted nothing
    plugin = MtpHeads(MtpHeadsParams(held_out={"source": "embedded:arithmetic"}))
    plugin._figures = {"before": figures["before"]}
    plugin._held_out_prompts = lambda ctx: ["1+1="]
    plugin._measure = lambda folder, prompts, seed: figures["after"]
    summary = plugin.trl_ext_after_stage(_stage("embedded:tiny-glm4-moe-mtp"), str(tmp_path),
                                         SimpleNamespace(args=SimpleNamespace(seed=0)))
    assert summary["mtp_acceptance_before"] is None and summary["mtp_acceptance_rate_before"] is None
    assert summary["mtp_acceptance_after"] == 1.0 and summary["mtp_acceptance_rate_after"] == 1.0


@pytest.mark.parametrize("tokens", [1, 2])
def test_acceptance_budget_that_can_never_draft_is_refused(tokens):
    from trl_ext_plugins.mtp.mtp_heads import MtpHeadsParams

    with pytest.raises(Exception, match="acceptance_max_new_tokens"):
        MtpHeadsParams(held_out={"source": "embedded:arithmetic"}, acceptance_max_new_tokens=tokens)
    MtpHeadsParams(held_out={"source": "embedded:arithmetic"}, acceptance_max_new_tokens=3)


def test_acceptance_summary_skips_prefill_steps():
    figures = summarize([(0, 0), (1, 1), (1, 0), (1, 1)], prompts=1)
    assert figures.acceptance_length == pytest.approx(2 / 3)
    assert figures.acceptance_rate == pytest.approx(2 / 3)
    assert figures.tokens_per_step == pytest.approx(5 / 3)
    assert (figures.steps, figures.drafted, figures.accepted) == (3, 3, 2)


# ----------------------------------------------------------------------------------------------------------------------
# The model side: on the embedded GLM-4-MoE-shaped model with one MTP layer
# ----------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from trl_ext.embedded.models import materialize_model

    return str(materialize_model("tiny-glm4-moe-mtp", tmp_path_factory.mktemp("mtp") / "model", seed=0))


def _trainer(model_dir, out, loss="soft", steps=1):
    from transformers import AutoTokenizer

    rows = Dataset.from_dict({"prompt": ["12+3=", "4+5=", "30+41=", "7+8="] * 2,
                              "completion": ["15<eos>", "9<eos>", "71<eos>", "15<eos>"] * 2})
    args = MtpConfig(output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
                     report_to="none", save_strategy="no", logging_steps=1, mtp_loss=loss, seed=0)
    return ExtMtpTrainer(model_dir, args, rows, AutoTokenizer.from_pretrained(model_dir), plugin_host=PluginHost())


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """One soft-loss step from fresh heads; snapshots of trunk and heads before it; the saved folder after it."""
    out = tmp_path_factory.mktemp("mtp_out")
    trainer = _trainer(model_dir, out / "ckpt")
    trunk = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in trainer.policy.named_buffers()}
    heads = {n: p.detach().clone() for n, p in trainer.head_parameters().items()}
    trainer.train()
    trainer.save_model(str(out / "saved"))
    return trainer, trunk, buffers, heads, str(out / "saved")


def test_fresh_heads_use_the_family_initialisation(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path)
    heads = trainer.head_parameters()
    assert all(torch.isfinite(p).all() for p in heads.values())
    std = trainer.policy.config.initializer_range
    # Glm4MoePreTrainedModel._init_weights draws experts and router from N(0, initializer_range); MtpModel's generic
    # init would leave the expert tensors as torch.empty.
    for name in ("layers.0.mtp_block.mlp.experts.gate_up_proj", "layers.0.mtp_block.mlp.gate.weight"):
        assert heads[name].std().item() == pytest.approx(std, rel=0.2)
    bias = dict(trainer.heads.named_buffers())["layers.0.mtp_block.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, torch.zeros_like(bias))


def test_one_step_changes_every_head_parameter_and_no_trunk_parameter(trained):
    trainer, trunk, buffers, heads, _ = trained
    for name, param in trainer.policy.named_parameters():  # embeddings, layers, final norm, tied LM head
        assert torch.equal(param, trunk[name]), name
        assert not param.requires_grad, name
    for name, buffer in trainer.policy.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    after = trainer.head_parameters()
    assert set(after) == set(heads) and len(heads) == 16
    for name, param in after.items():
        assert not torch.equal(param, heads[name]), f"head parameter {name} did not change"


def test_saved_checkpoint_reloads_through_transformers_with_the_heads(trained):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    trainer, trunk, _, _, saved = trained
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    for name, param in model.named_parameters():
        assert torch.equal(param, trunk[name]), name
    loaded = dict(MtpModel.from_pretrained(model).named_parameters())  # what MTPCandidateGenerator loads
    for name, param in trainer.head_parameters().items():
        assert torch.equal(loaded[name], param), name
    ids = torch.tensor([[5, 6, 14, 7, 18]])
    spec = model.generate(ids, use_mtp=True, do_sample=False, max_new_tokens=6)
    plain = model.generate(ids, do_sample=False, max_new_tokens=6)
    assert torch.equal(spec, plain)  # greedy speculative decoding is lossless


def test_generate_use_mtp_drafts_with_the_saved_heads(trained):
    figures = measure_acceptance(trained[4], ["12+3=", "4+5="], max_new_tokens=4)
    assert figures.steps > 0 and figures.drafted == figures.steps  # one MTP layer: one draft per step
    assert 0 <= figures.accepted <= figures.drafted


def test_a_draft_the_trunk_always_agrees_with_scores_full_acceptance_at_any_budget(trained, tmp_path):
    """With every output head zeroed all logits tie, so trunk and MTP head both pick token 0 and every draft that fits
    is accepted: rate 1 and length 1 whatever max_new_tokens is. transformers drafts one token even when only the
    trunk's token fits before max_length, then crops it; counting that draft as rejected gave 0.5 at 4 new tokens."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = tmp_path / "agree"
    shutil.copytree(trained[4], folder)
    assert AutoTokenizer.from_pretrained(folder).eos_token_id != 0
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(str(shard))
        tensors = {k: torch.zeros_like(v) if ("embed_tokens" in k or "head" in k) else v for k, v in tensors.items()}
        save_file(tensors, str(shard), metadata={"format": "pt"})
    for new_tokens in (4, 5, 8):
        figures = measure_acceptance(folder, ["12+3="], max_new_tokens=new_tokens)
        assert figures.drafted > 0, new_tokens
        assert (figures.acceptance_rate, figures.acceptance_length) == (1.0, 1.0), (new_tokens, figures)


@pytest.mark.parametrize("min_new_tokens, expected_drafted", [(1, 0), (3, 1), (4, 2)])
def test_an_eos_drafted_and_accepted_is_not_counted_as_a_rejection(trained, tmp_path, min_new_tokens,
                                                                    expected_drafted):
    """Every logit tied (output heads zeroed): trunk and MTP head both pick token 0, made the eos here and kept out of
    the first ``min_new_tokens`` tokens. When the eos comes as a draft the trunk verifies, transformers crops the step
    at it and reports num_matches 0; counting that draft as drafted-and-rejected gave acceptance 0.0 (min_new_tokens
    1) and 0.5 (3) for a draft that always equals the trunk's choice."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "agree_eos"
    shutil.copytree(trained[4], folder)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(str(shard))
        tensors = {k: torch.zeros_like(v) if ("embed_tokens" in k or "head" in k) else v for k, v in tensors.items()}
        save_file(tensors, str(shard), metadata={"format": "pt"})
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update({"eos_token_id": 0, "min_new_tokens": min_new_tokens})
    config_path.write_text(json.dumps(config))
    figures = measure_acceptance(folder, ["12+3="], max_new_tokens=8)
    assert (figures.drafted, figures.accepted) == (expected_drafted, expected_drafted), figures
    if expected_drafted:
        assert (figures.acceptance_rate, figures.acceptance_length) == (1.0, 1.0), figures


def test_teacher_forced_depth_logits_equal_transformers_drafts(trained):
    """The training forward feeds the MTP layer the inputs transformers' drafting loop gives it: each logit vector
    transformers drafts during generate(use_mtp=True) equals the trainer's at the same position."""
    from transformers import AutoModelForCausalLM

    saved = trained[4]
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    drafts = []
    build = model._get_candidate_generator

    def observe(*args, **kwargs):
        generator = build(*args, **kwargs)
        get = generator.get_candidates

        def get_and_record(input_ids, **kw):
            ids, logits = get(input_ids, **kw)
            if logits is not None:
                drafts.append((input_ids.shape[1], logits[0, 0].clone()))
            return ids, logits

        generator.get_candidates = get_and_record
        return generator

    model._get_candidate_generator = observe
    prompt = torch.tensor([[5, 6, 14, 7, 18]])
    sequence = model.generate(prompt, use_mtp=True, do_sample=False, max_new_tokens=5, min_new_tokens=5)
    assert drafts
    hidden, logits = trunk_forward(model, sequence, torch.ones_like(sequence))
    width = sequence.shape[1]
    mask = draft_target_mask(torch.tensor([prompt.shape[1]]), torch.tensor([width]), width)
    heads = trained[0].heads
    with torch.no_grad():
        ours = depth_outputs(heads, hidden, logits, sequence, mask)[0].logits[0]
    for length, draft in drafts:  # drafted token x[length]: depth 0 at hidden position j = length - 2
        # min_new_tokens' logits processor sets eos to -inf in the drafts; every other entry must agree.
        finite = torch.isfinite(draft)
        assert (~finite).nonzero().flatten().tolist() == [model.generation_config.eos_token_id]
        assert torch.allclose(ours[length - 2][finite], draft[finite], atol=1e-4), length


def test_two_depth_teacher_forcing_equals_transformers_mtp_forward():
    """Depth 2 reads depth 1's output and the next token, one position further on: run transformers' own drafting
    forward (MtpModel.forward over a prefilled prefix, the call MTPCandidateGenerator makes) with two fresh layers
    and compare both drafted logit vectors with the trainer's teacher-forced ones on the sequence extended by the
    first draft (which is the token depth 2 reads in transformers' loop)."""
    from transformers.cache_utils import MtpCache

    from trl_ext.embedded.models import build_model
    from trl_ext.trainers.mtp import fresh_heads

    model = build_model("tiny-glm4-moe-mtp", seed=0).eval()
    model.config.num_mtp_layers = 2
    heads = fresh_heads(model, 2, seed=1).eval()
    sequence = torch.tensor([[5, 6, 14, 7, 18, 9, 12]])
    width = sequence.shape[1]
    with torch.no_grad():
        hidden, _ = trunk_forward(model, sequence[:, :-1], torch.ones_like(sequence[:, :-1]))
        positions = torch.arange(1, width)[None]
        tokens, logits, _ = heads(input_ids=sequence[:, 1:], last_hidden_states=hidden, attention_mask=None,
                                  position_ids=positions, mtp_cache=MtpCache(config=model.config.get_mtp_config()))
        extended = torch.cat([sequence, tokens[:, :1]], dim=1)
        h, policy_logits = trunk_forward(model, extended, torch.ones_like(extended))
        mask = torch.ones_like(extended, dtype=torch.bool)
        ours = depth_outputs(heads, h, policy_logits, extended, mask)
    assert len(ours) == 2
    assert torch.allclose(ours[0].logits[0, width - 2], logits[0, 0], atol=1e-4)
    assert torch.allclose(ours[1].logits[0, width - 2], logits[0, 1], atol=1e-4)


def test_the_smallest_accepted_budget_drafts(trained):
    """max_new_tokens 3 (the least mtp_heads accepts) keeps one draft per prompt; 2 keeps none: undefined figures."""
    assert measure_acceptance(trained[4], ["12+3=", "4+5="], max_new_tokens=3).drafted == 2
    figures = measure_acceptance(trained[4], ["12+3=", "4+5="], max_new_tokens=2)
    assert figures.drafted == 0 and figures.acceptance_length is None


@pytest.mark.parametrize("bf16_from", ["model_init_kwargs", "checkpoint"])
def test_fresh_heads_take_a_bf16_trunk_dtype_and_train(trained, model_dir, tmp_path, bf16_from):
    """A bf16 trunk without MTP weights (bf16 asked for in model_init_kwargs, or a checkpoint saved in bf16 as released
    GLM-4.5 / DeepSeek-V3 ones are) got float32 fresh heads and the first step failed with a dtype mismatch. Fresh
    heads now have, tensor for tensor, the dtypes of heads loaded for the same trunk (bf16, with the family's float32
    router kept), and the trunk's shared rotary buffers are not cast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.trainers.mtp import load_heads

    source, init_kwargs = model_dir, {"dtype": torch.bfloat16}
    if bf16_from == "checkpoint":
        source, init_kwargs = str(tmp_path / "bf16"), None
        AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).save_pretrained(source)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(source)
    rows = Dataset.from_dict({"prompt": ["12+3=", "4+5="] * 2, "completion": ["15<eos>", "9<eos>"] * 2})
    args = MtpConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                     report_to="none", save_strategy="no", seed=0, model_init_kwargs=init_kwargs)
    trainer = ExtMtpTrainer(source, args, rows, AutoTokenizer.from_pretrained(source), plugin_host=PluginHost())
    assert trainer.policy.dtype == torch.bfloat16
    fresh = {n: p.dtype for n, p in trainer.heads.named_parameters()}
    loaded = {n: p.dtype for n, p in load_heads(trainer.policy, trained[4]).named_parameters()}
    assert fresh == loaded
    assert fresh["layers.0.eh_proj.weight"] == torch.bfloat16
    assert fresh["layers.0.mtp_block.mlp.gate.weight"] == torch.float32  # Glm4Moe keeps its router in float32
    assert trainer.policy.model.rotary_emb.inv_freq.dtype == torch.float32
    before = {n: p.detach().clone() for n, p in trainer.head_parameters().items()}
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.head_parameters().values())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.head_parameters().items())


def _chat_folder(trained, tmp_path):
    """The trained checkpoint with a chat template that adds a generation prompt."""
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(trained[4], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}=={% endif %}")
    tokenizer.save_pretrained(folder)
    return str(folder), AutoTokenizer.from_pretrained(folder)


def test_conversational_prompt_ids_are_a_list_of_ids_with_the_generation_prompt(trained, tmp_path):
    """transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding by default; prompt_ids returned it
    as is, so conversational prompts crashed sampling and the acceptance measurement."""
    from trl_ext_plugins.mtp.acceptance import prompt_ids

    _, tokenizer = _chat_folder(trained, tmp_path)
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "12+3"}])
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tokenizer("12+3==", add_special_tokens=False)["input_ids"]  # content + generation prompt


def test_conversational_prompts_sample_and_measure(trained, tmp_path):
    from trl_ext_plugins.mtp.acceptance import prompt_ids
    from trl_ext_plugins.mtp.mtp_heads import MtpHeadsParams, sample_completions

    folder, tokenizer = _chat_folder(trained, tmp_path)
    conversation = [{"role": "user", "content": "12+3"}]
    params = MtpHeadsParams(held_out={"source": "embedded:arithmetic"}, samples_per_prompt=2, max_new_tokens=3,
                            batch_size=4)
    rows = sample_completions(folder, [conversation, "4+5="], params, seed=0)
    assert len(rows) == 4
    assert rows[0]["prompt_ids"] == prompt_ids(tokenizer, conversation) and rows[0]["completion_ids"]
    figures = measure_acceptance(folder, [conversation], max_new_tokens=4)
    assert figures.steps > 0 and figures.prompts == 1


def _fake_hub_cache(monkeypatch, tmp_path, repo_id: str, folder) -> None:
    """Serve ``folder`` as ``repo_id`` from a hub cache under tmp_path, offline: no download can happen."""
    import shutil

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hub_id_checkpoint_starts_from_its_own_heads(trained, model_dir, tmp_path, monkeypatch, sharded):
    """A model given by hub id never used its own MTP heads (the check globbed Path(<hub id>), which finds nothing) and
    ``heads_from: <hub id>`` was refused; the checkpoint is now resolved through the hub cache as from_pretrained
    resolves it (index only, for a sharded one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ext.trainers.mtp import checkpoint_has_heads, load_heads, write_heads

    folder = trained[4]
    if sharded:  # the trained checkpoint re-saved in shards, the heads in their own shard
        folder = tmp_path / "sharded"
        policy = AutoModelForCausalLM.from_pretrained(trained[4])
        heads = load_heads(policy, trained[4])
        policy.save_pretrained(folder, max_shard_size="100KB")
        write_heads(policy, heads, folder)
        AutoTokenizer.from_pretrained(trained[4]).save_pretrained(folder)
        assert (folder / "model.safetensors.index.json").exists()
    _fake_hub_cache(monkeypatch, tmp_path, "acme/tiny-mtp", folder)
    expected = trained[0].head_parameters()

    rows = Dataset.from_dict({"prompt": ["12+3="] * 4, "completion": ["15<eos>"] * 4})
    args = MtpConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", save_strategy="no", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    by_id = ExtMtpTrainer("acme/tiny-mtp", args, rows, tokenizer, plugin_host=PluginHost())
    assert checkpoint_has_heads(by_id.policy, "acme/tiny-mtp")
    for name, param in by_id.head_parameters().items():
        assert torch.equal(param, expected[name]), name

    fresh = ExtMtpTrainer(model_dir, args, rows, tokenizer, plugin_host=PluginHost())
    assert not checkpoint_has_heads(fresh.policy, model_dir)
    fresh.load_heads("acme/tiny-mtp")  # heads_from: <hub id>
    for name, param in fresh.head_parameters().items():
        assert torch.equal(param, expected[name]), name
    assert not checkpoint_has_heads(fresh.policy, "acme/not-cached")  # offline, not in the cache: no heads, no error
    with pytest.raises(MtpSupportError, match="acme/not-cached: holds no MTP weights"):
        fresh.load_heads("acme/not-cached")


def test_hard_loss_trains_too(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, loss="hard")
    before = {n: p.detach().clone() for n, p in trainer.head_parameters().items()}
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.head_parameters().items())


def test_heads_load_from_another_checkpoint(trained, model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path)
    trainer.load_heads(trained[4])
    for name, param in trainer.head_parameters().items():
        assert torch.equal(param, trained[0].head_parameters()[name]), name
    assert trainer.model is trainer.heads


# ----------------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------------


def _stage(model, **extra):
    return StageSpec(name="mtp", trainer="mtp", model=model, dataset={"source": "embedded:arithmetic"}, **extra)


def test_heads_load_from_a_checkpoint_after_the_model_was_saved(trained, model_dir, tmp_path):
    """Resuming an mtp stage loads the checkpoint's heads after mtp_heads saved the starting model once, and
    save_pretrained leaves config.dtype a string: the load failed ("'str' object has no attribute
    'is_floating_point'"), so an interrupted mtp stage could not resume."""
    trainer = _trainer(model_dir, tmp_path / "out")
    trainer.save_model(str(tmp_path / "before"))  # the writer mtp_heads' trl_ext_trainer_created uses (_save)
    assert isinstance(trainer.policy.config.dtype, str)
    trainer._load_from_checkpoint(trained[4])
    for name, param in trainer.head_parameters().items():
        assert torch.equal(param, trained[0].head_parameters()[name]), name
    assert trainer.policy.config.dtype == "float32"  # left as it was


def test_model_class_without_mtp_is_refused_at_validation_naming_the_class():
    errors = check_stage(_stage("embedded:tiny-qwen2"), {}, "stages[0]")
    assert len(errors) == 1
    assert errors[0].startswith("stages[0].model: embedded:tiny-qwen2: Qwen2ForCausalLM has no multi-token-prediction")
    assert check_stage(_stage("embedded:tiny-glm4-moe-mtp"), {}, "stages[0]") == []


def test_layer_count_transformers_cannot_find_is_refused():
    """DeepSeek-V3's MTP weights are found only at model.layers.61: a 2-layer DeepSeek-V3 cannot carry heads that
    generate(use_mtp=True) would load, and the message says so."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8,
                              kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    problem = mtp_support_problem(DeepseekV3ForCausalLM, config)
    assert "DeepseekV3ForCausalLM with num_hidden_layers=2" in problem and "layers\\.61" in problem
    assert "model.layers.2" in problem


def test_unknown_class_is_refused_by_the_trainer_before_training(tmp_path):
    from transformers import AutoTokenizer

    from trl_ext.embedded.models import materialize_model

    folder = str(materialize_model("tiny-qwen2", tmp_path / "qwen2", seed=0))
    rows = Dataset.from_dict({"prompt": ["1+1="], "completion": ["2<eos>"]})
    args = MtpConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none")
    with pytest.raises(MtpSupportError, match="Qwen2ForCausalLM has no multi-token-prediction support"):
        ExtMtpTrainer(folder, args, rows, AutoTokenizer.from_pretrained(folder), plugin_host=PluginHost())


def test_evaluation_and_peft_are_refused_on_mtp_stages():
    stage = _stage("embedded:tiny-glm4-moe-mtp", peft={"type": "lora"},
                   evaluation={"dataset": {"source": "embedded:arithmetic"}, "reward": "exact_match"})
    errors = check_stage(stage, {}, "stages[0]")
    assert [e.split(":")[0] for e in errors] == ["stages[0].evaluation", "stages[0].peft"]


def test_zero3_is_refused_at_validation():
    """Under ZeRO-3 transformers loads the frozen trunk partitioned, but only the heads enter the DeepSpeed engine: the
    trunk's forward met size-0 weights at the first step (2 processes, 'The size of tensor a (0) must match ...')."""
    from trl_ext.launch import backend_args

    stage = _stage("embedded:tiny-glm4-moe-mtp")
    for backend, refused in (("zero3", True), ("zero2", False), ("ddp", False)):
        errors = check_stage(stage, backend_args(backend, cuda=False), "stages[0]")
        assert errors == ([f"stages[0].args.deepspeed: {ZERO3_REFUSAL}"] if refused else []), backend
    assert "does not run under DeepSpeed ZeRO-3" in ZERO3_REFUSAL


def test_plugin_conformance_and_required_held_out():
    check_plugin_conformance(MtpHeads)
    with pytest.raises(Exception, match="held_out"):
        MtpHeads.Params()
