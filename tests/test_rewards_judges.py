"""llm_judge, checklist_judge, self_judge: verdict parsing, order averaging, fallbacks, HTTP judge, checklists,
Copeland self-judging, and the llm_judge recipe end to end."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_ext.catalog import Catalog
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec, load_raw, parse_recipe
from trl_ext.runner import resolve_recipe, run_recipe
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.rewards import judging
from trl_ext_plugins.rewards.checklist_judge import (ChecklistJudge, ChecklistJudgeParams, normalise_checklist,
                                                     parse_verifier, run_verifier)
from trl_ext_plugins.rewards.llm_judge import LLMJudge, LLMJudgeParams, pairwise_rewards
from trl_ext_plugins.rewards.self_judge import (CONSISTENCY, SelfJudge, SelfJudgeParams, group_rewards,
                                               judge_policy_loss)
from tests.markers import NEEDS_DEEPSPEED

STAGE = StageSpec(trainer="grpo", model="x", dataset={"source": "embedded:arithmetic"})


class FakeJudge:
    """A backend whose reply is ``reply(text)``; records every judge prompt it saw."""

    def __init__(self, reply):
        self.reply, self.seen = reply, []

    def bind(self, trainer):
        return None

    def generate(self, texts):
        self.seen.extend(texts)
        return [self.reply(t) for t in texts]


def _answers(text):
    """(answer A, answer B) of a built-in pairwise judge prompt."""
    a = text.split("Response A: ")[1].split("\n")[0]
    b = text.split("Response B: ")[1].split("\n")[0]
    return a, b


def longer_wins(text):  # a position-free judge: the longer answer wins, whichever order it is shown in
    a, b = _answers(text)
    return "Verdict: A" if len(a) > len(b) else "Verdict: B"


def always_a(text):  # a maximally position-biased judge
    return "Verdict: A"


class Metrics(dict):
    def __call__(self, name, value):
        self.setdefault(name, []).append(value)


# ---------------------------------------------------------------------------------------------------------------
# Verdict parsing
# ---------------------------------------------------------------------------------------------------------------

SCORE_TABLE = [
    ("", None), ("   \n", None), (None, None),
    ("no number here", None),
    ("Score: 11", None), ("Score: 0", None), ("Score: -3", None),  # out of [1, 10]
    ("3 and 7", None), ("between 4 and 6", None),  # several bare numbers, no verdict marker
    ("Score: 7/10", 7.0), ("Score: 7/5", None),  # a denominator must be the scale's top
    ("**8**", 8.0), ("I'd say **8**.", 8.0), ("[[6]]", 6.0), ("Rating: 6.5", 6.5), ("score = 4", 4.0),
    ("7", 7.0), ("7.", 7.0), ("9/10", 9.0),
    ("12+5=17 is right; 2 steps, 3 checks.\nVerdict: 3", 3.0),  # reasoning numbers, then the verdict
    ("Score: 2 at first sight. On reflection...\nFinal score: 9", 9.0),  # the last verdict counts
    ("Score: **5**", 5.0), ("Score: 5. Then 100 and 200 other numbers", 5.0),
    # a verdict number ends where it ends: not the 1 of 1e3, the 7 of 7-8 or 7,5, the 5.5 of 5.5.5
    ("Score: 1e3", None), ("Score: 10e-1", None), ("Score: 7-8", None), ("Score: 7,5", None), ("score: 5.5.5", None),
    ("Score: 8/10, well argued", 8.0), ("Score: 8-point answer", 8.0),
]


@pytest.mark.parametrize(("text", "expected"), SCORE_TABLE)
def test_parse_score_table(text, expected):
    assert judging.parse_score(text, 1, 10) == expected


PREF_TABLE = [
    ("", None), (None, None), ("both are fine", None), ("Response A is better", None),
    ("Verdict: A", 1.0), ("verdict: B", 0.0), ("Verdict: b", None), ("[[A]]", 1.0), ("[[C]]", 0.5), ("Winner: tie", 0.5),
    ("A", 1.0), (" **B** ", 0.0),
    ("A says 3, B says 4; A is wrong.\nVerdict: B", 0.0),  # reasoning mentions both, the last verdict counts
    ("Verdict: A ... no, wait. Final verdict: B", 0.0),
    ("The answer is a bit off, so the better one is a mess", None),  # lower-case 'a' is a word, not a verdict
    ("The answer is a bit off.\nVerdict: B", 0.0),
    # prose after the verdict is not a verdict: "Answer A ..." flipped these to A
    ("Verdict: B\nAnswer A has an arithmetic error, so B is better.", 0.0), ("[[B]] because answer A is wrong", 0.0),
    ("Final answer: B", 0.0), ("The better response is A.", 1.0), ("My choice: B", 0.0), ("Answer A", None),
]


@pytest.mark.parametrize(("text", "expected"), PREF_TABLE)
def test_parse_preference_table(text, expected):
    assert judging.parse_preference(text) == expected


def test_order_averaging_formula_and_swap_consistency():
    for v_ab in (0.0, 0.5, 1.0):
        for v_ba in (0.0, 0.5, 1.0):
            p_ab = judging.order_averaged_preference(v_ab, v_ba)
            assert p_ab == (v_ab + 1 - v_ba) / 2
            assert p_ab + judging.order_averaged_preference(v_ba, v_ab) == 1.0
    assert judging.swap_consistency(1.0, 0.0) == 1.0  # A first wins, and it still wins shown second
    assert judging.swap_consistency(1.0, 1.0) == 0.0  # the first position always wins
    assert judging.swap_consistency(0.5, 0.5) == 1.0


# ---------------------------------------------------------------------------------------------------------------
# llm_judge
# ---------------------------------------------------------------------------------------------------------------


def _llm(backend, **params):
    plugin = LLMJudge(LLMJudgeParams(path="unused", **params))
    plugin.backend = backend
    (fn,) = plugin.trl_ext_reward_functions(STAGE)
    return plugin, fn


def test_pointwise_normalises_and_falls_back_with_counts():
    replies = {"a": "Score: 10", "b": "Reasoning: 1+1=2.\nScore: 4", "c": "banana", "d": "Score: 42", "e": None}
    backend = FakeJudge(lambda t: replies[t.split("Response: ")[1].split("\n")[0]])
    plugin, fn = _llm(backend, fallback=-1.0)
    metrics = Metrics()
    got = fn.fn(prompts=["q"] * 5, completions=list("abcde"), log_metric=metrics)
    assert got == [1.0, (4 - 1) / 9, -1.0, -1.0, -1.0]
    assert metrics["llm_judge/unparsable"] == [3.0] and metrics["llm_judge/unparsable_frac"] == [0.6]
    assert metrics["llm_judge/request_errors"] == [1.0]
    fn.fn(prompts=["q"], completions=["c"], log_metric=metrics)  # the running total keeps counting
    assert metrics["llm_judge/unparsable_total"] == [3.0, 4.0] and plugin.stats.verdicts == 6
    assert "Question: q" in backend.seen[0] and "'Score: n' only" in backend.seen[0]


def test_reasoning_mode_changes_the_instruction_and_reads_the_last_verdict():
    backend = FakeJudge(lambda t: "Step 1 gives 9, step 2 gives 10.\nScore: 2")
    _, fn = _llm(backend, reasoning=True, scale_min=0, scale_max=10)
    assert fn.fn(prompts=["q"], completions=["x"]) == [0.2]
    assert "Explain your reasoning" in backend.seen[0] and "from 0 to 10" not in backend.seen[0]
    assert "scale of 0 to 10" in backend.seen[0]


def test_a_collective_judge_is_called_on_a_rank_without_pairs():
    """Evaluation may split a prompt's group across ranks (TRL only asks that the global eval batch hold whole groups),
    leaving a rank groups of one answer and no pair to judge. The policy judge gathers every rank's call count, so it
    must still be called there (with no texts), or the other ranks wait in that gather; an endpoint judge is not."""
    calls = []

    class Collective(FakeJudge):
        collective = True

        def generate(self, texts):
            calls.append(list(texts))
            return super().generate(texts)

    stats = judging.JudgeStats("t")
    assert judging.judge_groups(Collective(always_a), ["q", "r"], [[0], [1]], ["x", "y"], judging.PAIRWISE_TEMPLATE,
                                "", stats) == [{}, {}]
    assert calls == [[]]
    endpoint = FakeJudge(always_a)
    endpoint.generate = lambda texts: calls.append(("endpoint", list(texts))) or []
    judging.judge_groups(endpoint, ["q"], [[0]], ["x"], judging.PAIRWISE_TEMPLATE, "", stats)
    assert calls == [[]]
    assert judging.PolicyJudge.collective and not getattr(judging.EndpointJudge, "collective", False)


def test_pairwise_order_swap_consistency():
    answers = ["xx", "x", "xxx"]
    # a position-biased judge: after averaging every pair is a coin flip and P(A>B) + P(B>A) = 1
    backend = FakeJudge(always_a)
    _, fn = _llm(backend, mode="pairwise")
    assert fn.fn(prompts=["q"] * 3, completions=answers) == [0.5, 0.5, 0.5]
    assert len(backend.seen) == 6  # G (G - 1): every pair in both orders
    verdicts = judging.judge_groups(backend, ["q"] * 2, [[0, 1]], ["x", "y"], judging.PAIRWISE_TEMPLATE, "",
                                    judging.JudgeStats("t"))[0]
    p, c = judging.preference_matrix(verdicts, 2)
    assert p[0, 1] + p[1, 0] == 1.0 and p[0, 1] == 0.5 and c[0, 1] == 0.0
    # a consistent judge (longer wins): P(long > short) = 1 in both orders, mean win probability ranks by length
    _, fn = _llm(FakeJudge(longer_wins), mode="pairwise")
    assert fn.fn(prompts=["q"] * 3, completions=answers) == [0.5, 0.0, 1.0]
    # swapping the order of the group permutes the rewards and changes nothing else
    assert fn.fn(prompts=["q"] * 3, completions=answers[::-1]) == [1.0, 0.0, 0.5]


def test_pairwise_groups_are_runs_of_one_prompt_and_copeland_option():
    backend = FakeJudge(longer_wins)
    _, fn = _llm(backend, mode="pairwise", pairwise_aggregation="copeland")
    got = fn.fn(prompts=["p", "p", "q", "q", "q"], completions=["a", "aaa", "bb", "bb", "b"])
    assert got == [0.0, 1.0, 0.75, 0.75, 0.0]  # bb vs bb: both orders say B -> a tie; Copeland counts 1/2
    assert len(backend.seen) == 2 + 6  # no comparisons across prompts
    assert judging.groups_of(["p", "p", "q", "p"]) == [[0, 1], [2], [3]]


def test_pairwise_fallback_for_samples_without_any_parsed_verdict():
    verdicts = {(0, 1): None, (1, 0): None, (0, 2): 1.0, (2, 0): 0.0, (1, 2): None, (2, 1): None}
    assert pairwise_rewards(verdicts, 3, "mean", fallback=-7.0) == [0.75, -7.0, 0.25]
    assert pairwise_rewards({}, 1, "mean", fallback=-7.0) == [-7.0]


class _JudgeServer(BaseHTTPRequestHandler):
    canned = {"good": "Score: 9", "bad": "Reasoning: 3 mistakes.\nScore: 2", "garbage": "no idea"}
    requests: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        answer = body["messages"][0]["content"].split("Response: ")[1].split("\n")[0]
        if answer == "error":
            self.send_error(500, "boom")
            return
        if answer == "slow":
            time.sleep(1.0)
        reply = {"choices": [{"message": {"role": "assistant", "content": self.canned.get(answer, "")}}]}
        if answer == "malformed":
            reply = {"unexpected": True}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        return None


@pytest.fixture
def judge_server():
    _JudgeServer.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_judge_against_local_server(judge_server, monkeypatch):
    monkeypatch.setenv("TRL_EXT_TEST_JUDGE_KEY", "dummy-test-value")
    plugin = LLMJudge(LLMJudgeParams(endpoint=judge_server, model="judge-1", timeout=0.4, fallback=-1.0,
                                     api_key_env="TRL_EXT_TEST_JUDGE_KEY", max_new_tokens=5))
    (fn,) = plugin.trl_ext_reward_functions(STAGE)
    metrics = Metrics()
    completions = ["good", "bad", "garbage", "error", "slow", "malformed"]
    got = fn.fn(prompts=["1+1="] * 6, completions=completions, log_metric=metrics)
    assert got == [pytest.approx(8 / 9), pytest.approx(1 / 9), -1.0, -1.0, -1.0, -1.0]
    assert metrics["llm_judge/request_errors"] == [3.0]  # 500, timeout, malformed reply
    assert metrics["llm_judge/unparsable"] == [4.0]
    path, headers, body = _JudgeServer.requests[0]
    assert path == "/v1/chat/completions"
    assert body["model"] == "judge-1" and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["messages"][0]["role"] == "user" and "Question: 1+1=" in body["messages"][0]["content"]
    assert headers["Authorization"] == "Bearer dummy-test-value"
    # a server that is not there at all: every request is a fallback, nothing raises
    dead = LLMJudge(LLMJudgeParams(endpoint="http://127.0.0.1:9/v1/chat/completions", model="m", timeout=0.5))
    assert dead.score(prompts=["q"], completions=["good"]) == [0.0]


def test_local_judge_greedy_batched_equals_one_by_one(tiny_model_dir):
    backend = judging.LocalJudge(tiny_model_dir, max_new_tokens=5, batch_size=8)
    texts = ["Score this: 1+2=3", "x", "Rate 12+34=46 from 1 to 10"]
    batched = backend.generate(texts)
    assert batched == [backend.generate([t])[0] for t in texts]
    assert all(isinstance(t, str) for t in batched)
    plugin = LLMJudge(LLMJudgeParams(path=tiny_model_dir, max_new_tokens=3, fallback=0.25))
    scores = plugin.score(prompts=["1+2="] * 2, completions=["3", "4"])
    # independent: the same judge prompts decoded one by one, parsed, normalised or replaced by the fallback
    prompts = [judging.POINTWISE_TEMPLATE.format(prompt="1+2=", completion=c, low=1, high=10,
                                                 instruction=judging.POINTWISE_INSTRUCTION[False]) for c in "34"]
    replies = [backend.generate([t])[0] for t in prompts]
    parsed = [judging.parse_score(r, 1, 10) for r in replies]
    assert scores == [0.25 if v is None else (v - 1) / 9 for v in parsed]
    assert plugin.stats.verdicts == 2 and plugin.stats.unparsable == parsed.count(None)


def test_validation_errors_name_the_fields():
    catalog = Catalog.discover()

    def stage(params):
        return parse_recipe({"seed": 0, "stages": [{
            "name": "g", "trainer": "grpo", "model": "embedded:tiny-qwen2",
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}},
            "plugins": ["grpo", {"llm_judge": params}]}]})

    with pytest.raises(RecipeError, match="exactly one of params.path"):
        resolve_recipe(stage({"path": "a", "endpoint": "http://x"}), catalog)
    with pytest.raises(RecipeError, match="params.model is required"):
        resolve_recipe(stage({"endpoint": "http://x"}), catalog)
    with pytest.raises(RecipeError, match="scale_max must exceed"):
        resolve_recipe(stage({"path": "a", "scale_min": 5, "scale_max": 5}), catalog)


@pytest.mark.parametrize("cls", [LLMJudge, ChecklistJudge, SelfJudge])
def test_conformance(cls):
    check_plugin_conformance(cls)


def test_llm_judge_recipe_end_to_end(tmp_path):
    """configs/llm_judge.yaml, 1 step: the tiny judge's garbage verdicts map to the fallback and are counted."""
    recipe = parse_recipe(load_raw("configs/llm_judge.yaml"))
    out = tmp_path / "run"
    info = run_recipe(recipe, out, Catalog.discover(), max_steps=1, echo=lambda _m: None)
    assert info["status"] == "complete"
    (row,) = [json.loads(line) for line in (out / "main" / "metrics.jsonl").read_text().splitlines()
              if "rewards/llm_judge/mean" in line]
    assert row["llm_judge/unparsable"] == 8.0 and row["llm_judge/unparsable_frac"] == 1.0
    assert row["rewards/llm_judge/mean"] == 0.0  # the fallback
    assert (out / "_embedded" / "tiny-qwen2" / "config.json").is_file()  # the judge shares the runner's copy


