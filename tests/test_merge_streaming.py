"""Streaming merges through safetensors: equal to the in-memory average, layout kept, buffers copied, mismatches
refused naming the tensor, output loadable by from_pretrained; the merge stages of both plugins on fake runs."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from trl_ext.recipe import StageSpec
from trl_ext_plugins.merge.checkpoint_average import CheckpointAverage, CheckpointAverageParams
from trl_ext_plugins.merge.math import (
    ArchitectureMismatchError,
    NonFiniteWeightsError,
    ZeroTaskVectorError,
    average_state_dicts,
    slerp_fold_coefficients,
)
from trl_ext_plugins.merge.streaming import stream_merge, weight_files
from trl_ext_plugins.merge.warp import Warp, WarpParams


def _config(**over):
    fields = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    return Qwen2Config(**{**fields, **over})


def _save(model, path, shard=None):
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return Path(path)


def _perturbed(base, seed, scale=0.05):
    model = AutoModelForCausalLM.from_config(base.config)
    model.load_state_dict(base.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """An initialisation and three models fine-tuned from it (perturbed copies), saved as single files."""
    root = tmp_path_factory.mktemp("merge")
    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(_config())
    models = [_perturbed(init, 10 + i) for i in range(3)]
    return {"init": _save(init, root / "init"), "runs": [_save(m, root / f"m{i}") for i, m in enumerate(models)],
            "root": root}


def _weights(folder):
    out = {}
    for name in weight_files(folder):
        out.update(load_file(str(Path(folder) / name)))
    return out


def test_stream_average_equals_in_memory_average_and_loads(family, tmp_path):
    sources = family["runs"]
    out = _save(AutoModelForCausalLM.from_pretrained(sources[0]), tmp_path / "out")
    weights = [0.5, 0.3, 0.2]
    counts = stream_merge(sources, out, lambda _n, _g: weights, who="test", chunk_elements=100)
    expected = average_state_dicts([_weights(s) for s in sources], weights)
    got = _weights(out)
    assert got.keys() == expected.keys() and counts["merged_tensors"] == len(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert not list(out.glob(".merge-tmp-*"))


def test_sharded_layout_is_mirrored(family, tmp_path):
    sharded = [_save(AutoModelForCausalLM.from_pretrained(s), tmp_path / f"s{i}", shard="20KB")
               for i, s in enumerate(family["runs"][:2])]
    assert len(weight_files(sharded[0])) > 1
    out = tmp_path / "out"
    _save(AutoModelForCausalLM.from_pretrained(family["init"]), out)  # a single-file folder: its old file must go
    stream_merge(sharded, out, lambda _n, _g: [0.5, 0.5], who="test")
    assert weight_files(out) == weight_files(sharded[0]) and not (out / "model.safetensors").exists()
    expected = average_state_dicts([_weights(s) for s in family["runs"][:2]])
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key


def test_integer_buffers_are_copied_from_the_base(tmp_path):
    folders = []
    for i, (w, steps) in enumerate([([1.0, 3.0], [7, 1]), ([3.0, 5.0], [9, 2])]):
        folder = tmp_path / f"c{i}"
        folder.mkdir()
        save_file({"w": torch.tensor(w), "steps": torch.tensor(steps), "keep": torch.tensor([i == 0, True])},
                  str(folder / "model.safetensors"))
        folders.append(folder)
    out = tmp_path / "out"
    out.mkdir()
    counts = stream_merge(folders, out, lambda _n, _g: [0.5, 0.5], base=1, who="test")
    got = load_file(str(out / "model.safetensors"))
    assert got["w"].tolist() == [2.0, 4.0]  # ALGORITHMS.md 53: mean of [1, 3] and [3, 5]
    assert got["steps"].tolist() == [9, 2] and got["steps"].dtype == torch.int64
    assert got["keep"].tolist() == [False, True]
    assert counts == {"merged_tensors": 1, "copied_tensors": 2}


def test_mismatched_architectures_are_refused_naming_the_tensor(family, tmp_path):
    wide = _save(AutoModelForCausalLM.from_config(_config(intermediate_size=48)), tmp_path / "wide")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ArchitectureMismatchError, match=r"'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight' has shape"
                       ) as err:
        stream_merge([family["runs"][0], wide], out, lambda _n, _g: [1.0, 0.0], who="checkpoint_average")
    assert str(wide) in str(err.value) and str(family["runs"][0]) in str(err.value)
    deeper = _save(AutoModelForCausalLM.from_config(_config(num_hidden_layers=3)), tmp_path / "deep")
    with pytest.raises(ArchitectureMismatchError, match=r"tensor 'model\.layers\.2\.[^']+' is in"):
        stream_merge([family["runs"][0], deeper], out, lambda _n, _g: [1.0, 0.0], who="checkpoint_average")
    assert not (out / "model.safetensors").exists()  # refused before writing anything
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        stream_merge([family["runs"][0], tmp_path], out, lambda _n, _g: [1.0, 0.0])


def _slerp_weights(_name, gram):
    coefficients, _ = slerp_fold_coefficients(gram)
    return [1.0 - sum(coefficients), *coefficients]


def test_non_finite_weights_and_integer_for_float_tensors_are_refused_naming_tensor_and_source(family, tmp_path):
    weights = _weights(family["runs"][1])
    name = sorted(k for k in weights if weights[k].is_floating_point())[0]
    broken = tmp_path / "nan"
    broken.mkdir()
    save_file({**weights, name: weights[name].clone().index_fill_(0, torch.tensor([0]), math.nan)},
              str(broken / "model.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    sources = [family["runs"][0], broken]
    with pytest.raises(NonFiniteWeightsError, match=f"tensor '{re.escape(name)}' holds NaN or Inf in '{broken}'"):
        stream_merge(sources, out, lambda _n, _g: [0.5, 0.5], who="checkpoint_average")
    with pytest.raises(NonFiniteWeightsError):  # the WARP path (Gram of the task vectors) refuses it too
        stream_merge([family["init"], family["runs"][0], broken], out, _slerp_weights, gram=True, who="warp")
    integer = tmp_path / "int"
    integer.mkdir()
    save_file({**weights, name: weights[name].to(torch.int64)}, str(integer / "model.safetensors"))
    with pytest.raises(ArchitectureMismatchError, match=f"tensor '{re.escape(name)}' is I64 in '{integer}'"):
        stream_merge([family["runs"][0], integer], out, lambda _n, _g: [0.5, 0.5], who="checkpoint_average")
    assert not (out / "model.safetensors").exists()


class _FakeTrainer:
    """What the after-stage hooks read from a trainer."""

    def __init__(self, model=None, step=0):
        self.model, self.state = model, type("S", (), {"global_step": step})()
        self.accelerator = type("A", (), {"unwrap_model": staticmethod(lambda m: m)})()
        self.weights_folder = None

    def use_weights(self, folder):  # the merge trainer's hook for where the merged model now is
        self.weights_folder = folder


def _merge_stage_dir(run_dir, name, model_folder):
    stage_dir = run_dir / name
    stage_dir.mkdir(parents=True, exist_ok=True)
    for item in Path(model_folder).iterdir():
        if item.is_file():
            (stage_dir / item.name).write_bytes(item.read_bytes())
    return stage_dir


def test_checkpoint_average_merge_stage_of_named_stages(family, tmp_path):
    run = tmp_path / "run"
    for i, folder in enumerate(family["runs"]):
        _merge_stage_dir(run, f"rl_{i}", folder)
    stage_dir = _merge_stage_dir(run, "soup", family["runs"][0])
    plugin = CheckpointAverage(CheckpointAverageParams(sources=["stage:rl_0", "stage:rl_1", "stage:rl_2"], mode="ema",
                                                       ema_decay=0.5, last_n=2))
    stage = StageSpec(name="soup", trainer="merge", model="stage:rl_0")
    summary = plugin.trl_ext_after_stage(stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer())
    assert summary["checkpoint_average"]["weights"] == [0.5, 0.5]  # EMA of 2 with decay 0.5
    expected = average_state_dicts([_weights(s) for s in family["runs"][1:]])
    loaded = AutoModelForCausalLM.from_pretrained(stage_dir).state_dict()
    for key in expected:
        assert torch.allclose(loaded[key], expected[key], atol=0, rtol=0), key


def test_checkpoint_average_of_a_training_stages_checkpoints(family, tmp_path):
    """checkpoint-2, checkpoint-4 and a final model at step 5 (not checkpointed): last_n 2 averages ckpt-4 + final,
    written into the stage folder, and the trainer's model is updated in place."""
    from trl_ext.callbacks import CHECKPOINT_COMPLETE

    stage_dir = tmp_path / "run" / "sft"
    for step, folder in ((2, family["init"]), (4, family["runs"][0])):
        _merge_stage_dir(stage_dir / "checkpoints", f"checkpoint-{step}", folder)
        (stage_dir / "checkpoints" / f"checkpoint-{step}" / CHECKPOINT_COMPLETE).write_text("{}")
    (stage_dir / "checkpoints" / "checkpoint-5").mkdir()  # killed while saving: no marker, never averaged
    _merge_stage_dir(stage_dir.parent, "sft", family["runs"][1])
    model = AutoModelForCausalLM.from_pretrained(stage_dir)
    plugin = CheckpointAverage(CheckpointAverageParams(last_n=2, mode="weighted", weights=[1.0, 3.0]))
    stage = StageSpec(name="sft", trainer="sft", model="x", dataset="embedded:arithmetic")
    summary = plugin.trl_ext_after_stage(stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer(model, step=5))
    info = summary["checkpoint_average"]
    assert info["sources"] == [str(stage_dir / "checkpoints" / "checkpoint-4"), str(stage_dir)]
    assert info["weights"] == [0.25, 0.75] and info["trainer_model_updated"] is True
    expected = average_state_dicts([_weights(family["runs"][0]), _weights(family["runs"][1])], [1.0, 3.0])
    on_disk = _weights(stage_dir)
    in_memory = model.state_dict()
    for key in expected:
        assert torch.equal(on_disk[key], expected[key]) and torch.equal(in_memory[key], expected[key]), key
    # identical checkpoints average to themselves (step 5 checkpointed: the final model is not added twice)
    _merge_stage_dir(stage_dir / "checkpoints", "checkpoint-5", stage_dir)
    (stage_dir / "checkpoints" / "checkpoint-5" / CHECKPOINT_COMPLETE).write_text("{}")
    before = _weights(stage_dir)
    summary = CheckpointAverage(CheckpointAverageParams(last_n=1)).trl_ext_after_stage(
        stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer(model, step=5))
    assert summary["checkpoint_average"]["sources"] == [str(stage_dir / "checkpoints" / "checkpoint-5")]
    assert all(torch.equal(v, before[k]) for k, v in _weights(stage_dir).items())


