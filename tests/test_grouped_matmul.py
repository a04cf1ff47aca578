"""pallas_kernels.grouped_matmul on CPU: the portable implementations against a float64 per-group oracle (values
and both gradients), and the input checks. The Hopper kernels (`mosaic`) are checked on the GPU by
experiments/bench_moe.py against the same function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul import mosaic

from tests.oracles import ATOL, RTOL


def np_grouped(x, w, sizes):
  """float64, one group at a time: rows [start, start + size) times w[g]; rows past the last group are 0."""
  x, w = np.float64(x), np.float64(w)
  y = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, size in enumerate(sizes):
    y[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return y


CASES = [([5, 0, 7, 4], 16),   # an empty group, every row used
         ([3, 9, 0, 0], 16),   # trailing empty groups, rows past the sum
         ([0, 0, 11, 0], 11)]  # one group holds everything


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("sizes,m", CASES)
def test_matches_per_group_oracle_and_gradients(impl, sizes, m):
  kx, kw, kc = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, 8), jnp.float32)
  w = jax.random.normal(kw, (len(sizes), 8, 6), jnp.float32)
  cot = np.asarray(jax.random.normal(kc, (m, 6), jnp.float32))
  gs = jnp.asarray(sizes, jnp.int32)
  y = grouped_matmul(x, w, gs, implementation=impl)
  np.testing.assert_allclose(y, np_grouped(x, w, sizes), atol=ATOL, rtol=RTOL)
  dx, dw = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, gs, implementation=impl) * cot), (0, 1))(x, w)
  # d/dx sum(cot * y) = cot @ w[g]^T per row; d/dw[g] = x_g^T cot_g: the oracle applied to transposed operands.
  ref_dx = np_grouped(cot, np.swapaxes(np.asarray(w), 1, 2), sizes)
  ref_dw = np.zeros(w.shape)
  start = 0
  for g, size in enumerate(sizes):
    ref_dw[g] = np.float64(x[start:start + size]).T @ np.float64(cot[start:start + size])
    start += size
  np.testing.assert_allclose(dx, ref_dx, atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(dw, ref_dw, atol=ATOL, rtol=RTOL)


def test_bad_inputs_name_the_problem():
  x, w, gs = jnp.ones((4, 8)), jnp.ones((2, 8, 6)), jnp.array([2, 2], jnp.int32)
  with pytest.raises(ValueError, match="disagree on K"):
    grouped_matmul(x, jnp.ones((2, 4, 6)), gs)
  with pytest.raises(ValueError, match="one entry per group"):
    grouped_matmul(x, w, jnp.array([4], jnp.int32))
  with pytest.raises(TypeError, match="must be integer"):
    grouped_matmul(x, w, jnp.array([2.0, 2.0]))
  with pytest.raises(ValueError, match="implementation='cuda'"):
    grouped_matmul(x, w, gs, implementation="cuda")
  with pytest.raises(TypeError, match="share a dtype"):
    grouped_matmul(x.astype(jnp.bfloat16), w, gs, implementation="mosaic")
  # The Hopper kernels' tiles: a clear message before any lowering (K = 8 is not a multiple of 64).
  with pytest.raises(ValueError, match="multiple of 64"):
    grouped_matmul(x, w, gs, implementation="mosaic")
  mosaic.check_shapes(256, 1024, 2048)  # the MoE shapes of small_lm pass
