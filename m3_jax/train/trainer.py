"""The trainer: one readable file, in the order things happen (config, mesh, data, model, shard, step,
checkpoint, evals, loop). `train_and_evaluate`, `evaluate` and `export` are the three `--mode`s of m3_jax.main.

One trainer for both model kinds: a config with a `vision` section (configs/tiny_vlm.py) trains the VLModel on
interleaved text / image-caption / video-caption batches (the contract of m3_jax/models/multimodal.py); any other
config trains the TextModel on packed text. `build_model` is the one place where the kind is chosen; everything
else (NNX split, sharding from logical axes, jit, checkpoints with the data iterator, evals) is shared."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from m3_jax.models.config import TextConfig, VLConfig, train_flops_per_token
from m3_jax.models.multimodal import VLModel, check_batch, vision_flops
from m3_jax.models.transformer import TextModel
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.core import sharding
from m3_jax.core.batch import TEXT_KEYS, VISUAL_KEYS, VISUAL_MARKERS
from m3_jax.train import config_lib
from m3_jax.train.metrics import MetricWriter, Progress, peak_flops
from m3_jax.train.optimizer import make_optimizer
from m3_jax.train.steps import TrainState, make_eval_step, make_train_step

BATCH_KEYS = TEXT_KEYS


def log(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)


# ============================================================================================ model + sharding ==

ModelConfig = TextConfig | VLConfig


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The one place where the model kind is chosen: VLConfig -> VLModel (vision tower + projector + text tower),
  TextConfig -> TextModel. Both return (logits, aux) and carry logical axes on every parameter."""
  if isinstance(cfg, VLConfig):
    return VLModel(cfg, rngs=rngs)
  return TextModel(cfg, rngs=rngs)


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract params, abstract rest) without allocating anything."""
  model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
  return nnx.split(model, nnx.Param, ...)


def param_shardings(cfg: ModelConfig, mesh) -> tuple[Any, Any, Any]:
  graphdef, params, rest = abstract_model(cfg)
  p_sh = sharding.state_shardings(params, mesh)
  r_sh = sharding.state_shardings(rest, mesh)
  return graphdef, (params, rest), (p_sh, r_sh)


def make_init_fn(cfg: ModelConfig, tx):
  """key -> a fresh TrainState; jitted with out_shardings it builds the state directly on the mesh."""

  def init(key):
    model = build_model(cfg, nnx.Rngs(params=key))
    _, p, r = nnx.split(model, nnx.Param, ...)
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, rest=r, opt_state=tx.init(p),
                      rng=jax.random.fold_in(key, 1))

  return init


def abstract_state(cfg: ModelConfig, tx, mesh) -> tuple[Any, TrainState, Any]:
  """(graphdef, the TrainState as ShapeDtypeStructs carrying their shardings, the shardings): a restore target,
  from shapes alone (nothing is allocated or compiled)."""
  graphdef, _, (p_sh, r_sh) = param_shardings(cfg, mesh)
  abstract = jax.eval_shape(make_init_fn(cfg, tx), jax.random.key(0))
  state_sh = state_shardings_for(abstract, p_sh, r_sh, mesh)
  return graphdef, ckpt_lib.abstract_like(abstract, state_sh), state_sh


def init_state(cfg: ModelConfig, tx, mesh, seed: int) -> tuple[Any, TrainState, Any]:
  """Creates the train state already sharded: jit(init, out_shardings=...) so no host ever holds it whole."""
  graphdef, _, state_sh = abstract_state(cfg, tx, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(make_init_fn(cfg, tx), out_shardings=state_sh)(jax.random.key(seed))
  return graphdef, state, state_sh


def state_shardings_for(abstract: TrainState, p_sh, r_sh, mesh) -> TrainState:
  """Optimizer moments shard like their parameters; scalars (counts, step, rng) are replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  p_struct = jax.tree.structure(abstract.params)

  def is_param_tree(x) -> bool:  # optax keeps mu/nu as pytrees with exactly the params' structure
    return jax.tree.structure(x) == p_struct

  opt_sh = jax.tree.map(lambda x: p_sh if is_param_tree(x) else replicated, abstract.opt_state,
                        is_leaf=is_param_tree)
  return TrainState(step=replicated, params=p_sh, rest=r_sh, opt_state=opt_sh, rng=replicated)


