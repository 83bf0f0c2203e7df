"""rollout_logprobs records each sampled token's log-prob while generating, one step's scores at a time: the numbers
are exactly those of transformers' ``output_scores`` (every step's scores kept), for plain and PEFT models."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from trl_ext.embedded.models import build_model
from trl_ext_plugins.rollout.rollout_logprobs import recording_logprobs, sampled_token_logprobs

PROMPTS = torch.tensor([[0, 0, 5, 9, 11], [7, 3, 12, 4, 8]])  # left-padded like TRL's batches
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def _config(**sampling):
    return GenerationConfig(max_new_tokens=12, do_sample=True, pad_token_id=0, eos_token_id=2, **sampling)


def _both_ways(model, config):
    torch.manual_seed(0)
    with recording_logprobs(model, config.max_new_tokens) as recorder:
        sequences = model.generate(input_ids=PROMPTS, attention_mask=MASK, generation_config=config)
    recorded = recorder.result(sequences[:, PROMPTS.size(1):])
    torch.manual_seed(0)
    out = model.generate(input_ids=PROMPTS, attention_mask=MASK, generation_config=config, output_scores=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, sequences)  # the recorder changed nothing that was sampled
    return recorded, sampled_token_logprobs(out.scores, out.sequences[:, PROMPTS.size(1):])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 5}, {"top_p": 0.8, "min_p": 0.05}],
                         ids=["plain", "temperature-top_k", "top_p-min_p"])
def test_recorded_logprobs_equal_output_scores_bit_for_bit(sampling):
    model = build_model("tiny-qwen2", seed=0).eval()
    recorded, reference = _both_ways(model, _config(**sampling))
    assert recorded.shape == reference.shape and recorded.shape[1] > 0
    assert torch.equal(recorded, reference)
    assert torch.isfinite(recorded).all()  # sampled tokens always have support under the truncated distribution


def test_peft_model_records_through_its_base_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("tiny-qwen2", seed=0), LoraConfig(r=4, target_modules=["q_proj"])).eval()
    recorded, reference = _both_ways(model, _config(temperature=0.9))
    assert torch.equal(recorded, reference)
    assert "_get_logits_processor" not in vars(model.get_base_model())  # the shadowing ends with the block


def test_a_recorder_transformers_never_ran_is_a_loud_error():
    from trl_ext_plugins.rollout.rollout_logprobs import SampledTokenLogprobs

    with pytest.raises(RuntimeError, match="recorded 0 sampling steps for 3 generated tokens"):
        SampledTokenLogprobs(8).result(torch.zeros(2, 3, dtype=torch.long))


def test_building_the_reduced_precision_copy_draws_nothing_from_the_global_generator():
    """The copy is built at a session's first rollout: an uninterrupted run builds it at step 0, a resumed one at its
    checkpoint's step, after the RNG state was restored. Its (discarded) random initialisation must not draw from the
    global generator, or the resumed run samples other tokens from then on."""
    from types import SimpleNamespace

    from trl_ext_plugins.rollout.rollout_logprobs import RolloutLogprobs, RolloutLogprobsParams

    model = build_model("tiny-qwen2", seed=0)
    plugin = RolloutLogprobs(RolloutLogprobsParams(dtype="bfloat16"))
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=2))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    copy = plugin._generation_model(trainer, model)
    assert torch.equal(torch.get_rng_state(), before)
    assert copy.dtype == torch.bfloat16
    assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(copy.parameters(), model.parameters(), strict=True))
