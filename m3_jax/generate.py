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

import os
import sys

from absl import app, flags, logging

from m3_jax import inference
from m3_jax.inference import load_model

_CKPT = flags.DEFINE_string("checkpoint", None, "export directory or HF checkpoint directory")
_PROMPT = flags.DEFINE_string("prompt", "", "the prompt text")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate")
_TEMP = flags.DEFINE_float("temperature", 0.0, "0 = greedy")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_TOKENIZER = flags.DEFINE_string("tokenizer", "data/tokenizer.json", "tokenizer.json when the checkpoint has none")
_DTYPE = flags.DEFINE_string("dtype", None, "HF checkpoints: parameter + compute dtype (default: the stored one)")
flags.mark_flag_as_required("checkpoint")


def load_tokenizer(checkpoint: str, fallback: str):
  """The checkpoint's tokenizer.json, else `fallback` (ours or any HF `tokenizers` file)."""
  return inference.load_tokenizer([os.path.join(checkpoint, "tokenizer.json"), fallback], checkpoint)


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
