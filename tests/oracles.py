"""The float64 numpy oracles of the tests, in one place, written independently of the code they check:

- MSA ops (pallas_kernels.msa), their test cases and comparison helpers: test_msa_ops.py checks every
  implementation against them, test_msa_pallas.py the Pallas-only paths;
- the M3 text tower (np_forward and its parts, from the paper / HF semantics): test_model.py;
- the vision tower's 3D RoPE, channel pair by channel pair: test_vision.py.

The oracles are written independently of pallas_kernels/msa/reference.py. The selection oracle follows the HF
transformers MiniMaxM3VLIndexer recipe (+inf on the local blocks, top-k, -inf slots -> -1), extended with the
packed-sequence mask: key j is visible to query t iff j <= q_offset + t and both lie in the same segment.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# float32 ops vs float64 oracles.
ATOL = RTOL = 1e-5

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
  s = np.einsum("bthi,bsi->bhts", np.float64(q_idx), np.float64(k_idx))
  return np_select_from_scores(s, block_size, topk, local_blocks, q_offset, segment_ids)


def np_select_from_scores(s, block_size, topk, local_blocks, q_offset, segment_ids=None):
  """np_select_blocks from token scores s [B, H, T, S] (any head combination the caller made)."""
  B, H, T, S = s.shape
  nb = -(-S // block_size)
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


def np_kl_shared(q, k, q_idx, k_idx, support, scale, index_scale):
  """The shared-selection indexer's KL (msa_selection="shared"): one support [B, 1, T, S] for all groups, the
  student Q = softmax_I(sum_h q_idx_h . k_idx * index_scale), the target P_all = mean over all Hq query heads of
  softmax_I(q_h . k_{group(h)} * scale).

  Returns (KL(P_all || Q) averaged over (b, t), mean over (b, t, g) of KL(P_g || P_all) with P_g the mean of group
  g's heads, d KL(P_all || Q) / d q_idx [B, T, Hkv, d_idx] (the same for every head, which enters through the sum),
  d / d k_idx [B, S, d_idx]).
  """
  q, k, q_idx, k_idx = map(np.float64, (q, k, q_idx, k_idx))
  B, T, Hq, _ = q.shape
  S, Hkv = k.shape[1:3]
  G = Hq // Hkv
  support = np.broadcast_to(support, (B, 1, T, S))
  p_heads = np_softmax(np.einsum("bthd,bshd->bhts", q, np.repeat(k, G, axis=2)) * scale,
                       np.broadcast_to(support, (B, Hq, T, S)))
  p_groups = p_heads.reshape(B, Hkv, G, T, S).mean(2)  # [B, Hkv, T, S]
  p_all = p_heads.mean(1)  # [B, T, S]
  z = sum(np.einsum("bti,bsi->bts", q_idx[:, :, h], k_idx) for h in range(Hkv)) * index_scale
  student = np_softmax(z, support[:, 0])  # [B, T, S]

  def kl(p, r):
    with np.errstate(divide="ignore", invalid="ignore"):
      return np.where(p > 0, p * (np.log(p) - np.log(r)), 0.0).sum(-1)

  n = B * T
  dz = (student - p_all) / n  # [B, T, S]
  dq = np.einsum("bts,bsi->bti", dz, k_idx) * index_scale
  dk = np.einsum("bts,bti->bsi", dz, q_idx.sum(2)) * index_scale
  gap = kl(p_groups, p_all[:, None]).mean()
  return kl(p_all, student).sum() / n, gap, np.repeat(dq[:, :, None], Hkv, axis=2), dk


# ---------------------------------------------------------------------------------------------------------------------
# Cases and inputs
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


def case_id(c: Case) -> str:
  return c.name


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
# Packed segments with boundaries inside blocks: three documents in row 0, two in row 1 (T = S = 32).
RAGGED_SEGMENTS = np.array([[0] * 5 + [1] * 14 + [2] * 13, [4] * 11 + [9] * 21], np.int32)

# KernelConfig knobs that make the Pallas kernels take, at test sizes, the paths that otherwise only occur at scale
# on the GPU: several steps per forward program, a hot block split over several programs, backward loops of several
# steps, padded merge tiles.
PALLAS_SMALL_TILES = dict(rows=16, fwd_steps=2, bwd_rows=8, merge_rows=8)


def make_inputs(c: Case, seed: int = 0) -> dict[str, np.ndarray]:
  """float32 q [B, T, Hq, D], k, v [B, S, Hkv, D], q_idx [B, T, Hkv, d_idx], k_idx [B, S, d_idx], dout like q."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return dict(q=f(c.B, c.T, c.Hq, c.D), k=f(c.B, c.S, c.Hkv, c.D), v=f(c.B, c.S, c.Hkv, c.D),
              q_idx=f(c.B, c.T, c.Hkv, c.d_idx), k_idx=f(c.B, c.S, c.d_idx), dout=f(c.B, c.T, c.Hq, c.D))


