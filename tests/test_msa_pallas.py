"""The paths only the Pallas kernels have, against the float64 oracles of tests/oracles.py, in Pallas interpret mode
on the CPU: the KV-outer map, group sizes and random partial selections, the query-major baseline, bitwise
determinism, the KL kernel's teacher variants and LSE fusion, split-K and group-folded selection, fp8 index caches.
The checks every implementation passes (outputs and VJPs of each op, Pallas included) are in test_msa_ops.py.

Interpret mode fills every output of a pallas_call with NaN before the kernel runs, so an element that no program
writes (a missed chunk, a dropped pair, a skipped merge slot) surfaces as NaN: every check below also requires
finite results. PALLAS_SMALL_TILES force the code paths that only occur at scale on the GPU (see tests/oracles.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import msa
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import pallas_kl, pallas_select
from pallas_kernels.msa.pallas_map import build_kv_map
from tests.oracles import (CASES, PALLAS_SMALL_TILES, RAGGED_SEGMENTS, Case, assert_attention_matches, assert_close,
                           assert_selection, make_inputs, np_attention, np_kl, np_select_blocks, np_support)

# Every test here runs Pallas kernels in interpret mode (seconds each on a CPU): the full suite only.
pytestmark = pytest.mark.slow


def pallas_vjp(x, block_idx, c: Case, *, segment_ids=None, scale=None, q_offset=None, **knobs):
  """(out, dq, dk, dv) of the Pallas kernels for cotangent x['dout']."""
  f = lambda q, k, v: msa_pallas.sparse_attention(  # noqa: E731
      q, k, v, jnp.asarray(block_idx), block_size=c.block_size, scale=scale, segment_ids=segment_ids,
      q_offset=q_offset, **knobs)
  out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
  return (out, *vjp(jnp.asarray(x["dout"])))


def random_selection(rng, B, Hkv, T, S, block_size, topk, q_offset):
  """Duplicate-free random selections of visible blocks, a random number of them per row (partial rows), -1 last."""
  sel = np.full((B, Hkv, T, topk), -1, np.int32)
  for b in range(B):
    for h in range(Hkv):
      for t in range(T):
        visible = (q_offset + t) // block_size + 1
        n = rng.integers(1, min(topk, visible) + 1)
        sel[b, h, t, :n] = rng.permutation(visible)[:n]
  return sel


# ---------------------------------------------------------------------------------------------------------------------
# sparse_attention: KV-outer forward + backward, query-major baseline, the KV-outer map
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_group_sizes_with_random_partial_selections(G):
  c = Case(f"g{G}", B=1, T=24, S=40, Hq=2 * G, Hkv=2, D=16, block_size=8, topk=4)
  x = make_inputs(c, seed=G)
  sel = random_selection(np.random.default_rng(G), c.B, c.Hkv, c.T, c.S, c.block_size, c.topk, c.offset)
  got = pallas_vjp(x, sel, c, **PALLAS_SMALL_TILES)
  assert_attention_matches(got, x, np_support(sel, c.T, c.S, c.block_size, c.offset), c.D ** -0.5)


def test_all_local_selection():
  # Every slot a forced local block: each block's pairs are runs of consecutive queries (the diagonal hot spot).
  c = Case("all_local", B=1, T=48, S=48, Hq=4, Hkv=1, D=16, block_size=8, topk=3, local_blocks=3)
  x = make_inputs(c, seed=5)
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  got = pallas_vjp(x, sel.astype(np.int32), c, **PALLAS_SMALL_TILES)
  assert_attention_matches(got, x, np_support(sel, c.T, c.S, c.block_size, 0), c.D ** -0.5)


def test_packed_segments_with_ragged_last_block():
  c = Case("segments", B=2, T=32, S=32, Hq=4, Hkv=2, D=8, block_size=8, topk=3)
  x = make_inputs(c, seed=7)
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, 1, 0, RAGGED_SEGMENTS)
  got = pallas_vjp(x, sel.astype(np.int32), c, segment_ids=jnp.asarray(RAGGED_SEGMENTS), **PALLAS_SMALL_TILES)
  assert_attention_matches(got, x, np_support(sel, c.T, c.S, c.block_size, 0, RAGGED_SEGMENTS), c.D ** -0.5)
  # S not a multiple of the block size: the last block is padded inside the op.
  c2 = Case("ragged", B=1, T=21, S=29, Hq=4, Hkv=2, D=8, block_size=8, topk=3)
  x2 = make_inputs(c2, seed=8)
  sel2 = random_selection(np.random.default_rng(2), 1, 2, c2.T, c2.S, 8, 3, c2.offset)
  got2 = pallas_vjp(x2, sel2, c2, **PALLAS_SMALL_TILES)
  assert_attention_matches(got2, x2, np_support(sel2, c2.T, c2.S, 8, c2.offset), c2.D ** -0.5)


def test_traced_q_offset_in_a_jitted_decode_step():
  # Decoding against a fixed cache buffer: the offset is a tracer, one compilation serves every step.
  c = Case("decode", B=2, T=2, S=24, Hq=4, Hkv=2, D=8, block_size=4, topk=3)
  x = make_inputs(c, seed=9)
  step = jax.jit(lambda q, k, v, sel, n: msa_pallas.sparse_attention(q, k, v, sel, block_size=4, q_offset=n))
  for n in (5, 13, 22):
    sel = random_selection(np.random.default_rng(n), c.B, c.Hkv, c.T, c.S, 4, 3, n)
    out = step(x["q"], x["k"], x["v"], sel, jnp.int32(n))
    assert_close(out, np_attention(x["q"], x["k"], x["v"], np_support(sel, c.T, c.S, 4, n), c.D ** -0.5),
                 f"offset {n}")


def test_bitwise_deterministic_and_bf16_within_tolerance():
  c = Case("bf16", B=1, T=40, S=40, Hq=8, Hkv=2, D=16, block_size=8, topk=3)
  x = make_inputs(c, seed=11)
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, 1, 0)
  xb = {n: jnp.asarray(a, jnp.bfloat16) for n, a in x.items()}
  first = pallas_vjp(xb, sel.astype(np.int32), c, **PALLAS_SMALL_TILES)
  second = pallas_vjp(xb, sel.astype(np.int32), c, **PALLAS_SMALL_TILES)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # bf16 inputs, f32 accumulation: the result is as close to the f64 oracle on the same (rounded) inputs as bf16
  # rounding of the outputs and of P allows.
  want = np_attention(*(np.asarray(xb[n], np.float64) for n in ("q", "k", "v")),
                      np_support(sel, c.T, c.S, c.block_size, 0), c.D ** -0.5, np.asarray(xb["dout"], np.float64))
  for name, a, b in zip(("out", "dq", "dk", "dv"), first, want):
    assert first[0].dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
    assert err < 1e-2, f"{name}: relative error {err:.2e}"


def test_query_major_baseline_matches_oracle():
  c = Case("qmajor", B=2, T=37, S=53, Hq=8, Hkv=2, D=16, block_size=8, topk=4)
  x = make_inputs(c, seed=13)
  sel = random_selection(np.random.default_rng(4), c.B, c.Hkv, c.T, c.S, 8, 4, c.offset)
  out = msa_pallas.sparse_attention_query_major(x["q"], x["k"], x["v"], sel, block_size=8)
  assert_close(out, np_attention(x["q"], x["k"], x["v"], np_support(sel, c.T, c.S, 8, c.offset), c.D ** -0.5), "out")


def test_kv_map_inverts_the_selection():
  rng = np.random.default_rng(0)
  B, Hkv, T, K, nb, R = 2, 2, 30, 4, 6, 3
  sel = rng.integers(-1, nb, size=(B, Hkv, T, K)).astype(np.int32)
  m = jax.tree.map(np.asarray, build_kv_map(jnp.asarray(sel), nb, R))
  for bh in range(B * Hkv):
    rows = sel.reshape(B * Hkv, T, K)[bh]
    pairs = {}  # block -> ascending queries that chose it (once per query, whatever the repeats)
    for t in range(T):
      for j in sorted(set(rows[t][rows[t] >= 0].tolist())):
        pairs.setdefault(j, []).append(t)
    for j in range(nb):
      start, count = m.blk_start[bh, j], m.blk_count[bh, j]
      assert m.sorted_t[bh, start:start + count].tolist() == pairs.get(j, [])
    live = m.chunk_count[bh] > 0
    assert (m.chunk_count[bh] <= R).all()
    covered = sorted(p for s, n in zip(m.chunk_start[bh][live], m.chunk_count[bh][live]) for p in range(s, s + n))
    assert covered == list(range(sum(len(v) for v in pairs.values())))  # every pair in exactly one chunk
    for t in range(T):
      for s in range(K):
        pos, j = m.pair_pos[bh, t * K + s], rows[t, s]
        first = j >= 0 and j not in rows[t, :s].tolist()
        assert (pos >= 0) == first
        if first:
          assert m.sorted_t[bh, pos] == t and m.blk_start[bh, j] <= pos < m.blk_start[bh, j] + m.blk_count[bh, j]


def test_api_dispatch_and_gpu_shape_errors():
  c = CASES[0]
  x = make_inputs(c)
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  via_api = msa.sparse_attention(x["q"], x["k"], x["v"], sel.astype(np.int32), block_size=c.block_size,
                                 implementation="pallas")
  direct = msa_pallas.sparse_attention(x["q"], x["k"], x["v"], sel.astype(np.int32), block_size=c.block_size)
  np.testing.assert_array_equal(np.asarray(via_api), np.asarray(direct))
  with pytest.raises(ValueError, match="block_size=8"):
    msa_pallas.check_gpu_shapes(G=2, D=16, block_size=8)
  with pytest.raises(ValueError, match="head dim D=48"):
    msa_pallas.check_gpu_shapes(G=2, D=48, block_size=64)
  with pytest.raises(ValueError, match="G = Hq / Hkv = 3"):
    msa_pallas.check_gpu_shapes(G=3, D=64, block_size=64)
  # The dense warmup target has no kernel: "pallas" runs it on xla.
  dense = [msa.kl_loss(x["q"], x["k"], x["q_idx"], x["k_idx"], None, block_size=8, implementation=impl)
           for impl in ("pallas", "xla")]
  np.testing.assert_array_equal(np.asarray(dense[0]), np.asarray(dense[1]))


# ---------------------------------------------------------------------------------------------------------------------
# select_blocks: fused scoring + running top-k
# ---------------------------------------------------------------------------------------------------------------------


def test_select_blocks_per_group_segments_and_tiles():
  # Group 1 reads the negated index query (opposite preferences), segments cut the history, and small query tiles
  # with T not a multiple of the tile exercise the padded last tile.
  c = Case("groups_segments", B=2, T=32, S=32, Hq=2, Hkv=2, D=8, block_size=4, topk=3)
  x = make_inputs(c, seed=21)
  q_idx = np.stack([x["q_idx"][:, :, 0], -x["q_idx"][:, :, 0]], axis=2)
  for seg in (None, RAGGED_SEGMENTS):
    sel = pallas_select.select_blocks(q_idx, x["k_idx"], block_size=4, topk=3, query_tile=8,
                                      segment_ids=None if seg is None else jnp.asarray(seg))
    oracle, raw = np_select_blocks(q_idx, x["k_idx"], 4, 3, 1, 0, seg)
    assert_selection(sel, oracle, raw, c)
    # Exactly the xla implementation's output (same tie-breaking, same slot order).
    want = msa.select_blocks(q_idx, x["k_idx"], block_size=4, topk=3, implementation="xla",
                             segment_ids=None if seg is None else jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(sel), np.asarray(want))
  t = pallas_select.select_blocks(q_idx[:, :29], x["k_idx"], block_size=4, topk=3, query_tile=8)
  np.testing.assert_array_equal(np.asarray(t), np.asarray(msa.select_blocks(q_idx[:, :29], x["k_idx"], block_size=4,
                                                                            topk=3, implementation="xla")))


@pytest.mark.parametrize("splits", [2, 5])
def test_select_blocks_key_splits_equal_one_program(splits):
  # Split-K selection (decoding) merges per-range candidates: the same selection, per-row offsets included.
  c = Case("splits", B=2, T=3, S=64, Hq=2, Hkv=2, D=8, block_size=4, topk=5, local_blocks=2)
  x = make_inputs(c, seed=splits)
  offsets = jnp.asarray([30, 61], jnp.int32)
  args = dict(block_size=4, topk=5, local_blocks=2, q_offset=offsets)
  one = pallas_select.select_blocks(x["q_idx"], x["k_idx"], **args)
  split = pallas_select.select_blocks(x["q_idx"], x["k_idx"], key_splits=splits, **args)
  np.testing.assert_array_equal(np.asarray(split), np.asarray(one))
  for b, off in enumerate((30, 61)):
    oracle, raw = np_select_blocks(x["q_idx"][b:b + 1], x["k_idx"][b:b + 1], 4, 5, 2, off)
    assert_selection(np.asarray(split[b:b + 1]), oracle, raw, Case("row", B=1, T=3, S=64, Hq=2, Hkv=2, D=8,
                                                                   block_size=4, topk=5, local_blocks=2, q_offset=off))


@pytest.mark.parametrize("splits", [1, 3])
def test_select_blocks_folded_groups_equal_per_group_programs(splits):
  # Decoding folds all groups' queries into one program's rows (one read of each index-key block); the selection
  # must be the per-group programs' one, with per-row offsets, padded rows and split-K.
  c = Case("fold", B=2, T=5, S=48, Hq=3, Hkv=3, D=8, block_size=4, topk=4, local_blocks=1)
  x = make_inputs(c, seed=71)
  args = dict(block_size=4, topk=4, q_offset=jnp.asarray([20, 43], jnp.int32), key_splits=splits, query_tile=8)
  folded = pallas_select.select_blocks(x["q_idx"], x["k_idx"], fold_groups=True, **args)
  per_group = pallas_select.select_blocks(x["q_idx"], x["k_idx"], fold_groups=False, **args)
  np.testing.assert_array_equal(np.asarray(folded), np.asarray(per_group))
  for b, off in enumerate((20, 43)):
    oracle, raw = np_select_blocks(x["q_idx"][b:b + 1], x["k_idx"][b:b + 1], 4, 4, 1, off)
    assert_selection(np.asarray(folded[b:b + 1]), oracle, raw,
                     Case("row", B=1, T=5, S=48, Hq=3, Hkv=3, D=8, block_size=4, topk=4, q_offset=off))


# ---------------------------------------------------------------------------------------------------------------------
# kl_loss: sparse target over the selected tokens, gradients to the index branch only
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("segmented", [False, True], ids=["causal", "segments"])
def test_kl_loss_and_index_gradients_match_oracle(segmented):
  c = Case("kl", B=2, T=32, S=32, Hq=8, Hkv=2, D=16, block_size=4, topk=3, d_idx=16)
  x = make_inputs(c, seed=31)
  seg = RAGGED_SEGMENTS if segmented else None
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, 1, 0, seg)
  sel = sel.astype(np.int32)
  sel[0, 1, 5] = [-1, sel[0, 1, 5, 0], -1]  # partial row, slots out of order
  seg_arg = None if seg is None else jnp.asarray(seg)
  f = lambda q, k, qi, ki: msa.kl_loss(q, k, qi, ki, sel, block_size=4, implementation="pallas",  # noqa: E731
                                       segment_ids=seg_arg)
  loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x["q"], x["k"], x["q_idx"], x["k_idx"])
  want, dq_idx, dk_idx, _ = np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"],
                                  np_support(sel, c.T, c.S, 4, 0, seg), c.D ** -0.5, c.d_idx ** -0.5)
  assert_close(loss, want, "kl")
  assert_close(grads[2], dq_idx, "d q_idx")
  assert_close(grads[3], dk_idx, "d k_idx")
  assert not np.asarray(grads[0]).any() and not np.asarray(grads[1]).any(), "the teacher must get no gradient"
  # LSE fusion: the attention forward's log-sum-exp gives the same loss as recomputing it.
  _, lse = msa_pallas.sparse_attention_with_lse(x["q"], x["k"], x["v"], sel, block_size=4, segment_ids=seg_arg)
  # Small tiles: several programs per block forward, several loop steps per block backward; every way of averaging
  # the teacher's heads (the default above is "loop").
  for teacher in pallas_kl.TEACHERS:
    kl = lambda qi, ki: pallas_kl.kl_loss(x["q"], x["k"], qi, ki, sel, block_size=4,  # noqa: E731, B023
                                          segment_ids=seg_arg, lse=lse, rows=16, steps=1, teacher=teacher)
    loss2, (dqi2, dki2) = jax.value_and_grad(kl, argnums=(0, 1))(x["q_idx"], x["k_idx"])
    assert_close(loss2, want, f"kl with the attention's lse, teacher {teacher}")
    assert_close(dqi2, dq_idx, f"d q_idx, small tiles, teacher {teacher}")
    assert_close(dki2, dk_idx, f"d k_idx, small tiles, teacher {teacher}")


def test_kl_fused_teacher_bf16_matches_oracle():
  """The fused teacher on 16-bit inputs: all G heads in one dot, averaged by the pooling dot over bf16 pieces.
  Against the float64 oracle on the same bf16-rounded inputs, so only the kernel's own rounding is measured (f32
  accumulation; 16 mantissa bits kept through the pooling)."""
  c = Case("kl16", B=1, T=48, S=48, Hq=16, Hkv=2, D=16, block_size=8, topk=3, d_idx=16)
  x = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
       for k, v in make_inputs(c, seed=37).items()}
  sel = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, 1, 0)[0].astype(np.int32)
  bf = {k: jnp.asarray(v, jnp.bfloat16) for k, v in x.items()}
  f = lambda qi, ki: pallas_kl.kl_loss(bf["q"], bf["k"], qi.astype(jnp.bfloat16), ki.astype(jnp.bfloat16), sel,  # noqa
                                       block_size=8, steps=1, teacher="fused")
  loss, (dqi, dki) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(x["q_idx"]), jnp.asarray(x["k_idx"]))
  want, dq_idx, dk_idx, _ = np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], np_support(sel, c.T, c.S, 8, 0),
                                  c.D ** -0.5, c.d_idx ** -0.5)
  assert_close(loss, want, "kl, fused teacher, bf16 inputs", rtol=1e-6)  # measured 9e-8
  # The gradients pass through bf16 twice (dz cast to the index dtype for the gradient dots, as the xla path does,
  # and the bf16 result): 2^-9 = 2e-3 relative rounding each; measured 2.0e-3 and 2.2e-3 in norm.
  for name, got, ref in (("d q_idx", dqi, dq_idx), ("d k_idx", dki, dk_idx)):
    err = np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref)
    assert err < 5e-3, f"{name}, fused teacher: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------------------------------
# fp8 index q/k (selection) and fp8 index-key caches (decode)
# ---------------------------------------------------------------------------------------------------------------------


def test_quantize_index_error_bound():
  x = np.random.default_rng(0).normal(size=(2, 50, 16)).astype(np.float32) * np.array([1e-3, 1.0])[:, None, None]
  x8, scale = msa.quantize_index(jnp.asarray(x))
  assert x8.dtype == jnp.float8_e4m3fn and scale.shape == (2, 50)
  back = np.asarray(x8, np.float64) * np.asarray(scale, np.float64)[..., None]
  # e4m3: 3 mantissa bits (round-to-nearest: half a step, 2^-4 of the value) and subnormal steps of 2^-9 * scale;
  # the largest magnitude of each vector maps to 448 exactly.
  bound = np.abs(x) * 2.0 ** -4 + np.asarray(scale)[..., None] * 2.0 ** -10 + 1e-12
  assert (np.abs(back - x) <= bound).all()
  np.testing.assert_allclose(np.abs(np.asarray(x8, np.float32)).max(-1), 448.0)


@pytest.mark.parametrize("q_fp8", [False, True], ids=["bf16_q", "fp8_q"])
def test_select_blocks_fp8_index_matches_oracle_on_dequantized_keys(q_fp8):
  c = Case("fp8", B=2, T=24, S=40, Hq=2, Hkv=2, D=8, block_size=4, topk=4, d_idx=16, q_offset=16)
  x = make_inputs(c, seed=51)
  k8, ks = msa.quantize_index(jnp.asarray(x["k_idx"]))
  q = msa.quantize_index(jnp.asarray(x["q_idx"]))[0] if q_fp8 else jnp.asarray(x["q_idx"], jnp.bfloat16)
  # The oracle scores exactly what the kernel sees: the fp8 values times their key scales (the query scale dropped).
  k_deq = np.asarray(k8, np.float64) * np.asarray(ks, np.float64)[..., None]
  oracle, raw = np_select_blocks(np.asarray(q, np.float64), k_deq, 4, 4, 1, 16)
  for impl in ("pallas", "xla"):
    sel = msa.select_blocks(q, k8, k_idx_scale=ks, block_size=4, topk=4, q_offset=16, implementation=impl)
    assert_selection(sel, oracle, raw, c)
  with pytest.raises(ValueError, match="needs k_idx_scale"):
    msa.select_blocks(q, k8, block_size=4, topk=4)
  with pytest.raises(ValueError, match="k_idx_scale: shape"):
    msa.select_blocks(q, k8, k_idx_scale=ks[:, :-1], block_size=4, topk=4)


def test_sparse_decode_with_fp8_index_cache():
  B, T, S_max, Hq, Hkv, D, bs, topk = 2, 2, 32, 4, 2, 16, 4, 3
  c = Case("dec8", B=B, T=T, S=S_max, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, topk=topk, d_idx=16)
  x = make_inputs(c, seed=61)
  k8, ks = msa.quantize_index(jnp.asarray(x["k_idx"]))
  lengths = jnp.asarray([19, S_max], jnp.int32)
  got = {impl: msa.sparse_decode(x["q"], x["k"], x["v"], x["q_idx"], k8, lengths, k_idx_scale=ks, block_size=bs,
                                 topk=topk, implementation=impl) for impl in ("pallas", "xla")}
  np.testing.assert_array_equal(np.asarray(got["pallas"][1]), np.asarray(got["xla"][1]))
  k_deq = np.asarray(k8, np.float64) * np.asarray(ks, np.float64)[..., None]
  for b, n in enumerate((19, S_max)):
    want_sel, raw = np_select_blocks(x["q_idx"][b:b + 1], k_deq[b:b + 1, :n], bs, topk, 1, n - T)
    sel = np.asarray(got["pallas"][1][b:b + 1])
    assert_selection(sel[..., :want_sel.shape[-1]], want_sel, raw,
                     Case("row", B=1, T=T, S=n, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, topk=topk))
    want = np_attention(x["q"][b:b + 1], x["k"][b:b + 1], x["v"][b:b + 1], np_support(sel, T, S_max, bs, n - T),
                        D ** -0.5)
    assert_close(got["pallas"][0][b:b + 1], want, f"row {b}")