# ---------------------------------------------------------------------------------------------------------------
# checklist_judge
# ---------------------------------------------------------------------------------------------------------------


def _item_judge(scores):
    """Replies 'Score: s' with s looked up by the item text of the judge prompt (None -> failed request)."""
    def reply(text):
        item = text.split("Requirement: ")[1].split("\n")[0]
        value = scores[item]
        return value(text) if callable(value) else value
    return FakeJudge(reply)


def _checklist(backend, **params):
    plugin = ChecklistJudge(ChecklistJudgeParams(path="unused", **params))
    plugin.backend = backend
    return plugin


def test_checklist_weighting_paper_example():
    backend = _item_judge({"is correct": "Score: 80", "is short": "Reasoning 1, 2.\nScore: 20"})
    plugin = _checklist(backend)
    checklist = [{"item": "is correct", "weight": 100}, {"item": "is short", "weight": 50}]
    got = plugin.score(prompts=["1+2="], completions=["3"], checklist=[checklist])
    assert got == [pytest.approx((100 * 80 + 50 * 20) / 150)] and got[0] == pytest.approx(60.0)
    assert "0 (not at all) to 100" in backend.seen[0]


def test_verifier_replaces_the_judge_deterministically():
    backend = _item_judge({"is correct": "Score: 80", "three words at most": "Score: 0"})
    plugin = _checklist(backend)
    checklist = [{"item": "is correct", "weight": 100},
                 {"item": "three words at most", "weight": 50, "verifier": "max_words:3"}]
    got = plugin.score(prompts=["q", "q"], completions=["one two", "one two three four"],
                       checklist=[checklist, checklist])
    assert got == [pytest.approx((100 * 80 + 50 * 100) / 150), pytest.approx((100 * 80 + 50 * 0) / 150)]
    assert not any("three words" in t for t in backend.seen)  # the judge is not asked about verified items


