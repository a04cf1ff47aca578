r"""MSA op timings against cuDNN dense attention, M3 shape (Hq=64, Hkv=4, D=128, d_idx=128, block 128, top-16),
bf16, batch 1. Checks each op against the `reference` implementation on a small random problem first, then
times with warm-up and the median of repeats. Prints a table and writes JSON.

  python -m experiments.bench_msa --seq=32768 --out=/tmp/bench_msa.json [--impls=xla]
  # issue 5: one MSA layer, prefill (chunked over queries past --query_chunk), training step, decode, top-k
  python -m experiments.bench_msa --impls=pallas --seq=32768 --seq=131072 --seq=524288 --seq=1048576 \
      --query_chunk=131072 --dense_max_t=131072 --topk_anchor --train_seq=32768 --train_seq=131072 \
      --decode_len=131072 --decode_len=1048576 --out=$OUT/bench_msa_layer.json --plot=$OUT/msa_vs_dense.png
  # issue 19, claim b: selection granularity at M3's 2048-token budget, 128K
  python -m experiments.bench_msa --impls=pallas --skip_check --decode_only --granularity=128x16,64x32,16x128 \
      --out=$OUT/bench_granularity.json
  # the KL alone per teacher variant (fused / loop / unroll over the group's heads), then the training step
  python -m experiments.bench_msa --impls=pallas --skip_check --decode_only --kl_teachers=131072 \
      --train_seq=32768 --train_seq=131072 --out=$OUT/bench_kl.json

Useful FLOPs (DESIGN.md §2): sparse attention forward 4*Hq*D*T*k*Bk (causal ignored: every query reads k*Bk keys
once T >= k*Bk); dense causal attention forward 2*Hq*D*T^2; index scoring Hkv*d_idx*T^2.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from pallas_kernels import msa
from pallas_kernels.msa import pallas_select

# The M3 shape: query heads, KV heads, head dim, index dim, block size, selected blocks per query.
HQ, HKV, D, DI, BS, TOPK = 64, 4, 128, 128, 128, 16

# Fused-selection tilings tried by --select_variants (the fastest bf16 one then runs the prefill rows).
SELECT_VARIANTS = [dict(query_tile=64, num_warps=4, num_stages=2), dict(query_tile=128, num_warps=4, num_stages=2),
                   dict(query_tile=128, num_warps=8, num_stages=2), dict(query_tile=128, num_warps=8, num_stages=3),
                   dict(query_tile=64, num_warps=4, num_stages=3)]


def inputs(key, t, hq, hkv, d, di, dtype):
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (1, t, hq, d), dtype)
  k = jax.random.normal(ks[1], (1, t, hkv, d), dtype)
  v = jax.random.normal(ks[2], (1, t, hkv, d), dtype)
  qi = jax.random.normal(ks[3], (1, t, hkv, di), dtype)
  ki = jax.random.normal(ks[4], (1, t, di), dtype)
  return q, k, v, qi, ki


def check(impl, bs, topk):
  """Small random problem: impl vs reference, relative error (f32 inputs; the reference's matmuls at full f32
  precision, not the GPU's default tf32, which reorders near-tied blocks)."""
  with jax.default_matmul_precision("highest"):
    return _check(impl, bs, topk)


def _check(impl, bs, topk):
  q, k, v, qi, ki = inputs(jax.random.key(1), 512, 8, 2, 64, 32, jnp.float32)
  idx_ref = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation="reference")
  idx = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl)
  same_sets = bool(jnp.all(jnp.sort(idx, -1) == jnp.sort(idx_ref, -1)))
  o_ref = msa.sparse_attention(q, k, v, idx_ref, block_size=bs, implementation="reference")
  o = msa.sparse_attention(q, k, v, idx_ref, block_size=bs, implementation=impl)
  rel = float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref))
  return {"selection_equal": same_sets, "attention_rel_err": rel}


