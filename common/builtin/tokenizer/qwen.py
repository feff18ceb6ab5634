"""The Qwen-Image built-ins' tokenizer: a byte-level BPE laid out like Qwen2.5-VL's (``Qwen2Tokenizer``:
Qwen's pre-tokeniser regex, no unk, the chat special tokens after the learned vocabulary), trained here with
the ``tokenizers`` BPE trainer on a small fixed corpus.

The corpus is the English scene descriptions of :mod:`common.builtin.tokenizer.corpus`, each also wrapped
in :data:`PROMPT_TEMPLATE`, so the template's words are among the first merges: every word of the template's
system prefix is one token, as with the real tokenizer, and the prefix is exactly
:data:`PROMPT_TEMPLATE_START_IDX` tokens long, which is what ``QwenImagePipeline`` drops from the encoder's
output.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from common.builtin.tokenizer.corpus import corpus

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
VISION_PAD_TOKEN = "<|vision_pad|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"
VIDEO_PAD_TOKEN = "<|video_pad|>"
# After the learned vocabulary, in Qwen2.5-VL's order; the vision tokens give the text encoder's
# image / video token ids real entries (no prompt ever contains them).
SPECIAL_TOKENS = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN,
                  VISION_PAD_TOKEN, IMAGE_PAD_TOKEN, VIDEO_PAD_TOKEN)
PAD_TOKEN = ENDOFTEXT_TOKEN
# Qwen2.5-VL-Instruct ends a turn (and a generation) with <|im_end|>; it has no bos or unk token.
EOS_TOKEN = IM_END_TOKEN
MODEL_MAX_LENGTH = 131072

# QwenImagePipeline's prompt template and the number of leading tokens it drops (its system prefix).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_START_IDX = 34
# The template's text before the user's prompt, up to and including "<|im_start|>user\n".
PROMPT_PREFIX = PROMPT_TEMPLATE.split("{}")[0]

# Size of the learned vocabulary: the 256 byte symbols plus 320 merges (the corpus saturates at 336).
TRAINED_VOCAB_SIZE = 576
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def _training_texts() -> list[str]:
    """The corpus lines, bare and inside the template, split at the special tokens (which BPE never sees:
    no pre-token crosses one)."""
    texts: list[str] = []
    for line in corpus():
        texts.append(line)
        texts.extend(piece for piece in _SPECIAL_RE.split(PROMPT_TEMPLATE.format(line)) if piece)
    return texts


def _train() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with the normaliser and pre-tokeniser ``Qwen2Tokenizer`` uses.

    The trainer breaks count ties by symbol id and the byte alphabet is seeded in a fixed order, so the
    result is the same in every process.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        # Every byte is a token, so no prompt (ASCII or not) loses characters.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if len(vocab) != TRAINED_VOCAB_SIZE or sorted(vocab.values()) != list(range(len(vocab))):
        raise RuntimeError(f"trained {len(vocab)} tokens, expected {TRAINED_VOCAB_SIZE} with dense ids")
    return vocab, merges


def vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The learned vocabulary followed by :data:`SPECIAL_TOKENS`, and the merges."""
    vocab, merges = _train()
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab, merges


def qwen2_tokenizer() -> Qwen2Tokenizer:
    """The Qwen2 tokenizer (``AutoTokenizer.from_pretrained`` reloads it as ``Qwen2Tokenizer``)."""
    from transformers import Qwen2Tokenizer

    vocab, merges = vocab_and_merges()
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t != PAD_TOKEN],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) != len(vocab):
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens, expected {len(vocab)}")
    prefix_len = len(tokenizer(PROMPT_PREFIX).input_ids)
    if prefix_len != PROMPT_TEMPLATE_START_IDX:
        raise RuntimeError(f"the template's prefix is {prefix_len} tokens, expected {PROMPT_TEMPLATE_START_IDX}")
    return tokenizer


# Qwen3's chat template, as much of it as the pipelines' one user turn without tools reaches
# (``enable_thinking=False`` adds the empty think block the real template adds).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
QWEN3_THINK_TOKENS = ("<think>", "</think>")


def qwen3_tokenizer():
    """The built-ins' Qwen2 tokenizer with Qwen3's thinking tokens and chat template (Qwen3's vocabulary is
    Qwen2's plus those)."""
    tok = qwen2_tokenizer()
    tok.add_tokens(list(QWEN3_THINK_TOKENS))
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok
