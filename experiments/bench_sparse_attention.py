r"""MSA sparse attention on the GPU: correctness of the Pallas kernels on every shape family, then timings at the M3
shape against the xla implementation, cuDNN dense causal attention and fla-core's NSA selected-attention kernel.

  python -m experiments.bench_sparse_attention --check --seq=32768 --seq=131072 --fla --out=$OUT/bench.json

Sections (each appends to the JSON as soon as it finishes, so a run cut short still reports what it measured):
  check   every shape family (G in 1..16, D 64/128, bf16/f32, ragged S, segments, partial rows): Pallas forward and
          VJP against the float32 `reference` on upcast inputs (relative L2 error), the query-major baseline's
          forward, and bitwise equality of two runs.
  timing  M3 shape (Hq=64, Hkv=4, D=128, block 128, top-16), bf16, batch 1, selection from `select_blocks` (xla)
          on random index q/k. Median of `--repeat` runs after 2 warm-ups. Useful FLOPs: forward
          4*Hq*D*T*topk*block (causal ignored), forward+backward 3.5x that (2 matmuls forward, 5 backward, as
          FlashAttention counts); dense causal 2*Hq*D*T^2 forward, 3.5x for forward+backward.
"""

from __future__ import annotations

import argparse
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from pallas_kernels import msa
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import reference as msa_reference

HQ, HKV, D, BS, TOPK = 64, 4, 128, 128, 16


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_problem(key, B, T, S, Hq, Hkv, d, bs, topk, dtype, segments=False, local_blocks=1):
  ks = jax.random.split(key, 6)
  q = jax.random.normal(ks[0], (B, T, Hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, Hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, Hkv, d), jnp.float32).astype(dtype)
  qi = jax.random.normal(ks[3], (B, T, Hkv, 32), jnp.float32)
  ki = jax.random.normal(ks[4], (B, S, 32), jnp.float32)
  seg = None
  if segments:
    seg = jnp.sort(jax.random.randint(ks[5], (B, S), 0, 3), axis=1).astype(jnp.int32)
  sel = msa.select_blocks(qi, ki, block_size=bs, topk=topk, local_blocks=local_blocks, implementation="xla",
                          segment_ids=seg)
  return q, k, v, sel, seg


# ---------------------------------------------------------------------------------------------------------------------
# check: every shape family lowers and matches the reference
# ---------------------------------------------------------------------------------------------------------------------

FAMILIES = [
    # name, G, Hkv, D, T, S, topk, dtype, segments
    ("g1_d128_bf16", 1, 4, 128, 512, 512, 4, "bfloat16", False),
    ("g2_d128_bf16", 2, 4, 128, 512, 512, 4, "bfloat16", False),
    ("g4_d128_bf16", 4, 2, 128, 512, 512, 4, "bfloat16", False),
    ("g8_d128_bf16", 8, 2, 128, 512, 512, 4, "bfloat16", False),
    ("g16_d128_bf16", 16, 2, 128, 512, 512, 4, "bfloat16", False),
    ("g16_d64_bf16", 16, 2, 64, 512, 512, 4, "bfloat16", False),
    ("g1_d64_bf16", 1, 2, 64, 512, 512, 4, "bfloat16", False),
    ("g4_d128_f32", 4, 2, 128, 384, 384, 4, "float32", False),
    ("g8_d64_f32_ragged_chunk", 8, 2, 64, 200, 1000, 5, "float32", False),  # S % 128 != 0, T < S (chunked prefill)
    ("g16_d128_bf16_segments_ragged", 16, 2, 128, 700, 700, 4, "bfloat16", True),
]


