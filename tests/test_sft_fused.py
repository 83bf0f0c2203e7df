"""The SFT aggregation seam keeps TRL's fused LM head: same loss as from full logits, no (B, T, V) tensor built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trl_ext.host import PluginHost
from trl_ext_plugins.trainers.sft import SFT, SFTParams
from tests.test_parity import _build


class LargestVocabTensor(TorchDispatchMode):
    """Records the most rows of any vocabulary-wide tensor (last dimension = vocabulary) an operator produced."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


def _batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def test_sequence_normalisation_equals_the_formula_from_full_logits_without_building_them(tiny_model_dir, tmp_path,
                                                                                          monkeypatch):
    import trl.trainer.utils

    chunk = 16  # vocabulary columns per tile of TRL's chunked log-prob head: fewer than the vocabulary
    monkeypatch.setattr(trl.trainer.utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", chunk)
    trainer = _build("sft", tiny_model_dir, tmp_path, None, PluginHost([SFT(SFTParams(normalization="sequence"))]), {})
    inputs = _batch(trainer)
    model = trainer.model
    with torch.no_grad():
        with LargestVocabTensor(model.config.vocab_size) as probe:
            loss = trainer.compute_loss(model, dict(inputs))
        with LargestVocabTensor(model.config.vocab_size) as unfused:  # the probe sees a plain forward's logits
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")).logits
    # Reference, independent of the fused head: per-sequence mean NLL of the shifted labels, then the batch mean.
    labels = inputs["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels.clamp(min=0), reduction="none")
    counted = labels != -100
    per_sequence = torch.where(counted, nll, 0.0).sum(-1) / counted.sum(-1).clamp(min=1)
    expected = per_sequence[counted.any(-1)].mean()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6), (loss.item(), expected.item())
    assert model.config.vocab_size > chunk and unfused.rows >= inputs["input_ids"].numel()
    assert probe.rows == 0  # the fused head scored vocabulary tiles: no tensor as wide as the vocabulary existed


def test_sequence_normalisation_is_per_example_when_examples_are_packed(tiny_model_dir, tmp_path):
    """With packing, TRL puts the micro-batch in one row (examples restart at position 0): the per-sequence mean must
    be per example (it was the packed row's token mean). Reference: each packed example forwarded alone, its mean NLL
    over its counted labels, then the mean over examples. A padded batch with position ids (0 on the padding) keeps
    one row per example."""
    from trl_ext.trainers.sft import split_packed_examples

    host = PluginHost([SFT(SFTParams(normalization="sequence"))])
    trainer = _build("sft", tiny_model_dir, tmp_path, None, host, {"per_device_train_batch_size": 4, "packing": True})
    inputs = _batch(trainer)
    ids, labels, positions = inputs["input_ids"][0], inputs["labels"][0], inputs["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
    assert inputs["input_ids"].shape[0] == 1 and len(starts) > 2  # one row, several examples
    per_example = []
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(inputs))
        for a, b in zip(starts, starts[1:]):
            logits = trainer.model(input_ids=ids[a:b].unsqueeze(0)).logits[0, :-1]
            target = labels[a + 1:b]
            counted = target != -100
            if counted.any():
                nll = F.cross_entropy(logits.float(), target.clamp(min=0), reduction="none")
                per_example.append(nll[counted].mean())
    expected = torch.stack(per_example).mean()
    assert torch.allclose(loss, expected, rtol=1e-4, atol=1e-5), (loss.item(), expected.item())

    per_token, mask = torch.ones(2, 4), torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 0]])
    padded_positions = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 2, 3, 0]])  # right padding at position 0
    out, out_mask = split_packed_examples(per_token, mask, padded_positions)
    assert torch.equal(out_mask, mask) and out.shape == per_token.shape


def test_one_forward_per_micro_batch_whichever_path(tiny_model_dir, tmp_path):
    """The default ``sft`` (token normalisation) keeps TRL's loss: the trainer must not run the fused-head forward,
    learn that no plugin reduces the loss, and then run TRL's forward too (that doubled the forward: 1.3-1.5x steps)."""
    for params, plugin_reduces in ((SFTParams(), False), (SFTParams(normalization="sequence"), True)):
        trainer = _build("sft", tiny_model_dir, tmp_path / params.normalization, None, PluginHost([SFT(params)]), {})
        inputs = _batch(trainer)
        calls = []
        handle = trainer.model.register_forward_hook(lambda *a: calls.append(1))
        try:
            trainer.compute_loss(trainer.model, dict(inputs))
            trainer.compute_loss(trainer.model, dict(inputs))
        finally:
            handle.remove()
        assert len(calls) == 2, (params.normalization, len(calls))
        assert trainer.plugin_reduces_loss() is plugin_reduces


# -- TRL's options and metrics on the plugin path -------------------------------------------------------------------


