"""`minimax_m3_sparse` attention: the M3 projections plus MSA's index branch (DESIGN.md §2).

The index branch reads `stop_gradient(x)` (the paper: without the detach training diverges), projects one
index-query head per GQA group and one shared index-key head, each with its own Gemma RMSNorm and the main
branch's partial RoPE. Selection (`select_blocks`) picks per (query, group) blocks; the main branch attends only
those (`sparse_attention`); the KL alignment (`kl_loss`) trains the index branch and nothing else.

Indexer warmup: while `step < warmup_steps` the main branch is dense and the KL target is the dense causal
distribution; the switch is a `lax.cond` on the traced step, so it never recompiles.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.models.attention import Attention, AttentionDims, dot_product_attention
from m3_jax.models.config import TextConfig
from m3_jax.models.layers import RMSNorm, apply_rope, param
from pallas_kernels import msa as msa_ops


class Indexer(nnx.Module):
  """q_proj: [d_model, Hkv, d_idx] (one index-query head per GQA group); k_proj: [d_model, d_idx] (ONE key head)."""

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs, std: float, param_dtype, dtype):
    d, hi, di = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    self.rotary_dim, self.theta, self.dtype = cfg.rotary_dim, cfg.rope_theta, dtype
    self.q_proj = param(rngs, (d, hi, di), ("embed", "index_heads", "index_dim"), std=std, dtype=param_dtype)
    self.k_proj = param(rngs, (d, di), ("embed", "index_dim"), std=std, dtype=param_dtype)
    self.q_norm = RMSNorm(di, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(di, eps=cfg.rms_norm_eps, param_dtype=param_dtype)

  def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, d] -> q_idx [B, T, Hkv, d_idx], k_idx [B, T, d_idx]."""
    qi = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(self.dtype))  # [B, T, Hkv, d_idx]
    ki = jnp.einsum("btd,dk->btk", x, self.k_proj[...].astype(self.dtype))[:, :, None]  # [B, T, 1, d_idx]
    qi = apply_rope(self.q_norm(qi), positions, rotary_dim=self.rotary_dim, theta=self.theta)
    ki = apply_rope(self.k_norm(ki), positions, rotary_dim=self.rotary_dim, theta=self.theta)
    return qi, ki[:, :, 0]


