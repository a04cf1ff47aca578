"""MSA ops (pallas_kernels.msa): every implementation against the float64 oracles of tests/oracles.py.

One parametrised test base: each test below takes an implementation `impl` and runs it through `call`, so the same
checks, outputs and VJPs, hold every implementation to the same oracles:

  reference           the pure-jnp definitions (through the API)
  xla                 the scalable implementation (through the API)
  xla_chunked         xla forced to chunks of QUERY_CHUNK queries: chunking and query padding at test sizes
  pallas              the Pallas kernels in interpret mode off the GPU (through the API)
  pallas_small_tiles  the Pallas attention kernels with PALLAS_SMALL_TILES: multi-step and split-block paths

Each test's `impls` / `impl_cases` decorator names the implementations (and cases) it runs. Interpret-mode Pallas is
several times slower than xla at these sizes, so it runs the output/VJP checks of each op on a subset of the cases;
test_msa_pallas.py holds the checks of paths only the Pallas kernels have (KV-outer map, KL teacher variants and LSE
fusion, split-K and group-folded selection, fp8 index caches).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import msa
from pallas_kernels.msa import pallas as msa_pallas
from pallas_kernels.msa import xla as msa_xla
from tests.oracles import (CASES, PALLAS_SMALL_TILES, RAGGED_SEGMENTS, SELECT_CASES, Case, assert_attention_matches,
                           assert_close, assert_selection, case_id, make_inputs, np_attention, np_kl,
                           np_select_blocks, np_support)

# "xla_chunked": chunks of 5 queries, so T=37 gives 8 chunks with 3 padded rows.
QUERY_CHUNK = 5
FAST = ("reference", "xla", "xla_chunked")

DENSE_CASES = [
    Case("dense_g2_ragged", B=1, T=33, S=33, Hq=4, Hkv=2, D=8, block_size=8, topk=8),
    Case("dense_prefill_g4", B=2, T=9, S=30, Hq=4, Hkv=1, D=8, block_size=4, topk=8),
]

# Packed sequences. Every row of PACK holds two documents of DOC slots each, whose boundary falls on a block boundary,
# so each document's blocks are exactly the blocks of that document run alone (blocks are anchored to absolute slots).
# local_blocks=2: the first block of the second document still forces the first document's last block. The general
# case (boundaries inside blocks) is RAGGED_SEGMENTS, checked against the oracle only.
PACK = Case("packed", B=2, T=32, S=32, Hq=4, Hkv=2, D=8, block_size=4, topk=3, local_blocks=2)
DOC = 16
# Ids need not be sorted or contiguous across rows: only equality matters.
PACK_SEGMENTS = np.array([[0] * DOC + [1] * DOC, [3] * DOC + [2] * DOC], np.int32)

# Decoding against a cache buffer of S slots of which only the first q_offset + T are written.
BUFFER = dict(B=2, S=24, Hq=4, Hkv=2, D=8, block_size=4, topk=3, local_blocks=2)


def call(impl: str, op: str, *args, query_chunk: int = QUERY_CHUNK, **kwargs):
  """The op `op` ("select_blocks", "sparse_attention", "kl_loss", "sparse_decode") of implementation `impl`;
  `query_chunk` only applies to xla_chunked."""
  if impl == "xla_chunked":
    return getattr(msa_xla, op)(*args, query_chunk=query_chunk, **kwargs)
  if impl == "pallas_small_tiles":
    if op != "sparse_attention":
      raise ValueError(f"op={op!r}: pallas_small_tiles implements sparse_attention only")
    return msa_pallas.sparse_attention(*args, **PALLAS_SMALL_TILES, **kwargs)
  return getattr(msa, op)(*args, implementation=impl, **kwargs)


def _marks(impl: str):
  # Interpret-mode Pallas is the slow part of these tests: the full suite runs it, the fast tier does not.
  return (pytest.mark.slow,) if impl.startswith("pallas") else ()


def impls(*names: str):
  """Parametrises `impl` over the named implementations: @impls(*FAST, "pallas")."""
  return pytest.mark.parametrize("impl", [pytest.param(n, id=n, marks=_marks(n)) for n in names])


def impl_cases(cases: list[Case], **more: list[Case]):
  """Parametrises `impl, c`: each FAST implementation on every case of `cases`, and each implementation named in
  `more` on its own case list (interpret-mode Pallas runs a subset): @impl_cases(CASES, pallas=CASES[:3])."""
  pairs = [(i, c) for i in FAST for c in cases] + [(i, c) for i, cs in more.items() for c in cs]
  return pytest.mark.parametrize("impl,c", [pytest.param(i, c, id=f"{i}-{case_id(c)}", marks=_marks(i))
                                            for i, c in pairs])


def doc_inputs(x, lo, hi):
  """The inputs of one document of a packed T = S batch: query rows and key slots lo:hi."""
  return {n: a[:, lo:hi] for n, a in x.items()}


def to_document(block_idx, first_block, num_blocks):
  """Packed selection -> the document's own block numbering; blocks outside the document become -1.

  The only outside blocks a packed selection may hold are forced local blocks of the previous document (at the
  document's first block, where nothing else of the document is visible, so the -1s stay at the end).
  """
  block_idx = np.asarray(block_idx)
  inside = (block_idx >= first_block) & (block_idx < first_block + num_blocks)
  return np.where(inside, block_idx - first_block, -1)


def buffer_inputs(c: Case, seed: int = 0):
  """make_inputs with the unwritten tail of the key buffer (slots >= q_offset + T) made large: any leak of a future
  key into the selection, the attention or the KL support would dominate the result."""
  x = make_inputs(c, seed)
  tail = np.arange(c.S) >= c.offset + c.T
  for n in ("k", "v", "k_idx"):
    x[n][:, tail] *= 30.0
  return x


def oracle_selection(x, c: Case, segment_ids=None) -> np.ndarray:
  """int32 [B, Hkv, T, slots]: the oracle's selection for the inputs x of case c."""
  sel, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset, segment_ids)
  return sel.astype(np.int32)


