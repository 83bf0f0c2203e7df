"""Tests of the embedded tokenizer, models, arithmetic task, evaluation and plotting."""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from trl_ext.embedded.arithmetic import EMBEDDED_DATASETS, arithmetic_dataset, exact_match_reward
from trl_ext.embedded.models import EMBEDDED_MODELS, MARKER_FILE, build_model, embedded_tokenizer, materialize_model
from trl_ext.embedded.tokenizer import EOS_TOKEN, build_tokenizer
from trl_ext.evaluation import evaluate_generation
from trl_ext.plotting import plot_curves

TASK_STRINGS = ["12+34=", "46<eos>", "0+0=0<eos>", "7*8=56", "3-49=-46<eos>", " 1 + 2 = 3 ", "Q: 2+2?\nA: 4"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return materialize_model("tiny-qwen2", tmp_path_factory.mktemp("models") / "tiny-qwen2")


# --- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trips_task_strings(tokenizer):
    for text in TASK_STRINGS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # One token per character, and eos text becomes the single eos id.
    assert tokenizer("12+34=")["input_ids"] == tokenizer.convert_tokens_to_ids(list("12+34="))
    assert tokenizer("46<eos>")["input_ids"][-1] == tokenizer.eos_token_id
    assert len(tokenizer("46<eos>")["input_ids"]) == 3


def test_tokenizer_special_tokens_and_padding(tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["1+2=", "10+20="], padding=True)
    assert batch["input_ids"][0][:2] == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1]
    # No bos or other special token is added on its own.
    assert tokenizer.decode(tokenizer("1+2=")["input_ids"], skip_special_tokens=False) == "1+2="
    # A character outside the alphabet is not dropped silently.
    assert tokenizer("1#2")["input_ids"][1] == tokenizer.unk_token_id


@pytest.mark.parametrize("loader", [PreTrainedTokenizerFast.from_pretrained, AutoTokenizer.from_pretrained])
def test_tokenizer_save_load_gives_identical_ids(tokenizer, model_dir, loader):
    # model_dir has a qwen2 config next to the tokenizer, the case where AutoTokenizer swaps classes.
    loaded = loader(model_dir)
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert len(loaded) == len(tokenizer)
    assert loaded.padding_side == "left"
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(loaded, name) == getattr(tokenizer, name)
    for text in TASK_STRINGS:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == text


# --- models ----------------------------------------------------------------------------------------


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_build_model_is_seeded():
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    first = build_model("tiny-qwen2", seed=0)
    assert torch.equal(torch.rand(1), expected_draw)  # the caller's random state is untouched
    assert _same_weights(first, build_model("tiny-qwen2", seed=0))
    assert not _same_weights(first, build_model("tiny-qwen2", seed=1))


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_embedded_models_run(name):
    tokenizer = embedded_tokenizer(name)  # the tool-calling model has its own tokenizer
    model = EMBEDDED_MODELS[name](seed=0)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    logits = model(**tokenizer(["12+34="], return_tensors="pt")).logits
    assert logits.shape == (1, 6, len(tokenizer))


def test_model_sizes_order_weak_and_strong():
    params = {name: build_model(name).num_parameters() for name in EMBEDDED_MODELS}
    assert 250_000 < params["tiny-qwen2"] < 400_000
    assert params["tiny-qwen2-small"] < params["tiny-qwen2"] / 3
    moe = build_model("tiny-qwen3-moe").config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_hidden_layers) == (4, 2, 2)


def test_moe_router_can_be_observed():
    model = build_model("tiny-qwen3-moe")
    routed = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, inputs, output: routed.append(output))
    model(torch.tensor([[5, 6, 14, 7, 8, 18]]))
    assert len(routed) == 2
    router_logits, top_k_weights, selected_experts = routed[0]
    assert router_logits.shape == (6, 4) and selected_experts.shape == (6, 2)


def test_build_model_rejects_unknown_name():
    with pytest.raises(ValueError, match="tiny-qwen2"):
        build_model("no-such-model")


# --- materialize_model ------------------------------------------------------------------------------


def test_materialize_model_writes_a_loadable_copy(model_dir):
    assert (model_dir / "model.safetensors").is_file()
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["padding_side"] == "left"
    assert _same_weights(AutoModelForCausalLM.from_pretrained(model_dir), build_model("tiny-qwen2", seed=0))


