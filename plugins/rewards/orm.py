"""``orm``: outcome reward model, outcome BCE on the ``prm`` trainer (the one-step case), used as a reward."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards.prm import TRAINING, PRMParams, PRMScorer


class ORMParams(PluginParams):
    label_column: str = Field("label", description="training: dataset column with the outcome (bool or number in "
                              "[0, 1]); rows are prompt, completion, label (TRL's unpaired format)")
    separator: str = Field("\n", description="appended after the solution; the score is read at its last token")
    path: str | None = Field(None, description="RL stages: the trained ORM (`stage:<name>`, `embedded:<name>` or a "
                             "folder)")
    weight: float = Field(1.0, description="RL stages: weight of this reward in the weighted sum")
    batch_size: int = Field(32, gt=0, description="RL stages: solutions per forward pass")


class ORM(Plugin):
    """Outcome reward model (Cobbe et al. "Training Verifiers", arXiv 2110.14168; Uesato et al. 2211.14275).

    BCE on final correctness, ``L = -[y log r(x, y) + (1 - y) log(1 - r(x, y))]``, trained on the ``prm`` trainer as a
    single step: each ``prompt, completion, label`` row becomes ``completions=[completion]``, ``labels=[label]`` and
    the score is read at the separator appended after the whole solution. Convention: Cobbe trains a value head on
    every token and uses the final one; here only the final position is trained (the ORM form of Uesato et al.).
    As a reward: sigmoid of the logit at that position, in [0, 1]; the whole completion, unchanged (a separator inside
    it included), is one step, exactly the text training read.
    """

    name = "orm"
    family = "reward"
    trainers = frozenset({TRAINING, "grpo", "rloo"})
    Params = ORMParams

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        self.scorer = PRMScorer(PRMParams(separator=p.separator, path=p.path, aggregation="last",
                                          batch_size=p.batch_size), split=False)

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        if stage.trainer == TRAINING:
            return ["plugin 'orm': params.path is for RL stages"] if self.params.path else None
        return None if self.params.path else [f"plugin 'orm': params.path is required in a {stage.trainer} stage"]

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        return {"step_separator": self.params.separator} if trainer == TRAINING else None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        if stage.trainer != TRAINING:
            return None
        column = self.params.label_column
        missing = [c for c in ("prompt", "completion", column) if c not in dataset.column_names]
        if missing:
            raise ValueError(f"orm: the {split} dataset lacks column(s) {missing} (columns: {dataset.column_names})")
        return dataset.map(lambda row: {"completions": [row["completion"]], "labels": [float(row[column])]},
                           remove_columns=[c for c in dataset.column_names if c not in ("prompt",)])

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        if stage.trainer == TRAINING:
            return None

        # one step, the completion unchanged (training reads prompt + completion + separator)
        return [RewardFunction(self.name, self.scorer, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.scorer.bind(trainer)
