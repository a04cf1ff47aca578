"""R data files without R: the character vectors (and numbers) saved in `.rda`/`.RData`, `.rds` and installed
packages' lazy-load databases (`data/Rdata.rdx` + `Rdata.rdb`), decoded from R's XDR serialization (formats 2 and
3, as R's serialize.c writes them). The text corpus reads Jane Austen's novels from r-cran-janeaustenr with it.

    read_rdata("janeaustenr/data/Rdata.rdx")   # {"emma": ["EMMA", "", "By Jane Austen", ...], ...}
"""
from __future__ import annotations

import bz2
import dataclasses
import gzip
import lzma
import os
import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["RDataError", "read_rdata"]


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
