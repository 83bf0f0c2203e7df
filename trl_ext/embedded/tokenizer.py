"""Character-level tokenizer for the embedded models, built in code with `tokenizers`.

Every ASCII character is one token. The vocabulary is the 256-symbol byte-level alphabet (so any text
round-trips, including letters a plugin task might use) plus four special tokens. The pipeline is a
byte-level BPE with no merges because that is exactly what `Qwen2Tokenizer` rebuilds from a saved
vocabulary: `AutoTokenizer` on a directory whose config says `qwen2` always picks `Qwen2Tokenizer`
(transformers 5 ignores `tokenizer_class` for that model type), and with this design it produces the
same ids as the tokenizer saved here.
"""

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
# `Qwen2Tokenizer` adds its own "<|endoftext|>" unk token when none is declared, which would grow the
# vocabulary past the model's embedding size, so an unk token is declared (it is never produced).
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Return the embedded tokenizer: ids 0-3 are pad, bos, eos, unk; then one id per byte symbol.

    No special token is added automatically (no bos): prompts tokenize to exactly their characters,
    so TRL's prompt/completion split and the evaluation see the same ids. Answers end with eos.
    Padding is on the left, which batched generation needs; TRL's trainers pad their own batches
    with an explicit side, so this setting does not affect SFT, DPO, KTO, reward or GRPO training.
    """
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # NFC and byte-level without a regex split are what Qwen2Tokenizer uses; with no merges the
    # split would not change any id, so it is left out.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        # The default clean-up would delete the space before punctuation and break round trips.
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
