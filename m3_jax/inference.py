"""Loading a checkpoint for inference: an export (`--mode=export`) or an HF MiniMax-M3 directory, and the tokenizer
to go with it (ours, or the checkpoint's own HF tokenizer). Shared by the drivers m3_jax.generate and
m3_jax.eval_long; no command-line flags here, so both can import it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence


def load_model(path: str, dtype: str | None = None):
  """(model, TextConfig) from an export or an HF directory."""
  from flax import nnx  # noqa: PLC0415
  from m3_jax.interop import hf  # noqa: PLC0415
  from m3_jax.models.config import TextConfig  # noqa: PLC0415
  from m3_jax.models.transformer import TextModel  # noqa: PLC0415
  from m3_jax.train import checkpoint as ckpt_lib  # noqa: PLC0415
  if ckpt_lib.is_export(path):
    cfg = TextConfig.from_dict(ckpt_lib.load_export_config(path))
    abstract = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    both = ckpt_lib.restore_params(path, {"params": params, "rest": rest})
    return nnx.merge(graphdef, both["params"], both["rest"]), cfg
  if os.path.exists(os.path.join(path, "config.json")):
    return hf.load(path, dtype, text_only=True)
  raise FileNotFoundError(f"checkpoint {path}: neither an export (model_config.json + params/) nor an HF "
                          "directory (config.json + safetensors)")


class HFTokenizer:
  """An HF checkpoint's own tokenizer.json (any `tokenizers` model) with the interface of ours; the
  end-of-sequence id comes from generation_config.json or config.json (the first one when they list several)."""

  def __init__(self, path: str, checkpoint: str):
    import tokenizers  # noqa: PLC0415
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.eot_id = None
    for name in ("generation_config.json", "config.json"):
      file = os.path.join(checkpoint, name)
      if self.eot_id is None and os.path.exists(file):
        with open(file) as f:
          try:
            raw = json.load(f)
          except ValueError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
        self.eot_id = eos[0] if isinstance(eos, list) and eos else eos

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids  # with the tokenizer's own special tokens, as HF's tokenizer(text) adds them

  def encode_batch(self, texts, *, allow_special: bool = False) -> list[list[int]]:
    """Pieces of a longer text (m3_jax.data.long_tasks): no special tokens added to each piece, and literal
    special-token strings in the text stay text unless allow_special."""
    prev = self._tok.encode_special_tokens
    self._tok.encode_special_tokens = not allow_special
    try:
      return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]
    finally:
      self._tok.encode_special_tokens = prev

  def decode(self, ids, *, skip_special: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special)


def load_tokenizer(paths: Sequence[str], checkpoint: str):
  """The first of `paths` that exists: ours (fixed special ids) when it is one of ours, else any HF `tokenizers`
  file (its end-of-sequence id from `checkpoint`'s configs)."""
  from m3_jax.data.tokenizer import Tokenizer  # noqa: PLC0415
  for path in paths:
    if path and os.path.isfile(path):
      try:
        return Tokenizer.from_file(path)
      except ValueError:  # not one of ours: its special tokens differ
        return HFTokenizer(path, checkpoint)
  raise FileNotFoundError(f"no tokenizer: none of {[p for p in paths if p]} exists (--tokenizer)")
