"""Vision data preparation: fetch and decode the image and video sources (m3_jax.data.vision_sources), keep a
bounded deterministic subset, hold out a fixed set of items per source and cache the arrays on disk.

    from m3_jax.data import vision_prepare
    vm = vision_prepare.prepare_vision("/work/main/data")   # cached; or `python -m m3_jax.data DIR --vision`
    imgs = vm.images("fashion_mnist", "train")              # ImageSet: pixels uint8 [N, h, w, c], labels, titles
    clips = vm.clips()                                       # the real clips (eval only)

Training video is synthetic (m3_jax.data.motion) and made on the fly by the pipeline from the prepared images;
nothing of it is stored here.

On-disk layout under `data_dir/vision/`:

    manifest.json                   what was built, from what, with which arguments, counts, what was skipped
    <source>.<split>.npz            image sources: pixels uint8 [N, h, w, c] (c = 1 grey, 4 RGBA), labels int32 [N]
                                    (class index, -1 without), titles str [N], keywords str [N] ("; "-joined)
    real_clips.heldout.npz          frames uint8 [T, h, w, 3] of all clips, offsets int64 [clips + 1], names,
                                    captions, fps

Splits are "train" and "heldout"; the held-out items of a source are chosen by `seed` alone. A source whose
package cannot be had is skipped and reported (`manifest.skipped`), never fatal; unreadable items (a truncated
PNG, a blank rendering, an oversized image) are skipped and counted per source (`corrupt`, with examples).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from m3_jax.data.common import SPLITS, heldout_indices, log, write_json
from m3_jax.data.motion import SYNTHETIC_MOTION_NOTE
from m3_jax.data.vision_sources import (ALL_VISION_SOURCES, IMAGE_READERS, SOURCE_ERRORS, VIDEO_SOURCES, read_clips,
                                        source_origin)

__all__ = ["ClipSet", "DEFAULT_MAX_ITEMS", "ImageSet", "VisionManifest", "VisionSourceInfo", "load_vision_manifest",
           "main", "prepare_vision"]

FORMAT_VERSION = 1
SUBDIR = "vision"
MANIFEST = "manifest.json"
_TAG = "m3_jax.data.vision"  # the progress lines' prefix

# Defaults that keep `prepare_vision` fast and the prepared directory small enough to copy to a GPU box.
DEFAULT_MAX_ITEMS: dict[str, int] = {"fashion_mnist": 20_000, "openclipart": 3_000}


# ---------------------------------------------------------------------------------------------------------------
# Prepared data: manifest and loaders
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImageSet:
  """The items of one split of an image source (in memory)."""
  source: str
  pixels: np.ndarray  # uint8 [N, h, w, c]: c = 1 (grey, ink/object bright on black) or 4 (RGBA)
  labels: np.ndarray  # int32 [N]: index into `classes`, -1 when the source has no classes
  titles: np.ndarray  # str [N]: human title (openclipart) or Unicode name (emoji); "" otherwise
  keywords: np.ndarray  # str [N]: "; "-joined keywords (openclipart); "" otherwise
  classes: tuple[str, ...] | None

  def __len__(self) -> int:
    return int(self.pixels.shape[0])


@dataclasses.dataclass(frozen=True)
class ClipSet:
  """The real clips: clip i is frames[offsets[i]:offsets[i + 1]], sampled at `fps`."""
  frames: np.ndarray  # uint8 [T, h, w, 3]
  offsets: np.ndarray  # int64 [clips + 1]
  names: tuple[str, ...]
  captions: tuple[str, ...]
  fps: float

  def __len__(self) -> int:
    return len(self.names)

  def clip(self, i: int) -> np.ndarray:
    return self.frames[self.offsets[i]:self.offsets[i + 1]]


@dataclasses.dataclass(frozen=True)
class VisionSourceInfo:
  kind: str  # "image" or "video"
  origin: str
  classes: list[str] | None
  item_shape: list[int]  # [h, w, c] of an image or a frame
  splits: dict[str, dict[str, Any]]  # split -> {"items": n, "file": relative path (, "frames": n)}
  corrupt: int
  corrupt_examples: list[str]
  config: dict[str, Any]  # the arguments this source was built with (its cache key)
  notes: str = ""


@dataclasses.dataclass(frozen=True)
class VisionManifest:
  """What `prepare_vision` built in `data_dir/vision/` (mirrors its manifest.json)."""
  data_dir: str
  sources: dict[str, VisionSourceInfo]
  skipped: dict[str, str]  # source -> why it is missing
  synthetic_motion: str
  config: dict[str, Any]
  build_seconds: float

  @property
  def image_sources(self) -> list[str]:
    return [s for s, info in self.sources.items() if info.kind == "image"]

  def _info(self, source: str) -> VisionSourceInfo:
    if source not in self.sources:
      extra = f" (skipped when built: {self.skipped[source]})" if source in self.skipped else ""
      raise KeyError(f"unknown vision source {source!r}; {self.data_dir}/{SUBDIR} has "
                     f"{sorted(self.sources)}{extra}")
    return self.sources[source]

  def images(self, source: str, split: str) -> ImageSet:
    info = self._info(source)
    if info.kind != "image":
      raise KeyError(f"vision source {source!r} is a {info.kind} source, not an image source")
    if split not in info.splits:
      raise KeyError(f"unknown split {split!r} of {source!r}; expected one of {sorted(info.splits)}")
    return _load_images(os.path.join(self.data_dir, info.splits[split]["file"]), source,
                        None if info.classes is None else tuple(info.classes))

  def clips(self, source: str = "real_clips") -> ClipSet:
    info = self._info(source)
    if info.kind != "video":
      raise KeyError(f"vision source {source!r} is not a video source")
    with np.load(os.path.join(self.data_dir, info.splits["heldout"]["file"])) as z:
      return ClipSet(z["frames"], z["offsets"], tuple(str(s) for s in z["names"]),
                     tuple(str(s) for s in z["captions"]), float(z["fps"]))

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    del d["data_dir"]
    d["format_version"] = FORMAT_VERSION
    return d

  @classmethod
  def from_json(cls, data_dir: str, d: Mapping[str, Any]) -> "VisionManifest":
    return cls(data_dir=os.path.abspath(data_dir),
               sources={k: VisionSourceInfo(**v) for k, v in d["sources"].items()}, skipped=dict(d["skipped"]),
               synthetic_motion=d["synthetic_motion"], config=dict(d["config"]),
               build_seconds=float(d["build_seconds"]))


_IMAGE_CACHE: dict[str, tuple[float, ImageSet]] = {}  # path -> (mtime, items): a rebuilt file is read again


def _load_images(path: str, source: str, classes: tuple[str, ...] | None) -> ImageSet:
  mtime = os.path.getmtime(path)
  hit = _IMAGE_CACHE.get(path)
  if hit is None or hit[0] != mtime:
    with np.load(path) as z:
      hit = (mtime, ImageSet(source, z["pixels"], z["labels"], z["titles"], z["keywords"], classes))
    _IMAGE_CACHE[path] = hit
  return hit[1]


def load_vision_manifest(data_dir: str) -> VisionManifest:
  """Reads `data_dir/vision/manifest.json`; raises FileNotFoundError with the fix when it is missing."""
  path = os.path.join(data_dir, SUBDIR, MANIFEST)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: the vision data of {data_dir!r} has not been prepared; run "
                            f"`python -m m3_jax.data {data_dir} --vision` or "
                            f"m3_jax.data.prepare_vision({data_dir!r})")
  with open(path) as f:
    d = json.load(f)
  if d.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{path} has format_version {d.get('format_version')}, this code reads {FORMAT_VERSION}; "
                     f"rebuild with m3_jax.data.prepare_vision({data_dir!r}, force=True)")
  return VisionManifest.from_json(data_dir, d)


def _save_npz(path: str, **arrays: np.ndarray) -> None:
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, path)


def _str_array(xs: Sequence[str]) -> np.ndarray:
  # Unicode arrays load without pickle (np.load's allow_pickle stays False).
  return np.asarray(list(xs), dtype=str) if len(xs) else np.zeros((0,), "<U1")


# ---------------------------------------------------------------------------------------------------------------
# prepare_vision, step by step
# ---------------------------------------------------------------------------------------------------------------


def _check_args(sources: Sequence[str] | None, max_items: Mapping[str, int | None] | None, heldout_fraction: float,
                icon_size: int, clip_size: tuple[int, int]) -> tuple[list[str], dict[str, int | None]]:
  """(source names, {source: item cap}) after checking every argument of `prepare_vision`."""
  if isinstance(sources, str):
    raise TypeError(f"sources must be a sequence of names, got the string {sources!r}")
  names = list(ALL_VISION_SOURCES if sources is None else sources)
  unknown = [s for s in names if s not in ALL_VISION_SOURCES]
  if unknown:
    raise ValueError(f"unknown vision sources {unknown}; expected some of {list(ALL_VISION_SOURCES)}")
  if len(set(names)) != len(names):
    raise ValueError(f"sources has duplicates: {names}")
  caps: dict[str, int | None] = dict(DEFAULT_MAX_ITEMS)
  for k, v in (max_items or {}).items():
    if k not in ALL_VISION_SOURCES:
      raise ValueError(f"max_items has unknown source {k!r}; expected some of {list(ALL_VISION_SOURCES)}")
    if v is not None and int(v) < 2:
      raise ValueError(f"max_items[{k!r}]={v}: expected None or >= 2")
    caps[k] = None if v is None else int(v)
  if not 0.0 <= heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction={heldout_fraction} must be in [0, 1)")
  if icon_size < 8:
    raise ValueError(f"icon_size={icon_size}: expected >= 8")
  if len(clip_size) != 2 or min(clip_size) < 8:
    raise ValueError(f"clip_size={clip_size}: expected (height, width), both >= 8")
  return names, caps


def _source_config(name: str, *, caps: Mapping[str, int | None], heldout_fraction: float, seed: int, icon_size: int,
                   clip_size: tuple[int, int], clip_fps: float, clip_max_frames: int) -> dict[str, Any]:
  """The arguments one source is built with: its cache key, stored in the manifest."""
  if name in VIDEO_SOURCES:
    cfg = {"clip_size": [int(clip_size[0]), int(clip_size[1])], "clip_fps": float(clip_fps),
           "clip_max_frames": int(clip_max_frames)}
  else:
    cfg = {"max_items": caps.get(name), "heldout_fraction": float(heldout_fraction), "seed": int(seed)}
    if name in ("openclipart", "emoji"):
      cfg["icon_size"] = int(icon_size)
  cfg["format"] = FORMAT_VERSION
  return cfg


def _subset(name: str, n: int, max_items: int | None, seed: int) -> np.ndarray:
  """Sorted indices of a deterministic subset of at most max_items of n items (all of them if None)."""
  if max_items is None or n <= max_items:
    return np.arange(n, dtype=np.int64)
  rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])
  return np.sort(rng.choice(n, size=int(max_items), replace=False)).astype(np.int64)


def _build_images(name: str, cfg: Mapping[str, Any], data_dir: str, raw_dir: str) -> VisionSourceInfo:
  origin, reader = IMAGE_READERS[name]
  items = reader(raw_dir, cfg)
  n_all = len(items.pixels)
  keep = _subset(name, n_all, cfg["max_items"], cfg["seed"]) if name != "openclipart" else np.arange(n_all)
  held = set(heldout_indices(name, len(keep), cfg["heldout_fraction"], cfg["seed"], min_items=16,
                             max_items=2000).tolist())
  splits = {}
  for split in SPLITS:
    idx = keep[[i for i in range(len(keep)) if (i in held) == (split == "heldout")]]
    rel = f"{SUBDIR}/{name}.{split}.npz"
    _save_npz(os.path.join(data_dir, rel), pixels=items.pixels[idx], labels=items.labels[idx],
              titles=_str_array([items.titles[i] for i in idx]),
              keywords=_str_array([items.keywords[i] for i in idx]))
    splits[split] = {"items": int(len(idx)), "file": rel}
  notes = f"{n_all} items read" + (f", kept a deterministic subset of {len(keep)}" if len(keep) < n_all else "")
  notes += f"; {items.notes}" if items.notes else ""
  return VisionSourceInfo(kind="image", origin=origin, classes=None if items.classes is None else list(items.classes),
                          item_shape=list(items.pixels.shape[1:]), splits=splits, corrupt=len(items.corrupt),
                          corrupt_examples=items.corrupt[:5], config=dict(cfg), notes=notes)


def _build_clips(name: str, cfg: Mapping[str, Any], data_dir: str, raw_dir: str) -> VisionSourceInfo:
  got = read_clips(raw_dir, cfg)
  rel = f"{SUBDIR}/{name}.heldout.npz"
  _save_npz(os.path.join(data_dir, rel), frames=got["frames"], offsets=got["offsets"],
            names=_str_array(got["names"]), captions=_str_array(got["captions"]),
            fps=np.asarray(cfg["clip_fps"], np.float64))
  lengths = np.diff(got["offsets"]).tolist()
  notes = (f"evaluation only; clips {dict(zip(got['names'], lengths))} frames at {cfg['clip_fps']} fps; "
           f"decoded with {got['ffmpeg']}" + (f"; problems: {got['problems']}" if got["problems"] else ""))
  return VisionSourceInfo(kind="video", origin=source_origin(name), classes=None,
                          item_shape=list(got["frames"].shape[1:]),
                          splits={"heldout": {"items": len(got["names"]), "file": rel,
                                              "frames": int(got["offsets"][-1])}},
                          corrupt=len(got["corrupt"]), corrupt_examples=got["corrupt"][:5], config=dict(cfg),
                          notes=notes)


def _build_sources(cfgs: Mapping[str, dict[str, Any]], old: VisionManifest | None, data_dir: str, force: bool,
                   verbose: bool) -> tuple[dict[str, VisionSourceInfo], dict[str, str], list[str]]:
  """(built or reused {source: info}, {source: why skipped}, reused names): a source whose config and files are
  unchanged is reused from `old`, the others are built now."""
  raw_dir = os.path.join(data_dir, "raw")
  built: dict[str, VisionSourceInfo] = {}
  skipped: dict[str, str] = {}
  reused = []
  for name, cfg in cfgs.items():
    prev = old.sources.get(name) if old is not None else None
    if (not force and prev is not None and prev.config == cfg and
        all(os.path.exists(os.path.join(data_dir, s["file"])) for s in prev.splits.values())):
      built[name] = prev
      reused.append(name)
      continue
    t = time.time()
    try:
      info = (_build_clips if name in VIDEO_SOURCES else _build_images)(name, cfg, data_dir, raw_dir)
    except ImportError as e:  # Pillow comes with matplotlib; without it no image can be decoded
      skipped[name] = f"{source_origin(name)}: needs Pillow ({e})"
      log(verbose, f"SKIPPED vision source {name!r}: {skipped[name]}", tag=_TAG)
      continue
    except SOURCE_ERRORS as e:
      skipped[name] = f"{source_origin(name)}: {e}"
      log(verbose, f"SKIPPED vision source {name!r}: {skipped[name]}", tag=_TAG)
      continue
    built[name] = info
    sizes = ", ".join(f"{k} {v['items']}" for k, v in info.splits.items())
    log(verbose, f"  {name:15s} {sizes}  item {'x'.join(map(str, info.item_shape))}"
                 + (f"  corrupt/skipped items {info.corrupt}" if info.corrupt else "")
                 + f"  ({time.time() - t:.1f} s)", tag=_TAG)
  return built, skipped, reused


def prepare_vision(data_dir: str, *, sources: Sequence[str] | None = None,
                   max_items: Mapping[str, int | None] | None = None, heldout_fraction: float = 0.05,
                   seed: int = 0, icon_size: int = 64, clip_size: tuple[int, int] = (72, 96),
                   clip_fps: float = 4.0, clip_max_frames: int = 64, verbose: bool = True,
                   force: bool = False) -> VisionManifest:
  """Builds (or finds already built) the image and clip arrays in `data_dir/vision/`; see the module docstring.

  Args:
    data_dir: the data directory (the text corpus's; downloads are cached in `data_dir/raw/` next to the text's).
    sources: subset of ALL_VISION_SOURCES (default all). A source whose package cannot be had is skipped with a
      printed reason and listed in `manifest.skipped`.
    max_items: {source: cap} on the items kept from a source (before the held-out split); merged over
      DEFAULT_MAX_ITEMS (fashion_mnist 20000, openclipart 3000); None as a value keeps everything.
    heldout_fraction: fraction of each image source held out (at least 16 items, at most 2000).
    seed: picks subsets and held-out items.
    icon_size: side of the stored clip-art and emoji icons (RGBA).
    clip_size: (height, width) of stored real-clip frames (scaled to cover, centre-cropped).
    clip_fps, clip_max_frames: real clips are sampled at clip_fps, at most clip_max_frames frames each.
    verbose: print progress and a summary.
    force: rebuild every source even if its cached arrays match the arguments (e.g. to retry skipped sources).

  Returns:
    The VisionManifest. Sources whose arguments did not change are reused from the cache, so a second call costs
    milliseconds and adding a source builds only that source.
  """
  t0 = time.time()
  data_dir = os.path.abspath(data_dir)
  names, caps = _check_args(sources, max_items, heldout_fraction, icon_size, clip_size)
  vdir = os.path.join(data_dir, SUBDIR)
  os.makedirs(vdir, exist_ok=True)
  try:
    old = load_vision_manifest(data_dir)
  except (FileNotFoundError, ValueError, KeyError, TypeError, json.JSONDecodeError):
    old = None
  cfgs = {name: _source_config(name, caps=caps, heldout_fraction=heldout_fraction, seed=seed, icon_size=icon_size,
                               clip_size=clip_size, clip_fps=clip_fps, clip_max_frames=clip_max_frames)
          for name in names}
  built, skipped, reused = _build_sources(cfgs, old, data_dir, force, verbose)
  if old is not None:  # files of sources no longer built must not linger
    for name, info in old.sources.items():
      if name not in built:
        for s in info.splits.values():
          p = os.path.join(data_dir, s["file"])
          if os.path.exists(p):
            os.remove(p)
  config = {"sources": names, "heldout_fraction": float(heldout_fraction), "seed": int(seed)}
  manifest = VisionManifest(data_dir=data_dir, sources=built, skipped=skipped,
                            synthetic_motion=SYNTHETIC_MOTION_NOTE, config=config,
                            build_seconds=round(time.time() - t0, 2))
  write_json(os.path.join(vdir, MANIFEST), manifest.to_json())
  if verbose:
    size = sum(os.path.getsize(os.path.join(data_dir, s["file"])) for i in built.values() for s in i.splits.values())
    log(True, f"vision data in {vdir}: {len(built)} sources ({size / 1e6:.1f} MB)"
              + (f", reused from cache: {reused}" if reused else "")
              + (f"; SKIPPED {sorted(skipped)}" if skipped else "")
              + f"; {time.time() - t0:.1f} s", tag=_TAG)
  return manifest


def main(argv: Sequence[str] | None = None) -> VisionManifest:
  """`python -m m3_jax.data.vision_prepare DATA_DIR [--sources a,b] [--force]`: only the vision data."""
  p = argparse.ArgumentParser(prog="python -m m3_jax.data.vision_prepare", description="Prepare the image/video data.")
  p.add_argument("data_dir")
  p.add_argument("--sources", default=None, help=f"comma-separated, from {','.join(ALL_VISION_SOURCES)}")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--force", action="store_true", help="rebuild even if up to date (e.g. to retry skipped sources)")
  a = p.parse_args(argv)
  srcs = None if a.sources is None else [s for s in a.sources.split(",") if s]
  return prepare_vision(a.data_dir, sources=srcs, seed=a.seed, force=a.force)


if __name__ == "__main__":
  main()
