"""MSA ops (pallas_kernels.msa) against float64 numpy oracles.

One shared test base runs every implementation: "reference", "xla" (through the public API) and "xla_chunked" (the
XLA implementation forced to small query chunks, so that chunking and query padding are exercised at test sizes).
The numpy oracles below are written independently of pallas_kernels/msa/reference.py; the selection oracle follows
the HF transformers MiniMaxM3VLIndexer recipe (+inf on the local blocks, top-k, -inf slots -> -1), extended with the
packed-sequence mask (key j visible to query t iff j <= q_offset + t and both lie in the same segment).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import msa
from pallas_kernels.msa import xla as msa_xla

# float32 ops vs float64 oracles.
ATOL = RTOL = 1e-5
# "xla_chunked": chunks of 5 queries, so T=37 gives 8 chunks with 3 padded rows.
QUERY_CHUNK = 5


# ---------------------------------------------------------------------------------------------------------------------
# float64 numpy oracles
# ---------------------------------------------------------------------------------------------------------------------


def np_causal(T, S, q_offset):
  return np.arange(S)[None, :] <= (q_offset + np.arange(T))[:, None]  # [T, S]


def np_visible(T, S, q_offset, segment_ids=None):
  """bool [B or 1, T, S]: causal, and (with segment_ids [B, S]) key and query slot in the same segment."""
  causal = np_causal(T, S, q_offset)[None]
  if segment_ids is None:
    return causal
  seg = np.asarray(segment_ids)
  q_seg = seg[:, q_offset:q_offset + T]  # [B, T]
  return causal & (q_seg[:, :, None] == seg[:, None, :])


def np_select_blocks(q_idx, k_idx, block_size, topk, local_blocks, q_offset, segment_ids=None):
  """HF recipe. Returns (block_idx [B, H, T, slots], raw block scores [B, H, T, nb] before the local boost).

  With segments the raw score of a block is the max over its keys of the query's segment (-inf if none); the local
  blocks still get +inf, so a local block without such a key is still selected, as HF forces it.
  """
  q_idx, k_idx = np.float64(q_idx), np.float64(k_idx)
  B, T, H, _ = q_idx.shape
  S = k_idx.shape[1]
  nb = -(-S // block_size)
  s = np.einsum("bthi,bsi->bhts", q_idx, k_idx)
  s = np.where(np_visible(T, S, q_offset, segment_ids)[:, None], s, -np.inf)
  s = np.concatenate([s, np.full(s.shape[:3] + (nb * block_size - S,), -np.inf)], -1)
  raw = s.reshape(B, H, T, nb, block_size).max(-1)
  boosted = raw.copy()
  q_block = (q_offset + np.arange(T)) // block_size
  for i in range(local_blocks):
    boosted[:, :, np.arange(T), np.maximum(q_block - i, 0)] = np.inf
  slots = min(topk, nb)
  order = np.argsort(-boosted, axis=-1, kind="stable")[..., :slots]
  top = np.take_along_axis(boosted, order, -1)
  return np.where(top == -np.inf, -1, order), raw


def np_support(block_idx, T, S, block_size, q_offset, segment_ids=None):
  """bool [B or 1, H or 1, T, S]: visible (causal, same segment), and (if block_idx is given) inside one of the
  valid selected blocks."""
  visible = np_visible(T, S, q_offset, segment_ids)[:, None]
  if block_idx is None:
    return visible
  nb = -(-S // block_size)
  chosen = (np.asarray(block_idx)[..., None] == np.arange(nb)).any(-2)  # [B, H, T, nb]; -1 matches no block
  return np.repeat(chosen, block_size, axis=-1)[..., :S] & visible


def np_softmax(s, mask):
  s = np.where(mask, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  p = np.where(mask, np.exp(s - m), 0.0)
  total = p.sum(-1, keepdims=True)
  return p / np.where(total > 0, total, 1.0)


def np_attention(q, k, v, support, scale, dout=None):
  """support [B, Hkv, T, S]. Returns out, or (out, dq, dk, dv) given a cotangent dout."""
  q, k, v = np.float64(q), np.float64(k), np.float64(v)
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1:3]
  G = Hq // Hkv
  mask = np.broadcast_to(np.repeat(np.broadcast_to(support, (B, Hkv, T, S)), G, axis=1), (B, Hq, T, S))
  kh, vh = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # [B, S, Hq, D]
  p = np_softmax(np.einsum("bthd,bshd->bhts", q, kh) * scale, mask)
  out = np.einsum("bhts,bshd->bthd", p, vh)
  if dout is None:
    return out
  dout = np.float64(dout)
  dp = np.einsum("bthd,bshd->bhts", dout, vh)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = np.einsum("bhts,bshd->bthd", ds, kh) * scale
  dk = (np.einsum("bhts,bthd->bshd", ds, q) * scale).reshape(B, S, Hkv, G, D).sum(3)
  dv = np.einsum("bhts,bthd->bshd", p, dout).reshape(B, S, Hkv, G, D).sum(3)
  return out, dq, dk, dv


def np_kl(q, k, q_idx, k_idx, support, scale, index_scale):
  """Returns loss, d loss / d q_idx, d loss / d k_idx, d loss / d index_logits [B, Hkv, T, S]."""
  q, k, q_idx, k_idx = map(np.float64, (q, k, q_idx, k_idx))
  B, T, Hq, _ = q.shape
  S, Hkv = k.shape[1:3]
  G = Hq // Hkv
  support = np.broadcast_to(support, (B, Hkv, T, S))
  p_heads = np_softmax(np.einsum("bthd,bshd->bhts", q, np.repeat(k, G, axis=2)) * scale, np.repeat(support, G, 1))
  teacher = p_heads.reshape(B, Hkv, G, T, S).mean(2)
  z = np.einsum("bthi,bsi->bhts", q_idx, k_idx) * index_scale
  student = np_softmax(z, support)
  with np.errstate(divide="ignore", invalid="ignore"):
    kl = np.where(teacher > 0, teacher * (np.log(teacher) - np.log(student)), 0.0)
  n = B * T * Hkv
  dz = (student - teacher) / n
  dq_idx = np.einsum("bhts,bsi->bthi", dz, k_idx) * index_scale
  dk_idx = np.einsum("bhts,bthi->bsi", dz, q_idx) * index_scale
  return kl.sum() / n, dq_idx, dk_idx, dz


# ---------------------------------------------------------------------------------------------------------------------
# Cases and helpers
# ---------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  B: int
  T: int
  S: int
  Hq: int
  Hkv: int
  D: int
  block_size: int
  topk: int
  local_blocks: int = 1
  q_offset: int | None = None
  d_idx: int = 8

  @property
  def offset(self):
    return self.S - self.T if self.q_offset is None else self.q_offset

  @property
  def num_blocks(self):
    return -(-self.S // self.block_size)


CASES = [
    Case("gqa2", B=2, T=40, S=40, Hq=4, Hkv=2, D=16, block_size=8, topk=3),
    Case("ragged_g4_chunks", B=1, T=37, S=37, Hq=4, Hkv=1, D=16, block_size=8, topk=2),
    Case("prefill_chunk_g1", B=1, T=12, S=50, Hq=2, Hkv=2, D=8, block_size=8, topk=3, local_blocks=2),
    Case("decode", B=2, T=1, S=45, Hq=4, Hkv=2, D=8, block_size=4, topk=3),
    Case("explicit_q_offset", B=1, T=10, S=40, Hq=2, Hkv=1, D=8, block_size=8, topk=2, q_offset=17),
]
SELECT_CASES = CASES + [
    Case("topk_gt_blocks", B=1, T=20, S=20, Hq=2, Hkv=2, D=8, block_size=8, topk=10),
    Case("no_local", B=1, T=30, S=30, Hq=2, Hkv=2, D=8, block_size=8, topk=2, local_blocks=0),
    Case("all_local", B=1, T=30, S=30, Hq=3, Hkv=3, D=8, block_size=4, topk=3, local_blocks=3),
    Case("local_gt_blocks", B=1, T=10, S=10, Hq=1, Hkv=1, D=8, block_size=8, topk=4, local_blocks=3),
]
DENSE_CASES = [
    Case("dense_g2_ragged", B=1, T=33, S=33, Hq=4, Hkv=2, D=8, block_size=8, topk=8),
    Case("dense_prefill_g4", B=2, T=9, S=30, Hq=4, Hkv=1, D=8, block_size=4, topk=8),
]
IDS = lambda c: c.name  # noqa: E731

# Packed sequences. Every row of PACK holds two documents of DOC slots each, whose boundary falls on a block boundary,
# so each document's blocks are exactly the blocks of that document run alone (blocks are anchored to absolute slots).
# local_blocks=2: the first block of the second document still forces the first document's last block.
PACK = Case("packed", B=2, T=32, S=32, Hq=4, Hkv=2, D=8, block_size=4, topk=3, local_blocks=2)
DOC = 16
# Ids need not be sorted or contiguous across rows: only equality matters.
PACK_SEGMENTS = np.array([[0] * DOC + [1] * DOC, [3] * DOC + [2] * DOC], np.int32)
# The general case: boundaries inside blocks, three documents in row 0 (checked against the oracle only).
RAGGED_SEGMENTS = np.array([[0] * 5 + [1] * 14 + [2] * 13, [4] * 11 + [9] * 21], np.int32)

# Decoding against a cache buffer of S slots of which only the first q_offset + T are written.
BUFFER = dict(B=2, S=24, Hq=4, Hkv=2, D=8, block_size=4, topk=3, local_blocks=2)


def make_inputs(c: Case, seed: int = 0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return dict(q=f(c.B, c.T, c.Hq, c.D), k=f(c.B, c.S, c.Hkv, c.D), v=f(c.B, c.S, c.Hkv, c.D),
              q_idx=f(c.B, c.T, c.Hkv, c.d_idx), k_idx=f(c.B, c.S, c.d_idx), dout=f(c.B, c.T, c.Hq, c.D))


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


def assert_close(actual, expected, what, atol=ATOL, rtol=RTOL):
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol, err_msg=what)


def assert_selection(sel, oracle_sel, raw, c: Case, gap_tol=1e-5):
  """Selection contract, plus equality with the oracle as sets.

  Where the oracle's last chosen and first rejected non-local blocks score within `gap_tol` (f32 vs f64 rounding can
  flip them), any choice that is a top-k within `gap_tol` of the oracle's scores is accepted instead.
  """
  sel = np.asarray(sel)
  slots = min(c.topk, c.num_blocks)
  assert sel.shape == (c.B, c.Hkv, c.T, slots) and sel.dtype == np.int32, (sel.shape, sel.dtype)
  q_block = (c.offset + np.arange(c.T)) // c.block_size
  for b in range(c.B):
    for h in range(c.Hkv):
      for t in range(c.T):
        row, want = sel[b, h, t], oracle_sel[b, h, t]
        where = f"b={b} h={h} t={t} row={row.tolist()} oracle={want.tolist()}"
        valid = row[row >= 0]
        n_valid = len(valid)
        assert (row[:n_valid] >= 0).all() and (row[n_valid:] == -1).all(), f"-1 padding not at the end: {where}"
        assert len(set(valid.tolist())) == n_valid, f"duplicate blocks: {where}"
        assert (valid <= q_block[t]).all(), f"future block selected: {where}"
        assert n_valid == (want >= 0).sum(), f"wrong number of valid blocks: {where}"
        n_local = min(c.local_blocks, q_block[t] + 1, slots)
        np.testing.assert_array_equal(valid[:n_local], q_block[t] - np.arange(n_local), f"local blocks: {where}")
        rest = raw[b, h, t, valid[n_local:]]
        assert (np.diff(rest) <= gap_tol).all(), f"non-local blocks not by descending score: {where}"
        if set(valid.tolist()) == set(want[want >= 0].tolist()):
          continue
        rejected = np.setdiff1d(np.flatnonzero(raw[b, h, t] > -np.inf), valid)
        assert rest.min() >= raw[b, h, t, rejected].max() - gap_tol, f"selection differs from the oracle: {where}"


# ---------------------------------------------------------------------------------------------------------------------
# Shared test base: every implementation runs the same tests
# ---------------------------------------------------------------------------------------------------------------------


class _MsaOpsTestBase:
  IMPL: str

  def call(self, name, *args, query_chunk=QUERY_CHUNK, **kwargs):
    """The op `name` of this implementation; `query_chunk` only applies to xla_chunked."""
    if self.IMPL == "xla_chunked":
      return getattr(msa_xla, name)(*args, query_chunk=query_chunk, **kwargs)
    return getattr(msa, name)(*args, implementation=self.IMPL, **kwargs)

  # -- select_blocks --------------------------------------------------------------------------------------------------

  @pytest.mark.parametrize("c", SELECT_CASES, ids=IDS)
  def test_select_blocks_matches_oracle(self, c):
    x = make_inputs(c)
    sel = self.call("select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk,
                    local_blocks=c.local_blocks, q_offset=c.q_offset)
    oracle, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
    assert_selection(sel, oracle, raw, c)

  def test_select_blocks_per_group(self):
    # Group 1 gets the negated index query: its preferred blocks are the opposite of group 0's, so any sharing of
    # one selection across groups shows up.
    c = Case("groups", B=1, T=24, S=48, Hq=2, Hkv=2, D=8, block_size=4, topk=3)
    x = make_inputs(c)
    q_idx = np.stack([x["q_idx"][:, :, 0], -x["q_idx"][:, :, 0]], axis=2)
    sel = np.asarray(self.call("select_blocks", q_idx, x["k_idx"], block_size=c.block_size, topk=c.topk))
    oracle, raw = np_select_blocks(q_idx, x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
    assert_selection(sel, oracle, raw, c)
    assert (np.sort(sel[:, 0], -1) != np.sort(sel[:, 1], -1)).any(-1).mean() > 0.5

  # -- sparse_attention -----------------------------------------------------------------------------------------------

  @pytest.mark.parametrize("c", CASES, ids=IDS)
  def test_sparse_attention_output_and_vjp(self, c):
    x = make_inputs(c)
    block_idx, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
    block_idx = block_idx.astype(np.int32)
    f = lambda q, k, v: self.call("sparse_attention", q, k, v, block_idx, block_size=c.block_size,  # noqa: E731
                                  q_offset=c.q_offset)
    out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
    dq, dk, dv = vjp(jnp.asarray(x["dout"]))
    support = np_support(block_idx, c.T, c.S, c.block_size, c.offset)
    want = np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5, x["dout"])
    assert out.shape == (c.B, c.T, c.Hq, c.D) and out.dtype == jnp.float32
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
      assert_close(got, exp, name)

  def test_sparse_attention_ignores_empty_and_repeated_slots(self):
    # Arbitrary slot order, -1 anywhere, repeated ids, and rows with no block at all (output 0, gradient 0).
    c = Case("messy", B=1, T=37, S=37, Hq=4, Hkv=2, D=8, block_size=8, topk=5)
    x = make_inputs(c)
    rng = np.random.default_rng(1)
    block_idx = rng.integers(-1, c.num_blocks, size=(c.B, c.Hkv, c.T, 6)).astype(np.int32)
    block_idx[:, :, ::7] = -1
    scale = 0.3
    f = lambda q, k, v: self.call("sparse_attention", q, k, v, block_idx, block_size=c.block_size,  # noqa: E731
                                  scale=scale)
    out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
    grads = vjp(jnp.asarray(x["dout"]))
    want = np_attention(x["q"], x["k"], x["v"], np_support(block_idx, c.T, c.S, c.block_size, 0), scale, x["dout"])
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
      assert_close(got, exp, name)
    assert not np.asarray(out)[0, ::7].any()

  @pytest.mark.parametrize("c", DENSE_CASES, ids=IDS)
  def test_sparse_attention_equals_dense_when_all_blocks_fit(self, c):
    # topk * block_size >= S: the selection holds every visible block, so MSA must be plain causal GQA.
    x = make_inputs(c)
    block_idx = self.call("select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk,
                          q_offset=c.q_offset)
    assert block_idx.shape[-1] == c.num_blocks
    f = lambda q, k, v: self.call("sparse_attention", q, k, v, block_idx, block_size=c.block_size,  # noqa: E731
                                  q_offset=c.q_offset)
    out, vjp = jax.vjp(f, x["q"], x["k"], x["v"])
    grads = vjp(jnp.asarray(x["dout"]))
    want = np_attention(x["q"], x["k"], x["v"], np_support(None, c.T, c.S, c.block_size, c.offset), c.D ** -0.5,
                        x["dout"])
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
      assert_close(got, exp, name)

  def test_sparse_attention_bf16(self):
    c = CASES[0]
    x = make_inputs(c)
    block_idx, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in "qkv")
    out = self.call("sparse_attention", q, k, v, block_idx.astype(np.int32), block_size=c.block_size)
    assert out.dtype == jnp.bfloat16
    want = np_attention(np.float32(q), np.float32(k), np.float32(v),
                        np_support(block_idx, c.T, c.S, c.block_size, c.offset), c.D ** -0.5)
    # Inputs are exactly the bf16 values; the only extra error is rounding the f32 result to bf16 (2^-8 relative).
    assert_close(out, want, "bf16 out", atol=1e-2, rtol=1e-2)

  # -- kl_loss --------------------------------------------------------------------------------------------------------

  @pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
  @pytest.mark.parametrize("c", [CASES[0], CASES[1], CASES[2], CASES[3]], ids=IDS)
  def test_kl_loss_value_and_grads(self, c, dense):
    x = make_inputs(c)
    block_idx = None
    if not dense:
      block_idx, _ = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset)
      block_idx = block_idx.astype(np.int32)
    scale, index_scale = 0.4, 0.5
    f = lambda q, k, qi, ki: self.call("kl_loss", q, k, qi, ki, block_idx, block_size=c.block_size,  # noqa: E731
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
  def test_kl_loss_gradient_wrt_index_scores_is_p_idx_minus_p(self, dense):
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
    f = lambda qi: self.call("kl_loss", x["q"], x["k"], qi, k_idx, block_idx, block_size=c.block_size,  # noqa: E731
                             index_scale=index_scale)
    dqi = jax.grad(f)(x["q_idx"])
    support = np_support(block_idx, c.T, c.S, c.block_size, c.offset)
    *_, want_dz = np_kl(x["q"], x["k"], x["q_idx"], k_idx, support, c.D ** -0.5, index_scale)
    got_dz = np.asarray(dqi, np.float64).transpose(0, 2, 1, 3) / index_scale  # [B, Hkv, T, S]
    # Entries are O(1 / N) = O(1e-2): the absolute tolerance scales with them.
    assert_close(got_dz, want_dz, "d loss / d index logits", atol=1e-7)
    assert not got_dz[~np.broadcast_to(support, got_dz.shape)].any(), "gradient outside the support"

  def test_kl_loss_all_blocks_equals_dense_warmup(self):
    c = DENSE_CASES[0]
    x = make_inputs(c)
    block_idx = self.call("select_blocks", x["q_idx"], x["k_idx"], block_size=c.block_size, topk=c.topk)
    sparse = self.call("kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, block_size=c.block_size)
    dense = self.call("kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], None, block_size=c.block_size)
    assert_close(sparse, float(dense), "sparse kl with every block vs dense kl")

  # -- packed sequences (segment_ids) ---------------------------------------------------------------------------------
  # Each op: the packed batch equals its documents run alone (PACK_SEGMENTS), and the general case (RAGGED_SEGMENTS)
  # equals the oracle. Forward and backward run in one jit per case: compiling them separately costs ~1.7x the time.

  def test_select_blocks_segments(self):
    c = PACK
    x = make_inputs(c, seed=2)
    opts = dict(block_size=c.block_size, topk=c.topk, local_blocks=c.local_blocks)
    sel = np.asarray(self.call("select_blocks", x["q_idx"], x["k_idx"], segment_ids=PACK_SEGMENTS, **opts))
    for lo in (0, DOC):
      d = doc_inputs(x, lo, lo + DOC)
      alone = np.asarray(self.call("select_blocks", d["q_idx"], d["k_idx"], **opts))
      got = to_document(sel[:, :, lo:lo + DOC], lo // c.block_size, DOC // c.block_size)
      np.testing.assert_array_equal(got, alone, f"document at slot {lo}")
    # The second document's first block still forces the first document's last block (HF's local-block rule).
    assert (sel[:, :, DOC:DOC + c.block_size, 1] == DOC // c.block_size - 1).all()

    sel = self.call("select_blocks", x["q_idx"], x["k_idx"], segment_ids=RAGGED_SEGMENTS, **opts)
    oracle, raw = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset,
                                   RAGGED_SEGMENTS)
    assert_selection(sel, oracle, raw, c)
    # Non-local blocks are chosen only if they hold a key of the query's segment.
    sel = np.asarray(sel)
    n_local = np.minimum(c.local_blocks, np.arange(c.T) // c.block_size + 1)[None, None, :, None]
    rest = (sel >= 0) & (np.arange(sel.shape[-1]) >= n_local)
    assert (np.take_along_axis(raw, np.maximum(sel, 0), -1)[rest] > -np.inf).all()

  def test_sparse_attention_segments(self):
    c = PACK
    x = make_inputs(c, seed=4)

    @jax.jit
    def fwd_bwd(q, k, v, dout, block_idx, segment_ids=None):
      out, vjp = jax.vjp(lambda q, k, v: self.call("sparse_attention", q, k, v, block_idx, block_size=c.block_size,
                                                   segment_ids=segment_ids), q, k, v)
      return (out, *vjp(dout))

    args = [x[n] for n in ("q", "k", "v", "dout")]
    block_idx = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset,
                                 PACK_SEGMENTS)[0].astype(np.int32)
    packed = fwd_bwd(*args, block_idx, PACK_SEGMENTS)
    for lo in (0, DOC):
      d = doc_inputs(x, lo, lo + DOC)
      idx = to_document(block_idx[:, :, lo:lo + DOC], lo // c.block_size, DOC // c.block_size).astype(np.int32)
      alone = fwd_bwd(*[d[n] for n in ("q", "k", "v", "dout")], idx)
      for name, got, exp in zip(("out", "dq", "dk", "dv"), packed, alone):
        assert_close(np.asarray(got)[:, lo:lo + DOC], np.asarray(exp, np.float64), f"{name} of document at {lo}")

    block_idx = np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset,
                                 RAGGED_SEGMENTS)[0].astype(np.int32)
    got = fwd_bwd(*args, block_idx, RAGGED_SEGMENTS)
    support = np_support(block_idx, c.T, c.S, c.block_size, c.offset, RAGGED_SEGMENTS)
    want = np_attention(x["q"], x["k"], x["v"], support, c.D ** -0.5, x["dout"])
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
      assert_close(g, w, f"{name} (ragged segments)")

  @pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense_warmup"])
  def test_kl_loss_segments(self, dense):
    c = PACK
    x = make_inputs(c, seed=6)

    @jax.jit
    def value_and_grads(q, k, q_idx, k_idx, block_idx, segment_ids=None):
      f = lambda qi, ki: self.call("kl_loss", q, k, qi, ki, block_idx, block_size=c.block_size,  # noqa: E731
                                   segment_ids=segment_ids)
      return jax.value_and_grad(f, argnums=(0, 1))(q_idx, k_idx)

    def selection(segment_ids):
      if dense:
        return None
      return np_select_blocks(x["q_idx"], x["k_idx"], c.block_size, c.topk, c.local_blocks, c.offset,
                              segment_ids)[0].astype(np.int32)

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

  # -- traced q_offset (decoding inside a jitted loop) ----------------------------------------------------------------

  @pytest.mark.parametrize("T,segmented", [(1, False), (4, True)], ids=["decode", "chunked_prefill_segments"])
  def test_traced_q_offset_equals_int_offset(self, T, segmented):
    # One jitted function serves every offset; at each offset it must equal the oracle, with the unwritten (future)
    # tail of the buffer invisible, and at two of them also the static-int result (each int offset compiles anew).
    chunk = 3  # xla_chunked: T=4 -> two chunks of 3 rows, the last one padded, each at a traced start
    seg = {"segment_ids": np.array([[0] * 10 + [1] * 14, [2] * 3 + [5] * 21], np.int32)} if segmented else {}
    segment_ids = seg.get("segment_ids")

    def ops(x, off):
      opts = dict(block_size=BUFFER["block_size"], q_offset=off, query_chunk=chunk, **seg)
      sel = self.call("select_blocks", x["q_idx"], x["k_idx"], topk=BUFFER["topk"],
                      local_blocks=BUFFER["local_blocks"], **opts)
      out = self.call("sparse_attention", x["q"], x["k"], x["v"], sel, **opts)
      kl = self.call("kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], sel, **opts)
      kl_dense = self.call("kl_loss", x["q"], x["k"], x["q_idx"], x["k_idx"], None, **opts)
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


class TestReference(_MsaOpsTestBase):
  IMPL = "reference"


class TestXla(_MsaOpsTestBase):
  IMPL = "xla"


class TestXlaChunked(_MsaOpsTestBase):
  IMPL = "xla_chunked"


# ---------------------------------------------------------------------------------------------------------------------
# API: dispatch, jit, validation
# ---------------------------------------------------------------------------------------------------------------------


def test_default_implementation_off_the_gpu_is_xla():
  # On the CPU every op defaults to xla; "pallas" is the interpret-mode kernel (tests/test_msa_pallas.py).
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
