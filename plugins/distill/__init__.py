"""Distillation plugins: teacher traces, rejection sampling, GKD, on-policy distillation as RL, multi-teacher and
own-stage teachers, BOND."""

from trl_ext import hookimpl
from trl_ext_plugins.distill.bond import BOND
from trl_ext_plugins.distill.gkd import GKD
from trl_ext_plugins.distill.opd import MultiTeacherOPD, OPDReward, StageTeachers
from trl_ext_plugins.distill.rejection_sampling import RejectionSampling
from trl_ext_plugins.distill.teacher_traces import TeacherTraces

PLUGINS: tuple = (GKD, OPDReward, MultiTeacherOPD, StageTeachers, TeacherTraces, BOND,
                  RejectionSampling)


@hookimpl
def trl_ext_register_plugins(register):
    for plugin in PLUGINS:
        register(plugin)


@hookimpl
def trl_ext_register_datasets(register):
    from trl_ext_plugins.distill.data import domain_arithmetic

    register("domain_arithmetic", domain_arithmetic)