def test_judge_samples_are_averaged_and_fallback_counted():
    cycle = iter(["Score: 60", "Score: 80", "unsure", "x", None, "Score: 101"])
    backend = _item_judge({"a": lambda _t: next(cycle), "b": lambda _t: next(cycle)})
    plugin = _checklist(backend, samples=3, fallback=10.0)
    metrics = Metrics()
    got = plugin.score(prompts=["q"], completions=["y"], checklist=[[{"item": "a", "weight": 1},
                                                                     {"item": "b", "weight": 3}]],
                       log_metric=metrics)
    assert len(backend.seen) == 6
    assert got == [pytest.approx((1 * 70 + 3 * 10) / 4)]  # a: mean(60, 80); b: nothing parsed -> fallback 10
    assert metrics["checklist_judge/unparsable"] == [4.0] and metrics["checklist_judge/request_errors"] == [1.0]


def test_rows_without_a_checklist_get_none_and_json_and_string_items_work():
    plugin = ChecklistJudge(ChecklistJudgeParams())  # no judge: verifier-only checklists
    assert plugin.trl_ext_validate_stage(STAGE, []) is None
    rows = [json.dumps([{"item": "says hi", "weight": 2, "verifier": "icontains:HI"},
                        {"item": "ends politely", "verifier": "regex:(please|thanks)[.!]?$"}]),
            None, []]
    got = plugin.score(prompts=["q"] * 3, completions=["hi there, thanks!", "x", "y"], checklist=rows)
    assert got == [pytest.approx(100.0), None, None]
    assert normalise_checklist(["plain item"]) == [{"item": "plain item", "weight": 1.0, "verifier": None}]
    with pytest.raises(ValueError, match="need a judge"):
        plugin.score(prompts=["q"], completions=["x"], checklist=[[{"item": "judge me"}]])


