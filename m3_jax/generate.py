r"""Generate text from a checkpoint, streaming tokens as they come (KV + MSA index-key caches).

  python -m m3_jax.generate --checkpoint=workdirs/tiny_lm/export --prompt="To be, or not to be"
  python -m m3_jax.generate --checkpoint=/path/to/hf_minimax_m3 --prompt="..." --max_new_tokens=64 \
      --temperature=0.8 --top_p=0.95 --seed=1

--checkpoint is an export directory (`--mode=export`: model_config.json + params/) or an HF MiniMax-M3 directory
(config.json + safetensors; a VL checkpoint generates from its text tower). The tokenizer is the checkpoint
directory's tokenizer.json when present (ours, or HF's with the end-of-sequence id from generation_config.json /
config.json), else --tokenizer (default: data/tokenizer.json, the one `make run` trains).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

_CKPT = flags.DEFINE_string("checkpoint", None, "export directory or HF checkpoint directory")
_PROMPT = flags.DEFINE_string("prompt", "", "the prompt text")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_TOKENIZER = flags.DEFINE_string("tokenizer", "data/tokenizer.json", "tokenizer.json when the checkpoint has none")
_DTYPE = flags.DEFINE_string("dtype", None, "HF checkpoints: parameter + compute dtype (default: the stored one)")
flags.mark_flag_as_required("checkpoint")


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
  raise FileNotFoundError(f"--checkpoint={path}: neither an export (model_config.json + params/) nor an HF "
                          "directory (config.json + safetensors)")


class HFTokenizer:
  """An HF checkpoint's own tokenizer.json (any `tokenizers` model) with the interface `main` uses; the
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

  def decode(self, ids, *, skip_special: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special)


def load_tokenizer(checkpoint: str, fallback: str):
  from m3_jax.data.tokenizer import Tokenizer  # noqa: PLC0415
  own = os.path.join(checkpoint, "tokenizer.json")
  if os.path.exists(own):
    try:
      return Tokenizer.from_file(own)
    except ValueError:  # not one of ours (its special tokens differ): the checkpoint's HF tokenizer
      return HFTokenizer(own, checkpoint)
  if os.path.exists(fallback):
    return Tokenizer.from_file(fallback)
  raise FileNotFoundError(f"no tokenizer: {checkpoint}/tokenizer.json and --tokenizer={fallback} do not exist")


def check_args(max_new_tokens: int, temperature: float, top_p: float, checkpoint: str) -> None:
  """The flags, checked before any model is loaded or compiled (ValueError naming the flag)."""
  if max_new_tokens < 0:
    raise ValueError(f"--max_new_tokens={max_new_tokens} must be >= 0 (0 prints the prompt only)")
  if temperature < 0:
    raise ValueError(f"--temperature={temperature} must be >= 0 (0 is greedy)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"--top_p={top_p} must be in (0, 1]")
  if not (os.path.isfile(os.path.join(checkpoint, "model_config.json"))
          or os.path.isfile(os.path.join(checkpoint, "config.json"))):
    raise ValueError(f"--checkpoint={checkpoint}: neither an export (model_config.json + params/) nor an HF "
                     "directory (config.json + safetensors)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    check_args(_MAX_NEW.value, _TEMP.value, _TOP_P.value, _CKPT.value)
  except ValueError as e:
    sys.exit(f"error: {e}")  # one line; absl's UsageError would print every flag's help around it
  if _MAX_NEW.value == 0:  # nothing to generate: the prompt as is, without loading the model
    print("--max_new_tokens=0: nothing generated", file=sys.stderr)
    sys.stdout.write(_PROMPT.value + "\n")
    return
  logging.set_verbosity(logging.WARNING)
  import jax.numpy as jnp  # noqa: PLC0415
  from m3_jax.models import decode  # noqa: PLC0415
  model, cfg = load_model(_CKPT.value, _DTYPE.value)
  tok = load_tokenizer(_CKPT.value, _TOKENIZER.value)
  ids = tok.encode(_PROMPT.value) or [tok.eot_id if tok.eot_id is not None else 0]
  if max(ids) >= cfg.vocab_size:
    raise ValueError(f"the tokenizer produced id {max(ids)} but the model's vocab_size is {cfg.vocab_size}")
  sys.stdout.write(_PROMPT.value)
  sys.stdout.flush()
  new: list[int] = []
  shown = ""

  def stream(token):
    nonlocal shown
    new.append(int(token[0]))
    text = tok.decode(new, skip_special=True)
    sys.stdout.write(text[len(shown):])  # decode the whole tail: a byte-level token may finish a character
    sys.stdout.flush()
    shown = text

  decode.generate(model, jnp.asarray([ids], jnp.int32), max_new_tokens=_MAX_NEW.value, temperature=_TEMP.value,
                  top_p=_TOP_P.value, seed=_SEED.value, eos_id=tok.eot_id, on_token=stream)
  sys.stdout.write("\n")


if __name__ == "__main__":
  app.run(main)
