r"""Long-context evaluation of a checkpoint: retrieval accuracy on synthetic tasks by length and needle depth, and
held-out loss by token position on long documents, both through the inference path (chunked prefill, then greedy
decoding with the KV caches and, in MSA layers, the index-key caches).

  python -m m3_jax.eval_long --checkpoint=workdirs/tiny_msa/export --tasks=passkey,kv --lengths=1024,4096 \
      --depths=0,0.25,0.5,0.75,1 --samples=4 --out=workdirs/tiny_msa/long_eval
  python -m m3_jax.eval_long --checkpoint=/path/to/hf_minimax_m3 --tokenizer=/path/to/tokenizer.json ...

--checkpoint is an export directory (`--mode=export`) or an HF MiniMax-M3 directory, as for m3_jax.generate.
The tokenizer is --tokenizer, else the checkpoint's tokenizer.json, else the corpus's (`DATA_DIR/tokenizer.json`).
Haystacks and long documents come from the held-out split of the prepared corpus --data_dir (`python -m
m3_jax.data DIR`), decoded and re-encoded by that tokenizer. Tasks, lengths and depths are those of
m3_jax.data.long_tasks; example (task, length, depth, sample) has seed (--seed, task, length, depth, sample), so
two checkpoints evaluated with the same flags see the same prompts.

An answer is right when the generated text, cut at <|endoftext|> or the first newline and stripped of spaces and a
final period, equals the answer exactly. Written to --out:

  results.json           flags, model, per task: accuracy and answer NLL (nats per answer token under teacher
                         forcing: a graded signal where exact match is 0 or 1) per (length, depth) cell and
                         overall, every example's answer, generation and answer log-prob; forward_check (the
                         first batch's last-position log-probs, cached path vs one full forward);
                         needle_selected (MSA checkpoints, --needle_selection): per example, cell and task, the
                         share of (MSA layer, KV group) pairs whose selection for the last prompt position (the
                         query whose output is the first answer token) holds the block of every token of the
                         answer needle's first sentence; per example also needle_selected_by_layer {layer: share
                         of groups}; None in cells and tasks of dense checkpoints; loss_by_position (below);
                         seconds
  heatmap_<task>.png     accuracy, lengths (rows) x depths (columns)
  loss_by_position.json  mean next-token loss of up to --loss_docs held-out documents of at least --loss_length + 1
                         tokens, per position bin (--loss_bins log-spaced bins), and the per-position curve
  loss_by_position.png   the same, loss against position
  progress.jsonl         while the retrieval tasks run: each scored example's row, a (length, task) at a time;
                         removed once results.json is written, so it remains only after a stopped evaluation
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from absl import app, flags, logging

_CKPT = flags.DEFINE_string("checkpoint", None, "export directory or HF checkpoint directory")
_TASKS = flags.DEFINE_string("tasks", "all", "comma-separated tasks of m3_jax.data.long_tasks.TASKS, or all")
_LENGTHS = flags.DEFINE_string("lengths", "1024,4096", "comma-separated prompt lengths in tokens")
_DEPTHS = flags.DEFINE_string("depths", "0,0.25,0.5,0.75,1", "comma-separated needle depths in [0, 1]")
_SAMPLES = flags.DEFINE_integer("samples", 4, "examples per (task, length, depth)")
_OUT = flags.DEFINE_string("out", None, "output directory")
_DATA = flags.DEFINE_string("data_dir", "data", "prepared corpus: haystack text and long held-out documents")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer.json (default: the checkpoint's, else the corpus's)")
_SEED = flags.DEFINE_integer("seed", 0, "seed of the examples")
_BATCH = flags.DEFINE_integer("batch_size", 8, "rows decoded together")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 512, "prefill chunk length in tokens")
_LOSS_LEN = flags.DEFINE_integer("loss_length", 0, "tokens per document for the loss by position (0: the longest "
                                 "of --lengths; -1: skip)")
_LOSS_DOCS = flags.DEFINE_integer("loss_docs", 8, "held-out documents for the loss by position")
_LOSS_BINS = flags.DEFINE_integer("loss_bins", 16, "log-spaced position bins of the loss")
_DTYPE = flags.DEFINE_string("dtype", None, "HF checkpoints: parameter + compute dtype (default: the stored one)")
_NEEDLE = flags.DEFINE_bool("needle_selection", True, "MSA checkpoints: whether each MSA layer's selection for the "
                            "last prompt position holds the answer needle's blocks (one more full forward a batch)")
PROGRESS = "progress.jsonl"

flags.mark_flag_as_required("checkpoint")
flags.mark_flag_as_required("out")


def _ints(flag: str, spec: str) -> list[int]:
  try:
    out = [int(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--{flag}={spec!r}: expected comma-separated integers") from None
  if not out or any(x < 1 for x in out):
    raise ValueError(f"--{flag}={spec!r}: expected one or more integers >= 1")
  return sorted(set(out))


def _floats(flag: str, spec: str) -> list[float]:
  try:
    out = [float(x) for x in spec.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--{flag}={spec!r}: expected comma-separated numbers") from None
  if not out or any(not 0.0 <= x <= 1.0 for x in out):
    raise ValueError(f"--{flag}={spec!r}: expected one or more depths in [0, 1]")
  return sorted(set(out))


def load_tokenizer(checkpoint: str, explicit: str, data_dir: str):
  """--tokenizer, else the checkpoint's tokenizer.json, else the corpus's."""
  from m3_jax import inference  # noqa: PLC0415
  paths = [explicit] if explicit else [os.path.join(checkpoint, "tokenizer.json"),
                                       os.path.join(data_dir, "tokenizer.json")]
  return inference.load_tokenizer(paths, checkpoint)


def check_args(*, checkpoint: str, tasks: str, lengths: str, depths: str, samples: int, out: str, data_dir: str,
               batch_size: int, prefill_chunk: int, tokenizer: Any = None) -> dict[str, Any]:
  """Every flag, checked before any model is loaded or compiled; returns the parsed values (ValueError naming the
  flag). With `tokenizer`, each length is also checked against each task's minimum."""
  from m3_jax.data import long_tasks  # noqa: PLC0415
  from m3_jax.data.text_prepare import MANIFEST  # noqa: PLC0415
  try:
    names = long_tasks.parse_tasks(tasks)
  except ValueError as e:
    raise ValueError(f"--tasks={tasks!r}: {e}") from None
  lens, deps = _ints("lengths", lengths), _floats("depths", depths)
  if samples < 1:
    raise ValueError(f"--samples={samples}: expected >= 1")
  if batch_size < 1 or prefill_chunk < 1:
    raise ValueError(f"--batch_size={batch_size} and --prefill_chunk={prefill_chunk} must be >= 1")
  if not out:
    raise ValueError("--out: an output directory is required")
  if not (os.path.isfile(os.path.join(checkpoint, "model_config.json"))
          or os.path.isfile(os.path.join(checkpoint, "config.json"))):
    raise ValueError(f"--checkpoint={checkpoint}: neither an export (model_config.json + params/) nor an HF "
                     "directory (config.json + safetensors)")
  if not os.path.isfile(os.path.join(data_dir, MANIFEST)):
    raise ValueError(f"--data_dir={data_dir}: not a prepared corpus (no {MANIFEST}); prepare it with "
                     f"`python -m m3_jax.data {data_dir}`")
  if tokenizer is not None:
    short = {t: long_tasks.min_length(t, tokenizer) for t in names}
    short = {t: m for t, m in short.items() if m > lens[0]}
    if short:
      raise ValueError(f"--lengths={lengths}: {lens[0]} is below the minimum of tasks {short} (their intro, "
                       "question and needles with this tokenizer, plus a haystack)")
  return {"tasks": names, "lengths": lens, "depths": deps}