VERIFIER_TABLE = [
    ("contains:42", "the answer is 42", 100.0), ("contains:42", "the answer is 4 2", 0.0),
    ("not_contains:sorry", "fine", 100.0), ("icontains:yes", "YES!", 100.0),
    ("regex:^\\d+$", "123", 100.0), ("regex:^\\d+$", "12a", 0.0), ("regex:a:b", "xa:by", 100.0),
    ("max_words:2", "one two", 100.0), ("max_words:2", "one two three", 0.0),
    ("min_words:2", "one", 0.0), ("max_chars:3", "abcd", 0.0),
    ("starts_with:Answer", "  Answer: 3", 100.0), ("ends_with:.", "done.  ", 100.0),
]


@pytest.mark.parametrize(("spec", "text", "expected"), VERIFIER_TABLE)
def test_verifier_registry(spec, text, expected):
    assert run_verifier(spec, text) == expected


def test_bad_verifiers_and_dataset_checks():
    from datasets import Dataset

    for spec, message in (("nope:1", "unknown verifier"), ("max_words", "unknown verifier"),
                          ("max_words:many", "bad argument"), ("regex:(", "bad argument")):
        with pytest.raises(ValueError, match=message):
            parse_verifier(spec)
    plugin = ChecklistJudge(ChecklistJudgeParams())
    good = Dataset.from_dict({"prompt": ["q"], "checklist": [[{"item": "a", "weight": 1.0, "verifier": "contains:x"}]]})
    assert plugin.trl_ext_prepare_dataset(good, "train", STAGE) is None
    bad = Dataset.from_dict({"prompt": ["q"], "checklist": [[{"item": "a", "weight": 1.0, "verifier": "len:3"}]]})
    with pytest.raises(ValueError, match="unknown verifier 'len:3'"):
        plugin.trl_ext_prepare_dataset(bad, "train", STAGE)
    with pytest.raises(ValueError, match="checklist_column 'checklist' is not a column"):
        plugin.trl_ext_prepare_dataset(Dataset.from_dict({"prompt": ["q"]}), "train", STAGE)
    for weight in (-1.0, float("nan"), float("inf")):  # NaN passed `weight < 0` and made the row's reward NaN
        rows = Dataset.from_dict({"prompt": ["q"], "checklist": [[{"item": "a", "weight": weight, "verifier": None}]]})
        with pytest.raises(ValueError, match="row 0 has a negative or non-finite item weight"):
            plugin.trl_ext_prepare_dataset(rows, "train", STAGE)