def init_from_export(state: TrainState, path: str, mesh, cfg: ModelConfig | None = None) -> TrainState:
  """Warm start from an export (e.g. dense -> MSA, the paper's MSA-CPT): every parameter the export has is
  copied (same path, same shape); the rest (MSA index projections and norms) keep their fresh initialisation.
  A text export into a VL model fills its `language_model` (continued pretraining of a text model with vision:
  the tower and projector start fresh). The optimizer starts fresh at step 0."""
  if not ckpt_lib.is_export(path):
    raise FileNotFoundError(f"init_from={path!r} is not an export directory (made by --mode=export)")
  src_cfg = config_lib.model_config_from_export(ckpt_lib.load_export_config(path))
  _, (params, rest), (p_sh, r_sh) = param_shardings(src_cfg, mesh)
  src = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                             {"params": p_sh, "rest": r_sh}))
  src_map = {**dict(nnx.to_flat_state(src["params"])), **dict(nnx.to_flat_state(src["rest"]))}
  if isinstance(cfg, VLConfig) and isinstance(src_cfg, TextConfig):
    src_map = {("language_model",) + k: v for k, v in src_map.items()}
  copied, fresh = 0, []

  def take(tree):
    nonlocal copied
    out = []
    for key, var in nnx.to_flat_state(tree):
      if key in src_map:
        new = src_map[key].get_value()
        if new.shape != var.get_value().shape:
          raise ValueError(f"init_from: {'/'.join(map(str, key))} has shape {new.shape} in {path}, "
                           f"{var.get_value().shape} in this model")
        out.append((key, var.replace(new.astype(var.get_value().dtype))))
        copied += 1
      else:
        fresh.append("/".join(map(str, key)))
        out.append((key, var))
    return nnx.from_flat_state(out)

  state = state.replace(params=take(state.params), rest=take(state.rest))
  log(f"initialised {copied} tensors from {path}; fresh: {fresh if len(fresh) < 12 else fresh[:12] + ['...']}")
  return state


# ======================================================================================================= data ==

def parse_text_files(spec: str) -> dict[str, list[str]] | None:
  """"NAME=GLOB[,GLOB][;NAME=GLOB]" -> {NAME: [files]}; a glob matching nothing is an error, not a silent skip."""
  import glob  # noqa: PLC0415
  if not spec:
    return None
  out = {}
  for part in spec.split(";"):
    name, eq, globs = part.partition("=")
    if not eq or not name.strip():
      raise ValueError(f"data.text_files: {part!r} is not NAME=GLOB[,GLOB]")
    files = sorted(f for g in globs.split(",") for f in glob.glob(os.path.expanduser(g.strip())))
    if not files:
      raise FileNotFoundError(f"data.text_files: {globs!r} matches no file for source {name!r}")
    out[name.strip()] = files
  return out


def prepare_data(config: ml_collections.ConfigDict):
  """Idempotent: the first call builds data.dir (downloads, BPE, token files), later calls read the manifest."""
  from m3_jax.data import corpus  # noqa: PLC0415  (keeps `eval`/`export` free of the data deps)
  d = config.data
  if d.use_builtin:
    sources = tuple(d.sources) if d.sources else None  # None: the default built-in set
  else:
    sources = ()
  manifest = corpus.prepare(d.dir, sources=sources, text_files=parse_text_files(d.text_files),
                            vocab_size=int(d.vocab_size), verbose=jax.process_index() == 0)
  if config_lib.is_multimodal(config):
    from m3_jax.data import vision  # noqa: PLC0415
    m = d.mm
    sources = _names(m.prepare_sources) or None
    if sources:  # prepare_vision drops the sources it is not given: keep those another config prepared here
      try:
        sources += [s for s in vision.load_vision_manifest(d.dir).sources if s not in sources]
      except (FileNotFoundError, ValueError):
        pass
    vision.prepare_vision(d.dir, sources=sources,
                          max_items={k: int(v) for k, v in _weights(m.max_items, "data.mm.max_items").items()},
                          verbose=jax.process_index() == 0)
  return manifest