# ---------------------------------------------------------------------------------------------------------------
# Retrieval tasks
# ---------------------------------------------------------------------------------------------------------------


def answer_of(generated: list[int], tokenizer: Any) -> str:
  """The answer text of generated ids: up to <|endoftext|> or the first newline, spaces and a final '.' off."""
  eot = getattr(tokenizer, "eot_id", None)
  if eot is not None and eot in generated:
    generated = generated[:generated.index(eot)]
  return tokenizer.decode(generated, skip_special=True).split("\n")[0].strip().rstrip(".").strip()


def make_examples(tasks: list[str], lengths: list[int], depths: list[float], samples: int, seed: int, haystack,
                  tokenizer) -> dict[tuple[str, int], list]:
  """{(task, length): [Example, ...]} over depths x samples, each seeded by its coordinates."""
  from m3_jax.data import long_tasks  # noqa: PLC0415
  from m3_jax.data.common import seed32  # noqa: PLC0415
  out = {}
  for task in tasks:
    for length in lengths:
      out[task, length] = [
          long_tasks.make_example(task, haystack=haystack, tokenizer=tokenizer, length=length, depth=d,
                                  seed=seed32(seed, long_tasks.TASKS.index(task), length, round(d * 10000), s))
          for d in depths for s in range(samples)]
  return out


