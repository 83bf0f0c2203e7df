"""``self_play`` (ALGORITHMS.md item 50): R-Zero's uncertainty reward and Absolute Zero's learnability reward by hand,
majority vote, repetition penalty and the informative band; the proposer reward of a batch with a stand-in solver;
the solver's pseudo-labelled, band-filtered rows; the proposal dataset; bad parameters refused at validation."""

from __future__ import annotations

import json
import sys

import pytest

from trl_ext.embedded.arithmetic import solve
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext_plugins.rollout.control_math import (
    bleu_distance_matrix,
    in_informative_band,
    learnability_reward,
    majority_vote,
    r_zero_code_reward,
    repetition_penalties,
    uncertainty_reward,
    verified_solve_rate,
)
from trl_ext_plugins.rollout.datasets import arithmetic_proposals
from trl_ext_plugins.rollout.self_play import SelfPlay, solver_rows


def test_item_50_rewards_by_hand():
    assert uncertainty_reward(0.5) == 1.0
    assert uncertainty_reward(0.9) == pytest.approx(0.2)  # 1 - 2 * 0.4
    assert uncertainty_reward(0.0) == 0.0 and uncertainty_reward(1.0) == 0.0
    assert learnability_reward(0.25) == 0.75
    assert learnability_reward(1.0) == 0.0 and learnability_reward(0.0) == 0.0


def test_majority_vote_band_and_repetition():
    assert majority_vote(["3", "3", "4", ""]) == ("3", 0.5)  # the unparsed answer counts in the denominator
    assert majority_vote(["4", "3", "3", "4"]) == ("4", 0.5)  # tie: the answer seen first
    assert majority_vote(["", ""]) == (None, 0.0)
    assert in_informative_band(0.7, 0.2) and in_informative_band(0.3, 0.2) and not in_informative_band(0.75, 0.2)
    assert repetition_penalties(["1+2=", "1+2=", "3+4=", "5 + 5="]) == [0.5, 0.5, 0.25, 0.25]
    assert repetition_penalties([]) == []


def test_r_zero_code_reward_by_hand():
    """R-Zero's released caller_penalty.py: min(p, 1 - p) - share; -1 - share for a malformed problem; no clip."""
    assert r_zero_code_reward(0.5, 0.25) == 0.25
    assert r_zero_code_reward(0.9, 0.25) == pytest.approx(0.1 - 0.25)
    assert r_zero_code_reward(None, 0.2) == -1.2


def hand_bleu(hypothesis: str, reference: str) -> float:
    """Sentence BLEU-4 from its formula, with smoothing method 1 (a zero n-gram match count becomes 0.1): BP *
    exp(sum_n log(p_n) / 4), BP = exp(1 - r/c) when the hypothesis is shorter; 0 without a unigram match."""
    import math
    from collections import Counter

    hyp, ref = hypothesis.split(), reference.split()
    if not hyp:
        return 0.0
    logs = []
    for n in range(1, 5):
        grams = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
        ref_grams = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        matched = sum(min(c, ref_grams[g]) for g, c in grams.items())
        if n == 1 and matched == 0:
            return 0.0
        logs.append(math.log((matched or 0.1) / max(1, sum(grams.values()))))
    brevity = 1.0 if len(hyp) > len(ref) else math.exp(1 - len(ref) / len(hyp))
    return brevity * math.exp(sum(logs) / 4)


def test_bleu_distances_follow_the_formula():
    questions = ["what is 1 plus 2", "what is 1 plus 3", "what is 1 plus 3 ?", "how many legs has a spider", "7+8="]
    dist = bleu_distance_matrix(questions)
    for i in range(len(questions)):
        assert dist[i][i] == 0.0
        for j in range(i + 1, len(questions)):  # the earlier question is the hypothesis (R-Zero's order)
            assert dist[i][j] == dist[j][i] == pytest.approx(1 - hand_bleu(questions[i], questions[j]), abs=1e-12)
    assert dist[0][1] == pytest.approx(1 - (0.8 * 0.75 * 2 / 3 * 0.5) ** 0.25)  # 4/5, 3/4, 2/3, 1/2 n-grams match
    # a one-token problem and its exact duplicate: BLEU 0.1^(3/4) = 0.18 (three smoothed empty n-gram orders), so
    # distance 0.82, beyond R-Zero's 0.5 threshold
    assert bleu_distance_matrix(["7+8=", "7+8="])[0][1] == pytest.approx(1 - 0.1 ** 0.75)


