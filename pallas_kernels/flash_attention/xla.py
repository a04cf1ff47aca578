"""Blockwise (FlashAttention-2 style) dense causal GQA attention in plain XLA, for every backend.

Forward: `lax.map` over query blocks of `block_q` rows; inside, `lax.scan` over key blocks of `block_k` slots with an
online softmax (running max m, running sum l, f32 accumulator). Only `out` and the log-sum-exp `lse [B, Hq, T]`
(f32) are kept for the backward (besides q, k, v). Backward (custom VJP): `delta = rowsum(dO * O)`, then the
probabilities are recomputed block by block as `exp(s - lse)`: one pass over query blocks accumulates dq (scan over
key blocks), one pass over key blocks accumulates dk and dv (scan over query blocks). s and p are recomputed in both
passes: two more matmuls per block pair than a single pass, in exchange for no scatter into a [T] accumulator.

Memory bound. One step of any loop holds a handful of `[B, Hkv, G, block_q, block_k]` f32 buffers (scores,
probabilities, dp, ds) and `[B, Hkv, G, block_q, D]` / `[B, block_k, Hkv, D]` f32 accumulators. Beyond that there are
only arrays the size of the inputs, outputs and gradients: q, k, v padded to whole blocks (a copy only when T or S
is not a multiple of the block), the stacked per-block results of the maps (out, dq, dk, dv), lse and delta
`[B, Hq, T]` f32. So memory is O(B * Hq * block_q * block_k + (T + S) * H * D): at T = S = 64K a score matrix
would be 16 GiB per (batch row, head); the gradient's compiled temporaries are about 60 MiB there (B=1, Hq=2, D=64,
bf16; tests/test_flash_attention.py checks them). Nothing T x S exists, in the forward or the backward.

Causal skip. Query t sits at position `q_offset + t`, so query block i ends at position
`q_offset + min((i + 1) * block_q, T) - 1`; key block j starts at `j * block_k`. When the key block starts after the
query block ends, every key of it lies in every query's future: `lax.cond` skips the block pair (in all three
passes). For T = S (q_offset = 0, block_q = block_k) that is the strict upper triangle of block pairs, about half the
work; with context parallelism a device's share is the fraction of the key sequence before its last query (so the
device with the last queries does the most). Blocks entirely before the queries are never skipped: only the future
is known invisible (a key block of other documents, with segment_ids, is computed and masked).

Masks. Key slot j is visible to query t iff `j <= q_offset + t`, `j < S` and, with segment_ids,
`segment_ids[b, j] == segment_ids[b, q_offset + t]`. The pad keys (slots >= S) are masked explicitly: causality
alone hides them only while `q_offset + T <= S`, which a traced offset does not guarantee. Padded query rows
(t >= T) see nothing and are dropped. A row that sees no key gets output 0, lse -inf, and zero gradients (never
0 / 0 or exp(-inf + inf)).

Context parallelism: inside `jax.shard_map` the inputs can vary over different manual mesh axes (local queries and
their offset over the sequence axis; replicated keys, values and segment ids over none). Every input is first made
to vary over the union of their axes (`_zeros`), so the scan carries and the cond branches are built with the type
the computed values have, and the custom VJP returns cotangents of its inputs' types; the additions' transposes
outside it sum each cotangent over the axes its input lacked, which is the psum plain autodiff would insert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._carry import carried_zero
from pallas_kernels.flash_attention._common import query_segments

# Default blocks: [B, Hq, 512, 512] f32 is 1 MiB per (batch row, head), large enough to keep a GPU's matmul units
# busy and the per-iteration loop overhead small on CPU, small enough for four such buffers beside a model.
BLOCK_Q = 512
BLOCK_K = 512

_F32 = jnp.float32


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _zeros(shape, dtype, *like: jax.Array) -> jax.Array:
  """Zeros that vary over the manual mesh axes `like` vary over: inside a shard_map the identity branch of a cond and a
  scan's initial carry must have the type the computed values have."""
  z = jnp.zeros(shape, dtype)
  for a in like:  # zeros_like keeps its operand's varying axes; one zero scalar of each gives z their union
    z = z + jnp.zeros_like(a[(0,) * a.ndim], dtype=dtype)
  return z