def greedy_answers(model, step, prompts, *, max_new_tokens: int, max_len: int, prefill_chunk: int,
                   eos_id: int | None, answers=None):
  """prompts int32 [B, L] -> (greedy ids int [B, n <= max_new_tokens], answer log-probs or None, last-position
  logits f32 [B, V]): chunked prefill into fresh caches of `max_len`, then one token per step (the path
  m3_jax.generate streams). With `answers` (int32 [B, A] padded, and their lengths [B]) the answers are also scored
  by teacher forcing from the same prefilled caches: log p(answer | prompt) per row, f64 [B]."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from m3_jax.models import decode  # noqa: PLC0415
  caches = decode.init_caches(model, prompts.shape[0], max_len)
  logits, caches = decode.prefill(step, jnp.asarray(prompts, jnp.int32), caches, chunk=prefill_chunk)
  last = logits[:, -1]  # [B, V]
  logp = None
  if answers is not None:
    ids, lens = answers
    # The caches are values: scoring from them leaves them as they are for the greedy decoding below. One token
    # per step, as decoding does: the same compiled step, and no multi-token chunk shorter than a kernel block.
    scored, c = [last], caches
    for i in range(ids.shape[1] - 1):
      out, c = step(jnp.asarray(ids[:, i:i + 1], jnp.int32), c)
      scored.append(out[:, -1])
    lp = jax.nn.log_softmax(jnp.stack(scored, axis=1), axis=-1)  # [B, A, V]
    tok_lp = np.asarray(jnp.take_along_axis(lp, jnp.asarray(ids, jnp.int32)[..., None], axis=-1)[..., 0])
    logp = np.where(np.arange(ids.shape[1])[None] < lens[:, None], tok_lp, 0.0).astype(np.float64).sum(1)
  gen = decode.continue_decoding(step, last, caches, max_new_tokens=max_new_tokens, eos_id=eos_id)
  return np.asarray(gen), logp, np.asarray(last, np.float32)


def forward_check(model, prompts, cached_last) -> dict[str, Any]:
  """The cached path against one full forward (no caches, the training kernels) on the same prompts: the largest
  difference of the last position's log-probabilities and whether the greedy tokens agree."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  graphdef, state = nnx.split(model)

  @jax.jit
  def last_logits(state, ids):
    m = nnx.merge(graphdef, state)
    hidden, _ = m(ids, head=False)
    return m.head_logits(hidden[:, -1:])[:, 0]  # [B, V]: one position, not [B, L, V]

  full = np.asarray(last_logits(state, jnp.asarray(prompts, jnp.int32)), np.float32)
  lp_full = np.asarray(jax.nn.log_softmax(full, axis=-1))
  lp_cached = np.asarray(jax.nn.log_softmax(cached_last, axis=-1))
  return {"rows": int(prompts.shape[0]), "length": int(prompts.shape[1]),
          "max_abs_logprob_diff": float(np.abs(lp_full - lp_cached).max()),
          "argmax_agree": float(np.mean(full.argmax(-1) == cached_last.argmax(-1)))}


