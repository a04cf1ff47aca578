r"""MSA's training-side kernels at the small model's head layouts (issue 18): the sparse attention forward + backward
and the KL forward + backward, per kernel-knob variant, beside cuDNN's dense causal forward + backward at the same
shape. Prints a table and writes JSON.

  python3 -m experiments.bench_msa_backward --heads=8/2 --heads=16/1 --seq=32768 --seq=131072 \
      --out=$OUT/bench_msa_backward.json

The selection imitates a trained model's (BENCHMARKS.md, profile of 2026-12-04): every query keeps its local block,
a share `--sink` of the queries also picks block 0, the other slots are random visible blocks. Hot blocks (block 0,
the early blocks every query sees) are what the backward's per-chunk programs are for.

Each variant is checked against the first one of its kind (the same math with other tilings: gradients agree to
bf16 rounding) before it is timed; a small problem is checked against the pure-jnp reference first.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from pallas_kernels import msa
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import pallas_kl

BS, TOPK, D, DI = 128, 16, 128, 128
# The first two of each list run at every length, the rest (tiling alternatives) only up to --variants_max_seq.
ATTN_VARIANTS = [
    {"bwd_steps": 1 << 20},  # one program per block: the kernel before the hot-block split
    {},  # defaults
    {"bwd_stages": 2},
    {"bwd_rows": 32},
    {"bwd_warps": 4},
    {"block": 64},  # not the same model: 32 blocks of 64 (same keys per query); is the 128-key tile the limit?
]
KL_VARIANTS = [{"grad_steps": 1 << 20}, {}, {"num_stages": 2}]


def selection(key, T, Hkv, sink, bs=BS, topk=TOPK):
  """int32 [1, Hkv, T, topk]: the local block, block 0 for a share `sink` of the queries, random visible others."""
  nb = T // bs
  k1, k2 = jax.random.split(key)
  t_blk = jnp.arange(T)[:, None] // bs  # [T, 1]
  j = jnp.arange(nb)[None, :]
  score = jax.random.uniform(k1, (Hkv, T, nb))
  score = jnp.where(j == t_blk, 3.0, score)
  score = jnp.where((j == 0) & (jax.random.uniform(k2, (Hkv, T, 1)) < sink), 2.0, score)
  score = jnp.where(j <= t_blk, score, -1.0)
  val, idx = jax.lax.top_k(score, topk)
  return jnp.where(val >= 0, idx, -1).astype(jnp.int32)[None]


def pair_stats(idx, nb):
  counts = np.bincount(np.asarray(idx).ravel()[np.asarray(idx).ravel() >= 0], minlength=nb)
  return {"max_block_pairs_over_mean": float(counts.max() / counts.mean())}


def attn_grads(q, k, v, idx, do, knobs):
  knobs = dict(knobs)
  bs = knobs.pop("block", BS)

  def loss(q, k, v):
    out = msa_pallas.sparse_attention(q, k, v, idx, block_size=bs, **knobs)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def kl_grads(qi, ki, q, k, idx, lse, knobs):
  loss = lambda qi, ki: pallas_kl.kl_loss(q, k, qi, ki, idx, block_size=BS, lse=lse, **knobs)  # noqa: E731
  return jax.grad(loss, argnums=(0, 1))(qi, ki)


def rel_err(a, b):
  a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
  return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def small_check():
  """Pallas vs the reference on a small f32 problem (the default split gives most blocks several chunks)."""
  ks = jax.random.split(jax.random.key(0), 6)
  T, Hq, Hkv, d = 1024, 8, 2, 64
  q = jax.random.normal(ks[0], (1, T, Hq, d))
  k = jax.random.normal(ks[1], (1, T, Hkv, d))
  v = jax.random.normal(ks[2], (1, T, Hkv, d))
  qi = jax.random.normal(ks[3], (1, T, Hkv, 32))
  ki = jax.random.normal(ks[4], (1, T, 32))
  do = jax.random.normal(ks[5], q.shape)
  idx = msa.select_blocks(qi, ki, block_size=64, topk=4, implementation="reference")
  out = {}
  with jax.default_matmul_precision("highest"):
    for name, impl_kw in (("reference", {"implementation": "reference"}), ("pallas", {"implementation": "pallas"})):
      f = lambda q, k, v, qi, ki: (jnp.sum(msa.sparse_attention(q, k, v, idx, block_size=64, **impl_kw) * do)  # noqa
                                   + msa.kl_loss(q, k, qi, ki, idx, block_size=64, **impl_kw))
      out[name] = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k, v, qi, ki)
  errs = {n: rel_err(a, b) for n, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), out["pallas"],
                                                out["reference"])}
  print("small check, pallas vs reference (relative error):", json.dumps(errs), flush=True)
  if max(errs.values()) > 1e-4:
    raise SystemExit(f"the Pallas gradients disagree with the reference: {errs}")
  return errs


def run(T, hq, hkv, sink, rows, variants_max_seq):
  ks = jax.random.split(jax.random.key(T + hq), 7)
  q = jax.random.normal(ks[0], (1, T, hq, D), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, hkv, D), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, T, hkv, D), jnp.bfloat16)
  qi = jax.random.normal(ks[3], (1, T, hkv, DI), jnp.bfloat16)
  ki = jax.random.normal(ks[4], (1, T, DI), jnp.bfloat16)
  do = jax.random.normal(ks[5], q.shape, jnp.bfloat16)
  idx = jax.jit(selection, static_argnums=(1, 2, 3))(ks[6], T, hkv, sink)
  base = {"T": T, "heads": hq, "kv_heads": hkv, **pair_stats(idx, T // BS)}
  fwd_flops = 4 * hq * D * T * TOPK * BS  # sparse forward, useful
  dense = lambda q, k, v: jax.vjp(  # noqa: E731
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), q, k, v)[1](do)
  t_dense = timeit(jax.jit(dense), q, k, v)
  rows.append({**base, "op": "cudnn_dense_fwd_bwd", "ms": 1e3 * t_dense,
               "tflops": 3.5 * 2 * hq * D * T * T / t_dense / 1e12})
  print(json.dumps(rows[-1]), flush=True)
  ref = None
  fwd = jax.jit(lambda q, k, v, idx: msa_pallas.sparse_attention_with_lse(q, k, v, idx, block_size=BS))
  t_fwd = timeit(fwd, q, k, v, idx)
  _, lse = fwd(q, k, v, idx)
  rows.append({**base, "op": "msa_attention_fwd", "ms": 1e3 * t_fwd, "tflops": fwd_flops / t_fwd / 1e12})
  print(json.dumps(rows[-1]), flush=True)
  idx64 = jax.jit(selection, static_argnums=(1, 2, 3, 4, 5))(ks[6], T, hkv, sink, 64, 2 * TOPK)
  for knobs in ATTN_VARIANTS[:None if T <= variants_max_seq else 2]:
    f = jax.jit(lambda q, k, v, idx, do, knobs=knobs: attn_grads(q, k, v, idx, do, knobs))
    sel = idx64 if "block" in knobs else idx
    try:
      g = f(q, k, v, sel, do)
    except Exception as e:  # noqa: BLE001  a tiling that does not fit shared memory: recorded, not fatal
      rows.append({**base, "op": "msa_attention_fwd_bwd", **knobs, "error": str(e).splitlines()[0][:200]})
      print(json.dumps(rows[-1]), flush=True)
      continue
    ref = ref or g
    t = timeit(f, q, k, v, sel, do)
    err = None if "block" in knobs else max(rel_err(a, b) for a, b in zip(g, ref))
    rows.append({**base, "op": "msa_attention_fwd_bwd", **knobs, "ms": 1e3 * t, "tflops": 3.5 * fwd_flops / t / 1e12,
                 "vs_cudnn": t_dense / t, "max_rel_err": err})
    print(json.dumps(rows[-1]), flush=True)
  ref = None
  for knobs in KL_VARIANTS[:None if T <= variants_max_seq else 2]:
    f = jax.jit(lambda qi, ki, q, k, idx, lse, knobs=knobs: kl_grads(qi, ki, q, k, idx, lse, knobs))
    try:
      g = f(qi, ki, q, k, idx, lse)
    except Exception as e:  # noqa: BLE001
      rows.append({**base, "op": "msa_kl_fwd_bwd", **knobs, "error": str(e).splitlines()[0][:200]})
      print(json.dumps(rows[-1]), flush=True)
      continue
    ref = ref or g
    t = timeit(f, qi, ki, q, k, idx, lse)
    rows.append({**base, "op": "msa_kl_fwd_bwd", **knobs, "ms": 1e3 * t,
                 "max_rel_err": max(rel_err(a, b) for a, b in zip(g, ref))})
    print(json.dumps(rows[-1]), flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", action="append", help="Hq/Hkv, e.g. 8/2")
  ap.add_argument("--seq", type=int, action="append")
  ap.add_argument("--sink", type=float, default=0.25, help="share of queries that also select block 0")
  ap.add_argument("--variants_max_seq", type=int, default=32768)
  ap.add_argument("--out", default="bench_msa_backward.json")
  args = ap.parse_args()
  info = {"device": str(jax.devices()[0]), "jax": jax.__version__, "sink": args.sink}
  info["small_check"] = small_check()
  rows = []
  for heads in args.heads or ["8/2", "16/1"]:
    hq, hkv = map(int, heads.split("/"))
    for T in args.seq or [32768]:
      run(T, hq, hkv, args.sink, rows, args.variants_max_seq)
  print(f"\n{'T':>7} {'heads':>6} {'op':<22} {'knobs':<34} {'ms':>8} {'TFLOP/s':>8} {'err':>8}")
  for r in rows:
    knobs = {k: r[k] for k in r if k in ("bwd_steps", "bwd_stages", "bwd_warps", "bwd_rows", "grad_steps", "rows",
                                          "num_stages", "block")}
    ms = f"{r['ms']:.2f}" if "ms" in r else "error"
    print(f"{r['T']:>7} {r['heads']}/{r['kv_heads']:<4} {r['op']:<22} {json.dumps(knobs):<34} {ms:>8} "
          f"{r.get('tflops', 0):>8.1f} {r.get('max_rel_err') or 0:>8.1e}")
  with open(args.out, "w") as f:
    json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
