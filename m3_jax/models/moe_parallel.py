"""Expert parallelism: the routed experts split over the `expert` mesh axis, token slots exchanged by all-to-all.

`MoE(impl="expert_parallel")` routes every token as the other implementations do (routing is per token, so each
device routes its own tokens), then runs `experts_all_to_all` inside one `jax.shard_map` over the whole mesh. Each
device holds n tokens (the batch split over the batch axes, `expert` included) and E / ep experts (ep: the size
of the `expert` axis), with their `mlp` dim split over `tensor` and their `embed` dim gathered from `fsdp` at the
shard_map boundary (FSDP's gather; its transpose is the gradient's reduce-scatter). On each device:

  1. every slot (token, chosen expert) goes into a fixed send buffer [ep, C, d] at the row of the shard that holds
     its expert, with the expert's local id; C = n * min(k, E / ep) is the most slots one device can send to one
     shard (each token's k distinct experts all on that shard), so nothing is ever dropped: the buffers trade up to
     ep x the balanced size for an exact, HF-equal function whatever the routing;
  2. all-to-all over `expert`: each shard receives the slots for its experts from every shard;
  3. grouped matmuls over the local experts (`grouped_swiglu`, any `pallas_kernels.grouped_matmul`
     implementation; `tiled` keeps the memory of both passes O(rows) on every backend); the empty buffer rows are
     sorted past the last expert's and give zero rows;
  4. all-to-all back, each slot's output weighted and summed into its token; a psum over `tensor` completes the
     down projection, whose contraction dim is split there.

Fixed buffers because XLA:CPU has no ragged all-to-all (jax 0.11: "HLO opcode ragged-all-to-all is not supported by
XLA:CPU"), and the tests of this path run on fake CPU devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from m3_jax.core import sharding
from m3_jax.models.layers import swiglu_oai
from pallas_kernels.grouped_matmul import grouped_matmul

# The mesh axes the expert weights are split over (the logical table is the one place that names them).
EXPERT_AXIS = sharding.LOGICAL_RULES["exp"]
TENSOR_AXIS = sharding.LOGICAL_RULES["mlp"]


def expert_shards() -> int:
  """Size of the `expert` axis of the current mesh (1 without one: then there is nothing to exchange)."""
  mesh = sharding.current_mesh()
  return 1 if mesh is None else int(mesh.shape.get(EXPERT_AXIS, 1))


def check_divisible(num_experts: int, intermediate: int, num_tokens: int) -> None:
  """ValueError naming what does not split evenly over the current mesh."""
  mesh = sharding.current_mesh()
  ep, tp = expert_shards(), int(mesh.shape.get(TENSOR_AXIS, 1))
  batch = sharding.token_divisor(mesh)
  if num_experts % ep:
    raise ValueError(f"moe_impl='expert_parallel': num_local_experts={num_experts} does not divide over mesh axis "
                     f"{EXPERT_AXIS!r} of size {ep} (mesh {dict(mesh.shape)}); use a divisor of the experts")
  if intermediate % tp:
    raise ValueError(f"moe_impl='expert_parallel': intermediate_size={intermediate} does not divide over mesh axis "
                     f"{TENSOR_AXIS!r} of size {tp} (mesh {dict(mesh.shape)})")
  if num_tokens % batch:
    raise ValueError(f"moe_impl='expert_parallel': {num_tokens} tokens (batch x length) do not divide over the token "
                     f"axes {sharding.LOGICAL_RULES['activation_tokens']} of total size {batch} (mesh "
                     f"{dict(mesh.shape)})")


def sort_slots(idx: jax.Array, num_experts: int):
  """The routed slots sorted by expert, for the grouped matmuls. idx: [N, k] expert ids -> (order [N k]: the flat
  slot (token * k + j) at each sorted position; inverse [N k]: the sorted position of each flat slot;
  group_sizes [E] int32). Counting by a one-hot sum rather than `bincount` keeps atomics out of the step."""
  flat = idx.reshape(-1)  # [N k]
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(flat.shape[0], dtype=order.dtype), unique_indices=True)
  group_sizes = jnp.sum(jax.nn.one_hot(flat, num_experts, dtype=jnp.int32), axis=0)  # [E]
  return order, inverse, group_sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_slots(x: jax.Array, perm: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
  """x: [N, ...] -> [N k, ...], row s = x[perm[s] // k], where perm is a permutation of range(N k) and inverse its
  inverse. Dispatch is gather_slots(tokens, order, inverse, k); the combine's return to slot order is
  gather_slots(sorted_outputs, inverse, order, 1). The backward is again a gather (through the inverse
  permutation) plus a sum over each row's k copies: autodiff of x[rows] would scatter-add into x, one atomic add
  per element, which XLA's GPU backend runs far slower than a gather."""
  return x[perm // k]


def _gather_slots_fwd(x, perm, inverse, k):
  return gather_slots(x, perm, inverse, k), (perm, inverse)


def _gather_slots_bwd(k, res, g):
  perm, inverse = res
  back = g[inverse]  # [N k, ...]: slot order
  dx = jnp.sum(back.reshape(back.shape[0] // k, k, *back.shape[1:]), axis=1) if k > 1 else back
  return dx, None, None


gather_slots.defvjp(_gather_slots_fwd, _gather_slots_bwd)


# The implementations whose products come out in the inputs' dtype (pallas_kernels.grouped_matmul): their outputs are
# rounded there already, so carrying them on in f32 would only double the bytes of every slot-sized buffer.
_INPUT_DTYPE_PRODUCTS = ("mosaic", "tokamax")


def product_dtype(matmul_impl: str, dtype) -> jnp.dtype:
  """The dtype a grouped matmul of `matmul_impl` produces from `dtype` inputs without loss: f32 where it accumulates
  into f32 (xla, tiled, reference), the input dtype for the Hopper kernels."""
  return jnp.dtype(dtype) if matmul_impl in _INPUT_DTYPE_PRODUCTS else jnp.dtype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def swiglu_halves(gu: jax.Array, alpha: float, limit: float, out_dtype) -> jax.Array:
  """gu: [M, 2 I] (gate | up, any float dtype) -> swiglu_oai in f32, returned as [M, I] out_dtype.

  A custom VJP so that the backward keeps gu itself (a matmul's output, bf16 from the Hopper kernels) and
  recomputes the f32 gate in one fused pass: autodiff would keep f32 intermediates of [M, I] (the clipped gate, the
  sigmoid) alive until the backward. The values and gradients are autodiff's of the same f32 function."""
  return _swiglu_f32(gu.astype(jnp.float32), alpha, limit).astype(out_dtype)


def _swiglu_f32(gu, alpha, limit):
  i = gu.shape[-1] // 2
  return swiglu_oai(gu[:, :i], gu[:, i:], alpha=alpha, limit=limit)


def _swiglu_halves_fwd(gu, alpha, limit, out_dtype):
  return swiglu_halves(gu, alpha, limit, out_dtype), gu


def _swiglu_halves_bwd(alpha, limit, out_dtype, gu, dh):
  _, vjp = jax.vjp(lambda g: _swiglu_f32(g, alpha, limit), gu.astype(jnp.float32))
  (dgu,) = vjp(dh.astype(jnp.float32))
  return (dgu.astype(gu.dtype),)


swiglu_halves.defvjp(_swiglu_halves_fwd, _swiglu_halves_bwd)


def combine_slots(y: jax.Array, w: jax.Array) -> jax.Array:
  """y: [N, k, d] each token's slot outputs (any float dtype); w: [N, k] f32 combine weights -> [N, d] f32."""
  return jnp.sum(y.astype(jnp.float32) * w[..., None], axis=1)


def grouped_swiglu(xs: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, alpha: float,
                   limit: float, matmul_impl: str = "xla") -> jax.Array:
  """xs: [M, d] rows sorted by (local) expert; group_sizes: [E_loc]; gate_up: [E_loc, d, 2, I_loc];
  down: [E_loc, I_loc, d] -> [M, d] in `product_dtype(matmul_impl, xs.dtype)` (this device's part of the down
  projection when I is split; callers weight and sum the slots in f32).
  matmul_impl: pallas_kernels.grouped_matmul's implementation (xla everywhere; mosaic/tokamax on Hopper)."""
  e, dm, _, i = gate_up.shape
  out = product_dtype(matmul_impl, xs.dtype)
  gu = grouped_matmul(xs, gate_up.reshape(e, dm, 2 * i), group_sizes, implementation=matmul_impl,
                      preferred_element_type=out)  # [M, 2 I_loc]
  h = swiglu_halves(gu, alpha, limit, xs.dtype)  # [M, I_loc]
  return grouped_matmul(h, down, group_sizes, implementation=matmul_impl, preferred_element_type=out)  # [M, d]


def experts_all_to_all(x: jax.Array, w: jax.Array, idx: jax.Array, gate_up: jax.Array, down: jax.Array, *,
                       alpha: float, limit: float, matmul_impl: str = "xla", chunk_tokens: int = 0) -> jax.Array:
  """The routed experts' output, expert-parallel over the current mesh (set with `jax.set_mesh`).

  x: [N, d] tokens; w, idx: [N, k] combine weights (f32) and global expert ids; gate_up: [E, d, 2, I];
  down: [E, I, d]. Returns [N, d] f32, the same function as the single-device grouped matmul. chunk_tokens > 0:
  each device exchanges its tokens that many at a time (TextConfig.moe_chunk_tokens).
  """
  num_experts, _, _, inter = gate_up.shape
  check_divisible(num_experts, inter, x.shape[0])
  ep = expert_shards()
  e_loc = num_experts // ep

  def exchange(x, w, idx, gate_up, down):
    # x: [n, d]; w, idx: [n, k]; gate_up: [E_loc, d, 2, I_loc]; down: [E_loc, I_loc, d]
    n, k = idx.shape
    dm = x.shape[-1]
    cap = n * min(k, e_loc)
    flat = idx.reshape(-1)  # [n k]
    dest = flat // e_loc  # [n k]: the shard that holds the slot's expert
    onehot = jax.nn.one_hot(dest, ep, dtype=jnp.int32)  # [n k, ep]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)  # [n k]: row in its shard's buffer
    send = jnp.zeros((ep, cap, dm), x.dtype).at[dest, pos].set(jnp.repeat(x, k, axis=0))  # [ep, C, d]
    send_id = jnp.full((ep, cap), -1, jnp.int32).at[dest, pos].set(flat % e_loc)  # [ep, C]; -1: empty row
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=True)  # [ep, C, d]: block j from shard j
    recv_id = jax.lax.all_to_all(send_id, EXPERT_AXIS, 0, 0, tiled=True)  # [ep, C]
    rows, ids = recv.reshape(ep * cap, dm), recv_id.reshape(ep * cap)  # [M, d], [M]
    key = jnp.where(ids < 0, e_loc, ids)  # empty rows sort past the last expert: no group, never multiplied
    order, inverse, group_sizes = sort_slots(key[:, None], e_loc + 1)
    group_sizes = group_sizes[:e_loc]  # [E_loc]; the empty rows' group e_loc is never multiplied
    y_sorted = grouped_swiglu(gather_slots(rows, order, inverse, 1), group_sizes, gate_up, down, alpha=alpha,
                              limit=limit, matmul_impl=matmul_impl)  # [M, d]
    y = gather_slots(y_sorted, inverse, order, 1)  # back to the received order
    back = jax.lax.all_to_all(y.reshape(ep, cap, dm), EXPERT_AXIS, 0, 0, tiled=True)  # [ep, C, d]: my slots
    got = back[dest, pos].reshape(n, k, dm)  # [n, k, d]
    return combine_slots(got, w)  # [n, d] f32

  def local(x, w, idx, gate_up, down):
    n, dm = x.shape
    if not chunk_tokens or chunk_tokens >= n:
      return jax.lax.psum(exchange(x, w, idx, gate_up, down), TENSOR_AXIS)
    if n % chunk_tokens:
      raise ValueError(f"moe_chunk_tokens={chunk_tokens} does not divide the {n} tokens each device holds")
    m = n // chunk_tokens

    def one(args):  # rematerialised: the backward keeps one chunk's buffers at a time, not all of them
      return exchange(*args, gate_up, down)

    chunks = (x.reshape(m, chunk_tokens, dm), w.reshape(m, chunk_tokens, -1), idx.reshape(m, chunk_tokens, -1))
    out = jax.lax.map(jax.checkpoint(one), chunks).reshape(n, dm)  # [n, d]
    return jax.lax.psum(out, TENSOR_AXIS)

  tokens = sharding.logical_to_spec(("activation_tokens", None))
  return jax.shard_map(
      local, out_specs=tokens,
      in_specs=(tokens, tokens, tokens, sharding.logical_to_spec(("exp", None, None, "mlp")),
                sharding.logical_to_spec(("exp", "mlp", None))))(x, w, idx, gate_up, down)
