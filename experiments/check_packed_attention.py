r"""Dense attention over packed documents on the GPU (issue 18): cuDNN's packed layout (`packed_cudnn_attention`)
and its blockwise fallback for rows of too many documents against the masked-softmax XLA reference (float32,
highest precision) for outputs and gradients, then the time of one layer's forward + backward at small_msa's head
layouts: packed vs its fallback vs the boolean-mask route vs plain causal (no document mask). Prints a table and
writes JSON.

  python3 -m experiments.check_packed_attention --seq=32768 --out=$OUT/packed_attention.json

Document lengths for the timing: log-uniform between 64 and 8192 tokens (--min_doc/--max_doc), the row's tail
padding (segment 0) up to 1% of the row.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from m3_jax.models.attention.core import causal_mask, masked_attention
from m3_jax.models.attention.dense import packed_cudnn_attention


def packed_segments(rng, T, min_doc, max_doc):
  """int32 [T]: documents 1, 2, ... of log-uniform lengths, then padding (0) for the last < 1% of the row."""
  seg, t, d = np.zeros(T, np.int32), 0, 1
  end = T - rng.integers(0, max(1, T // 100))
  while t < end:
    n = int(np.exp(rng.uniform(np.log(min_doc), np.log(max_doc))))
    seg[t:min(t + n, end)] = d
    t, d = t + n, d + 1
  return seg


def check(hq, hkv, rng):
  """Packed cuDNN (bf16 and f32 inputs) vs the f32 XLA reference on a 2-row batch; returns relative errors."""
  T, D = 2048, 128
  ks = jax.random.split(jax.random.key(hq), 4)
  q = jax.random.normal(ks[0], (2, T, hq, D))
  k = jax.random.normal(ks[1], (2, T, hkv, D))
  v = jax.random.normal(ks[2], (2, T, hkv, D))
  do = jax.random.normal(ks[3], q.shape)
  seg = jnp.asarray(np.stack([packed_segments(rng, T, 16, 700), packed_segments(rng, T, 300, 3000)]))

  def ref(q, k, v):
    pos = jnp.arange(T)
    with jax.default_matmul_precision("highest"):
      return masked_attention(q, k, v, causal_mask(pos, pos, seg, seg))

  # max_runs=2: both rows hold more documents, so the lax.cond takes its blockwise fallback
  out = {}
  for name, f in (("reference", ref), ("packed", lambda q, k, v: packed_cudnn_attention(q, k, v, seg)),
                  ("fallback", lambda q, k, v: packed_cudnn_attention(q, k, v, seg, max_runs=2))):
    o, vjp = jax.vjp(jax.jit(f), *(x.astype(jnp.float32 if name == "reference" else jnp.bfloat16) for x in (q, k, v)))
    out[name] = (o, *vjp(do.astype(o.dtype)))
  err = {}
  for path in ("packed", "fallback"):
    for n, a, b in zip(("out", "dq", "dk", "dv"), out[path], out["reference"]):
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
      err[n if path == "packed" else f"{path}_{n}"] = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  return err


def timing(hq, hkv, T, rng, min_doc, max_doc):
  D = 128
  ks = jax.random.split(jax.random.key(T), 4)
  q = jax.random.normal(ks[0], (1, T, hq, D), jnp.bfloat16)
  k = jax.random.normal(ks[1], (1, T, hkv, D), jnp.bfloat16)
  v = jax.random.normal(ks[2], (1, T, hkv, D), jnp.bfloat16)
  do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
  seg = jnp.asarray(packed_segments(rng, T, min_doc, max_doc))[None]
  pos = jnp.arange(T)
  variants = {
      "causal_no_doc_mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                         implementation="cudnn"),
      "masked_bias": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=causal_mask(pos, pos, seg, seg),
                                                                  implementation="cudnn"),
      "packed": lambda q, k, v: packed_cudnn_attention(q, k, v, seg),
      "packed_fallback": lambda q, k, v: packed_cudnn_attention(q, k, v, seg, max_runs=2),  # the blockwise branch
  }
  docs = int(jnp.max(seg))
  rows = []
  for name, f in variants.items():
    step = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](do))
    t = timeit(step, q, k, v)
    rows.append({"T": T, "heads": hq, "kv_heads": hkv, "variant": name, "docs": docs, "fwd_bwd_ms": 1e3 * t,
                 "causal_tflops": 3.5 * 2 * hq * D * T * T / t / 1e12})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--heads", action="append")
  ap.add_argument("--seq", type=int, action="append")
  ap.add_argument("--min_doc", type=int, default=64)
  ap.add_argument("--max_doc", type=int, default=8192)
  ap.add_argument("--out", default="packed_attention.json")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "checks": {}, "timing": []}
  for heads in args.heads or ["8/2", "16/1"]:
    hq, hkv = map(int, heads.split("/"))
    res["checks"][heads] = check(hq, hkv, rng)
    print(f"packed cuDNN vs f32 reference, heads {heads}: {json.dumps(res['checks'][heads])}", flush=True)
    for T in args.seq or [32768]:
      res["timing"] += timing(hq, hkv, T, rng, args.min_doc, args.max_doc)
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
