"""Byte-level BPE tokenizer: a thin wrapper over HF `tokenizers` with the project's special tokens.

Byte-level means every string (any script, emoji, control characters, stray whitespace) maps to tokens and
decodes back to exactly the same string; there is no unknown token and no normaliser.

Special tokens have fixed ids (m3_jax.core.batch.SPECIAL_TOKENS), in this order, so that code can rely on them
without reading the vocab:

    0 <|pad|>           padding; the data pipeline pads with 0 and masks it out of the loss
    1 <|endoftext|>     appended after every document
    2 <image>           placeholder that the multimodal model replaces with visual tokens
    3 <video>           same, for video
    4..7                <|image_start|> <|image_end|> <|video_start|> <|video_end|>
    8..15               <|reserved_0|> .. <|reserved_7|>, kept free so later additions do not shift ids
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from m3_jax.core.batch import EOT, IMAGE, PAD, SPECIAL_TOKENS, VIDEO

__all__ = ["MIN_VOCAB_SIZE", "Tokenizer", "train_bpe"]


# Smallest vocab that holds the 256 byte symbols, the special tokens and at least one merge.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1


class Tokenizer:
  """Byte-level BPE tokenizer with fixed special-token ids (see module docstring)."""

  def __init__(self, tok: tokenizers.Tokenizer):
    for i, name in enumerate(SPECIAL_TOKENS):
      got = tok.token_to_id(name)
      if got != i:
        raise ValueError(f"tokenizer has special token {name!r} at id {got}, expected {i}; "
                         "it was not built by m3_jax.data.train_bpe")
    self._tok = tok

  @classmethod
  def from_file(cls, path: str) -> "Tokenizer":
    """Loads a `tokenizer.json` written by `train_bpe` (or `Tokenizer.save`)."""
    if not os.path.exists(path):
      raise FileNotFoundError(f"tokenizer file {path!r} does not exist; run m3_jax.data.prepare(data_dir) first")
    return cls(tokenizers.Tokenizer.from_file(path))

  def save(self, path: str) -> None:
    self._tok.save(path)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped HF tokenizer (for batch APIs not mirrored here)."""
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return PAD

  @property
  def eot_id(self) -> int:
    return EOT

  @property
  def image_id(self) -> int:
    return IMAGE

  @property
  def video_id(self) -> int:
    return VIDEO

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
    """Returns the token ids of `text`.

    allow_special: when True, literal special-token strings in `text` (e.g. "<image>") become their special ids;
      when False they are encoded as ordinary bytes, which is what corpus text wants (a Python doc page that
      mentions "<image>" must not turn into an image placeholder).
    """
    return self.encode_batch([text], allow_special=allow_special)[0]

  def encode_batch(self, texts: Sequence[str], *, allow_special: bool = True) -> list[list[int]]:
    """`encode` for many texts at once (parallel in Rust)."""
    prev = self._tok.encode_special_tokens
    self._tok.encode_special_tokens = not allow_special
    try:
      encs = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
    finally:
      self._tok.encode_special_tokens = prev
    return [e.ids for e in encs]

  def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
    """Inverse of `encode`: `decode(encode(s)) == s` for every string s."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def _empty_bpe() -> tokenizers.Tokenizer:
  tok = tokenizers.Tokenizer(models.BPE())
  # add_prefix_space=False keeps decode(encode(s)) == s; the GPT-2 regex splits words/punctuation/spaces.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  return tok


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | None = None, *,
              min_frequency: int = 2, length: int | None = None) -> Tokenizer:
  """Trains a byte-level BPE on `texts` and (if `path`) writes it as `tokenizer.json`.

  Args:
    texts: training documents (any iterable of str; consumed once).
    vocab_size: total vocab including the 256 byte symbols and the special tokens; at least MIN_VOCAB_SIZE.
      A small corpus may stop short of it (no more pairs with `min_frequency`); `Tokenizer.vocab_size` is the truth.
    path: where to save, or None to keep it in memory only.
    min_frequency: a pair must occur this often to be merged.
    length: number of texts, only for the progress estimate.
  """
  if vocab_size < MIN_VOCAB_SIZE:
    raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE with {len(SPECIAL_TOKENS)} special "
                     f"tokens needs at least {MIN_VOCAB_SIZE}")
  tok = _empty_bpe()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=min_frequency,
      special_tokens=list(SPECIAL_TOKENS),  # added first, so they get ids 0..15 in order
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer, length=length)
  out = Tokenizer(tok)
  if path is not None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    tok.save(tmp)
    os.replace(tmp, path)
  return out