def check_families(log):
  rows = []
  for i, (name, G, Hkv, d, T, S, topk, dtype, segments) in enumerate(FAMILIES):
    try:
      q, k, v, sel, seg = random_problem(jax.random.key(100 + i), 1, T, S, G * Hkv, Hkv, d, BS, topk,
                                         jnp.dtype(dtype), segments)
      do = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(q.dtype)
      kw = dict(block_size=BS, segment_ids=seg)
      def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: msa.sparse_attention(q, k, v, sel, implementation="pallas", **kw), q, k, v)
        return out, vjp(do)

      f = jax.jit(fwd_bwd)
      out, grads = f(q, k, v, do)
      out2, grads2 = f(q, k, v, do)
      up = lambda x: x.astype(jnp.float32)  # noqa: E731
      with jax.default_matmul_precision("highest"):  # XLA's GPU default for f32 matmuls is tf32
        ref_out, ref_vjp = jax.vjp(lambda q, k, v: msa_reference.sparse_attention(q, k, v, sel, **kw),
                                   up(q), up(k), up(v))
        ref_grads = ref_vjp(up(do))
      qm = msa_pallas.sparse_attention_query_major(q, k, v, sel, **kw)
      row = {"family": name, "G": G, "D": d, "T": T, "S": S, "topk": topk, "dtype": dtype, "segments": segments,
             "rel_out": rel(out, ref_out), **{f"rel_{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads)},
             "rel_query_major_out": rel(qm, ref_out),
             "deterministic": bool(np.array_equal(np.asarray(out), np.asarray(out2)) and all(
                 np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(grads, grads2))),
             "finite": bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in (out, *grads)))}
    except Exception as e:  # noqa: BLE001 - report every family, keep going
      row = {"family": name, "error": f"{type(e).__name__}: {e}"[:2000]}
      traceback.print_exc()
    rows.append(row)
    log(row)
  return rows


# ---------------------------------------------------------------------------------------------------------------------
# timing at the M3 shape
# ---------------------------------------------------------------------------------------------------------------------


def fla_times(q, k, v, sel, do, repeat):
  """fla-core NSA selected attention (PyTorch + Triton) on the same inputs and per-token selection."""
  import torch  # noqa: PLC0415 - only on the GPU box
  from fla.ops.nsa.parallel import parallel_nsa  # noqa: PLC0415
  import triton  # noqa: PLC0415

  def to_torch(x):
    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
      return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(x).cuda()

  tq, tk, tv, tdo = map(to_torch, (q, k, v, do))
  idx = torch.from_numpy(np.asarray(sel).transpose(0, 2, 1, 3).astype(np.int64)).cuda()  # [B, T, Hkv, topk]
  fwd = lambda: parallel_nsa(tq, tk, tv, block_indices=idx, block_counts=sel.shape[-1], block_size=BS)  # noqa: E731
  out = fwd()
  tq.requires_grad_(True); tk.requires_grad_(True); tv.requires_grad_(True)  # noqa: E702

  def fwd_bwd():
    o = parallel_nsa(tq, tk, tv, block_indices=idx, block_counts=sel.shape[-1], block_size=BS)
    o.backward(tdo)

  t_f = triton.testing.do_bench(fwd, warmup=200, rep=max(500, 50 * repeat), return_mode="median") / 1e3
  t_fb = triton.testing.do_bench(fwd_bwd, warmup=200, rep=max(500, 50 * repeat), return_mode="median",
                                 grad_to_none=[tq, tk, tv]) / 1e3
  out_np = out.float().cpu().numpy()
  del tq, tk, tv, tdo, idx
  torch.cuda.empty_cache()
  return t_f, t_fb, out_np