def test_bleu_clusters_use_average_linkage_at_the_threshold():
    a, b, c = "what is 1 plus 2", "what is 1 plus 3", "how many legs has a spider"
    d_ab = 1 - hand_bleu(a, b)  # 0.331
    # a twice (distance 0) joins b at the average distance d_ab < 0.5; c shares no word with them (distance 1)
    assert repetition_penalties([a, b, c, a], "bleu") == [0.75, 0.75, 0.25, 0.75]
    # below d_ab only the duplicates merge
    assert repetition_penalties([a, b, c, a], "bleu", threshold=d_ab - 1e-6) == [0.5, 0.25, 0.25, 0.5]
    # average linkage: x - y 0.12, y - z 0.24, x - z 0.36, so {x, y} is 0.30 from z on average. At 0.25 single linkage
    # would chain z in (0.24); at 0.31 complete linkage would keep it out (0.36)
    x, y, z = "a b c d e f g h i j", "a b c d e f g h i k", "l m c d e f g h i k"
    dxy, dyz, dxz = 1 - hand_bleu(x, y), 1 - hand_bleu(y, z), 1 - hand_bleu(x, z)
    assert dxy < dyz < 0.25 < (dxz + dyz) / 2 < 0.31 < dxz
    assert repetition_penalties([x, y, z], "bleu", threshold=0.25) == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert repetition_penalties([x, y, z], "bleu", threshold=0.31) == pytest.approx([1.0, 1.0, 1.0])
    # one-token formal problems never come within 0.5 of themselves: only `exact` clusters them
    assert repetition_penalties(["1+2=", "1+2=", "3+4="], "bleu") == pytest.approx([1 / 3] * 3)
    assert repetition_penalties(["1+2=", "1+2=", "3+4="], "exact") == pytest.approx([2 / 3, 2 / 3, 1 / 3])


def test_solver_rows_keep_the_band_with_majority_labels():
    questions = ["1+2=", "2+2=", "9*9=", "5-7="]
    answers = [["3"] * 9 + ["4"],            # p_hat 0.9: too easy, dropped
               ["4"] * 5 + ["5"] * 5,        # p_hat 0.5: kept, label "4" (seen first)
               ["81", "80", "18", "81", "1", "", "81", "8", "2", "0"],  # 0.3: kept (|0.3 - 0.5| <= 0.25)
               [""] * 10]                    # nothing parsed: dropped
    assert solver_rows(questions, [majority_vote(a) for a in answers], band=(0.25, 0.75)) == [
        {"prompt": "2+2=", "answer": "4", "p_hat": 0.5},
        {"prompt": "9*9=", "answer": "81", "p_hat": 0.3},
    ]
    assert SelfPlay.Params(role="solver", partner="x", delta=0.2).solver_band() == (0.3, 0.7)
    released = SelfPlay.Params(role="solver", partner="x", band=[0.3, 0.8])  # R-Zero's solver_train.sh bounds
    assert [r["p_hat"] for r in solver_rows(questions, [majority_vote(a) for a in answers],
                                            released.solver_band())] == [0.5, 0.3]


def test_verified_labels_use_the_solve_rate():
    assert verified_solve_rate(["4", "4", "5", ""], "4") == ("4", 0.5)
    assert verified_solve_rate(["4", "4", "4", "5"], "5") == ("5", 0.25)  # the majority is wrong: the label is not
    assert verified_solve_rate(["4"], None) == (None, 0.0)  # the verifier rejected the problem
    plugin = SelfPlay(SelfPlay.Params(role="solver", partner="unused", labels="verifier", verifier="arithmetic"))
    questions = ["2+2=", "9*9=", "5-7=", "3+3="]
    answers = [["4"] * 5 + ["5"] * 5,              # solve rate 0.5: kept
               ["80"] * 7 + ["81"] * 3,            # majority 80 (p_hat 0.7) but solve rate 0.3: kept, label 81
               ["2"] * 10,                          # solve rate 0 (answer -2): dropped
               ["6"] * 8 + ["7", "5"]]              # solve rate 0.8: dropped
    assert solver_rows(questions, plugin.votes(questions, answers), band=(0.25, 0.75)) == [
        {"prompt": "2+2=", "answer": "4", "p_hat": 0.5},
        {"prompt": "9*9=", "answer": "81", "p_hat": 0.3},
    ]