def test_warp_merge_stage(family, tmp_path):
    run = tmp_path / "run"
    _merge_stage_dir(run, "init", family["init"])
    for i in range(2):
        _merge_stage_dir(run, f"rl_{i}", family["runs"][i])
    stage_dir = _merge_stage_dir(run, "warp", family["init"])
    plugin = Warp(WarpParams(runs=["stage:rl_0", "stage:rl_1"], eta=0.3))
    stage = StageSpec(name="warp", trainer="merge", model="stage:init", dataset="embedded:arithmetic")
    summary = plugin.trl_ext_after_stage(stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer())
    assert summary["warp"]["linear_fallback_tensors"] == 0
    init, r0, r1 = (_weights(f) for f in (family["init"], *family["runs"][:2]))
    got = AutoModelForCausalLM.from_pretrained(stage_dir).state_dict()
    for key in init:  # the formula, written out independently: per-tensor angle, SLERP at 1/2, LITI with eta 0.3
        d1, d2 = (r0[key] - init[key]).double().flatten(), (r1[key] - init[key]).double().flatten()
        omega = torch.arccos(d1 @ d2 / (d1.norm() * d2.norm()))
        slerped = (torch.sin(omega / 2) / torch.sin(omega)) * (d1 + d2)
        expected = (init[key].double().flatten() + 0.3 * slerped).reshape(init[key].shape).float()
        assert torch.allclose(got[key], expected, atol=1e-6, rtol=0), key