def test_materialize_model_is_idempotent(tmp_path):
    target = tmp_path / "m"
    assert materialize_model("tiny-qwen2-small", target) == target
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert materialize_model("tiny-qwen2-small", str(target)) == target
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging directory left behind
    with pytest.raises(FileExistsError):
        materialize_model("tiny-qwen2-small", target, seed=1)  # a different model is never overwritten


def test_materialize_model_fills_an_empty_directory_but_not_a_used_one(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (materialize_model("tiny-qwen2-small", empty) / MARKER_FILE).is_file()
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        materialize_model("tiny-qwen2-small", used)
    assert (used / "notes.txt").read_text() == "keep me"


def test_materialize_model_tolerates_a_concurrent_writer(tmp_path, monkeypatch):
    target = tmp_path / "m"
    real_build_tokenizer = build_tokenizer

    def competing_writer_first():
        # Another process finishes its copy while this one is still writing.
        monkeypatch.setattr("trl_ext.embedded.models.build_tokenizer", real_build_tokenizer)
        materialize_model("tiny-qwen2-small", target)
        return real_build_tokenizer()

    monkeypatch.setattr("trl_ext.embedded.models.build_tokenizer", competing_writer_first)
    assert materialize_model("tiny-qwen2-small", target) == target
    assert (target / MARKER_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_materialize_model_is_atomic(tmp_path, monkeypatch):
    def broken_tokenizer():
        raise RuntimeError("disk full")

    monkeypatch.setattr("trl_ext.embedded.models.build_tokenizer", broken_tokenizer)
    with pytest.raises(RuntimeError, match="disk full"):
        materialize_model("tiny-qwen2-small", tmp_path / "m")
    assert os.listdir(tmp_path) == []  # neither a partial copy nor a staging directory


# --- arithmetic task -------------------------------------------------------------------------------


def test_splits_are_disjoint_and_deterministic():
    train = arithmetic_dataset("train", format="prompt")
    test = arithmetic_dataset("test", format="prompt")
    assert (len(train), len(test)) == (2300, 200)
    assert not set(train["prompt"]) & set(test["prompt"])
    assert len(set(train["prompt"]) | set(test["prompt"])) == 50 * 50
    assert arithmetic_dataset("test", format="prompt")["prompt"] == test["prompt"]
    assert arithmetic_dataset("test", format="prompt", seed=1)["prompt"] != test["prompt"]
    assert arithmetic_dataset("train", format="prompt", size=10)["prompt"] == train["prompt"][:10]


def test_other_operations_and_sizes():
    data = arithmetic_dataset("train", format="prompt", max_operand=10, operations="+-*")
    assert len(data) == 300 - 60
    for prompt, answer in zip(data["prompt"], data["answer"], strict=True):
        assert str(eval(prompt[:-1])) == answer  # the prompts are Python expressions
    with pytest.raises(ValueError):
        arithmetic_dataset(operations="/")
    with pytest.raises(ValueError):
        arithmetic_dataset("test", size=201)


@pytest.mark.parametrize(
    "format, columns",
    [
        ("prompt_completion", {"prompt", "completion", "answer"}),
        ("prompt", {"prompt", "answer"}),
        ("preference", {"prompt", "chosen", "rejected", "answer"}),
        ("unpaired", {"prompt", "completion", "label", "answer"}),
    ],
)
def test_formats_have_their_columns(format, columns):
    data = arithmetic_dataset("test", format=format)
    assert set(data.column_names) == columns
    row = data[0]
    assert row["prompt"].endswith("=") and str(eval(row["prompt"][:-1])) == row["answer"]


def test_completions_are_correct_or_deliberately_wrong():
    pc = arithmetic_dataset("train", format="prompt_completion")
    assert all(c == a + EOS_TOKEN for c, a in zip(pc["completion"], pc["answer"], strict=True))
    pref = arithmetic_dataset("train", format="preference")
    assert exact_match_reward(pref["chosen"], pref["answer"]) == [1.0] * len(pref)
    assert exact_match_reward(pref["rejected"], pref["answer"]) == [0.0] * len(pref)
    assert all(r.endswith(EOS_TOKEN) and not r.startswith("-") for r in pref["rejected"])
    unpaired = arithmetic_dataset("train", format="unpaired")
    assert exact_match_reward(unpaired["completion"], unpaired["answer"]) == [float(x) for x in unpaired["label"]]
    assert sum(unpaired["label"]) == len(unpaired) // 2


def test_verbose_tails_are_long_tailed_fixed_per_problem_and_ignored_by_the_reward():
    plain = arithmetic_dataset("train")
    assert arithmetic_dataset("train", tail_fraction=0.0)["completion"] == plain["completion"]
    tailed = arithmetic_dataset("train", tail_fraction=0.2, tail_max=40)
    lengths = []
    for row in tailed:
        body = row["completion"].removesuffix(EOS_TOKEN)
        assert body.startswith(row["answer"]) and body.count(".") == len(body) - len(row["answer"])
        lengths.append(len(body) - len(row["answer"]))
    tails = [n for n in lengths if n]
    # Bernoulli(0.2) over 2300 problems: standard error 0.008, so +-0.03 is about 4 of them
    assert abs(len(tails) / len(lengths) - 0.2) < 0.03
    assert min(tails) >= 1 and max(tails) == 40
    # L = min(40, floor(exp(U(0, ln 41)))) has P(L <= k) = ln(k + 1) / ln 41. The empirical CDF of the ~460 tails must
    # follow it within 0.07 (3 standard errors of a proportion); a uniform length (P(L <= 6) = 0.15 against 0.52)
    # or a geometric one would not.
    for k in (1, 3, 6, 12, 24):
        assert abs(sum(n <= k for n in tails) / len(tails) - math.log(k + 1) / math.log(41)) < 0.07, k
    assert exact_match_reward(tailed["completion"], tailed["answer"]) == [1.0] * len(tailed)
    # the same problem gets the same tail whatever the split size or row order
    assert arithmetic_dataset("train", tail_fraction=0.2, tail_max=40, size=50)["completion"] == tailed["completion"][:50]
    with pytest.raises(ValueError, match="tail_fraction"):
        arithmetic_dataset("train", tail_fraction=1.5)
    with pytest.raises(ValueError, match="tail_max"):
        arithmetic_dataset("train", tail_fraction=0.1, tail_max=0)
    with pytest.raises(ValueError, match="needs format 'prompt_completion'"):
        arithmetic_dataset("train", format="prompt", tail_fraction=0.1)


def test_sft_trainer_adds_no_second_eos(tokenizer, model_dir, tmp_path):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), bf16=False, report_to="none", max_steps=1)
    trainer = SFTTrainer(
        model=str(model_dir),
        args=args,
        train_dataset=arithmetic_dataset("train", size=8),
        processing_class=tokenizer,
    )
    for row, source in zip(trainer.train_dataset, arithmetic_dataset("train", size=8), strict=True):
        assert row["input_ids"] == tokenizer(source["prompt"] + source["completion"])["input_ids"]
        assert row["input_ids"].count(tokenizer.eos_token_id) == 1
        # Only the answer and its eos are trained on.
        trained = [label for label in row["labels"] if label != -100]
        assert trained == tokenizer(source["completion"])["input_ids"]