def test_the_arithmetic_verifier_parses_and_never_evaluates():
    assert [solve(q) for q in ("12+34=", " 7 * 8 = ", "5-7=", "07+1=", "-3+4=")] == ["46", "56", "-2", "8", "1"]
    for text in ("12+34", "2**8=", "__import__('os')=", "1+2=3", "1/2=", "", "9" * 1001 + "+1="):
        assert solve(text) is None, text


class StandInSolver(SelfPlay):
    """The proposer's reward with a scripted solver: answers come from a table instead of a model."""

    table: dict[str, list[str]] = {}

    def _partner_model(self):
        return None, None

    def answers(self, model, tokenizer, questions, seed):
        return [self.table[q] for q in questions]


def test_proposer_reward_of_a_batch():
    plugin = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", samples=10,
                                           repetition_clustering="exact"))
    plugin.table = {"1+2=": ["3"] * 5 + ["4"] * 5,   # p_hat 0.5 -> r_unc 1
                    "7+8=": ["15"] * 9 + ["16"],     # p_hat 0.9 -> r_unc 0.2
                    "3+3=": ["6"] * 10}              # p_hat 1.0 -> 0
    prompts = ["1+", "1+", "7+", "3+", "4+"]
    completions = ["2=", "2=<eos>", "8=", "3=", "x"]  # "4+x" is malformed
    logged = {}
    rewards = plugin._proposer_reward(prompts, completions, log_metric=logged.__setitem__)
    # batch of B = 5, the malformed problem included: "1+2=" twice (share 2/5), the others once (1/5)
    assert rewards == pytest.approx([1 - 0.4, 1 - 0.4, max(0.0, 0.2 - 0.2), 0.0, 0.0])
    assert logged["self_play/valid"] == pytest.approx(0.8)
    assert logged["self_play/agreement"] == pytest.approx((0.5 + 0.5 + 0.9 + 1.0) / 4)
    assert logged["self_play/in_band"] == pytest.approx(0.5)  # the two 0.5s
    az = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", proposer_reward="absolute_zero"))
    az.table = plugin.table
    assert az._proposer_reward(prompts, completions) == pytest.approx([0.5, 0.5, 0.1, 0.0, 0.0])
    code = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", proposer_reward="r_zero_code",
                                         repetition_clustering="exact"))
    code.table = plugin.table  # min(p, 1 - p) - share, unclipped; the malformed problem -1 - share
    assert code._proposer_reward(prompts, completions) == pytest.approx([0.5 - 0.4, 0.5 - 0.4, 0.1 - 0.2, -0.2, -1.2])
    bleu = StandInSolver(SelfPlay.Params(role="proposer", partner="unused"))  # the default: BLEU clusters
    bleu.table = plugin.table  # one-token problems: every share is 1/5
    assert bleu._proposer_reward(prompts, completions) == pytest.approx([0.8, 0.8, 0.0, 0.0, 0.0])
    solver = SelfPlay(SelfPlay.Params(role="solver", partner="unused"))
    assert solver.trl_ext_reward_functions(stage=None) is None


def test_the_repetition_share_is_over_every_ranks_questions(monkeypatch):
    """TRL calls a reward function on each rank's rows: the share was taken over one rank's slice, so on 2 ranks a
    unique question paid 2/B and a duplicate on the other rank was not counted. Rank r now clusters the gathered batch
    and keeps its own slice, which equals the one-process rewards sliced."""
    import accelerate
    import accelerate.utils

    plugin = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", samples=10,
                                           repetition_clustering="exact"))
    plugin.table = {"1+2=": ["3"] * 5 + ["4"] * 5, "5+6=": ["11"] * 5 + ["12"] * 5}  # p_hat 0.5 -> r_unc 1
    prompts, completions = ["1+", "5+", "1+", "5+"], ["2=", "6=", "2=", "x"]
    one = plugin._proposer_reward(prompts, completions)
    assert one == pytest.approx([1 - 0.5, 1 - 0.25, 1 - 0.5, 0.0])  # "1+2=" twice in B = 4: 2/4
    halves = {0: (prompts[:2], completions[:2]), 1: (prompts[2:], completions[2:])}
    for rank, (rank_prompts, rank_completions) in halves.items():
        class TwoRanks:  # rank `rank` of 2, as PartialState reports it
            num_processes, process_index = 2, rank
        monkeypatch.setattr(accelerate, "PartialState", TwoRanks)
        everyone = [plugin.question_text(x, c) for x, c in zip(prompts, completions)]
        monkeypatch.setattr(accelerate.utils, "gather_object", lambda _mine, everyone=everyone: list(everyone))
        assert plugin._proposer_reward(rank_prompts, rank_completions) == pytest.approx(one[2 * rank:2 * rank + 2])