def test_warp_zero_task_vector(family, tmp_path):
    run = tmp_path / "run"
    _merge_stage_dir(run, "init", family["init"])
    _merge_stage_dir(run, "rl_0", family["runs"][0])
    _merge_stage_dir(run, "rl_1", family["init"])  # a run that changed nothing
    stage = StageSpec(name="warp", trainer="merge", model="stage:init", dataset="embedded:arithmetic")
    stage_dir = _merge_stage_dir(run, "warp", family["init"])
    with pytest.raises(ZeroTaskVectorError, match=r"warp: tensor '[^']+' did not change in 'stage:rl_1'"):
        Warp(WarpParams(runs=["stage:rl_0", "stage:rl_1"])).trl_ext_after_stage(
            stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer())
    summary = Warp(WarpParams(runs=["stage:rl_0", "stage:rl_1"], zero_task_vector="linear", eta=1.0)
                   ).trl_ext_after_stage(stage=stage, output_dir=str(stage_dir), trainer=_FakeTrainer())
    assert summary["warp"]["zero_task_vector_tensors"] == summary["warp"]["merged_tensors"]
    init, r0, got = _weights(family["init"]), _weights(family["runs"][0]), _weights(stage_dir)
    for key in init:  # linear: init + (delta_1 + 0) / 2
        assert torch.allclose(got[key], (init[key] + r0[key]) / 2, atol=1e-6), key
    assert json.loads((stage_dir / "config.json").read_text())["model_type"] == "qwen2"


