r"""MSA op timings against cuDNN dense attention, M3 shape (Hq=64, Hkv=4, D=128, d_idx=128, block 128, top-16),
bf16, batch 1. Checks each op against the `reference` implementation on a small random problem first, then
times with warm-up and the median of repeats. Prints a table and writes JSON.

  python experiments/bench_msa.py --seq=32768 --out=/tmp/bench_msa.json [--impls=xla]
  # issue 5: one MSA layer, prefill (chunked over queries past --query_chunk), training step, decode, top-k
  python experiments/bench_msa.py --impls=pallas --seq=32768 --seq=131072 --seq=524288 --seq=1048576 \
      --query_chunk=131072 --dense_max_t=131072 --topk_anchor --train_seq=32768 --train_seq=131072 \
      --decode_len=131072 --decode_len=1048576 --out=$OUT/bench_msa_layer.json --plot=$OUT/msa_vs_dense.png

Useful FLOPs (DESIGN.md §2): sparse attention forward 4*Hq*D*T*k*Bk (causal ignored: every query reads k*Bk keys
once T >= k*Bk); dense causal attention forward 2*Hq*D*T^2; index scoring Hkv*d_idx*T^2.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import msa


def timeit(fn, *args, warmup=2, repeat=5):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeat):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def inputs(key, t, hq, hkv, d, di, dtype):
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (1, t, hq, d), dtype)
  k = jax.random.normal(ks[1], (1, t, hkv, d), dtype)
  v = jax.random.normal(ks[2], (1, t, hkv, d), dtype)
  qi = jax.random.normal(ks[3], (1, t, hkv, di), dtype)
  ki = jax.random.normal(ks[4], (1, t, di), dtype)
  return q, k, v, qi, ki


def check(impl, bs, topk):
  """Small random problem: impl vs reference, relative error (f32 inputs)."""
  q, k, v, qi, ki = inputs(jax.random.key(1), 512, 8, 2, 64, 32, jnp.float32)
  idx_ref = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation="reference")
  idx = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl)
  same_sets = bool(jnp.all(jnp.sort(idx, -1) == jnp.sort(idx_ref, -1)))
  o_ref = msa.sparse_attention(q, k, v, idx_ref, block_size=bs, implementation="reference")
  o = msa.sparse_attention(q, k, v, idx_ref, block_size=bs, implementation=impl)
  rel = float(jnp.linalg.norm(o - o_ref) / jnp.linalg.norm(o_ref))
  return {"selection_equal": same_sets, "attention_rel_err": rel}


def chunked(fn_select, fn_attend, q, k, v, qi, ki, chunk):
  """Prefill of T queries in chunks of `chunk` (chunked prefill: each chunk attends to every key before it)."""
  T = q.shape[1]
  outs = []
  for s in range(0, T, chunk):
    e = min(T, s + chunk)
    # Chunk [s, e) sees keys [0, e): the ops take the queries as the last rows of the keys they are given.
    idx = fn_select(qi[:, s:e], ki[:, :e])
    outs.append(fn_attend(q[:, s:e], k[:, :e], v[:, :e], idx))
  return outs


def topk_anchor(hkv, t, bs, topk):
  """`lax.top_k` alone over materialised block scores [Hkv, T, T / bs] (the issue's anchor: 49.7 ms at 128K)."""
  scores = jax.random.normal(jax.random.key(3), (hkv, t, t // bs), jnp.float32)
  return timeit(jax.jit(lambda s: jax.lax.top_k(s, topk)), scores)


def train_step_times(impl, t, hq, hkv, d, di, bs, topk):
  """One MSA attention training step (select + sparse attention fwd/bwd + KL fwd/bwd) vs cuDNN fwd+bwd."""
  q, k, v, qi, ki = inputs(jax.random.key(4), t, hq, hkv, d, di, jnp.bfloat16)
  do = jax.random.normal(jax.random.key(5), q.shape, jnp.bfloat16)

  def msa_step(q, k, v, qi, ki, do):
    idx = msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl)
    def loss(q, k, v, qi, ki):
      out = msa.sparse_attention(q, k, v, idx, block_size=bs, implementation=impl)
      kl = msa.kl_loss(q, k, qi, ki, idx, block_size=bs, implementation=impl)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)) + kl
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, qi, ki)

  def dense_step(q, k, v, do):
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa
    return jax.vjp(f, q, k, v)[1](do)

  return timeit(jax.jit(msa_step), q, k, v, qi, ki, do), timeit(jax.jit(dense_step), q, k, v, do)