def _names(spec: str) -> list[str]:
  return [s.strip() for s in str(spec).split(",") if s.strip()]


def _weights(spec: str, what: str) -> dict[str, float]:
  """"NAME=W[,NAME=W]" -> {NAME: W}."""
  out = {}
  for item in _names(spec):
    name, _, value = item.partition("=")
    try:
      out[name.strip()] = float(value)
    except ValueError:
      raise ValueError(f"{what}: {item!r} is not NAME=NUMBER (in {spec!r})") from None
    if not name.strip():
      raise ValueError(f"{what}: {item!r} has no NAME (in {spec!r})")
  return out


class VisionFrom:
  """vision_weight schedule: no multimodal rows before step `start`, then `weight` of each batch's rows."""

  def __init__(self, start: int, weight: float):
    self.start, self.weight = start, weight

  def __call__(self, step: int) -> float:
    return self.weight if step >= self.start else 0.0

  def __repr__(self) -> str:
    return f"VisionFrom(start={self.start}, weight={self.weight})"


def vision_spec(config: ml_collections.ConfigDict, cfg: VLConfig):
  """The static visual shapes of every batch: the model's patch sizes and `data.mm`'s pixel shapes."""
  from m3_jax.data import vision_pipeline  # noqa: PLC0415
  m = config.data.mm
  return vision_pipeline.VisionSpec.from_vision_config(
      cfg.vision, height=int(m.height), width=int(m.width), num_frames=int(m.num_frames),
      max_images_per_row=int(m.max_images_per_row), max_videos_per_row=int(m.max_videos_per_row))


def _motion(config: ml_collections.ConfigDict):
  from m3_jax.data import vision  # noqa: PLC0415
  m = config.data.mm
  return vision.MotionConfig(min_objects=int(m.min_objects), max_objects=int(m.max_objects))


def vision_rows(config: ml_collections.ConfigDict) -> int:
  """Multimodal rows appended to every batch's train.batch_size text rows (data.mm.vision_rows; 0: none, or a
  text config)."""
  return int(config.data.mm.get("vision_rows", 0)) if config_lib.is_multimodal(config) else 0


def train_rows(config: ml_collections.ConfigDict) -> int:
  """Rows of a global training batch: train.batch_size text (or mixed) rows + the appended multimodal rows."""
  return int(config.train.batch_size) + vision_rows(config)


def train_iterator(config: ml_collections.ConfigDict):
  """Infinite training batches (a grain iterator: its state goes into every checkpoint). Text configs: packed
  text rows. VL configs: each batch mixes text rows with multimodal rows (image- and video-caption examples):
  a share `data.mm.vision_weight` of the rows, or, with `data.mm.vision_rows` > 0, that many rows appended to
  the text rows (vision is extra: the text rows are exactly a text-only run's), multimodal from
  `data.mm.vision_start_step` on and padding before."""
  from m3_jax.data import pipeline  # noqa: PLC0415
  d, t = config.data, config.train
  common = dict(seq_len=int(t.seq_len), global_batch_size=int(t.batch_size), seed=int(t.seed),
                process_index=jax.process_index(), process_count=jax.process_count(), num_workers=int(d.num_workers))
  if not config_lib.is_multimodal(config):
    return iter(pipeline.make_train_dataset(d.dir, **common))
  from m3_jax.data import vision_pipeline  # noqa: PLC0415
  m = d.mm
  weight, start, extra = float(m.vision_weight), int(m.vision_start_step), vision_rows(config)
  kw = {}
  if _names(m.sprite_sources):
    kw["sprite_sources"] = _names(m.sprite_sources)
  if extra:
    if weight != 0.0:
      raise ValueError(f"data.mm.vision_rows={extra} appends multimodal rows to the text rows; data.mm.vision_weight="
                       f"{weight} would also replace text rows by multimodal ones: set data.mm.vision_weight=0")
    kw.update(vision_rows=extra, vision_start_step=start, vision_weight=0.0)
  else:
    kw["vision_weight"] = VisionFrom(start, weight) if start > 0 else weight
  ds = vision_pipeline.make_mm_train_dataset(
      d.dir, spec=vision_spec(config, config_lib.model_config(config)),
      mm_sources=_weights(m.sources, "data.mm.sources") or None, text_in_mm_rows=float(m.text_in_mm_rows),
      caption_first_prob=float(m.caption_first_prob), motion=_motion(config), **kw, **common)
  return iter(ds)


