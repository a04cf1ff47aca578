"""grain pipelines for multimodal batches: image-caption and video-caption examples (the prepared images of
m3_jax.data.vision_prepare, synthetic motion clips of m3_jax.data.motion) packed into rows, mixed row by row with
the text pipeline's rows (m3_jax.data.text_pipeline).

A batch (keys: m3_jax.core.batch.MM_KEYS) is the text batch of text_pipeline.py (`inputs, targets, segment_ids,
positions, loss_mask`, all [B, L]) plus, for each modality the `VisionSpec` uses (a modality with 0 items per row
has no keys at all):

    images       float32 [B, N_img, tp, H, W, 3]   pixels normalised as (x / 255 - 0.5) / 0.5, so in [-1, 1]; an
                                                   image is one frame repeated tp = temporal_patch_size times
    image_valid  bool    [B, N_img]                real items first in each row, then padding (all-zero pixels)
    videos       float32 [B, N_vid, F, H, W, 3]    F = spec.num_frames, a multiple of tp
    video_valid  bool    [B, N_vid]

One example is `<|image_start|> n x <image> <|image_end|> caption <|endoftext|>` (with probability
`caption_first_prob` the caption comes first: `caption <|image_start|> ... <|image_end|> <|endoftext|>`), n =
`spec.tokens_per_image` = (H / (patch * merge)) * (W / (patch * merge)); a video example is the same with
`<|video_start|>`, `<video>` x `spec.tokens_per_video` (= F / tp times that) and `<|video_end|>`. The k-th item of a
row belongs to the k-th placeholder span of that row; items are never split across rows. `loss_mask` is 0 where
the target is a placeholder or a start/end marker (loss on text only), and 0 in padding.

Mixing text and vision, and why the text stream stays the same across arms. A training batch has
`global_batch_size // process_count` rows; in step s, `round`-ed so that the running total matches, a fraction
`vision_weight(s)` of them are multimodal rows and the rest are text rows. Both come from separate streams:

  * the text rows are exactly the rows of `text_pipeline.make_train_dataset` with the same seed, sources and packing
    (same pieces, same order, same packing), consumed in order;
  * the multimodal rows are packed from the multimodal examples alone (optionally with text pieces from an
    independently seeded text stream, `text_in_mm_rows`).

So two runs that differ only in `vision_weight` (e.g. text-only vs native multimodal, or vision switched on at step
1000 via `vision_weight=lambda step: 0.0 if step < 1000 else 0.25`) read the identical sequence of text rows; the
vision arm just takes fewer of them per step (same text order, fewer text tokens per step). With
`vision_weight=0` the batches are those of `make_train_dataset` (plus empty visual keys) row for row. The step
counter is part of the iterator state, so a schedule resumes correctly.

Extra rows (`vision_rows` > 0), for comparisons under the same text-token budget: every batch is the whole text
batch of `make_train_dataset` (global_batch_size rows, in order) with `vision_rows` multimodal rows appended, so a
vision arm sees exactly the text tokens of a text-only run, per step and in total. Before `vision_start_step` the
appended rows are padding rows (no tokens, no loss, no valid items): shapes stay static, so one compiled step serves
the whole run, and the multimodal stream is not read until vision starts. With several processes each process
appends its `vision_rows // process_count` rows to its `global_batch_size // process_count` text rows.

Every training batch also carries `text_row` bool [B] (True for the rows of the text stream), and the iterator keeps
a running count of the text stream's target tokens (`text_tokens`, loss-mask sum of the text rows) and a running
hash of it (`text_hash`: sha256 chained over each batch's text rows' int32 `inputs` bytes, starting from the empty
string) in its state: equal counts and hashes after the same number of steps prove two runs read the same text.

Everything is deterministic for a seed and resumable: `it.get_state()` is plain JSON (both streams' grain states
and the step counter) and `it.set_state(state)` continues exactly; orbax's `grain.checkpoint.CheckpointSave(it)`
works as for the text pipeline.

Eval: `make_mm_eval_batches(data_dir, source, ...)` gives a fixed, finite list of batches per source: every
held-out item of an image source (fixed templates), `synthetic_video` (a fixed set of clips synthesised from
held-out sprites, with `direction_mask` / `object_mask` marking the caption tokens that need temporal information)
and `real_clips` (windows of the real clips, evaluation only).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from m3_jax.core.batch import EOT, IMAGE, IMAGE_END, IMAGE_START, VIDEO, VIDEO_END, VIDEO_START
from m3_jax.data.captions import image_caption, item_phrase
from m3_jax.data.common import check_seq_len, mp_prefetch, seed32
from m3_jax.data.motion import MotionConfig, SyntheticClip, synthesize_clip
from m3_jax.data.text_pipeline import pack_pieces, train_pieces
from m3_jax.data.text_prepare import load_manifest
from m3_jax.data.tokenizer import Tokenizer
from m3_jax.data.vision_prepare import ClipSet, ImageSet, load_vision_manifest

__all__ = ["VisionSpec", "SYNTHETIC_VIDEO", "EVAL_ONLY_SOURCES", "DEFAULT_MM_WEIGHTS",
           "DEFAULT_SPRITE_SOURCES", "list_mm_sources", "make_mm_train_dataset", "make_mm_eval_batches",
           "image_to_pixels", "normalize_pixels"]

_VISUAL_IDS = np.array([IMAGE, VIDEO, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END])

SYNTHETIC_VIDEO = "synthetic_video"
EVAL_ONLY_SOURCES = ("real_clips",)
# Element shares of the multimodal examples (not token shares); only the prepared sources a spec can use count.
DEFAULT_MM_WEIGHTS: dict[str, float] = {"fashion_mnist": 1.0, "opencv_digits": 1.0, "sklearn_digits": 0.5,
                                        "openclipart": 1.0, "emoji": 1.0, SYNTHETIC_VIDEO: 2.0}
DEFAULT_SPRITE_SOURCES = ("fashion_mnist", "opencv_digits", "emoji")


@dataclasses.dataclass(frozen=True)
class VisionSpec:
  """The static visual shapes of a batch (fixed per config so that jit sees one shape).

  height, width: pixels of every image and frame; multiples of patch_size * spatial_merge_size.
  num_frames: frames of every video item; a multiple of temporal_patch_size.
  max_images_per_row, max_videos_per_row: N_img and N_vid; 0 drops that modality's keys from the batch.
  """
  height: int
  width: int
  patch_size: int = 14
  spatial_merge_size: int = 2
  temporal_patch_size: int = 2
  num_frames: int = 8
  max_images_per_row: int = 4
  max_videos_per_row: int = 1

  def __post_init__(self):
    for name in ("height", "width", "patch_size", "spatial_merge_size", "temporal_patch_size", "num_frames"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"VisionSpec: {name}={v!r} must be a positive int")
    for name in ("max_images_per_row", "max_videos_per_row"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"VisionSpec: {name}={v!r} must be an int >= 0")
    unit = self.unit
    if self.height % unit or self.width % unit:
      raise ValueError(f"VisionSpec: height x width = {self.height} x {self.width} must be multiples of "
                       f"patch_size * spatial_merge_size = {self.patch_size} * {self.spatial_merge_size} = {unit}")
    if self.num_frames % self.temporal_patch_size:
      raise ValueError(f"VisionSpec: num_frames={self.num_frames} must be a multiple of "
                       f"temporal_patch_size={self.temporal_patch_size}")
    if self.max_images_per_row == 0 and self.max_videos_per_row == 0:
      raise ValueError("VisionSpec: max_images_per_row and max_videos_per_row are both 0: no visual items at all")

  @property
  def unit(self) -> int:
    """Pixels per merged visual token along each spatial axis."""
    return self.patch_size * self.spatial_merge_size

  @property
  def tokens_per_image(self) -> int:
    return (self.height // self.unit) * (self.width // self.unit)

  @property
  def tokens_per_video(self) -> int:
    return (self.num_frames // self.temporal_patch_size) * self.tokens_per_image

  @classmethod
  def from_vision_config(cls, vcfg: Any, *, height: int, width: int, num_frames: int = 8,
                         max_images_per_row: int = 4, max_videos_per_row: int = 1) -> "VisionSpec":
    """From the model's VisionConfig (patch_size, spatial_merge_size, temporal_patch_size) and data shapes."""
    return cls(height=height, width=width, patch_size=int(vcfg.patch_size),
               spatial_merge_size=int(vcfg.spatial_merge_size), temporal_patch_size=int(vcfg.temporal_patch_size),
               num_frames=num_frames, max_images_per_row=max_images_per_row, max_videos_per_row=max_videos_per_row)


