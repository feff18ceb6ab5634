"""The builder's Gemma factories (common/builtin): the Gemma tokenizer trained here (BOS first, byte fallback,
merges from the corpus and a family's fixed text, the same after save and reload) and the seeded Gemma2 encoder
on its vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.builtin.text_encoders import gemma2
from common.builtin.tokenizer.gemma import SPECIAL_TOKENS, gemma_tokenizer

FIXED = ("Given a user prompt, generate an Enhanced prompt that provides detailed visual descriptions.",)


@dataclass(frozen=True)
class _Spec:
    seed: int = 3


def test_tokenizer_reloads_equal_starts_with_bos_and_falls_back_to_bytes(tmp_path):
    from transformers import AutoTokenizer, GemmaTokenizer, GemmaTokenizerFast

    tok = gemma_tokenizer(FIXED)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(again, (GemmaTokenizer, GemmaTokenizerFast))
    odd = "a red fox caf\u00e9 \u732b 42!"
    ids = tok(odd).input_ids
    assert ids == again(odd).input_ids and ids[0] == tok.bos_token_id == SPECIAL_TOKENS.index("<bos>")
    assert tok.unk_token_id not in ids  # unknown characters become byte tokens
    assert tok.decode(ids, skip_special_tokens=True) == odd
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)


def test_a_fixed_text_is_learnt_into_few_tokens():
    with_it, without = gemma_tokenizer(FIXED), gemma_tokenizer()
    assert len(with_it(FIXED[0]).input_ids) < len(without(FIXED[0]).input_ids) < len(FIXED[0])
    assert gemma_tokenizer(FIXED).get_vocab() == with_it.get_vocab()  # deterministic


def test_gemma2_encoder_is_seeded_on_the_tokenizer_vocabulary():
    tok = gemma_tokenizer()
    sizes = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    a, b = gemma2(_Spec(), "text_encoder", tok, **sizes), gemma2(_Spec(), "text_encoder", tok, **sizes)
    other = gemma2(_Spec(seed=4), "text_encoder", tok, **sizes)
    assert a.config.vocab_size == len(tok) and a.config.bos_token_id == tok.bos_token_id
    ids = torch.tensor([tok("a red fox").input_ids])
    with torch.no_grad():
        out = a(ids).last_hidden_state
    assert torch.equal(out, b(ids).last_hidden_state) and not torch.equal(out, other(ids).last_hidden_state)
