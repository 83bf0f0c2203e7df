"""prm / orm: step BCE at separators, Math-Shepherd MC labels, judge labels, product/min aggregation, training recipe
end to end."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_ext.catalog import Catalog
from trl_ext.recipe import StageSpec, load_raw, parse_recipe
from trl_ext.runner import run_recipe
from trl_ext.testing import check_plugin_conformance
from trl_ext.trainers.prm import IGNORE, step_bce_loss, tokenize_steps
from trl_ext_plugins.rewards import formulas, judging
from trl_ext_plugins.rewards.orm import ORM, ORMParams
from trl_ext_plugins.rewards.prm import PRM, PRMParams, split_steps, step_probabilities
from trl_ext_plugins.rewards.steps import (judge_step_labels, judge_step_prompts, monte_carlo_step_labels,
                                            multistep_arithmetic)


def test_step_bce_reads_only_labelled_positions():
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.7], [1.5, 0.1, -0.4, 9.9]], dtype=torch.float64, requires_grad=True)
    labels = torch.full((2, 4), IGNORE, dtype=torch.float64)
    labels[0, 1], labels[0, 3], labels[1, 2] = 1.0, 0.375, 0.0
    loss = step_bce_loss(logits, labels)
    p = lambda x: 1 / (1 + torch.exp(-torch.tensor(x, dtype=torch.float64)))  # noqa: E731
    expected = -(torch.log(p(-1.2)) + 0.375 * torch.log(p(0.7)) + 0.625 * torch.log(1 - p(0.7))
                 + torch.log(1 - p(-0.4))) / 3
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    loss.backward()
    unlabelled = labels == IGNORE
    assert torch.all(logits.grad[unlabelled] == 0) and torch.all(logits.grad[~unlabelled] != 0)
    # a micro-batch without a labelled step (rows whose completion has no step): 0 and a zero gradient, not NaN
    nothing = torch.full((2, 4), IGNORE, dtype=torch.float64)
    empty = step_bce_loss(logits, nothing)
    assert empty.item() == 0.0
    (grad,) = torch.autograd.grad(empty, logits)
    assert torch.equal(grad, torch.zeros_like(logits))


def test_tokenize_steps_puts_labels_at_separators(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, positions = tokenize_steps(tok, "1+2+3=\n", ["1+2=3", "3+3=6"], "\n")
    assert tok.decode(ids) == "1+2+3=\n1+2=3\n3+3=6\n"
    assert [tok.decode([ids[i]]) for i in positions] == ["\n", "\n"] and positions == [12, 18]


def test_rows_without_steps_are_left_out_of_prm_training(tiny_model_dir):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_ext.trainers.prm import ExtPRMTrainer, PRMConfig

    rows = Dataset.from_dict({"prompt": ["1+2=\n", "3+4=\n"], "completions": [["1+2=3"], []], "labels": [[1.0], []]})
    args = PRMConfig(output_dir="unused", report_to="none", max_length=None)
    out = ExtPRMTrainer._tokenize(rows, AutoTokenizer.from_pretrained(tiny_model_dir), args)
    assert len(out) == 1 and out[0]["step_labels"] == [1.0]


@pytest.mark.parametrize("labels", [[1, 0, -1], [1.0, 2.0, 0.0], [1.0, float("nan"), 0.0], [1.0, None, 0.0]])
def test_step_labels_outside_unit_interval_are_refused(tiny_model_dir, labels):
    """BCE with a target of -1 (a PRM800K negative rating left unmapped) is softplus(x) + x, unbounded below: the
    trainer would push that logit to -inf rather than learn; such rows must be refused, not trained on."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_ext.trainers.prm import ExtPRMTrainer, PRMConfig

    target = torch.tensor(-1.0)
    losses = [torch.nn.functional.binary_cross_entropy_with_logits(torch.tensor(x), target) for x in (0.0, -10.0)]
    assert losses[1] < losses[0] < 0.7  # unbounded below: -9.99995 at x = -10
    rows = Dataset.from_dict({"prompt": ["1+2+3=\n"], "completions": [["1+2=3", "3+3=6", "6=6"]], "labels": [labels]})
    args = PRMConfig(output_dir="unused", report_to="none", max_length=None)
    with pytest.raises(ValueError, match=r"step labels must be numbers in \[0, 1\]"):
        ExtPRMTrainer._tokenize(rows, AutoTokenizer.from_pretrained(tiny_model_dir), args)
    ok = Dataset.from_dict({"prompt": ["1+2+3=\n"], "completions": [["1+2=3", "3+3=6"]], "labels": [[1.0, 0.375]]})
    out = ExtPRMTrainer._tokenize(ok, AutoTokenizer.from_pretrained(tiny_model_dir), args)
    assert out[0]["step_labels"] == [1.0, 0.375]