def attention_vjp(impl, x, block_idx, **kwargs):
  """(out, dq, dk, dv) of `impl`'s sparse_attention for the cotangent x['dout']."""
  f = lambda q, k, v: call(impl, "sparse_attention", q, k, v, block_idx, **kwargs)  # noqa: E731
  out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
  return (out, *vjp(jnp.asarray(x["dout"])))


# ---------------------------------------------------------------------------------------------------------------------
# select_blocks
# ---------------------------------------------------------------------------------------------------------------------


@impl_cases(SELECT_CASES, pallas=SELECT_CASES)
def test_select_blocks_matches_oracle(impl, c):
  x = make_inputs(c)
  sel = call(impl, "select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk,
             local_blocks=c.local_blocks, q_offset=c.q_offset)
  oracle, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  assert_selection(sel, oracle, raw, c)


@impls(*FAST)
def test_select_blocks_per_group(impl):
  # Group 1 gets the negated index query: its preferred blocks are the opposite of group 0's, so any sharing of
  # one selection across groups shows up.
  c = Case("groups", B=1, T=24, S=48, Hq=2, Hkv=2, D=8, block_size=4, topk=3)
  x = make_inputs(c)
  q_idx = np.stack([x["q_idx"][:, :, 0], -x["q_idx"][:, :, 0]], axis=2)
  sel = np.asarray(call(impl, "select_blocks", q_idx, x["k_idx"], block_size=c.block_size, topk=c.topk))
  oracle, raw = np_select_blocks(q_idx, x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  assert_selection(sel, oracle, raw, c)
  assert (np.sort(sel[:, 0], -1) != np.sort(sel[:, 1], -1)).any(-1).mean() > 0.5


# ---------------------------------------------------------------------------------------------------------------------
# sparse_attention
# ---------------------------------------------------------------------------------------------------------------------


@impl_cases(CASES, pallas=CASES[:3], pallas_small_tiles=CASES[:3])
def test_sparse_attention_output_and_vjp(impl, c):
  x = make_inputs(c)
  block_idx = oracle_selection(x, c)
  got = attention_vjp(impl, x, block_idx, block_size=c.block_size, q_offset=c.q_offset)
  assert got[0].shape == (c.B, c.T, c.Hq, c.D) and got[0].dtype == jnp.float32
  assert_attention_matches(got, x, np_support(block_idx, c.T, c.S, c.block_size, c.offset), c.D ** -0.5)


@impls(*FAST, "pallas_small_tiles")
def test_sparse_attention_ignores_empty_and_repeated_slots(impl):
  # Arbitrary slot order, -1 anywhere, repeated ids (count once), rows with no block at all (output 0, gradient 0),
  # a custom scale.
  c = Case("messy", B=1, T=37, S=37, Hq=4, Hkv=2, D=8, block_size=8, topk=5)
  x = make_inputs(c)
  rng = np.random.default_rng(1)
  block_idx = rng.integers(-1, c.num_blocks, size=(c.B, c.Hkv, c.T, 6)).astype(np.int32)
  block_idx[:, :, ::7] = -1
  got = attention_vjp(impl, x, block_idx, block_size=c.block_size, scale=0.3)
  assert_attention_matches(got, x, np_support(block_idx, c.T, c.S, c.block_size, 0), 0.3)
  assert not np.asarray(got[0])[0, ::7].any()


@impl_cases(DENSE_CASES)
def test_sparse_attention_equals_dense_when_all_blocks_fit(impl, c):
  # topk * block_size >= S: the selection holds every visible block, so MSA must be plain causal GQA.
  x = make_inputs(c)
  block_idx = call(impl, "select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk,
                   q_offset=c.q_offset)
  assert block_idx.shape[-1] == c.num_blocks
  got = attention_vjp(impl, x, block_idx, block_size=c.block_size, q_offset=c.q_offset)
  assert_attention_matches(got, x, np_support(None, c.T, c.S, c.block_size, c.offset), c.D ** -0.5)


@impls(*FAST)
def test_sparse_attention_bf16(impl):
  c = CASES[0]
  x = make_inputs(c)
  block_idx = oracle_selection(x, c)
  q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in "qkv")
  out = call(impl, "sparse_attention", q, k, v, block_idx, block_size=c.block_size)
  assert out.dtype == jnp.bfloat16
  want = np_attention(np.float32(q), np.float32(k), np.float32(v),
                      np_support(block_idx, c.T, c.S, c.block_size, c.offset), c.D ** -0.5)
  # Inputs are exactly the bf16 values; the only extra error is rounding the f32 result to bf16 (2^-8 relative).
  assert_close(out, want, "bf16 out", atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------------------------------
# kl_loss
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
@impl_cases(CASES[:4], pallas=CASES[:1])
def test_kl_loss_value_and_grads(impl, c, dense):
  x = make_inputs(c)
  block_idx = None if dense else oracle_selection(x, c)
  scale, index_scale = 0.4, 0.5
  f = lambda q, k, qi, ki: call(impl, "kl_loss", q, k, qi, ki, block_idx, block_size=c.block_size,  # noqa: E731
                                scale=scale, index_scale=index_scale, q_offset=c.q_offset)
  loss, (dq, dk, dqi, dki) = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x["q"], x["k"], x["q_idx"], x["k_idx"])
  support = np_support(block_idx, c.T, c.S, c.block_size, c.offset)
  want_loss, want_dqi, want_dki, _ = np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], support, scale, index_scale)
  assert loss.shape == () and loss.dtype == jnp.float32
  assert_close(loss, want_loss, "loss")
  assert_close(dqi, want_dqi, "d q_idx")
  assert_close(dki, want_dki, "d k_idx")
  assert not np.asarray(dq).any() and not np.asarray(dk).any(), "the teacher (q, k) must get no gradient"


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
@impls(*FAST)
def test_kl_loss_gradient_wrt_index_scores_is_p_idx_minus_p(impl, dense):
  # With k_idx = identity (d_idx = S) the index logits are z[b, g, t, j] = index_scale * q_idx[b, t, g, j], so
  # d loss / d q_idx is index_scale times the gradient w.r.t. the logits: it must be (P_idx - P) / (B * T * Hkv).
  c = Case("identity", B=2, T=21, S=29, Hq=4, Hkv=2, D=8, block_size=4, topk=3, d_idx=29)
  x = make_inputs(c)
  k_idx = np.broadcast_to(np.eye(c.S, dtype=np.float32), (c.B, c.S, c.S)).copy()
  block_idx = None
  if not dense:
    block_idx, _ = np_select_blocks(x["q_idx"], k_idx, c.block_size, c.topk, c.local_blocks, c.offset)
    block_idx = block_idx.astype(np.int32)
  index_scale = 0.7
  f = lambda qi: call(impl, "kl_loss", x["q"], x["k"], qi, k_idx, block_idx, block_size=c.block_size,  # noqa: E731
                      index_scale=index_scale)
  dqi = jax.grad(f)(x["q_idx"])
  support = np_support(block_idx, c.T, c.S, c.block_size, c.offset)
  *_, want_dz = np_kl(x["q"], x["k"], x["q_idx"], k_idx, support, c.D ** -0.5, index_scale)
  got_dz = np.asarray(dqi, np.float64).transpose(0, 2, 1, 3) / index_scale  # [B, Hkv, T, S]
  # Entries are O(1 / N) = O(1e-2): the absolute tolerance scales with them.
  assert_close(got_dz, want_dz, "d loss / d index logits", atol=1e-7)
  assert not got_dz[~np.broadcast_to(support, got_dz.shape)].any(), "gradient outside the support"