# ---------------------------------------------------------------------------------------------------------------
# Needle selection (MSA layers)
# ---------------------------------------------------------------------------------------------------------------


def msa_layers(cfg) -> list[int]:
  """The indices of the layers whose attention selects key blocks (MSAAttention or a subclass)."""
  from m3_jax.models.attention import attention_class  # noqa: PLC0415
  from m3_jax.models.attention.msa import MSAAttention  # noqa: PLC0415
  return [i for i, t in enumerate(cfg.layer_types) if issubclass(attention_class(t), MSAAttention)]


def needle_slots(example, tokenizer):
  """Prompt slots of the answer needle's first sentence, int32 [N]: from `needle_pos` (the needle at the requested
  depth, which holds the answer; the first of several for multi_value and vt) to the token that holds its '.'.

  Every task's needle states its value in that sentence ("... is 1234567.", "VAR ABCDE = 12345."); what may
  follow (passkey's " Remember it.") carries nothing to retrieve. The Example keeps only the needle's first slot,
  so its end is found by decoding."""
  import numpy as np  # noqa: PLC0415
  prompt, lo = example.prompt, int(example.needle_pos)
  if not 0 <= lo < len(prompt):
    raise ValueError(f"needle_slots: needle_pos={lo} outside the prompt of {len(prompt)} tokens")
  for hi in range(lo + 1, len(prompt) + 1):
    if "." in tokenizer.decode(prompt[lo:hi]):
      return np.arange(lo, hi, dtype=np.int32)
  raise ValueError(f"needle_slots: no '.' after needle_pos={lo} in the prompt of {example.task!r} (seed "
                   f"{example.seed}): not a needle of m3_jax.data.long_tasks")