@pytest.mark.parametrize(
    "completion, gold, reward",
    [
        ("46", "46", 1.0),
        ("47", "46", 0.0),
        ("46<eos>", "46", 1.0),
        ("46<eos><pad><pad>", "46", 1.0),
        (" 46", "46", 1.0),
        ("\n46 \n", "46", 1.0),
        ("46 12", "46", 1.0),  # only the leading integer counts
        ("460", "46", 0.0),
        ("46.5", "46", 0.0),  # a decimal is not its integer part
        ("46.5", "4", 0.0),
        ("-3.25", "-3", 0.0),
        ("46.", "46", 1.0),  # a full stop ends the number
        ("46....", "46", 1.0),
        ("4", "46", 0.0),
        ("", "46", 0.0),
        ("<eos>", "46", 0.0),
        ("x46", "46", 0.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ([{"role": "assistant", "content": "46<eos>"}], "46", 1.0),
        ([{"role": "assistant", "content": "45"}], "46", 0.0),
    ],
)
def test_exact_match_reward(completion, gold, reward):
    assert exact_match_reward([completion], answer=[gold], prompts=["unused"]) == [reward]


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("12+5=17,17+7=24<eos>", 1.0),   # the answer after the last "="
        ("12+5=17,17+7=23<eos>", 0.0),
        ("12+5=24,24+7=31", 0.0),        # the right number in the wrong place does not count
        ("24", 1.0),                     # no marker: read from the start
        ("12+5=17,17+7= 24 <eos>", 1.0),
        ("12+5=17,17+7=", 0.0),          # a chain cut before its answer
        ([{"role": "assistant", "content": "7+5=12,12+12=24"}], 1.0),
    ],
)
def test_exact_match_reward_after_a_marker(completion, reward):
    assert exact_match_reward([completion], answer=["24"], answer_after="=") == [reward]