@impls(*FAST)
def test_kl_loss_all_blocks_equals_dense_warmup(impl):
  c = DENSE_CASES[0]
  x = make_inputs(c)
  block_idx = call(impl, "select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk)
  sparse = call(impl, "kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, block_size=c.block_size)
  dense = call(impl, "kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], None, block_size=c.block_size)
  assert_close(sparse, float(dense), "sparse kl with every block vs dense kl")


# ---------------------------------------------------------------------------------------------------------------------
# Packed sequences (segment_ids)
# Each op: the packed batch equals its documents run alone (PACK_SEGMENTS), and the general case (RAGGED_SEGMENTS)
# equals the oracle. Forward and backward run in one jit per case: compiling them separately costs ~1.7x the time.
# ---------------------------------------------------------------------------------------------------------------------


@impls(*FAST)
def test_select_blocks_segments(impl):
  c = PACK
  x = make_inputs(c, seed=2)
  opts = dict(block_size=c.block_size, topk=c.topk, local_blocks=c.local_blocks)
  sel = np.asarray(call(impl, "select_blocks", x["q_idx"], x["k_idx"], segment_ids=PACK_SEGMENTS, **opts))
  for lo in (0, DOC):
    d = doc_inputs(x, lo, lo + DOC)
    alone = np.asarray(call(impl, "select_blocks", d["q_idx"], d["k_idx"], **opts))
    got = to_document(sel[:, :, lo:lo + DOC], lo // c.block_size, DOC // c.block_size)
    np.testing.assert_array_equal(got, alone, f"document at slot {lo}")
  # The second document's first block still forces the first document's last block (HF's local-block rule).
  assert (sel[:, :, DOC:DOC + c.block_size, 1] == DOC // c.block_size - 1).all()

  sel = call(impl, "select_blocks", x["q_idx"], x["k_idx"], segment_ids=RAGGED_SEGMENTS, **opts)
  oracle, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset,
                                 RAGGED_SEGMENTS)
  assert_selection(sel, oracle, raw, c)
  # Non-local blocks are chosen only if they hold a key of the query's segment.
  sel = np.asarray(sel)
  n_local = np.minimum(c.local_blocks, np.arange(c.T) // c.block_size + 1)[None, None, :, None]
  rest = (sel >= 0) & (np.arange(sel.shape[-1]) >= n_local)
  assert (np.take_along_axis(raw, np.maximum(sel, 0), -1)[rest] > -np.inf).all()


@impls(*FAST)
def test_sparse_attention_segments(impl):
  c = PACK
  x = make_inputs(c, seed=4)

  @jax.jit
  def fwd_bwd(q, k, v, dout, block_idx, segment_ids=None):
    out, vjp = jax.vjp(lambda q, k, v: call(impl, "sparse_attention", q, k, v, block_idx, block_size=c.block_size,
                                            segment_ids=segment_ids), q, k, v)
    return (out, *vjp(dout))

  args = [x[n] for n in ("q", "k", "v", "dout")]
  block_idx = oracle_selection(x, c, PACK_SEGMENTS)
  packed = fwd_bwd(*args, block_idx, PACK_SEGMENTS)
  for lo in (0, DOC):
    d = doc_inputs(x, lo, lo + DOC)
    idx = to_document(block_idx[:, :, lo:lo + DOC], lo // c.block_size, DOC // c.block_size).astype(np.int32)
    alone = fwd_bwd(*[d[n] for n in ("q", "k", "v", "dout")], idx)
    for name, got, exp in zip(("out", "dq", "dk", "dv"), packed, alone):
      assert_close(np.asarray(got)[:, lo:lo + DOC], np.asarray(exp, np.float64), f"{name} of document at {lo}")

  block_idx = oracle_selection(x, c, RAGGED_SEGMENTS)
  got = fwd_bwd(*args, block_idx, RAGGED_SEGMENTS)
  support = np_support(block_idx, c.T, c.S, c.block_size, c.offset, RAGGED_SEGMENTS)
  want = np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5, x["dout"])
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert_close(g, w, f"{name} (ragged segments)")


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
@impls(*FAST)
def test_kl_loss_segments(impl, dense):
  c = PACK
  x = make_inputs(c, seed=6)

  @jax.jit
  def value_and_grads(q, k, q_idx, k_idx, block_idx, segment_ids=None):
    f = lambda qi, ki: call(impl, "kl_loss", q, k, qi, ki, block_idx, block_size=c.block_size,  # noqa: E731
                            segment_ids=segment_ids)
    return jax.value_and_grad(f, argnums=(0, 1))(q_idx, k_idx)

  def selection(segment_ids):
    return None if dense else oracle_selection(x, c, segment_ids)

  # The loss is a mean over (b, t, group) rows: the packed loss is the mean of the two documents' losses, and each
  # document's gradients are its alone gradients over 2 (twice as many rows share the mean).
  block_idx = selection(PACK_SEGMENTS)
  loss, (dqi, dki) = value_and_grads(x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, PACK_SEGMENTS)
  losses = []
  for lo in (0, DOC):
    d = doc_inputs(x, lo, lo + DOC)
    idx = None if dense else to_document(block_idx[:, :, lo:lo + DOC], lo // c.block_size,
                                         DOC // c.block_size).astype(np.int32)
    loss_d, (dqi_d, dki_d) = value_and_grads(d["q"], d["k"], d["q_idx"], d["k_idx"], idx)
    losses.append(float(loss_d))
    assert_close(np.asarray(dqi)[:, lo:lo + DOC], np.asarray(dqi_d, np.float64) / 2, f"d q_idx of document at {lo}")
    assert_close(np.asarray(dki)[:, lo:lo + DOC], np.asarray(dki_d, np.float64) / 2, f"d k_idx of document at {lo}")
  assert_close(loss, np.mean(losses), "packed loss vs mean of the documents' losses")

  block_idx = selection(RAGGED_SEGMENTS)
  loss, (dqi, dki) = value_and_grads(x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, RAGGED_SEGMENTS)
  support = np_support(block_idx, c.T, c.S, c.block_size, c.offset, RAGGED_SEGMENTS)
  want_loss, want_dqi, want_dki, _ = np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], support, c.D ** -0.5,
                                           c.d_idx ** -0.5)
  assert_close(loss, want_loss, "loss (ragged segments)")
  assert_close(dqi, want_dqi, "d q_idx (ragged segments)")
  assert_close(dki, want_dki, "d k_idx (ragged segments)")


# ---------------------------------------------------------------------------------------------------------------------
# Traced q_offset (decoding inside a jitted loop) and sparse_decode (caches of different lengths per row)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,segmented", [(1, False), (4, True)], ids=["decode", "chunked_prefill_segments"])
@impls(*FAST)
def test_traced_q_offset_equals_int_offset(impl, T, segmented):
  # One jitted function serves every offset; at each offset it must equal the oracle, with the unwritten (future)
  # tail of the buffer invisible, and at two of them also the static-int result (each int offset compiles anew).
  chunk = 3  # xla_chunked: T=4 -> two chunks of 3 rows, the last one padded, each at a traced start
  seg = {"segment_ids": np.array([[0] * 10 + [1] * 14, [2] * 3 + [5] * 21], np.int32)} if segmented else {}
  segment_ids = seg.get("segment_ids")

  def ops(x, off):
    opts = dict(block_size=BUFFER["block_size"], q_offset=off, query_chunk=chunk, **seg)
    sel = call(impl, "select_blocks", x["q_idx"], x["k_idx"], topk=BUFFER["topk"],
               local_blocks=BUFFER["local_blocks"], **opts)
    out = call(impl, "sparse_attention", x["q"], x["k"], x["v"], sel, **opts)
    kl = call(impl, "kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], sel, **opts)
    kl_dense = call(impl, "kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], None, **opts)
    return sel, out, kl, kl_dense

  traced = jax.jit(ops)
  static = jax.jit(ops, static_argnums=1)  # q_offset a Python int: the static path of every op
  for i, n in enumerate((0, 7, 13) if T > 1 else (0, 6, 17)):
    c = Case(f"buffer_{n}", T=T, q_offset=n, **BUFFER)
    x = buffer_inputs(c, seed=n)
    sel, out, kl, kl_dense = traced(x, jnp.int32(n))
    if i < 2:
      want = static(x, n)
      np.testing.assert_array_equal(sel, want[0], f"selection at q_offset={n}")
      for name, got, exp in zip(("out", "kl", "kl_dense"), (out, kl, kl_dense), want[1:]):
        assert_close(got, np.asarray(exp, np.float64), f"{name} at q_offset={n}")

    oracle, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, n, segment_ids)
    assert_selection(sel, oracle, raw, c)
    support = np_support(np.asarray(sel), T, c.S, c.block_size, n, segment_ids)
    assert_close(out, np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5), f"out vs oracle at {n}")
    for name, got, sup in (("kl", kl, support),
                           ("dense kl", kl_dense, np_support(None, T, c.S, c.block_size, n, segment_ids))):
      want_kl = np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], sup, c.D ** -0.5, c.d_idx ** -0.5)[0]
      assert_close(got, want_kl, f"{name} vs oracle at {n}")


@pytest.mark.parametrize("T", [1, 3])
@impls("xla", "pallas")  # sparse_decode: the API's vmapped xla path and the fused Pallas one
def test_sparse_decode_matches_each_rows_prefix(impl, T):
  B, S_max, Hq, Hkv, D, bs, topk = 3, 40, 4, 2, 16, 4, 3
  c = Case("dec", B=B, T=T, S=S_max, Hq=Hq, Hkv=Hkv, D=D, block_size=bs, topk=topk, d_idx=16)
  x = make_inputs(c, seed=41 + T)
  lengths = np.array([T + 2, 23, S_max], np.int32)
  for b, n in enumerate(lengths):  # unwritten cache slots hold huge values: any leak would dominate
    for name in ("k", "v", "k_idx"):
      x[name][b, n:] = 1e4
  out, sel = call(impl, "sparse_decode", x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], jnp.asarray(lengths),
                  block_size=bs, topk=topk)
  for b, n in enumerate(lengths):
    row = {name: x[name][b:b + 1] for name in x}
    want_sel, raw = np_select_blocks(row["q_idx"], row["k_idx"][:, :n], bs, topk, 1, n - T)
    got_sel = np.asarray(sel[b:b + 1])
    slots = want_sel.shape[-1]  # a short row has fewer blocks: the rest of its slots must be -1
    assert (got_sel[..., slots:] == -1).all()
    assert_selection(got_sel[..., :slots], want_sel, raw, Case("row", B=1, T=T, S=int(n), Hq=Hq, Hkv=Hkv, D=D,
                                                                 block_size=bs, topk=topk))
    support = np_support(got_sel, T, S_max, bs, n - T)
    want = np_attention(row["q"], row["k"], row["v"], support, D ** -0.5)
    assert np.isfinite(np.asarray(out[b])).all()
    assert_close(out[b:b + 1], want, f"row {b} (length {n})")


# API: dispatch, jit, validation
# ---------------------------------------------------------------------------------------------------------------------


def test_default_implementation_off_the_gpu_is_xla():
  # On the CPU every op defaults to xla; "pallas" is the interpret-mode kernel.
  c = CASES[3]
  x = make_inputs(c)
  default = msa.select_blocks(x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk)
  np.testing.assert_array_equal(default, msa.select_blocks(x["q_idx"], x["k_idx"], block_size=c.block_size,
                                                           topk=c.topk, implementation="xla"))
  with pytest.raises(ValueError, match="implementation"):
    msa.select_blocks(x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk, implementation="triton")


def test_ops_compose_under_jit():
  # Under jit block_idx is a tracer: the value check is skipped, shapes are still checked.
  c = CASES[0]
  x = make_inputs(c)

  @jax.jit
  def step(q, k, v, q_idx, k_idx):
    block_idx = msa.select_blocks(q_idx, k_idx, block_size=c.block_size, topk=c.topk)
    out = msa.sparse_attention(q, k, v, block_idx, block_size=c.block_size)
    kl = msa.kl_loss(q, k, q_idx, k_idx, block_idx, block_size=c.block_size)
    return out, kl

  out, kl = step(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"])
  block_idx, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
  support = np_support(block_idx, c.T, c.S, c.block_size, c.offset)
  assert_close(out, np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5), "out")
  assert_close(kl, np_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], support, c.D ** -0.5, c.d_idx ** -0.5)[0], "kl")


