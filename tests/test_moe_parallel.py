"""Expert parallelism (moe_impl="expert_parallel"): on 8 fake CPU devices, tiny_lm's MoE split over `expert` (with
data, fsdp and tensor beside it) gives the losses and gradients of the single-device grouped matmul."""

import json
import os
import subprocess
import sys

import pytest

from tests.train_utils import REPO

EIGHT_DEVICES = r"""
import json
import jax, numpy as np
from flax import nnx
from m3_jax.core.sharding import batch_sharding, make_mesh, state_shardings
from m3_jax.train import config_lib
from m3_jax.train.state import abstract_model
from m3_jax.train.steps import cross_entropy, forward
from tests.model_utils import numpy_values
from tests.train_utils import small_config

# tiny_lm with MoE at the test size: layers (dense, sparse), 4 experts, top-2
base = config_lib.model_config(small_config("unused"))
assert base.num_local_experts == 4 and base.num_experts_per_tok == 2
b, t = 8, 16
rng = np.random.default_rng(0)
ids = rng.integers(0, base.vocab_size, size=(b, t + 1))
mask = np.ones((b, t), np.float32)
mask[3, 10:] = 0.0
batch = {"inputs": ids[:, :-1].astype(np.int32), "targets": ids[:, 1:].astype(np.int32),
         "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
         "segment_ids": np.ones((b, t), np.int32), "loss_mask": mask}
_, params, rest = abstract_model(base)
params = numpy_values(params, seed=0, std=0.1)
rest = numpy_values(rest, seed=1, std=0.05)  # a non-zero router bias: it must reach every shard's routing

def loss_and_grads(cfg, mesh):
  graphdef = abstract_model(cfg)[0]
  def loss(p, r, bt):
    logits, aux = forward(graphdef, p, r, bt)
    ce, _ = cross_entropy(logits, bt["targets"], bt["loss_mask"])
    return ce + cfg.router_aux_loss_coef * aux["moe_aux_loss"]
  p_sh = state_shardings(params, mesh)
  r_sh = state_shardings(rest, mesh)
  bt = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
  fn = jax.jit(jax.value_and_grad(loss))
  with jax.set_mesh(mesh):
    args = (jax.device_put(params, p_sh), jax.device_put(rest, r_sh), bt)
    compiled = fn.lower(*args).compile()  # called directly: jit's own call would compile it a second time
    value, grads = compiled(*args)
  hlo = compiled.as_text()
  return float(value), {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(grads)}, hlo

ref_loss, ref_grads, _ = loss_and_grads(base, make_mesh({"data": 1}, jax.devices()[:1]))
out = {"devices": jax.device_count(), "meshes": {}}
# the second mesh runs the local experts' grouped matmul as scanned tiles (configs/m3.py's default): its custom VJP
# inside the shard_map must give the same gradients as XLA's ragged_dot in the first
for shape, matmul in (({"expert": 4, "data": 2}, "xla"), ({"expert": 2, "fsdp": 2, "tensor": 2}, "tiled")):
  value, grads, hlo = loss_and_grads(base.replace(moe_impl="expert_parallel", grouped_matmul_impl=matmul),
                                     make_mesh(shape))
  err = {k: float(np.max(np.abs(grads[k] - ref_grads[k])) / max(float(np.max(np.abs(ref_grads[k]))), 1e-30))
         for k in ref_grads}
  worst = max(err, key=err.get)
  out["meshes"][str(shape)] = {"loss": value, "ref_loss": ref_loss, "worst_grad": worst, "worst_rel": err[worst],
                               "grads_nonzero": int(sum(np.any(g != 0) for g in grads.values())),
                               "grads": len(grads), "all_to_all": hlo.count("all-to-all")}
# the experts must divide over the expert axis: a clear error, before anything is compiled
try:
  bad = base.replace(num_local_experts=6, moe_impl="expert_parallel")
  g, p6, r6 = abstract_model(bad)
  with jax.set_mesh(make_mesh({"expert": 4, "data": 2})):
    jax.eval_shape(lambda p, r: forward(g, p, r, batch), p6, r6)
  out["error"] = None
except ValueError as e:
  out["error"] = str(e)
print(json.dumps(out))
"""


