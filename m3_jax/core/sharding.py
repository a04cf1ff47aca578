"""The mesh and the one table of logical axis names -> mesh axes.

Every parameter carries `logical_axes` metadata (one name or None per dim) and large activations are constrained
with `constrain(x, names)`. This file is the only place that knows how those names land on the mesh.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer state sharded),
`tensor` (Megatron-style heads / MLP split), `expert` (MoE experts; batch is also split over it outside the MoE),
`context` (the sequence: every [B, T] activation is split along T; parameters and optimizer state are sharded over
it as over `fsdp`, so a long-context run does not hold a full copy per context shard; core/context.py says which
slots each device holds, models/attention/context.py how attention sees the whole sequence).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "expert", "context")

# Logical name -> mesh axis, or a tuple of mesh axes, or None (replicated).
LOGICAL_RULES: dict[str, Any] = {
    # activations
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": "context",
    "activation_embed": None,
    "activation_heads": "tensor",
    "activation_kv_heads": "tensor",
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
    "activation_exp": "expert",
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "exp": "expert",
    "norm": None,
    "index_heads": "tensor",
    "index_dim": None,
    # the leading axis of a scanned layer stack's parameters (TextConfig.scan_layers): every device holds every
    # layer's shard, as it does unscanned; splitting it would make each scan step gather its layer
    "layers": None,
}


def _axes_tuple(entry) -> tuple[str, ...]:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


# [B * T] flattened tokens (the MoE's rows): batch-major, so the batch axes come first and `context` last.
LOGICAL_RULES["activation_tokens"] = (_axes_tuple(LOGICAL_RULES["activation_batch"])
                                      + _axes_tuple(LOGICAL_RULES["activation_length"]))


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the 5-axis mesh (axes missing from `shape` have size 1). One entry of `shape` may be -1: it takes the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh: unknown axes {unknown}; the mesh axes are {MESH_AXES}")
  sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
  free = [a for a, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f"mesh: only one axis may be -1, got {free}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if len(devices) % known:
      raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes {sizes}")
    sizes[free[0]] = len(devices) // known
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(f"mesh: axes {sizes} need {math.prod(sizes.values())} devices, but {len(devices)} are "
                     "available (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices)")
  arr = np.asarray(devices).reshape([sizes[a] for a in MESH_AXES])
  return Mesh(arr, MESH_AXES)


def logical_to_spec(names: Sequence[str | None], rules: Mapping[str, Any] = LOGICAL_RULES) -> P:
  """Maps logical names to a PartitionSpec; two logical dims may never share a mesh axis."""
  out, used = [], {}
  for name in names:
    if name is None:
      out.append(None)
      continue
    if name not in rules:
      raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")
    tup = _axes_tuple(rules[name])
    for a in tup:
      if a in used:
        raise ValueError(f"logical axes {used[a]!r} and {name!r} both map to mesh axis {a!r} in {tuple(names)}")
      used[a] = name
    out.append(None if not tup else tup[0] if len(tup) == 1 else tup)
  return P(*out)


def _mesh_size(mesh: Mesh, entry) -> int:
  if entry is None:
    return 1
  axes = (entry,) if isinstance(entry, str) else entry
  return math.prod(mesh.shape[a] for a in axes)


def fitted_spec(shape: Sequence[int], names: Sequence[str | None], mesh: Mesh, *, what: str = "array",
                strict: bool = True) -> P:
  """`logical_to_spec`, checked against `shape`: a dim must divide evenly by the mesh axes it is split over.

  With strict=False a dim that does not divide is replicated instead (used for activations such as a batch of
  one during generation); parameters are strict so a bad mesh is an error before compilation.
  """
  if len(names) != len(shape):
    raise ValueError(f"{what}: {len(names)} logical axes {tuple(names)} for shape {tuple(shape)}")
  spec = logical_to_spec(names)
  fixed = []
  for dim, n, entry in zip(shape, names, spec):
    size = _mesh_size(mesh, entry)
    if dim % size:
      if strict:
        raise ValueError(f"{what} of shape {tuple(shape)}: dim {n!r}={dim} does not divide over mesh axes "
                         f"{entry} of total size {size} (mesh {dict(mesh.shape)}); change the mesh or the model")
      entry = None
    fixed.append(entry)
  return P(*fixed)


def current_mesh() -> Mesh | None:
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """Sharding constraint by logical names under the current `jax.set_mesh` mesh; a no-op without one."""
  mesh = current_mesh()
  if mesh is None or math.prod(mesh.shape.values()) == 1:
    return x
  return jax.lax.with_sharding_constraint(x, fitted_spec(x.shape, names, mesh, strict=False))


def _logical_axes(v: nnx.Variable) -> tuple | None:
  return v.get_metadata().get("logical_axes")


def state_shardings(abstract_state: Any, mesh: Mesh, *, prefix: str = "") -> Any:
  """NamedShardings for every leaf of an nnx.State (or a pytree containing Variables) from `logical_axes`."""

  def one(path, v):
    where = prefix + jax.tree_util.keystr(path)
    if isinstance(v, nnx.Variable):
      names = _logical_axes(v)
      shape = v.get_value().shape
      if names is None:
        spec = P()
      else:
        spec = fitted_spec(shape, names, mesh, what=f"parameter {where}")
      return v.replace(NamedSharding(mesh, spec))
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Every batch array: dim 0 over the batch axes, dim 1 (the sequence of [B, T] arrays, in core/context.py's
  device order when `context` > 1) over `context`. A multimodal batch never has `context` > 1 (train/checks.py), so
  its pixel arrays' dim 1 is whole."""
  return NamedSharding(mesh, logical_to_spec(("activation_batch", "activation_length")))


def batch_divisor(mesh: Mesh) -> int:
  return _mesh_size(mesh, LOGICAL_RULES["activation_batch"])


def token_divisor(mesh: Mesh) -> int:
  """How many ways flattened [B * T] tokens split: the batch axes times `context`."""
  return _mesh_size(mesh, LOGICAL_RULES["activation_tokens"])


def context_shards(mesh: Mesh | None = None) -> int:
  """Size of the mesh axis the sequence is split over (`mesh`, or the current one; 1 without a mesh)."""
  mesh = current_mesh() if mesh is None else mesh
  return 1 if mesh is None else _mesh_size(mesh, LOGICAL_RULES["activation_length"])


def bytes_per_device(tree: Any) -> dict[str, int]:
  """Bytes each device holds for a pytree of (Shape)DtypeStruct-like leaves with `.sharding`."""
  total: dict[str, int] = {}
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    shard_shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    nbytes = math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
    total["per_device"] = total.get("per_device", 0) + nbytes
    total["global"] = total.get("global", 0) + math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
  return total
