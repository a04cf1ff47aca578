"""`train.loss_chunk`: the output layer and loss a chunk of tokens at a time give the full-logits step's losses,
gradients and eval sums, and the compiled step no longer holds the [B, T, V] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from m3_jax.core import sharding
from m3_jax.models.config import TextConfig
from m3_jax.train import checks, config_lib
from m3_jax.train.defaults import base_config
from m3_jax.train.state import abstract_model, make_init_fn
from m3_jax.train.steps import make_eval_step, make_train_step


def tiny_cfg(**kw):
  base = dict(vocab_size=97, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=8, rotary_dim=4, rope_theta=10000.0, dense_intermediate_size=24,
              layer_types=["full_attention"] * 2, mlp_layer_types=["dense"] * 2)
  base.update(kw)
  return TextConfig(**base)


def batch(vocab, b=2, t=24, seed=0):
  ids = np.random.default_rng(seed).integers(0, vocab, size=(b, t + 1))
  mask = np.ones((b, t), np.float32)
  mask[1, -5:] = 0.0  # padding: its positions must not count
  return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32),
          "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
          "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.asarray(mask)}


def steps(cfg, chunk, tx):
  graphdef = abstract_model(cfg)[0]
  train = jax.jit(make_train_step(graphdef, tx, lambda s: 0.1, moe_aux_coef=0.0, kl_weight=0.0,
                                  router_bias_rate=0.0, loss_chunk=chunk))
  return graphdef, train, jax.jit(make_eval_step(graphdef, chunk))


def test_chunked_loss_equals_the_full_logits_step():
  """SGD (the update is the gradient, so parameters compare gradients) over 2 steps: loss, gradient norm and new
  parameters of chunks of 8 tokens against the full logits, to f32 rounding; the eval sums likewise, and the
  argmax hits exactly."""
  cfg = tiny_cfg()
  tx = optax.sgd(0.1)
  state = make_init_fn(cfg, tx)(jax.random.key(0))
  _, full_train, full_eval = steps(cfg, 0, tx)
  _, chunk_train, chunk_eval = steps(cfg, 8, tx)
  a = b = state
  for i in range(2):
    x = batch(cfg.vocab_size, seed=i)
    a, ma = full_train(a, x)
    b, mb = chunk_train(b, x)
    for k in ("loss", "grad_norm", "tokens"):
      np.testing.assert_allclose(float(mb[k]), float(ma[k]), rtol=2e-6, err_msg=k)
  for pa, pb in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(pb), np.asarray(pa), rtol=1e-5, atol=1e-7)
  ea, eb = full_eval(a.params, a.rest, x), chunk_eval(a.params, a.rest, x)
  np.testing.assert_allclose(float(eb["loss_sum"]), float(ea["loss_sum"]), rtol=2e-6)
  assert float(eb["tokens"]) == float(ea["tokens"]) == 43.0
  assert float(eb["correct"]) == float(ea["correct"])


def test_chunked_step_does_not_hold_the_logits():
  """Compiled (CPU) temporaries of a step whose logits dominate (V = 4096, B x T = 8 x 128: 16 MiB of f32 logits
  and as much gradient): with chunks of 8 positions (64 tokens of the batch at a time) they fall below a quarter of
  the full-logits step's."""
  cfg = tiny_cfg(vocab_size=4096, hidden_size=16)
  tx = optax.sgd(0.1)
  state = jax.eval_shape(make_init_fn(cfg, tx), jax.random.key(0))
  x = jax.eval_shape(lambda: batch(cfg.vocab_size, b=8, t=128))
  temp = {}
  for chunk in (0, 8):
    _, train, _ = steps(cfg, chunk, tx)
    temp[chunk] = train.lower(state, x).compile().memory_analysis().temp_size_in_bytes
  logits = 8 * 128 * 4096 * 4
  assert temp[0] > 2 * logits, temp  # the full step holds the logits and their gradient
  assert temp[8] < temp[0] / 4, temp


def test_a_chunk_that_does_not_divide_the_sequence_is_refused_before_compiling():
  config = base_config()
  config.train.seq_len = 100
  config.train.batch_size = 1
  config.eval.batch_size = 1
  config.train.loss_chunk = 64
  mesh = sharding.make_mesh(dict(config.mesh))
  with pytest.raises(ValueError, match=r"train.loss_chunk=64 must be 0 \(off\) or divide train.seq_len=100"):
    checks.check_fits(config_lib.model_config(config), config, mesh)
