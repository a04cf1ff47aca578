"""pallas_kernels.grouped_matmul on CPU: the portable implementations against a float64 per-group oracle (values
and both gradients), and the input checks. The Hopper kernels (`mosaic`) are checked on the GPU by
experiments/bench_moe.py against the same function."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul import mosaic, tiled

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


@pytest.mark.parametrize("impl", ["xla", "tiled", "reference"])
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
  # each product's own tiles are checked against the sizes that product tiles (dx: its output columns are K)
  wide_dx = mosaic.KernelTiles(dx=mosaic.Tiles(block_n=256))
  with pytest.raises(ValueError, match=r"K \(x's columns\) = 640 must be a multiple of 256 \(dx block_n"):
    mosaic.check_shapes(256, 640, 2048, wide_dx)
  mosaic.check_shapes(256, 1024, 2048, wide_dx)
  mosaic.check_shapes(256, 768, 1536)  # M3's experts with I split 4 ways (the defaults' snake takes partial strips)


@pytest.mark.parametrize("sizes,tile", [((5, 0, 20, 9), 8), ((0, 0, 40), 512), ((25, 25), 4)])
def test_tiled_matches_ragged_dot_across_tile_sizes(sizes, tile):
  """The tiled grouped matmul (one-group tiles, scanned) at several tile sizes against jax.lax.ragged_dot: values and
  both gradients, with empty groups, groups that end mid-tile, and rows past the last group (zero rows out, zero
  gradient in)."""
  rng = np.random.default_rng(0)
  m, used = sum(sizes) + 7, sum(sizes)
  x = jnp.asarray(rng.standard_normal((m, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), 6, 5)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  live = (jnp.arange(m) < used)[:, None]

  def ours(x, w):
    return jnp.sum(jnp.sin(tiled.grouped_matmul(x, w, gs, tile=tile)))

  def reference(x, w):  # the tail rows join the last group there, and are masked out
    y = jax.lax.ragged_dot(x, w, gs.at[-1].add(m - used), preferred_element_type=jnp.float32)
    return jnp.sum(jnp.sin(jnp.where(live, y, 0.0)))

  (a, (dxa, dwa)), (b, (dxb, dwb)) = (jax.value_and_grad(f, (0, 1))(x, w) for f in (ours, reference))
  np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(dxa), np.asarray(dxb), atol=1e-5)
  np.testing.assert_allclose(np.asarray(dwa), np.asarray(dwb), atol=1e-5)
  assert not np.any(np.asarray(dxa)[used:])
  assert np.any(np.asarray(tiled.grouped_matmul(x, w, gs, tile=tile))[:used])