def vl_eval_sources(config: ml_collections.ConfigDict) -> list[str]:
  """The held-out multimodal sets the batch shapes allow: every prepared image source (captions of held-out
  images), synthetic_video (clips of held-out sprites, with direction/object masks) and real_clips."""
  from m3_jax.data import vision, vision_pipeline  # noqa: PLC0415
  spec = vision_spec(config, config_lib.model_config(config))
  names = vision_pipeline.list_mm_sources(config.data.dir, spec)
  if spec.max_videos_per_row:
    prepared = vision.load_vision_manifest(config.data.dir).sources
    names += [s for s in vision_pipeline.EVAL_ONLY_SOURCES if s in prepared]
  return names


def vl_eval_batches(config: ml_collections.ConfigDict, name: str) -> list[dict]:
  from m3_jax.data import vision_pipeline  # noqa: PLC0415
  m = config.data.mm
  kw = {"sprite_sources": _names(m.sprite_sources)} if _names(m.sprite_sources) else {}
  return vision_pipeline.make_mm_eval_batches(
      config.data.dir, name, spec=vision_spec(config, config_lib.model_config(config)),
      seq_len=int(config.train.seq_len), batch_size=int(config.eval.batch_size),
      max_batches=int(config.eval.max_batches), num_clips=int(m.eval_num_clips), motion=_motion(config), **kw)


def eval_sets(config: ml_collections.ConfigDict, cfg: ModelConfig | None = None) -> dict[str, list[dict]]:
  """Every prepared source's fixed held-out split (per-source loss and perplexity); for a VL config also the
  image-caption, video-caption and real-clip sets; `eval.sources` picks a subset. With `cfg`, every batch is
  checked now, before any compile."""
  from m3_jax.data import pipeline  # noqa: PLC0415
  d, t = config.data, config.train
  text = pipeline.list_sources(d.dir)
  vl = vl_eval_sources(config) if config_lib.is_multimodal(config) else []
  names = _names(config.eval.get("sources", ""))
  unknown = [n for n in names if n not in text + vl]
  if unknown:
    raise ValueError(f"eval.sources: {unknown} are not held-out sets of {d.dir}; available: {text + vl}")
  sets = {}
  for name in names or text + vl:
    if name in text:
      sets[name] = pipeline.make_eval_batches(d.dir, name, seq_len=int(t.seq_len),
                                              batch_size=int(config.eval.batch_size),
                                              max_batches=int(config.eval.max_batches))
    else:
      sets[name] = vl_eval_batches(config, name)
  if cfg is not None:
    for name, batches in sets.items():
      for i, b in enumerate(batches):
        check_host_batch(b, cfg, f"eval set {name!r}, batch {i}")
  return sets


def to_global(batch: dict, mesh) -> dict:
  """Host-local numpy batch -> global jax.Arrays sharded over the batch axes (dim 0 of every array; pixels keep
  their other dims whole). Keys outside the batch contract stay on the host, except eval masks (`NAME_mask`)."""
  sh = sharding.batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sh, np.asarray(v)) for k, v in batch.items()
          if k in BATCH_KEYS + VISUAL_KEYS or k.endswith("_mask")}


# ================================================================================================== checks ==