def chunked(fn_select, fn_attend, q, k, v, qi, ki, chunk):
  """Prefill of T queries in chunks of `chunk` (chunked prefill: each chunk attends to every key before it). Every
  chunk gets all T keys and its first position as a traced q_offset, so one compiled program serves all chunks;
  the kernels never visit blocks past a chunk's last query."""
  T = q.shape[1]
  outs = []
  for s in range(0, T, chunk):
    e = min(T, s + chunk)
    off = jnp.int32(s)
    idx = fn_select(qi[:, s:e], ki, off)
    outs.append(fn_attend(q[:, s:e], k, v, idx, off))
  return outs


def select_fn(impl, bs, topk, knobs=None, fp8=False):
  """jitted (q_idx, k_idx) -> block ids; fp8 quantises the index q/k first (inside the timed function: in a model
  the index keys would be cached in fp8 already, so this over-counts the quantisation of k_idx)."""
  knobs = knobs or {}

  def f(qi, ki, q_offset=None):
    kw = {"q_offset": q_offset}
    if fp8:
      qi = msa.quantize_index(qi)[0]
      ki, kw["k_idx_scale"] = msa.quantize_index(ki)
    if impl == "pallas":
      return pallas_select.select_blocks(qi, ki, block_size=bs, topk=topk, **kw, **knobs)
    return msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl, **kw)
  return jax.jit(f)


def agreement(a, b) -> dict:
  """How often two selections agree: whole rows as sets, and the mean share of a row's blocks both picked."""
  a, b = np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1)
  same = float(np.mean(np.all(a == b, -1)))
  overlap = float(np.mean([len(np.intersect1d(x[x >= 0], y[y >= 0])) / max(1, len(np.unique(x[x >= 0])))
                           for x, y in zip(a.reshape(-1, a.shape[-1])[::97], b.reshape(-1, b.shape[-1])[::97])]))
  return {"rows_same_set": same, "mean_overlap_sampled": overlap}


def select_variants(t, hkv, di, bs, topk):
  """Fused selection at T tokens: each tiling (bf16 and fp8 index), the xla implementation, lax.top_k alone, and
  the agreement of the fp8 selection with the bf16 one. Returns (rows, fastest bf16 knobs)."""
  ks = jax.random.split(jax.random.key(7), 2)
  qi = jax.random.normal(ks[0], (1, t, hkv, di), jnp.bfloat16)
  ki = jax.random.normal(ks[1], (1, t, di), jnp.bfloat16)
  flops = 2 * hkv * di * t * t / 2  # causal index scoring
  rows, best = [], None
  xla_idx = None
  if t <= 131072:
    f = select_fn("xla", bs, topk)
    rows.append({"T": t, "impl": "xla", "ms": 1e3 * timeit(f, qi, ki, warmup=1, repeat=3)})
    xla_idx = f(qi, ki)
  for fp8 in (False, True):
    for knobs in SELECT_VARIANTS if not fp8 else [dict(v, fp8_dot=d) for v in SELECT_VARIANTS[1:3]
                                                   for d in (True, False)]:
      row = {"T": t, "impl": "pallas", "fp8": fp8, **knobs}
      try:
        f = select_fn("pallas", bs, topk, knobs, fp8)
        ms = 1e3 * timeit(f, qi, ki, warmup=1, repeat=5)
        row.update({"ms": ms, "tflops": flops / ms / 1e9})
        idx = f(qi, ki)
        if xla_idx is not None:
          row["vs_xla_bf16"] = agreement(idx, xla_idx)
          row["exact_vs_xla"] = bool(jnp.all(idx == xla_idx)) if not fp8 else None
        if not fp8 and (best is None or ms < best[0]):
          best = (ms, knobs, idx)
        elif fp8 and best is not None:
          row["vs_pallas_bf16"] = agreement(idx, best[2])
      except Exception as e:  # noqa: BLE001 - a tiling that does not lower is reported, not fatal
        row["error"] = f"{type(e).__name__}: {e}"[:500]
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows, (best[1] if best else {})