def test_a_malformed_copy_of_a_problem_is_its_own_cluster():
    """R-Zero's released reward (caller_penalty.py) clusters a malformed proposal as an empty question, a singleton:
    BLEU put two malformed near-copies of "1 + 2 =" in its cluster (share 3/4, reward 0.25); now its share is 1/4,
    and identical malformed copies no longer share a cluster either (r_zero_code: -1 - 1/4 each, not -1 - 2/4)."""
    bleu = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", samples=10))
    bleu.table = {"1 + 2 =": ["3"] * 5 + ["4"] * 5}  # p_hat 0.5 -> r_unc 1
    spaced = bleu._proposer_reward(["1 + ", "1 + ", "1 + ", "7 +"], ["2 =", "2 = x", "2 = y", "x"])
    assert spaced == pytest.approx([1 - 0.25, 0.0, 0.0, 0.0])
    plugin = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", samples=10,
                                           repetition_clustering="exact"))
    plugin.table = {"1+2=": ["3"] * 5 + ["4"] * 5}
    prompts, completions = ["1+", "1+", "1+", "7+"], ["2=", "2=x", "2=x", "x"]  # three malformed
    assert plugin._proposer_reward(prompts, completions) == pytest.approx([1 - 0.25, 0.0, 0.0, 0.0])
    code = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", proposer_reward="r_zero_code",
                                         repetition_clustering="exact"))
    code.table = plugin.table  # a malformed problem: -1 minus its singleton share 1/4
    assert code._proposer_reward(prompts, completions) == pytest.approx([0.5 - 0.25, -1.25, -1.25, -1.25])


def test_proposer_reward_with_verified_labels():
    """labels: verifier: p_hat is the solve rate against the verified answer; a problem the verifier rejects earns 0."""
    plugin = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", labels="verifier", verifier="arithmetic",
                                           question_pattern=r".*=$", repetition_clustering="exact"))
    plugin.table = {"1+2=": ["3"] * 5 + ["4"] * 5,   # solve rate 0.5 -> 1
                    "7+8=": ["16"] * 9 + ["15"],     # majority wrong: solve rate 0.1 -> 0.2
                    "1/0=": ["0"] * 10}              # matches the pattern, but not a problem of the task
    logged = {}
    rewards = plugin._proposer_reward(["1+", "7+", "1/"], ["2=", "8=", "0="], log_metric=logged.__setitem__)
    # batch of 3, each unique: share 1/3
    assert rewards == pytest.approx([1 - 1 / 3, max(0.0, 0.2 - 1 / 3), 0.0])
    assert logged["self_play/valid"] == pytest.approx(2 / 3)
    assert logged["self_play/solve_rate"] == pytest.approx((0.5 + 0.1) / 2)
    assert logged["self_play/agreement"] == logged["self_play/solve_rate"]
    # with majority labels the verifier only measures: 7+8= agrees at 0.9 but is solved at 0.1
    measured = StandInSolver(SelfPlay.Params(role="proposer", partner="unused", verifier="arithmetic"))
    measured.table = plugin.table
    logged = {}
    measured._proposer_reward(["1+", "7+"], ["2=", "8="], log_metric=logged.__setitem__)
    assert logged["self_play/agreement"] == pytest.approx((0.5 + 0.9) / 2)
    assert logged["self_play/solve_rate"] == pytest.approx((0.5 + 0.1) / 2)


def test_a_failing_verifier_is_named_in_one_line(tmp_path):
    path = tmp_path / "checker.py"
    path.write_text("def check(question):\n    return str(1 // 0)\n")
    plugin = SelfPlay(SelfPlay.Params(role="solver", partner="unused", labels="verifier", verifier=f"{path}:check"))
    with pytest.raises(ValueError, match=r"verifier .*checker.py:check' raised ZeroDivisionError: .* on the problem "
                                         r"'1\+2='"):
        plugin.verified_answer("1+2=")  # the solver's reward is exact_match on the labels


