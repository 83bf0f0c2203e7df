"""A character-level tokenizer with a tool-calling chat template, built in code (nothing is downloaded).

The embedded tokenizer of :mod:`trl_ext.embedded.tokenizer` has no chat template and an alphabet without
``{ } " _ |``, so it cannot carry a tool call: TRL's GRPO trainer refuses tools (``environment_factory``) unless
``trl.chat_template_utils.supports_tool_calling`` accepts the tokenizer, and it parses completions with
``add_response_schema`` / ``parse_response``, which recognise a fixed set of chat templates only. This tokenizer is a
separate one (the embedded tokenizer's ids are left as they are, recorded fixtures depend on them):

* one token per printable ASCII character (space to ``~``) plus newline and tab, byte-level with no merges, as the
  embedded tokenizer is built, so ``AutoTokenizer`` on a saved copy (``Qwen2Tokenizer``) gives the same ids;
* the special tokens of TRL's Qwen3 chat template, each one token (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``
  ... ``</think>``), with ``<|im_end|>`` as eos and ``<|endoftext|>`` as pad, as in Qwen3;
* TRL's own copy of the Qwen3 chat template (``trl.chat_template_utils.qwen3_chat_template``), byte for byte, so
  ``add_response_schema`` maps it to TRL's Qwen3 response parser (tool calls ``<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>``) and TRL substitutes its prefix-preserving training template in multi-turn
  rollouts.
"""

from __future__ import annotations

import string

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from trl_ext.embedded.tokenizer import character_backend

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
# Qwen3's chat-template markers: every one must be a single token for the response parser to find it.
TEMPLATE_TOKENS = (IM_START, EOS_TOKEN, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                   "<think>", "</think>")
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, *TEMPLATE_TOKENS)
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
assert set(string.printable) - set(ALPHABET) == {"\r", "\x0b", "\x0c"}


def chat_template() -> str:
    """TRL's Qwen3 chat template (the exact text ``add_response_schema`` compares against)."""
    from trl.chat_template_utils import qwen3_chat_template

    return qwen3_chat_template


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0-1 are pad and unk, 2-9 the Qwen3 template markers, then one id per ``ALPHABET`` character.

    No bos and no special token added automatically; padding on the left (batched generation), as the embedded
    tokenizer.
    """
    backend = character_backend(SPECIAL_TOKENS, ALPHABET, UNK_TOKEN)
    # Added tokens are matched before pre-tokenization, so "<tool_call>" is one id, never eleven characters.
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(TEMPLATE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = chat_template()
    return tokenizer