def test_registry():
    assert EMBEDDED_DATASETS["arithmetic"] is arithmetic_dataset
    assert set(EMBEDDED_MODELS) == {"tiny-qwen2", "tiny-qwen2-small", "tiny-qwen3-moe", "tiny-glm4-moe-mtp",
                                    "tiny-qwen3-tools"}


# --- evaluation ------------------------------------------------------------------------------------


class OracleModel(torch.nn.Module):
    """Stands in for a causal LM: "generates" the right answer (or a wrong one) followed by eos."""

    def __init__(self, tokenizer, wrong: bool = False):
        super().__init__()
        self.tokenizer = tokenizer
        self.wrong = wrong

    def generate(self, input_ids, attention_mask, max_new_tokens, num_return_sequences, **kwargs):
        rows = []
        for ids in input_ids:
            prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
            answer = eval(prompt[:-1]) + (1 if self.wrong else 0)
            rows += [ids.tolist() + self.tokenizer(f"{answer}<eos>")["input_ids"]] * num_return_sequences
        width = max(map(len, rows))
        return torch.tensor([row + [self.tokenizer.pad_token_id] * (width - len(row)) for row in rows])


def test_evaluate_generation_scores_an_oracle(tokenizer):
    data = arithmetic_dataset("test")
    oracle = OracleModel(tokenizer)
    assert oracle.training
    result = evaluate_generation(oracle, tokenizer, data, exact_match_reward, batch_size=64)
    samples = result.pop("samples")
    assert result == {"accuracy": 1.0, "reward_mean": 1.0, "n": 200, "unscored": 0}
    assert [s["prompt"] for s in samples] == data["prompt"][:5]  # eval.json shows a few completions with rewards
    assert all(s["reward"] == 1.0 and s["completion"].startswith(a) for s, a in zip(samples, data["answer"]))
    assert oracle.training  # the training mode is given back
    wrong = evaluate_generation(OracleModel(tokenizer, wrong=True).eval(), tokenizer, data, exact_match_reward)
    assert wrong["accuracy"] == 0.0
    sampled = evaluate_generation(oracle, tokenizer, data, exact_match_reward, greedy=False, num_samples=3)
    assert {k: sampled[k] for k in ("accuracy", "reward_mean", "n")} == {"accuracy": 1.0, "reward_mean": 1.0, "n": 600}
    assert [s["prompt"] for s in sampled["samples"]] == [data["prompt"][0]] * 3 + [data["prompt"][1]] * 2


def test_evaluation_leaves_rows_the_reward_does_not_score_out_of_its_figures(tokenizer):
    """A reward returns None for a row it cannot score (math_verify on an unparsable gold answer, exact_match without
    one): TRL leaves the row out of training, and the evaluation crashed on it (None >= 1.0) after the stage had
    trained."""
    data = arithmetic_dataset("test", size=8)
    answers = list(data["answer"])
    answers[1] = answers[5] = None
    data = data.remove_columns("answer").add_column("answer", answers)
    result = evaluate_generation(OracleModel(tokenizer), tokenizer, data, exact_match_reward)
    assert {k: result[k] for k in ("accuracy", "reward_mean", "n", "unscored")} == {
        "accuracy": 1.0, "reward_mean": 1.0, "n": 8, "unscored": 2}
    assert result["samples"][1]["reward"] is None