def check_fits(cfg: ModelConfig, config: ml_collections.ConfigDict, mesh) -> None:
  div = sharding.batch_divisor(mesh)
  bs = int(config.train.batch_size)
  if bs % div:
    raise ValueError(f"train.batch_size={bs} is not divisible by the batch-parallel mesh size {div} "
                     f"(data x fsdp x expert of mesh {dict(mesh.shape)})")
  if bs % jax.process_count():
    raise ValueError(f"train.batch_size={bs} is not divisible by the process count {jax.process_count()}")
  extra = vision_rows(config)
  if extra < 0 or extra % jax.process_count():
    raise ValueError(f"data.mm.vision_rows={extra} must be >= 0 and divisible by the process count "
                     f"{jax.process_count()} (each process appends the same number of multimodal rows)")
  if (bs + extra) % div:
    raise ValueError(f"train.batch_size + data.mm.vision_rows = {bs} + {extra} rows per batch is not divisible by "
                     f"the batch-parallel mesh size {div} (data x fsdp x expert of mesh {dict(mesh.shape)})")
  eb = int(config.eval.batch_size)
  if eb % div:
    raise ValueError(f"eval.batch_size={eb} is not divisible by the batch-parallel mesh size {div}")
  param_shardings(cfg, mesh)  # raises, naming the parameter, if a dim does not divide over its mesh axes


def check_vocab(cfg: ModelConfig, manifest) -> None:
  vocab = int(getattr(manifest, "vocab_size", None) or manifest["vocab_size"])
  text = config_lib.text_config(cfg)
  if vocab > text.vocab_size:
    raise ValueError(f"the tokenizer has {vocab} tokens but model.vocab_size={text.vocab_size}")


def check_host_batch(batch: dict, cfg: ModelConfig, what: str) -> None:
  """Eager numpy checks of a host batch before it reaches a compiled step (a few comparisons per token).

  VL: `check_batch` (pixel shapes, one placeholder per visual token, in every row) and the loss on text only:
  `loss_mask` must be 0 wherever the target is a visual token or a visual span's start/end marker. A violation
  is a ValueError naming `what` (which batch) instead of a silently wrong loss or a shape error inside XLA."""
  missing = [k for k in BATCH_KEYS if k not in batch]
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


def visual_token_ids(cfg: VLConfig) -> np.ndarray:
  """Target ids that never carry loss: the placeholders and the start/end markers of visual spans (our
  tokenizer's <|image_start|> .. <|video_end|>, m3_jax/core/batch.py)."""
  return np.asarray(sorted({cfg.image_token_index, cfg.video_token_index, *VISUAL_MARKERS}), np.int64)


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


# ===================================================================================================== train ==

def _compile(fn, *args):
  t0 = time.time()
  compiled = fn.lower(*args).compile()
  mem = compiled.memory_analysis()
  if mem is not None:
    gib = lambda b: b / 2**30  # noqa: E731
    log(f"compiled in {time.time() - t0:.1f}s; per-device memory: args {gib(mem.argument_size_in_bytes):.3f} GiB, "
        f"outputs {gib(mem.output_size_in_bytes):.3f} GiB, temps {gib(mem.temp_size_in_bytes):.3f} GiB")
  return compiled


def train_flops_per_step(cfg: ModelConfig, config: ml_collections.ConfigDict, batch: dict | None) -> float:
  """Model FLOPs of one train step (fwd + bwd = 3x fwd), the MFU numerator: the text tower over batch x seq_len
  tokens, plus for VL the vision tower + projector on every item slot of the global batch (padding items too:
  they are computed)."""
  b, t = train_rows(config), int(config.train.seq_len)
  flops = train_flops_per_token(config_lib.text_config(cfg), t) * b * t
  if isinstance(cfg, VLConfig) and batch is not None:
    for key in ("images", "videos"):
      if key in batch:
        _, n, f, h, w, _ = batch[key].shape
        flops += 3.0 * b * n * vision_flops(cfg, f, h, w)
  return flops