def components(q, k, v, sel, do, rec, args):
  """Each stage of the default KV-outer forward and backward jitted alone, on the outputs of the stage before."""
  from pallas_kernels.msa import pallas_bwd, pallas_fwd  # noqa: PLC0415
  from pallas_kernels.msa.pallas_map import build_kv_map  # noqa: PLC0415
  B, T = q.shape[:2]
  G, nb, K = HQ // HKV, T // BS, sel.shape[-1]
  cfg = msa_pallas.KernelConfig(block_size=BS, scale=D ** -0.5, interpret=False)
  R, Rb, TQ = cfg.fwd_rows(q.dtype) // G, cfg.bwd_rows_for(q.dtype) // G, cfg.merge_rows // G
  offset = jnp.zeros((B,), jnp.int32)
  q2, do2 = q.reshape(B, T * HQ, D), do.reshape(B, T * HQ, D)
  mk = jax.jit(lambda s: build_kv_map(s, nb, R * cfg.fwd_steps, pad=max(R, Rb)))
  rec("part_kv_map", timeit(mk, sel, repeat=args.repeat))
  kv_map = mk(sel)
  part = jax.jit(lambda q2, k, v, m: pallas_fwd.kv_outer_partials(
      q2, k, v, m, offset, None, G=G, R=R, bs=BS, scale=cfg.scale, partial_dtype=q.dtype, interpret=False,
      num_warps=cfg.num_warps, num_stages=cfg.fwd_stages))
  rec("part_fwd_partials", timeit(part, q2, k, v, kv_map, repeat=args.repeat))
  o_part, lse_part = part(q2, k, v, kv_map)
  merge = jax.jit(lambda m, o, l: pallas_fwd.merge_partials(
      m.pair_pos, o, l, B=B, T_pad=T, Hq=HQ, Hkv=HKV, K=K, TQ=TQ, out_dtype=q.dtype, interpret=False,
      num_warps=cfg.merge_warps, num_stages=cfg.merge_stages))
  rec("part_fwd_merge", timeit(merge, kv_map, o_part, lse_part, repeat=args.repeat))
  out, lse = merge(kv_map, o_part, lse_part)
  del o_part, lse_part
  delta = jnp.sum(do2.astype(jnp.float32) * out.astype(jnp.float32), -1)
  bwd = jax.jit(lambda q2, k, v, do2, lse, delta, m: pallas_bwd.kv_outer_backward(
      q2, k, v, do2, lse, delta, m, offset, None, G=G, R=Rb, bs=BS, scale=cfg.scale,
      dq_dtype=q.dtype, interpret=False, num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages))
  rec("part_bwd_dkv_dqpart", timeit(bwd, q2, k, v, do2, lse, delta, kv_map, repeat=args.repeat))
  dq_part = bwd(q2, k, v, do2, lse, delta, kv_map)[2]
  mdq = jax.jit(lambda m, d: pallas_bwd.merge_dq(m.pair_pos, d, B=B, T_pad=T, Hq=HQ, Hkv=HKV, K=K, TQ=TQ,
                                                 out_dtype=q.dtype, interpret=False, num_warps=cfg.merge_warps,
                                                 num_stages=cfg.merge_stages))
  rec("part_bwd_dq_merge", timeit(mdq, kv_map, dq_part, repeat=args.repeat))


