"""``self_play``: a proposer rewarded for problems at the solver's 50% boundary; a solver trained on them with
majority-vote pseudo-labels (R-Zero). The two roles alternate as stages of one recipe."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from transformers import TrainerCallback

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rollout.control_math import (
    learnability_reward,
    majority_vote,
    r_zero_code_reward,
    repetition_penalties,
    uncertainty_reward,
    verified_solve_rate,
    within_band,
)


def solver_rows(questions: list[str], votes: list[tuple[str | None, float]],
                band: tuple[float, float]) -> list[dict[str, Any]]:
    """The solver's training rows: each problem with its label and ``p_hat`` (from :func:`majority_vote` or
    :func:`verified_solve_rate`), kept only when it has a label and ``low <= p_hat <= high`` (R-Zero's informative
    band, ``band = (low, high)``)."""
    rows = []
    for question, (label, p_hat) in zip(questions, votes, strict=True):
        if label is not None and within_band(p_hat, *band):
            rows.append({"prompt": question, "answer": label, "p_hat": p_hat})
    return rows


ROWS_FILE = "self_play_rows.jsonl"
BUILTIN_VERIFIERS = {"arithmetic": "trl_ext.embedded.arithmetic.solve",
                     "arithmetic_chain": "trl_ext_plugins.rollout.datasets.solve_sum"}


def load_verifier(spec: str) -> Callable[[str], Any]:
    """The verifier function ``spec`` names: a built-in name (:data:`BUILTIN_VERIFIERS`), ``module.function`` or
    ``file.py:function``; ``ValueError`` with one line when it cannot be loaded."""
    from trl_ext_plugins.rewards.python_reward import load_reward_function

    return load_reward_function(BUILTIN_VERIFIERS.get(spec, spec))


class SelfPlayParams(PluginParams):
    role: Literal["proposer", "solver"] = Field(description="proposer: GRPO on problem generation, rewarded by the "
                                                            "partner solver's uncertainty; solver: GRPO on problems the "
                                                            "partner proposer generates, labelled by majority vote.")
    partner: str = Field(description="The other role's model (stage:<name>, embedded:<name> or a path): the solver "
                                     "that answers a proposer's problems, or the proposer that writes a solver's.")
    samples: int = Field(10, ge=2, description="m: solver answers per problem (R-Zero: 10).")
    delta: float = Field(0.25, ge=0.0, le=0.5, description="Solver filter band |p_hat - 1/2| <= delta (R-Zero's "
                                                           "paper: 0.25).")
    band: tuple[float, float] | None = Field(None, description="Explicit solver filter bounds [low, high] on p_hat "
                                             "instead of 1/2 +- delta (R-Zero's released solver script keeps "
                                             "[0.3, 0.8]).")
    proposer_reward: Literal["r_zero", "r_zero_code", "absolute_zero"] = Field(
        "r_zero", description="r_zero: max(0, 1 - 2|p_hat - 1/2| - repetition penalty), 0 for a malformed problem "
                              "(the paper, the default); r_zero_code: min(p_hat, 1 - p_hat) - penalty, -1 - penalty "
                              "for a malformed problem, unclipped (R-Zero's released code); absolute_zero: "
                              "1 - p_hat if 0 < p_hat < 1 else 0 (the learnability reward: p_hat is the solve rate "
                              "with labels: verifier, as in Absolute Zero; the majority agreement stands in for it "
                              "with labels: majority).")
    repetition_clustering: Literal["bleu", "exact"] = Field(
        "bleu", description="How the repetition penalty clusters the batch's problems. bleu: R-Zero's 1 - BLEU "
                            "distance (NLTK, whitespace tokens) and average-linkage clustering at "
                            "repetition_threshold (scikit-learn; pip install 'trl-ext[self-play]'), the default; "
                            "exact: identical problems (after whitespace normalisation), for short formal problems, "
                            "whose single whitespace token never comes within BLEU distance 0.5 of itself.")
    repetition_threshold: float = Field(0.5, gt=0.0, le=1.0, description="bleu clustering: clusters stop merging at "
                                                                          "this average 1 - BLEU distance (R-Zero: "
                                                                          "0.5).")
    labels: Literal["majority", "verifier"] = Field(
        "majority", description="Where answers' labels come from. majority: the most frequent of the m answers, with "
                                "p_hat its share (R-Zero, the default); verifier: the `verifier` function's answer, "
                                "with p_hat the share of the m answers equal to it, the solve rate (Absolute Zero's "
                                "executor-checked tasks). Problems the verifier rejects earn 0 and are not trained on.")
    verifier: str | None = Field(None, description="A function problem text -> answer, None for a text that is not a "
                                 "valid problem: 'arithmetic' (the embedded task's, "
                                 "trl_ext.embedded.arithmetic.solve), "
                                 "module.function or file.py:function. Required by labels: verifier; with labels: "
                                 "majority it only measures the pseudo-labels (self_play/label_accuracy).")
    repetition_weight: float = Field(1.0, ge=0.0, description="Weight of the batch repetition penalty (r_zero).")
    question_pattern: str = Field(r"^\s*\d+\s*[-+*]\s*\d+\s*=\s*$", description="Regex a well-formed problem must "
                                  "match (format-invalid problems earn 0). Default: the embedded arithmetic format.")
    answer_pattern: str = Field(r"-?\d+", description="Regex whose first match in a solver answer is the answer.")
    prompt_is_prefix: bool = Field(True, description="The problem is prompt + completion (the proposer completes a "
                                                     "prefix such as '12+'); false: the completion alone.")
    num_questions: int = Field(256, ge=1, description="Solver role: problems generated (one per dataset prompt, "
                                                      "cycling).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature of generated problems and answers.")
    question_max_new_tokens: int = Field(6, ge=1, description="Tokens per generated problem (solver role).")
    answer_max_new_tokens: int = Field(6, ge=1, description="Tokens per solver answer.")
    seed: int = Field(0, description="Seed of the sampling RNG.")
    exclude_held_out: bool = Field(True, description="Solver role: drop proposed problems that are prompts of the "
                                                     "stage's held-out evaluation (evaluation.dataset; compared "
                                                     "without whitespace) before they are answered, so the held-out "
                                                     "score never counts a problem the solver trained on.")

    @model_validator(mode="after")
    def _patterns_compile(self):
        for name in ("question_pattern", "answer_pattern"):
            try:
                re.compile(getattr(self, name))
            except re.error as exc:
                raise ValueError(f"{name} is not a valid regular expression: {exc}") from None
        return self

    @model_validator(mode="after")
    def _band_is_ordered(self):
        if self.band is not None and not 0.0 <= self.band[0] <= self.band[1] <= 1.0:
            raise ValueError(f"band must satisfy 0 <= low <= high <= 1, got {list(self.band)}")
        return self

    @model_validator(mode="after")
    def _bleu_clustering_installed(self):
        if self.repetition_clustering == "bleu" and self.role == "proposer":
            try:
                import nltk.translate.bleu_score  # noqa: F401
                import sklearn.cluster  # noqa: F401
            except ImportError as exc:
                raise ValueError(f"repetition_clustering: bleu needs NLTK and scikit-learn ({exc}); pip install "
                                 "'trl-ext[self-play]' or set repetition_clustering: exact") from None
        return self

    def solver_band(self) -> tuple[float, float]:
        """The kept p_hat range: ``band`` or ``1/2 +- delta``."""
        return tuple(self.band) if self.band is not None else (0.5 - self.delta, 0.5 + self.delta)

    @model_validator(mode="after")
    def _verifier_loads(self):
        if self.labels == "verifier" and self.verifier is None:
            raise ValueError("labels: verifier needs a verifier (e.g. verifier: arithmetic)")
        if self.verifier is not None:
            try:
                load_verifier(self.verifier)  # import errors surface at validation, before any model loads
            except ValueError as exc:
                raise ValueError(f"verifier {self.verifier!r}: {exc}") from None
        return self


class SelfPlay(Plugin):
    """Self-play curriculum at the solver's 50% boundary: R-Zero (Huang et al. 2025, arXiv 2508.05004); Absolute
    Zero's verified answers and learnability reward as options (Zhao et al. 2025, arXiv 2505.03335). ALGORITHMS.md
    item 50.

    ``role: proposer`` adds one reward function, ``self_play``: each proposed problem (``prompt + completion`` by
    default, so a proposer can complete a prefix such as ``12+``) that matches ``question_pattern`` is answered
    ``samples`` times (m, default 10) by the ``partner`` solver; ``p_hat`` is the share agreeing with the label, and the
    reward is ``max(0, 1 - 2|p_hat - 1/2| - repetition_weight * |C| / B)``; a malformed problem earns 0. ``|C| / B`` is
    the share of the reward call's batch (B problems, malformed ones included; per rank) in the problem's cluster;
    only well-formed problems are clustered, a malformed one is a cluster of its own (R-Zero's code clusters it as an
    empty question, at distance 1 from every other), so a malformed near-copy does not raise a valid problem's share.
    ``proposer_reward: r_zero_code`` uses R-Zero's released code instead (``min(p_hat, 1 - p_hat) - |C| / B``, and
    ``-1 - |C| / B`` for a malformed problem, unclipped: the paper's uncertainty term halved); ``absolute_zero`` uses
    ``1 - p_hat`` for ``0 < p_hat < 1``. Logged: ``self_play/agreement`` (mean p_hat of valid problems),
    ``self_play/valid``, ``self_play/in_band`` (share of valid problems in the solver's band) and, with a ``verifier``,
    ``self_play/solve_rate`` (the solver's true accuracy on them).

    Clusters (``repetition_clustering``): ``bleu`` (default, R-Zero's paper and code) clusters by ``1 - BLEU`` with
    average linkage, stopping at ``repetition_threshold`` (0.5), with R-Zero's choices: NLTK sentence BLEU with
    smoothing method 1 on whitespace tokens, the earlier problem of a pair as hypothesis, scikit-learn's agglomerative
    clustering. ``exact`` clusters identical problems: for short formal problems such as ``12+34=``, one whitespace
    token whose BLEU with itself is 0.18, so ``bleu`` would never cluster even exact duplicates (the embedded recipes
    set ``exact``).

    ``role: solver`` replaces the train split: ``num_questions`` problems are sampled from the ``partner`` proposer
    (one per dataset prompt, cycling), well-formed ones are answered m times by the stage's own (starting) solver, the
    label becomes the ``answer`` column (a binary reward such as ``exact_match`` then scores against it) and only
    problems with ``|p_hat - 1/2| <= delta`` (default 0.25, the paper's; ``band: [0.3, 0.8]`` gives the released
    script's bounds) are kept; ``p_hat`` is added as a column (fewer kept problems than one generation batch is an
    error: TRL's sampler would drop the incomplete batch and train zero steps). A proposed problem that is a prompt of the stage's
    held-out evaluation (whitespace aside) is dropped before it is answered (``exclude_held_out``, on by default): the
    proposer may write any problem, held-out ones included, and a solver trained on them would inflate its held-out
    score, with verified labels above all. How the rows were made (``self_play/generated``, ``valid``,
    ``held_out_dropped``, ``kept`` and, for majority labels with a verifier, ``label_accuracy``) is logged with step 1,
    and the kept rows (problem, label, p_hat and, with a verifier, the verified answer) are saved in the stage's
    ``self_play_rows.jsonl``.
    Alternation: stages ``proposer_1`` (partner: the solver), ``solver_1`` (partner: stage:proposer_1),
    ``proposer_2`` (partner: stage:solver_1), ... in one recipe (configs/self_play.yaml).

    Labels, where the papers differ (``labels``):

    * ``majority`` (default, R-Zero): the most frequent parsed answer is the pseudo-label and p_hat its share. No
      answer key is needed, and the labels are only as good as the solver's vote;
    * ``verifier`` (Absolute Zero, whose code executor computes each proposed task's answer): the ``verifier``
      function answers the problem (``arithmetic``: the embedded task's parser, which never evaluates the text),
      p_hat is the share of the m answers equal to it (the solve rate, Absolute Zero's ``r_solve``), and problems it
      rejects earn 0 and are not trained on. With ``labels: majority`` a ``verifier`` only measures (``solve_rate``,
      ``label_accuracy``).

    Other conventions chosen: answers are the first ``answer_pattern`` match of a completion (empty when none: it counts
    in p_hat's denominator but never wins the vote); ties in the vote go to the answer seen first; answers and labels
    compare as strings; sampling draws from the full distribution at ``temperature`` with a fixed ``seed`` (forked
    RNG). The partner model is loaded once per stage with ``from_pretrained`` defaults (CPU), next to the trained
    policy. Not implemented: R-Zero's ``<question>`` and ``\\boxed{}`` tags (``question_pattern`` and
    ``answer_pattern`` take their place).

    Measured on the embedded tasks (configs/self_play*.yaml, one run each, held-out problems dropped): with verified
    labels the solver rises (one-step addition, greedy 0.415 -> 0.430 -> 0.460, the proposer's solve rate 0.141 ->
    0.295). With majority labels on the chain task (embedded:arithmetic_chain, where the vote beats the greedy answer)
    the vote is right 38% / 55% / 72% / 86% of the time at p_hat 0.3 / 0.4 / 0.5 / 0.6, so the recipe keeps ``band:
    [0.5, 0.8]``: greedy / sampled mean@8 at T = 0.7 go 0.714 / 0.511 -> 0.738 / 0.640 -> 0.694 / 0.657 over two rounds
    (labels right 83%, then 68%); with the paper's band round 1 reached 0.634 / 0.531 on the same runner (labels right
    71%). Round 2 loses greedy accuracy as its labels worsen, the iteration decline R-Zero reports. On one-step
    addition the vote is worse than the greedy answer at every temperature and the solver falls (greedy 0.415 -> 0.305
    -> 0.250). The recipes' headers have the variants measured and how much the figures move between CPUs.
    """

    name = "self_play"
    family = "rollout"
    trainers = frozenset({"grpo"})
    Params = SelfPlayParams

    def __init__(self, params=None):
        super().__init__(params)
        self._partner = None
        self._verifier = None
        self.history: list[dict[str, float]] = []
        self.kept: list[dict[str, Any]] = []  # solver role, main process: the rows trained on (ROWS_FILE)

    def _partner_model(self):
        if self._partner is None:
            from trl_ext_plugins.preference.generation import load_policy, resolve_model

            self._partner = load_policy(resolve_model(self.params.partner, self.name))
        return self._partner

    def answers(self, model, tokenizer, questions: list[str], seed: int) -> list[list[str]]:
        """m parsed answers per question."""
        from trl_ext_plugins.preference.generation import sample_completions

        texts = sample_completions(model, tokenizer, questions, num_samples=self.params.samples,
                                   max_new_tokens=self.params.answer_max_new_tokens, do_sample=True,
                                   temperature=self.params.temperature, seed=seed)
        pattern = re.compile(self.params.answer_pattern)
        special = re.compile(r"<[a-z]+>")
        out = []
        for row in texts:
            parsed = []
            for text in row:
                match = pattern.search(special.sub("", text))
                parsed.append(match.group() if match else "")
            out.append(parsed)
        return out

    def verified_answer(self, question: str) -> str | None:
        """The verifier's answer to ``question`` (``None``: not a valid problem)."""
        if self._verifier is None:
            self._verifier = load_verifier(self.params.verifier)
        try:
            answer = self._verifier(question)
        except Exception as exc:  # user code: say which verifier failed on which problem, in one line
            raise ValueError(f"plugin {self.name!r}: verifier {self.params.verifier!r} raised "
                             f"{type(exc).__name__}: {exc} on the problem {question!r}") from None
        return None if answer is None else str(answer)

    def votes(self, questions: list[str], answers: list[list[str]]) -> list[tuple[str | None, float]]:
        """Each problem's label and p_hat: the majority answer and its share, or the verified answer and the solve
        rate (``labels``)."""
        if self.params.labels == "verifier":
            return [verified_solve_rate(row, self.verified_answer(question))
                    for question, row in zip(questions, answers, strict=True)]
        return [majority_vote(row) for row in answers]

    # -- proposer ---------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        if self.params.role != "proposer":
            return None
        return [RewardFunction(self.name, self._proposer_reward)]

    def question_text(self, prompt: Any, completion: Any) -> str:
        from trl_ext_plugins.preference.generation import completion_text

        text = re.sub(r"<[a-z]+>", "", completion_text(completion))
        return (completion_text(prompt) + text) if self.params.prompt_is_prefix else text

    def _proposer_reward(self, prompts, completions, log_metric=None, trainer_state=None, **kwargs):
        p = self.params
        questions = [self.question_text(x, c) for x, c in zip(prompts, completions, strict=True)]
        valid = [i for i, q in enumerate(questions) if self.well_formed(q)]
        shares = self.repetition_shares(questions)
        p_hat_of: dict[int, float] = {}
        if valid:
            model, tokenizer = self._partner_model()
            step = trainer_state.global_step if trainer_state is not None else 0
            valid_questions = [questions[i] for i in valid]
            answers = self.answers(model, tokenizer, valid_questions, seed=p.seed + step)
            votes = self.votes(valid_questions, answers)
            p_hat_of = {i: p_hat for i, (_, p_hat) in zip(valid, votes, strict=True)}
            p_hats = [v[1] for v in votes]
            band = p.solver_band()
            record = {"self_play/agreement": sum(p_hats) / len(p_hats),
                      "self_play/in_band": sum(within_band(x, *band) for x in p_hats) / len(p_hats),
                      "self_play/valid": len(valid) / len(questions)}
            if p.verifier is not None:  # the solver's true accuracy on the proposed problems (rejected ones: 0)
                rates = [verified_solve_rate(row, self.verified_answer(q))[1]
                         for q, row in zip(valid_questions, answers, strict=True)]
                record["self_play/solve_rate"] = sum(rates) / len(rates)
        else:
            record = {"self_play/valid": 0.0}
        rewards = [self.proposer_reward(p_hat_of.get(i), share) for i, share in enumerate(shares)]
        self.history.append(record)
        if log_metric is not None:
            for key, value in record.items():
                log_metric(key, value)
        return rewards

    def repetition_shares(self, questions: list[str]) -> list[float]:
        """This rank's weighted repetition shares, over the whole batch B (R-Zero's ``|C_k| / B``).

        TRL calls a reward function on each rank's rows, so the questions of every rank are gathered first: clustered
        over one rank's slice, a unique question paid R / B and duplicates on two ranks were never counted together.
        Only well-formed problems are clustered: R-Zero's caller_penalty.py clusters a malformed proposal as ""
        (distance 1 to everything), a singleton."""
        from accelerate import PartialState
        from accelerate.utils import gather_object

        state = PartialState()
        everyone = gather_object(list(questions)) if state.num_processes > 1 else list(questions)
        offset = state.process_index * len(questions) if state.num_processes > 1 else 0  # TRL's equal slices
        B = len(everyone)
        valid = [i for i, q in enumerate(everyone) if self.well_formed(q)]
        valid_shares = repetition_penalties([everyone[i] for i in valid], self.params.repetition_clustering,
                                            self.params.repetition_threshold)
        share_of = {i: s * len(valid) / B for i, s in zip(valid, valid_shares)}
        return [self.params.repetition_weight * share_of.get(i, 1.0 / B)
                for i in range(offset, offset + len(questions))]

    def well_formed(self, question: str) -> bool:
        """Matches ``question_pattern`` and, with verifier labels, has a verified answer."""
        if not re.match(self.params.question_pattern, question):
            return False
        return self.params.labels != "verifier" or self.verified_answer(question) is not None

    def proposer_reward(self, p_hat: float | None, share: float) -> float:
        """One problem's reward from its p_hat (None: malformed) and its weighted repetition share."""
        kind = self.params.proposer_reward
        if kind == "r_zero_code":
            return r_zero_code_reward(p_hat, share)
        if p_hat is None:
            return 0.0
        if kind == "absolute_zero":
            return learnability_reward(p_hat)
        return max(0.0, uncertainty_reward(p_hat) - share)

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        if self.params.role == "solver" and self.history:
            trainer.add_callback(_LogDatasetFigures(trainer, self.history[-1]))

    # -- solver -----------------------------------------------------------------------------------------------------

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if self.params.role != "solver" or split != "train":
            return None
        if len(dataset) == 0:
            raise ValueError(f"plugin {self.name!r}: the train dataset (the proposer's prompts) has no rows")
        from trl_ext_plugins.preference.generation import on_main_process

        # Sampled on the main process only; every rank trains on its rows (the hook wants the same rows on every rank,
        # and sampling need not agree across ranks). The figures come along, so every rank's history is the same.
        rows, record = on_main_process(lambda: self._solver_rows(dataset, stage), self.name)
        self.history.append(record)
        if not rows:
            low, high = self.params.solver_band()
            raise ValueError(f"plugin {self.name!r}: none of {record['self_play/valid']} well-formed problems has "
                             f"{low:g} <= p_hat <= {high:g}; widen delta or band, or sample more")
        from accelerate import PartialState

        from trl_ext_plugins.rollout.multi_env import generation_batch_prompts

        needed = generation_batch_prompts(stage.args, PartialState().num_processes, stage.trainer)
        if len(rows) < needed:  # TRL's sampler drops the incomplete batch: the stage would train zero steps, silently
            raise ValueError(f"plugin {self.name!r}: only {len(rows)} problems lie in the band, fewer than the {needed} "
                             f"prompts of one generation batch; raise num_questions, widen delta or band, or shrink "
                             f"the batch")
        from datasets import Dataset

        return Dataset.from_list(rows)

    def _solver_rows(self, dataset, stage) -> tuple[list[dict], dict[str, float]]:
        """The solver's rows (problems in the band, majority answers) and the figures of their making."""
        from trl_ext_plugins.preference.generation import load_policy, resolve_model, sample_completions

        p = self.params
        prompts = [dataset[i % len(dataset)]["prompt"] for i in range(p.num_questions)]
        proposer, proposer_tokenizer = self._partner_model()
        completions = [row[0] for row in sample_completions(
            proposer, proposer_tokenizer, prompts, num_samples=1, max_new_tokens=p.question_max_new_tokens,
            do_sample=True, temperature=p.temperature, seed=p.seed)]
        questions = [q for q in (self.question_text(x, c) for x, c in zip(prompts, completions, strict=True))
                     if self.well_formed(q)]
        if not questions:
            raise ValueError(f"plugin {self.name!r}: the proposer {p.partner!r} wrote no well-formed problem in "
                             f"{p.num_questions} tries (question_pattern {p.question_pattern!r})")
        well_formed = len(questions)
        if p.exclude_held_out and stage.evaluation is not None:
            held_out = held_out_problems(stage)
            questions = [q for q in questions if _squeezed(q) not in held_out]
        solver, solver_tokenizer = load_policy(resolve_model(stage.model, self.name))
        answers = self.answers(solver, solver_tokenizer, questions, seed=p.seed + 1)
        rows = solver_rows(questions, self.votes(questions, answers), p.solver_band())
        record = {"self_play/generated": len(prompts), "self_play/valid": well_formed,
                  "self_play/held_out_dropped": well_formed - len(questions), "self_play/kept": len(rows)}
        self.kept = [dict(r) for r in rows]
        if p.labels == "majority" and p.verifier is not None and rows:
            # How often the pseudo-label is right (R-Zero measures it with an oracle); training does not see it.
            for row in self.kept:
                row["verified"] = self.verified_answer(row["prompt"])
            record["self_play/label_accuracy"] = sum(r["answer"] == r["verified"] for r in self.kept) / len(rows)
        return rows, record

    @hookimpl
    def trl_ext_after_stage(self, stage, output_dir, trainer):
        """Solver role: the kept problems, their labels, p_hat and (with a verifier and majority labels) the verified
        answer, one JSON line each in ``self_play_rows.jsonl`` (main process), for inspecting what the round
        trained on."""
        if self.params.role != "solver" or not self.kept:
            return None
        from accelerate import PartialState

        from trl_ext.callbacks import rewrite_jsonl

        if PartialState().is_main_process:
            rewrite_jsonl(Path(output_dir) / ROWS_FILE, self.kept)
        return None


def _squeezed(text: str) -> str:
    return "".join(text.split())


def held_out_problems(stage) -> set[str]:
    """The prompts of ``stage``'s held-out evaluation, whitespace removed (problems the solver must not train on)."""
    from trl_ext_plugins.preference.generation import completion_text
    from trl_ext_plugins.rollout.multi_env import _load, current_catalog

    prompts = _load(stage.evaluation.dataset, current_catalog(), stage)["prompt"]
    return {_squeezed(completion_text(prompt)) for prompt in prompts}


class _LogDatasetFigures(TrainerCallback):
    """Logs how the solver's rows were made (generated, valid, kept, label accuracy) with the first logged step.

    At the end of step 1, in training mode (TRL files metrics by the model's mode) and before that step's logging. A
    resumed run rebuilds the same rows but starts after step 1, so the figures are logged once per run."""

    def __init__(self, trainer, record: dict[str, float]):
        self.trainer, self.record = trainer, record

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.trainer._log_plugin_metrics(self.record)
