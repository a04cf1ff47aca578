"""The text model against an independent float64 numpy implementation of MiniMax-M3's text tower."""

import dataclasses

import numpy as np
import pytest
import jax.numpy as jnp
from flax import nnx

from m3_jax.models.attention.dense import segment_runs
from m3_jax.models.config import TextConfig
from m3_jax.models.layers import apply_rope
from m3_jax.models.transformer import TextModel
from tests.model_utils import np_params, randomize
from tests.oracles import np_forward


def tiny_cfg(**kw):
  base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, rotary_dim=4, rope_theta=10000.0, dense_intermediate_size=48, intermediate_size=16,
              shared_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, routed_scaling_factor=2.0,
              swiglu_limit=1.5, layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])
  base.update(kw)
  return TextConfig(**base)


# ---- tests ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("moe_impl", ["ragged", "dense"])
def test_logits_match_float64_oracle(moe_impl):
  cfg = tiny_cfg(moe_impl=moe_impl)
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(0)))
  ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 11))
  logits, aux = model(jnp.asarray(ids))
  params = np_params(model)
  for b in range(2):
    ref = np_forward(params, cfg, ids[b])
    np.testing.assert_allclose(np.asarray(logits[b]), ref, atol=2e-4, rtol=2e-4)
  assert aux["expert_load"].shape == (2, cfg.num_local_experts)
  np.testing.assert_allclose(np.asarray(aux["expert_load"]).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_packed_segments_equal_separate_sequences():
  cfg = tiny_cfg()
  model = randomize(TextModel(cfg, rngs=nnx.Rngs(1)))
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 5)
  packed = np.concatenate([a, b])[None]
  seg = np.array([[1] * 7 + [2] * 5])
  pos = np.array([list(range(7)) + list(range(5))])
  lp, _ = model(jnp.asarray(packed), jnp.asarray(pos), jnp.asarray(seg))
  la, _ = model(jnp.asarray(a[None]))
  lb, _ = model(jnp.asarray(b[None]))
  np.testing.assert_allclose(np.asarray(lp[0, :7]), np.asarray(la[0]), atol=1e-5)
  np.testing.assert_allclose(np.asarray(lp[0, 7:]), np.asarray(lb[0]), atol=1e-5)
  ref = np_forward(np_params(model), cfg, packed[0], pos[0], seg[0])
  np.testing.assert_allclose(np.asarray(lp[0]), ref, atol=2e-4, rtol=2e-4)


def test_segment_runs_for_cudnn_packed_layout():
  """The runs handed to cuDNN's packed layout (dense.segment_runs) against a plain loop over each row: offsets and
  lengths of every run of equal ids (padding included), -1 past the row's runs; the true count when a row has more
  runs than fit (the caller then takes the masked route)."""
  rows = [np.repeat([1, 2, 3, 0], [5, 1, 7, 3]), np.repeat([1, 2], [10, 6]), np.arange(16) + 1]
  seg = np.stack(rows).astype(np.int32)
  for M in (4, 16):
    lengths, offsets, runs = (np.asarray(a) for a in segment_runs(jnp.asarray(seg), M))
    for b, row in enumerate(seg):
      starts = [t for t in range(len(row)) if t == 0 or row[t] != row[t - 1]]
      lens = np.diff(starts + [len(row)]).tolist()
      assert runs[b] == len(starts)
      if len(starts) <= M:
        assert offsets[b].tolist() == starts + [-1] * (M + 1 - len(starts))
        assert lengths[b].tolist() == lens + [-1] * (M - len(starts))


def test_rope_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

  def score(pq, pk):
    rq = apply_rope(q, jnp.array([[pq]]), rotary_dim=8, theta=100.0)
    rk = apply_rope(k, jnp.array([[pk]]), rotary_dim=8, theta=100.0)
    return float(jnp.sum(rq * rk))

  assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
  # the channels past rotary_dim are untouched
  r = apply_rope(q, jnp.array([[7]]), rotary_dim=8, theta=100.0)
  np.testing.assert_array_equal(np.asarray(r[..., 8:]), np.asarray(q[..., 8:]))