def decode_times(impl, batch, length, hq, hkv, d, di, bs, topk):
  """One decoding step (1 new token per sequence) over `length` cached tokens: MSA (index scoring over the
  index-key cache, top-k, sparse attention) vs cuDNN dense attention over the whole KV cache."""
  ks = jax.random.split(jax.random.key(6), 5)
  q = jax.random.normal(ks[0], (batch, 1, hq, d), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (batch, length, hkv, d), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (batch, length, hkv, d), jnp.bfloat16)
  qi = jax.random.normal(ks[3], (batch, 1, hkv, di), jnp.bfloat16)
  kic = jax.random.normal(ks[4], (batch, length, di), jnp.bfloat16)
  lengths = jnp.full((batch,), length, jnp.int32)
  sparse = jax.jit(lambda *a: msa.sparse_decode(*a, block_size=bs, topk=topk, implementation=impl)[0])
  dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  return timeit(sparse, q, kc, vc, qi, kic, lengths, repeat=20), timeit(dense, q, kc, vc, repeat=20)


def plot(rows, path):
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(6, 4))
  for key, label in (("cudnn_dense_fwd_ms", "cuDNN dense causal"),) + tuple(
      (k, k.replace("_prefill_ms", " MSA prefill")) for k in rows[0] if k.endswith("_prefill_ms")):
    pts = [(r["T"], r[key]) for r in rows if key in r]
    if pts:
      ax.loglog(*zip(*pts), "o-", label=label)
  ax.set_xlabel("context length T (tokens)")
  ax.set_ylabel("one layer, forward (ms)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, action="append")
  ap.add_argument("--impls", default="xla")
  ap.add_argument("--query_chunk", type=int, default=0, help="prefill in query chunks above this length (0: off)")
  ap.add_argument("--dense_max_t", type=int, default=1 << 30, help="skip timing cuDNN above this length")
  ap.add_argument("--topk_anchor", action="store_true")
  ap.add_argument("--train_seq", type=int, action="append", default=[])
  ap.add_argument("--decode_len", type=int, action="append", default=[])
  ap.add_argument("--decode_batch", type=int, default=8)
  ap.add_argument("--plot", default="")
  ap.add_argument("--out", default="bench_msa.json")
  args = ap.parse_args()
  hq, hkv, d, di, bs, topk = 64, 4, 128, 128, 128, 16
  rows = []
  for impl in args.impls.split(","):
    print(impl, "check vs reference:", check(impl, 32, 4), flush=True)
  for t in args.seq or [32768]:
    q, k, v, qi, ki = inputs(jax.random.key(0), t, hq, hkv, d, di, jnp.bfloat16)
    row = {"T": t}
    if t <= args.dense_max_t:
      dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
      t_dense = timeit(dense, q, k, v, warmup=1 if t > 131072 else 2, repeat=3 if t > 131072 else 5)
      row.update({"cudnn_dense_fwd_ms": 1e3 * t_dense, "cudnn_tflops": 2 * hq * d * t * t / t_dense / 1e12})
    for impl in args.impls.split(","):
      sel = jax.jit(lambda qi, ki: msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl))
      att = jax.jit(lambda q, k, v, idx: msa.sparse_attention(q, k, v, idx, block_size=bs, implementation=impl))
      useful = 4 * hq * d * t * topk * bs
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
      row["lax_top_k_anchor_ms"] = 1e3 * topk_anchor(hkv, t, bs, topk)
    rows.append(row)
    print(json.dumps(row), flush=True)
    del q, k, v, qi, ki
  extra = {"train": [], "decode": []}
  for impl in args.impls.split(","):
    for t in args.train_seq:
      t_msa, t_dense = train_step_times(impl, t, hq, hkv, d, di, bs, topk)
      extra["train"].append({"impl": impl, "T": t, "msa_step_ms": 1e3 * t_msa, "cudnn_fwd_bwd_ms": 1e3 * t_dense,
                             "speedup": t_dense / t_msa})
      print(json.dumps(extra["train"][-1]), flush=True)
    for n in args.decode_len:
      t_msa, t_dense = decode_times(impl, args.decode_batch, n, hq, hkv, d, di, bs, topk)
      extra["decode"].append({"impl": impl, "batch": args.decode_batch, "cached": n, "msa_ms": 1e3 * t_msa,
                              "cudnn_ms": 1e3 * t_dense, "speedup": t_dense / t_msa})
      print(json.dumps(extra["decode"][-1]), flush=True)
  if args.plot:
    plot(rows, args.plot)
  for r in rows + extra["train"] + extra["decode"]:
    print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
  with open(args.out, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows, **extra}, f, indent=2)


if __name__ == "__main__":
  main()