def test_evaluate_generation_calls_the_reward_with_trls_training_signature(tokenizer):
    # A function written for TRL's reward signature (completion_ids, trainer_state, log_metric as named parameters)
    # scored training but raised TypeError at the held-out evaluation, which passed none of them.
    from types import SimpleNamespace

    from trl_ext.evaluation import training_reward_kwargs

    data = arithmetic_dataset("test", size=8)
    seen = {}

    def trl_signature(prompts, completions, completion_ids, trainer_state, log_metric, answer, **kwargs):
        seen.update(ids=completion_ids, state=trainer_state)
        log_metric("held_out/extra", 1.0)  # logs nothing at evaluation, but must not fail
        return exact_match_reward(completions, answer)

    trainer = SimpleNamespace(state="the trainer's state")
    result = evaluate_generation(OracleModel(tokenizer), tokenizer, data, trl_signature,
                                 reward_kwargs=training_reward_kwargs(trainer))
    assert result["accuracy"] == 1.0 and seen["state"] == "the trainer's state"
    # each completion's ids: its tokens up to and including EOS, the padding generate adds after it cut off
    assert seen["ids"] == [tokenizer(f"{a}<eos>")["input_ids"] for a in data["answer"]]


def test_evaluate_generation_on_a_real_model_is_deterministic(tokenizer):
    model = build_model("tiny-qwen2", seed=0)
    data = arithmetic_dataset("test", size=40)
    calls = []

    def recording_reward(completions, answer, **kwargs):
        calls.append(completions)
        return exact_match_reward(completions, answer)

    first = evaluate_generation(model, tokenizer, data, recording_reward, batch_size=16)
    second = evaluate_generation(model, tokenizer, data, recording_reward, batch_size=40)
    assert first == second and first["n"] == 40
    assert calls[0] == calls[1]  # batching and left padding do not change greedy decodes
    assert model.training


def test_sampled_evaluation_is_the_mean_over_k_draws_seeded_and_leaves_the_training_rng(tokenizer):
    from trl_ext.evaluation import sampled_evaluation

    model = build_model("tiny-qwen2", seed=0)
    data = arithmetic_dataset("test", size=12)
    draws = []

    def even_length(completions, answer, **kwargs):  # a reward that differs between sampled completions
        draws.append(completions)
        return [float(len(c) % 2 == 0) for c in completions]

    ev = {"k": 3, "temperature": 1.0, "max_new_tokens": 6, "batch_size": 5}
    torch.manual_seed(123)
    untouched = torch.rand(4)
    torch.manual_seed(123)
    first = sampled_evaluation(model, tokenizer, data, even_length, seed=5, **ev)
    assert torch.equal(torch.rand(4), untouched)  # the training's random stream goes on as if nothing was drawn
    assert first["sampled_n"] == 36 and len(draws[0]) == 36  # k completions of every prompt
    assert first["sampled_accuracy"] == sum(len(c) % 2 == 0 for c in draws[0]) / 36
    assert 0 < first["sampled_accuracy"] < 1
    assert sampled_evaluation(model, tokenizer, data, even_length, seed=5, **ev) == first and draws[1] == draws[0]
    sampled_evaluation(model, tokenizer, data, even_length, seed=6, **ev)
    assert draws[2] != draws[0]  # the recipe's seed decides the draw


# --- plotting --------------------------------------------------------------------------------------


def test_plot_curves_writes_a_png(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps({"step": s, "loss": 3.0 / s}) for s in range(10, 110, 10)))
    grpo = tmp_path / "grpo.jsonl"
    grpo.write_text(
        "\n".join(
            json.dumps({"step": s, "loss": 0.01, "reward": s / 100, "rewards/exact_match_reward/mean": s / 100})
            for s in range(5, 105, 5)
        )
        + "\n"
        + json.dumps({"step": 100, "train_runtime": 3.0})
    )
    dpo = tmp_path / "dpo.jsonl"  # logs nothing the panels draw
    dpo.write_text(json.dumps({"step": 1, "rewards/margins": 0.1}))
    evaluations = {"sft": {"before": {"accuracy": 0.0}, "after": {"accuracy": 0.4}},
                   "grpo": {"before": {"accuracy": 0.4}, "after": {"accuracy": 0.6}}}
    out = plot_curves({"sft": sft, "grpo": grpo, "dpo": dpo, "missing": tmp_path / "none.jsonl"}, tmp_path / "a/c.png",
                      evaluations)
    assert out == tmp_path / "a/c.png"
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    from PIL import Image

    assert Image.open(out).size == (1650, 400)  # loss, reward and held-out accuracy panels
    only_loss = plot_curves({"sft": sft}, tmp_path / "b.png")  # the empty reward panel is left out, not drawn flat
    assert Image.open(only_loss).size == (550, 400)


def test_plot_curves_without_any_data(tmp_path):
    out = plot_curves({}, tmp_path / "empty.png")
    assert out.read_bytes().startswith(b"\x89PNG")
