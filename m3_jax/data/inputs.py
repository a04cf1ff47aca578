"""The experiment config -> data: what the trainer (and the experiments) call to prepare `data.dir`, to get the
training iterator and the held-out eval sets, all from the `data`, `train` and `eval` sections of a config.

    manifest = inputs.prepare(config, vision=vision_cfg is not None)      # idempotent: builds data.dir once
    it = inputs.train_iterator(config, vision_cfg)                          # infinite batches (grain iterator)
    sets = inputs.eval_sets(config, vision_cfg)                             # {set name: [batch, ...]}

`vision_cfg` is the model's VisionConfig (patch_size, spatial_merge_size, temporal_patch_size) for a
vision-language config and None for a text config. It is read by attribute only, so that data stays below models
in the layering; the pixel shapes come from `data.mm`. With several processes, each process gets its share of the
rows (jax.process_index / process_count).
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections

from m3_jax.data import text_pipeline, text_prepare, vision_pipeline, vision_prepare
from m3_jax.data.motion import MotionConfig
from m3_jax.data.text_prepare import Manifest
from m3_jax.data.vision_pipeline import VisionSpec

__all__ = ["VisionFrom", "eval_sets", "parse_text_files", "prepare", "text_stream_metrics", "train_iterator",
           "train_rows", "vision_rows", "vision_spec", "vl_eval_batches", "vl_eval_sources"]

ConfigDict = ml_collections.ConfigDict


def parse_text_files(spec: str) -> dict[str, list[str]] | None:
  """"NAME=GLOB[,GLOB][;NAME=GLOB]" -> {NAME: [files]}; a glob matching nothing is an error, not a silent skip."""
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


def _names(spec: str) -> list[str]:
  """"a, b,c" -> ["a", "b", "c"] (empty items dropped)."""
  return [s.strip() for s in str(spec).split(",") if s.strip()]


def _weights(spec: str, what: str) -> dict[str, float]:
  """"NAME=W[,NAME=W]" -> {NAME: W}; `what` names the config field in errors."""
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


def prepare(config: ConfigDict, *, vision: bool) -> Manifest:
  """Idempotent: the first call builds data.dir (downloads, BPE, token files; with `vision` also the image/video
  arrays of `data.mm`), later calls read the manifests. Returns the text Manifest."""
  d = config.data
  if d.use_builtin:
    sources = tuple(d.sources) if d.sources else None  # None: the default built-in set
  else:
    sources = ()
  verbose = jax.process_index() == 0
  check_data_dir(d.dir, verbose=verbose)
  manifest = text_prepare.prepare(d.dir, sources=sources, text_files=parse_text_files(d.text_files),
                                  vocab_size=int(d.vocab_size), verbose=verbose)
  if vision:
    m = d.mm
    names = _names(m.prepare_sources) or None
    if names:  # prepare_vision drops the sources it is not given: keep those another config prepared here
      try:
        names += [s for s in vision_prepare.load_vision_manifest(d.dir).sources if s not in names]
      except (FileNotFoundError, ValueError):
        pass
    vision_prepare.prepare_vision(d.dir, sources=names,
                                  max_items={k: int(v) for k, v in _weights(m.max_items, "data.mm.max_items").items()},
                                  verbose=verbose)
  return manifest


def check_data_dir(path: str, *, verbose: bool = True) -> None:
  """data.dir is created (and prepared) when it does not exist, but only inside an existing directory other than
  the filesystem root: a mistyped path is an error naming it, not a new tree somewhere."""
  if os.path.isdir(path):
    return
  full = os.path.abspath(path)
  parent = os.path.dirname(full)
  if os.path.exists(full):
    raise ValueError(f"data.dir={path!r} exists but is not a directory")
  if not os.path.isdir(parent) or parent == os.path.dirname(parent):
    where = "the filesystem root" if os.path.isdir(parent) else f"{parent}, which does not exist either"
    raise ValueError(f"data.dir={path!r} does not exist and would be created in {where}: a typo? Create it "
                     f"yourself (mkdir -p {full}) if you mean it, or point --config.data.dir at a prepared directory")
  if verbose:
    print(f"[m3_jax.data] data.dir {full} does not exist: creating it and preparing the corpus there", flush=True)


class VisionFrom:
  """vision_weight schedule: no multimodal rows before step `start`, then `weight` of each batch's rows."""

  def __init__(self, start: int, weight: float):
    self.start, self.weight = start, weight

  def __call__(self, step: int) -> float:
    return self.weight if step >= self.start else 0.0

  def __repr__(self) -> str:
    return f"VisionFrom(start={self.start}, weight={self.weight})"


def vision_spec(config: ConfigDict, vision_cfg: Any) -> VisionSpec:
  """The static visual shapes of every batch: the model's patch sizes (`vision_cfg`) and `data.mm`'s pixel shapes."""
  m = config.data.mm
  return VisionSpec.from_vision_config(
      vision_cfg, height=int(m.height), width=int(m.width), num_frames=int(m.num_frames),
      max_images_per_row=int(m.max_images_per_row), max_videos_per_row=int(m.max_videos_per_row))


def _motion(config: ConfigDict) -> MotionConfig:
  m = config.data.mm
  return MotionConfig(min_objects=int(m.min_objects), max_objects=int(m.max_objects))