def list_mm_sources(data_dir: str, spec: VisionSpec | None = None) -> list[str]:
  """Multimodal train sources available in `data_dir` for `spec`: prepared image sources and synthetic_video (if
  any sprite source is prepared); eval-only sources (real_clips) are not listed."""
  vm = load_vision_manifest(data_dir)
  out = []
  if spec is None or spec.max_images_per_row > 0:
    out += vm.image_sources
  if (spec is None or spec.max_videos_per_row > 0) and any(s in vm.sources for s in DEFAULT_SPRITE_SOURCES):
    out.append(SYNTHETIC_VIDEO)
  return out


# ---------------------------------------------------------------------------------------------------------------
# Pixels
# ---------------------------------------------------------------------------------------------------------------


def image_to_pixels(item: np.ndarray, height: int, width: int) -> np.ndarray:
  """A stored image (uint8 [h, w, 1] grey or [h, w, 4] RGBA) as uint8 [height, width, 3].

  Grey images keep their black background; RGBA icons are composited on white. A square image is scaled to fit and
  centred (letterboxed) so that non-square targets keep its aspect ratio.
  """
  from PIL import Image
  if item.ndim != 3 or item.shape[-1] not in (1, 3, 4):
    raise ValueError(f"image_to_pixels: item of shape {item.shape}; expected [h, w, 1|3|4]")
  c = item.shape[-1]
  if c == 1:
    im, fill = Image.fromarray(item[..., 0], "L").convert("RGB"), (0, 0, 0)
  elif c == 3:
    im, fill = Image.fromarray(item, "RGB"), (0, 0, 0)
  else:
    rgba = Image.fromarray(item, "RGBA")
    im, fill = Image.new("RGB", rgba.size, (255, 255, 255)), (255, 255, 255)
    im.paste(rgba, mask=rgba.getchannel("A"))
  scale = min(height / im.height, width / im.width)
  w, h = max(1, round(im.width * scale)), max(1, round(im.height * scale))
  im = im.resize((w, h), Image.Resampling.BICUBIC if scale > 1 else Image.Resampling.LANCZOS)
  if (w, h) != (width, height):
    canvas = Image.new("RGB", (width, height), fill)
    canvas.paste(im, ((width - w) // 2, (height - h) // 2))
    im = canvas
  return np.asarray(im, dtype=np.uint8)


def _frames_to_pixels(frames: np.ndarray, height: int, width: int) -> np.ndarray:
  """Real-clip frames uint8 [T, h, w, 3] -> [T, height, width, 3]: centre crop to the target aspect, resize."""
  from PIL import Image
  t, h, w, _ = frames.shape
  target = width / height
  if w / h > target:
    cw, ch = round(h * target), h
  else:
    cw, ch = w, round(w / target)
  x0, y0 = (w - cw) // 2, (h - ch) // 2
  out = np.empty((t, height, width, 3), np.uint8)
  for i in range(t):
    im = Image.fromarray(frames[i, y0:y0 + ch, x0:x0 + cw])
    out[i] = np.asarray(im.resize((width, height), Image.Resampling.BILINEAR))
  return out


def normalize_pixels(x: np.ndarray) -> np.ndarray:
  """uint8 pixels -> float32 (x / 255 - 0.5) / 0.5, in [-1, 1] (the contract's normalisation)."""
  return x.astype(np.float32) * np.float32(2.0 / 255.0) - np.float32(1.0)


# ---------------------------------------------------------------------------------------------------------------
# Examples (element dicts before packing)
# ---------------------------------------------------------------------------------------------------------------


class _Captioner:
  """Tokenises captions with the project tokenizer; loads it lazily (pickles into grain workers as a path)."""

  def __init__(self, path: str):
    self.path = path
    self._tok: Tokenizer | None = None

  @property
  def tok(self) -> Tokenizer:
    if self._tok is None:
      self._tok = Tokenizer.from_file(self.path)
    return self._tok

  def encode(self, text: str) -> list[int]:
    return self.tok.encode(text, allow_special=False)

  def encode_pieces(self, pieces: Sequence[tuple[str, str]]) -> tuple[list[int], list[str]]:
    ids, tags = [], []
    for piece, got in zip(pieces, self.tok.encode_batch([p for p, _ in pieces], allow_special=False)):
      ids += got
      tags += [piece[1]] * len(got)
    return ids, tags

  def __getstate__(self):
    return {"path": self.path, "_tok": None}


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What an element dict holds besides the tokens, so that all elements of a packed stream share a structure."""
  spec: VisionSpec
  seq_len: int
  temporal_masks: bool = False  # eval of synthetic video: direction_mask / object_mask

  def empty_visual(self) -> dict[str, np.ndarray]:
    s = self.spec
    out = {}
    if s.max_images_per_row:
      out["images"] = np.zeros((0, s.height, s.width, 3), np.uint8)
    if s.max_videos_per_row:
      out["videos"] = np.zeros((0, s.num_frames, s.height, s.width, 3), np.uint8)
    return out

  def length_struct(self) -> dict[str, int]:
    s = self.spec
    out = {"inputs": self.seq_len, "targets": self.seq_len, "loss_mask": self.seq_len}
    if self.temporal_masks:
      out.update(direction_mask=self.seq_len, object_mask=self.seq_len)
    if s.max_images_per_row:
      out["images"] = s.max_images_per_row
    if s.max_videos_per_row:
      out["videos"] = s.max_videos_per_row
    return out


def _example(layout: _Layout, kind: str, pixels: np.ndarray, caption: list[int], caption_first: bool,
             tags: list[str] | None = None) -> dict[str, np.ndarray]:
  """One packed-stream element: the token sequence of an item with its caption, and the item's pixels."""
  spec = layout.spec
  if kind == "image":
    n, start, ph, end = spec.tokens_per_image, IMAGE_START, IMAGE, IMAGE_END
  else:
    n, start, ph, end = spec.tokens_per_video, VIDEO_START, VIDEO, VIDEO_END
  # The whole example must fit one row: seq_len + 1 tokens give seq_len input/target pairs.
  room = layout.seq_len + 1 - (n + 3)
  caption, tags = caption[:room], (tags[:room] if tags is not None else None)
  visual = [start] + [ph] * n + [end]
  if caption_first:
    seq, seq_tags = caption + visual + [EOT], (tags or [""] * len(caption)) + [""] * (n + 3)
  else:
    seq, seq_tags = visual + caption + [EOT], [""] * (n + 2) + (tags or [""] * len(caption)) + [""]
  seq = np.asarray(seq, np.int32)
  targets = seq[1:]
  out = {"inputs": seq[:-1], "targets": targets,
         "loss_mask": (~np.isin(targets, _VISUAL_IDS)).astype(np.float32)}
  if layout.temporal_masks:
    t = np.asarray(seq_tags[1:])
    out["direction_mask"] = (t == "direction").astype(np.float32)
    out["object_mask"] = (t == "object").astype(np.float32)
  out.update(layout.empty_visual())
  key = "images" if kind == "image" else "videos"
  out[key] = pixels[None]
  return out


def _check_fits(layout: _Layout, kinds: Sequence[str]) -> None:
  """Raises unless one item of each kind in `kinds` ("image", "video") fits a row with a caption."""
  spec = layout.spec
  n = max(spec.tokens_per_image if k == "image" else spec.tokens_per_video for k in kinds)
  if layout.seq_len < n + 3:
    raise ValueError(f"seq_len={layout.seq_len} cannot hold one visual item of {n} tokens plus its start/end "
                     f"markers, one caption token and <|endoftext|> (needs >= {n + 3}); spec {spec}")


class _ImageItems(Sequence):
  """Random-access items of one split of a prepared image source, loaded lazily (cheap to pickle)."""

  def __init__(self, data_dir: str, source: str, split: str):
    self.data_dir, self.source, self.split = data_dir, source, split
    self._set: ImageSet | None = None
    self._n = load_vision_manifest(data_dir).sources[source].splits[split]["items"]

  @property
  def items(self) -> ImageSet:
    if self._set is None:
      self._set = load_vision_manifest(self.data_dir).images(self.source, self.split)
    return self._set

  def __len__(self) -> int:
    return int(self._n)

  def __getitem__(self, i):
    s = self.items
    i = int(i)
    return {"index": i, "pixels": s.pixels[i], "label": int(s.labels[i]), "title": str(s.titles[i]),
            "keywords": str(s.keywords[i])}

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_set"] = None
    return d


class _ImageExample:
  """grain random_map: an image item -> a packed-stream element with a templated caption."""

  def __init__(self, layout: _Layout, captioner: _Captioner, source: str, caption_first_prob: float,
               fixed: bool = False):
    self.layout, self.captioner, self.source = layout, captioner, source
    self.caption_first_prob, self.fixed = caption_first_prob, fixed

  def __call__(self, item: Mapping[str, Any], rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    if self.fixed:  # eval: the template is a function of the item, the caption comes after the image
      template, first = item["index"], False
    else:
      template, first = int(rng.integers(1 << 30)), bool(rng.random() < self.caption_first_prob)
    text = image_caption(self.source, item["label"], item["title"], item["keywords"], template)
    spec = self.layout.spec
    pixels = image_to_pixels(item["pixels"], spec.height, spec.width)
    return _example(self.layout, "image", pixels, self.captioner.encode(text), first)


_DIRECTION_WORDS = re.compile(r"\b(left|right|up|down|upwards|downwards|leftwards|rightwards|upward|downward)\b",
                              re.I)


class _SpritePool:
  """The sprites of synthetic clips: items of some image sources' split, each with a caption noun phrase."""

  def __init__(self, data_dir: str, sources: Sequence[str], split: str):
    vm = load_vision_manifest(data_dir)
    self.data_dir, self.split = data_dir, split
    self.sources = [s for s in sources if s in vm.sources and vm.sources[s].kind == "image"]
    if not self.sources:
      raise ValueError(f"sprite_sources={list(sources)}: none is a prepared image source of {data_dir} "
                       f"(prepared: {vm.image_sources})")
    names, owner, local = [], [], []
    for k, s in enumerate(self.sources):
      items = vm.images(s, split)
      phrases = [item_phrase(s, int(l), str(t)) for l, t in zip(items.labels, items.titles)]
      # A sprite named by a direction ("upwards black arrow emoji") would blur the direction words of captions.
      keep = [i for i, p in enumerate(phrases) if not _DIRECTION_WORDS.search(p)]
      names += [phrases[i] for i in keep]
      owner.append(np.full(len(keep), k, np.int32))
      local.append(np.asarray(keep, dtype=np.int64))
    if not names:
      raise ValueError(f"sprite_sources {self.sources} have no {split} items")
    self.names = names
    self._owner, self._local = np.concatenate(owner), np.concatenate(local)
    self._sets: list[ImageSet] | None = None

  def __len__(self) -> int:
    return len(self.names)

  def sprite(self, i: int, side: int, rng: np.random.Generator,
             background: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rgb float32 [side, side, 3], alpha float32 [side, side]) of sprite i. Grey items (bright object on black)
    become a tinted object whose opacity is the grey level, tinted to contrast with the background."""
    from PIL import Image
    if self._sets is None:
      vm = load_vision_manifest(self.data_dir)
      self._sets = [vm.images(s, self.split) for s in self.sources]
    item = self._sets[self._owner[i]].pixels[self._local[i]]
    if item.shape[-1] == 1:
      g = np.asarray(Image.fromarray(item[..., 0], "L").resize((side, side), Image.Resampling.BICUBIC),
                     np.float32) / 255.0
      dark_bg = float(background.mean()) < 128
      tint = rng.uniform(150, 255, 3) if dark_bg else rng.uniform(0, 100, 3)
      alpha = np.clip(g * 1.5, 0.0, 1.0)
      rgb = np.broadcast_to(tint.astype(np.float32), (side, side, 3))
      return rgb, alpha
    im = Image.fromarray(item, "RGBA").convert("RGBa").resize((side, side), Image.Resampling.LANCZOS)
    arr = np.asarray(im.convert("RGBA"), np.float32)
    return arr[..., :3], arr[..., 3] / 255.0

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_sets"] = None
    return d


class _VideoExample:
  """grain map: an int (the element's index) -> a synthetic clip element. The clip depends on (seed, index) only.

  The motion is synthetic (motion.synthesize_clip): real images slide over a plain background."""

  def __init__(self, layout: _Layout, captioner: _Captioner, sprites: _SpritePool, motion: MotionConfig,
               seed: int, caption_first_prob: float, fixed: bool = False):
    self.layout, self.captioner, self.sprites, self.motion = layout, captioner, sprites, motion
    self.seed, self.caption_first_prob, self.fixed = seed, caption_first_prob, fixed

  def clip(self, index: int) -> SyntheticClip:
    spec = self.layout.spec
    rng = np.random.default_rng([self.seed, int(index)])
    return synthesize_clip(rng, self.sprites.names, self.sprites.sprite, spec.height, spec.width,
                                  spec.num_frames, self.motion)

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    clip = self.clip(index)
    rng = np.random.default_rng([self.seed, int(index), 1])
    first = False if self.fixed else bool(rng.random() < self.caption_first_prob)
    if self.layout.temporal_masks:
      ids, tags = self.captioner.encode_pieces(clip.pieces)
    else:
      ids, tags = self.captioner.encode(clip.caption), None
    return _example(self.layout, "video", clip.frames, ids, first, tags)


class _TextPiece:
  """grain map: a text piece of text_pipeline.train_pieces -> a packed-stream element without visual items."""

  def __init__(self, layout: _Layout):
    self.layout = layout

  def __call__(self, piece: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"inputs": piece["inputs"], "targets": piece["targets"],
           "loss_mask": np.ones(piece["targets"].shape, np.float32)}
    if self.layout.temporal_masks:
      out["direction_mask"] = np.zeros(piece["targets"].shape, np.float32)
      out["object_mask"] = np.zeros(piece["targets"].shape, np.float32)
    out.update(self.layout.empty_visual())
    return out


# ---------------------------------------------------------------------------------------------------------------
# Packing multimodal rows
# ---------------------------------------------------------------------------------------------------------------


class _FinalizeRow:
  """Packed element -> the row of a batch (uint8 pixels; `_ToModelBatch` normalises after batching)."""

  def __init__(self, layout: _Layout):
    self.layout = layout

  def __call__(self, row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = row["inputs_segment_ids"].astype(np.int32)
    real = seg > 0
    out = {
        "inputs": row["inputs"].astype(np.int32),
        "targets": row["targets"].astype(np.int32),
        "segment_ids": seg,
        "positions": row["inputs_positions"].astype(np.int32),
        "loss_mask": (row["loss_mask"] * real).astype(np.float32),
    }
    if self.layout.temporal_masks:
      out["direction_mask"] = (row["direction_mask"] * real).astype(np.float32)
      out["object_mask"] = (row["object_mask"] * real).astype(np.float32)
    for key, valid in (("images", "image_valid"), ("videos", "video_valid")):
      if key in row:
        out[key] = row[key]
        out[valid] = row[f"{key}_segment_ids"] > 0  # occupied slots carry their example's segment id
    return out


def _padding_row(layout: _Layout) -> dict[str, np.ndarray]:
  """An empty multimodal row: no tokens (segment 0), no loss, no valid items; its keys are a training row's."""
  zeros = {k: np.zeros((layout.seq_len,), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
  out = _text_row_as_mm({**zeros, "loss_mask": np.zeros((layout.seq_len,), np.float32)}, layout)
  out["text_row"] = np.bool_(False)
  return out


def _pack_mm(ds: grain.IterDataset, layout: _Layout, num_bins: int, seed: int, shuffle_bins: bool) -> grain.IterDataset:
  packed = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct=layout.length_struct(), num_packing_bins=num_bins, seed=seed, shuffle_bins=shuffle_bins)
  return packed.map(_FinalizeRow(layout))


def _text_row_as_mm(row: Mapping[str, np.ndarray], layout: _Layout) -> dict[str, np.ndarray]:
  out = dict(row)
  out["text_row"] = np.bool_(True)
  s = layout.spec
  if s.max_images_per_row:
    out["images"] = np.zeros((s.max_images_per_row, s.height, s.width, 3), np.uint8)
    out["image_valid"] = np.zeros((s.max_images_per_row,), bool)
  if s.max_videos_per_row:
    out["videos"] = np.zeros((s.max_videos_per_row, s.num_frames, s.height, s.width, 3), np.uint8)
    out["video_valid"] = np.zeros((s.max_videos_per_row,), bool)
  return out


class _ToModelBatch:
  """Stacked uint8 rows -> the contract's batch: images repeated tp times, pixels normalised, padding zeroed."""

  def __init__(self, spec: VisionSpec):
    self.spec = spec

  def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(batch)
    tp = self.spec.temporal_patch_size
    if "images" in batch:
      x = normalize_pixels(batch["images"]) * batch["image_valid"][:, :, None, None, None]  # [B, N, H, W, 3]
      out["images"] = np.repeat(x[:, :, None], tp, axis=2)  # [B, N, tp, H, W, 3]
    if "videos" in batch:
      out["videos"] = normalize_pixels(batch["videos"]) * batch["video_valid"][:, :, None, None, None, None]
    return out


def _stack(rows: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# ---------------------------------------------------------------------------------------------------------------
# Row mixing: text rows and multimodal rows, a step-dependent share
# ---------------------------------------------------------------------------------------------------------------


def _rows_this_step(acc: float, weight: float, batch: int) -> tuple[int, float]:
  """Multimodal rows in a step whose running target before the step is `acc` rows: the rounded running total
  grows by weight * batch per step, so shares below one row per step still come out right on average."""
  new = acc + weight * batch
  n = int(np.floor(new + 0.5)) - int(np.floor(acc + 0.5))
  return min(max(n, 0), batch), new


def _mm_positions(n: int, batch: int) -> list[int]:
  """Rows of a batch that hold multimodal rows: spread evenly (data-parallel shards get similar vision work)."""
  return sorted({(j * batch) // n for j in range(n)}) if n else []


class _TextStream:
  """Running count of the text rows' target tokens and a sha256 chain over their inputs (plain JSON state)."""

  def __init__(self):
    self.tokens, self.hash = 0, hashlib.sha256(b"").hexdigest()

  def add(self, rows: Sequence[Mapping[str, np.ndarray]]) -> None:
    if self.hash is None:  # resumed from a state written before the text stream was tracked: unknown from then on
      return
    h = hashlib.sha256(bytes.fromhex(self.hash))
    for r in rows:
      h.update(np.ascontiguousarray(r["inputs"], dtype="<i4").tobytes())
      self.tokens += int(np.asarray(r["loss_mask"]).sum())
    self.hash = h.hexdigest()

  def state(self) -> dict[str, Any]:
    return {"text_tokens": self.tokens, "text_hash": self.hash}

  def restore(self, state: Mapping[str, Any]) -> None:
    if "text_hash" not in state:
      self.tokens, self.hash = None, None
    else:
      self.tokens, self.hash = int(state["text_tokens"]), str(state["text_hash"])


def _mm_row(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {**row, "text_row": np.bool_(False)}


class _RowMixIterator(grain.DatasetIterator):

  def __init__(self, text_it, mm_it, batch: int, weight, layout: _Layout):
    super().__init__([text_it, mm_it])
    self._text, self._mm = text_it, mm_it
    self._batch, self._weight, self._layout = batch, weight, layout
    self._to_model = _ToModelBatch(layout.spec)
    self._step, self._acc = 0, 0.0
    self._stream = _TextStream()

  def _weight_at(self, step: int) -> float:
    w = float(self._weight(step)) if callable(self._weight) else float(self._weight)
    if not 0.0 <= w <= 1.0:
      raise ValueError(f"vision_weight at step {step} is {w}; expected a fraction of rows in [0, 1]")
    return w

  def __next__(self) -> dict[str, np.ndarray]:
    n, acc = _rows_this_step(self._acc, self._weight_at(self._step), self._batch)
    where = set(_mm_positions(n, self._batch))
    rows = [_mm_row(next(self._mm)) if r in where else _text_row_as_mm(next(self._text), self._layout)
            for r in range(self._batch)]
    self._stream.add([r for r in rows if r["text_row"]])
    self._step, self._acc = self._step + 1, acc
    return self._to_model(_stack(rows))

  @property
  def text_stream(self) -> dict[str, Any]:
    """{"text_tokens": target tokens of the text rows so far, "text_hash": sha256 chain over their inputs}."""
    return self._stream.state()

  def get_state(self) -> dict[str, Any]:
    return {"step": self._step, "acc": self._acc, "text": self._text.get_state(), "mm": self._mm.get_state(),
            **self._stream.state()}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._text.set_state(state["text"])
    self._mm.set_state(state["mm"])
    self._step, self._acc = int(state["step"]), float(state["acc"])
    self._stream.restore(state)


class _RowMixIterDataset(grain.IterDataset):
  """Batches of `batch` rows: in step s, `vision_weight(s)` of them from `mm_rows`, the rest from `text_rows`."""

  def __init__(self, text_rows: grain.IterDataset, mm_rows: grain.IterDataset, batch: int,
               weight: float | Callable[[int], float], layout: _Layout):
    super().__init__([text_rows, mm_rows])
    self._text_rows, self._mm_rows = text_rows, mm_rows
    self._batch, self._weight, self._layout = batch, weight, layout

  def __iter__(self) -> _RowMixIterator:
    return _RowMixIterator(self._text_rows.__iter__(), self._mm_rows.__iter__(), self._batch, self._weight,
                           self._layout)

  def __str__(self) -> str:
    return f"_RowMixIterDataset(batch={self._batch}, vision_weight={self._weight!r})"


class _ExtraRowsIterator(grain.DatasetIterator):
  """Each batch: `text_batch` text rows (in stream order), then `vision_rows` multimodal rows from step
  `start` on (padding rows before it; the multimodal stream is not read until then)."""

  def __init__(self, text_it, mm_it, text_batch: int, vision_rows: int, start: int, layout: _Layout):
    super().__init__([text_it, mm_it])
    self._text, self._mm = text_it, mm_it
    self._text_batch, self._vision_rows, self._start, self._layout = text_batch, vision_rows, start, layout
    self._to_model = _ToModelBatch(layout.spec)
    self._step = 0
    self._stream = _TextStream()
    self._padding = _padding_row(layout)

  def __next__(self) -> dict[str, np.ndarray]:
    text = [_text_row_as_mm(next(self._text), self._layout) for _ in range(self._text_batch)]
    if self._step >= self._start:
      extra = [_mm_row(next(self._mm)) for _ in range(self._vision_rows)]
    else:
      extra = [self._padding] * self._vision_rows
    self._stream.add(text)
    self._step += 1
    return self._to_model(_stack(text + extra))

  @property
  def text_stream(self) -> dict[str, Any]:
    """{"text_tokens": target tokens of the text rows so far, "text_hash": sha256 chain over their inputs}."""
    return self._stream.state()

  def get_state(self) -> dict[str, Any]:
    return {"step": self._step, "text": self._text.get_state(), "mm": self._mm.get_state(), **self._stream.state()}

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._text.set_state(state["text"])
    self._mm.set_state(state["mm"])
    self._step = int(state["step"])
    self._stream.restore(state)


class _ExtraRowsIterDataset(grain.IterDataset):
  """Batches of `text_batch` text rows + `vision_rows` multimodal rows (padding before step `start`)."""

  def __init__(self, text_rows: grain.IterDataset, mm_rows: grain.IterDataset, text_batch: int, vision_rows: int,
               start: int, layout: _Layout):
    super().__init__([text_rows, mm_rows])
    self._text_rows, self._mm_rows = text_rows, mm_rows
    self._args = (text_batch, vision_rows, start, layout)

  def __iter__(self) -> _ExtraRowsIterator:
    return _ExtraRowsIterator(self._text_rows.__iter__(), self._mm_rows.__iter__(), *self._args)

  def __str__(self) -> str:
    return f"_ExtraRowsIterDataset(text rows={self._args[0]}, vision rows={self._args[1]}, from step {self._args[2]})"


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def _resolve_mm_weights(data_dir: str, spec: VisionSpec, mm_sources: Mapping[str, float] | None) -> dict[str, float]:
  available = list_mm_sources(data_dir, spec)
  vm = load_vision_manifest(data_dir)
  if mm_sources is None:
    weights = {s: DEFAULT_MM_WEIGHTS.get(s, 1.0) for s in available}
    if not weights:
      raise ValueError(f"no multimodal source of {data_dir} fits spec {spec} (prepared: {sorted(vm.sources)}, "
                       f"skipped: {vm.skipped})")
    return weights
  if isinstance(mm_sources, (str, Sequence)):
    raise TypeError(f"mm_sources must be a mapping {{source: weight}}, got {mm_sources!r}")
  bad = [s for s in mm_sources if s not in available]
  if bad:
    why = {s: vm.skipped[s] for s in bad if s in vm.skipped}
    eval_only = [s for s in bad if s in EVAL_ONLY_SOURCES]
    raise ValueError(f"mm_sources: {bad} not available for training with spec (images per row "
                     f"{spec.max_images_per_row}, videos per row {spec.max_videos_per_row}); available: {available}"
                     + (f"; skipped when prepared: {why}" if why else "")
                     + (f"; {eval_only} are evaluation only" if eval_only else ""))
  weights = {s: float(w) for s, w in mm_sources.items() if float(w) > 0}
  if not weights or any(not float(w) >= 0 for w in mm_sources.values()):
    raise ValueError(f"mm_sources={dict(mm_sources)}: weights must be >= 0 with at least one > 0")
  return weights


def _mm_examples(data_dir: str, layout: _Layout, *, seed: int, weights: Mapping[str, float],
                 caption_first_prob: float, motion: MotionConfig, sprite_sources: Sequence[str],
                 text_in_mm_rows: float, text_sources: Sequence[str] | None) -> grain.MapDataset:
  """The infinite, mixed MapDataset of multimodal train examples (before per-process slicing)."""
  captioner = _Captioner(load_manifest(data_dir).tokenizer_path)
  parts, shares = [], []
  for i, (name, w) in enumerate(sorted(weights.items())):
    part_seed = seed32(seed, 7, i)
    if name == SYNTHETIC_VIDEO:
      pool = _SpritePool(data_dir, sprite_sources, "train")
      fn = _VideoExample(layout, captioner, pool, motion, part_seed, caption_first_prob)
      ds = grain.MapDataset.range(1 << 40).map(fn)
    else:
      items = _ImageItems(data_dir, name, "train")
      if len(items) == 0:
        raise ValueError(f"image source {name!r} has no train items in {data_dir}")
      fn = _ImageExample(layout, captioner, name, caption_first_prob)
      ds = grain.MapDataset.source(items).seed(part_seed).shuffle().repeat().random_map(fn, seed=part_seed)
    parts.append(ds)
    shares.append(w)
  if text_in_mm_rows > 0:
    # Text pieces from a stream seeded apart from the main text rows, so the main text stream is untouched.
    pieces = train_pieces(data_dir, seq_len=layout.seq_len, seed=seed32(seed, 11),
                                    sources=text_sources)
    parts.append(pieces.map(_TextPiece(layout)))
    total = sum(shares)
    shares = [s * (1 - text_in_mm_rows) / total for s in shares] + [text_in_mm_rows]
  return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, shares)


def _check_train_args(seq_len: int, global_batch_size: int, process_index: int, process_count: int,
                      vision_weight: float | Callable[[int], float] | None, vision_rows: int, vision_start_step: int,
                      text_in_mm_rows: float, caption_first_prob: float) -> float | Callable[[int], float]:
  """Checks the arguments of `make_mm_train_dataset`; returns vision_weight with its default filled in."""
  check_seq_len(seq_len)
  if not (isinstance(global_batch_size, (int, np.integer)) and global_batch_size >= 1):
    raise ValueError(f"global_batch_size={global_batch_size!r}: expected an int >= 1")
  if not (isinstance(process_count, (int, np.integer)) and process_count >= 1) or global_batch_size % process_count:
    raise ValueError(f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index!r}: expected 0 <= process_index < process_count={process_count}")
  if not (isinstance(vision_rows, (int, np.integer)) and vision_rows >= 0) or vision_rows % process_count:
    raise ValueError(f"vision_rows={vision_rows!r}: expected an int >= 0 divisible by process_count={process_count} "
                     "(each process appends the same number of multimodal rows)")
  if not (isinstance(vision_start_step, (int, np.integer)) and vision_start_step >= 0):
    raise ValueError(f"vision_start_step={vision_start_step!r}: expected an int >= 0")
  if vision_weight is None:
    vision_weight = 0.0 if vision_rows else 0.5
  if vision_rows and (callable(vision_weight) or float(vision_weight) != 0.0):
    raise ValueError(f"vision_rows={vision_rows} appends multimodal rows to the text rows, vision_weight="
                     f"{vision_weight!r} replaces text rows by multimodal ones: the modes are exclusive, pass "
                     "vision_weight=0 (or None) with vision_rows > 0")
  if vision_start_step and not vision_rows:
    raise ValueError(f"vision_start_step={vision_start_step} needs vision_rows > 0 (with vision_weight, pass a "
                     "function of the step instead)")
  if not callable(vision_weight) and not 0.0 <= float(vision_weight) <= 1.0:
    raise ValueError(f"vision_weight={vision_weight!r}: expected a fraction of rows in [0, 1] or a function of "
                     "the step returning one")
  if not 0.0 <= text_in_mm_rows < 1.0:
    raise ValueError(f"text_in_mm_rows={text_in_mm_rows}: expected a share in [0, 1)")
  if not 0.0 <= caption_first_prob <= 1.0:
    raise ValueError(f"caption_first_prob={caption_first_prob}: expected a probability")
  return vision_weight


def make_mm_train_dataset(data_dir: str, *, spec: VisionSpec, seq_len: int, global_batch_size: int, seed: int,
                          vision_weight: float | Callable[[int], float] | None = None, vision_rows: int = 0,
                          vision_start_step: int = 0, mm_sources: Mapping[str, float] | None = None,
                          text_sources: Sequence[str] | None = None,
                          text_source_weights: Mapping[str, float] | None = None, text_in_mm_rows: float = 0.0,
                          caption_first_prob: float = 0.25, motion: MotionConfig = MotionConfig(),
                          sprite_sources: Sequence[str] = DEFAULT_SPRITE_SOURCES, process_index: int = 0,
                          process_count: int = 1, num_packing_bins: int | None = None, shuffle_bins: bool = True,
                          num_workers: int = 0) -> grain.IterDataset:
  """Infinite multimodal training batches (see the module docstring for the layout and the mixing).

  Args:
    data_dir: a directory prepared by `m3_jax.data.prepare` (text, tokenizer) and `prepare_vision`.
    spec: the static visual shapes; see VisionSpec.
    seq_len, global_batch_size, seed, process_index, process_count, num_packing_bins, shuffle_bins, text_sources,
      text_source_weights: as in `text_pipeline.make_train_dataset`; the text rows are that pipeline's rows for the
      same arguments (text_sources/text_source_weights are its sources/source_weights).
    vision_weight: fraction of each batch's rows that are multimodal, in [0, 1]; a float, or a function of the
      step (the number of batches this iterator has produced, restored from its state) for schedules. Default
      (None): 0.5, or 0 with vision_rows > 0 (the two modes are exclusive).
    vision_rows: > 0 appends this many multimodal rows (over all processes; a multiple of process_count) to the
      global_batch_size text rows of every batch: vision is extra, the text rows are all of make_train_dataset's.
    vision_start_step: with vision_rows > 0, the first step (batches produced so far) whose appended rows are
      multimodal; before it they are padding rows.
    mm_sources: {source: weight}, element shares of the multimodal examples; sources from `list_mm_sources`
      (image sources and "synthetic_video"). Default: DEFAULT_MM_WEIGHTS over what is prepared and fits `spec`.
    text_in_mm_rows: element share of plain text pieces packed into the multimodal rows (from a separately seeded
      text stream, so the main text rows are unchanged); 0 packs multimodal rows with visual examples only.
    caption_first_prob: probability that a caption precedes its image/video instead of following it.
    motion: how synthetic clips move (MotionConfig); sprite_sources: image sources their objects come from.
    num_workers: > 0 builds the multimodal rows in that many worker processes (`mp_prefetch`); deterministic,
      but resume with the same value.

  Returns:
    A `grain.IterDataset`; `it = iter(ds)` yields batch dicts ([B, L] text keys, visual keys per VisionSpec,
    `text_row` bool [B]) with B = (global_batch_size + vision_rows) // process_count; `it.get_state()` /
    `it.set_state(state)` resume exactly; `it.text_stream` is {"text_tokens", "text_hash"} so far.
  """
  vision_weight = _check_train_args(seq_len, global_batch_size, process_index, process_count, vision_weight,
                                    vision_rows, vision_start_step, text_in_mm_rows, caption_first_prob)
  layout = _Layout(spec, int(seq_len))
  weights = _resolve_mm_weights(data_dir, spec, mm_sources)
  _check_fits(layout, ["video" if s == SYNTHETIC_VIDEO else "image" for s in weights])
  if SYNTHETIC_VIDEO in weights:
    motion.validate(spec.height, spec.width, spec.num_frames)
  local = global_batch_size // process_count
  bins = local if num_packing_bins is None else int(num_packing_bins)
  if bins < 1:
    raise ValueError(f"num_packing_bins={num_packing_bins!r}: expected >= 1")
  read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=max(16, 4 * local))

  # Text rows: the rows of text_pipeline.make_train_dataset (same pieces, seeds and packing), unbatched.
  text = train_pieces(data_dir, seq_len=seq_len, seed=seed, sources=text_sources, source_weights=text_source_weights,
                      process_index=process_index, process_count=process_count)
  text_rows = pack_pieces(text.to_iter_dataset(read), seq_len, bins, seed32(seed, process_index, 1), shuffle_bins)

  mm = _mm_examples(data_dir, layout, seed=seed, weights=weights, caption_first_prob=caption_first_prob,
                    motion=motion, sprite_sources=sprite_sources, text_in_mm_rows=text_in_mm_rows,
                    text_sources=text_sources)
  mm = mm[process_index::process_count]
  mm_rows = _pack_mm(mm.to_iter_dataset(read), layout, bins, seed32(seed, process_index, 2), shuffle_bins)
  if num_workers:
    mm_rows = mp_prefetch(mm_rows, num_workers)
  if vision_rows:
    return _ExtraRowsIterDataset(text_rows, mm_rows, local, vision_rows // process_count, int(vision_start_step),
                                 layout)
  return _RowMixIterDataset(text_rows, mm_rows, local, vision_weight, layout)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


class _ClipWindow:
  """grain map: (clip, start) of the real clips -> an element with the window's frames and the clip's caption."""

  def __init__(self, layout: _Layout, captioner: _Captioner, data_dir: str):
    self.layout, self.captioner, self.data_dir = layout, captioner, data_dir
    self._clips: ClipSet | None = None

  def __call__(self, window: tuple[int, int]) -> dict[str, np.ndarray]:
    if self._clips is None:
      self._clips = load_vision_manifest(self.data_dir).clips()
    spec = self.layout.spec
    clip, start = window
    frames = self._clips.clip(clip)[start:start + spec.num_frames]
    pixels = _frames_to_pixels(frames, spec.height, spec.width)
    return _example(self.layout, "video", pixels, self.captioner.encode(self._clips.captions[clip]), False)

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_clips"] = None
    return d


def make_mm_eval_batches(data_dir: str, source: str, *, spec: VisionSpec, seq_len: int, batch_size: int,
                         max_batches: int | None = None, split: str = "heldout", num_clips: int = 256,
                         max_windows_per_clip: int = 8, seed: int = 0, motion: MotionConfig = MotionConfig(),
                         sprite_sources: Sequence[str] = DEFAULT_SPRITE_SOURCES) -> list[dict[str, np.ndarray]]:
  """A fixed, finite list of packed batches of one multimodal source (same list on every call).

  Sources: an image source of `list_mm_sources` (every item of `split`, template chosen by the item's index,
  caption after the image); "synthetic_video" (`num_clips` clips made from the `split` items of `sprite_sources`,
  clip i from (seed, i); batches also carry `direction_mask` and `object_mask` [B, L]: 1.0 where the target is
  a token of a direction word or of an object's name, the caption tokens that need the clip's temporal order);
  "real_clips" (non-overlapping windows of spec.num_frames frames, at most `max_windows_per_clip` per clip, with
  the clip's caption). Keys and shapes are those of the training batches (plus the two masks for synthetic
  video), so one jitted eval step serves all. The last batch is padded with empty rows (all-zero loss_mask, no
  valid items). Summing loss x loss_mask over all batches / sum(loss_mask) is the source's caption loss.
  """
  check_seq_len(seq_len)
  if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
    raise ValueError(f"batch_size={batch_size!r}: expected an int >= 1")
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches={max_batches!r}: expected None or >= 1")
  vm = load_vision_manifest(data_dir)
  captioner = _Captioner(load_manifest(data_dir).tokenizer_path)
  known = list_mm_sources(data_dir) + [s for s in EVAL_ONLY_SOURCES if s in vm.sources]
  if source not in known:
    why = f" (skipped when prepared: {vm.skipped[source]})" if source in vm.skipped else ""
    raise ValueError(f"source {source!r} is not an eval source of {data_dir}; available: {known}{why}")
  layout = _Layout(spec, int(seq_len), temporal_masks=(source == SYNTHETIC_VIDEO))
  _check_fits(layout, ["video" if source in (SYNTHETIC_VIDEO,) + EVAL_ONLY_SOURCES else "image"])
  if source == SYNTHETIC_VIDEO:
    if not spec.max_videos_per_row:
      raise ValueError(f"source {source!r} needs videos but spec has max_videos_per_row=0")
    motion.validate(spec.height, spec.width, spec.num_frames)
    pool = _SpritePool(data_dir, sprite_sources, split)
    fn = _VideoExample(layout, captioner, pool, motion, seed32(seed, 13), 0.0, fixed=True)
    ds = grain.MapDataset.range(int(num_clips)).map(fn)
  elif source in EVAL_ONLY_SOURCES:
    if not spec.max_videos_per_row:
      raise ValueError(f"source {source!r} needs videos but spec has max_videos_per_row=0")
    clips = vm.clips(source)
    windows = [(c, k * spec.num_frames) for c in range(len(clips))
               for k in range(min(max_windows_per_clip, len(clips.clip(c)) // spec.num_frames))]
    if not windows:
      raise ValueError(f"no real clip has {spec.num_frames} frames (lengths {np.diff(clips.offsets).tolist()})")
    ds = grain.MapDataset.source(windows).map(_ClipWindow(layout, captioner, data_dir))
  else:
    if not spec.max_images_per_row:
      raise ValueError(f"source {source!r} needs images but spec has max_images_per_row=0")
    ds = grain.MapDataset.source(_ImageItems(data_dir, source, split)).map(
        _ImageExample(layout, captioner, source, 0.0, fixed=True))
  rows = _pack_mm(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=16)), layout,
                  batch_size, 0, shuffle_bins=False)
  to_model = _ToModelBatch(spec)
  out, cur = [], []
  for row in rows:
    cur.append(row)
    if len(cur) == batch_size:
      out.append(to_model(_stack(cur)))
      cur = []
      if max_batches is not None and len(out) >= max_batches:
        return out
  if cur:
    empty = {k: np.zeros_like(v) for k, v in cur[0].items()}
    out.append(to_model(_stack(cur + [empty] * (batch_size - len(cur)))))
  return out