def evaluate_sets(eval_fn, params, rest, sets: dict[str, list[dict]], mesh) -> dict[str, float]:
  """Per source: loss and perplexity over every target token with loss_mask (text only in a VL batch), the
  teacher-forced next-token accuracy, and both again over each extra mask of the set (`eval/synthetic_video/
  direction_loss`, `.../direction_accuracy`: the caption tokens that need the clip's temporal order)."""
  out = {}
  for name, batches in sets.items():
    sums: dict[str, float] = {}
    for b in batches:
      for k, v in jax.device_get(eval_fn(params, rest, to_global(b, mesh))).items():
        sums[k] = sums.get(k, 0.0) + float(v)
    loss = sums["loss_sum"] / max(sums["tokens"], 1.0)
    out[f"eval/{name}/loss"] = loss
    out[f"eval/{name}/perplexity"] = float(math.exp(min(loss, 50.0)))
    out[f"eval/{name}/accuracy"] = sums["correct"] / max(sums["tokens"], 1.0)
    out[f"eval/{name}/tokens"] = sums["tokens"]
    for k in sorted(sums):
      if k.endswith("/tokens"):
        sub = k[:-len("/tokens")]
        n = max(sums[k], 1.0)
        out[f"eval/{name}/{sub}_loss"] = sums[f"{sub}/loss_sum"] / n
        out[f"eval/{name}/{sub}_accuracy"] = sums[f"{sub}/correct"] / n
        out[f"eval/{name}/{sub}_tokens"] = sums[k]
  if out:
    losses = [v for k, v in out.items() if k.endswith("/loss")]
    out["eval/mean_loss"] = float(np.mean(losses))
  return out


def text_stream_metrics(data_iter) -> dict[str, Any]:
  """What the text stream so far was (VL pipelines track it; the iterator has produced exactly the batches of the
  steps taken when this is logged): `data/text_tokens`, the text rows' target tokens, and `data/text_hash`, the
  first 16 hex digits of the sha256 chain over their inputs. Equal values at the same step in two runs mean the
  same text rows in the same order (with several processes: this process's text rows)."""
  stream = getattr(data_iter, "text_stream", None)
  if not stream or stream.get("text_hash") is None:
    return {}
  return {"data/text_tokens": int(stream["text_tokens"]), "data/text_hash": str(stream["text_hash"])[:16]}


