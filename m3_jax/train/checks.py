"""Everything that refuses a bad config, workdir or batch before compilation: a clear error naming the setting (or
the batch, row and position) here instead of minutes of compiling, a shape error inside XLA or a silently wrong
loss."""

from __future__ import annotations

from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from m3_jax.core import sharding
from m3_jax.core.batch import TEXT_KEYS, VISUAL_MARKERS
from m3_jax.data import inputs
from m3_jax.models.config import VLConfig
from m3_jax.models.multimodal import check_batch
from m3_jax.train import config_lib
from m3_jax.train.state import ModelConfig, abstract_model, param_shardings


def check_fits(cfg: ModelConfig, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  """Batch sizes divide over the batch-parallel mesh axes and the processes; every parameter over its axes."""
  div = sharding.batch_divisor(mesh)
  bs = int(config.train.batch_size)
  if bs % div:
    raise ValueError(f"train.batch_size={bs} is not divisible by the batch-parallel mesh size {div} "
                     f"(data x fsdp x expert of mesh {dict(mesh.shape)})")
  if bs % jax.process_count():
    raise ValueError(f"train.batch_size={bs} is not divisible by the process count {jax.process_count()}")
  extra = inputs.vision_rows(config)
  if extra < 0 or extra % jax.process_count():
    raise ValueError(f"data.mm.vision_rows={extra} must be >= 0 and divisible by the process count "
                     f"{jax.process_count()} (each process appends the same number of multimodal rows)")
  if (bs + extra) % div:
    raise ValueError(f"train.batch_size + data.mm.vision_rows = {bs} + {extra} rows per batch is not divisible by "
                     f"the batch-parallel mesh size {div} (data x fsdp x expert of mesh {dict(mesh.shape)})")
  eb = int(config.eval.batch_size)
  if eb % div:
    raise ValueError(f"eval.batch_size={eb} is not divisible by the batch-parallel mesh size {div}")
  check_context(cfg, config, mesh)
  chunk = int(config.train.get("loss_chunk", 0))
  if chunk < 0 or (chunk and int(config.train.seq_len) % chunk):
    raise ValueError(f"train.loss_chunk={chunk} must be 0 (off) or divide train.seq_len={config.train.seq_len}")
  param_shardings(cfg, mesh)  # raises, naming the parameter, if a dim does not divide over its mesh axes


def check_context(cfg: ModelConfig, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  """Context parallelism (`mesh.context` > 1): text models only, sequences of 2 x context equal chunks, and the
  heads split evenly over `tensor` inside the attention's shard_map (models/attention/context.py)."""
  n = sharding.context_shards(mesh)
  if n == 1:
    return
  if isinstance(cfg, VLConfig):
    raise ValueError(f"mesh.context={n}: context parallelism covers the text model only; a multimodal config "
                     "needs mesh.context=1")
  for what, t in (("train.seq_len", int(config.train.seq_len)),
                  ("eval.seq_len", int(config.eval.get("seq_len", 0) or config.train.seq_len))):
    if t % (2 * n):
      raise ValueError(f"{what}={t} with mesh.context={n}: each device holds two equal chunks of the sequence "
                       f"(core/context.py), so the length must be a multiple of 2 x context = {2 * n}")
  # Each process feeds whole rows (its own batch slice, every position): the devices that share a row's chunks
  # must then be one process's.
  ctx_dim = list(mesh.axis_names).index("context")
  procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
  if (np.moveaxis(procs, ctx_dim, -1) != np.moveaxis(procs, ctx_dim, -1)[..., :1]).any():
    raise ValueError(f"mesh.context={n} spans processes (mesh {dict(mesh.shape)} on {jax.process_count()} "
                     "processes): each process reads whole sequences, so keep context within one host's devices")
  text = config_lib.text_config(cfg)
  tp = int(mesh.shape["tensor"])
  if text.num_key_value_heads % tp:
    raise ValueError(f"mesh.context={n} with mesh.tensor={tp}: num_key_value_heads={text.num_key_value_heads} must "
                     "divide over tensor (context-parallel attention keeps each device's query heads with their "
                     "KV heads)")


def check_vocab(cfg: ModelConfig, manifest) -> None:
  """The tokenizer of the prepared data fits the model's embedding table."""
  vocab = int(getattr(manifest, "vocab_size", None) or manifest["vocab_size"])
  text = config_lib.text_config(cfg)
  if vocab > text.vocab_size:
    raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={text.vocab_size}")


def check_host_batch(batch: dict, cfg: ModelConfig, what: str) -> None:
  """Eager numpy checks of a host batch before it reaches a compiled step (a few comparisons per token).

  VL: `check_batch` (pixel shapes, one placeholder per visual token, in every row) and the loss on text only:
  `loss_mask` must be 0 wherever the target is a visual token or a visual span's start/end marker. A violation
  is a ValueError naming `what` (which batch) instead of a silently wrong loss or a shape error inside XLA."""
  missing = [k for k in TEXT_KEYS if k not in batch]
  if missing:
    raise ValueError(f"{what}: the batch has no {missing} (keys: {sorted(batch)})")
  if not isinstance(cfg, VLConfig):
    return
  try:
    check_batch(batch, cfg)
  except ValueError as e:
    raise ValueError(f"{what}: {e}") from None
  visual = np.isin(np.asarray(batch["targets"]), visual_token_ids(cfg))
  bad = visual & (np.asarray(batch["loss_mask"]) != 0)
  if bad.any():
    row, col = (int(i[0]) for i in np.nonzero(bad))
    raise ValueError(f"{what}: loss_mask is {batch['loss_mask'][row, col]} at row {row}, position {col}, where the "
                     f"target is the visual token {int(batch['targets'][row, col])}; the loss must be on text "
                     f"tokens only ({int(bad.sum())} such positions in the batch)")


def check_eval_sets(sets: dict[str, list[dict]], cfg: ModelConfig) -> None:
  """check_host_batch on every batch of every held-out set (they are built once, before any compile)."""
  for name, batches in sets.items():
    for i, b in enumerate(batches):
      check_host_batch(b, cfg, f"eval set {name!r}, batch {i}")


def visual_token_ids(cfg: VLConfig) -> np.ndarray:
  """Target ids that never carry loss: the placeholders and the start/end markers of visual spans (our
  tokenizer's <|image_start|> .. <|video_end|>, m3_jax/core/batch.py)."""
  return np.asarray(sorted({cfg.image_token_index, cfg.video_token_index, *VISUAL_MARKERS}), np.int64)


def check_compatible(saved: dict | None, current: dict, workdir: str) -> None:
  """A checkpoint restores into the current model iff every parameter has the same path and shape; switches that
  do not change parameters (attention_impl, remat, dtype, MSA warmup, max_frames, ...) may differ."""
  if not saved:
    return
  if _param_shapes(saved) == _param_shapes(current):
    return
  old, new = _model_fields(saved), _model_fields(current)
  diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
  details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in diff[:8])
  raise ValueError(f"workdir {workdir} holds a checkpoint of a different model ({details}); "
                   "use a fresh --workdir or the same model config")


def _param_shapes(run_config: dict) -> dict[str, tuple]:
  cfg = config_lib.model_config(run_config, known_only=True)
  _, params, rest = abstract_model(cfg)
  return {"/".join(map(str, k)): tuple(v.get_value().shape)
          for tree in (params, rest) for k, v in nnx.to_flat_state(tree)}


def _model_fields(run_config: dict) -> dict[str, Any]:
  """{"hidden_size": .., "vision.hidden_size": .., ...}: the model sections flattened (text fields unprefixed)."""
  out = {}
  for sec in config_lib.MODEL_SECTIONS:
    for k, v in (run_config.get(sec) or {}).items():
      out[k if sec == "model" else f"{sec}.{k}"] = v
  return out