def last_selection_fn(model, layers: list[int]):
  """prompts int [B, L] -> int32 [len(layers), B, Hkv, topk]: each listed MSA layer's selected blocks for the query
  at the last prompt position, from one jitted full forward.

  capture="selection" keeps every layer on its usual attention path (no [B, Hq, T, S] probabilities) and the
  slice happens inside the jit, so only topk ids per (layer, row, group) reach the host, not [B, Hkv, L, topk];
  the rows run one at a time (one compiled program of batch 1 per prompt length)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  graphdef, state = nnx.split(model)

  @jax.jit
  def last(state, ids):
    m = nnx.merge(graphdef, state)
    _, aux = m(ids, capture_attention="selection", head=False)  # head=False: no [B, L, V] logits
    return jnp.stack([aux["block_idx"][i][:, :, -1] for i in layers])  # [L_msa, B, Hkv, topk]

  # One row at a time: a whole batch's forward at a 64K prompt would hold every query's KV-outer partials
  # ([B, T, Hq, topk, D], ~17 GiB at B=8) and SwiGLU products at once, several times the cached path's memory.
  return lambda prompts: np.concatenate([np.asarray(last(state, jnp.asarray(prompts[i:i + 1], jnp.int32)))
                                         for i in range(len(prompts))], axis=1)


def needle_selected(selection, slots: list, layers: list[int], block_size: int):
  """selection int [len(layers), B, Hkv, topk] (`last_selection_fn`), slots: B int arrays of needle slots ->
  (f64 [B]: the share of (layer, group) pairs that selected the block of every needle token, {layer: f64 [B]
  share of groups})."""
  import numpy as np  # noqa: PLC0415
  from m3_jax.models.attention.msa_diagnostics import needle_block_selected  # noqa: PLC0415
  selection = np.asarray(selection)
  if selection.ndim != 4 or selection.shape[0] != len(layers) or selection.shape[1] != len(slots):
    raise ValueError(f"needle_selected: selection shape {selection.shape}, expected [layers={len(layers)}, "
                     f"B={len(slots)}, Hkv, topk]")
  if any(len(s) == 0 for s in slots):
    raise ValueError("needle_selected: every row needs at least one needle slot")
  n = max(len(s) for s in slots)
  # Rows pad with their own first slot: a repeated token changes no `.all`.
  needles = np.stack([np.concatenate([s, np.full(n - len(s), s[0])]) for s in slots]).astype(np.int32)  # [B, N]
  rows = np.zeros(len(slots), np.int32)  # the selection holds one query row: the last position's
  by_layer = {}
  for j, layer in enumerate(layers):
    hit = needle_block_selected(selection[j][:, :, None], needles, rows, block_size)  # [B, Hkv, N]
    by_layer[layer] = np.asarray(hit).all(-1).mean(-1).astype(np.float64)  # [B]
  return np.mean(list(by_layer.values()), axis=0), by_layer


def _mean_selected(rows: list[dict]) -> float | None:
  import numpy as np  # noqa: PLC0415
  vals = [r["needle_selected"] for r in rows if "needle_selected" in r]
  return float(np.mean(vals)) if vals else None


def run_tasks(model, step, tokenizer, examples: dict, *, batch_size: int, max_len: int, prefill_chunk: int,
              t0: float, check: bool = True, needle_selection: bool = True,
              progress: str | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """Scores every example (exact match of the greedy answer, and the answer's log-probability under teacher
  forcing); one progress line per (length, task). With `check`, the first batch is also run through a full
  forward (`forward_check`). With `needle_selection` and MSA layers in `model.cfg`, every batch also runs one
  full forward for the last position's selection (`needle_selected`). With `progress` (a path), each (length,
  task)'s example rows are appended to it as JSON lines ({"task", **row}) once scored: a long evaluation that is
  stopped keeps what it scored. Returns ({task: results}, the check or None)."""
  import numpy as np  # noqa: PLC0415
  results: dict[str, Any] = {}
  checked = None
  layers = msa_layers(model.cfg) if needle_selection else []
  last_selection = last_selection_fn(model, layers) if layers else None
  for (task, length), exs in sorted(examples.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    rows = results.setdefault(task, {"examples": []})["examples"]
    width = max(len(e.answer) for e in exs)  # one answer width per (task, length): one scoring shape
    for lo in range(0, len(exs), batch_size):
      part = exs[lo:lo + batch_size]
      padded = part + [part[-1]] * (batch_size - len(part))  # one batch shape: nothing compiles twice
      prompts = np.stack([e.prompt for e in padded])  # [B, length]
      answers = np.zeros((len(padded), width), np.int32)
      for i, e in enumerate(padded):
        answers[i, :len(e.answer)] = e.answer
      lens = np.asarray([len(e.answer) for e in padded])
      new = max(len(e.answer) for e in part) + 2  # room for a closing token and a stray one
      gen, logp, last = greedy_answers(model, step, prompts, max_new_tokens=new, max_len=max_len,
                                       prefill_chunk=prefill_chunk, eos_id=getattr(tokenizer, "eot_id", None),
                                       answers=(answers, lens))
      if check and checked is None:
        checked = {"task": task, **forward_check(model, prompts, last)}
        print(f"[eval_long] cached vs full forward ({task}, {length:,} tokens, {len(padded)} rows): max |d log p| "
              f"{checked['max_abs_logprob_diff']:.3g}, greedy tokens agree {checked['argmax_agree']:.0%}",
              flush=True)
      picked = None
      if last_selection is not None:
        try:
          picked = needle_selected(last_selection(prompts), [needle_slots(e, tokenizer) for e in padded], layers,
                                   model.cfg.index_block_size)
        except Exception as err:  # noqa: BLE001 - a diagnostic's failure (e.g. out of memory) must not lose the scores
          print(f"[eval_long] needle selection off from here ({task}, {length:,} tokens): {type(err).__name__}: "
                f"{str(err).splitlines()[0][:300]}", flush=True)
          last_selection = None
      for i, (e, g, lp) in enumerate(zip(part, gen, logp)):
        got = answer_of([int(x) for x in g], tokenizer)
        rows.append({"length": length, "depth": e.depth, "seed": e.seed, "answer": e.answer_text,
                     "generated": got, "exact": got == e.answer_text, "needle_pos": e.needle_pos,
                     "answer_logprob": float(lp), "answer_tokens": int(len(e.answer)),
                     "generated_ids": [int(x) for x in g]})
        if picked is not None:
          # str keys: the dict evaluate() returns then reads as results.json does
          rows[-1].update(needle_selected=float(picked[0][i]),
                          needle_selected_by_layer={str(k): float(v[i]) for k, v in picked[1].items()})
    mine = [r for r in rows if r["length"] == length]
    if progress:
      with open(progress, "a") as f:
        f.writelines(json.dumps({"task": task, **r}) + "\n" for r in mine)
    acc = np.mean([r["exact"] for r in mine])
    nll = np.mean([-r["answer_logprob"] / r["answer_tokens"] for r in mine])
    sel = _mean_selected(mine)
    sel_text = "" if sel is None else f", needle selected {sel:6.1%}"
    print(f"[eval_long] length {length:>7,} {task:12s} accuracy {acc:6.1%}, answer NLL {nll:5.2f} nats/token"
          f"{sel_text} ({len(exs)} examples)  {time.time() - t0:7.1f} s", flush=True)
  for task, r in results.items():
    cells = {}
    for row in r["examples"]:
      cells.setdefault((row["length"], row["depth"]), []).append(row)
    r["cells"] = [{"length": k[0], "depth": k[1], "accuracy": float(np.mean([x["exact"] for x in v])),
                   "answer_nll": float(np.mean([-x["answer_logprob"] / x["answer_tokens"] for x in v])),
                   "needle_selected": _mean_selected(v), "n": len(v)} for k, v in sorted(cells.items())]
    r["accuracy"] = float(np.mean([row["exact"] for row in r["examples"]]))
    r["answer_nll"] = float(np.mean([-x["answer_logprob"] / x["answer_tokens"] for x in r["examples"]]))
    r["needle_selected"] = _mean_selected(r["examples"])
  return results, checked


def plot_heatmap(path: str, task: str, cells: list[dict], lengths: list[int], depths: list[float]) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  acc = np.full((len(lengths), len(depths)), np.nan)
  for c in cells:
    acc[lengths.index(c["length"]), depths.index(c["depth"])] = c["accuracy"]
  fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(depths), 1.0 + 0.5 * len(lengths)))
  im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
  for i in range(len(lengths)):
    for j in range(len(depths)):
      ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", color="w" if acc[i, j] < 0.6 else "k",
              fontsize=8)
  ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
  ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
  ax.set_xlabel("needle depth")
  ax.set_ylabel("prompt length (tokens)")
  ax.set_title(f"{task}: exact-match accuracy")
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Loss by position
# ---------------------------------------------------------------------------------------------------------------


def long_documents(data_dir: str, tokenizer, length: int, max_docs: int):
  """Up to `max_docs` held-out documents of at least length + 1 tokens (re-encoded by `tokenizer`), longest first,
  each cut to length + 1: int32 [n, length + 1]; and how many held-out documents there were."""
  import numpy as np  # noqa: PLC0415
  from m3_jax.core.batch import EOT  # noqa: PLC0415
  from m3_jax.data.text_prepare import load_manifest, load_tokenizer as corpus_tokenizer  # noqa: PLC0415
  manifest, corpus_tok = load_manifest(data_dir), corpus_tokenizer(data_dir)
  texts = [corpus_tok.decode(d[d != EOT]) for s in manifest.source_names for d in manifest.documents(s, "heldout")]
  ids = sorted(tokenizer.encode_batch(texts, allow_special=False), key=len, reverse=True)
  docs = [d[:length + 1] for d in ids if len(d) >= length + 1][:max_docs]
  return (np.asarray(docs, np.int32).reshape(len(docs), length + 1)), len(texts)


def loss_by_position(step, model, docs, *, batch_size: int, max_len: int, prefill_chunk: int, bins: int):
  """Mean next-token loss per position over `docs` [n, L + 1] through chunked prefill: the curve [L] and its means
  over at most `bins` log-spaced position bins ([{start, end, loss}])."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from m3_jax.models import decode  # noqa: PLC0415

  @jax.jit
  def token_loss(logits, targets):  # [B, t, V], [B, t] -> [B, t]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

  n, length = docs.shape[0], docs.shape[1] - 1
  total = np.zeros((length,), np.float64)
  for lo in range(0, n, batch_size):
    part = docs[lo:lo + batch_size]
    rows = np.concatenate([part, np.repeat(part[-1:], batch_size - len(part), 0)])  # [B, L + 1]
    caches = decode.init_caches(model, batch_size, max_len)
    pieces = []
    for c in range(0, length, prefill_chunk):
      hi = min(c + prefill_chunk, length)
      logits, caches = step(jnp.asarray(rows[:, c:hi]), caches)
      pieces.append(np.asarray(token_loss(logits, jnp.asarray(rows[:, c + 1:hi + 1]))))
    total += np.concatenate(pieces, axis=1)[:len(part)].sum(0)
  curve = total / n
  # Log-spaced bins: the question is whether loss still falls between 1K and 32K, not within the first 100 tokens.
  edges = np.unique(np.concatenate([[0], np.round(np.geomspace(1, length, bins)).astype(int)]))
  table = [{"start": int(a), "end": int(b), "loss": float(curve[a:b].mean())} for a, b in zip(edges[:-1], edges[1:])
           if b > a]
  return curve, table