class _Stop:
  """Turns SIGTERM into a clean stop between steps (the checkpoint is saved, nothing is lost)."""

  def __init__(self):
    self.requested = False
    try:
      signal.signal(signal.SIGTERM, self._handler)
    except ValueError:  # not the main thread
      pass

  def _handler(self, *_):
    self.requested = True


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its latest checkpoint) and returns the final eval metrics."""
  # ---- config -------------------------------------------------------------------------------------------------
  config_lib.check_train_config(config)
  cfg = config_lib.model_config(config)
  ocfg = config_lib.optim_config(config)
  run_config = config_lib.to_jsonable(config)
  os.makedirs(workdir, exist_ok=True)
  steps = int(config.train.steps)

  # ---- mesh -------------------------------------------------------------------------------------------------------
  mesh = sharding.make_mesh(dict(config.mesh))
  check_fits(cfg, config, mesh)
  log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s), "
      f"{jax.process_count()} process(es)")

  # ---- checkpoint compatibility (before any data work or compilation) -------------------------------------------
  ckpt = make_checkpointer(config, workdir)
  latest = ckpt.latest_step()
  check_compatible(ckpt.saved_config(latest) if latest is not None else None, run_config, workdir)

  # ---- data -------------------------------------------------------------------------------------------------------
  manifest = prepare_data(config)
  check_vocab(cfg, manifest)
  data_iter = train_iterator(config)
  evals = eval_sets(config, cfg)

  # ---- model, optimizer, state born sharded (or restored: then nothing is initialised) -------------------------
  tx, schedule = make_optimizer(ocfg)
  graphdef, abstract, state_sh = abstract_state(cfg, tx, mesh)
  n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
  text_cfg = config_lib.text_config(cfg)
  log(f"model: {n_params / 1e6:.2f}M parameters, layers {text_cfg.layer_types} / {text_cfg.mlp_layer_types}"
      + (f"; vision tower {cfg.vision.num_hidden_layers} x {cfg.vision.hidden_size}, max_frames "
         f"{cfg.vision.max_frames}" if isinstance(cfg, VLConfig) else ""))
  state = None
  if latest is not None:
    state = ckpt.restore(latest, abstract, data_iter)
    log(f"resumed from step {latest} in {workdir}")
  start = int(jax.device_get(state.step)) if state is not None else 0
  # The first batch is checked before anything is compiled: a bad batch is a clear error here, not minutes later
  # (or a shape error inside the compiled step).
  host_batch = next(data_iter) if start < steps else None
  if host_batch is not None:
    check_host_batch(host_batch, cfg, f"train batch {start + 1}")
  if state is None:
    graphdef, state, state_sh = init_state(cfg, tx, mesh, int(config.train.seed))
    if config.get("init_from"):
      state = init_from_export(state, config.init_from, mesh, cfg)

  # ---- steps, compiled ahead of time -------------------------------------------------------------------------------
  train_step = jax.jit(make_train_step(graphdef, tx, schedule, moe_aux_coef=float(config.train.moe_aux_coef),
                                       kl_weight=text_cfg.kl_weight),
                       in_shardings=(state_sh, sharding.batch_sharding(mesh)),
                       out_shardings=(state_sh, None), donate_argnums=(0,))
  eval_step = jax.jit(make_eval_step(graphdef),
                      in_shardings=(state_sh.params, state_sh.rest, sharding.batch_sharding(mesh)))
  batch = to_global(host_batch, mesh) if host_batch is not None else None
  with jax.set_mesh(mesh):
    compiled = _compile(train_step, state, batch) if batch is not None else None

  # ---- loop -------------------------------------------------------------------------------------------------------
  writer = MetricWriter(workdir, process_index=jax.process_index())
  flops_step = train_flops_per_step(cfg, config, host_batch)
  peak = peak_flops(jax.devices()[0])
  log_every, eval_every = int(config.train.log_every), int(config.train.eval_every)
  tokens_per_step = float(train_rows(config)) * float(config.train.seq_len)
  progress = Progress(steps, start, quiet=jax.process_index() != 0)
  stopper = _Stop()
  final_eval: dict = {}
  first_eval: dict = {}
  t_last, tok_last, last_saved = time.time(), 0.0, latest
  step = start

  def save(step: int, force: bool = False):
    nonlocal last_saved
    if ckpt.save(step, state, data_iter, run_config, force=force):
      last_saved = step

  try:
    with jax.set_mesh(mesh):
      if start == 0 and eval_every > 0:  # the starting point, so a run shows how far held-out loss fell
        ev = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
        writer.write(0, ev)
        first_eval = ev
        progress.message("step 0: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items()
                                                if k.endswith("/loss") and k.count("/") == 2))
        t_last = time.time()
      while step < steps:
        state, metrics = compiled(state, batch)
        step += 1
        tok_last += tokens_per_step
        is_log = step % log_every == 0 or step == steps or step == start + 1
        saving = ckpt.every > 0 and step % ckpt.every == 0
        if is_log or saving:
          m = jax.device_get(metrics)
          if not np.isfinite(m["loss"]) or not np.isfinite(m["grad_norm"]):
            raise FloatingPointError(
                f"non-finite loss/grad at step {step} (loss={m['loss']}, grad_norm={m['grad_norm']}); stopping "
                f"without saving this state: the last good checkpoint is step {last_saved} in {ckpt.directory}")
          if is_log:
            dt = time.time() - t_last
            tps = tok_last / max(dt, 1e-9)
            m = {k: v for k, v in m.items() if k != "tokens"}
            m["tokens_per_sec"] = tps
            m["mfu"] = (tps * flops_step / tokens_per_step / (peak * jax.device_count())) if peak else None
            m.update(text_stream_metrics(data_iter))
            writer.write(step, m)
            progress.update(step, f"loss {float(m['loss']):.4f} lr {float(m['lr']):.2e} "
                            f"gnorm {float(m['grad_norm']):.3f} {tps:,.0f} tok/s")
            t_last, tok_last = time.time(), 0.0
        if saving:
          save(step)
        if eval_every > 0 and (step % eval_every == 0 or step == steps):
          ev = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
          writer.write(step, ev)
          progress.message(f"step {step}: " + ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in ev.items()
                                                           if k.endswith("/loss") and k.count("/") == 2))
          final_eval = ev
          t_last = time.time()
        if stopper.requested:
          progress.message(f"SIGTERM: saving step {step} and stopping")
          save(step, force=True)
          break
        if step < steps:
          host_batch = next(data_iter)
          check_host_batch(host_batch, cfg, f"train batch {step + 1}")
          batch = to_global(host_batch, mesh)
      else:
        if last_saved != step:
          save(step, force=True)
  except KeyboardInterrupt:
    progress.message(f"interrupted: saving step {step}")
    save(step, force=True)
    raise
  finally:
    progress.close()
    ckpt.close()
    writer.close()
  if not final_eval and steps <= start:
    final_eval = evaluate_sets(eval_step, state.params, state.rest, evals, mesh)
  if first_eval and final_eval:
    log(f"held-out mean loss over {len(evals)} sources: {first_eval['eval/mean_loss']:.3f} (step 0) -> "
        f"{final_eval['eval/mean_loss']:.3f} (step {step})")
  log(f"done: {workdir} holds checkpoints/ (step {last_saved}), metrics.jsonl and tb/")
  return final_eval


def make_checkpointer(config, workdir) -> ckpt_lib.Checkpointer:
  c = config.checkpoint
  return ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), every=int(c.every), keep=int(c.keep),
                               async_save=bool(c.get("async_save", True)))


# ============================================================================================ eval and export ==

def load_params(config: ml_collections.ConfigDict, workdir: str, mesh, checkpoint: str | None = None):
  """Params from an export directory (params-only) or the latest train checkpoint of `workdir`."""
  path = checkpoint or config.get("eval_checkpoint", "") or ""
  if path and ckpt_lib.is_export(path):
    cfg = config_lib.model_config_from_export(ckpt_lib.load_export_config(path))
    graphdef, (params, rest), (p_sh, r_sh) = param_shardings(cfg, mesh)
    both = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                                {"params": p_sh, "rest": r_sh}))
    return cfg, graphdef, both["params"], both["rest"], f"export {path}"
  cfg = config_lib.model_config(config)
  ocfg = config_lib.optim_config(config)
  tx, _ = make_optimizer(ocfg)
  ckpt = make_checkpointer(config, path or workdir)
  step = ckpt.latest_step()
  if step is None:
    raise FileNotFoundError(f"no checkpoint in {ckpt.directory} and no export directory given")
  check_compatible(ckpt.saved_config(step), config_lib.to_jsonable(config), workdir)
  graphdef, abstract, _ = abstract_state(cfg, tx, mesh)
  state = ckpt.restore(step, abstract)
  ckpt.close()
  return cfg, graphdef, state.params, state.rest, f"checkpoint step {step} of {ckpt.directory}"


def evaluate(config: ml_collections.ConfigDict, workdir: str, checkpoint: str | None = None) -> dict:
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, graphdef, params, rest, what = load_params(config, workdir, mesh, checkpoint)
  prepare_data(config)
  evals = eval_sets(config, cfg)
  p_sh = jax.tree.map(lambda x: x.sharding, params)
  r_sh = jax.tree.map(lambda x: x.sharding, rest)
  eval_step = jax.jit(make_eval_step(graphdef), in_shardings=(p_sh, r_sh, sharding.batch_sharding(mesh)))
  with jax.set_mesh(mesh):
    ev = evaluate_sets(eval_step, params, rest, evals, mesh)
  log(f"evaluated {what}:")
  for k, v in ev.items():
    log(f"  {k} = {v:.4f}")
  path = os.path.join(workdir, "eval_results.json")
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path, "w") as f:
      json.dump({"source": what, **ev}, f, indent=2)
  log(f"wrote {path}")
  return ev


def export(config: ml_collections.ConfigDict, workdir: str) -> str:
  mesh = sharding.make_mesh(dict(config.mesh))
  cfg, _, params, rest, what = load_params(config, workdir, mesh)
  out = config.export.get("path") or os.path.join(workdir, "export")
  dtype = config.export.get("dtype") or None
  ckpt_lib.export_params(out, {"params": params, "rest": rest}, cfg.to_dict(), dtype=dtype)
  log(f"exported params of {what} ({dtype or 'original dtype'}) to {out}")
  return out
