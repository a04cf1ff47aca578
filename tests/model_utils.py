"""Shared pieces of the model tests (imported by test modules; no test module imports another)."""

import jax
import numpy as np
from flax import nnx


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
