"""Memory sanity check of the XLA MSA path at a long-ish sequence on CPU.

    python -m pallas_kernels.msa.memory_check [--seq 16384] [--with-select] [--with-kl]

Runs `sparse_attention` forward + backward (implementation="xla") at T = S = 16384, Hq = 8, Hkv = 2, D = 64,
topk = 8, block 64 and prints the process's peak RSS and the wall time. A T x S f32 array per KV head would be 1 GiB
here (the dense-masked formulation needs several of them), so a peak RSS well under 4 GB shows that nothing of that
size is materialised, in the forward or in the backward. `--with-select` / `--with-kl` also run `select_blocks` and
`kl_loss` (value + gradient) on the same inputs.
"""

from __future__ import annotations

import argparse
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import msa


def _peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is in KiB on Linux


def _synthetic_block_idx(rng: np.random.Generator, B: int, Hkv: int, T: int, S: int, block_size: int,
                         topk: int) -> np.ndarray:
  """A valid selection without the index scores: own block, then random distinct older blocks, then -1."""
  num_blocks = -(-S // block_size)
  q_block = (S - T + np.arange(T)) // block_size  # [T]
  noise = rng.random((B, Hkv, T, num_blocks))
  older = np.arange(num_blocks) < q_block[:, None]  # [T, num_blocks]
  noise = np.where(older, noise, -1.0)
  picks = np.argsort(-noise, axis=-1)[..., :topk - 1]  # [B, Hkv, T, topk - 1], random older blocks first
  picks = np.where(np.take_along_axis(np.broadcast_to(older, noise.shape), picks, -1), picks, -1)
  own = np.broadcast_to(q_block[:, None], (B, Hkv, T, 1))
  return np.concatenate([own, picks], axis=-1).astype(np.int32)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--with-select", action="store_true")
  parser.add_argument("--with-kl", action="store_true")
  args = parser.parse_args()
  B, T, S, Hq, Hkv, D, d_idx, block_size, topk = 1, args.seq, args.seq, 8, 2, 64, 32, 64, 8

  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32))
  k = jnp.asarray(rng.standard_normal((B, S, Hkv, D), np.float32))
  v = jnp.asarray(rng.standard_normal((B, S, Hkv, D), np.float32))
  dout = jnp.asarray(rng.standard_normal((B, T, Hq, D), np.float32))
  block_idx = jnp.asarray(_synthetic_block_idx(rng, B, Hkv, T, S, block_size, topk))
  print(f"backend={jax.default_backend()} B={B} T=S={S} Hq={Hq} Hkv={Hkv} D={D} topk={topk} block={block_size}")
  print(f"after inputs: peak RSS {_peak_rss_gb():.2f} GB")

  def fwd_bwd(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: msa.sparse_attention(q, k, v, block_idx, block_size=block_size,
                                                            implementation="xla"), q, k, v)
    return out, vjp(dout)

  t0 = time.perf_counter()
  out, grads = jax.jit(fwd_bwd)(q, k, v)
  jax.block_until_ready((out, grads))
  print(f"sparse_attention fwd+bwd: {time.perf_counter() - t0:.1f} s (incl. compile), "
        f"peak RSS {_peak_rss_gb():.2f} GB, |out| {float(jnp.abs(out).mean()):.4f}")

  if args.with_select or args.with_kl:
    q_idx = jnp.asarray(rng.standard_normal((B, T, Hkv, d_idx), np.float32))
    k_idx = jnp.asarray(rng.standard_normal((B, S, d_idx), np.float32))
  if args.with_select:
    t0 = time.perf_counter()
    sel = jax.block_until_ready(msa.select_blocks(q_idx, k_idx, block_size=block_size, topk=topk))
    print(f"select_blocks (d_idx={d_idx}): {time.perf_counter() - t0:.1f} s (incl. compile), "
          f"peak RSS {_peak_rss_gb():.2f} GB, shape {sel.shape}")
  if args.with_kl:
    t0 = time.perf_counter()
    loss, g = jax.value_and_grad(
        lambda qi, ki: msa.kl_loss(q, k, qi, ki, block_idx, block_size=block_size), argnums=(0, 1))(q_idx, k_idx)
    jax.block_until_ready((loss, g))
    print(f"kl_loss value+grad: {time.perf_counter() - t0:.1f} s (incl. compile), "
          f"peak RSS {_peak_rss_gb():.2f} GB, loss {float(loss):.4f}")


if __name__ == "__main__":
  main()