def _pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
  """x zero-padded along `axis` to `size` (no copy when it already has that size)."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)


def _rows(x: jax.Array, start, size: int, axis: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _unblock(x: jax.Array, axis: int, length: int) -> jax.Array:
  """[n, ...] with a block-local axis of size b at `axis` (counted without n) -> [..., n * b, ...] cut to `length`."""
  x = jnp.moveaxis(x, 0, axis)  # [..., n, b, ...]
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


class _Blocks:
  """The padded inputs and the block geometry shared by the forward and both backward passes.

  q is grouped as [B, Tp, Hkv, G, D] (query head h = kv head h // G, member h % G), so K and V are read once per
  block pair for all G heads that share them, never repeated in memory.
  """

  def __init__(self, q, k, v, offset, seg, block_q: int, block_k: int):
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    self.B, self.T, self.S, self.Hkv, self.G, self.D = B, T, S, Hkv, Hq // Hkv, D
    self.bq, self.bk = block_q, block_k
    self.nq, self.nk = _cdiv(T, block_q), _cdiv(S, block_k)
    self.Tp, self.Sp = self.nq * block_q, self.nk * block_k
    self.q = _pad_to(q.reshape(B, T, Hkv, self.G, D), 1, self.Tp)  # [B, Tp, Hkv, G, D]
    self.k = _pad_to(k, 1, self.Sp)  # [B, Sp, Hkv, D]
    self.v = _pad_to(v, 1, self.Sp)
    self.offset = offset
    if seg is None:
      self.q_seg = self.k_seg = None
    else:
      self.q_seg = _pad_to(query_segments(seg, offset, T), 1, self.Tp)  # [B, Tp]
      self.k_seg = _pad_to(seg, 1, self.Sp)  # [B, Sp]

  def q_last(self, i):
    """Position of the last real query of query block i."""
    return self.offset + jnp.minimum((i + 1) * self.bq, self.T) - 1

  def sees(self, i, j):
    """False when key block j lies wholly in the future of query block i (the causal skip)."""
    return j * self.bk <= self.q_last(i)

  def q_block(self, x, i, axis=1):
    return _rows(x, i * self.bq, self.bq, axis)

  def k_block(self, x, j):
    return _rows(x, j * self.bk, self.bk, 1)

  def scores(self, qb, kb, i, j, scale: float) -> jax.Array:
    """Masked scaled scores [B, Hkv, G, bq, bk] f32 of query block i (qb [B, bq, Hkv, G, D]) against key block j
    (kb [B, bk, Hkv, D]); invisible entries are -inf."""
    q_pos = self.offset + i * self.bq + jnp.arange(self.bq)  # [bq]
    k_pos = j * self.bk + jnp.arange(self.bk)  # [bk]
    real_q = q_pos < self.offset + self.T
    mask = ((k_pos[None, :] <= q_pos[:, None]) & (k_pos < self.S)[None, :] & real_q[:, None])[None]  # [1, bq, bk]
    if self.q_seg is not None:
      same = self.q_block(self.q_seg, i)[:, :, None] == self.k_block(self.k_seg, j)[:, None, :]  # [B, bq, bk]
      mask = mask & same
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=_F32) * scale  # [B, Hkv, G, bq, bk]
    return jnp.where(mask[:, None, None], s, -jnp.inf)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset, segment_ids: jax.Array | None,
                    scale: float | None, block_q: int | None = None, block_k: int | None = None) -> jax.Array:
  """q [B, T, Hq, D], k, v [B, S, Hkv, D] -> [B, T, Hq, D] in q.dtype; see api.flash_attention for the contract.

  The offset always enters the compiled function as an int32 scalar: one compilation serves every offset (the skip
  decisions are runtime conds either way). Blocks default to BLOCK_Q / BLOCK_K, capped by T and S.
  """
  T, D = q.shape[1], q.shape[3]
  S = k.shape[1]
  block_q = min(BLOCK_Q if block_q is None else block_q, T)
  block_k = min(BLOCK_K if block_k is None else block_k, S)
  scale = D ** -0.5 if scale is None else float(scale)
  return _flash_attention(q, k, v, jnp.asarray(q_offset, jnp.int32), segment_ids, scale=scale, block_q=block_q,
                          block_k=block_k)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k"))
def _flash_attention(q, k, v, offset, segment_ids, *, scale, block_q, block_k):
  like = (q, k, v, offset) + (() if segment_ids is None else (segment_ids,))
  q = _zeros((), q.dtype, *like) + q
  k = _zeros((), k.dtype, *like) + k
  v = _zeros((), v.dtype, *like) + v
  # tied to the query values: masks built from the offset alone would be hoisted out of scanned layers (_carry)
  offset = _zeros((), jnp.int32, *like) + offset + carried_zero(q)
  seg = None if segment_ids is None else _zeros((), jnp.int32, *like) + segment_ids.astype(jnp.int32)
  return _attention(q, k, v, offset, seg, scale, block_q, block_k)


# ---------------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, offset, seg, scale, block_q, block_k):
  return _forward(q, k, v, offset, seg, scale, block_q, block_k)[0]


def _forward(q, k, v, offset, seg, scale, block_q, block_k):
  """-> (out [B, T, Hq, D] in q.dtype, lse [B, Hq, T] f32, -inf on a row that sees no key)."""
  bl = _Blocks(q, k, v, offset, seg, block_q, block_k)
  B, Hkv, G, D, bq = bl.B, bl.Hkv, bl.G, bl.D, bl.bq

  def query_block(i):
    qb = bl.q_block(bl.q, i)  # [B, bq, Hkv, G, D]

    def step(carry, j):
      def visit(carry):
        m, l, acc = carry  # [B, Hkv, G, bq] x2, [B, Hkv, G, bq, D]
        kb, vb = bl.k_block(bl.k, j), bl.k_block(bl.v, j)  # [B, bk, Hkv, D]
        s = bl.scores(qb, kb, i, j, scale)  # [B, Hkv, G, bq, bk]
        m_new = jnp.maximum(m, s.max(-1))
        # While a row has seen no key its max is -inf; shifting by 0 instead keeps exp(-inf - -inf) out.
        m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_use[..., None])  # masked: exp(-inf) = 0
        alpha = jnp.exp(m - m_use)  # rescales what was summed under the old max (0 while it was -inf)
        pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(vb.dtype), vb, preferred_element_type=_F32)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

      return jax.lax.cond(bl.sees(i, j), visit, lambda c: c, carry), None

    init = (_zeros((B, Hkv, G, bq), _F32, bl.q) - jnp.inf, _zeros((B, Hkv, G, bq), _F32, bl.q),
            _zeros((B, Hkv, G, bq, D), _F32, bl.q))
    (m, l, acc), _ = jax.lax.scan(step, init, jnp.arange(bl.nk))
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = (acc / l_safe[..., None]).transpose(0, 3, 1, 2, 4)  # [B, bq, Hkv, G, D]
    return out.astype(q.dtype), jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)

  out, lse = jax.lax.map(query_block, jnp.arange(bl.nq))  # [nq, B, bq, Hkv, G, D], [nq, B, Hkv, G, bq]
  out = _unblock(out, 1, bl.T).reshape(q.shape)  # [B, T, Hq, D]
  lse = _unblock(lse, 3, bl.T).reshape(B, Hkv * G, bl.T)  # [B, Hq, T]
  return out, lse


def _attention_fwd(q, k, v, offset, seg, scale, block_q, block_k):
  out, lse = _forward(q, k, v, offset, seg, scale, block_q, block_k)
  return out, (q, k, v, offset, seg, out, lse)


# ---------------------------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------------------------


def _attention_bwd(scale, block_q, block_k, res, dout):
  """dout [B, T, Hq, D] -> (dq, dk, dv in their inputs' dtypes, None, None)."""
  q, k, v, offset, seg, out, lse = res
  bl = _Blocks(q, k, v, offset, seg, block_q, block_k)
  B, T, Hkv, G, D, bq, bk = bl.B, bl.T, bl.Hkv, bl.G, bl.D, bl.bq, bl.bk
  do = _pad_to(dout.reshape(B, T, Hkv, G, D), 1, bl.Tp)  # [B, Tp, Hkv, G, D]
  # d softmax: ds = p * (dp - delta), delta_t = sum_j p_tj dp_tj = dO_t . O_t.
  delta = jnp.einsum("bthd,bthd->bth", dout, out, preferred_element_type=_F32)  # [B, T, Hq]
  delta = _pad_to(delta.reshape(B, T, Hkv, G).transpose(0, 2, 3, 1), 3, bl.Tp)  # [B, Hkv, G, Tp]
  # A row that saw no key has lse -inf and every score -inf: shift by 0 so p = exp(-inf) = 0, not exp(nan).
  lse = _pad_to(jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(B, Hkv, G, T), 3, bl.Tp)  # [B, Hkv, G, Tp]

  def probabilities(qb, kb, lse_b, i, j):
    return jnp.exp(bl.scores(qb, kb, i, j, scale) - lse_b[..., None])  # [B, Hkv, G, bq, bk]

  def dq_block(i):
    qb, dob = bl.q_block(bl.q, i), bl.q_block(do, i)  # [B, bq, Hkv, G, D]
    lse_b, delta_b = bl.q_block(lse, i, axis=3), bl.q_block(delta, i, axis=3)  # [B, Hkv, G, bq]

    def step(dq, j):
      def visit(dq):
        kb, vb = bl.k_block(bl.k, j), bl.k_block(bl.v, j)  # [B, bk, Hkv, D]
        p = probabilities(qb, kb, lse_b, i, j)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dob, vb, preferred_element_type=_F32)  # [B, Hkv, G, bq, bk]
        ds = p * (dp - delta_b[..., None])
        return dq + jnp.einsum("bhgqk,bkhd->bhgqd", ds.astype(kb.dtype), kb, preferred_element_type=_F32)

      return jax.lax.cond(bl.sees(i, j), visit, lambda c: c, dq), None

    dq, _ = jax.lax.scan(step, _zeros((B, Hkv, G, bq, D), _F32, bl.q, do), jnp.arange(bl.nk))
    return (dq * scale).transpose(0, 3, 1, 2, 4).astype(q.dtype)  # [B, bq, Hkv, G, D]

  def dkv_block(j):
    kb, vb = bl.k_block(bl.k, j), bl.k_block(bl.v, j)  # [B, bk, Hkv, D]

    def step(carry, i):
      def visit(carry):
        dk, dv = carry  # [B, bk, Hkv, D] f32
        qb, dob = bl.q_block(bl.q, i), bl.q_block(do, i)  # [B, bq, Hkv, G, D]
        lse_b, delta_b = bl.q_block(lse, i, axis=3), bl.q_block(delta, i, axis=3)  # [B, Hkv, G, bq]
        p = probabilities(qb, kb, lse_b, i, j)  # [B, Hkv, G, bq, bk]
        dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(dob.dtype), dob, preferred_element_type=_F32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dob, vb, preferred_element_type=_F32)
        ds = p * (dp - delta_b[..., None])
        dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(qb.dtype), qb, preferred_element_type=_F32)
        return dk, dv

      return jax.lax.cond(bl.sees(i, j), visit, lambda c: c, carry), None

    init = (_zeros((B, bk, Hkv, D), _F32, bl.q, do), _zeros((B, bk, Hkv, D), _F32, bl.q, do))
    (dk, dv), _ = jax.lax.scan(step, init, jnp.arange(bl.nq))
    return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

  dq = _unblock(jax.lax.map(dq_block, jnp.arange(bl.nq)), 1, T).reshape(q.shape)  # [B, T, Hq, D]
  dk, dv = jax.lax.map(dkv_block, jnp.arange(bl.nk))  # [nk, B, bk, Hkv, D]
  return dq, _unblock(dk, 1, bl.S), _unblock(dv, 1, bl.S), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