def test_chunked_gram_merge_equals_whole_tensor_merge(family, tmp_path):
    """Row chunks of a few dozen elements give the same Gram matrices and the same merged weights as whole tensors."""
    sources = [family["init"], *family["runs"][:2]]
    grams = {}

    def record(chunks):
        def weights(name, gram):
            grams.setdefault(name, []).append(gram)
            return [0.4, 0.3, 0.3]
        return weights

    outs = []
    for chunk in (1 << 20, 40):
        out = tmp_path / f"out{chunk}"
        out.mkdir()
        stream_merge(sources, out, record(chunk), gram=True, chunk_elements=chunk)
        outs.append(_weights(out))
    for key, (whole, chunked) in grams.items():
        assert torch.allclose(whole, chunked, rtol=1e-12, atol=0), key
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key


def _single(folder, tensors):
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _sharded(folder, shards, index):
    folder.mkdir(parents=True)
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name))
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    return folder


@pytest.mark.parametrize("shard_name", ["../../evil.safetensors", "/tmp/evil.safetensors", "sub/x.safetensors",
                                        "model.bin", ".hidden.safetensors"])
def test_an_index_cannot_point_the_merge_outside_the_folder(tmp_path, shard_name):
    """The index is untrusted: its shard names are written back out (the output mirrors the base's layout), so
    '../../evil.safetensors' wrote a file two folders above the stage."""
    good = _single(tmp_path / "good", {"a": torch.ones(2)})
    hostile = _sharded(tmp_path / "runs" / "stage" / "m", {"model-1.safetensors": {"a": torch.ones(2)}},
                       {"weight_map": {"a": shard_name}})
    out = tmp_path / "runs" / "stage" / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"weight_map['a'] = {shard_name!r} is not a *.safetensors file "
                                                   "name inside the folder")) as err:
        stream_merge([good, hostile], out, lambda _n, _g: [0.5, 0.5], base=1)
    assert str(hostile / "model.safetensors.index.json") in str(err.value)
    assert not list(tmp_path.rglob("evil.safetensors")) and list(out.iterdir()) == []


