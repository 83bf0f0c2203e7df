"""Character-level tokenizer for the embedded models, built in code with `tokenizers`.

Each character of a small alphabet (digits, arithmetic signs, some punctuation, space, newline and the
Latin letters) is one token, plus four special tokens. The alphabet is kept small on purpose: with the
256-symbol byte alphabet, the tiny model still put about a tenth of its sampling mass (temperature 1) on
characters that never occur in answers after 500 SFT steps, noise that a following GRPO stage samples.

The pipeline is a byte-level BPE with no merges because that is what `Qwen2Tokenizer` rebuilds from a
saved vocabulary: `AutoTokenizer` on a directory whose config says `qwen2` always picks `Qwen2Tokenizer`
(transformers 5 ignores `tokenizer_class` for that model type), and with this design it produces the same
ids as the tokenizer saved here. The one difference: a character outside the alphabet becomes `<unk>`
here, while `Qwen2Tokenizer` drops it.
"""

import string

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
ALPHABET = string.digits + "+-*/=()<>.,:;?! \n" + string.ascii_letters


def character_backend(special_tokens, alphabet: str, unk_token: str) -> Tokenizer:
    """A byte-level BPE without merges: ids ``0..`` are ``special_tokens``, then one id per ``alphabet`` character."""
    # Byte-level BPE stores characters in the byte-level alphabet (" " is "Ġ", "\n" is "Ċ").
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {token: i for i, token in enumerate(special_tokens)}
    for character in alphabet:
        ((symbol, _),) = byte_level.pre_tokenize_str(character)
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk_token))
    # NFC is what Qwen2Tokenizer normalizes with. Its regex split is left out: with no merges it
    # cannot change any id.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Return the embedded tokenizer: ids 0-3 are pad, bos, eos, unk, then one id per `ALPHABET` character.

    No special token is added automatically (no bos): prompts tokenize to exactly their characters,
    so TRL's prompt/completion split and the evaluation see the same ids. Answers end with eos.
    Padding is on the left, which batched generation needs; TRL's trainers pad their own batches
    with an explicit side, so this setting does not affect SFT, DPO, KTO, reward or GRPO training.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=character_backend(SPECIAL_TOKENS, ALPHABET, UNK_TOKEN),
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # Declared so that Qwen2Tokenizer does not add its own "<|endoftext|>", which would grow the
        # vocabulary past the model's embedding size.
        unk_token=UNK_TOKEN,
        padding_side="left",
        # The default clean-up would delete the space before punctuation and break round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
