"""warm: weight-space averaging of reward models (ALGORITHMS.md item 16) and its refusal of mismatched models."""

import pytest
import torch

from trl_ext.recipe import StageSpec
from trl_ext.testing import check_plugin_conformance
from trl_ext_plugins.merge.math import average_state_dicts
from trl_ext_plugins.rewards.scoring import (
    ArchitectureMismatchError,
    load_sequence_classifier,
    score_texts,
)
from trl_ext_plugins.rewards.warm import Warm, WarmParams, load_warm

TEXTS = ["1+2=3", "12+34=46", "9+9=17"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three RMs from one initialisation (embedded tiny model + one head), each perturbed differently, saved."""
    from trl_ext.embedded.models import materialize_model

    base = tmp_path_factory.mktemp("warm")
    lm = str(materialize_model("tiny-qwen2", base / "lm", seed=0))
    torch.manual_seed(0)
    init, tok = load_sequence_classifier(lm)
    paths = []
    for i in range(3):
        model, _ = load_sequence_classifier(lm)
        model.load_state_dict(init.state_dict())
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        path = base / f"rm{i}"
        model.save_pretrained(path)
        tok.save_pretrained(path)
        paths.append(str(path))
    return paths


def _sd(path):
    return load_sequence_classifier(path)[0].state_dict()


def test_single_model_is_identity(models):
    merged, tok = load_warm(models[:1], None)
    single, _ = load_sequence_classifier(models[0])
    for key, value in single.state_dict().items():
        assert torch.equal(merged.state_dict()[key], value), key
    assert score_texts(merged, tok, TEXTS) == score_texts(single, tok, TEXTS)


def test_identical_copies_average_to_the_same_weights(models):
    merged, _ = load_warm([models[1]] * 3, None)
    for key, value in _sd(models[1]).items():
        assert torch.equal(merged.state_dict()[key], value), key


def test_average_is_the_mean_in_weight_space(models):
    merged, tok = load_warm(models, None)
    sds = [_sd(p) for p in models]
    for key in sds[0]:
        expected = (sum(sd[key].double() for sd in sds) / 3).float()
        assert torch.allclose(merged.state_dict()[key], expected, atol=1e-7, rtol=0), key
    # weighted average, coefficients normalised
    weighted, _ = load_warm(models[:2], None, coefficients=[3.0, 1.0])
    key = "score.weight"
    expected = (0.75 * sds[0][key].double() + 0.25 * sds[1][key].double()).float()
    assert torch.allclose(weighted.state_dict()[key], expected, atol=1e-7, rtol=0)
    # weight space, not score space: for these deep nets the merged score is not the mean of the scores ...
    singles = [score_texts(load_sequence_classifier(p)[0], tok, TEXTS) for p in models]
    mean_scores = [sum(s[i] for s in singles) / 3 for i in range(len(TEXTS))]
    assert score_texts(merged, tok, TEXTS) != pytest.approx(mean_scores, abs=1e-4)


def test_linear_head_average_equals_mean_score(models):
    """... but when only the linear head differs (shared backbone), averaging weights == averaging scores."""
    sds = [_sd(p) for p in models]
    heads_only = [{**sds[0], "score.weight": sd["score.weight"]} for sd in sds]
    merged, tok = load_sequence_classifier(models[0])
    merged.load_state_dict(average_state_dicts(heads_only))
    scores = []
    for sd in heads_only:
        model, _ = load_sequence_classifier(models[0])
        model.load_state_dict(sd)
        scores.append(score_texts(model, tok, TEXTS))
    mean_scores = [sum(s[i] for s in scores) / 3 for i in range(len(TEXTS))]
    assert score_texts(merged, tok, TEXTS) == pytest.approx(mean_scores, abs=1e-5)


def test_mismatched_architectures_are_refused_naming_both(models, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from trl_ext.embedded.models import materialize_model

    small = str(materialize_model("tiny-qwen2-small", tmp_path / "small", seed=0))
    model = AutoModelForSequenceClassification.from_pretrained(small, num_labels=1)
    model.save_pretrained(tmp_path / "small-rm")
    load_sequence_classifier(small)[1].save_pretrained(tmp_path / "small-rm")
    other = str(tmp_path / "small-rm")
    with pytest.raises(ArchitectureMismatchError) as err:
        load_warm([models[0], other], None)
    assert models[0] in str(err.value) and other in str(err.value) and "different parameters" in str(err.value)
    # same parameter names, one shape differs (a wider MLP)
    config = load_sequence_classifier(models[0])[0].config
    config.intermediate_size = 128
    wide = AutoModelForSequenceClassification.from_config(config)
    wide.save_pretrained(tmp_path / "narrow-rm")
    load_sequence_classifier(small)[1].save_pretrained(tmp_path / "narrow-rm")
    with pytest.raises(ArchitectureMismatchError, match="has shape") as err:
        load_warm([models[0], str(tmp_path / "narrow-rm")], None)
    assert models[0] in str(err.value) and "narrow-rm" in str(err.value)
    with pytest.raises(ValueError, match="2 coefficients for 3 models"):
        load_warm(models, None, coefficients=[1.0, 1.0])


def test_plugin_reward_uses_the_averaged_model(models, tmp_path):
    plugin = Warm(WarmParams(paths=models, batch_size=2))

    class FakeTrainer:
        class args:  # noqa: N801
            output_dir = str(tmp_path / "run" / "grpo" / "checkpoints")

    plugin.trl_ext_trainer_created(FakeTrainer())
    (fn,) = plugin.trl_ext_reward_functions(StageSpec(trainer="grpo", model="x", dataset={"source": "embedded:arithmetic"}))
    got = fn.fn(prompts=["1+2=", "12+34="], completions=["3", "46"])
    merged, tok = load_warm(models, None)
    assert got == pytest.approx(score_texts(merged, tok, TEXTS[:2]), abs=1e-6)
    assert plugin.scorer.model.training is False
    assert not any(p.requires_grad for p in plugin.scorer.model.parameters())


def test_conformance_and_validation():
    check_plugin_conformance(Warm)
    with pytest.raises(ValueError):
        WarmParams(paths=[])
    bad = Warm(WarmParams(paths=["a", "b"], coefficients=[1.0]))
    assert bad.trl_ext_validate_stage(stage=None, plugins=[bad])
