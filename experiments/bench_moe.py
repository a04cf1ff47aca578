r"""The grouped matmul of a dropless MoE on the GPU (issue 20): every `pallas_kernels.grouped_matmul`
implementation checked against float32 XLA on the same inputs (output and both gradients), then timed forward and
forward + backward at small_lm's MoE shapes (slots = batch x seq x top-k rows sorted into 16 experts). Prints a table
and writes JSON. The whole-model comparison (tokens/s, MFU) is `experiments.bench_train` over configs/small_lm.py
with `moe_impl=capacity` vs `moe_impl=ragged` and `--config.model.grouped_matmul_impl=...`.

  python3 -m experiments.bench_moe --impl=mosaic,tokamax,tiled,xla --out=$OUT/bench_moe.json
  python3 -m experiments.bench_moe --sweep --tokens=49152 --out=$OUT/sweep.json   # the mosaic kernels' tiles

--sweep times each Mosaic GPU kernel alone (fwd, dx, dw of both matmuls) over a grid of tile sizes with the CUPTI
kernel timer of `jax.experimental.mosaic.gpu.profiler` (device time only, median of --iterations), after checking
each config's output against float32 XLA, and prints the best `mosaic.Tiles` per kernel (summed over the two
matmuls) for `pallas_kernels/grouped_matmul/mosaic.py`.

Routing: slots per expert drawn from a multinomial over expert shares ~ Dirichlet(--skew) (large skew: balanced).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul import mosaic


def group_sizes(rng, slots: int, experts: int, skew: float) -> np.ndarray:
  return rng.multinomial(slots, rng.dirichlet(np.full(experts, skew))).astype(np.int32)


def rel_err(a, b) -> float:
  a, b = np.float64(a), np.float64(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def loss_fn(impl):
  def f(x, w, gs, cot):
    return jnp.sum(grouped_matmul(x, w, gs, implementation=impl).astype(jnp.float32) * cot)
  return f


def check(impl, m, k, n, g, rng) -> dict:
  """Relative errors of y, dx, dw (bf16 inputs) against XLA on the same bf16 values in float32."""
  gs = jnp.asarray(group_sizes(rng, m, g, 1.0))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
  cot = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  y = jax.jit(lambda x, w: grouped_matmul(x, w, gs, implementation=impl))(x, w)
  dx, dw = jax.jit(jax.grad(loss_fn(impl), (0, 1)))(x, w, gs, cot)
  x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
  y_ref = jax.jit(lambda x, w: grouped_matmul(x, w, gs, implementation="xla"))(x32, w32)
  dx_ref, dw_ref = jax.jit(jax.grad(loss_fn("xla"), (0, 1)))(x32, w32, gs, cot)
  return {"y": rel_err(y, y_ref), "dx": rel_err(dx, dx_ref), "dw": rel_err(dw, dw_ref),
          "sizes": [int(s) for s in gs]}


def bench(impl, m, k, n, g, skew, rng) -> dict:
  gs = jnp.asarray(group_sizes(rng, m, g, skew))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
  cot = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
  fwd = jax.jit(lambda x, w: grouped_matmul(x, w, gs, implementation=impl))
  both = jax.jit(jax.grad(loss_fn(impl), (0, 1)))
  flops = 2.0 * m * k * n
  t_f = timeit(fwd, x, w, warmup=2, repeat=10)
  t_b = timeit(both, x, w, gs, cot, warmup=2, repeat=10)
  return {"fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_b, "fwd_tflops": flops / t_f / 1e12,
          "fwd_bwd_tflops": 3 * flops / t_b / 1e12, "max_group": int(gs.max()), "min_group": int(gs.min())}


# Candidates per kernel: (block_m, block_n) output tiles whose f32 accumulator fits one warpgroup's registers
# (block_m x block_n / 128 threads: 64-256 f32 per thread; 128 x 256 may spill), pipeline depths and the grid's snake
# width. N = 2048 and 1024 rule out 192-wide tiles.
SWEEP_MN = ((128, 128), (64, 256), (64, 128), (128, 64), (128, 256))  # the likeliest first: each kernel has a deadline
SWEEP_STEPS = (4, 6)
SWEEP_GRID_N = (4, 1)
SWEEP_K_DW = (64, 128)


def sweep_configs(kernel: str, k_out: int, n_out: int) -> list[mosaic.Tiles]:
  """Tiles to try for one kernel whose output columns (ragged_dot) or K x N tile (dw) are k_out x n_out."""
  out = []
  ks = SWEEP_K_DW if kernel == "dw" else (64,)
  for (bm, bn), steps, gbn, bk in itertools.product(SWEEP_MN, SWEEP_STEPS, SWEEP_GRID_N, ks):
    if n_out % bn or (kernel == "dw" and k_out % bm):
      continue
    out.append(mosaic.Tiles(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn))
  return out


def sweep(args) -> dict:
  """Device ms of every (kernel, matmul, tiles) at the model's shapes; configs that fail to compile (shared memory)
  or disagree with XLA are recorded as such."""
  from jax.experimental.mosaic.gpu import profiler
  rd, trd = mosaic._kernels()
  m, d, i, g = args.tokens * args.top_k, args.d_model, args.intermediate, args.experts
  rng = np.random.default_rng(0)
  gs = jnp.asarray(group_sizes(rng, m, g, args.skew))
  rows = {}
  for name, (k, n) in {"gate_up": (d, 2 * i), "down": (i, d)}.items():
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    x32, w32, dy32 = (a.astype(jnp.float32) for a in (x, w, dy))
    refs = {"fwd": jax.lax.ragged_dot(x32, w32, gs),  # [M, N]
            "dx": jax.lax.ragged_dot(dy32, jnp.swapaxes(w32, 1, 2), gs),  # [M, K]
            "dw": jax.grad(lambda w: jnp.sum(jax.lax.ragged_dot(x32, w, gs) * dy32))(w32)}  # [G, K, N]
    # kernel -> (the call at given tiles, (k_out, n_out) for sweep_configs): fwd's output columns are N, dx's K,
    # dw's output tile K x N
    calls = {"fwd": (lambda t: lambda x, w, dy: rd(x, w, group_sizes=gs, **dataclasses.asdict(t)), (k, n)),
             "dx": (lambda t: lambda x, w, dy: rd(dy, w, group_sizes=gs, transpose_rhs=True,
                                                   **dataclasses.asdict(t)), (n, k)),
             "dw": (lambda t: lambda x, w, dy: trd(x, dy, group_sizes=gs, **dataclasses.asdict(t)), (k, n))}
    used = int(gs.sum())  # rows past the groups are left unwritten by the raw kernels
    for kernel, (make, out_shape) in calls.items():
      configs = sweep_configs(kernel, *out_shape)
      flops = 2.0 * m * k * n
      deadline = time.time() + args.sweep_seconds / 6  # an equal share for each (kernel, matmul)
      for t in configs:
        key = f"{kernel}/{name}/{t.block_m}x{t.block_n}x{t.block_k}/s{t.max_concurrent_steps}/g{t.grid_block_n}"
        if time.time() > deadline:
          rows[key] = {"error": "skipped: --sweep_seconds spent"}
          continue
        try:
          f = jax.jit(make(t))
          got, ms = profiler.measure(f, iterations=args.iterations)(x, w, dy)
          err = rel_err(got, refs[kernel]) if kernel == "dw" else rel_err(got[:used], refs[kernel][:used])
          med = statistics.median(ms)
          rows[key] = {"kernel": kernel, "matmul": name, "tiles": dataclasses.asdict(t), "ms": med,
                       "tflops": flops / (med / 1e3) / 1e12, "rel_err": err}
          print(f"{key:<44}{med:>8.3f} ms {flops / (med / 1e3) / 1e12:>6.0f} TFLOP/s  err {err:.1e}", flush=True)
        except Exception as e:  # shared memory overflow, register spills refused, ...
          rows[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
          print(f"{key:<44} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
  best = {}
  for kernel in ("fwd", "dx", "dw"):
    total = {}
    for key, r in rows.items():
      if r.get("kernel") == kernel and r["rel_err"] < 1e-2:
        tk = json.dumps(r["tiles"], sort_keys=True)
        total.setdefault(tk, {})[r["matmul"]] = r["ms"]
    both = {tk: sum(v.values()) for tk, v in total.items() if len(v) == 2}
    if both:
      tk = min(both, key=both.get)
      best[kernel] = {"tiles": json.loads(tk), "ms_both": both[tk], **{f"ms_{mm}": total[tk][mm] for mm in total[tk]}}
      default = json.dumps(dataclasses.asdict(getattr(mosaic.DEFAULT_TILES, kernel)), sort_keys=True)
      if default in both:  # is the kernel's current default still the best?
        best[kernel]["default_ms_both"] = both[default]
  return {"rows": rows, "best": best, "group_sizes": [int(s) for s in gs]}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--impl", default="mosaic,tokamax,tiled,xla")
  ap.add_argument("--tokens", type=int, default=8 * 4096, help="tokens per step (batch x seq)")
  ap.add_argument("--top_k", type=int, default=2)
  ap.add_argument("--experts", type=int, default=16)
  ap.add_argument("--d_model", type=int, default=1024)
  ap.add_argument("--intermediate", type=int, default=1024)
  ap.add_argument("--skew", type=float, default=8.0, help="Dirichlet concentration of the expert shares")
  ap.add_argument("--check_rows", type=int, default=4096)
  ap.add_argument("--out", default="bench_moe.json")
  ap.add_argument("--sweep", action="store_true", help="time the mosaic kernels over a grid of tiles instead")
  ap.add_argument("--iterations", type=int, default=10, help="--sweep: timed calls per config")
  ap.add_argument("--sweep_seconds", type=float, default=300.0, help="--sweep: seconds for all configs (a sixth per kernel and matmul)")
  args = ap.parse_args()
  if args.sweep:
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args), **sweep(args)}
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
    print("\nbest tiles per kernel (ms summed over gate_up + down; default tiles' ms beside):")
    for kernel, b in out["best"].items():
      print(f"  {kernel}: {b['tiles']}  {b['ms_both']:.3f} ms (default {b.get('default_ms_both', float('nan')):.3f})")
    return
  m, d, i, g = args.tokens * args.top_k, args.d_model, args.intermediate, args.experts
  shapes = {"gate_up": (d, 2 * i), "down": (i, d)}
  out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args), "check": {}, "bench": {}}
  for impl in args.impl.split(","):
    rng = np.random.default_rng(0)
    try:
      out["check"][impl] = check(impl, args.check_rows, d, 2 * i, g, rng)
      print(f"check {impl}: {json.dumps(out['check'][impl])}", flush=True)
      for name, (k, n) in shapes.items():
        out["bench"][f"{impl}/{name}"] = r = bench(impl, m, k, n, g, args.skew, rng)
        print(f"{impl}/{name}: {json.dumps(r)}", flush=True)
    except Exception as e:  # one failing implementation (e.g. out of memory) must not lose the others' rows
      out["bench"][f"{impl}/error"] = f"{type(e).__name__}: {str(e)[:500]}"
      traceback.print_exc()
    with open(args.out, "w") as f:
      json.dump(out, f, indent=2)
  print(f"\n{'impl/matmul':<22}{'fwd ms':>9}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}")
  for key, r in out["bench"].items():
    if isinstance(r, dict):
      print(f"{key:<22}{r['fwd_ms']:>9.3f}{r['fwd_tflops']:>9.0f}{r['fwd_bwd_ms']:>12.3f}{r['fwd_bwd_tflops']:>9.0f}")
    else:
      print(f"{key:<22}{r}")


if __name__ == "__main__":
  main()
