r"""The grouped matmul of a dropless MoE on the GPU (issue 20): every `pallas_kernels.grouped_matmul`
implementation checked against float32 XLA on the same inputs (output and both gradients), then timed forward and
forward + backward at small_lm's MoE shapes (slots = batch x seq x top-k rows sorted into 16 experts). Prints a table
and writes JSON. The whole-model comparison (tokens/s, MFU) is `experiments.bench_train` over configs/small_lm.py
with `moe_impl=capacity` vs `moe_impl=ragged` and `--config.model.grouped_matmul_impl=...`.

  python3 -m experiments.bench_moe --impl=mosaic,tokamax,tiled,xla --out=$OUT/bench_moe.json

Routing: slots per expert drawn from a multinomial over expert shares ~ Dirichlet(--skew) (large skew: balanced).
"""

from __future__ import annotations

import argparse
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib.timing import timeit
from pallas_kernels.grouped_matmul import grouped_matmul


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
  args = ap.parse_args()
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
