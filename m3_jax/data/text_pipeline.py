"""grain input pipelines over a prepared corpus (see `m3_jax.data.text_prepare`): packed LM batches for training
and a fixed, finite set of packed batches per source for held-out evaluation.

Every batch is a dict of numpy arrays (the keys are m3_jax.core.batch.TEXT_KEYS), all [B, seq_len]:

    inputs       int32    token ids fed to the model; 0 (<|pad|>) in padding
    targets      int32    the next token of the same document; 0 in padding
    segment_ids  int32    1, 2, 3, ... for the documents packed into a row (in row order), 0 = padding
    positions    int32    position inside its document piece, restarting at 0 for every segment
    loss_mask    float32  1.0 where `targets` is a real next token (== segment_ids > 0), else 0.0

Attention must stay inside a segment (`segment_ids[q] == segment_ids[k]`), causal in `positions`.

A document longer than seq_len + 1 tokens is cut into pieces of seq_len + 1 tokens that overlap by one token, so
each next-token pair of the document is a target exactly once per epoch (a piece of n tokens gives n - 1 targets).
Every document ends with <|endoftext|>, so predicting the end of a document is part of the loss.

Training pipeline (all of it grain, all of it deterministic for a seed and resumable from `get_state()`):

    pieces -> MapDataset.source -> seed -> shuffle -> repeat      (per source, then `MapDataset.mix` if weighted)
           -> [process_index::process_count] -> to_iter_dataset
           -> FirstFitPackIterDataset -> batch(global_batch_size // process_count) [-> mp_prefetch]

Saving the iterator with orbax: `ocp.args.Composite(..., data=grain.checkpoint.CheckpointSave(it))` and
`data=grain.checkpoint.CheckpointRestore(it)` (grain 0.2.18 registers both with orbax's handler registry).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import grain
import numpy as np

from m3_jax.data import long_tasks
from m3_jax.data.common import check_seq_len, memmap, mp_prefetch, seed32
from m3_jax.data.text_prepare import Manifest, load_manifest

__all__ = ["list_sources", "make_train_dataset", "make_eval_batches", "pack_pieces", "train_pieces"]


def list_sources(data_dir: str) -> list[str]:
  """Names of the sources prepared in `data_dir` (those that were skipped at build time are absent)."""
  return load_manifest(data_dir).source_names


# ---------------------------------------------------------------------------------------------------------------
# Document pieces
# ---------------------------------------------------------------------------------------------------------------


def _piece_bounds(offsets: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Start/end token offsets (int64 [P] each) of the pieces of every document, in document order.

  Pieces hold at most seq_len + 1 tokens and consecutive pieces of a document share one token; documents of a
  single token (no next-token pair) give no piece.
  """
  starts_doc, ends_doc = offsets[:-1], offsets[1:]
  pairs = np.maximum(ends_doc - starts_doc - 1, 0)  # next-token pairs per document
  n_pieces = -(-pairs // seq_len)  # ceil
  doc_of_piece = np.repeat(np.arange(len(pairs)), n_pieces)
  first_piece = np.cumsum(n_pieces) - n_pieces
  k = np.arange(len(doc_of_piece)) - first_piece[doc_of_piece]  # piece number inside its document
  starts = starts_doc[doc_of_piece] + k * seq_len
  ends = np.minimum(starts + seq_len + 1, ends_doc[doc_of_piece])
  return starts.astype(np.int64), ends.astype(np.int64)


class _Pieces(Sequence):
  """Random-access source of document pieces of one split of some sources, for `grain.MapDataset.source`.

  Element i is {"inputs": int32 [n-1], "targets": int32 [n-1]} for the piece's n tokens. Holds only paths and
  small index arrays, so it pickles cheaply into `mp_prefetch` workers; the token files are mapped lazily.
  """

  def __init__(self, manifest: Manifest, sources: Sequence[str], split: str, seq_len: int):
    self._paths = [os.path.join(manifest.data_dir, manifest.split(s, split).bin) for s in sources]
    self._dtype = np.dtype(manifest.token_dtype)
    src, starts, ends = [], [], []
    for i, s in enumerate(sources):
      a, b = _piece_bounds(manifest.doc_offsets(s, split), seq_len)
      src.append(np.full(a.shape, i, np.int32))
      starts.append(a)
      ends.append(b)
    self._src = np.concatenate(src) if src else np.zeros((0,), np.int32)
    self._starts = np.concatenate(starts) if starts else np.zeros((0,), np.int64)
    self._ends = np.concatenate(ends) if ends else np.zeros((0,), np.int64)
    self._tokens: list[np.ndarray] | None = None

  def __len__(self) -> int:
    return int(self._starts.size)

  @property
  def num_targets(self) -> int:
    return int((self._ends - self._starts - 1).sum())

  def __getitem__(self, i):
    if self._tokens is None:
      self._tokens = [memmap(p, self._dtype) for p in self._paths]
    i = int(i)
    piece = np.asarray(self._tokens[self._src[i]][self._starts[i]:self._ends[i]], dtype=np.int32)
    return {"inputs": piece[:-1], "targets": piece[1:]}

  def __getstate__(self):
    d = dict(self.__dict__)
    d["_tokens"] = None  # memmaps are reopened in the worker rather than pickled as arrays
    return d

  def __repr__(self) -> str:
    return f"_Pieces(n={len(self)}, files={[os.path.basename(p) for p in self._paths]})"


def _finalize(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  seg = row["inputs_segment_ids"].astype(np.int32)
  return {
      "inputs": row["inputs"].astype(np.int32),
      "targets": row["targets"].astype(np.int32),
      "segment_ids": seg,
      "positions": row["inputs_positions"].astype(np.int32),
      "loss_mask": (seg > 0).astype(np.float32),
  }


def pack_pieces(ds: grain.IterDataset, seq_len: int, num_bins: int, seed: int,
                shuffle_bins: bool) -> grain.IterDataset:
  """Document pieces ({"inputs", "targets"} of up to seq_len tokens each) -> rows of the batch contract, packed
  first-fit into `num_bins` rows at a time (see the module docstring for the row layout)."""
  packed = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=num_bins, seed=seed,
      shuffle_bins=shuffle_bins)
  return packed.map(_finalize)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------


def _resolve_sources(manifest: Manifest, sources: Sequence[str] | None, arg: str = "sources") -> list[str]:
  if isinstance(sources, str):
    sources = [sources]
  names = list(manifest.source_names if sources is None else sources)
  unknown = [s for s in names if s not in manifest.sources]
  if unknown:
    skipped = [s for s in unknown if s in manifest.skipped]
    msg = f"{arg}: unknown source(s) {unknown}; {manifest.data_dir} has {manifest.source_names}"
    if skipped:
      msg += f" ({skipped} were skipped when it was prepared: {[manifest.skipped[s] for s in skipped]})"
    raise ValueError(msg)
  if not names:
    raise ValueError(f"{arg}: no sources selected")
  return names


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def train_pieces(data_dir: str, *, seq_len: int, seed: int, sources: Sequence[str] | None = None,
                 source_weights: Mapping[str, float] | None = None, process_index: int = 0,
                 process_count: int = 1) -> grain.MapDataset:
  """The infinite, shuffled, per-process MapDataset of train pieces (the pipeline up to packing); each element is
  {"inputs": int32 [n - 1], "targets": int32 [n - 1]} for a piece of n <= seq_len + 1 tokens."""
  check_seq_len(seq_len)
  if not (isinstance(process_count, (int, np.integer)) and process_count >= 1):
    raise ValueError(f"process_count={process_count!r}: expected an int >= 1")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index!r}: expected 0 <= process_index < process_count={process_count}")
  manifest = load_manifest(data_dir)
  if source_weights is not None:
    if sources is None:
      sources = list(source_weights)
    names = _resolve_sources(manifest, sources)
    missing = [s for s in names if s not in source_weights]
    extra = [s for s in source_weights if s not in names]
    if missing or extra:
      raise ValueError(f"source_weights keys {sorted(source_weights)} must match sources {names}")
    bad = {s: w for s, w in source_weights.items() if not (float(w) >= 0)}
    if bad or not any(float(w) > 0 for w in source_weights.values()):
      raise ValueError(f"source_weights={dict(source_weights)}: weights must be >= 0 with at least one > 0")
  else:
    names = _resolve_sources(manifest, sources)

  if source_weights is None:
    # One pool of all pieces, shuffled: every epoch sees every train token once, i.e. sources mix by token count.
    pieces = _Pieces(manifest, names, "train", seq_len)
    if len(pieces) == 0:
      raise ValueError(f"sources {names} have no train tokens in {data_dir}")
    ds = grain.MapDataset.source(pieces).seed(seed).shuffle().repeat()
  else:
    parts, weights = [], []
    for i, s in enumerate(names):
      w = float(source_weights[s])
      if w == 0:
        continue
      pieces = _Pieces(manifest, [s], "train", seq_len)
      if len(pieces) == 0:
        raise ValueError(f"source {s!r} has no train tokens but weight {w}")
      parts.append(grain.MapDataset.source(pieces).seed(seed32(seed, i)).shuffle().repeat())
      # mix() draws elements; dividing by the mean piece length turns a token share into an element share.
      weights.append(w / (pieces.num_targets / len(pieces)))
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  return ds[process_index::process_count]


