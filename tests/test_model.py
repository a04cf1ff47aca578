"""The text model against an independent float64 numpy implementation of MiniMax-M3's text tower."""

import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.models.config import TextConfig
from m3_jax.models.layers import apply_rope
from m3_jax.models.transformer import TextModel


def tiny_cfg(**kw):
  base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, rotary_dim=4, rope_theta=10000.0, dense_intermediate_size=48, intermediate_size=16,
              shared_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, routed_scaling_factor=2.0,
              swiglu_limit=1.5, layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"])
  base.update(kw)
  return TextConfig(**base)


def randomize(model, seed=0, std=0.3):
  """Non-trivial values everywhere (norm scales, router bias) so every term of the formulas is exercised."""
  state = nnx.state(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  nnx.update(model, jax.tree.unflatten(treedef, new))
  return model


# ---- float64 numpy oracle (written from the paper / HF semantics, no shared code with the model) -------------

def np_rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1 + w)


def np_rope(x, pos, rdim, theta):
  # x [T, H, D]; rotate_half NeoX on the first rdim channels, as HF's apply_rotary_pos_emb.
  inv = 1.0 / theta ** (np.arange(0, rdim, 2) / rdim)
  ang = pos[:, None] * inv[None]
  emb = np.concatenate([ang, ang], -1)
  cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]
  r = x[..., :rdim]
  half = np.concatenate([-r[..., rdim // 2:], r[..., :rdim // 2]], -1)
  return np.concatenate([r * cos + half * sin, x[..., rdim:]], -1)


def np_swiglu(g, u, alpha, limit):
  g = np.minimum(g, limit)
  u = np.clip(u, -limit, limit)
  return (u + 1) * g * (1 / (1 + np.exp(-alpha * g)))


def np_mlp(x, gate_up, down, cfg):
  gu = np.einsum("td,dgi->tgi", x, gate_up)
  return np_swiglu(gu[:, 0], gu[:, 1], cfg.swiglu_alpha, cfg.swiglu_limit) @ down


def np_moe(x, p, cfg):
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    s = 1 / (1 + np.exp(-(x[t] @ p["router"])))
    chosen = np.argsort(-(s + p["e_score_correction_bias"]), kind="stable")[:cfg.num_experts_per_tok]
    w = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
    for e, we in zip(chosen, w):
      out[t] += we * np_mlp(x[t:t + 1], p["gate_up"][e], p["down"][e], cfg)[0]
  shared = p["shared"]
  return out + np_mlp(x, shared["gate_up"], shared["down"], cfg)


def np_attention(x, p, cfg, pos, seg):
  t = x.shape[0]
  q = np.einsum("td,dhk->thk", x, p["q_proj"])
  k = np.einsum("td,dhk->thk", x, p["k_proj"])
  v = np.einsum("td,dhk->thk", x, p["v_proj"])
  q = np_rope(np_rms(q, p["q_norm"]["weight"], cfg.rms_norm_eps), pos, cfg.rotary_dim, cfg.rope_theta)
  k = np_rope(np_rms(k, p["k_norm"]["weight"], cfg.rms_norm_eps), pos, cfg.rotary_dim, cfg.rope_theta)
  g = cfg.num_attention_heads // cfg.num_key_value_heads
  out = np.zeros_like(q)
  for h in range(cfg.num_attention_heads):
    for i in range(t):
      js = [j for j in range(i + 1) if seg[j] == seg[i]]
      s = np.array([q[i, h] @ k[j, h // g] for j in js]) / np.sqrt(cfg.head_dim)
      pr = np.exp(s - s.max())
      pr /= pr.sum()
      out[i, h] = sum(pj * v[j, h // g] for pj, j in zip(pr, js))
  return np.einsum("thk,hkd->td", out, p["o_proj"])


def np_forward(params, cfg, ids, pos=None, seg=None):
  t = len(ids)
  pos = np.arange(t, dtype=np.float64) if pos is None else np.asarray(pos, np.float64)
  seg = np.ones(t, int) if seg is None else np.asarray(seg)
  x = params["embed_tokens"][ids]
  for i, mt in enumerate(cfg.mlp_layer_types):
    lp = params["layers"][i]
    x = x + np_attention(np_rms(x, lp["input_layernorm"]["weight"], cfg.rms_norm_eps), lp["self_attn"], cfg, pos,
                         seg)
    y = np_rms(x, lp["post_attention_layernorm"]["weight"], cfg.rms_norm_eps)
    x = x + (np_mlp(y, lp["mlp"]["gate_up"], lp["mlp"]["down"], cfg) if mt == "dense" else np_moe(y, lp["mlp"], cfg))
  return np_rms(x, params["norm"]["weight"], cfg.rms_norm_eps) @ params["lm_head"]


def np_params(model):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))


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