def block_metrics(q, k, block_idx, *, block_size: int, local_blocks: int, q_offset, segment_ids, num_queries: int,
                  key):
  """Diagnostics on a sample of queries of batch row 0 (no gradient):

  - mass_recall: share of the full attention probability mass (mean over the group's heads) that falls in the
    selected blocks; random_mass_recall: the same for a random selection with the same forced local blocks;
  - block_recall: overlap of the selection with the oracle top blocks by attention mass (same count).
  q: [B, T, Hq, D]; k: [B, S, Hkv, D]; block_idx: [B, Hkv, T, topk].
  """
  q, k = jax.lax.stop_gradient(q[0]), jax.lax.stop_gradient(k[0])  # [T, Hq, D], [S, Hkv, D]
  t, hq, d = q.shape
  s, hkv = k.shape[0], k.shape[1]
  g = hq // hkv
  nb = -(-s // block_size)
  nq = min(num_queries, t)
  rows = jnp.linspace(t // 2, t - 1, nq).astype(jnp.int32)  # the later half, where sparsity bites
  pos = q_offset + rows  # [nq]
  qs = q[rows].reshape(nq, hkv, g, d)
  scores = jnp.einsum("nkgd,skd->kgns", qs, k, preferred_element_type=jnp.float32) * d ** -0.5
  visible = jnp.arange(s)[None, :] <= pos[:, None]  # [nq, S]
  if segment_ids is not None:
    visible &= segment_ids[0][None, :] == segment_ids[0][rows][:, None]
  probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).mean(axis=1)  # [Hkv, nq, S]
  mass = jnp.pad(probs, ((0, 0), (0, 0), (0, nb * block_size - s))).reshape(hkv, nq, nb, block_size).sum(-1)
  sel = block_idx[0][:, rows]  # [Hkv, nq, topk]
  chosen = jnp.zeros((hkv, nq, nb + 1), jnp.float32).at[
      jnp.arange(hkv)[:, None, None], jnp.arange(nq)[None, :, None], jnp.where(sel < 0, nb, sel)].set(1.0)[..., :nb]
  n_valid = jnp.sum(sel >= 0, axis=-1)  # [Hkv, nq]
  mass_recall = jnp.mean(jnp.sum(mass * chosen, -1))
  # oracle: the n_valid blocks with the most attention mass
  rank = jnp.argsort(jnp.argsort(-mass, axis=-1), axis=-1)  # 0 = heaviest block
  oracle = (rank < n_valid[..., None]).astype(jnp.float32)
  block_recall = jnp.mean(jnp.sum(oracle * chosen, -1) / jnp.maximum(n_valid, 1))
  # random baseline: forced local blocks, then uniformly random visible blocks
  q_block = pos // block_size  # [nq]
  blocks = jnp.arange(nb)
  vis_block = blocks[None, :] <= q_block[:, None]  # [nq, nb]
  rnd = jax.random.uniform(key, (hkv, nq, nb))
  local = (blocks[None, :] <= q_block[:, None]) & (blocks[None, :] > q_block[:, None] - local_blocks)
  rnd = jnp.where(local[None], 2.0, jnp.where(vis_block[None], rnd, -1.0))
  rrank = jnp.argsort(jnp.argsort(-rnd, axis=-1), axis=-1)
  rchosen = ((rrank < n_valid[..., None]) & vis_block[None]).astype(jnp.float32)
  random_recall = jnp.mean(jnp.sum(mass * rchosen, -1))
  return {"mass_recall": mass_recall, "block_recall": block_recall, "random_mass_recall": random_recall}


def selected_probs(q, k, block_idx, *, block_size: int, q_offset=None, segment_ids=None) -> jax.Array:
  """Attention probabilities over (selected blocks ∩ causal ∩ segment), materialised: analysis only.
  q: [B, T, Hq, D]; k: [B, S, Hkv, D]; block_idx: [B, Hkv, T, topk] -> [B, Hq, T, S] f32."""
  b, t, hq, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  nb = -(-s // block_size)
  q_offset = s - t if q_offset is None else q_offset
  chosen = jnp.zeros((b, hkv, t, nb + 1), bool).at[
      jnp.arange(b)[:, None, None, None], jnp.arange(hkv)[None, :, None, None], jnp.arange(t)[None, None, :, None],
      jnp.where(block_idx < 0, nb, block_idx)].set(True)[..., :nb]
  key_ok = jnp.repeat(chosen, block_size, axis=-1)[..., :s]  # [B, Hkv, T, S]
  key_ok &= (jnp.arange(s)[None, :] <= q_offset + jnp.arange(t)[:, None])[None, None]
  if segment_ids is not None:
    q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, q_offset, t, axis=1)
    key_ok &= (q_seg[:, :, None] == segment_ids[:, None, :])[:, None]
  qg = q.reshape(b, t, hkv, hq // hkv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
  probs = jax.nn.softmax(jnp.where(key_ok[:, :, None], scores, -jnp.inf), axis=-1)
  return probs.reshape(b, hq, t, s)


class MSAAttention(Attention):
  """Same projections (and HF names) as dense attention, plus `indexer`."""

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs, std: float = 0.02, param_dtype=jnp.float32,
               dtype=jnp.float32):
    dims = AttentionDims.from_config(cfg)
    super().__init__(dims, impl=cfg.attention_impl, rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype,
                     document_mask=cfg.document_mask)
    if cfg.index_n_heads != cfg.num_key_value_heads:
      raise ValueError(f"TextConfig: index_n_heads={cfg.index_n_heads} must equal num_key_value_heads="
                       f"{cfg.num_key_value_heads} (MSA selects per GQA group)")
    if cfg.index_head_dim < cfg.rotary_dim:
      raise ValueError(f"TextConfig: index_head_dim={cfg.index_head_dim} < rotary_dim={cfg.rotary_dim}; the index "
                       "branch applies the main branch's partial RoPE and needs at least rotary_dim channels")
    self.block_size, self.topk, self.local_blocks = cfg.index_block_size, cfg.index_topk_blocks, cfg.index_local_blocks
    self.warmup_steps, self.detach = cfg.warmup_steps, cfg.detach_index_input
    self.msa_impl, self.metric_queries = cfg.msa_impl, cfg.msa_metric_queries
    self.index_fp8 = cfg.msa_index_fp8
    self.indexer = Indexer(cfg, rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype)

  def __call__(self, x, positions, segment_ids=None, *, cache=None, capture: bool = False,
               step_state: Any = None):
    """x: [B, T, d]. Returns (y [B, T, d], aux) with aux: kl_loss, metrics (training), cache (decoding)."""
    q, k, v = self.project(x, positions)
    if not self.document_mask:
      segment_ids = None
    q_idx, k_idx = self.indexer(jax.lax.stop_gradient(x) if self.detach else x, positions)
    aux: dict[str, Any] = {}
    q_offset = None
    if cache is not None:
      q_offset = cache.length
      cache = cache.update(k, v, k_idx)
      k, v, k_idx, aux["cache"] = cache.k, cache.v, cache.k_idx, cache
      segment_ids = None
    ops = dict(block_size=self.block_size, q_offset=q_offset, implementation=self.msa_impl)
    seg = {} if segment_ids is None else {"segment_ids": segment_ids}
    sel_q, sel_k, sel_kw = q_idx, k_idx, {}
    if self.index_fp8:
      # fp8 index scoring (selection only; the KL trains the full-precision index branch).
      sel_q, _ = msa_ops.quantize_index(q_idx)
      sel_k, sel_kw["k_idx_scale"] = msa_ops.quantize_index(k_idx)
    block_idx = msa_ops.select_blocks(sel_q, sel_k, topk=self.topk, local_blocks=self.local_blocks, **ops, **seg,
                                      **sel_kw)
    training = step_state is not None
    in_warmup = training and self.warmup_steps > 0
    # On the Pallas kernels the KL reuses the attention forward's log-sum-exp (LSE fusion): a training step then
    # does no dense work besides the index scoring inside select_blocks.
    fuse_lse = self.msa_impl == "pallas" and training and not in_warmup and not capture
    lse = None

    def sparse():
      return msa_ops.sparse_attention(q, k, v, block_idx, **ops, **seg)

    def dense():
      return dot_product_attention(q, k, v, impl=self.impl, q_offset=q_offset, segment_ids=segment_ids)

    if capture:  # analysis: the probabilities the sparse branch actually uses, and the selection itself
      out = sparse()
      aux["attention_probs"] = selected_probs(q, k, block_idx, block_size=self.block_size,
                                              q_offset=q_offset, segment_ids=segment_ids)
      aux["block_idx"] = block_idx
    elif in_warmup:
      out = jax.lax.cond(step_state["step"] < self.warmup_steps, dense, sparse)
    elif fuse_lse:
      out, lse = msa_ops.sparse_attention_with_lse(q, k, v, block_idx, block_size=self.block_size,
                                                   q_offset=q_offset, **seg)
    else:
      out = sparse()
    if training:
      def kl_of(idx):
        return msa_ops.kl_loss(q, k, q_idx, k_idx, idx, **ops, **seg, lse=lse)
      if in_warmup:
        kl = jax.lax.cond(step_state["step"] < self.warmup_steps, lambda: kl_of(None), lambda: kl_of(block_idx))
      else:
        kl = kl_of(block_idx)
      aux["kl_loss"] = kl
      metrics = block_metrics(q, k, block_idx, block_size=self.block_size,
                              q_offset=k.shape[1] - q.shape[1] if q_offset is None else q_offset,
                              segment_ids=segment_ids, num_queries=self.metric_queries,
                              key=jax.random.fold_in(jax.random.key(0), step_state["step"]),
                              local_blocks=self.local_blocks)
      aux["metrics"] = {"kl": kl, **metrics}
    return self.output(out.astype(self.dtype)), aux
