"""Aux-loss-free load balancing (M3 / DeepSeek-V3): the router bias takes one sign step toward equal load per train
step, inside the compiled step; a rate of 0 leaves training exactly as it was."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from m3_jax.models.config import TextConfig
from m3_jax.models.moe import balance_bias_step
from m3_jax.train.state import TrainState, abstract_model
from m3_jax.train.steps import cross_entropy, forward, make_train_step, optimizer_step
from tests.model_utils import numpy_values

LR = 1e-2


def tiny_cfg(**kw):
  base = dict(vocab_size=61, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
              head_dim=8, rotary_dim=4, rope_theta=10000.0, dense_intermediate_size=24, intermediate_size=8,
              shared_intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
              layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])
  base.update(kw)
  return TextConfig(**base)


def batch(cfg, b=2, t=12, seed=0):
  ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(b, t + 1))
  mask = np.ones((b, t), np.float32)
  mask[1, -3:] = 0.0  # padding: its tokens must not count in the load
  return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.asarray(mask)}


def fresh_state(cfg, tx):
  """(graphdef, a TrainState with random parameters and a router bias that differs per layer and expert, so a step
  that ignores the bias or mixes up layers shows)."""
  graphdef, params, rest = abstract_model(cfg)
  params = numpy_values(params, seed=0, std=0.1)
  rest = numpy_values(rest, seed=1, std=0.05)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest, opt_state=jax.jit(tx.init)(params),
                     rng=jax.random.key(0))
  return graphdef, state


def router_biases(rest):
  """[L_moe, E] biases of layers 1 and 2, in layer order."""
  got = {k[1]: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(rest) if k[-1] == "e_score_correction_bias"}
  return np.stack([got[i] for i in sorted(got)])


def test_bias_step_is_a_sign_step_toward_equal_load():
  load = jnp.asarray([0.5, 0.25, 0.125, 0.125])  # mean 0.25: expert 0 over, 1 at, 2 and 3 under
  bias = jnp.asarray([0.1, 0.0, -0.2, 0.3])
  np.testing.assert_array_equal(np.asarray(balance_bias_step(bias, load, 0.1)),
                                np.asarray(bias) + 0.1 * np.array([-1.0, 0.0, 1.0, 1.0], np.float32))
  with pytest.raises(ValueError, match=r"bias \(4,\) and load \(3,\)"):
    balance_bias_step(bias, load[:3], 0.1)


@pytest.fixture(scope="module")
def setup():
  """The model, a fresh state and the jitted steps the tests share (each compiles once per module)."""
  cfg = tiny_cfg()
  tx = optax.sgd(LR)  # the optimizer is not what is tested: the cheapest to compile
  graphdef, state = fresh_state(cfg, tx)

  def balanced_step(rate):
    return jax.jit(make_train_step(graphdef, tx, lambda s: LR, moe_aux_coef=0.01, kl_weight=1.0,
                                   router_bias_rate=rate))

  @jax.jit
  def plain_step(params, opt_state, rest, batch, step):
    """The train step as it was before balancing existed: (new params, opt_state, ce, expert_load [L_moe, E])."""
    def loss_fn(p):
      logits, aux = forward(graphdef, p, rest, batch, step=step)
      ce, _ = cross_entropy(logits, batch["targets"], batch["loss_mask"])
      return ce + 0.01 * aux["moe_aux_loss"] + 1.0 * aux["kl_loss"], (ce, aux["expert_load"])

    (_, (ce, load)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    params, opt_state, _ = optimizer_step(tx, grads, opt_state, params)  # the trainer's own update application
    return params, opt_state, ce, load

  return cfg, state, balanced_step, plain_step


def test_rate_zero_trains_exactly_as_the_step_without_balancing(setup):
  """The step with router_bias_rate=0 against the step as it was before balancing existed (written out in
  `setup`): bit-identical losses and parameters over 3 steps, and the bias never moves."""
  cfg, state, balanced_step, plain_step = setup
  bias0 = router_biases(state.rest)
  step = balanced_step(0.0)
  params, opt_state = state.params, state.opt_state
  for i in range(3):
    b = batch(cfg, seed=i)
    params, opt_state, ce, _ = plain_step(params, opt_state, state.rest, b, state.step)
    state, m = step(state, b)
    np.testing.assert_array_equal(np.asarray(m["loss"]), np.asarray(ce))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(state.params), nnx.to_pure_dict(params))
  np.testing.assert_array_equal(router_biases(state.rest), bias0)


def test_bias_moves_by_the_sign_of_its_layers_load_inside_the_compiled_step(setup):
  """One jitted step with rate r: each MoE layer's bias equals the hand-computed sign step from that layer's load
  in the same forward (the plain step's, from the same params, rest and batch), the parameters take the plain
  step's update (the bias moves after the forward), and the metrics name the layers."""
  cfg, state, balanced_step, plain_step = setup
  b = batch(cfg)
  params, _, _, load = plain_step(state.params, state.opt_state, state.rest, b, state.step)
  load = np.asarray(load)  # [2, E]
  assert not np.allclose(load[0], load[1])  # distinct rows: a layer mix-up cannot pass
  bias0 = router_biases(state.rest)
  rate = 0.03
  new, m = balanced_step(rate)(state, b)
  expected = bias0 + np.float32(rate) * np.sign(load.mean(-1, keepdims=True) - load).astype(np.float32)
  np.testing.assert_array_equal(router_biases(new.rest), expected)
  assert np.any(expected != bias0)
  jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(new.params), nnx.to_pure_dict(params))
  e = cfg.num_local_experts
  for row, layer in zip(load, (1, 2)):  # layer 0 is dense: rows are MoE layers, names are model layers
    np.testing.assert_allclose(float(m[f"moe/max_over_mean/layer{layer}"]), row.max() * e, rtol=1e-6)
    np.testing.assert_allclose(float(m[f"moe/min_over_mean/layer{layer}"]), row.min() * e, rtol=1e-6)


def test_negative_rate_is_refused_by_name():
  with pytest.raises(ValueError, match="router_bias_update_rate=-0.1"):
    tiny_cfg(router_bias_update_rate=-0.1)
