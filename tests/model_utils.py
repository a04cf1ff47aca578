"""Shared pieces of the model tests (imported by test modules; no test module imports another)."""

import jax
import numpy as np
from flax import nnx

from m3_jax.models.config import TextConfig


def jaxpr_eqns(jaxpr):
  """Every equation of a jaxpr in program order, each followed by those of its sub-jaxprs (pjit, remat, scan, cond
  branches, custom rules; closed or open)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from jaxpr_eqns(inner)


def randomize(model, seed=0, std=0.3):
  """Non-trivial values everywhere (norm scales, router bias) so every term of the formulas is exercised."""
  state = nnx.state(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  nnx.update(model, jax.tree.unflatten(treedef, new))
  return model


def np_params(model):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))


def numpy_values(abstract_state, seed=0, std=0.1):
  """An nnx.State of ShapeDtypeStructs (e.g. from `nnx.eval_shape`) filled with normal(0, std) numbers made by
  numpy: no JAX op runs, so nothing is compiled (eager initialisation costs seconds of op compiles per model)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: np.asarray(std * rng.standard_normal(x.shape), x.dtype), abstract_state)


def msa_cfg(**kw):
  """A 2-layer model, layer 1 MSA (block 4, top 2, 1 local): the MSA model tests' shape; kw overrides."""
  base = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, rotary_dim=4, rope_theta=10000.0, dense_intermediate_size=48,
              layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "dense"],
              index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2, index_local_blocks=1)
  base.update(kw)
  return TextConfig(**base)