def test_math_shepherd_mc_labels_with_a_scripted_completer():
    """N=8: 3 correct rollouts after step 1 -> soft 0.375, hard 1; 0/8 after step 2 -> both 0 (ALGORITHMS.md 11)."""
    outcomes = {"5=\n2+3=5\n": ["6"] * 3 + ["4"] * 5, "5=\n2+3=5\n5+1=7\n": ["7"] * 8}

    def completer(prefixes, n):
        return [outcomes[p][:n] for p in prefixes]

    steps = ["2+3=5", "5+1=7", "7+0=7"]
    soft = monte_carlo_step_labels("5=\n", steps, "6", completer, 8, soft=True)
    hard = monte_carlo_step_labels("5=\n", steps, "6", completer, 8, soft=False)
    assert soft == [0.375, 0.0, 0.0] and hard == [1.0, 0.0, 0.0]
    # the last step is labelled by the solution's own answer
    assert monte_carlo_step_labels("", ["2+4=6"], "6", completer, 8) == [1.0]


def test_embedded_stepwise_held_out_problems_are_never_drawn_for_training():
    """Split by the problem's hash: with seeded streams alone, 10 of the 256 default test problems were in train."""
    from trl_ext.embedded.splits import hash_split

    train, test = multistep_arithmetic("train", size=2048), multistep_arithmetic("test", size=256)
    assert not set(train["prompt"]) & set(test["prompt"])
    assert {hash_split(p.rstrip("=\n")) for p in test["prompt"]} == {"test"}
    assert multistep_arithmetic("test", size=16)["prompt"] == test["prompt"][:16]


def test_embedded_stepwise_data_labels_match_the_arithmetic():
    data = multistep_arithmetic("train", size=64)
    for row in data:
        value = None
        ok = True
        for step, label in zip(row["completions"], row["labels"]):
            lhs, rhs = step.split("=")
            a, b = map(int, lhs.split("+"))
            ok = ok and (value is None or a == value) and a + b == int(rhs)
            assert label == float(ok), row
            value = int(rhs)
        assert (row["labels"][-1] == 1.0) == (str(value) == row["answer"])
    assert 0 < sum(r["labels"][-1] for r in data) < 64  # both kinds present


def test_aggregation_and_scoring_match_the_formula(tiny_model_dir):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts, completions = ["1+2+3=\n", "4+4+1=\n"], ["1+2=3\n3+3=6", "4+4=8\n8+1=10\n"]
    steps = [split_steps(c, "\n") for c in completions]
    assert steps == [["1+2=3", "3+3=6"], ["4+4=8", "8+1=10"]]
    probs = step_probabilities(model, tok, prompts, steps, "\n", batch_size=1)
    batched = step_probabilities(model, tok, prompts, steps, "\n", batch_size=2)
    for a, b in zip(probs, batched):
        assert torch.allclose(a, b, atol=1e-6)
    ids, pos = tokenize_steps(tok, prompts[0], steps[0], "\n")
    with torch.no_grad():
        alone = torch.sigmoid(model(input_ids=torch.tensor([ids])).logits[0, pos, 0].double())
    assert torch.allclose(alone, probs[0], atol=1e-6)
    # plugin: product / min of step probabilities
    for how in ("product", "min"):
        plugin = PRM(PRMParams(path=tiny_model_dir, aggregation=how))
        plugin.scorer.model, plugin.scorer.tokenizer = model, tok
        (fn,) = plugin.trl_ext_reward_functions(StageSpec(trainer="grpo", model="x", dataset={"source": "x"}))
        got = fn.fn(prompts=prompts, completions=completions)
        want = [(p.prod() if how == "product" else p.min()).item() for p in probs]
        assert got == pytest.approx(want, abs=1e-6)
    assert formulas.aggregate_step_scores(torch.tensor([0.9, 0.8]), "product").item() == pytest.approx(0.72)