def test_router_bias_only_chooses():
  """A large bias on one expert makes it chosen for every token, but its weight stays sigmoid-renormalised."""
  from m3_jax.models.moe import route
  logits = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)
  bias = jnp.array([0.0, 0.0, 0.0, 100.0])
  w, idx, s = route(logits, bias, 2, 2.0)
  assert np.all(np.asarray(idx)[:, 0] == 3)
  s = np.asarray(s)
  for t in range(5):
    chosen = np.asarray(idx[t])
    np.testing.assert_allclose(np.asarray(w[t]), s[t, chosen] / s[t, chosen].sum() * 2.0, rtol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(num_key_value_heads=3), "not a multiple of"),
    (dict(layer_types=["full_attention"] * 2), "layer_types has 2 entries"),
    (dict(mlp_layer_types=["dense", "moe", "dense"]), r"mlp_layer_types\[1\]"),
    (dict(rotary_dim=9), "rotary_dim"),
    (dict(attention_impl="flash"), "attention_impl"),
])
def test_config_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    tiny_cfg(**bad)


def test_hf_config_names_round_trip():
  hf = {"model_type": "minimax_m3_vl_text", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.5},
        "sparse_attention_config": {"sparse_block_size": 32, "sparse_topk_blocks": 4,
                                    "sparse_attention_freq": [0, 1]},
        "moe_layer_freq": [0, 1], "vocab_size": 100}
  cfg = TextConfig.from_hf_dict(hf)
  assert cfg.rotary_dim == 8 and cfg.rope_theta == 5e6
  assert cfg.index_block_size == 32 and cfg.index_topk_blocks == 4
  assert cfg.layer_types == ("full_attention", "minimax_m3_sparse")
  assert cfg.mlp_layer_types == ("dense", "sparse")
  assert TextConfig.from_dict(cfg.to_dict()) == cfg


def test_hf_defaults_are_the_text_configs():
  """config.json resolution (models/hf_config.py) fills omitted fields with HF's class defaults, which must stay the
  real model's, i.e. TextConfig's."""
  from m3_jax.models import hf_config  # noqa: PLC0415
  assert hf_config.HF_DEFAULT_LAYERS == TextConfig.num_hidden_layers
  assert hf_config.HF_DEFAULT_HEAD_DIM == TextConfig.head_dim
  assert hf_config.HF_DEFAULT_THETA == TextConfig.rope_theta
  assert set(hf_config.HF_FIELDS) <= {f.name for f in dataclasses.fields(TextConfig)}


def test_param_and_flop_counts_pinned_to_the_closed_form():
  """A 2-layer model (dense attention + dense MLP, then MSA + MoE), counted by hand."""
  from m3_jax.models.flops import param_count, train_flops_per_token  # noqa: PLC0415
  cfg = TextConfig(vocab_size=10, hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=2, rotary_dim=2, dense_intermediate_size=6, intermediate_size=3,
                   shared_intermediate_size=5, num_local_experts=4, num_experts_per_tok=2,
                   layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
                   index_n_heads=1, index_head_dim=2, index_block_size=4, index_topk_blocks=2)
  # embed + lm_head + final norm: 2*10*4 + 4 = 84; per layer 2 RMSNorms: 8; attention q 4*2*2 + k, v 2*4*1*2 +
  # o 2*2*4 + q/k norms 2*2 = 52; MSA indexer q 4*1*2 + k 4*2 + norms 2*2 = 20; dense MLP 3*4*6 = 72;
  # MoE: 4 experts of 3*4*3 = 36, shared 3*4*5 = 60, router 4*4 + 4 = 20 (active: 2 experts).
  total = 84 + (8 + 52 + 72) + (8 + 52 + 20 + 4 * 36 + 60 + 20)
  active = 84 + (8 + 52 + 72) + (8 + 52 + 20 + 2 * 36 + 60 + 20)
  assert param_count(cfg) == {"total": total, "active": active} == {"total": 520, "active": 448}
  # 6 x (active - embedding 10*4) + dense scores 6*2*(T/2)*2*2 + MSA scores over min(T/2, 2*4) keys
  # 6*2*keys*2*2 + index scoring 6*(T/2)*1*2.
  assert train_flops_per_token(cfg, 16) == 6 * 408 + 6 * 2 * 8 * 4 + (6 * 2 * 8 * 4 + 6 * 8 * 2) == 3312
  assert train_flops_per_token(cfg, 64) == 6 * 408 + 6 * 2 * 32 * 4 + (6 * 2 * 8 * 4 + 6 * 32 * 2) == 4752