def test_proposal_dataset():
    rows = arithmetic_proposals("train", format="prompt_completion", size=4)
    assert all(r["prompt"].endswith("+") and r["completion"].endswith("=<eos>") for r in rows)
    from trl_ext.embedded.arithmetic import arithmetic_dataset

    assert [r["prompt"] + r["completion"][:-5] for r in rows] == arithmetic_dataset("train", "prompt", size=4)["prompt"]


@pytest.mark.parametrize("params, message", [
    ({"role": "proposer"}, "params.partner: Field required"),
    ({"role": "judge", "partner": "x"}, "params.role"),
    ({"role": "solver", "partner": "x", "delta": 0.7}, "params.delta"),
    ({"role": "solver", "partner": "x", "question_pattern": "("}, "question_pattern is not a valid regular expression"),
    ({"role": "solver", "partner": "x", "labels": "verifier"}, "labels: verifier needs a verifier"),
    ({"role": "solver", "partner": "x", "verifier": "no_such_module.solve"}, "verifier 'no_such_module.solve'"),
    ({"role": "solver", "partner": "x", "labels": "oracle", "verifier": "arithmetic"}, "params.labels"),
    ({"role": "solver", "partner": "x", "band": [0.8, 0.3]}, "band must satisfy 0 <= low <= high <= 1"),
    ({"role": "proposer", "partner": "x", "repetition_clustering": "rouge"}, "params.repetition_clustering"),
    ({"role": "proposer", "partner": "x", "repetition_threshold": 0}, "params.repetition_threshold"),
])
def test_bad_parameters_are_refused(trl_ext_catalog, register_plugin, params, message):
    register_plugin(SelfPlay)
    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic"},
                      plugins=[{"self_play": params}])
    with pytest.raises(RecipeError) as err:
        resolve_stage(stage, 0, trl_ext_catalog)
    assert message in str(err.value) and "self_play" in str(err.value)


def test_solver_dataset_from_real_models(tiny_model_dir):
    """Plumbing on the untrained tiny models: loose patterns so its random text counts as problems and answers."""
    plugin = SelfPlay(SelfPlay.Params(role="solver", partner=tiny_model_dir, num_questions=12, samples=4, delta=0.5,
                                      question_pattern=r"^\d+\+.+", answer_pattern=r"\S"))
    stage = StageSpec(trainer="grpo", model=tiny_model_dir, dataset={"source": "embedded:arithmetic_proposals"})
    prompts = arithmetic_proposals("train", size=5)
    rows = plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)
    assert 0 < len(rows) <= 12 and set(rows.column_names) == {"prompt", "answer", "p_hat"}
    assert all(r["prompt"].split("+")[0] + "+" in prompts["prompt"] for r in rows)  # prompt + proposed completion
    assert all(r["p_hat"] in (0.25, 0.5, 0.75, 1.0) for r in rows)  # m = 4 answers
    assert plugin.history[-1]["self_play/generated"] == 12
    assert plugin.trl_ext_prepare_dataset(dataset=prompts, split="eval", stage=stage) is None

    strict = SelfPlay(SelfPlay.Params(role="solver", partner=tiny_model_dir, num_questions=4, samples=2))
    with pytest.raises(ValueError, match="wrote no well-formed problem in 4 tries"):
        strict.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)


@pytest.mark.slow
def test_proposer_grpo_steps_with_a_real_solver(tiny_trainer, tiny_model_dir):
    """Plumbing: the proposer role's reward samples the partner solver during GRPO and logs the self-play figures."""
    plugin = SelfPlay(SelfPlay.Params(role="proposer", partner=tiny_model_dir, samples=4,
                                      question_pattern=r"^\d+\+.+"))  # loose: the untrained proposer writes noise
    trainer = tiny_trainer("grpo", plugins=[plugin], dataset=arithmetic_proposals("train", size=16),
                           args={"max_steps": 2})
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    assert {"rewards/self_play/mean", "self_play/valid", "self_play/agreement", "self_play/in_band"} <= logged
    assert len(plugin.history) == 2