_V = make_inputs(Case("v", B=2, T=8, S=16, Hq=4, Hkv=2, D=8, block_size=4, topk=2))
_BI = np.zeros((2, 2, 8, 2), np.int32)


def _attn(**over):
  args = dict(q=_V["q"], k=_V["k"], v=_V["v"], block_idx=_BI, block_size=4)
  args.update(over)
  return lambda: msa.sparse_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("block_idx"), **args)


def _select(**over):
  args = dict(q_idx=_V["q_idx"], k_idx=_V["k_idx"], block_size=4, topk=2)
  args.update(over)
  return lambda: msa.select_blocks(args.pop("q_idx"), args.pop("k_idx"), **args)


def _kl(**over):
  args = dict(q=_V["q"], k=_V["k"], q_idx=_V["q_idx"], k_idx=_V["k_idx"], block_idx=_BI, block_size=4)
  args.update(over)
  return lambda: msa.kl_loss(args.pop("q"), args.pop("k"), args.pop("q_idx"), args.pop("k_idx"),
                             args.pop("block_idx"), **args)


VALIDATION_CASES = [
    ("q_rank", _attn(q=_V["q"][0]), ValueError, r"q: shape \(8, 4, 8\).*rank 4"),
    ("k_batch", _attn(k=_V["k"][:1]), ValueError, r"k: shape \(1, 16, 2, 8\)"),
    ("k_head_dim", _attn(k=_V["k"][..., :4], v=_V["v"][..., :4]), ValueError, r"k: shape .*D=8"),
    ("v_shape", _attn(v=_V["v"][:, :12]), ValueError, r"v: shape \(2, 12, 2, 8\).*shape of k"),
    ("heads_not_multiple", _attn(q=np.zeros((2, 8, 3, 8), np.float32)), ValueError, r"q: Hq=3.*multiple of Hkv=2"),
    ("q_int", _attn(q=np.zeros((2, 8, 4, 8), np.int32)), TypeError, r"q: dtype int32.*floating"),
    ("block_idx_float", _attn(block_idx=np.zeros((2, 2, 8, 2), np.float32)), TypeError, r"block_idx: dtype float32"),
    ("block_idx_shape", _attn(block_idx=np.zeros((2, 1, 8, 2), np.int32)), ValueError,
     r"block_idx: shape \(2, 1, 8, 2\), expected \[B=2, Hkv=2, T=8, topk\]"),
    ("block_idx_range", _attn(block_idx=np.full((2, 2, 8, 2), 4, np.int32)), ValueError,
     r"block_idx: .*values in \[4, 4\], expected values in \[-1, 4\)"),
    ("block_idx_below", _attn(block_idx=np.full((2, 2, 8, 2), -2, np.int32)), ValueError, r"block_idx: .*\[-1, 4\)"),
    ("block_size_zero", _attn(block_size=0), ValueError, r"block_size=0"),
    ("block_size_float", _attn(block_size=4.0), TypeError, r"block_size=4.0"),
    ("q_offset_past_end", _attn(q_offset=9), ValueError, r"q_offset=9 with T=8 queries and S=16 keys"),
    ("q_offset_negative", _attn(q_offset=-1), ValueError, r"q_offset=-1"),
    ("more_queries_than_keys", _attn(k=_V["k"][:, :4], v=_V["v"][:, :4], block_idx=_BI[..., :1] * 0), ValueError,
     r"q: T=8 queries but only S=4 keys"),
    ("scale_array", _attn(scale="big"), TypeError, r"scale='big'"),
    ("select_topk_zero", _select(topk=0), ValueError, r"topk=0"),
    ("select_local_gt_topk", _select(local_blocks=3), ValueError, r"local_blocks=3.*topk=2"),
    ("select_local_negative", _select(local_blocks=-1), ValueError, r"local_blocks=-1"),
    ("select_block_size", _select(block_size=-4), ValueError, r"block_size=-4"),
    ("select_k_idx_dim", _select(k_idx=_V["k_idx"][..., :4]), ValueError, r"k_idx: shape \(2, 16, 4\).*d_idx=8"),
    ("select_k_idx_batch", _select(k_idx=_V["k_idx"][:1]), ValueError, r"k_idx: shape \(1, 16, 8\)"),
    ("select_q_idx_rank", _select(q_idx=_V["q_idx"][..., 0]), ValueError, r"q_idx: shape \(2, 8, 2\).*rank 4"),
    ("select_q_idx_int", _select(q_idx=np.zeros((2, 8, 2, 8), np.int32)), TypeError, r"q_idx: dtype int32"),
    ("select_q_offset", _select(q_offset=10), ValueError, r"q_offset=10"),
    ("kl_q_idx_heads", _kl(q_idx=_V["q_idx"][:, :, :1]), ValueError, r"q_idx: shape \(2, 8, 1, 8\).*Hkv=2"),
    ("kl_q_idx_len", _kl(q_idx=_V["q_idx"][:, :4]), ValueError, r"q_idx: shape \(2, 4, 2, 8\).*T=8"),
    ("kl_k_idx_len", _kl(k_idx=_V["k_idx"][:, :8]), ValueError, r"k_idx: shape \(2, 8, 8\).*S=16"),
    ("kl_block_idx", _kl(block_idx=_BI[:, :, :4]), ValueError, r"block_idx: shape \(2, 2, 4, 2\)"),
    ("kl_index_scale", _kl(index_scale=[1.0]), TypeError, r"index_scale=\[1.0\]"),
    ("segment_ids_shape", _attn(segment_ids=np.zeros((2, 8), np.int32)), ValueError,
     r"segment_ids: shape \(2, 8\), expected \[B=2, S=16\]"),
    ("segment_ids_float", _attn(segment_ids=np.zeros((2, 16), np.float32)), TypeError,
     r"segment_ids: dtype float32.*integer"),
    ("segment_ids_bool", _attn(segment_ids=np.zeros((2, 16), bool)), TypeError, r"segment_ids: dtype bool"),
    ("segment_ids_list", _attn(segment_ids=[[0] * 16] * 2), TypeError, r"segment_ids: expected None or an integer"),
    ("select_segment_ids_batch", _select(segment_ids=np.zeros((1, 16), np.int32)), ValueError,
     r"segment_ids: shape \(1, 16\)"),
    ("kl_segment_ids_len", _kl(segment_ids=np.zeros((2, 15), np.int32)), ValueError, r"segment_ids: shape \(2, 15\)"),
    ("q_offset_float", _attn(q_offset=2.0), TypeError, r"q_offset=2.0: expected a Python int or a scalar integer"),
    ("q_offset_vector", _attn(q_offset=jnp.zeros((2,), jnp.int32)), TypeError, r"q_offset: array of shape \(2,\)"),
    ("q_offset_float_array", _attn(q_offset=jnp.float32(1)), TypeError, r"q_offset: .*dtype float32"),
    # A concrete array offset is still range-checked; only a traced one cannot be.
    ("q_offset_array_past_end", _select(q_offset=jnp.int32(9)), ValueError, r"q_offset=9 with T=8"),
    ("kl_q_offset_array_negative", _kl(q_offset=jnp.int32(-1)), ValueError, r"q_offset=-1"),
]


