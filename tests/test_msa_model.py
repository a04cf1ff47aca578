"""MSA inside the model: dense equivalence, where gradients go, the warmup switch, dense -> MSA conversion."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3_jax.models.transformer import TextModel
from m3_jax.train.steps import cross_entropy
from tests.model_utils import jaxpr_eqns, msa_cfg, randomize


def ids(t=24, b=2, seed=0, vocab=101):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=(b, t)))


def assert_same_logits_and_grads(model_a, model_b):
  """Logits and the gradients of a fixed log-prob readout agree between two models (gradients matched by path; the
  paths of model_b must exist in model_a)."""
  x = ids()

  def loss(m):
    logits, _ = m(x)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 1]), logits

  (_, lg_a), ga = nnx.value_and_grad(loss, has_aux=True)(model_a)
  (_, lg_b), gb = nnx.value_and_grad(loss, has_aux=True)(model_b)
  np.testing.assert_allclose(np.asarray(lg_a), np.asarray(lg_b), atol=1e-5)
  flat_a = dict(nnx.to_flat_state(ga))
  for k, v in nnx.to_flat_state(gb):
    np.testing.assert_allclose(np.asarray(flat_a[k].get_value()), np.asarray(v.get_value()), atol=1e-6,
                               err_msg=str(k))


@pytest.mark.slow
def test_msa_equals_dense_when_everything_is_selected():
  """topk * block_size >= S: the MSA layer is exactly dense GQA attention (outputs and gradients)."""
  cfg = msa_cfg(index_topk_blocks=6)  # 6 * 4 = 24 = S
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(0)))
  dense_cfg = cfg.replace(layer_types=("full_attention", "full_attention"))
  dense = TextModel(dense_cfg, rngs=nnx.Rngs(0))
  shared = {k: v for k, v in nnx.to_flat_state(nnx.state(model)) if "indexer" not in k}
  nnx.update(dense, nnx.from_flat_state(list(shared.items())))
  assert_same_logits_and_grads(model, dense)


def _grads(model, x, which, step=10**6):
  """Gradients of the LM loss or of the summed KL w.r.t. every parameter."""
  targets = jnp.roll(x, -1, axis=1)
  mask = jnp.ones(x.shape, jnp.float32)

  def f(m):
    logits, aux = m(x, step_state={"step": jnp.int32(step)})
    return cross_entropy(logits, targets, mask)[0] if which == "lm" else aux["kl_loss"]

  return dict(nnx.to_flat_state(nnx.grad(f)(model)))


def _norm(g):
  return float(jnp.sqrt(sum(jnp.sum(v.get_value() ** 2) for v in g)))


def assert_same_kl_and_lm_grads(ref, other, x, what: str, **tol):
  """`other`'s LM and KL gradients equal `ref`'s (which must be non-zero) within `tol`, parameter by parameter."""
  for which in ("kl", "lm"):
    g_ref, g_other = _grads(ref, x, which), _grads(other, x, which)
    assert _norm(g_ref.values()) > 0
    for k, v in g_ref.items():
      np.testing.assert_allclose(np.asarray(g_other[k].get_value()), np.asarray(v.get_value()), **tol,
                                 err_msg=f"{what} {which} {k}")


@pytest.mark.parametrize("step", [0, 10**6])  # warmup (dense KL) and sparse
def test_kl_trains_only_the_indexer_and_lm_loss_never_reaches_it(step):
  cfg = msa_cfg(warmup_steps=5)
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(1)))
  x = ids(seed=1)
  kl = _grads(model, x, "kl", step)
  lm = _grads(model, x, "lm", step)
  idx = [k for k in kl if "indexer" in k]
  assert idx
  assert _norm([kl[k] for k in idx]) > 1e-4
  assert _norm([v for k, v in kl.items() if "indexer" not in k]) == 0.0
  assert _norm([lm[k] for k in idx]) == 0.0
  assert _norm([v for k, v in lm.items() if "indexer" not in k]) > 1e-4


def test_without_detach_the_kl_reaches_the_backbone():
  """The ablation switch: the detach is what keeps the KL off the backbone (so the test above can fail)."""
  cfg = msa_cfg(detach_index_input=False)
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(1)))
  kl = _grads(model, ids(seed=1), "kl")
  assert _norm([v for k, v in kl.items() if "indexer" not in k and "embed" in "/".join(map(str, k))]) > 1e-6


def test_warmup_switch_is_dense_then_sparse_without_recompiling():
  cfg = msa_cfg(warmup_steps=3)
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(2)))
  x = ids(seed=2)
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, step):
    logits, aux = nnx.merge(graphdef, state)(x, step_state={"step": step})
    return logits, aux["kl_loss"]

  dense_model = TextModel(cfg.replace(layer_types=("full_attention", "full_attention")), rngs=nnx.Rngs(0))
  nnx.update(dense_model, nnx.from_flat_state([(k, v) for k, v in nnx.to_flat_state(state) if "indexer" not in k]))
  dense_logits, _ = dense_model(x)
  sparse_logits, _ = model(x)  # no step: always sparse
  warm, kl_warm = run(state, jnp.int32(0))
  late, kl_late = run(state, jnp.int32(3))
  assert run._cache_size() == 1
  np.testing.assert_allclose(np.asarray(warm), np.asarray(dense_logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(late), np.asarray(sparse_logits), atol=1e-5)
  assert not np.allclose(np.asarray(warm), np.asarray(late), atol=1e-3)  # sparsity is active at S=24, 2x4 keys
  assert float(kl_warm) != pytest.approx(float(kl_late))


def test_dense_to_msa_conversion_copies_the_dense_weights(tmp_path):
  from m3_jax.train import checkpoint as ckpt_lib
  from m3_jax.core import sharding
  from m3_jax.train import state as state_lib
  from m3_jax.train.optimizer import OptimConfig, make_optimizer
  dense_cfg = msa_cfg(layer_types=["full_attention", "full_attention"])
  dense = randomize(TextModel(dense_cfg, rngs=nnx.Rngs(3)))
  _, p, r = nnx.split(dense, nnx.Param, ...)
  path = ckpt_lib.export_params(str(tmp_path / "dense"), {"params": p, "rest": r}, dense_cfg.to_dict())
  mesh = sharding.make_mesh({"data": 1})
  tx, _ = make_optimizer(OptimConfig(total_steps=10, warmup_steps=1))
  msa = msa_cfg()
  _, state, _ = state_lib.init_state(msa, tx, mesh, seed=0)
  fresh_indexer = {k: v.get_value() for k, v in nnx.to_flat_state(state.params) if "indexer" in k}
  state = state_lib.init_from_export(state, path, mesh)
  dense_flat = dict(nnx.to_flat_state(p))
  for k, v in nnx.to_flat_state(state.params):
    if "indexer" in k:
      np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(fresh_indexer[k]))
    else:
      np.testing.assert_array_equal(np.asarray(v.get_value()), np.asarray(dense_flat[k].get_value()))


@pytest.mark.slow
def test_pallas_sparse_attention_in_the_model_matches_xla():
  """msa_impl="pallas" (Pallas interpret mode on the CPU) gives the xla model's logits and gradients, with sparsity
  active (topk * block_size = 8 < S = 24)."""
  cfg = msa_cfg()
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(0)))
  pallas_model = TextModel(cfg.replace(msa_impl="pallas"), rngs=nnx.Rngs(0))
  nnx.update(pallas_model, nnx.state(model))
  assert_same_logits_and_grads(pallas_model, model)


@pytest.mark.slow
def test_pallas_training_step_with_lse_fusion_matches_xla():
  """A training forward on the Pallas kernels (fused selection, sparse attention returning its LSE, KL reusing it)
  gives the xla model's KL and the same KL and LM gradients; with fp8 index scoring (msa_index_fp8) both pick the
  same blocks. (One case only: each interpret-mode model gradient costs ~15 s of the CI budget.)"""
  cfg = msa_cfg(msa_index_fp8=True)
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(0)))
  pallas_model = TextModel(cfg.replace(msa_impl="pallas"), rngs=nnx.Rngs(0))
  nnx.update(pallas_model, nnx.state(model))
  x = ids()
  assert_same_kl_and_lm_grads(model, pallas_model, x, "pallas", atol=2e-6)
  _, aux_x = model(x, step_state={"step": jnp.int32(10**6)})
  _, aux_p = pallas_model(x, step_state={"step": jnp.int32(10**6)})
  np.testing.assert_allclose(float(aux_p["kl_loss"]), float(aux_x["kl_loss"]), rtol=1e-5)


def _count_primitive(jaxpr, name: str) -> int:
  """Occurrences of primitive `name` in a jaxpr, sub-jaxprs (remat, pjit, cond, custom rules) included."""
  return sum(eqn.primitive.name == name for eqn in jaxpr_eqns(jaxpr))


def test_diagnostics_cadence_keeps_losses_and_gradients():
  """msa_metrics_every=2: the recall metrics are those of the every-step model on steps 0, 1, 3 (step 0, and step + 1
  divisible by 2) and NaN on step 2; losses and gradients are the same on every step."""
  base = randomize(TextModel(msa_cfg(), rngs=nnx.Rngs(5)))
  sparse = TextModel(msa_cfg(msa_metrics_every=2), rngs=nnx.Rngs(5))
  nnx.update(sparse, nnx.state(base))
  x = ids(seed=5)
  for step in range(4):
    (lm_b, aux_b), (lm_s, aux_s) = (m(x, step_state={"step": jnp.int32(step)}) for m in (base, sparse))
    np.testing.assert_array_equal(np.asarray(lm_s), np.asarray(lm_b))
    assert float(aux_s["kl_loss"]) == float(aux_b["kl_loss"])
    recall = {k: v for k, v in aux_b["metrics"].items() if not k.endswith("/kl")}
    assert recall and all(np.isfinite(np.asarray(v)).all() for v in recall.values())
    for k, v in recall.items():
      got = np.asarray(aux_s["metrics"][k])
      if step != 2:
        # inside lax.cond XLA fuses the reductions differently: f32 rounding, a few ulps
        np.testing.assert_allclose(got, np.asarray(v), rtol=1e-6, err_msg=f"step {step} {k}")
      else:
        assert np.isnan(got).all(), (step, k, got)
  # _grads takes step 10**6: odd step + 1, a step without diagnostics
  assert_same_kl_and_lm_grads(base, sparse, x, "metrics_every=2", rtol=1e-6, atol=1e-8)
  with pytest.raises(ValueError, match="msa_metrics_every=0"):
    TextModel(msa_cfg(msa_metrics_every=0), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("policy", ["full", "save_selection", "save_matmuls"])
def test_remat_policies_keep_losses_and_gradients(policy):
  """remat (any policy) gives the LM and KL losses and gradients of the model without remat (f32); the
  save_selection policy keeps the top-k out of the backward's recompute: one top_k per MSA layer in the whole
  gradient program, against two for full remat (forward + recompute)."""
  cfg = msa_cfg(layer_types=["minimax_m3_sparse", "minimax_m3_sparse"])
  base = randomize(TextModel(cfg, rngs=nnx.Rngs(4)))
  rematted = TextModel(cfg.replace(remat=True, remat_policy=policy), rngs=nnx.Rngs(4))
  nnx.update(rematted, nnx.state(base))
  x = ids()
  assert_same_kl_and_lm_grads(base, rematted, x, policy, rtol=1e-5, atol=1e-7)
  (lm_b, aux_b), (lm_r, aux_r) = (m(x, step_state={"step": jnp.int32(10**6)}) for m in (base, rematted))
  np.testing.assert_allclose(np.asarray(lm_r), np.asarray(lm_b), rtol=1e-6)
  np.testing.assert_allclose(float(aux_r["kl_loss"]), float(aux_b["kl_loss"]), rtol=1e-6)

  graphdef, state = nnx.split(rematted)

  def loss(st):
    logits, aux = nnx.merge(graphdef, st)(x, step_state={"step": jnp.int32(10**6)})
    return jnp.mean(logits) + aux["kl_loss"]

  top_ks = _count_primitive(jax.make_jaxpr(jax.grad(loss))(state).jaxpr, "top_k")
  assert top_ks == {"full": 4, "save_selection": 2, "save_matmuls": 2}[policy], top_ks