def timing(T, args, log):
  q, k, v, sel, _ = random_problem(jax.random.key(0), 1, T, T, HQ, HKV, D, BS, TOPK, jnp.bfloat16)
  do = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(jnp.bfloat16)
  fwd_flops = 4 * HQ * D * T * TOPK * BS
  dense_flops = 2 * HQ * D * T * T
  row = {"T": T, "empty_slot_fraction": float(jnp.mean(sel < 0)), "useful_fwd_tflop": fwd_flops / 1e12}

  def rec(name, seconds, flops=None):
    row[f"{name}_ms"] = 1e3 * seconds
    if flops:
      row[f"{name}_tflops"] = flops / seconds / 1e12
    log({"T": T, name + "_ms": round(1e3 * seconds, 3)})

  def vjp_fn(attn):
    return jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))

  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa
  rec("cudnn_fwd", timeit(jax.jit(cudnn), q, k, v, repeat=args.repeat), dense_flops)
  rec("cudnn_fwd_bwd", timeit(vjp_fn(cudnn), q, k, v, do, repeat=args.repeat), 3.5 * dense_flops)

  pallas = lambda **kn: (lambda q, k, v: msa_pallas.sparse_attention(q, k, v, sel, block_size=BS, **kn))  # noqa
  out_p = jax.jit(pallas())(q, k, v)
  if args.xla and T <= args.xla_max_t:
    xla = lambda q, k, v: msa.sparse_attention(q, k, v, sel, block_size=BS, implementation="xla")  # noqa: E731
    rec("xla_fwd", timeit(jax.jit(xla), q, k, v, repeat=3), fwd_flops)
    # Accuracy at scale: every bf16 path against the xla implementation on float32 upcasts of the same inputs.
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):
      out_32, g32 = jax.jit(lambda q, k, v, do: (xla(q, k, v), jax.vjp(xla, q, k, v)[1](do)))(
          up(q), up(k), up(v), up(do))
    row["rel_pallas_vs_f32_out"] = rel(out_p, out_32)
    row["rel_xla_bf16_vs_f32_out"] = rel(jax.jit(xla)(q, k, v), out_32)
    for tag, fn in (("xla_bf16", xla), ("pallas", pallas()), ("pallas_dq_f32", pallas(dq_dtype="float32")),
                    ("pallas_dq_bf16", pallas(dq_dtype="bfloat16"))):
      for n, a, b in zip("qkv", vjp_fn(fn)(q, k, v, do), g32):
        row[f"rel_{tag}_vs_f32_d{n}"] = rel(a, b)
    log({kk: vv for kk, vv in row.items() if kk.startswith("rel_")})
    del g32, out_32
  qm = jax.jit(lambda q, k, v: msa_pallas.sparse_attention_query_major(q, k, v, sel, block_size=BS))
  row["rel_query_major_vs_kv_outer"] = rel(qm(q, k, v), out_p)
  rec("pallas_query_major_fwd", timeit(qm, q, k, v, repeat=args.repeat), fwd_flops)

  components(q, k, v, sel, do, rec, args)
  for variant in args.variants:
    kn = dict(json.loads(variant))
    tag = "pallas_kv_outer" + "".join(f"_{a}{b}" for a, b in kn.items())
    try:
      rec(tag + "_fwd", timeit(jax.jit(pallas(**kn)), q, k, v, repeat=args.repeat), fwd_flops)
      rec(tag + "_fwd_bwd", timeit(vjp_fn(pallas(**kn)), q, k, v, do, repeat=args.repeat), 3.5 * fwd_flops)
    except Exception as e:  # noqa: BLE001
      row[tag + "_error"] = f"{type(e).__name__}: {e}"[:1000]
      traceback.print_exc()

  if args.fla:
    try:
      t_f, t_fb, out_fla = fla_times(q, k, v, sel, do, args.repeat)
      rec("fla_nsa_fwd", t_f, fwd_flops)
      rec("fla_nsa_fwd_bwd", t_fb, 3.5 * fwd_flops)
      row["rel_fla_vs_pallas_out"] = rel(out_fla, out_p)
    except Exception as e:  # noqa: BLE001
      row["fla_error"] = f"{type(e).__name__}: {e}"[:1000]
      traceback.print_exc()
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", action="store_true")
  ap.add_argument("--seq", type=int, action="append", default=[])
  ap.add_argument("--fla", action="store_true")
  ap.add_argument("--xla", action="store_true")
  ap.add_argument("--xla_max_t", type=int, default=32768)
  ap.add_argument("--repeat", type=int, default=10)
  ap.add_argument("--rows", type=int, action="append", default=None)
  ap.add_argument("--variant", dest="variants", action="append", default=None,
                  help='KernelConfig overrides as JSON, e.g. {"rows": 64, "num_warps": 4}')
  ap.add_argument("--out", default="bench_sparse_attention.json")
  args = ap.parse_args()
  args.rows = args.rows or [128]
  args.variants = args.variants or ["{}"]
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "block": BS, "topk": TOPK, "dtype": "bfloat16", "B": 1},
            "check": [], "timing": []}

  def save():
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)

  def log(x):
    print(json.dumps(x), flush=True)
    save()

  if args.check:
    result["check"] = check_families(log)
  for T in args.seq:
    result["timing"].append(timing(T, args, log))
    save()
  for r in result["timing"]:
    print("\n".join(f"T={r['T']:>7} {k:<48} {v:.4g}" for k, v in r.items() if isinstance(v, float)))
  save()


if __name__ == "__main__":
  main()
