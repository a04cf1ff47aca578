r"""MSA op timings against cuDNN dense attention, M3 shape (Hq=64, Hkv=4, D=128, d_idx=128, block 128, top-16),
bf16, batch 1. Checks each op against the `reference` implementation on a small random problem first, then
times with warm-up and the median of repeats. Prints a table and writes JSON.

  python experiments/bench_msa.py --seq=32768 --out=/tmp/bench_msa.json [--impls=xla]

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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, action="append")
  ap.add_argument("--impls", default="xla")
  ap.add_argument("--out", default="bench_msa.json")
  args = ap.parse_args()
  hq, hkv, d, di, bs, topk = 64, 4, 128, 128, 128, 16
  rows = []
  for impl in args.impls.split(","):
    print(impl, "check vs reference:", check(impl, 32, 4), flush=True)
  for t in args.seq or [32768]:
    q, k, v, qi, ki = inputs(jax.random.key(0), t, hq, hkv, d, di, jnp.bfloat16)
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    t_dense = timeit(dense, q, k, v)
    dense_flops = 2 * hq * d * t * t  # causal half of 4*Hq*D*T^2
    row = {"T": t, "cudnn_dense_fwd_ms": 1e3 * t_dense, "cudnn_tflops": dense_flops / t_dense / 1e12}
    for impl in args.impls.split(","):
      sel = jax.jit(lambda qi, ki: msa.select_blocks(qi, ki, block_size=bs, topk=topk, implementation=impl))
      t_sel = timeit(sel, qi, ki)
      idx = sel(qi, ki)
      att = jax.jit(lambda q, k, v, idx: msa.sparse_attention(q, k, v, idx, block_size=bs, implementation=impl))
      t_att = timeit(att, q, k, v, idx)
      useful = 4 * hq * d * t * topk * bs
      row.update({f"{impl}_select_ms": 1e3 * t_sel, f"{impl}_sparse_fwd_ms": 1e3 * t_att,
                  f"{impl}_sparse_tflops": useful / t_att / 1e12,
                  f"{impl}_prefill_ms": 1e3 * (t_sel + t_att),
                  f"{impl}_speedup_vs_cudnn": t_dense / (t_sel + t_att)})
    rows.append(row)
    print(json.dumps(row), flush=True)
  keys = list(rows[0])
  print("\n" + " | ".join(keys))
  for r in rows:
    print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
  with open(args.out, "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  main()
