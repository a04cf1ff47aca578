"""The train state: the model kind chosen from its config, parameters born sharded from their logical axes, the
optimizer state sharded like them, and the warm start from an export. Nothing here allocates a whole model on one
host: abstract shapes first (`nnx.eval_shape`), then `jax.jit(init, out_shardings=...)`."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from m3_jax.core import sharding
from m3_jax.models.config import TextConfig, VLConfig
from m3_jax.models.multimodal import VLModel
from m3_jax.models.transformer import TextModel, per_layer_keys
from m3_jax.train import checkpoint as ckpt_lib
from m3_jax.train import config_lib
from m3_jax.train.metrics import log

ModelConfig = TextConfig | VLConfig


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of nnx.Param
  rest: Any  # nnx.State of every other variable (router correction bias, ...); not touched by the optimizer
  opt_state: Any
  rng: jax.Array  # for stochastic parts (none in the default models); saved so a resume is exact


def build_model(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The one place where the model kind is chosen: VLConfig -> VLModel (vision tower + projector + text tower),
  TextConfig -> TextModel. Both return (logits, aux) and carry logical axes on every parameter."""
  if isinstance(cfg, VLConfig):
    return VLModel(cfg, rngs=rngs)
  return TextModel(cfg, rngs=rngs)


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract params, abstract rest) without allocating anything."""
  model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
  return nnx.split(model, nnx.Param, ...)


def param_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh) -> tuple[Any, Any, Any]:
  """(graphdef, (abstract params, abstract rest), (their shardings on `mesh`)); raises, naming the parameter, if
  a dim does not divide over its mesh axes."""
  graphdef, params, rest = abstract_model(cfg)
  p_sh = sharding.state_shardings(params, mesh)
  r_sh = sharding.state_shardings(rest, mesh)
  return graphdef, (params, rest), (p_sh, r_sh)


def make_init_fn(cfg: ModelConfig, tx: optax.GradientTransformation):
  """key -> a fresh TrainState; jitted with out_shardings it builds the state directly on the mesh."""

  def init(key):
    model = build_model(cfg, nnx.Rngs(params=key))
    _, p, r = nnx.split(model, nnx.Param, ...)
    return TrainState(step=jnp.zeros((), jnp.int32), params=p, rest=r, opt_state=tx.init(p),
                      rng=jax.random.fold_in(key, 1))

  return init


def abstract_state(cfg: ModelConfig, tx: optax.GradientTransformation,
                   mesh: jax.sharding.Mesh) -> tuple[Any, TrainState, Any]:
  """(graphdef, the TrainState as ShapeDtypeStructs carrying their shardings, the shardings): a restore target,
  from shapes alone (nothing is allocated or compiled)."""
  graphdef, _, (p_sh, r_sh) = param_shardings(cfg, mesh)
  abstract = jax.eval_shape(make_init_fn(cfg, tx), jax.random.key(0))
  state_sh = state_shardings_for(abstract, p_sh, r_sh, mesh)
  return graphdef, ckpt_lib.abstract_like(abstract, state_sh), state_sh


def init_state(cfg: ModelConfig, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
               seed: int) -> tuple[Any, TrainState, Any]:
  """Creates the train state already sharded: jit(init, out_shardings=...) so no host ever holds it whole."""
  graphdef, _, state_sh = abstract_state(cfg, tx, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(make_init_fn(cfg, tx), out_shardings=state_sh)(jax.random.key(seed))
  return graphdef, state, state_sh


def state_shardings_for(abstract: TrainState, p_sh, r_sh, mesh: jax.sharding.Mesh) -> TrainState:
  """Optimizer moments shard like their parameters; scalars (counts, step, rng) are replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  p_struct = jax.tree.structure(abstract.params)

  def is_param_tree(x) -> bool:  # optax keeps mu/nu as pytrees with exactly the params' structure
    return jax.tree.structure(x) == p_struct

  opt_sh = jax.tree.map(lambda x: p_sh if is_param_tree(x) else replicated, abstract.opt_state,
                        is_leaf=is_param_tree)
  return TrainState(step=replicated, params=p_sh, rest=r_sh, opt_state=opt_sh, rng=replicated)


def _per_layer(cfg: ModelConfig | None, key: tuple) -> list[tuple[tuple, int | None]]:
  """A flat state key of `cfg`'s model -> [(the unscanned layout's key, stack row or None)] (None: unscanned)."""
  if cfg is None:
    return [(key, None)]
  pre = ("language_model",) if isinstance(cfg, VLConfig) else ()
  if key[:len(pre)] != pre:
    return [(key, None)]
  return [(pre + k, row) for k, row in per_layer_keys(config_lib.text_config(cfg), key[len(pre):])]


def init_from_export(state: TrainState, path: str, mesh: jax.sharding.Mesh,
                     cfg: ModelConfig | None = None) -> TrainState:
  """Warm start from an export (e.g. dense -> MSA, the paper's MSA-CPT): every parameter the export has is
  copied (same path, same shape); the rest (MSA index projections and norms) keep their fresh initialisation.
  A text export into a VL model fills its `language_model` (continued pretraining of a text model with vision:
  the tower and projector start fresh). Paths are matched per layer, so an export and a model of different
  `scan_layers` layouts (cfg: this model's config; None: unscanned) meet layer by layer. The optimizer starts
  fresh at step 0."""
  if not ckpt_lib.is_export(path):
    raise FileNotFoundError(f"init_from={path!r} is not an export directory (made by --mode=export)")
  src_cfg = config_lib.model_config_from_export(ckpt_lib.load_export_config(path))
  _, (params, rest), (p_sh, r_sh) = param_shardings(src_cfg, mesh)
  src = ckpt_lib.restore_params(path, ckpt_lib.abstract_like({"params": params, "rest": rest},
                                                             {"params": p_sh, "rest": r_sh}))
  src_map = {}
  for key, var in [*nnx.to_flat_state(src["params"]), *nnx.to_flat_state(src["rest"])]:
    for k, row in _per_layer(src_cfg, key):
      src_map[k] = var.get_value() if row is None else var.get_value()[row]
  if isinstance(cfg, VLConfig) and isinstance(src_cfg, TextConfig):
    src_map = {("language_model",) + k: v for k, v in src_map.items()}
  copied, fresh = 0, []

  def take(tree):
    nonlocal copied
    out = []
    for key, var in nnx.to_flat_state(tree):
      value = var.get_value()
      for k, row in _per_layer(cfg, key):
        name = "/".join(map(str, k))
        if k not in src_map:
          fresh.append(name)
          continue
        new = src_map[k].astype(value.dtype)
        want = value.shape if row is None else value.shape[1:]
        if new.shape != want:
          raise ValueError(f"init_from: {name} has shape {new.shape} in {path}, {want} in this model")
        value = new if row is None else jax.device_put(value.at[row].set(new), value.sharding)
        copied += 1
      out.append((key, var.replace(value)))
    return nnx.from_flat_state(out)

  state = state.replace(params=take(state.params), rest=take(state.rest))
  log(f"initialised {copied} tensors from {path}; fresh: {fresh if len(fresh) < 12 else fresh[:12] + ['...']}")
  return state