@pytest.mark.parametrize("fn,error,match", [c[1:] for c in VALIDATION_CASES], ids=[c[0] for c in VALIDATION_CASES])
def test_validation_errors_name_the_argument(fn, error, match):
  with pytest.raises(error, match=match):
    fn()


def test_concrete_array_q_offset_equals_int():
  # Outside jit an array offset (e.g. a cache length) takes the dynamic path too: no compile per value.
  for n in (0, 5):
    np.testing.assert_array_equal(_select(q_offset=jnp.int32(n))(), _select(q_offset=n)())


def test_traced_q_offset_skips_range_check():
  # Under jit the offset's value is unknown, so validation must not try to read it.
  out = jax.jit(lambda off: _attn(q_offset=off)())(jnp.int32(3))
  assert out.shape == (2, 8, 4, 8)


def test_sparse_decode_validation():
  x = make_inputs(Case("v", B=2, T=2, S=16, Hq=4, Hkv=2, D=8, block_size=4, topk=2, d_idx=8))
  with pytest.raises(ValueError, match="lengths: values in"):
    msa.sparse_decode(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], jnp.asarray([1, 16]), block_size=4, topk=2)
  with pytest.raises(ValueError, match="lengths: expected an integer array"):
    msa.sparse_decode(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], jnp.asarray([4.0, 16.0]), block_size=4, topk=2)