# ---------------------------------------------------------------------------------------------------------------
# self_judge
# ---------------------------------------------------------------------------------------------------------------


def test_copeland_example_and_consistency():
    # A > B, A > C, B > C, each stated consistently in both orders (v = 1 when the first shown wins)
    beats = {(0, 1), (0, 2), (1, 2)}
    verdicts = {(i, j): 1.0 if (i, j) in beats else 0.0 for i in range(3) for j in range(3) if i != j}
    wins, consistency = group_rewards(verdicts, 3)
    assert wins == [1.0, 0.5, 0.0] and consistency == [1.0, 1.0, 1.0]
    # swapping the presentation order of every pair does not change a consistent judge's aggregated verdict
    swapped = {(j, i): 1.0 - v for (i, j), v in verdicts.items()}
    assert swapped == verdicts and group_rewards(swapped, 3)[0] == wins
    # a position-biased judge: every pair a tie, consistency 0
    biased = {k: 1.0 for k in verdicts}
    assert group_rewards(biased, 3) == ([0.5, 0.5, 0.5], [0.0, 0.0, 0.0])
    # one order unparsable: that pair counts as half the parsed verdict and is inconsistent
    partial = {**verdicts, (1, 0): None}
    wins, consistency = group_rewards(partial, 3)
    assert wins == [1.0, 0.5, 0.0]  # P(A > B) = (1 + 1 - 0.5) / 2 = 0.75 > 0.5, still a win
    assert consistency == [0.5, 0.5, 1.0]


def test_self_judge_reward_and_consistency_column_with_fake_policy():
    plugin = SelfJudge(SelfJudgeParams(consistency_weight=0.1))
    plugin.judge = FakeJudge(longer_wins)
    actor, cons = plugin.trl_ext_reward_functions(STAGE)
    assert (cons.name, cons.weight) == (CONSISTENCY, 0.1)
    metrics = Metrics()
    completions = ["bb", "bbb", "b", "x", "xx"]
    prompts = ["p"] * 3 + ["q"] * 2
    assert actor.fn(prompts=prompts, completions=completions, log_metric=metrics) == [0.5, 1.0, 0.0, 0.0, 1.0]
    assert cons.fn(prompts=prompts, completions=completions) == [1.0] * 5
    assert len(plugin.judge.seen) == 6 + 2  # the consistency column reuses the actor call's verdicts
    assert metrics["self_judge/consistency"] == [1.0]
    plugin.judge = FakeJudge(always_a)
    assert actor.fn(prompts=prompts, completions=completions, log_metric=metrics) == [0.5] * 5
    assert cons.fn(prompts=prompts, completions=completions) == [0.0] * 5
    assert metrics["self_judge/consistency"] == [1.0, 0.0]


def test_self_judge_uses_the_trained_policy(tiny_trainer):
    """One GRPO step in which the policy judges its own groups: verdicts come from trainer.model (in eval mode, the
    training mode restored afterwards), and the judge metrics and both reward columns are logged."""
    plugin = SelfJudge(SelfJudgeParams(consistency_weight=0.5, max_new_tokens=3))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1})
    assert plugin.judge.trainer is trainer
    calls = []
    original_generate = judging.generate_sequences

    def spy(model, *args, **kwargs):
        before = model.training
        out = original_generate(model, *args, **kwargs)
        calls.append((len(args[1]), model is trainer.model, before, model.training))
        return out

    judging.generate_sequences = spy
    try:
        trainer.train()
    finally:
        judging.generate_sequences = original_generate
    assert calls == [(2 * 4 * 3, True, True, True)]  # 2 groups of G=4, G(G-1) verdicts each, in one call
    logged = [row for row in trainer.state.log_history if "self_judge/consistency" in row]
    assert logged and 0.0 <= logged[0]["self_judge/consistency"] <= 1.0
    assert "self_judge/unparsable" in logged[0] and "rewards/self_judge/mean" in logged[0]
    # joint training of the judging ran on the one micro-batch: all 24 verdicts, 1..3 tokens each
    assert torch.isfinite(torch.tensor(logged[0]["self_judge/judge_loss"]))
    assert 24 <= logged[0]["self_judge/judge_tokens"] <= 24 * 3
    assert 0.0 <= logged[0]["self_judge/judge_reward"] <= 1.0
    assert plugin._pending["cursor"] == 24  # every judge sample consumed once
    assert f"rewards/{CONSISTENCY}/mean" in logged[0]
    assert torch.isfinite(torch.tensor(logged[0]["rewards/self_judge/mean"]))