def _sequence_trainer(model_dir, tmp_path, args):
    return _build("sft", model_dir, tmp_path, None, PluginHost([SFT(SFTParams(normalization="sequence"))]), args)


def test_sequence_normalisation_keeps_trls_dft_token_weight(tiny_model_dir, tmp_path):
    """``loss_type: dft`` (arXiv 2508.05629) weighs each token's NLL by its detached probability; the plugin path used
    the plain NLL (4.4420 for both loss types on this batch). Reference from full logits: per-sequence mean of
    ``p * nll`` over the counted labels, then the mean over sequences."""
    trainer = _sequence_trainer(tiny_model_dir, tmp_path, {"loss_type": "dft"})
    inputs = _batch(trainer)
    model = trainer.model
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(inputs))
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")).logits
    labels = inputs["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels.clamp(min=0), reduction="none")
    counted = labels != -100
    dft = torch.where(counted, nll * torch.exp(-nll), 0.0)
    expected = (dft.sum(-1) / counted.sum(-1).clamp(min=1))[counted.any(-1)].mean()
    plain = (torch.where(counted, nll, 0.0).sum(-1) / counted.sum(-1).clamp(min=1))[counted.any(-1)].mean()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6), (loss.item(), expected.item())
    assert abs(expected.item() - plain.item()) > 1e-2


def test_sequence_normalisation_logs_trls_metrics(tiny_model_dir, tmp_path):
    """The plugin path logged no ``entropy``, ``mean_token_accuracy`` or ``num_tokens``; they now equal what TRL's own
    compute_loss logs on the same batch."""
    from trl import SFTTrainer

    trainer = _sequence_trainer(tiny_model_dir, tmp_path, {})
    inputs = _batch(trainer)
    trainer.model.train()  # num_tokens is counted in training
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        trainer.compute_loss(trainer.model, dict(inputs))
        ours = {key: list(values) for key, values in trainer._metrics["train"].items()}
        trainer._metrics["train"].clear()
        trainer._total_train_tokens = 0
        SFTTrainer.compute_loss(trainer, trainer.model, dict(inputs))
        theirs = {key: list(values) for key, values in trainer._metrics["train"].items()}
    assert set(ours) == set(theirs) >= {"entropy", "mean_token_accuracy", "num_tokens"}
    assert ours["num_tokens"] == theirs["num_tokens"] == [inputs["attention_mask"].sum().item()]
    for key in ("entropy", "mean_token_accuracy"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-6)


def test_label_smoothing_with_a_reducing_plugin_is_refused(tiny_model_dir, tmp_path, trl_ext_catalog,
                                                           register_plugin):
    """Label smoothing needs the full logits, which the plugin path never builds: it was silently not applied."""
    from trl_ext.errors import RecipeError
    from trl_ext.recipe import StageSpec
    from trl_ext.stage import resolve_stage

    register_plugin(SFT)

    def stage(normalization):
        return StageSpec(trainer="sft", model="embedded:tiny-qwen2", dataset="embedded:arithmetic",
                         plugins=[{"name": "sft", "params": {"normalization": normalization}}],
                         args={"label_smoothing_factor": 0.1})

    with pytest.raises(RecipeError, match=r"args\.label_smoothing_factor: .*\['sft'\]"):
        resolve_stage(stage("sequence"), 0, trl_ext_catalog)
    resolve_stage(stage("token"), 0, trl_ext_catalog)  # TRL's own path applies it
    trainer = _sequence_trainer(tiny_model_dir, tmp_path, {"label_smoothing_factor": 0.1})
    with pytest.raises(ValueError, match=r"args\.label_smoothing_factor"):
        trainer.compute_loss(trainer.model, dict(_batch(trainer)))


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    from trl_ext.embedded.models import materialize_model

    return str(materialize_model("tiny-qwen3-moe", tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", seed=0))


def test_sequence_normalisation_keeps_the_router_aux_loss(moe_model_dir, tmp_path):
    """On an MoE policy TRL adds ``router_aux_loss_coef * aux_loss``; the plugin path dropped it (and its metric)."""
    trainer = _sequence_trainer(moe_model_dir, tmp_path, {"router_aux_loss_coef": 0.05})
    assert trainer.aux_loss_enabled
    inputs = _batch(trainer)
    model = trainer.model.eval()
    with torch.no_grad():
        ours = trainer.compute_loss(model, dict(inputs))
        aux = model(**inputs, output_router_logits=True, fused_lm_head=True).aux_loss
        trainer.router_aux_loss_coef = 0.0
        nll_only = trainer.compute_loss(model, dict(inputs))
    assert aux.item() > 0
    assert ours.item() == pytest.approx(nll_only.item() + 0.05 * aux.item(), abs=1e-6)
    assert trainer._metrics["eval"]["aux_loss"][0] == pytest.approx(aux.item(), abs=1e-6)