@pytest.mark.parametrize("case, message", [
    ("not_json", "not a JSON safetensors index"),
    ("no_weight_map", "no 'weight_map' object"),
    ("empty_weight_map", "'weight_map' must be a non-empty object"),
    ("missing_shard", "weight file missing"),
    ("truncated", "not a readable safetensors file"),
    ("lying_index", "tensor 'b' is listed in 'model-1.safetensors' but that file does not hold it"),
    ("complex", "tensor 'a' has dtype C64, which merging does not support"),
])
def test_unreadable_weight_files_are_refused_naming_the_file(tmp_path, case, message):
    good = _single(tmp_path / "good", {"a": torch.ones(2)})
    shard = {"model-1.safetensors": {"a": torch.ones(2)}}
    index = {"weight_map": {"a": "model-1.safetensors"}}
    bad = tmp_path / "bad"
    if case == "not_json":
        _sharded(bad, shard, "{weight_map: 1")
    elif case == "no_weight_map":
        _sharded(bad, shard, {"metadata": {}})
    elif case == "empty_weight_map":
        _sharded(bad, shard, {"weight_map": {}})
    elif case == "missing_shard":
        _sharded(bad, {}, index)
    elif case == "truncated":
        _single(bad, {"a": torch.ones(2)})
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[:5])
    elif case == "lying_index":
        _sharded(bad, shard, {"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors"}})
    else:
        _single(bad, {"a": torch.ones(2, dtype=torch.complex64)})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)) as err:
        stream_merge([good, bad], out, lambda _n, _g: [0.5, 0.5])
    assert str(bad) in str(err.value) and len(str(err.value).splitlines()) == 1
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                                   torch.float8_e5m2fnuz])
def test_float8_weights_are_averaged(tmp_path, dtype):
    """float8 is listed as mergeable: it crashed in the NaN check (no isfinite kernel), and the FNUZ variants were
    copied from the base unaveraged."""
    low = _single(tmp_path / "low", {"a": torch.full((4,), 1.0).to(dtype)})
    high = _single(tmp_path / "high", {"a": torch.full((4,), 2.0).to(dtype)})
    out = tmp_path / "out"
    out.mkdir()
    counts = stream_merge([low, high], out, lambda _n, _g: [0.5, 0.5])
    got = load_file(str(out / "model.safetensors"))["a"]
    assert counts == {"merged_tensors": 1, "copied_tensors": 0} and got.dtype == dtype
    assert got.float().tolist() == [1.5] * 4  # 1.5 is exact in every float8 format


def _moves_killed_at(monkeypatch, call):
    import trl_ext_plugins.merge.streaming as streaming

    real, calls = streaming.os.replace, [0]

    def replace(src, dst):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt("killed")
        real(src, dst)

    monkeypatch.setattr(streaming.os, "replace", replace)
    return real


@pytest.mark.parametrize("old_layout, new_layout", [("single", "sharded"), ("sharded", "single"),
                                                     ("sharded", "sharded")])
def test_a_kill_while_the_merged_files_move_in_leaves_one_whole_model(tmp_path, monkeypatch, old_layout, new_layout):
    """Every instant of the final moves leaves a folder that reads as one whole model (the old one or the merge):
    before, old files were deleted first and new ones moved in in set order, so a kill could leave an index naming a
    shard that was not there yet, and the stage's rerun failed on it every time."""
    two = {"model-00001-of-00002.safetensors": {"a": torch.ones(2)}, "model-00002-of-00002.safetensors":
           {"b": torch.zeros(3)}}
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}

    def make(folder, layout, scale):
        if layout == "single":
            return _single(folder, {"a": scale * torch.ones(2), "b": scale * torch.ones(3)})
        return _sharded(folder, {n: {k: scale * torch.ones_like(v) for k, v in t.items()} for n, t in two.items()},
                        index)

    sources = [make(tmp_path / "s1", new_layout, 1.0), make(tmp_path / "s2", new_layout, 3.0)]
    moves = 3 if new_layout == "sharded" else 1
    for call in range(1, moves + 1):
        out = make(tmp_path / f"out{call}", old_layout, 7.0)
        real = _moves_killed_at(monkeypatch, call)
        with pytest.raises(KeyboardInterrupt):
            stream_merge(sources, out, lambda _n, _g: [0.5, 0.5])
        monkeypatch.setattr("trl_ext_plugins.merge.streaming.os.replace", real)
        weights = _weights(out)  # reads through the index: raises on a listed shard that is missing
        assert sorted(weights) == ["a", "b"]
        values = {float(v.unique()) for v in weights.values()}
        if old_layout != new_layout:  # the new files go in under names the folder does not read until the switch
            assert values in ({7.0}, {2.0}), (call, values)
        # same shard names are replaced one by one: whole but partly merged until the stage's rerun rewrites it
        assert stream_merge(sources, out, lambda _n, _g: [0.5, 0.5]) == {"merged_tensors": 2, "copied_tensors": 0}
        assert {float(v.unique()) for v in _weights(out).values()} == {2.0}
        assert not list(out.glob(".merge-tmp-*"))