def test_orm_and_prm_score_the_text_they_were_trained_on(tiny_model_dir):
    """The ORM trains on prompt + completion + separator with the completion unchanged: scoring a multi-line
    completion must not replace its newlines (the separator) first. The PRM trains on the question text: a
    conversational prompt is scored with its question, not as an empty prompt."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stage = StageSpec(trainer="grpo", model="x", dataset={"source": "x"})

    def trained_reading(prompt, steps):
        ids, pos = tokenize_steps(tok, prompt, steps, "\n")
        with torch.no_grad():
            return torch.sigmoid(model(input_ids=torch.tensor([ids])).logits[0, pos, 0].double())

    orm = ORM(ORMParams(path=tiny_model_dir))
    orm.scorer.model, orm.scorer.tokenizer = model, tok
    (fn,) = orm.trl_ext_reward_functions(stage)
    completion = "12+30=42\nSo the answer is 42"
    assert fn.fn(prompts=["12+30=\n"], completions=[completion]) == pytest.approx(
        [trained_reading("12+30=\n", [completion])[-1].item()], abs=1e-6)

    prm = PRM(PRMParams(path=tiny_model_dir, aggregation="product"))
    prm.scorer.model, prm.scorer.tokenizer = model, tok
    (fn,) = prm.trl_ext_reward_functions(stage)
    expected = trained_reading("12+30=", ["12+30=42", "42"]).prod().item()
    chat = fn.fn(prompts=[[{"role": "user", "content": "12+30="}]],
                 completions=[[{"role": "assistant", "content": "12+30=42\n42"}]])
    assert chat == pytest.approx([expected], abs=1e-6)
    assert fn.fn(prompts=["12+30="], completions=["12+30=42\n42"]) == pytest.approx([expected], abs=1e-6)


def test_orm_turns_unpaired_rows_into_one_step():
    from trl_ext.embedded.arithmetic import arithmetic_dataset

    stage = StageSpec(trainer="prm", model="x", dataset={"source": "x"})
    data = ORM(ORMParams()).trl_ext_prepare_dataset(arithmetic_dataset("train", format="unpaired", size=4), "train", stage)
    assert data[0]["completions"] == [data[0]["completions"][0]] and data["labels"] == [[1.0], [0.0], [1.0], [0.0]]
    with pytest.raises(ValueError, match="lacks column"):
        ORM(ORMParams(label_column="nope")).trl_ext_prepare_dataset(arithmetic_dataset("train", format="unpaired", size=4),
                                                                    "train", stage)


def test_validation_and_conformance():
    check_plugin_conformance(PRM)
    check_plugin_conformance(ORM)
    train = StageSpec(trainer="prm", model="x", dataset={"source": "x"})
    grpo = StageSpec(trainer="grpo", model="x", dataset={"source": "x"})
    assert PRM(PRMParams(label_source="mc_soft")).trl_ext_validate_stage(stage=train, plugins=[])
    assert PRM(PRMParams()).trl_ext_validate_stage(stage=grpo, plugins=[])
    assert not PRM(PRMParams(path="stage:prm")).trl_ext_validate_stage(stage=grpo, plugins=[])


def test_prm_recipe_end_to_end(tmp_path):
    """configs/prm.yaml, 3 PRM steps then 1 GRPO step scored by the trained PRM."""
    out = tmp_path / "run"
    info = run_recipe(parse_recipe(load_raw("configs/prm.yaml")), out, Catalog.discover(), max_steps=3,
                      echo=lambda _m: None)
    assert info["stages"]["prm"]["global_step"] == 3 and info["stages"]["prm"]["train_loss"] > 0
    assert json.loads((out / "prm" / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    scores = [r["rewards/prm/mean"] for r in rows if "rewards/prm/mean" in r]
    assert scores and all(0.0 <= s <= 1.0 for s in scores)


# ---------------------------------------------------------------------------------------------------------------
# label_source: judge
# ---------------------------------------------------------------------------------------------------------------

TRAIN = StageSpec(trainer="prm", model="x", dataset={"source": "x"})
# (judge reply for a step, the score the parser must read on [1, 10]; None: unparsable -> fallback label)
VERDICTS = [
    ("Score: 10", 10.0), ("Score: 6", 6.0), ("Score: 5", 5.0), ("Rating: 5.5", 5.5), ("**1**", 1.0),
    ("3+4=7 checks out.\nScore: 8", 8.0), ("garbage", None), ("Score: 11", None), ("", None), ("3 and 7", None),
    ("ERROR", None),  # the server answers 500: a failed request
]


class _StepJudgeServer(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        step = body["messages"][0]["content"].split("Latest step: ")[1].split("\n")[0]
        content = {f"s{i}": text for i, (text, _) in enumerate(VERDICTS)}[step]
        if content == "ERROR":
            self.send_error(500, "boom")
            return
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return None


@pytest.fixture
def step_judge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StepJudgeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _two_solutions():
    """Two rows whose steps s0..s10 get the VERDICTS replies (6 steps, then 5)."""
    from datasets import Dataset

    steps = [f"s{i}" for i in range(len(VERDICTS))]
    return Dataset.from_list([{"prompt": "q1", "completions": steps[:6], "labels": [9.0] * 6, "answer": "1"},
                              {"prompt": "q2", "completions": steps[6:], "labels": [9.0] * 5, "answer": "2"}])


@pytest.mark.parametrize(("labels", "threshold"), [("hard", None), ("hard", 8.0), ("soft", None)])
def test_judge_labels_from_an_endpoint_match_the_verdict_table(step_judge_server, labels, threshold):
    plugin = PRM(PRMParams(label_source="judge", judge={"endpoint": step_judge_server, "model": "j", "labels": labels,
                                                        "threshold": threshold, "fallback": 0.25, "timeout": 5}))
    assert not plugin.trl_ext_validate_stage(stage=TRAIN, plugins=[])
    out = plugin.trl_ext_prepare_dataset(_two_solutions(), "train", TRAIN)
    thr = 5.5 if threshold is None else threshold  # default: the midpoint of [1, 10]
    want = [0.25 if s is None else (s - 1) / 9 if labels == "soft" else float(s >= thr) for _, s in VERDICTS]
    got = out["labels"][0] + out["labels"][1]
    assert got == pytest.approx(want, abs=1e-12) and [len(x) for x in out["labels"]] == [6, 5]
    if labels == "hard" and threshold is None:
        assert got == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.25, 0.25, 0.25, 0.25, 0.25]
    assert plugin.judge_stats.verdicts == 11 and plugin.judge_stats.unparsable == 5 and plugin.judge_stats.errors == 1
    assert plugin.judge_summary["prm/judge/unparsable"] == 5.0 and plugin.judge_summary["prm/judge/verdicts"] == 11.0
    assert plugin.judge_summary["prm/judge/request_errors"] == 1.0


def test_judge_step_prompts_show_the_prefix_and_labels_split_per_row():
    prompts = judge_step_prompts([{"role": "user", "content": "2+3+4=\n"}], ["2+3=5", "5+4=9"], 1, 10)
    assert "Question: 2+3+4=\n" in prompts[0] and "Previous steps:\n(none)\nLatest step: 2+3=5\n" in prompts[0]
    assert "Previous steps:\n2+3=5\nLatest step: 5+4=9\n" in prompts[1] and "scale of 1 (certainly wrong) to 10" in prompts[1]
    assert prompts[1].endswith(judging.POINTWISE_INSTRUCTION[False])

    class Fake:
        def generate(self, texts):
            return ["Score: 4" if "Latest step: b" in t else "Score: 9" for t in texts]

    stats = judging.JudgeStats("x")
    got = judge_step_labels(["p", "q"], [["a", "b"], ["c"]], Fake(), stats, low=0, high=10, soft=True)
    assert got == [[0.9, 0.4], [0.9]] and stats.verdicts == 3 and stats.unparsable == 0
    assert judge_step_labels(["p"], [["a", "b"]], Fake(), stats, low=0, high=10) == [[1.0, 0.0]]  # midpoint 5


@pytest.mark.parametrize(("params", "message"), [
    ({"label_source": "judge"}, "params.judge is required with label_source 'judge'"),
    ({"label_source": "judge", "judge": {}}, "set exactly one of params.judge.path"),
    ({"label_source": "judge", "judge": {"path": "a", "endpoint": "http://x/v1", "model": "m"}}, "exactly one"),
    ({"label_source": "judge", "judge": {"endpoint": "http://x/v1"}}, "params.judge.model is required"),
    ({"label_source": "judge", "judge": {"path": "stage:sft"}}, "judge.path must be a folder or embedded"),
    ({"label_source": "judge", "judge": {"path": "a", "threshold": 11}}, "threshold (11.0) must lie in"),
    ({"label_source": "judge", "judge": {"path": "a", "scale_min": 5, "scale_max": 5}}, "scale_max must exceed"),
    ({"judge": {"path": "a"}}, "params.judge is only read with label_source 'judge'"),
])
def test_judge_label_validation(params, message):
    errors = PRM(PRMParams(**params)).trl_ext_validate_stage(stage=TRAIN, plugins=[])
    assert any(message in e for e in errors), errors
    with pytest.raises(ValueError):
        PRMParams(label_source="judge", judge={"path": "a", "fallback": 1.5})


def test_tiny_model_as_judge_gives_fallback_labels_counted(tiny_model_dir):
    """The untrained embedded model as judge: its replies are garbage, so steps get the fallback label, counted."""
    data = multistep_arithmetic("train", size=3)
    plugin = PRM(PRMParams(label_source="judge", judge={"path": tiny_model_dir, "max_new_tokens": 4, "fallback": 0.5}))
    out = plugin.trl_ext_prepare_dataset(data, "train", TRAIN)
    # independent: the same prompts decoded one by one, parsed, thresholded at 5.5 or replaced by the fallback
    backend = judging.LocalJudge(tiny_model_dir, max_new_tokens=4)
    parsed = [judging.parse_score(backend.generate([t])[0], 1, 10)
              for row in data for t in judge_step_prompts(row["prompt"], row["completions"], 1, 10)]
    want = [0.5 if s is None else float(s >= 5.5) for s in parsed]
    assert [x for row in out["labels"] for x in row] == want
    assert plugin.judge_stats.verdicts == len(parsed) and plugin.judge_stats.unparsable == parsed.count(None) > 0


def test_judge_labelled_prm_stage_runs_in_a_recipe(tmp_path, monkeypatch):
    """One prm stage whose labels come from the embedded tiny model as judge (by name), 1 training step. The judge is
    the run's own copy of the embedded model: labelling writes no model folder outside the output directory."""
    from trl_ext_plugins.rewards import llm_judge

    judged_from = []
    make_backend = llm_judge.make_backend
    monkeypatch.setattr(llm_judge, "make_backend", lambda j: judged_from.append(j.path) or make_backend(j))
    recipe = parse_recipe({"seed": 0, "stages": [{
        "name": "prm", "trainer": "prm", "model": "embedded:tiny-qwen2",
        "dataset": {"source": "embedded:multistep_arithmetic", "split": "train", "params": {"size": 4}},
        "plugins": [{"prm": {"label_source": "judge", "judge": {"path": "embedded:tiny-qwen2", "max_new_tokens": 3}}}],
        "args": {"max_steps": 1, "per_device_train_batch_size": 4, "save_strategy": "no", "max_length": 64}}]})
    info = run_recipe(recipe, tmp_path / "run", Catalog.discover(), echo=lambda _m: None)
    assert info["stages"]["prm"]["global_step"] == 1 and info["stages"]["prm"]["train_loss"] > 0
    assert judged_from == [str(tmp_path / "run" / "_embedded" / "tiny-qwen2")]