def plot_loss(path: str, curve, table: list[dict], title: str) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 3.5))
  pos = np.arange(1, len(curve) + 1)
  ax.plot(pos, curve, color="0.8", lw=0.6, label="per position")
  ax.plot([(b["start"] + b["end"]) / 2 + 1 for b in table], [b["loss"] for b in table], "o-", label="bin mean")
  ax.set_xscale("log")
  ax.set_xlabel("token position")
  ax.set_ylabel("next-token loss (nats)")
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------------


def evaluate(*, checkpoint: str, tasks: str, lengths: str, depths: str, samples: int, out: str, data_dir: str,
             tokenizer: str = "", seed: int = 0, batch_size: int = 8, prefill_chunk: int = 512, loss_length: int = 0,
             loss_docs: int = 8, loss_bins: int = 16, dtype: str | None = None,
             needle_selection: bool = True) -> dict[str, Any]:
  """The whole evaluation (the command line's flags as arguments); writes --out and returns results.json's dict."""
  t0 = time.time()
  args = dict(checkpoint=checkpoint, tasks=tasks, lengths=lengths, depths=depths, samples=samples, out=out,
              data_dir=data_dir, batch_size=batch_size, prefill_chunk=prefill_chunk)
  check_args(**args)  # the cheap checks first: no tokenizer needed for a typo in a flag
  tok = load_tokenizer(checkpoint, tokenizer, data_dir)
  parsed = check_args(**args, tokenizer=tok)
  names, lens, deps = parsed["tasks"], parsed["lengths"], parsed["depths"]
  from m3_jax.data import long_tasks  # noqa: PLC0415
  haystack = long_tasks.Haystack.from_corpus(data_dir, tokenizer=tok)
  examples = make_examples(names, lens, deps, samples, seed, haystack, tok)
  loss_len = max(lens) if loss_length == 0 else loss_length
  docs, n_heldout = (long_documents(data_dir, tok, loss_len, loss_docs) if loss_len > 0 else (None, 0))

  from m3_jax.inference import load_model  # noqa: PLC0415
  from m3_jax.models import decode  # noqa: PLC0415
  model, cfg = load_model(checkpoint, dtype)
  top = max(int(e.prompt.max()) for exs in examples.values() for e in exs)
  if top >= cfg.vocab_size:
    raise ValueError(f"the tokenizer produced id {top} but the model's vocab_size is {cfg.vocab_size}: "
                     "pass the checkpoint's own tokenizer with --tokenizer")
  answer_room = max(len(e.answer) for exs in examples.values() for e in exs) + 2
  # One cache size for every length and the loss documents: each chunk length compiles once for the whole run.
  max_len = max(max(lens) + answer_room, loss_len if loss_len > 0 else 0)
  step = decode.make_step(model)
  print(f"[eval_long] {checkpoint}: {len(names)} tasks x {len(lens)} lengths x {len(deps)} depths x {samples} "
        f"samples; caches of {max_len:,} tokens, prefill chunks of {prefill_chunk}", flush=True)
  os.makedirs(out, exist_ok=True)
  progress = os.path.join(out, PROGRESS)
  open(progress, "w").close()  # an earlier run's rows must not mix with this one's
  results, checked = run_tasks(model, step, tok, examples, batch_size=batch_size, max_len=max_len,
                               prefill_chunk=prefill_chunk, t0=t0, needle_selection=needle_selection,
                               progress=progress)
  for task, r in results.items():
    plot_heatmap(os.path.join(out, f"heatmap_{task}.png"), task, r["cells"], lens, deps)
  loss: dict[str, Any] = {"length": loss_len, "heldout_documents": n_heldout}
  if docs is None:
    loss["skipped"] = "--loss_length=-1"
  elif len(docs) == 0:
    loss["skipped"] = f"no held-out document of {data_dir} has {loss_len + 1} tokens"
    print(f"[eval_long] loss by position skipped: {loss['skipped']}", flush=True)
  else:
    curve, table = loss_by_position(step, model, docs, batch_size=batch_size, max_len=max_len,
                                    prefill_chunk=prefill_chunk, bins=loss_bins)
    loss.update(documents=len(docs), bins=table, curve=[float(x) for x in curve])
    plot_loss(os.path.join(out, "loss_by_position.png"), curve, table,
              f"held-out loss by position ({len(docs)} documents)")
    print(f"[eval_long] loss by position over {len(docs)} documents of {loss_len:,} tokens: first bin "
          f"{table[0]['loss']:.3f}, last bin {table[-1]['loss']:.3f}  {time.time() - t0:7.1f} s", flush=True)
  with open(os.path.join(out, "loss_by_position.json"), "w") as f:
    json.dump(loss, f, indent=1)
  summary = {"checkpoint": os.path.abspath(checkpoint), "data_dir": os.path.abspath(data_dir), "seed": seed,
             "lengths": lens, "depths": deps, "samples": samples, "prefill_chunk": prefill_chunk,
             "layer_types": list(cfg.layer_types), "needle_selection": bool(needle_selection and msa_layers(cfg)),
             "tasks": results, "forward_check": checked,
             "loss_by_position": {k: v for k, v in loss.items() if k != "curve"},
             "seconds": round(time.time() - t0, 1)}
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(summary, f, indent=1)
  os.remove(progress)  # results.json holds every row now
  print(f"[eval_long] wrote {out}/results.json, heatmap_<task>.png, loss_by_position.json/.png "
        f"({time.time() - t0:.1f} s)", flush=True)
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    evaluate(checkpoint=_CKPT.value, tasks=_TASKS.value, lengths=_LENGTHS.value, depths=_DEPTHS.value,
             samples=_SAMPLES.value, out=_OUT.value, data_dir=_DATA.value, tokenizer=_TOKENIZER.value,
             seed=_SEED.value, batch_size=_BATCH.value, prefill_chunk=_CHUNK.value, loss_length=_LOSS_LEN.value,
             loss_docs=_LOSS_DOCS.value, loss_bins=_LOSS_BINS.value, dtype=_DTYPE.value,
             needle_selection=_NEEDLE.value)
  except (ValueError, FileNotFoundError) as e:
    if os.environ.get("M3_JAX_TRACEBACK"):
      raise
    sys.exit(f"error: {e}")  # one line (M3_JAX_TRACEBACK=1: the traceback); the flag checks run before compiling


if __name__ == "__main__":
  app.run(main)