def topk_anchor(hkv, t, bs, topk):
  """`lax.top_k` alone over materialised block scores [Hkv, T, T / bs] (the issue's anchor: 49.7 ms at 128K)."""
  scores = jax.random.normal(jax.random.key(3), (hkv, t, t // bs), jnp.float32)
  return timeit(jax.jit(lambda s: jax.lax.top_k(s, min(topk, t // bs))), scores)


def train_step_times(impl, t, hq, hkv, d, di, bs, topk, sel_knobs=None, dense=True):
  """One MSA attention training step (select + sparse attention fwd/bwd + KL fwd/bwd) vs cuDNN fwd+bwd (None with
  dense=False). On the Pallas kernels the KL reuses the attention forward's log-sum-exp (LSE fusion), as the model
  does."""
  q, k, v, qi, ki = inputs(jax.random.key(4), t, hq, hkv, d, di, jnp.bfloat16)
  do = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)

  def msa_step(q, k, v, qi, ki, do):
    if impl == "pallas":
      idx = pallas_select.select_blocks(qi, ki, block_size=bs, topk=topk, **(sel_knobs or {}))
    else:
      idx = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl)
    def loss(q, k, v, qi, ki):
      if impl == "pallas":
        out, lse = msa.sparse_attention_with_lse(q, k, v, idx, block_size=bs)
      else:
        out, lse = msa.sparse_attention(q, k, v, idx, block_size=bs, implementation=impl), None
      kl = msa.kl_loss(q, k, qi, ki, idx, block_size=bs, implementation=impl, lse=lse)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)) + kl
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, qi, ki)

  def dense_step(q, k, v, do):
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa
    return jax.vjp(f, q, k, v)[1](do)

  return timeit(jax.jit(msa_step), q, k, v, qi, ki, do), timeit(jax.jit(dense_step), q, k, v, do) if dense else None


def kl_teacher_times(t, hq, hkv, d, di, bs, topk, teachers):
  """The KL alone (forward, and forward + backward to the index q/k) for each way of averaging the teacher's heads
  (`pallas_kl.TEACHERS`), on the selection and log-sum-exp of the Pallas forward; the losses must agree."""
  from pallas_kernels.msa import pallas_kl  # noqa: PLC0415
  q, k, v, qi, ki = inputs(jax.random.key(7), t, hq, hkv, d, di, jnp.bfloat16)
  idx = jax.jit(lambda qi, ki: pallas_select.select_blocks(qi, ki, block_size=bs, topk=topk))(qi, ki)
  _, lse = jax.jit(lambda q, k, v, idx: msa.sparse_attention_with_lse(q, k, v, idx, block_size=bs))(q, k, v, idx)
  out = []
  for teacher in teachers:
    # every array is an argument: a closure would embed GBs of constants in the program and slow its compilation
    loss = lambda qi, ki, q, k, idx, lse, teacher=teacher: pallas_kl.kl_loss(  # noqa: E731
        q, k, qi, ki, idx, block_size=bs, lse=lse, teacher=teacher)
    fwd, both = jax.jit(loss), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    args = (qi, ki, q, k, idx, lse)
    value, (dqi, dki) = both(*args)
    out.append({"T": t, "teacher": teacher, "loss": float(value), "kl_fwd_ms": 1e3 * timeit(fwd, *args),
                "kl_fwd_bwd_ms": 1e3 * timeit(both, *args),
                "dqi_norm": float(jnp.linalg.norm(dqi.astype(jnp.float32))),
                "dki_norm": float(jnp.linalg.norm(dki.astype(jnp.float32)))})
    print(json.dumps(out[-1]), flush=True)
  return out


def decode_times(impl, batch, length, hq, hkv, d, di, bs, topk, fp8=False):
  """One decoding step (1 new token per sequence) over `length` cached tokens: MSA (index scoring over the
  index-key cache, top-k, sparse attention) vs cuDNN dense attention over the whole KV cache."""
  ks = jax.random.split(jax.random.key(6), 5)
  q = jax.random.normal(ks[0], (batch, 1, hq, d), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (batch, length, hkv, d), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (batch, length, hkv, d), jnp.bfloat16)
  qi = jax.random.normal(ks[3], (batch, 1, hkv, di), jnp.bfloat16)
  kic = jax.random.normal(ks[4], (batch, length, di), jnp.bfloat16)
  lengths = jnp.full((batch,), length, jnp.int32)
  if fp8:  # the index-key cache is stored in fp8 with one scale per key: what a decoding step reads is halved
    kic, ksc = msa.quantize_index(kic)
    sparse = jax.jit(lambda q, kc, vc, qi, kic, n, ksc: msa.sparse_decode(
        q, kc, vc, qi, kic, n, block_size=bs, topk=topk, implementation=impl, k_idx_scale=ksc)[0])
    t_sparse = timeit(sparse, q, kc, vc, qi, kic, lengths, ksc, repeat=20)
  else:
    sparse = jax.jit(lambda *a: msa.sparse_decode(*a, block_size=bs, topk=topk, implementation=impl)[0])
    t_sparse = timeit(sparse, q, kc, vc, qi, kic, lengths, repeat=20)
  dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  return t_sparse, timeit(dense, q, kc, vc, repeat=20)


# cuDNN dense causal prefill measured on this H200 box (DESIGN.md §5): the anchors past what we re-time here.
DENSE_ANCHORS_MS = {32768: 30.2, 131072: 513.0, 524288: 9180.0, 1048576: 37800.0}


def plot(rows, path, decode=()):
  """Log-log time vs context length: one layer's prefill (dense vs MSA) and, if given, one decoding step."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, axes = plt.subplots(1, 2 if decode else 1, figsize=(11 if decode else 6, 4), squeeze=False)
  ax = axes[0, 0]
  pts = [(r["T"], r["cudnn_dense_fwd_ms"]) for r in rows if "cudnn_dense_fwd_ms" in r]
  if pts:
    ax.loglog(*zip(*pts), "o-", color="C0", label="cuDNN dense causal (measured)")
  ax.loglog(list(DENSE_ANCHORS_MS), list(DENSE_ANCHORS_MS.values()), "s--", color="C0", alpha=0.5, mfc="none",
            label="cuDNN dense causal (DESIGN.md anchors)")
  keys = sorted({k for r in rows for k in r if k.endswith("_prefill_ms")})
  for key in keys:
    pts = [(r["T"], r[key]) for r in rows if key in r]
    ax.loglog(*zip(*pts), "o-", color="C1" if "fp8" in key else "C2", label=key.replace("_prefill_ms", " MSA prefill"))
  ax.set(xlabel="context length T (tokens)", ylabel="ms", title="one layer, prefill (forward)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  if decode:
    ax = axes[0, 1]
    for impl in sorted({d["impl"] for d in decode}):
      pts = sorted((d["cached"], d["msa_ms"]) for d in decode if d["impl"] == impl)
      ax.loglog(*zip(*pts), "o-", color="C1" if "fp8" in impl else "C2", label=f"{impl} MSA decode")
    pts = sorted({d["cached"]: d["cudnn_ms"] for d in decode if d["impl"] == "pallas"}.items())
    ax.loglog(*zip(*pts), "o-", color="C0", label="cuDNN dense decode")
    ax.set(xlabel="cached tokens", ylabel="ms", title=f"one decoding step, batch {decode[0]['batch']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def parse_args() -> argparse.Namespace:
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, action="append")
  ap.add_argument("--impls", default="xla")
  ap.add_argument("--query_chunk", type=int, default=0, help="prefill in query chunks above this length (0: off)")
  ap.add_argument("--dense_max_t", type=int, default=1 << 30, help="skip timing cuDNN above this length")
  ap.add_argument("--topk_anchor", action="store_true")
  ap.add_argument("--train_seq", type=int, action="append", default=[])
  ap.add_argument("--decode_len", type=int, action="append", default=[])
  ap.add_argument("--kl_teachers", type=int, default=0, help="time the KL alone per teacher variant at this T")
  ap.add_argument("--kl_teacher_list", default="loop,fused,unroll")
  ap.add_argument("--decode_batch", type=int, default=8)
  ap.add_argument("--plot", default="")
  ap.add_argument("--select_variants", type=int, default=0, help="time the fused selection's tilings at this T")
  ap.add_argument("--fp8", action="store_true", help="also prefill and decode with fp8 index q/k / index cache")
  ap.add_argument("--skip_check", action="store_true")
  ap.add_argument("--decode_only", action="store_true", help="skip the prefill rows (decode and train only)")
  ap.add_argument("--granularity", default="", help="BSxTOPK,... at one token budget (e.g. 128x16,64x32,16x128): "
                  "selection, sparse forward and the training step of each at --granularity_seq (issue 19, claim b)")
  ap.add_argument("--granularity_seq", type=int, default=131072)
  ap.add_argument("--out", default="bench_msa.json")
  ap.add_argument("--replot", default="", help="only redraw --plot from this JSON of an earlier run")
  ap.add_argument("--replot_decode", default="", help="with --replot: take the decode panel from this JSON instead")
  return ap.parse_args()


def prefill_row(args: argparse.Namespace, t: int, impls: list[str], knobs: dict) -> dict:
  """One layer's prefill at T = t: cuDNN dense causal (up to --dense_max_t) and each MSA implementation (select +
  sparse attention, or chunked over queries past --query_chunk), with speedups; the top-k anchor at 128K."""
  q, k, v, qi, ki = inputs(jax.random.key(0), t, HQ, HKV, D, DI, jnp.bfloat16)
  row = {"T": t}
  if t <= args.dense_max_t:
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    t_dense = timeit(dense, q, k, v, warmup=1 if t > 131072 else 2, repeat=3 if t > 131072 else 5)
    row.update({"cudnn_dense_fwd_ms": 1e3 * t_dense, "cudnn_tflops": 2 * HQ * D * t * t / t_dense / 1e12})
  for impl in impls:
    base = impl.removesuffix("_fp8")
    sel = select_fn(base, BS, TOPK, knobs if base == "pallas" else None, fp8=impl.endswith("_fp8"))
    att = jax.jit(lambda q, k, v, idx, off=None: msa.sparse_attention(q, k, v, idx, block_size=BS, q_offset=off,
                                                                      implementation=base))
    useful = 4 * HQ * D * t * TOPK * BS
    if args.query_chunk and t > args.query_chunk:
      t_pre = timeit(lambda *a: chunked(sel, att, *a, args.query_chunk), q, k, v, qi, ki, warmup=1, repeat=3)
      row.update({f"{impl}_prefill_ms": 1e3 * t_pre, f"{impl}_query_chunk": args.query_chunk})
    else:
      t_sel = timeit(sel, qi, ki)
      idx = sel(qi, ki)
      t_att = timeit(att, q, k, v, idx)
      t_pre = t_sel + t_att
      row.update({f"{impl}_select_ms": 1e3 * t_sel, f"{impl}_sparse_fwd_ms": 1e3 * t_att,
                  f"{impl}_sparse_tflops": useful / t_att / 1e12, f"{impl}_prefill_ms": 1e3 * t_pre})
    if "cudnn_dense_fwd_ms" in row:
      row[f"{impl}_speedup_vs_cudnn"] = row["cudnn_dense_fwd_ms"] / (1e3 * t_pre)
  if args.topk_anchor and t == 131072:
    row["lax_top_k_anchor_ms"] = 1e3 * topk_anchor(HKV, t, BS, TOPK)
  return row


def decode_and_train(args: argparse.Namespace, knobs: dict, extra: dict, save) -> None:
  """Per implementation: one decoding step per --decode_len (and with the fp8 index cache under --fp8) and one
  training step per --train_seq, each appended to extra["decode"] / extra["train"] and saved as it finishes."""
  for impl in args.impls.split(","):
    for n in args.decode_len:
      for fp8 in (False, True) if args.fp8 and impl == "pallas" else (False,):
        t_msa, t_dense = decode_times(impl, args.decode_batch, n, HQ, HKV, D, DI, BS, TOPK, fp8=fp8)
        extra["decode"].append({"impl": impl + ("_fp8_index_cache" if fp8 else ""), "batch": args.decode_batch,
                                "cached": n, "msa_ms": 1e3 * t_msa, "cudnn_ms": 1e3 * t_dense,
                                "speedup": t_dense / t_msa})
        print(json.dumps(extra["decode"][-1]), flush=True)
        save()
    for t in args.train_seq:
      t_msa, t_dense = train_step_times(impl, t, HQ, HKV, D, DI, BS, TOPK, knobs if impl == "pallas" else None)
      extra["train"].append({"impl": impl, "T": t, "msa_step_ms": 1e3 * t_msa, "cudnn_fwd_bwd_ms": 1e3 * t_dense,
                             "speedup": t_dense / t_msa})
      print(json.dumps(extra["train"][-1]), flush=True)
      save()


def granularity_rows(t: int, spec: str) -> list[dict]:
  """Pallas selection, sparse forward and training step (select + attention fwd/bwd + KL fwd/bwd) at T = t for each
  block size x top-k of `spec`, with cuDNN's causal fwd+bwd once as the yardstick (M3 heads)."""
  rows, t_dense = [], None
  for item in spec.split(","):
    bs, _, topk = item.partition("x")
    bs, topk = int(bs), int(topk)
    q, k, v, qi, ki = inputs(jax.random.key(0), t, HQ, HKV, D, DI, jnp.bfloat16)
    sel = select_fn("pallas", bs, topk)
    att = jax.jit(lambda q, k, v, idx, bs=bs: msa.sparse_attention(q, k, v, idx, block_size=bs,
                                                                  implementation="pallas"))
    t_sel = timeit(sel, qi, ki)
    t_att = timeit(att, q, k, v, sel(qi, ki))
    del q, k, v, qi, ki
    t_step, dense = train_step_times("pallas", t, HQ, HKV, D, DI, bs, topk, dense=t_dense is None)
    t_dense = dense if t_dense is None else t_dense
    rows.append({"T": t, "block_size": bs, "topk": topk, "budget_tokens": bs * topk, "select_ms": 1e3 * t_sel,
                 "sparse_fwd_ms": 1e3 * t_att, "train_step_ms": 1e3 * t_step, "cudnn_fwd_bwd_ms": 1e3 * t_dense,
                 "sparse_fwd_tflops": 4 * HQ * D * t * topk * bs / t_att / 1e12})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main():
  args = parse_args()
  if args.replot:
    old = json.load(open(args.replot))
    decode = json.load(open(args.replot_decode))["decode"] if args.replot_decode else old.get("decode", [])
    plot(old["rows"], args.plot, decode)
    return
  rows, result = [], {"device": jax.devices()[0].device_kind, "jax": jax.__version__}

  def save():
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)

  if not args.skip_check:
    for impl in args.impls.split(","):
      print(impl, "check vs reference:", check(impl, 32, 4), flush=True)
  knobs = {}
  if args.select_variants:
    result["select_variants"], knobs = select_variants(args.select_variants, HKV, DI, BS, TOPK)
    result["select_knobs"] = knobs
    result["lax_top_k_ms"] = 1e3 * topk_anchor(HKV, args.select_variants, BS, TOPK)
    print("lax.top_k alone:", result["lax_top_k_ms"], "ms; fastest tiling", knobs, flush=True)
    save()
  impls = args.impls.split(",") + (["pallas_fp8"] if args.fp8 and "pallas" in args.impls else [])
  for t in [] if args.decode_only else args.seq or [32768]:
    rows.append(prefill_row(args, t, impls, knobs))
    result["rows"] = rows
    save()
    print(json.dumps(rows[-1]), flush=True)
  if args.kl_teachers:
    result["kl_teachers"] = kl_teacher_times(args.kl_teachers, HQ, HKV, D, DI, BS, TOPK,
                                             args.kl_teacher_list.split(","))
    save()
  if args.granularity:
    result["granularity"] = granularity_rows(args.granularity_seq, args.granularity)
    save()
  extra = {"train": result.setdefault("train", []), "decode": result.setdefault("decode", [])}
  decode_and_train(args, knobs, extra, save)
  if args.plot:
    plot(rows, args.plot, extra["decode"])
  for r in rows + extra["train"] + extra["decode"]:
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
  save()


if __name__ == "__main__":
  main()
