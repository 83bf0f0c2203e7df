"""``sample_completions`` (plugins/preference/generation.py): the default decode keeps the eos text (SFT/DPO data
builders rely on it), ``skip_special_tokens=True`` gives exactly the text TRL's GRPO trainer hands reward functions.

The model is scripted (it "generates" fixed ids) and the tokenizer is the embedded tool tokenizer, whose eos
``<|im_end|>`` is not one of the plain embedded tokenizer's specials: nothing is downloaded or trained."""

from __future__ import annotations

import torch

from trl_ext.embedded.models import embedded_tokenizer
from trl_ext_plugins.preference.generation import sample_completions


def tool_tokenizer():
    tokenizer = embedded_tokenizer("tiny-qwen3-tools")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class ScriptedModel:
    """Stands in for a causal LM: ``generate`` appends ``continuation`` (ids) to every prompt, then pads."""

    device = torch.device("cpu")
    training = False

    def __init__(self, continuation: list[int], pad: int, padding: int = 2):
        self.new = continuation + [pad] * padding

    def eval(self):
        pass

    def train(self, mode=True):
        pass

    def generate(self, input_ids, attention_mask, max_new_tokens, num_return_sequences, **kwargs):
        ids = input_ids.repeat_interleave(num_return_sequences, 0)
        return torch.cat([ids, torch.tensor([self.new] * ids.shape[0])], 1)


def action_ids(tokenizer, text: str, trailing: str = "") -> list[int]:
    """``text`` then the eos, then ``trailing`` (what a model may emit after its eos; never part of a completion)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids + (tokenizer(trailing, add_special_tokens=False)["input_ids"] if trailing else [])


def test_default_decode_keeps_the_eos_text_and_stops_there():
    tokenizer = tool_tokenizer()
    model = ScriptedModel(action_ids(tokenizer, "add(12,3)", trailing=" junk"), tokenizer.pad_token_id)
    samples = sample_completions(model, tokenizer, ["U:(12+3)?\nA:"], num_samples=2, do_sample=True)
    assert samples == [["add(12,3)<|im_end|>"] * 2]


def test_skip_special_tokens_decodes_as_trl_decodes_completions_for_rewards():
    """TRL's GRPO trainer: ``processing_class.batch_decode(completion_ids, skip_special_tokens=True)`` of the ids up
    to and including the first eos (``trl/trainer/grpo_trainer.py``)."""
    tokenizer = tool_tokenizer()
    ids = action_ids(tokenizer, "add(12,3)", trailing=" junk")
    model = ScriptedModel(ids, tokenizer.pad_token_id)
    samples = sample_completions(model, tokenizer, ["U:(12+3)?\nA:", "U:1?\nA:"], num_samples=3, do_sample=True,
                                 skip_special_tokens=True)
    completion_ids = ids[:ids.index(tokenizer.eos_token_id) + 1]
    trl_text = tokenizer.batch_decode([completion_ids], skip_special_tokens=True)[0]
    assert trl_text == "add(12,3)"
    assert samples == [[trl_text] * 3] * 2


def test_samples_come_from_the_models_own_distribution_whatever_its_generation_config():
    """A model shipping sampling defaults (Qwen2.5-Instruct: repetition_penalty 1.05) or a min_p was not sampled from
    its own distribution: transformers fills every field a call leaves unset from model.generation_config. The same
    seed now gives the same samples with and without those fields, and the model's config is restored afterwards."""
    from trl_ext.embedded.models import build_model

    tokenizer = embedded_tokenizer("tiny-qwen2")
    prompts = ["12+3=", "7+40="]

    def draw(**config):
        model = build_model("tiny-qwen2", seed=0).float()
        for key, value in config.items():
            setattr(model.generation_config, key, value)
        samples = sample_completions(model, tokenizer, prompts, num_samples=4, max_new_tokens=12, do_sample=True,
                                     temperature=1.0, seed=0)
        assert all(getattr(model.generation_config, key) == value for key, value in config.items())
        return samples

    plain = draw()
    assert draw(repetition_penalty=5.0) == plain
    assert draw(min_p=0.5, no_repeat_ngram_size=1) == plain