def test_label_accuracy_of_majority_labels_is_measured_and_logged_once(monkeypatch, tmp_path):
    """With majority labels and a verifier, the solver's record says how often the kept pseudo-labels are right; it
    reaches metrics.jsonl with step 1 only (a resumed run starts later and must not log it again)."""
    from types import SimpleNamespace

    from trl_ext_plugins.preference import generation
    from trl_ext_plugins.rollout.self_play import _LogDatasetFigures

    proposals = {"1+": "2=", "2+": "2=", "3+": "x"}  # "3+x" is malformed
    monkeypatch.setattr(generation, "sample_completions",
                        lambda model, tok, prompts, **kw: [[proposals[p]] for p in prompts])
    monkeypatch.setattr(generation, "load_policy", lambda path: (None, None))
    monkeypatch.setattr(generation, "resolve_model", lambda ref, name: ref)
    plugin = StandInSolver(SelfPlay.Params(role="solver", partner="unused", num_questions=3, verifier="arithmetic"))
    plugin.table = {"1+2=": ["3"] * 5 + ["2"] * 5,   # majority "3" (seen first), right
                    "2+2=": ["5"] * 6 + ["4"] * 4}   # majority "5", wrong
    from datasets import Dataset

    rows, record = plugin._solver_rows(Dataset.from_list([{"prompt": p} for p in proposals]),
                                       SimpleNamespace(model="unused", evaluation=None))
    assert [(r["prompt"], r["answer"]) for r in rows] == [("1+2=", "3"), ("2+2=", "5")]
    assert record == {"self_play/generated": 3, "self_play/valid": 2, "self_play/held_out_dropped": 0,
                      "self_play/kept": 2, "self_play/label_accuracy": 0.5}
    assert all("verified" not in r for r in rows)  # the true answer never reaches the training rows

    # After the stage, what it trained on is saved for inspection, with the verified answers beside the labels.
    plugin.trl_ext_after_stage(stage=None, output_dir=str(tmp_path), trainer=None)
    saved = [json.loads(line) for line in (tmp_path / "self_play_rows.jsonl").read_text().splitlines()]
    assert saved == [{"prompt": "1+2=", "answer": "3", "p_hat": 0.5, "verified": "3"},
                     {"prompt": "2+2=", "answer": "5", "p_hat": 0.6, "verified": "4"}]

    logged = []
    callback = _LogDatasetFigures(SimpleNamespace(_log_plugin_metrics=logged.append), record)
    for step in (1, 2, 3):
        callback.on_step_end(None, SimpleNamespace(global_step=step), None)
    assert logged == [record]


def test_held_out_problems_are_never_trained_on(monkeypatch, tmp_path):
    """A proposer can write a held-out problem (one in 12 of the embedded task's problems is held out): the solver
    drops it before answering, whitespace aside, and counts it; with ``exclude_held_out: false`` it is kept."""
    import json

    from datasets import Dataset

    from trl_ext.recipe import StageSpec
    from trl_ext_plugins.preference import generation

    proposals = {"1+": "2=", "2+": " 2 =", "3+": "3="}
    monkeypatch.setattr(generation, "sample_completions",
                        lambda model, tok, prompts, **kw: [[proposals[p]] for p in prompts])
    monkeypatch.setattr(generation, "load_policy", lambda path: (None, None))
    monkeypatch.setattr(generation, "resolve_model", lambda ref, name: ref)
    held_out = tmp_path / "held_out.jsonl"
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "7+1=", "answer": "8"}]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    stage = StageSpec(trainer="grpo", model="unused", dataset={"source": "embedded:arithmetic_proposals"},
                      evaluation={"dataset": {"source": str(held_out)}, "reward": "exact_match"})
    table = {"1+2=": ["3"] * 6 + ["4"] * 4, "2+ 2 =": ["4"] * 6 + ["5"] * 4, "3+3=": ["6"] * 6 + ["5"] * 4}
    for exclude, kept in ((True, ["1+2=", "3+3="]), (False, ["1+2=", "2+ 2 =", "3+3="])):
        plugin = StandInSolver(SelfPlay.Params(role="solver", partner="unused", num_questions=3,
                                               exclude_held_out=exclude))
        plugin.table = table
        rows, record = plugin._solver_rows(Dataset.from_list([{"prompt": p} for p in proposals]), stage)
        assert [r["prompt"] for r in rows] == kept
        assert record["self_play/valid"] == 3 and record["self_play/held_out_dropped"] == (1 if exclude else 0)


