"""``reward_model``: Bradley-Terry reward-model training (TRL RewardTrainer) and a trained model used as a reward."""

from __future__ import annotations

from pydantic import Field

from trl_ext import Plugin, PluginParams, hookimpl
from trl_ext.rewards import RewardFunction
from trl_ext_plugins.rewards.scoring import LazyScorer, load_sequence_classifier, resolve_ref

TRAINING = "reward"


class RewardModelParams(PluginParams):
    path: str | None = Field(
        None, description="RL stages: the reward model to score with: `stage:<name>` (an earlier `reward` stage), "
        "`embedded:<name>` or a folder. Must be unset in a `reward` (training) stage")
    weight: float = Field(1.0, description="RL stages: weight of this reward in the weighted sum of reward functions")
    batch_size: int = Field(32, gt=0, description="RL stages: texts per reward-model forward pass")
    max_length: int | None = Field(None, gt=0, description="RL stages: truncate scored texts to this many tokens "
                                   "(from the left, keeping the completion); None: no truncation")
    append_eos: bool = Field(True, description="RL stages: append eos before scoring, as RewardTrainer does in "
                             "training (the head reads the last token)")
    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="training: TRL's reward-centering coefficient c, loss += c * mean((r_w + r_l)^2) "
        "(Eisenstein et al. 2023); None (TRL default) disables it")
    margin_column: str | None = Field(
        None, description="training: dataset column holding a per-pair margin m (Llama 2: -log sigmoid(r_w - r_l - "
        "m)); renamed to TRL's `margin` column. None: no margin unless the dataset already has `margin`")


class RewardModel(Plugin):
    """Bradley-Terry reward model (Christiano et al. arXiv 1706.03741; Stiennon et al. 2009.01325; InstructGPT
    2203.02155): trained on TRL's RewardTrainer, then used as a batched reward by GRPO/RLOO stages.

    **Training** (stage ``trainer: reward``, ``path`` unset). TRL's RewardTrainer loads the stage's ``model`` with
    ``AutoModelForSequenceClassification(num_labels=1)``: a causal-LM folder (e.g. ``embedded:tiny-qwen2``) gets a
    fresh head seeded by ``args.seed``. The loss is the per-batch mean of
    ``-log sigmoid(r(x, y_w) - r(x, y_l) - m)`` (:func:`formulas.bradley_terry_loss`), ``m`` from a ``margin`` column
    when the dataset has one (``margin_column`` renames another column to it; Llama 2's margin), plus
    ``c * mean((r_w + r_l)^2)`` when ``center_rewards_coefficient`` is set (TRL's centering; default off, as in TRL).
    Conventions: one pair per row (InstructGPT's all-C(K,2)-pairs-per-prompt batching is a dataset choice: list the
    pairs as rows); the reward is read at the last non-pad token, which is the eos TRL appends to each text.

    **Use as a reward** (GRPO/RLOO stage, ``path`` set). ``path`` may be ``stage:<name>`` (resolved against the run
    directory at the first scoring call, see :mod:`trl_ext_plugins.rewards.scoring`), ``embedded:<name>`` or a
    folder. Each completion is scored as ``r(prompt + completion + eos)`` (chat template for conversational data),
    ``batch_size`` texts per forward pass, with the frozen model on the trainer's device. The raw score is the reward
    (no normalisation: GRPO's group normalisation removes offsets; InstructGPT's mean-0 normalisation is an offset).
    """

    name = "reward_model"
    family = "reward"
    trainers = frozenset({TRAINING, "grpo", "rloo"})
    Params = RewardModelParams

    def __init__(self, params=None):
        super().__init__(params)
        p = self.params
        self.scorer = LazyScorer(self._load, p.batch_size, p.max_length, p.append_eos)

    def _load(self, run_dir):
        return load_sequence_classifier(resolve_ref(self.params.path, run_dir))

    @hookimpl
    def trl_ext_validate_stage(self, stage, plugins):
        p = self.params
        if stage.trainer == TRAINING:
            wrong = [k for k in ("path",) if getattr(p, k) is not None]
            return [f"plugin 'reward_model': params.{k} is for RL stages; a reward stage trains the stage's model"
                    for k in wrong]
        errors = []
        if p.path is None:
            errors.append("plugin 'reward_model': params.path is required in a "
                          f"{stage.trainer} stage (stage:<name>, embedded:<name> or a folder)")
        for key in ("center_rewards_coefficient", "margin_column"):
            if getattr(p, key) is not None:
                errors.append(f"plugin 'reward_model': params.{key} only applies to a `reward` training stage")
        return errors

    @hookimpl
    def trl_ext_configure_args(self, trainer, args):
        if trainer == TRAINING and self.params.center_rewards_coefficient is not None:
            return {"center_rewards_coefficient": self.params.center_rewards_coefficient}
        return None

    @hookimpl
    def trl_ext_prepare_dataset(self, dataset, split, stage):
        column = self.params.margin_column
        if stage.trainer != TRAINING or column is None or column == "margin":
            return None
        if column not in dataset.column_names:
            raise ValueError(f"reward_model: margin_column {column!r} is not a column of the {split} dataset "
                             f"(columns: {dataset.column_names})")
        if "margin" in dataset.column_names:
            dataset = dataset.remove_columns("margin")
        return dataset.rename_column(column, "margin")

    @hookimpl
    def trl_ext_reward_functions(self, stage):
        if stage.trainer == TRAINING:
            return None
        return [RewardFunction("reward_model", self.scorer, self.params.weight)]

    @hookimpl
    def trl_ext_trainer_created(self, trainer):
        self.scorer.bind(trainer)
