"""MSA ablation switches (issue 19) against float64 oracles: one block set shared by all KV groups
(msa_selection="shared"), token-granular selection at a fixed token budget (block 16 x top 128, 64 x 32, 128 x 16),
the index branch's input detach; and the diagnostics group_jaccard and needle_block_selected.

The model-level tests sit on one MSA layer (module fixture) and jit every call: eager ops and whole-model
compilations cost seconds each on 2 cores."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from m3_jax.models.attention.msa import MSAAttention, MSADims, shared_index_queries
from m3_jax.models.attention.msa_diagnostics import block_metrics, group_jaccard, needle_block_selected
from m3_jax.models.config import TextConfig, msa_token_budget
from pallas_kernels import msa
from tests.model_utils import msa_cfg
from tests.oracles import (Case, assert_attention_matches, assert_close, assert_selection, make_inputs, np_attention,
                           np_kl_shared, np_select_blocks, np_select_from_scores, np_support)


def shared_oracle_selection(q_idx, k_idx, c: Case):
  """(block_idx [B, Hkv, T, slots], raw block scores [B, Hkv, T, nb]): the HF recipe on the per-head token scores
  q_idx_h . k_idx summed over the index heads (float64), one set copied to every group."""
  q_idx, k_idx = np.float64(q_idx), np.float64(k_idx)
  s = sum(np.einsum("bti,bsi->bts", q_idx[:, :, h], k_idx) for h in range(q_idx.shape[2]))[:, None]  # [B, 1, T, S]
  sel, raw = np_select_from_scores(s, c.block_size, c.topk, c.local_blocks, c.offset)
  return np.repeat(sel, c.Hkv, axis=1), np.repeat(raw, c.Hkv, axis=1)


# ---------------------------------------------------------------------------------------------------------------------
# Shared selection
# ---------------------------------------------------------------------------------------------------------------------


LAYER = Case("layer", B=2, T=32, S=32, Hq=4, Hkv=2, D=8, block_size=4, topk=3)


@pytest.fixture(scope="module")
def shared_layer():
  """An MSA layer (msa_cfg's dims) with msa_selection="shared", block 4 x top 3, random parameters (numpy: eager
  jax.random costs seconds of compilation), and its input x [B, T, 32]."""
  dims = MSADims.from_config(msa_cfg(msa_selection="shared", index_topk_blocks=3))
  layer = nnx.eval_shape(lambda: MSAAttention(dims, rngs=nnx.Rngs(0)))  # shapes only: the values come next
  rng = np.random.default_rng(3)
  nnx.update(layer, jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype),
                                 nnx.state(layer)))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((LAYER.B, LAYER.T, 32)), jnp.float32)
  return layer, x


def variant(layer, **changes):
  """The same parameters under other MSA switches (MSADims fields: selection, impl, block_size, ...)."""
  other = nnx.clone(layer)
  other.msa = dataclasses.replace(layer.msa, **changes)
  return other


@nnx.jit  # one compilation instead of one per eager op (seconds on 2 cores)
def run_layer(layer, x):
  """(y, block_idx, kl_loss, group_jaccard, (q, k, v), (q_idx, k_idx)) of a training and a capture forward."""
  pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  y, aux = layer(x, pos, capture=True)
  _, aux_train = layer(x, pos, step_state={"step": jnp.int32(0)})  # step 0: diagnostics computed
  return (y, aux["block_idx"], aux_train["kl_loss"], aux_train["metrics"]["group_jaccard"], layer.project(x, pos),
          layer.indexer(x, pos))


def check_shared_layer(layer, x, c: Case):
  """The layer's shared selection is the top-k of the index scores summed over the index heads, the same for every
  group and unlike the per-group one; its output is sparse attention over that selection (projected by o_proj);
  its KL is mean_g KL(P_g || Q) = KL(P_all || Q) + mean_g KL(P_g || P_all); its group_jaccard is 1."""
  y, sel, kl_got, jaccard, (q, k, v), (q_idx, k_idx) = jax.tree.map(np.asarray, run_layer(layer, x))
  want, raw = shared_oracle_selection(q_idx, k_idx, c)
  assert_selection(sel, want, raw, c)
  np.testing.assert_array_equal(sel[:, 0], sel[:, 1])
  assert float(jaccard) == 1.0
  per_group, _ = np_select_blocks(q_idx, k_idx, c.block_size, c.topk, c.local_blocks, c.offset)
  assert float(group_jaccard(jnp.asarray(per_group, jnp.int32), c.num_blocks)) < 0.9  # sharing is visible here

  support = np_support(sel, c.T, c.S, c.block_size, c.offset)
  o_proj = np.asarray(layer.o_proj[...], np.float64)
  want_y = np.einsum("bthk,hkd->btd", np_attention(q, k, v, support, c.D ** -0.5), o_proj)
  assert_close(y, want_y, "shared output")
  kl, gap, _, _ = np_kl_shared(q, k, q_idx, k_idx, support[:, :1], c.D ** -0.5, c.d_idx ** -0.5)
  assert gap > 1e-3  # the two terms are told apart
  assert_close(kl_got, kl + gap, "shared kl")


def test_shared_selection_layer_matches_float64_oracle(shared_layer):
  check_shared_layer(*shared_layer, LAYER)


@pytest.mark.slow
def test_shared_token_granular_layer_on_pallas_interpret(shared_layer):
  """The same on the Pallas kernels (interpret mode on the CPU: fused selection of the one summed index head,
  KV-outer sparse attention on the broadcast selection, KL with LSE fusion) at token granularity: block 16 x top 2
  (32 of 64 keys)."""
  layer, _ = shared_layer
  c = Case("pallas16", B=1, T=64, S=64, Hq=4, Hkv=2, D=8, block_size=16, topk=2)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((c.B, c.T, 32)), jnp.float32)
  check_shared_layer(variant(layer, impl="pallas", block_size=16, topk_blocks=2), x, c)


def test_detach_switch_decides_whether_the_kl_reaches_the_trunk(shared_layer):
  """detach_index_input=True: the KL's gradient does not reach the layer's input (the trunk below it); False: it
  does. With the shared selection (test_msa_model.py checks the per-group one in the whole model)."""
  layer, x = shared_layer
  pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
  grad_x = nnx.jit(lambda lay, x: jax.grad(
      lambda x: lay(x, pos, step_state={"step": jnp.int32(1)})[1]["kl_loss"])(x))
  assert layer.msa.detach_index_input
  assert not np.asarray(grad_x(layer, x)).any()
  assert np.abs(np.asarray(grad_x(variant(layer, detach_index_input=False), x))).max() > 1e-4


def test_shared_kl_gradient_targets_the_mean_of_all_query_heads():
  """kl_loss (xla) on the shared index queries has the gradient of KL(P_all || Q) (P_all: the mean attention of all
  Hq heads; Q: the softmax of the summed index scores) w.r.t. q_idx and k_idx."""
  c = Case("kl", B=2, T=20, S=20, Hq=4, Hkv=2, D=8, block_size=4, topk=2)
  x = make_inputs(c, seed=1)
  sel, _ = shared_oracle_selection(x["q_idx"], x["k_idx"], c)
  support = np_support(sel, c.T, c.S, c.block_size, c.offset)
  kl, gap, dq, dk = np_kl_shared(x["q"], x["k"], x["q_idx"], x["k_idx"], support[:, :1], c.D ** -0.5, 8 ** -0.5)

  @jax.jit
  def value_and_grads(qi, ki):
    return jax.value_and_grad(lambda qi, ki: msa.kl_loss(
        x["q"], x["k"], shared_index_queries(qi), ki, sel.astype(np.int32), block_size=c.block_size,
        implementation="xla"), argnums=(0, 1))(qi, ki)

  val, (gq, gk) = value_and_grads(jnp.asarray(x["q_idx"]), jnp.asarray(x["k_idx"]))
  assert_close(val, kl + gap, "value")
  assert_close(gq, dq, "d q_idx")
  assert_close(gk, dk, "d k_idx")


# ---------------------------------------------------------------------------------------------------------------------
# Token-granular selection at a fixed budget
# ---------------------------------------------------------------------------------------------------------------------

def _selection_and_attention(impl, x, c: Case, selection: str):
  """(selection, oracle selection, oracle raw scores, (out, dq, dk, dv)) of the ops as the layer calls them."""
  q_idx = x["q_idx"] if selection == "per_group" else np.asarray(shared_index_queries(jnp.asarray(x["q_idx"])))
  sel_q = q_idx if selection == "per_group" else q_idx[:, :, :1]
  sel = msa.select_blocks(sel_q, x["k_idx"], block_size=c.block_size, topk=c.topk, local_blocks=c.local_blocks,
                          q_offset=c.q_offset, implementation=impl)
  sel = np.broadcast_to(np.asarray(sel), (c.B, c.Hkv) + sel.shape[2:])
  if selection == "per_group":
    want, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  else:
    want, raw = shared_oracle_selection(x["q_idx"], x["k_idx"], c)

  def f(q, k, v):
    return msa.sparse_attention(q, k, v, sel, block_size=c.block_size, q_offset=c.q_offset, implementation=impl)

  out, vjp = jax.vjp(f, *(jnp.asarray(x[n]) for n in "qkv"))
  return sel, want, raw, (out, *vjp(jnp.asarray(x["dout"])))


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_token_budget_selection_matches_oracle_on_xla(block_size):
  """msa_token_budget(block_size) = 2048 keys per (query, group) at S = 4096 (the last 8 queries, a prefill chunk):
  per-group and shared selections and the sparse attention (output and VJP) on xla equal the float64 oracle, and
  the queries read 2048 visible keys (block 16 x top 128, 64 x 32, 128 x 16)."""
  budget = msa_token_budget(block_size)
  c = Case(f"budget{block_size}", B=1, T=8, S=4096, Hq=4, Hkv=2, D=16, block_size=budget["index_block_size"],
           topk=budget["index_topk_blocks"], d_idx=16)
  x = make_inputs(c, seed=block_size)
  for selection in ("per_group", "shared"):
    sel, want, raw, got = _selection_and_attention("xla", x, c, selection)
    assert_selection(sel, want, raw, c)
    support = np_support(sel, c.T, c.S, c.block_size, c.offset)
    # every selected block whole, except the query's own one past the query: 2048 keys for the block's last query
    own_block_future = c.block_size - 1 - (c.offset + np.arange(c.T)) % c.block_size
    np.testing.assert_array_equal(support.sum(-1), np.broadcast_to(2048 - own_block_future, (c.B, c.Hkv, c.T)))
    assert_attention_matches(got, x, support, c.D ** -0.5)


# ---------------------------------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------------------------------

# Three groups, two queries; nb = 4 blocks. Query 0: {0,1,2}, {0,1,3}, {2}: Jaccard 2/4, 1/3, 0/4 -> mean 5/18.
# Query 1: {3,2,1}, {1,2,3} (another order), {3}: 1, 1/3, 1/3 -> 5/9. Mean over queries 5/12.
JACCARD_EXAMPLE = np.array([[[[0, 1, 2], [3, 2, 1]], [[0, 1, 3], [1, 2, 3]], [[2, -1, -1], [3, -1, -1]]]], np.int32)


def test_group_jaccard_hand_computed():
  assert float(group_jaccard(jnp.asarray(JACCARD_EXAMPLE), 4)) == pytest.approx(5 / 12, abs=1e-7)
  # repeated ids count once (query 0), two empty sets are identical (query 1), and so is one group with itself
  assert float(group_jaccard(jnp.asarray([[[[1, 1, -1], [-1, -1, -1]], [[1, -1, -1], [-1, -1, -1]]]]), 4)) == 1.0
  assert float(group_jaccard(jnp.asarray(JACCARD_EXAMPLE[:, :1]), 4)) == 1.0
  # block_metrics samples rows linspace(T // 2, T - 1, 2) = 8, 15 of T = 16: the two example queries
  b, t, nb = 1, 16, 4
  block_idx = np.zeros((b, 3, t, 3), np.int32)
  block_idx[:, :, [8, 15]] = JACCARD_EXAMPLE
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((b, t, 3, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, 3, 8)), jnp.float32)
  m = jax.jit(lambda q, k, idx: block_metrics(q, k, idx, block_size=t // nb, local_blocks=1, q_offset=0,
                                              segment_ids=None, num_queries=2, key=jax.random.key(0)))(
                                                  q, k, jnp.asarray(block_idx))
  assert float(m["group_jaccard"]) == pytest.approx(5 / 12, abs=1e-7)


def test_needle_block_selected_hand_computed():
  # JACCARD_EXAMPLE with block_size 4: row 1 selects {3,2,1}, {1,2,3}, {3}; row 0 {0,1,2}, {0,1,3}, {2}.
  idx = jnp.asarray(JACCARD_EXAMPLE)
  hit = needle_block_selected(idx, np.array([[5, 9, 13]]), np.array([1]), 4)  # blocks 1, 2, 3 at row 1
  np.testing.assert_array_equal(hit, [[[True, True, True], [True, True, True], [False, False, True]]])
  hit = needle_block_selected(idx, np.array([12]), np.array([0]), 4)  # block 3 at row 0: only group 1
  np.testing.assert_array_equal(hit, [[False, True, False]])
  hit = needle_block_selected(idx, np.array([3]), np.array([0]), 4)  # block 0 at row 0; group 2's -1 slots no hit
  np.testing.assert_array_equal(hit, [[True, True, False]])
  with pytest.raises(ValueError, match="query_positions in \\[2, 2\\]"):
    needle_block_selected(idx, np.array([3]), np.array([2]), 4)
  with pytest.raises(ValueError, match="needle_positions has -1"):
    needle_block_selected(idx, np.array([-1]), np.array([0]), 4)
  with pytest.raises(ValueError, match="needle_positions shape"):
    needle_block_selected(idx, np.array([[[3]]]), np.array([0]), 4)


# ---------------------------------------------------------------------------------------------------------------------
# Config switches
# ---------------------------------------------------------------------------------------------------------------------


def test_config_switches_validate():
  assert TextConfig().msa_selection == "per_group" and TextConfig().detach_index_input
  with pytest.raises(ValueError, match="msa_selection='one'"):
    msa_cfg(msa_selection="one")
  with pytest.raises(ValueError, match="index_local_blocks=3"):
    msa_cfg(index_local_blocks=3)
  with pytest.raises(ValueError, match="index_block_size=0"):
    msa_cfg(index_block_size=0)
  assert msa_token_budget(16) == {"index_block_size": 16, "index_topk_blocks": 128}
  assert msa_token_budget(128) == {"index_block_size": 128, "index_topk_blocks": 16}
  with pytest.raises(ValueError, match="tokens=100 is not a multiple of block_size=16"):
    msa_token_budget(16, tokens=100)
  with pytest.raises(ValueError, match="block_size=0"):
    msa_token_budget(0)