def test_policy_judge_generates_in_eval_mode_and_restores(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    modes = []
    handle = model.register_forward_pre_hook(lambda m, _a: modes.append(m.training))
    try:
        judging.generate_texts(model, tok, ["1+2=", "3"], max_new_tokens=2)
    finally:
        handle.remove()
    assert modes and not any(modes) and model.training


# joint training of the judging ------------------------------------------------------------------------------------

# one group of 3: jobs in pair_jobs order (0,1) (0,2) (1,0) (1,2) (2,0) (2,1); pair (0,1) consistent, (0,2)
# position-decided, (1,2) half unparsable -> verdict rewards [1, 0, 1, 0, 0, 0], mean 1/3
JUDGE_VERDICTS = {(0, 1): 1.0, (1, 0): 0.0, (0, 2): 1.0, (2, 0): 1.0, (1, 2): None, (2, 1): 0.0}
JUDGE_ADV = [2 / 3, -1 / 3, 2 / 3, -1 / 3, -1 / 3, -1 / 3]


def _judge_setup(tiny_model_dir, temperature=0.7, weight=1.0):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).train()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plugin = SelfJudge(SelfJudgeParams(temperature=temperature, judge_loss_weight=weight))
    plugin.judge.bind(SimpleNamespace(model=model, processing_class=tok))
    lengths = [(3, 1), (5, 2), (7, 3), (4, 3), (6, 1), (3, 2)]  # (prompt, verdict) token counts
    seqs = [(torch.randint(5, 80, (p,)).tolist(), torch.randint(5, 80, (v,)).tolist()) for p, v in lengths]
    plugin.judge.last_sequences = seqs
    rewards = plugin._record_judge_samples([[0, 1, 2]], [JUDGE_VERDICTS])
    return plugin, model, tok, seqs, rewards


def _loss_inputs(model, steps_per_generation=2, grad_accum_steps=2, training=True, num_processes=1):
    from types import SimpleNamespace

    return SimpleNamespace(training=training, steps_per_generation=steps_per_generation,
                           grad_accum_steps=grad_accum_steps, extra={"model": model}, metrics={},
                           num_processes=num_processes)


def _reference_judge_loss(model, seqs, advantages, temperature, normalizer):
    """Independent: each sequence unpadded, full log-softmax, sum of verdict-token log-probs."""
    total = 0.0
    for (prompt, verdict), adv in zip(seqs, advantages, strict=True):
        ids = torch.tensor([prompt + verdict])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double() / temperature, dim=-1)
        positions = range(len(prompt) - 1, len(prompt) + len(verdict) - 1)
        total = total + adv * sum(logp[t, ids[0, t + 1]] for t in positions)
    return -total / normalizer


def test_judge_rewards_advantages_and_term_match_independent_computation(tiny_model_dir):
    plugin, model, _tok, seqs, rewards = _judge_setup(tiny_model_dir)
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert torch.allclose(plugin._pending["advantages"].double(), torch.tensor(JUDGE_ADV, dtype=torch.float64))
    n_tokens = sum(len(v) for _, v in seqs)
    # two micro-batches per generation batch, GA 2: chunks of 3 samples, each over N * 2 / 2 tokens
    li = _loss_inputs(model)
    terms = [plugin.trl_ext_extra_loss(li), plugin.trl_ext_extra_loss(li)]
    assert plugin.trl_ext_extra_loss(li) is None  # each judge sample is used once
    for k, term in enumerate(terms):
        chunk = slice(3 * k, 3 * k + 3)
        ref = _reference_judge_loss(model, seqs[chunk], JUDGE_ADV[chunk], 0.7, n_tokens)
        assert abs(term.item() - ref.item()) < 1e-8
    from trl_ext.metrics import reduce_figures

    logged = reduce_figures(li.metrics)  # figures of every rank's tokens (one process here)
    assert logged["self_judge/judge_tokens"] == sum(len(v) for _, v in seqs[3:])
    last = _reference_judge_loss(model, seqs[3:], JUDGE_ADV[3:], 0.7, sum(len(v) for _, v in seqs[3:]))
    assert logged["self_judge/judge_loss"] == pytest.approx(last.item(), abs=1e-6)
    # GA scaling: one micro-batch per generation batch over 4 accumulation steps -> whole term / 4
    plugin._pending["cursor"] = 0
    whole = plugin.trl_ext_extra_loss(_loss_inputs(model, steps_per_generation=1, grad_accum_steps=4))
    ref = _reference_judge_loss(model, seqs, JUDGE_ADV, 0.7, n_tokens * 4)
    assert abs(whole.item() - ref.item()) < 1e-8
    # eval micro-batches and judge_loss_weight 0 add nothing
    plugin._pending["cursor"] = 0
    assert plugin.trl_ext_extra_loss(_loss_inputs(model, training=False)) is None
    off, *_ = _judge_setup(tiny_model_dir, weight=0.0)
    assert off._pending is None and off.trl_ext_extra_loss(_loss_inputs(model)) is None


def test_judge_gradients_flow_through_verdict_tokens_only(tiny_model_dir):
    plugin, model, _tok, seqs, _ = _judge_setup(tiny_model_dir)
    n_tokens = sum(len(v) for _, v in seqs)
    plugin.trl_ext_extra_loss(_loss_inputs(model, steps_per_generation=1, grad_accum_steps=1)).backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert got and any(g.abs().sum() > 0 for g in got.values())
    model.zero_grad(set_to_none=True)
    _reference_judge_loss(model, seqs, JUDGE_ADV, 0.7, n_tokens).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-10), name
    # the gradient is carried by the advantage-weighted verdict log-probs only: zero advantages, zero gradient
    model.zero_grad(set_to_none=True)
    plugin._pending["cursor"], plugin._pending["advantages"] = 0, torch.zeros(6)
    plugin.trl_ext_extra_loss(_loss_inputs(model, steps_per_generation=1, grad_accum_steps=1)).backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())


