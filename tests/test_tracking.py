"""Tracking: one tracker run per stage (TRL run_name ``<run>/<stage>``, TensorBoard under ``<output_dir>/<stage>/
tensorboard``), and the held-out evaluation logged to the report_to backends at the stage's last step, before the
backend closes its run.

The `tensorboard` package is not installed here, so transformers' real TensorBoardCallback runs against a recording
SummaryWriter put in place of ``torch.utils.tensorboard``."""

import json
import os
import sys
import types

import pytest

from trl_ext.recipe import parse_recipe
from trl_ext.runner import run_recipe
from trl_ext.testing import fresh_catalog
from trl_ext.tracking import StageReporting, heldout_logs
from trl_ext_plugins.rewards.exact_match import ExactMatch
from trl_ext_plugins.trainers.sft import SFT

WRITERS: list["RecordingWriter"] = []


class RecordingWriter:
    """Stands in for torch.utils.tensorboard.SummaryWriter: records what it is given, in order."""

    def __init__(self, log_dir=None, **_kwargs):
        self.log_dir = log_dir
        self.events: list[tuple] = []
        WRITERS.append(self)

    def add_scalar(self, tag, value, step):
        self.events.append(("scalar", tag, value, step))

    def add_text(self, tag, text, step=None):
        self.events.append(("text", tag, text, step))

    def flush(self):
        pass

    def close(self):
        self.events.append(("close",))


@pytest.fixture
def recording_tensorboard(monkeypatch):
    """report_to: tensorboard works with the recording writer (validation and transformers both see it installed)."""
    import transformers.integrations.integration_utils as integrations

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = RecordingWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(integrations, "is_tensorboard_available", lambda: True)
    available = integrations.get_available_reporting_integrations
    monkeypatch.setattr(integrations, "get_available_reporting_integrations",
                        lambda: sorted({*available(), "tensorboard"}))
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    WRITERS.clear()
    return WRITERS


def _stage(name, **args):
    return {"name": name, "trainer": "sft", "model": "embedded:tiny-qwen2", "plugins": ["sft"],
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt_completion"}, "limit": 16},
            "evaluation": {"reward": "exact_match", "limit": 8, "dataset": {
                "source": "embedded:arithmetic", "split": "test", "params": {"format": "prompt"}}},
            "args": {"max_steps": 2, "per_device_train_batch_size": 8, "max_length": 32, "logging_steps": 1,
                     "save_strategy": "no", "report_to": "tensorboard", **args}}


def _catalog():
    catalog = fresh_catalog()
    for cls in (SFT, ExactMatch):
        catalog.add_plugin(cls)
    return catalog


def test_one_tensorboard_run_per_stage_with_heldout_results(tmp_path, recording_tensorboard):
    out = tmp_path / "myrun"
    second = _stage("second", run_name="custom")
    second["evaluation"] = {**second["evaluation"], "mean_at_k": 2, "temperature": 0.7}
    recipe = parse_recipe({"seed": 0, "stages": [_stage("first"), second]})
    run_recipe(recipe, out, _catalog(), echo=lambda _m: None)

    dirs = sorted({w.log_dir for w in recording_tensorboard})
    assert dirs == [str(out / "first" / "tensorboard"), str(out / "second" / "tensorboard")]
    assert "TENSORBOARD_LOGGING_DIR" not in os.environ  # restored after each stage's trainer was built
    for stage, run_name in (("first", "myrun/first"), ("second", "custom")):
        events = [e for w in recording_tensorboard if w.log_dir == str(out / stage / "tensorboard") for e in w.events]
        (args_text,) = [e[2] for e in events if e[:2] == ("text", "args")]
        assert json.loads(args_text)["run_name"] == run_name  # the recipe's own run_name is kept
        # each stage counts its own steps from 1 (its own run), training rows at steps 1 and 2
        assert sorted({e[3] for e in events if e[:2] == ("scalar", "train/loss")}) == [1, 2]
        evaluation = json.loads((out / stage / "eval.json").read_text())
        scalars = {e[1]: (e[2], e[3]) for e in events if e[0] == "scalar"}
        for when in ("before", "after"):
            sampled = ("sampled_accuracy", "sampled_reward_mean", "sampled_n") if stage == "second" else ()
            assert set(evaluation[when]) == {"accuracy", "reward_mean", "n", "unscored", "samples", *sampled}
            assert evaluation[when].get("sampled_n", 16) == 16  # 8 prompts x mean_at_k 2
            for key in ("accuracy", "reward_mean", "n", *sampled):
                assert scalars[f"eval/heldout_{key}_{when}"] == (evaluation[when][key], 2)  # at the last step
        # logged while the run is open, and the run is closed once, after them
        kinds = [e[0] if e[0] == "close" else e[1] for e in events]
        assert kinds.count("close") == 1
        assert kinds.index("eval/heldout_accuracy_after") < kinds.index("close")
    rows = [json.loads(line) for line in (out / "first" / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("eval_heldout") for row in rows for key in row)  # eval.json holds them


def test_tensorboard_logging_dir_variable_nests_run_and_stage(tmp_path, recording_tensorboard, monkeypatch):
    root = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(root))
    recipe = parse_recipe({"seed": 0, "stages": [{**_stage("only"), "evaluation": None}]})
    run_recipe(recipe, tmp_path / "exp", _catalog(), echo=lambda _m: None)
    assert {w.log_dir for w in recording_tensorboard} == {str(root / "exp" / "only")}
    assert os.environ["TENSORBOARD_LOGGING_DIR"] == str(root)
    (writer,) = recording_tensorboard
    assert writer.events[-1] == ("close",)  # no evaluation: the held on_train_end still runs


def test_heldout_logs_and_deferred_train_end():
    assert heldout_logs({"before": {"accuracy": 0.25, "n": 8, "samples": []}, "after": {"accuracy": 0.5}}) == {
        "eval_heldout_accuracy_before": 0.25, "eval_heldout_n_before": 8, "eval_heldout_accuracy_after": 0.5}
    assert heldout_logs({}) == {}

    from transformers import TrainerControl, TrainerState
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    calls = []

    class Backend(INTEGRATION_TO_CALLBACK["tensorboard"]):
        def __init__(self):  # the real one needs tensorboard installed
            pass

        def on_log(self, args, state, control, logs=None, **kwargs):
            calls.append(("log", dict(logs)))

        def on_train_end(self, args, state, control, **kwargs):
            calls.append(("end",))

    backend = Backend()
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=[object(), backend]),
                                    args=None, state=TrainerState(), control=TrainerControl(), model=None)
    reporting = StageReporting(trainer).hold()
    assert reporting.callbacks == [backend]
    backend.on_train_end(None, trainer.state, trainer.control)  # what Trainer does at the end of train()
    assert calls == []
    reporting.finish({"eval_heldout_accuracy_after": 1.0})
    assert calls == [("log", {"eval_heldout_accuracy_after": 1.0}), ("end",)]
    assert "on_train_end" not in vars(backend)  # the class's method is back
