"""Minimal safetensors reader/writer on numpy memory maps: tensors are read one at a time, never the whole file.

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, raw bytes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """Lazy view of one .safetensors file: `names`, `shape(name)`, `get(name)` (a numpy array)."""

  def __init__(self, path: str):
    self.path = path
    size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise ValueError(f"{path}: {size} bytes, too short for a safetensors file (truncated?)")
      (n,) = struct.unpack("<Q", head)
      if 8 + n > size:
        raise ValueError(f"{path}: its header claims {n:,} bytes but the file has {size:,} (truncated, or not a "
                         "safetensors file)")
      try:
        header = json.loads(f.read(n))
      except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"{path}: the safetensors header is not valid JSON ({e}); the file is damaged") from None
    if not isinstance(header, dict):
      raise ValueError(f"{path}: the safetensors header is not a JSON object; the file is damaged")
    self.metadata = header.pop("__metadata__", {})
    self.header = header
    self._base = 8 + n
    self._mm = None

  @property
  def names(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def dtype(self, name: str) -> str:
    return self.header[name]["dtype"]

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in _DTYPES:
      raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    if self._mm is None:
      self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
    if self._base + end > len(self._mm):
      raise ValueError(f"{self.path}: tensor {name} ends at byte {self._base + end} but the file has {len(self._mm)} "
                       "bytes (truncated, or a shape-only checkpoint written by write_header)")
    raw = self._mm[self._base + start:self._base + end]
    return np.frombuffer(raw, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])


class Checkpoint:
  """A single `model.safetensors` or a sharded set indexed by `model.safetensors.index.json`."""

  def __init__(self, directory: str):
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        try:
          weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError(f"{index}: not a safetensors index (JSON with a weight_map): {e!r}") from None
      files = {fn: SafetensorsFile(os.path.join(directory, fn)) for fn in sorted(set(weight_map.values()))}
      self._where = {name: files[fn] for name, fn in weight_map.items()}
    elif os.path.exists(single):
      f = SafetensorsFile(single)
      self._where = {name: f for name in f.names}
    else:
      raise FileNotFoundError(f"{directory}: neither model.safetensors nor model.safetensors.index.json")

  @property
  def names(self) -> list[str]:
    return list(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._where[name].shape(name)

  def dtype(self, name: str) -> str:
    return self._where[name].dtype(name)

  def get(self, name: str) -> np.ndarray:
    return self._where[name].get(name)


def _header(specs: list[tuple[str, str, tuple[int, ...], int]], metadata) -> bytes:
  """specs: (name, safetensors dtype, shape, nbytes) in file order."""
  header, offset = {}, 0
  for name, dt, shape, nbytes in specs:
    header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
  return struct.pack("<Q", len(blob)) + blob


def write_header(path: str, specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None) -> None:
  """A shape-only safetensors file: the header of `specs` {name: (dtype, shape)} without the data section. Readers
  see every name, dtype and shape; `get` raises. Used to plan loading a checkpoint that is not on this machine."""
  rows = []
  for name, (dt, shape) in specs.items():
    dt = np.dtype(dt)
    if dt not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {dt} cannot be written to safetensors")
    rows.append((name, _NAMES[dt], tuple(shape), int(np.prod(shape, dtype=np.int64)) * dt.itemsize))
  with open(path, "wb") as f:
    f.write(_header(rows, metadata))


def write(path: str, tensors: Mapping[str, np.ndarray] | Iterator[tuple[str, np.ndarray]],
          metadata: Mapping[str, str] | None = None) -> None:
  items = [(name, np.asarray(arr)) for name, arr in (tensors.items() if isinstance(tensors, Mapping) else tensors)]
  for name, arr in items:
    if arr.dtype not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be written to safetensors")
  with open(path, "wb") as f:
    f.write(_header([(name, _NAMES[arr.dtype], arr.shape, arr.nbytes) for name, arr in items], metadata))
    for _, arr in items:
      f.write(np.ascontiguousarray(arr).tobytes())