def make_train_dataset(data_dir: str, *, seq_len: int, global_batch_size: int, seed: int,
                       sources: Sequence[str] | None = None, source_weights: Mapping[str, float] | None = None,
                       process_index: int = 0, process_count: int = 1, num_packing_bins: int | None = None,
                       shuffle_bins: bool = True, num_workers: int = 0, read_threads: int = 0,
                       task_share: float = 0.0, tasks: Sequence[str] | str = "", task_questions: int = 1,
                       task_text_loss: bool = False, task_placement: str = "end",
                       task_lengths: Sequence[int] = ()) -> grain.IterDataset:
  """Infinite packed LM batches of this process's share of the train split; see the module docstring.

  Args:
    data_dir: a directory built by `m3_jax.data.prepare`.
    seq_len: row length (>= 2).
    global_batch_size: rows per step over all processes; each process yields global_batch_size // process_count.
    seed: fixes the shuffle, the mixing order and the packing; the same seed gives the same batches.
    sources: subset of `list_sources(data_dir)` (default all).
    source_weights: {source: weight}; each source's share of target tokens is weight / sum(weights). Default:
      proportional to each source's train token count (one shuffled pool; every epoch covers each token once).
    process_index, process_count: this host's slice; processes see disjoint pieces that together cover the data.
    num_packing_bins: rows packed at once (default: the local batch size); more bins, less padding.
    shuffle_bins: shuffle rows within each packed group so long and short rows do not alternate predictably.
    num_workers: > 0 runs the pipeline in that many worker processes (`mp_prefetch`); the stream is still
      deterministic but depends on num_workers, so resume with the same value.
    read_threads: grain read threads before packing; 0 reads inline (the token files are memory-mapped).
    task_share: > 0 replaces that share of the rows (drawn per row) by synthetic long-context task rows
      (`m3_jax.data.long_tasks`: haystack from the train split, loss on the answer only), each a full row.
    tasks: the task names for those rows ("" or "all": every task).
    task_questions, task_text_loss, task_placement, task_lengths: questions per task example, loss on its
      haystack text, where its questions go, example lengths packed into a row (long_tasks.TaskRows).

  Returns:
    A `grain.IterDataset`; `it = iter(ds)` yields batch dicts of [global_batch_size // process_count, seq_len]
    arrays, and `it.get_state()` / `it.set_state(state)` resume exactly.
  """
  if not (isinstance(global_batch_size, (int, np.integer)) and global_batch_size >= 1):
    raise ValueError(f"global_batch_size={global_batch_size!r}: expected an int >= 1")
  if isinstance(process_count, (int, np.integer)) and process_count >= 1 and global_batch_size % process_count:
    raise ValueError(f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}")
  ds = train_pieces(data_dir, seq_len=seq_len, seed=seed, sources=sources, source_weights=source_weights,
                    process_index=process_index, process_count=process_count)
  local = global_batch_size // process_count
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(16, 4 * local)))
  bins = local if num_packing_bins is None else int(num_packing_bins)
  if bins < 1:
    raise ValueError(f"num_packing_bins={num_packing_bins!r}: expected >= 1")
  out = pack_pieces(it_ds, seq_len, bins, seed32(seed, process_index, 1), shuffle_bins)
  if task_share:
    out = long_tasks.mix_task_rows(out, data_dir, share=float(task_share), tasks=long_tasks.parse_tasks(tasks),
                                   seq_len=seq_len, seed=seed32(seed, 2),
                                   process_index=process_index, process_count=process_count,
                                   questions=int(task_questions), text_loss=bool(task_text_loss),
                                   placement=str(task_placement), lengths=tuple(task_lengths))
  out = out.batch(local, drop_remainder=True)
  return mp_prefetch(out, num_workers) if num_workers else out


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def make_eval_batches(data_dir: str, source: str, *, seq_len: int, batch_size: int,
                      max_batches: int | None = None, split: str = "heldout") -> list[dict[str, np.ndarray]]:
  """All of one source's held-out documents as packed batches, in a fixed order (same for every call).

  Packing is the training packer without shuffling. Each held-out target token appears exactly once, so summing
  the per-token loss times `loss_mask` over all batches and dividing by the mask's sum gives the source's held-out
  loss (exp of it: perplexity). The last batch is padded with empty rows (all-zero mask) to [batch_size, seq_len]
  so that every batch has the same shape.

  Args:
    source: one of `list_sources(data_dir)`.
    max_batches: stop after this many batches (None: the whole split).
    split: "heldout" (default) or "train".
  """
  check_seq_len(seq_len)
  if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
    raise ValueError(f"batch_size={batch_size!r}: expected an int >= 1")
  if max_batches is not None and max_batches < 1:
    raise ValueError(f"max_batches={max_batches!r}: expected None or >= 1")
  manifest = load_manifest(data_dir)
  if not isinstance(source, str):
    raise TypeError(f"source must be one source name (str), got {source!r}")
  (name,) = _resolve_sources(manifest, [source], "source")
  pieces = _Pieces(manifest, [name], split, seq_len)
  if len(pieces) == 0:
    raise ValueError(f"source {name!r} has no {split} documents in {data_dir} "
                     f"(a source with a single document has no held-out split)")
  ds = grain.MapDataset.source(pieces).to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=16))
  rows = pack_pieces(ds, seq_len, batch_size, 0, shuffle_bins=False).batch(batch_size, drop_remainder=False)
  out = []
  for batch in rows:
    n = batch["inputs"].shape[0]
    if n < batch_size:
      batch = {k: np.concatenate([v, np.zeros((batch_size - n, seq_len), v.dtype)]) for k, v in batch.items()}
    out.append(batch)
    if max_batches is not None and len(out) >= max_batches:
      break
  return out