def vision_rows(config: ConfigDict) -> int:
  """Multimodal rows appended to every batch's train.batch_size text rows (data.mm.vision_rows; 0: none, or a
  text config, i.e. one without a `vision` section)."""
  return int(config.data.mm.get("vision_rows", 0)) if "vision" in config else 0


def train_rows(config: ConfigDict) -> int:
  """Rows of a global training batch: train.batch_size text (or mixed) rows + the appended multimodal rows."""
  return int(config.train.batch_size) + vision_rows(config)


def train_iterator(config: ConfigDict, vision_cfg: Any) -> Iterator[dict]:
  """Infinite training batches (a grain iterator: its state goes into every checkpoint). Text configs
  (vision_cfg None): packed text rows. VL configs: each batch mixes text rows with multimodal rows (image- and
  video-caption examples): a share `data.mm.vision_weight` of the rows, or, with `data.mm.vision_rows` > 0, that
  many rows appended to the text rows (vision is extra: the text rows are exactly a text-only run's), multimodal
  from `data.mm.vision_start_step` on and padding before."""
  d, t = config.data, config.train
  common = dict(seq_len=int(t.seq_len), global_batch_size=int(t.batch_size), seed=int(t.seed),
                process_index=jax.process_index(), process_count=jax.process_count(), num_workers=int(d.num_workers))
  share = float(d.tasks.share) if "tasks" in d else 0.0
  if vision_cfg is None:
    kw = {}
    if share:
      kw = dict(tasks=str(d.tasks.names), task_questions=int(d.tasks.get("questions", 1)),
                task_text_loss=bool(d.tasks.get("text_loss", False)),
                task_placement=str(d.tasks.get("placement", "end")),
                task_lengths=[int(x) for x in str(d.tasks.get("lengths", "")).split(",") if x.strip()])
    return iter(text_pipeline.make_train_dataset(d.dir, task_share=share, **kw, **common))
  if share:
    raise ValueError(f"data.tasks.share={share}: long-context task rows are for text configs only")
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
      d.dir, spec=vision_spec(config, vision_cfg),
      mm_sources=_weights(m.sources, "data.mm.sources") or None, text_in_mm_rows=float(m.text_in_mm_rows),
      caption_first_prob=float(m.caption_first_prob), motion=_motion(config), **kw, **common)
  return iter(ds)


def vl_eval_sources(config: ConfigDict, vision_cfg: Any) -> list[str]:
  """The held-out multimodal sets the batch shapes allow: every prepared image source (captions of held-out
  images), synthetic_video (clips of held-out sprites, with direction/object masks) and real_clips."""
  spec = vision_spec(config, vision_cfg)
  names = vision_pipeline.list_mm_sources(config.data.dir, spec)
  if spec.max_videos_per_row:
    prepared = vision_prepare.load_vision_manifest(config.data.dir).sources
    names += [s for s in vision_pipeline.EVAL_ONLY_SOURCES if s in prepared]
  return names


def vl_eval_batches(config: ConfigDict, vision_cfg: Any, name: str) -> list[dict]:
  """The fixed eval batches of one multimodal set (a name from `vl_eval_sources`)."""
  m = config.data.mm
  kw = {"sprite_sources": _names(m.sprite_sources)} if _names(m.sprite_sources) else {}
  return vision_pipeline.make_mm_eval_batches(
      config.data.dir, name, spec=vision_spec(config, vision_cfg),
      seq_len=int(config.train.seq_len), batch_size=int(config.eval.batch_size),
      max_batches=int(config.eval.max_batches), num_clips=int(m.eval_num_clips), motion=_motion(config), **kw)


def eval_sets(config: ConfigDict, vision_cfg: Any) -> dict[str, list[dict]]:
  """Every prepared source's fixed held-out split (per-source loss and perplexity); for a VL config (vision_cfg
  not None) also the image-caption, video-caption and real-clip sets; `eval.sources` picks a subset. The batches
  are host numpy dicts, not yet checked against the model (the trainer does that before any compile)."""
  d, t = config.data, config.train
  text = text_pipeline.list_sources(d.dir)
  vl = vl_eval_sources(config, vision_cfg) if vision_cfg is not None else []
  names = _names(config.eval.get("sources", ""))
  unknown = [n for n in names if n not in text + vl]
  if unknown:
    raise ValueError(f"eval.sources: {unknown} are not held-out sets of {d.dir}; available: {text + vl}")
  sets = {}
  for name in names or text + vl:
    if name in text:
      sets[name] = text_pipeline.make_eval_batches(d.dir, name, seq_len=int(t.seq_len),
                                                   batch_size=int(config.eval.batch_size),
                                                   max_batches=int(config.eval.max_batches))
    else:
      sets[name] = vl_eval_batches(config, vision_cfg, name)
  return sets


def text_stream_metrics(data_iter: Any) -> dict[str, Any]:
  """What the text stream so far was (VL pipelines track it; the iterator has produced exactly the batches of the
  steps taken when this is logged): `data/text_tokens`, the text rows' target tokens, and `data/text_hash`, the
  first 16 hex digits of the sha256 chain over their inputs. Equal values at the same step in two runs mean the
  same text rows in the same order (with several processes: this process's text rows). {} for a text pipeline."""
  stream = getattr(data_iter, "text_stream", None)
  if not stream or stream.get("text_hash") is None:
    return {}
  return {"data/text_tokens": int(stream["text_tokens"]), "data/text_hash": str(stream["text_hash"])[:16]}