@pytest.mark.slow
def test_verified_self_play_recipe_raises_the_solver_and_moves_the_proposer(tmp_path):
    """configs/self_play_verified.yaml in full (about 3.5 min on 2 cores): the issue's two claims on the embedded task.

    Measured on this recipe (transformers 5.25): held-out greedy 0.415 -> 0.430 -> 0.460 (200 problems, so the rise is
    9 problems), and the proposer's solve rate 0.141 -> 0.295 from round 1's first logged step to round 2's last. The
    solvers drop the proposed problems that are held out (about 135 a round) and say so."""
    import json
    from pathlib import Path

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import load_raw, parse_recipe
    from trl_ext.runner import run_recipe

    recipe = parse_recipe(load_raw(Path(__file__).resolve().parents[1] / "configs" / "self_play_verified.yaml"))
    info = run_recipe(recipe, tmp_path, Catalog.discover(), echo=lambda _m: None)
    assert info["status"] == "complete"

    def held_out(stage: str, when: str) -> float:
        return json.loads((tmp_path / stage / "stage.json").read_text())["summary"]["eval"][when]["accuracy"]

    start, first_round, second_round = held_out("solver_1", "before"), held_out("solver_1", "after"), \
        held_out("solver_2", "after")
    assert start == held_out("solver_0", "after")
    assert second_round > start, (start, first_round, second_round)

    def solve_rates(stage: str) -> list[float]:
        rows = [json.loads(line) for line in (tmp_path / stage / "metrics.jsonl").read_text().splitlines()]
        return [row["self_play/solve_rate"] for row in rows if "self_play/solve_rate" in row]

    first, last = solve_rates("proposer_1")[0], solve_rates("proposer_2")[-1]
    assert abs(last - 0.5) < abs(first - 0.5), (first, last)  # closer to the solver's 50% boundary
    made = json.loads((tmp_path / "solver_1" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < made["self_play/kept"] <= made["self_play/valid"] <= made["self_play/generated"] == 2048
    assert 0 < made["self_play/held_out_dropped"] < made["self_play/valid"] - made["self_play/kept"]



@pytest.mark.slow
def test_majority_vote_self_play_raises_the_solvers_sampled_accuracy(tmp_path):
    """configs/self_play_chain.yaml's first round (R-Zero's majority-vote pseudo-labels, no answer key in training),
    its solver cut to 1500 steps (about 7 min on 2 cores): the solver's held-out sampled accuracy (mean of 8 answers
    at T = 0.7 on 500 held-out problems) rises although part of its kept labels are wrong.

    Measured at these settings on an AMD EPYC runner: 0.511 -> 0.556 (GRPO seed 1: 0.576), labels right 83%. With
    the paper's band 0.5 +- 0.25 instead (labels right 71%) the rise was 0.021 / 0.012 (seeds 0 / 1), too close to the
    run-to-run spread to test, and 0.077 on an earlier runner: the recipe keeps the problems where at least half the
    answers agree."""
    import json
    from pathlib import Path

    from trl_ext.catalog import Catalog
    from trl_ext.recipe import load_raw, parse_recipe
    from trl_ext.runner import run_recipe

    raw = load_raw(Path(__file__).resolve().parents[1] / "configs" / "self_play_chain.yaml")
    raw["stages"] = [s for s in raw["stages"] if s["name"] in ("solver_0", "proposer_0", "proposer_1", "solver_1")]
    raw["stages"][-1]["args"] = {**raw["stages"][-1]["args"], "max_steps": 1500, "save_steps": 1500}
    info = run_recipe(parse_recipe(raw), tmp_path, Catalog.discover(), echo=lambda _m: None)
    assert info["status"] == "complete"

    evaluation = json.loads((tmp_path / "solver_1" / "stage.json").read_text())["summary"]["eval"]
    before, after = evaluation["before"], evaluation["after"]
    assert before["sampled_n"] == after["sampled_n"] == 4000
    assert after["sampled_accuracy"] > before["sampled_accuracy"] + 0.02, (before, after)
    made = json.loads((tmp_path / "solver_1" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0.6 < made["self_play/label_accuracy"] < 0.95  # pseudo-labels, some wrong: no answer key was used


def test_bleu_clusters_without_their_libraries_are_refused_in_one_line(monkeypatch):
    """The default BLEU clustering needs the self-play extra; without it the parameters are refused before any model
    loads, with the install command and the way out."""
    monkeypatch.setitem(sys.modules, "sklearn.cluster", None)  # import fails as if scikit-learn were missing
    with pytest.raises(ValueError, match=r"repetition_clustering: bleu needs NLTK and scikit-learn .*pip install "
                                         r"'trl-ext\[self-play\]' or set repetition_clustering: exact"):
        SelfPlay.Params(role="proposer", partner="x")
    assert SelfPlay.Params(role="proposer", partner="x", repetition_clustering="exact")  # no library needed
    assert SelfPlay.Params(role="solver", partner="x")  # the solver role never clusters


def test_chain_task_rows_are_worked_sums_in_varied_orders():
    from trl_ext_plugins.rollout.datasets import arithmetic_chain, arithmetic_chain_proposals, chain_of_steps, solve_sum

    train, test = arithmetic_chain("train"), arithmetic_chain("test", format="prompt")
    assert (len(train), len(test)) == (8000 - 500, 500)  # all 20^3 ordered triples, 500 held out
    assert not set(train["prompt"]) & set(test["prompt"]) and "completion" not in test.column_names
    firsts = set()
    for row in train.select(range(300)):
        a, b, c = (int(x) for x in row["prompt"][:-1].split("+"))
        steps = row["completion"].removesuffix("<eos>")
        first, second = steps.split(",")
        x, y = (int(v) for v in first.split("=")[0].split("+"))
        partial = int(first.split("=")[1])
        assert sorted([x, y, int(second.split("+")[1].split("=")[0])]) == sorted([a, b, c])
        assert partial == x + y and second == f"{partial}+{a + b + c - partial}={a + b + c}"
        assert row["answer"] == str(a + b + c) == solve_sum(row["prompt"])
        if len({a, b, c}) == 3:  # which two positions were added first
            firsts.add(frozenset(i for i, v in enumerate((a, b, c)) if v in (x, y)))
    assert firsts == {frozenset({0, 1}), frozenset({0, 2}), frozenset({1, 2})}  # every pair comes first somewhere
    assert chain_of_steps(12, 7, 5) == chain_of_steps(12, 7, 5) and arithmetic_chain("train")[:5] == train[:5]
    proposals = arithmetic_chain_proposals("train", format="prompt_completion", size=3)
    assert [p + c.removesuffix("<eos>") for p, c in zip(proposals["prompt"], proposals["completion"])] == \
        train["prompt"][:3]
    assert [solve_sum(q) for q in ("1+2+3=", " 10 + 20 + 30 = ", "4+5=", "1+2+3", "1+-2+3=", "1*2+3=", "")] == \
        ["6", "60", "9", None, None, None, None]
    assert solve_sum("9" * 101 + "+1+1=") is None  # never parses a huge generated number


def test_chain_answers_are_read_after_the_last_equals_sign():
    """The chain recipe's answer pattern: the number ending the text right after an "=" (a chain cut short, or with
    text after its last number, has no answer)."""
    plugin = SelfPlay(SelfPlay.Params(role="solver", partner="x", answer_pattern=r"(?<![^=])-?\d+(?=\s*$)"))
    import re

    pattern = re.compile(plugin.params.answer_pattern)
    found = [(m.group() if (m := pattern.search(t)) else "") for t in
             ("12+5=17,17+7=24", "24", "12+5=17,17+", "12+5=17,17+7=24\n", "12+5=17,17+7=", "7+5=12,12+12=24x")]
    assert found == ["24", "24", "", "24", "", ""]


def test_fewer_solver_rows_than_one_generation_batch_is_an_error(monkeypatch):
    """TRL's sampler drops an incomplete generation batch: 1 problem in the band with 2 prompts per generation batch
    (8 completions / 4 generations) trained the solver zero steps and ended the stage as if it had trained."""
    from datasets import Dataset

    stage = StageSpec(trainer="grpo", model="m", dataset={"source": "embedded:arithmetic_proposals"},
                      args={"per_device_train_batch_size": 8, "num_generations": 4})
    plugin = SelfPlay(SelfPlay.Params(role="solver", partner="unused"))
    rows = [{"prompt": "1+2=", "answer": "3", "p_hat": 0.5}, {"prompt": "2+2=", "answer": "4", "p_hat": 0.6}]
    record = {"self_play/valid": 2}
    monkeypatch.setattr(plugin, "_solver_rows", lambda dataset, stage: (rows[:1], record))
    prompts = Dataset.from_list([{"prompt": "1+"}])
    with pytest.raises(ValueError, match="only 1 problems lie in the band, fewer than the 2 prompts"):
        plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)
    monkeypatch.setattr(plugin, "_solver_rows", lambda dataset, stage: (rows, record))
    assert plugin.trl_ext_prepare_dataset(dataset=prompts, split="train", stage=stage)["prompt"] == ["1+2=", "2+2="]
