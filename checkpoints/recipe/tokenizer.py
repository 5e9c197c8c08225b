"""Byte-level BPE tokenizer trained with Hugging Face `tokenizers` on the training split only.

`<|endoftext|>` (id 0) separates documents in the token stream and is the model's EOS token.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOS_TOKEN) != 0:
        raise AssertionError(f"{EOS_TOKEN} should be token 0, got {tok.token_to_id(EOS_TOKEN)}")
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents encoded, each followed by the EOS id, as one uint16 array."""
    eos = tok.token_to_id(EOS_TOKEN)
    if tok.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab size {tok.get_vocab_size()} does not fit the uint16 token stream")
    pieces = []
    for enc in tok.encode_batch(texts):
        pieces.append(np.asarray(enc.ids, np.uint16))
        pieces.append(np.asarray([eos], np.uint16))
    return np.concatenate(pieces)