def test_expert_parallel_meshes_match_one_device():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  out = json.loads(p.stdout.strip().splitlines()[-1])
  assert out["devices"] == 8
  for mesh, m in out["meshes"].items():
    print(f"{mesh}: loss {m['loss']:.7f} vs {m['ref_loss']:.7f}; worst gradient {m['worst_grad']} rel "
          f"{m['worst_rel']:.1e}; {m['all_to_all']} all-to-all ops")
    assert m["all_to_all"] > 0, f"{mesh}: the compiled step exchanges no token slots (not expert-parallel)"
    assert abs(m["loss"] - m["ref_loss"]) <= 1e-6 * abs(m["ref_loss"]), mesh
    # f32: the sharded reductions (tensor psum, fsdp reduce-scatter, token sums) change the summation order only
    assert m["worst_rel"] <= 1e-5, (mesh, m)
    assert m["grads_nonzero"] == m["grads"], f"{mesh}: a parameter got no gradient"
  assert out["error"] is not None and "num_local_experts=6" in out["error"] and "'expert' of size 4" in out["error"]


def test_swiglu_halves_keeps_only_its_bf16_input_for_the_backward():
  """The grouped experts' SwiGLU (moe_parallel.swiglu_halves): the values and gradients of autodiff through the same
  f32 function (bitwise, after the same roundings), while the backward keeps nothing but the bf16 matmul output
  [M, 2I]; plain autodiff keeps f32 [M, I] intermediates of the gate."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from m3_jax.models import moe_parallel

  m, i, alpha, limit = 12, 8, 1.702, 7.0
  rng = np.random.default_rng(0)
  gu = jnp.asarray(rng.standard_normal((m, 2 * i)) * 4.0, jnp.bfloat16)  # beyond +-limit in places: the clips act
  dh = jnp.asarray(rng.standard_normal((m, i)), jnp.bfloat16)

  def plain(g):
    g = g.astype(jnp.float32)
    return moe_parallel.swiglu_oai(g[:, :i], g[:, i:], alpha=alpha, limit=limit).astype(jnp.bfloat16)

  h, vjp = jax.vjp(lambda g: moe_parallel.swiglu_halves(g, alpha, limit, jnp.bfloat16), gu)
  h_ref, vjp_ref = jax.vjp(plain, gu)
  assert h.dtype == jnp.bfloat16 and h.shape == (m, i)
  np.testing.assert_array_equal(np.float32(h), np.float32(h_ref))
  np.testing.assert_array_equal(np.float32(vjp(dh)[0]), np.float32(vjp_ref(dh)[0]))
  assert np.any(np.abs(np.float32(gu)) > limit)
  kept = [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "dtype")]
  assert kept == [(jnp.dtype(jnp.bfloat16), (m, 2 * i))], kept
  kept_ref = [(x.dtype, x.shape) for x in jax.tree_util.tree_leaves(vjp_ref) if hasattr(x, "dtype")]
  assert (jnp.dtype(jnp.float32), (m, i)) in kept_ref, kept_ref  # what the custom VJP saves the backward from


def test_grouped_products_stay_in_the_kernels_dtype():
  """Only the Hopper kernels, whose products are already rounded to the input dtype, carry their slots on in it."""
  import jax.numpy as jnp

  from m3_jax.models import moe_parallel

  for impl in ("mosaic", "tokamax"):
    assert moe_parallel.product_dtype(impl, jnp.bfloat16) == jnp.bfloat16
  for impl in ("xla", "tiled", "reference"):
    assert moe_parallel.product_dtype(impl, jnp.bfloat16) == jnp.float32
