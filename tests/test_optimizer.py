"""Schedules against their closed forms, and the weight-decay mask."""

import jax.numpy as jnp
import numpy as np
import pytest

from m3_jax.train.optimizer import OptimConfig, decay_mask, make_schedule, wsd_decay_start


def test_wsd_warmup_stable_then_linear_decay():
  cfg = OptimConfig(learning_rate=1.0, schedule="wsd", warmup_steps=10, total_steps=100, decay_fraction=0.2,
                    min_lr_ratio=0.1)
  lr = make_schedule(cfg)
  assert wsd_decay_start(cfg) == 80
  np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10, 50, 79, 80, 90, 100)],
                             [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1], rtol=1e-6)


def test_wsd_sqrt_decay_and_cosine():
  cfg = OptimConfig(learning_rate=2.0, schedule="wsd", warmup_steps=0, total_steps=100, decay_fraction=0.5,
                    decay_shape="sqrt", min_lr_ratio=0.0)
  assert float(make_schedule(cfg)(75)) == pytest.approx(2.0 * np.sqrt(0.5), rel=1e-6)
  cos = make_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.0))
  assert float(cos(10)) == pytest.approx(1.0)
  assert float(cos(60)) == pytest.approx(0.5, abs=1e-6)
  assert float(cos(110)) == pytest.approx(0.0, abs=1e-6)


def test_decay_mask_spares_vectors():
  params = {"w": jnp.ones((3, 4)), "norm": jnp.ones((4,)), "experts": jnp.ones((2, 3, 4))}
  assert decay_mask(params) == {"w": True, "norm": False, "experts": True}


@pytest.mark.parametrize("bad", [dict(schedule="linear"), dict(warmup_steps=20, total_steps=10),
                                 dict(decay_fraction=1.5)])
def test_bad_optim_config(bad):
  with pytest.raises(ValueError, match="optim"):
    OptimConfig(**bad)