def test_policy_judge_makes_as_many_generate_calls_as_the_busiest_rank(tiny_model_dir):
    """Ranks can hold different numbers of judge texts (two equal prompts on one rank merge into one group of 2G:
    2G(2G-1) verdicts against 2G(G-1)); a ZeRO-3 policy's generate gathers weights collectively, so the rank with
    fewer calls fell out of step (2 processes, gloo: 'Is there a distributed collective mismatch'). Every rank now pads
    to the busiest rank's call count with placeholder calls whose output is dropped."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    calls = []
    original = model.generate
    model.generate = lambda **kwargs: calls.append(kwargs["input_ids"].shape[0]) or original(**kwargs)
    accelerator = SimpleNamespace(num_processes=2, device="cpu", unwrap_model=lambda m: m,
                                  gather=lambda t: torch.cat([t, torch.tensor([4])]))  # the other rank: 4 calls
    judge = judging.PolicyJudge(max_new_tokens=2, temperature=1.0, batch_size=2)
    judge.bind(SimpleNamespace(model=model, processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
                               accelerator=accelerator))
    replies = judge.generate(["1+2=", "3+4=", "5+6="])
    assert calls == [2, 1, 1, 1] and len(replies) == 3 and len(judge.last_sequences) == 3


def test_judge_term_forwards_on_every_first_pass_micro_batch_on_several_processes(tiny_model_dir):
    """A rank whose judge samples are used up (or that has none) still forwards on each micro-batch of the first pass,
    on a placeholder weighted 0, so a ZeRO-3 model's collective forwards stay in step across ranks and every rank
    logs the same figure keys; later passes (num_iterations > 1) add nothing on any rank."""
    plugin, model, _tok, _seqs, _ = _judge_setup(tiny_model_dir)
    plugin.judge.last_sequences = []  # nothing usable on this rank
    plugin._record_judge_samples([[0, 1, 2]], [JUDGE_VERDICTS])
    forwards = []
    handle = model.register_forward_pre_hook(lambda _m, _a: forwards.append(1))
    try:
        inputs = _loss_inputs(model, steps_per_generation=2, num_processes=2)
        terms = [plugin.trl_ext_extra_loss(inputs) for _ in range(3)]
    finally:
        handle.remove()
    assert len(forwards) == 2 and terms[2] is None
    assert all(t.item() == 0.0 and t.requires_grad for t in terms[:2])
    assert {"self_judge/judge_loss", "self_judge/judge_tokens"} <= set(inputs.metrics)
    # one process keeps the old rule: nothing to forward, nothing added
    plugin._record_judge_samples([[0, 1, 2]], [JUDGE_VERDICTS])
    assert plugin.trl_ext_extra_loss(_loss_inputs(model)) is None


def test_grpo_loss_with_judge_term_and_weight_zero_parity(tiny_trainer):
    """On a generated GRPO batch: weight 0 gives TRL's own loss; weight 1 adds exactly the independent judge term."""
    from trl import GRPOTrainer

    plugin = SelfJudge(SelfJudgeParams(max_new_tokens=3))
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"max_steps": 1})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by the train loop
    inputs = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(inputs)
    pending = plugin._pending
    assert pending is not None and len(pending["verdicts"]) == 24
    # the random tiny model's verdicts are mostly unparsable (all advantages 0): use non-zero advantages instead
    pending["advantages"] = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64)
    base = GRPOTrainer._compute_loss(trainer, trainer.model, out)
    with_judge = trainer._compute_loss(trainer.model, out)
    seqs = list(zip(pending["prompts"], pending["verdicts"], strict=True))
    ref = _reference_judge_loss(trainer.model, seqs, pending["advantages"].tolist(), 1.0, pending["tokens"])
    assert abs(ref.item()) > 1e-3 and abs((with_judge - base).item() - ref.item()) < 1e-5
    plugin.params = SelfJudgeParams(max_new_tokens=3, judge_loss_weight=0.0)
    pending["cursor"] = 0
    assert abs(trainer._compute_loss(trainer.model, out).item() - base.item()) < 1e-7


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_self_judge_under_zero3_with_uneven_judge_work_per_rank(tmp_path):
    """Four prompts, three of them equal, two per rank: one rank merges its two equal prompts into one group of 8
    (56 verdicts, 4 generate calls of 16), the other judges two groups of 4 (24 verdicts, 2 calls). Under ZeRO-3 on
    2 processes the step died in a collective mismatch; now it trains and logs the judge figures."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "fixed_rollouts_cli.py"  # deterministic completions
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n"
                            for p in ["What is 1+1?", "What is 1+1?", "What is 1+1?", "What is 2+3?"]))
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({
        "seed": 0, "name": "sj", "trainer": "grpo", "model": "embedded:tiny-qwen2", "dataset": {"source": str(data)},
        "plugins": ["grpo", "fixed_rollouts", {"self_judge": {"max_new_tokens": 4}}],
        "args": {"max_steps": 1, "per_device_train_batch_size": 8, "learning_rate": 0.1, "optim": "sgd",
                 "logging_steps": 1, "save_strategy": "no", "gradient_checkpointing": False, "num_generations": 4,
                 "max_completion_length": 8},
        "distributed": {"num_processes": 2, "backend": "zero3"}}))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             "29619", str(script), "train", str(recipe), "--output-dir", str(out)],
                            check=False, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "sj" / "metrics.jsonl").read_text().splitlines()]
    logged = next(row for row in rows if "self_judge/judge_tokens" in row)
    assert logged["self_judge/judge_tokens"] >= 56 + 24  # both ranks' verdicts, at least one token each


def test_joint_training_validation():
    with pytest.raises(ValueError, match="temperature > 0"):
        SelfJudgeParams(temperature=0.0)
    assert SelfJudgeParams(temperature=0.0, judge_loss_weight=0.0).temperature == 0.0
    rloo = StageSpec(trainer="rloo", model="x", dataset={"source": "embedded:arithmetic"})
    assert "judge_loss_weight: 0" in SelfJudge().trl_ext_validate_stage(rloo, [])[0]
    assert SelfJudge(SelfJudgeParams(judge_loss_weight=0.0)).trl_ext_validate_stage(rloo, []) is None
    assert SelfJudge().trl_ext_validate_stage(STAGE, []) is None


def test_judge_policy_loss_ignores_infinite_log_probs_at_padded_verdict_positions():
    logps = torch.tensor([[-0.5, -1.0, float("-inf")], [-2.0, float("-inf"), float("-inf")]], dtype=torch.float64,
                         requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages = torch.tensor([1.0, -2.0])
    loss = judge_policy_loss(logps, mask, advantages, normalizer=3.0)
    assert loss.item() == pytest.approx(-(1.0 * (-1.5) + -2.0 * (-2.0)) / 3.0)  # -sum_i A_i sum_t log pi / 3
    loss.backward()
    assert torch.isfinite(logps.grad).all() and (logps.grad[mask == 0] == 0).all()
    assert logps.grad[0, 0].item() == pytest.approx(-1.0 / 3.0) and logps.grad[1, 0].item() == pytest.approx(2.0 / 3.0)


def test_math_verify_gold_answers_with_an_escaped_dollar_or_missing():
    """MATH writes currency as "\\$18.90": the escaped dollar was read as a math delimiter, the gold did not parse and
    every completion of the row scored None. A missing gold (None, NaN) became the text "None", scored as a product
    of symbols: \\boxed{None} was correct."""
    from trl_ext_plugins.rewards.verify_math import math_verify_scores

    assert math_verify_scores(["\\boxed{18.90}", "\\boxed{7}", "$18.9$"], ["\\$18.90"] * 3) == [True, False, True]
    assert math_verify_scores(["\\boxed{32348}"], ["\\$32,348"]) == [True]
    assert math_verify_scores(["$3$"], ["$3$"]) == [True]  # an unescaped dollar still delimits
    assert math_verify_scores(["\\boxed{None}", "\\boxed{3}", "\\boxed{3}", "3"], [None, None, float("nan"), " "]) == \
        [None] * 4
    from trl_ext.embedded.arithmetic import exact_match_reward

    assert exact_match_reward(["3", "3", "3", "3"], ["3", None, float("nan"), ""]) == [1.0, None, None, None]


def test_pairwise_judges_refuse_groups_split_between_processes():
    """TRL requires whole groups over all processes only: 6 rows per process with num_generations 4 split a group in
    two, each process judging half of it (win rates 1.0 / 0.0 where one process gives 0.667 / 0.333)."""
    from trl_ext.recipe import StageSpec

    def stage(**args):
        return StageSpec(trainer="grpo", model="embedded:tiny-qwen2", dataset={"source": "embedded:arithmetic"},
                         args={"num_generations": 4, **args})

    split = judging.split_group_error(stage(per_device_train_batch_size=6), "llm_judge", num_processes=2)
    assert "holds 6 rows of a generation batch, which splits groups of num_generations=4" in split
    assert judging.split_group_error(stage(per_device_train_batch_size=6), "llm_judge", num_processes=1) is None
    assert judging.split_group_error(stage(per_device_train_batch_size=8), "llm_judge", num_processes=2) is None
    assert judging.split_group_error(stage(per_device_train_batch_size=2, steps_per_generation=2), "self_judge",
                                     num_processes=2) is None  # 4 rows per process per generation batch
    assert judging.split_group_error(stage(per_device_train_batch_size=8, generation_batch_size=12), "llm_judge",
                                     num_processes=2) is not None  # 6 rows per process


def test_judge_counts_are_batch_counts_after_trls_average_over_processes():
    """TRL's log_metric averages a value over the processes, so a count logged as is read as the count per process
    (2 unparsable verdicts on each of 2 processes logged as 2, not 4). Counts go out times the process count."""
    stats = judging.JudgeStats("llm_judge")
    stats.start()
    for text, parsed in (("x", None), ("y", None), ("Verdict: A", 1.0), (None, None)):
        stats.add(text, parsed)
    one, two = stats.metrics(1), stats.metrics(2)
    assert (one["llm_judge/unparsable"], one["llm_judge/request_errors"]) == (3.0, 1.0)
    trl_mean = (two["llm_judge/unparsable"] + two["llm_judge/unparsable"]) / 2  # two processes with the same counts
    assert trl_mean == 6.0 and two["llm_judge/unparsable_frac"] == one["llm_judge/unparsable_frac"] == 0.75
