"""Reward plugins for RL trainers (GRPO, RLOO) and held-out evaluation."""

from trl_ext import hookimpl
from trl_ext_plugins.rewards.checklist_judge import ChecklistJudge
from trl_ext_plugins.rewards.constraints import Constraints
from trl_ext_plugins.rewards.exact_match import ExactMatch
from trl_ext_plugins.rewards.length_shaping import LengthShaping
from trl_ext_plugins.rewards.llm_judge import LLMJudge
from trl_ext_plugins.rewards.orm import ORM
from trl_ext_plugins.rewards.prm import PRM
from trl_ext_plugins.rewards.python_reward import PythonReward
from trl_ext_plugins.rewards.reward_model import RewardModel
from trl_ext_plugins.rewards.self_judge import SelfJudge
from trl_ext_plugins.rewards.unit_tests import UnitTests
from trl_ext_plugins.rewards.verify_math import MathVerify
from trl_ext_plugins.rewards.warm import Warm


@hookimpl
def trl_ext_register_plugins(register):
    register(ExactMatch)
    register(Constraints)
    register(LengthShaping)
    register(MathVerify)
    register(UnitTests)
    register(RewardModel)
    register(Warm)
    register(PRM)
    register(ORM)
    register(LLMJudge)
    register(ChecklistJudge)
    register(SelfJudge)
    register(PythonReward)


@hookimpl
def trl_ext_register_datasets(register):
    from trl_ext_plugins.rewards.instructions import instruction_arithmetic
    from trl_ext_plugins.rewards.steps import multistep_arithmetic

    register("multistep_arithmetic", multistep_arithmetic)
    register("instruction_arithmetic", instruction_arithmetic)