def test_capacity_moe_equals_dropless_with_room_and_drops_overflow():
  from m3_jax.models.moe import MoE, MoEDims
  dims = MoEDims(d_model=16, num_experts=4, top_k=2, intermediate=8, shared_intermediate=8,
                 routed_scaling_factor=2.0, alpha=1.702, limit=3.0, capacity_factor=4.0)  # C = N*k: no drops
  ragged = randomize(MoE(dims, impl="ragged", rngs=nnx.Rngs(0)), seed=3)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)
  want, _ = ragged(x)
  roomy = MoE(dims, impl="capacity", rngs=nnx.Rngs(0))
  nnx.update(roomy, nnx.state(ragged))
  got, _ = roomy(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  # capacity 1 per expert: only the first assignment of each expert survives; everything else is shared-only
  tight = MoE(dataclasses.replace(dims, capacity_factor=4 / 20), impl="capacity", rngs=nnx.Rngs(0))
  nnx.update(tight, nnx.state(ragged))
  got, _ = tight(x)
  from m3_jax.models.moe import route
  xf = np.asarray(x.reshape(10, 16))
  w, idx, _ = route(jnp.asarray(xf) @ ragged.router[...], ragged.e_score_correction_bias[...], 2, 2.0)
  idx, w = np.asarray(idx), np.asarray(w)
  expect = np.array(ragged.shared(jnp.asarray(xf)))
  seen = set()
  for a in range(20):  # assignments in token-major order, as the capacity path ranks them
    t, j = divmod(a, 2)
    e = idx[t, j]
    if e in seen:
      continue
    seen.add(e)
    gu = np.einsum("d,dgi->gi", xf[t], np.asarray(ragged.gate_up[...])[e])
    g, u = np.minimum(gu[0], 3.0), np.clip(gu[1], -3.0, 3.0)
    expect[t] += w[t, j] * ((u + 1) * g / (1 + np.exp(-1.702 * g))) @ np.asarray(ragged.down[...])[e]
  np.testing.assert_allclose(np.asarray(got).reshape(10, 16), expect, atol=1e-5)


def test_gather_slots_and_its_gather_only_backward_against_numpy():
  import jax
  from m3_jax.models.moe_parallel import gather_slots, sort_slots
  rng = np.random.default_rng(0)
  n, k, e, d = 7, 3, 5, 4
  idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])  # [N, k] distinct experts per token
  order, inverse, sizes = sort_slots(jnp.asarray(idx), e)
  order, inverse = np.asarray(order), np.asarray(inverse)
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(idx.ravel(), minlength=e))
  np.testing.assert_array_equal(idx.ravel()[order], np.sort(idx.ravel()))
  np.testing.assert_array_equal(order[inverse], np.arange(n * k))
  x = rng.normal(size=(n, d)).astype(np.float32)
  cot = rng.normal(size=(n * k, d)).astype(np.float32)
  out, vjp = jax.vjp(lambda x: gather_slots(x, jnp.asarray(order), jnp.asarray(inverse), k), jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(out), x[order // k])
  want = np.zeros((n, d), np.float64)
  np.add.at(want, order // k, np.float64(cot))  # what autodiff of x[rows] computes, by scatter-add
  np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(cot))[0]), want, rtol=1e-6, atol=1e-6)
  y = rng.normal(size=(n * k, d)).astype(np.float32)  # k = 1: the combine's return from sorted to slot order
  out, vjp = jax.vjp(lambda y: gather_slots(y, jnp.asarray(inverse), jnp.asarray(order), 1), jnp.asarray(y))
  np.testing.assert_array_equal(np.asarray(out), y[inverse])
  want = np.zeros_like(y)
  want[inverse] = cot
  np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(cot))[0]), want)


def test_ragged_moe_gradients_equal_the_dense_reference():
  import jax
  from m3_jax.models.moe import MoE, MoEDims
  dims = MoEDims(d_model=16, num_experts=6, top_k=2, intermediate=8, shared_intermediate=8,
                 routed_scaling_factor=2.0, alpha=1.702, limit=3.0)
  ragged = randomize(MoE(dims, impl="ragged", rngs=nnx.Rngs(0)), seed=5)
  dense = MoE(dims, impl="dense", rngs=nnx.Rngs(0))
  nnx.update(dense, nnx.state(ragged))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 16)), jnp.float32)
  cot = jnp.asarray(np.random.default_rng(2).normal(size=(2, 9, 16)), jnp.float32)

  def grads(model):
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params, x):
      y, aux = nnx.merge(graph, params, rest)(x)
      return jnp.sum(y * cot) + aux["moe_aux_loss"]
    return jax.grad(f, argnums=(0, 1))(params, x)

  (gp_r, gx_r), (gp_d, gx_d) = grads(ragged), grads(dense)
  np.testing.assert_allclose(np.asarray(gx_r), np.asarray(gx_d), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(gp_r), jax.tree.leaves(gp_d)):
    assert np.abs(np.asarray(b)).max() > 0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
