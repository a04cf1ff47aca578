r"""GPU lowering and correctness of the issue-5 Pallas kernels (`select_blocks`, `kl_loss`, `sparse_decode`)
against the `reference` implementations, one shape family at a time (a family that fails to lower is reported,
the others still run). Matmuls of the reference run at full f32 precision so that they are a fair oracle.

  python -m experiments.check_msa_kernels --out=$OUT/check_msa_kernels.json

Selections are compared exactly (same block ids in the same slots); `rows_equal` is the fraction of (b, group,
query) rows that agree, `sets_equal` the fraction whose selected sets agree. KL: relative error of the loss and of
its gradients in q_idx and k_idx. Decode: relative error of the output and exact equality of the selection.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import msa

jax.config.update("jax_default_matmul_precision", "highest")


def _rand(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _segments(key, B, S, n):
  cuts = np.sort(np.asarray(jax.random.randint(key, (B, n - 1), 1, S)), axis=1)
  pos = np.arange(S)
  return jnp.asarray((pos[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)  # [B, S]


def compare_idx(a, b) -> dict:
  a, b = np.asarray(a), np.asarray(b)
  rows_equal = float(np.mean(np.all(a == b, axis=-1)))
  sets_equal = float(np.mean(np.all(np.sort(a, -1) == np.sort(b, -1), axis=-1)))
  return {"exact": bool(np.array_equal(a, b)), "rows_equal": rows_equal, "sets_equal": sets_equal}


SELECT_FAMILIES = [
    dict(name="f32_small", B=2, T=1024, S=1024, Hkv=2, di=64, bs=64, topk=8, local=1, dtype="float32"),
    dict(name="bf16_small", B=2, T=1024, S=1024, Hkv=2, di=64, bs=64, topk=8, local=1, dtype="bfloat16"),
    dict(name="f32_ragged_S", B=1, T=1000, S=1000, Hkv=4, di=32, bs=64, topk=6, local=2, dtype="float32"),
    dict(name="f32_chunk_T<S", B=2, T=256, S=2048, Hkv=2, di=64, bs=128, topk=8, local=1, dtype="float32"),
    dict(name="f32_segments", B=2, T=1024, S=1024, Hkv=2, di=64, bs=64, topk=8, local=1, dtype="float32", seg=4),
    dict(name="bf16_m3_8k", B=1, T=8192, S=8192, Hkv=4, di=128, bs=128, topk=16, local=1, dtype="bfloat16"),
    dict(name="f32_m3_8k", B=1, T=8192, S=8192, Hkv=4, di=128, bs=128, topk=16, local=1, dtype="float32"),
]

KL_FAMILIES = [
    dict(name="f32_g4_d64", B=2, T=512, S=512, Hq=8, Hkv=2, D=64, di=32, bs=64, topk=4, dtype="float32"),
    dict(name="bf16_g4_d64", B=2, T=512, S=512, Hq=8, Hkv=2, D=64, di=32, bs=64, topk=4, dtype="bfloat16"),
    dict(name="f32_g16_d128_seg", B=1, T=1024, S=1024, Hq=64, Hkv=4, D=128, di=128, bs=128, topk=4,
         dtype="float32", seg=3),
    dict(name="bf16_m3_4k", B=1, T=4096, S=4096, Hq=64, Hkv=4, D=128, di=128, bs=128, topk=16, dtype="bfloat16"),
]

DECODE_FAMILIES = [
    dict(name="f32_T1", B=3, T=1, S=4096, Hq=8, Hkv=2, D=64, di=64, bs=64, topk=8, dtype="float32"),
    dict(name="bf16_T4", B=3, T=4, S=4096, Hq=16, Hkv=2, D=128, di=64, bs=128, topk=8, dtype="bfloat16"),
    dict(name="f32_T16_m3", B=2, T=16, S=16384, Hq=64, Hkv=4, D=128, di=128, bs=128, topk=16, dtype="float32"),
    dict(name="bf16_T1_m3_64k", B=2, T=1, S=65536, Hq=64, Hkv=4, D=128, di=128, bs=128, topk=16,
         dtype="bfloat16"),
    dict(name="bf16_T2_m3_64k_fp8cache", B=2, T=2, S=65536, Hq=64, Hkv=4, D=128, di=128, bs=128, topk=16,
         dtype="bfloat16", fp8=True),
]


def check_select(f) -> dict:
  ks = jax.random.split(jax.random.key(0), 3)
  dt = jnp.dtype(f["dtype"])
  qi = _rand(ks[0], (f["B"], f["T"], f["Hkv"], f["di"]), dt)
  ki = _rand(ks[1], (f["B"], f["S"], f["di"]), dt)
  seg = _segments(ks[2], f["B"], f["S"], f["seg"]) if f.get("seg") else None
  kw = dict(block_size=f["bs"], topk=f["topk"], local_blocks=f["local"], segment_ids=seg)
  ref = msa.select_blocks(qi, ki, implementation="reference", **kw)
  got = jax.block_until_ready(msa.select_blocks(qi, ki, implementation="pallas", **kw))
  return compare_idx(got, ref)


def check_kl(f) -> dict:
  ks = jax.random.split(jax.random.key(1), 6)
  dt = jnp.dtype(f["dtype"])
  B, T, S = f["B"], f["T"], f["S"]
  q = _rand(ks[0], (B, T, f["Hq"], f["D"]), dt)
  k = _rand(ks[1], (B, S, f["Hkv"], f["D"]), dt)
  qi = _rand(ks[2], (B, T, f["Hkv"], f["di"]), dt)
  ki = _rand(ks[3], (B, S, f["di"]), dt)
  seg = _segments(ks[4], B, S, f["seg"]) if f.get("seg") else None
  idx = msa.select_blocks(qi, ki, block_size=f["bs"], topk=f["topk"], implementation="reference", segment_ids=seg)
  out = {}
  for impl in ("reference", "pallas"):
    fn = lambda qi, ki: msa.kl_loss(q, k, qi, ki, idx, block_size=f["bs"], implementation=impl,  # noqa: B023
                                    segment_ids=seg)
    val, (gq, gk) = jax.value_and_grad(fn, argnums=(0, 1))(qi, ki)
    out[impl] = jax.block_until_ready((val, gq, gk))
  (v0, gq0, gk0), (v1, gq1, gk1) = out["reference"], out["pallas"]
  return {"loss_ref": float(v0), "loss_rel_err": _rel(v1, v0), "dq_idx_rel_err": _rel(gq1, gq0),
          "dk_idx_rel_err": _rel(gk1, gk0)}


def check_decode(f) -> dict:
  ks = jax.random.split(jax.random.key(2), 6)
  dt = jnp.dtype(f["dtype"])
  B, T, S = f["B"], f["T"], f["S"]
  q = _rand(ks[0], (B, T, f["Hq"], f["D"]), dt)
  kc = _rand(ks[1], (B, S, f["Hkv"], f["D"]), dt)
  vc = _rand(ks[2], (B, S, f["Hkv"], f["D"]), dt)
  qi = _rand(ks[3], (B, T, f["Hkv"], f["di"]), dt)
  kic = _rand(ks[4], (B, S, f["di"]), dt)
  # Different fill levels per row, one of them ending inside a block.
  lengths = jnp.asarray([S - 37 * (i + 1) * (i % 2) - i * f["bs"] for i in range(B)], jnp.int32)
  kw = dict(block_size=f["bs"], topk=f["topk"])
  if f.get("fp8"):  # fp8 index-key cache: the reference scores the same dequantised keys
    kic, kw["k_idx_scale"] = msa.quantize_index(kic)
  o_ref, i_ref = msa.sparse_decode(q, kc, vc, qi, kic, lengths, implementation="reference", **kw)
  o, i = jax.block_until_ready(msa.sparse_decode(q, kc, vc, qi, kic, lengths, implementation="pallas", **kw))
  return {"out_rel_err": _rel(o, o_ref), **{f"idx_{k}": v for k, v in compare_idx(i, i_ref).items()}}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="check_msa_kernels.json")
  ap.add_argument("--only", default="", help="comma-separated: select,kl,decode")
  ap.add_argument("--names", default="", help="comma-separated family names (default: all)")
  a = ap.parse_args()
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "families": []}
  groups = [("select", SELECT_FAMILIES, check_select), ("kl", KL_FAMILIES, check_kl),
            ("decode", DECODE_FAMILIES, check_decode)]
  for op, fams, fn in groups:
    if a.only and op not in a.only.split(","):
      continue
    for f in fams:
      if a.names and f["name"] not in a.names.split(","):
        continue
      t0 = time.perf_counter()
      try:
        r = {"op": op, **f, **fn(f), "ok": True}
      except Exception as e:  # noqa: BLE001 - report the lowering/compile error and go on with the next family
        r = {"op": op, **f, "ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
             "trace": traceback.format_exc()[-3000:]}
      r["seconds"] = time.perf_counter() - t0
      results["families"].append(r)
      print(json.dumps({k: v for k, v in r.items() if k != "trace"})[:1500], flush=True)
      with open(a.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
  main()