# ---------------------------------------------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------------------------------------------


def assert_close(actual, expected, what, atol=ATOL, rtol=RTOL):
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, atol=atol, rtol=rtol, err_msg=what)


def assert_attention_matches(got, x, support, scale):
  """got = (out, dq, dk, dv) for the cotangent x['dout']: finite (an element no Pallas program writes is NaN in
  interpret mode) and equal to the oracle on `support` within ATOL / RTOL."""
  want = np_attention(x["q"], x["k"], x["v"], support, scale, x["dout"])
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isfinite(np.asarray(a)).all(), f"{name}: non-finite entries (an element was never written)"
    assert_close(a, b, name)


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
        _assert_selection_row(sel[b, h, t], oracle_sel[b, h, t], raw[b, h, t], q_block[t], c, slots, gap_tol,
                              f"b={b} h={h} t={t}")


def _assert_selection_row(row, want, raw, q_block, c: Case, slots, gap_tol, at):
  where = f"{at} row={row.tolist()} oracle={want.tolist()}"
  valid = row[row >= 0]
  n_valid = len(valid)
  assert (row[:n_valid] >= 0).all() and (row[n_valid:] == -1).all(), f"-1 padding not at the end: {where}"
  assert len(set(valid.tolist())) == n_valid, f"duplicate blocks: {where}"
  assert (valid <= q_block).all(), f"future block selected: {where}"
  assert n_valid == (want >= 0).sum(), f"wrong number of valid blocks: {where}"
  n_local = min(c.local_blocks, q_block + 1, slots)
  np.testing.assert_array_equal(valid[:n_local], q_block - np.arange(n_local), f"local blocks: {where}")
  rest = raw[valid[n_local:]]
  assert (np.diff(rest) <= gap_tol).all(), f"non-local blocks not by descending score: {where}"
  if set(valid.tolist()) == set(want[want >= 0].tolist()):
    return
  rejected = np.setdiff1d(np.flatnonzero(raw > -np.inf), valid)
  assert rest.min() >= raw[rejected].max() - gap_tol, f"selection differs from the oracle: {where}"


# ---------------------------------------------------------------------------------------------------------------------
# The M3 text tower (paper / HF semantics, no shared code with m3_jax.models)
# ---------------------------------------------------------------------------------------------------------------------

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


def np_gqa_layer(x, p, cfg, pos, seg):
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
    x = x + np_gqa_layer(np_rms(x, lp["input_layernorm"]["weight"], cfg.rms_norm_eps), lp["self_attn"], cfg, pos,
                         seg)
    y = np_rms(x, lp["post_attention_layernorm"]["weight"], cfg.rms_norm_eps)
    x = x + (np_mlp(y, lp["mlp"]["gate_up"], lp["mlp"]["down"], cfg) if mt == "dense" else np_moe(y, lp["mlp"], cfg))
  return np_rms(x, params["norm"]["weight"], cfg.rms_norm_eps) @ params["lm_head"]


# ---------------------------------------------------------------------------------------------------------------------
# The vision tower's 3D axial RoPE
# ---------------------------------------------------------------------------------------------------------------------

def np_rope_3d(x, pos, cfg):
  """float64 oracle written pair by pair: channel c < R/2 pairs with c + R/2; c lies in axis block c // (sd/2)
  (t, h, w) and rotates by pos[axis] * theta^(-2 (c mod sd/2) / sd); channels >= R pass through."""
  sd, r = cfg.rope_axis_dim, cfg.rotary_dim
  out = np.array(x, np.float64)
  for s in range(x.shape[0]):
    for c in range(r // 2):
      axis, j = divmod(c, sd // 2)
      ang = pos[s, axis] * cfg.rope_theta ** (-2.0 * j / sd)
      a, b = x[s, :, c], x[s, :, c + r // 2]
      out[s, :, c] = a * np.cos(ang) - b * np.sin(ang)
      out[s, :, c + r // 2] = b * np.cos(ang) + a * np.sin(ang)
  return out
