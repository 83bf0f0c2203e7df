"""delta_pairs keys its cache on the whole prompt list: two prompt sets that differ only late get different keys.

In datasets 5 ``dataset["prompt"]`` is a lazy Column whose printed form is cut short, so keying on it made different
prompt sets share a cache entry (and silently reuse the wrong pairs)."""

from datasets import Dataset

from trl_ext_plugins.preference import generation as gen
from trl_ext_plugins.preference.delta_pairs import DeltaPairs, DeltaPairsParams


def test_delta_pairs_cache_key_covers_every_prompt(monkeypatch, tmp_path):
    keys = []
    monkeypatch.setattr(gen, "resolve_model", lambda ref, plugin: ref)
    monkeypatch.setattr(gen, "model_fingerprint", lambda path: {"id": path})
    monkeypatch.setattr(gen, "cached_dataset", lambda root, key, build: (keys.append(key) or ([], True)))
    plugin = DeltaPairs(DeltaPairsParams(strong="strong", weak="weak", cache_dir=str(tmp_path)))
    prompts = [f"{i}+{i}=" for i in range(100)]
    for last in ("99+99=", "changed"):
        plugin.trl_ext_prepare_dataset(Dataset.from_dict({"prompt": prompts[:-1] + [last]}), "train", stage=None)
    assert len(keys) == 2 and keys[0] != keys[1]
