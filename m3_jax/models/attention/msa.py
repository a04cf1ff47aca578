"""MSA attention (MiniMax-M3's sparse layers): the dense projections plus an index branch (DESIGN.md §2), and its
decoding cache (keys, values and index keys).

The index branch reads `stop_gradient(x)` (the paper: without the detach training diverges), projects one
index-query head per GQA group and one shared index-key head, each with its own Gemma RMSNorm and the main
branch's partial RoPE. Selection (`select_blocks`) picks per (query, group) blocks; the main branch attends only
those (`sparse_attention`); the KL alignment (`kl_loss`) trains the index branch and nothing else.

Indexer warmup: while `step < warmup_steps` the main branch is dense and the KL target is the dense causal
distribution; the switch is a `lax.cond` on the traced step, so it never recompiles.

Ablations (issue 19), each a TextConfig switch: `msa_selection="shared"` (one block set per query for all groups,
see `MSAAttention._index_queries`), `detach_index_input=False`, and the block granularity at a fixed token budget
(`index_block_size` x `index_topk_blocks`, e.g. config.msa_token_budget(16) = block 16 x top 128).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from m3_jax.models.attention import context
from m3_jax.models.attention.dense import (KV_AXES, Q_AXES, TOKEN_AXES, Attention, AttentionDims, KVCache,
                                           captures_probs, dense_attention)
from m3_jax.models.attention.msa_diagnostics import block_metrics, selected_probs
from m3_jax.models.layers import RMSNorm, apply_rope, param
from pallas_kernels import msa as msa_ops
from pallas_kernels.flash_attention import flash_attention

# The name of the block selection inside a rematerialised layer: a remat policy that saves it (TextConfig
# remat_policy="save_selection") spares the backward's recompute the index scoring and the top-k.
SELECTION_NAME = "msa_selection"
INDEX_QUERY_AXES = ("activation_batch", "activation_length", "activation_kv_heads", None)  # q_idx [B, T, Hkv, d_idx]
INDEX_KEY_AXES = ("activation_batch", "activation_length", None)  # k_idx [B, S, d_idx]: one head, on every device


@dataclasses.dataclass(frozen=True)
class MSADims:
  """What an MSA layer reads of the model config: the dense attention's dims plus the index branch and the MSA
  training switches (TextConfig's index_* and msa_* fields)."""

  attention: AttentionDims
  index_heads: int  # one index-query head per GQA group: must equal attention.num_kv_heads
  index_dim: int
  block_size: int
  topk_blocks: int
  local_blocks: int
  warmup_steps: int = 0  # dense attention + dense KL target while step < warmup_steps
  detach_index_input: bool = True  # False only for the paper's ablation
  selection: str = "per_group"  # per_group (M3) | shared (one block set per query for all groups)
  impl: str = "xla"  # pallas_kernels.msa implementation: xla | reference | pallas
  index_fp8: bool = False  # select blocks from fp8 (e4m3) index q/k, one scale per vector
  metric_queries: int = 64  # queries sampled per step for the recall metrics
  metrics_every: int = 1  # recall metrics on step 0 and every N-th step (step + 1 divisible by N), NaN on the others

  def __post_init__(self):
    if self.metrics_every < 1:
      raise ValueError(f"msa_metrics_every={self.metrics_every}: expected >= 1 (1 = every step)")
    if self.selection not in ("per_group", "shared"):
      raise ValueError(f"msa_selection={self.selection!r}: expected 'per_group' or 'shared'")

  @classmethod
  def from_config(cls, cfg) -> "MSADims":
    return cls(attention=AttentionDims.from_config(cfg), index_heads=cfg.index_n_heads,
               index_dim=cfg.index_head_dim, block_size=cfg.index_block_size, topk_blocks=cfg.index_topk_blocks,
               local_blocks=cfg.index_local_blocks, warmup_steps=cfg.warmup_steps,
               detach_index_input=cfg.detach_index_input, selection=cfg.msa_selection, impl=cfg.msa_impl,
               index_fp8=cfg.msa_index_fp8, metric_queries=cfg.msa_metric_queries,
               metrics_every=cfg.msa_metrics_every)


def shared_index_queries(q_idx: jax.Array) -> jax.Array:
  """msa_selection="shared": every group's index query becomes sum_h q_idx_h (see MSAAttention._index_queries).
  q_idx: [B, T, Hkv, d_idx] -> [B, T, Hkv, d_idx], equal along the head axis."""
  q_sum = jnp.sum(q_idx.astype(jnp.float32), axis=2, keepdims=True).astype(q_idx.dtype)  # [B, T, 1, d_idx]
  return jnp.broadcast_to(q_sum, q_idx.shape)  # [B, T, Hkv, d_idx]


@flax.struct.dataclass
class MSACache:
  """An MSA layer's decoding cache: the dense keys/values plus the index keys, filled together."""

  kv: KVCache
  k_idx: jax.Array  # [B, S_max, d_idx]

  @classmethod
  def empty(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, index_dim: int, *,
            dtype=jnp.float32) -> "MSACache":
    return cls(kv=KVCache.empty(batch, max_len, num_kv_heads, head_dim, dtype=dtype),
               k_idx=jnp.zeros((batch, max_len, index_dim), dtype))

  @property
  def length(self) -> jax.Array:
    return self.kv.length

  @property
  def max_len(self) -> int:
    return self.kv.max_len

  def update(self, k: jax.Array, v: jax.Array, k_idx: jax.Array) -> "MSACache":
    """Writes T new slots at `length`. k, v: [B, T, Hkv, D]; k_idx: [B, T, d_idx]."""
    new_idx = jax.lax.dynamic_update_slice(self.k_idx, k_idx.astype(self.k_idx.dtype), (0, self.length, 0))
    return self.replace(kv=self.kv.update(k, v), k_idx=new_idx)


class Indexer(nnx.Module):
  """q_proj: [d_model, Hkv, d_idx] (one index-query head per GQA group); k_proj: [d_model, d_idx] (ONE key head)."""

  def __init__(self, dims: MSADims, *, rngs: nnx.Rngs, std: float, param_dtype, dtype):
    a = dims.attention
    d, hi, di = a.d_model, dims.index_heads, dims.index_dim
    self.rotary_dim, self.theta, self.dtype = a.rotary_dim, a.rope_theta, dtype
    self.q_proj = param(rngs, (d, hi, di), ("embed", "index_heads", "index_dim"), std=std, dtype=param_dtype)
    self.k_proj = param(rngs, (d, di), ("embed", "index_dim"), std=std, dtype=param_dtype)
    self.q_norm = RMSNorm(di, eps=a.eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(di, eps=a.eps, param_dtype=param_dtype)

  @staticmethod
  def param_count(dims: MSADims) -> int:
    """q_proj, k_proj and the two norms."""
    d, hi, di = dims.attention.d_model, dims.index_heads, dims.index_dim
    return d * hi * di + d * di + 2 * di

  def __call__(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [B, T, d] -> q_idx [B, T, Hkv, d_idx], k_idx [B, T, d_idx]."""
    qi = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(self.dtype))  # [B, T, Hkv, d_idx]
    ki = jnp.einsum("btd,dk->btk", x, self.k_proj[...].astype(self.dtype))[:, :, None]  # [B, T, 1, d_idx]
    qi = apply_rope(self.q_norm(qi), positions, rotary_dim=self.rotary_dim, theta=self.theta)
    ki = apply_rope(self.k_norm(ki), positions, rotary_dim=self.rotary_dim, theta=self.theta)
    return qi, ki[:, :, 0]


class MSAAttention(Attention):
  """Same projections (and HF names) as dense attention, plus `indexer`."""

  def __init__(self, dims: MSADims, *, rngs: nnx.Rngs, std: float = 0.02, param_dtype=jnp.float32,
               dtype=jnp.float32):
    super().__init__(dims.attention, rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype)
    a = dims.attention
    if dims.index_heads != a.num_kv_heads:
      raise ValueError(f"MSADims: index_heads={dims.index_heads} (TextConfig.index_n_heads) must equal "
                       f"num_kv_heads={a.num_kv_heads} (num_key_value_heads): MSA selects per GQA group")
    if dims.index_dim < a.rotary_dim:
      raise ValueError(f"MSADims: index_dim={dims.index_dim} (TextConfig.index_head_dim) < rotary_dim="
                       f"{a.rotary_dim}; the index branch applies the main branch's partial RoPE and needs at least "
                       "rotary_dim channels")
    self.msa = dims
    self.indexer = Indexer(dims, rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype)

  @classmethod
  def dims_from_config(cls, cfg) -> MSADims:
    return MSADims.from_config(cfg)

  @classmethod
  def param_count(cls, dims: MSADims) -> int:
    return Attention.param_count(dims.attention) + Indexer.param_count(dims)

  @classmethod
  def score_flops_per_token(cls, dims: MSADims, seq_len: int) -> float:
    """Only the selected keys (at most topk * block of the T / 2 causal ones on average) plus the index scoring of
    every causal key by each index head."""
    a = dims.attention
    keys = min(seq_len / 2, dims.topk_blocks * dims.block_size)
    scored_heads = 1 if dims.selection == "shared" else dims.index_heads  # shared scores one summed index query
    return 6 * 2 * keys * a.num_heads * a.head_dim + 6 * seq_len / 2 * scored_heads * dims.index_dim

  def init_cache(self, batch: int, max_len: int, dtype) -> MSACache:
    a = self.dims
    return MSACache.empty(batch, max_len, a.num_kv_heads, a.head_dim, self.msa.index_dim, dtype=dtype)

  def _index_queries(self, q_idx: jax.Array) -> jax.Array:
    """The index queries that select and that the KL trains, [B, T, Hkv, d_idx].

    per_group: the heads' own. shared: every group gets q_sum = sum_h q_idx_h, so the one shared score is
    sum_h q_idx_h . k_idx (the index scores summed over the index heads; the block score is its max-pool, as
    per group). The KL kernels then compute mean_g KL(P_g || Q) with one student Q for all groups; its gradient
    w.r.t. q_sum sums the groups' (Q - P_g) / Hkv terms into Q - mean_g P_g, which is the gradient of
    KL(P_all || Q) with P_all the mean attention of all Hq query heads: the shared indexer's target. The logged
    value exceeds KL(P_all || Q) by mean_g KL(P_g || P_all), a term the index branch cannot change; it is the
    per-group arm's quantity (each group's teacher against the student that group reads), so the arms compare.
    """
    return q_idx if self.msa.selection == "per_group" else shared_index_queries(q_idx)

  def _select(self, q_idx: jax.Array, k_idx: jax.Array, ops: dict, seg: dict) -> jax.Array:
    """block_idx [B, Hkv, T, topk] (-1: no block) from the index branch, optionally scored in fp8 (selection only;
    the KL trains the full-precision index branch). q_idx: from `_index_queries`."""
    shared = self.msa.selection == "shared"
    # shared: the groups' queries are one vector, scored once (a single index head) and the set broadcast.
    sel_q, sel_k, sel_kw = (q_idx[:, :, :1] if shared else q_idx), k_idx, {}
    if self.msa.index_fp8:
      sel_q, _ = msa_ops.quantize_index(sel_q)
      sel_k, sel_kw["k_idx_scale"] = msa_ops.quantize_index(k_idx)
    block_idx = msa_ops.select_blocks(sel_q, sel_k, topk=self.msa.topk_blocks, local_blocks=self.msa.local_blocks,
                                      **ops, **seg, **sel_kw)
    block_idx = checkpoint_name(block_idx, SELECTION_NAME)  # [B, 1 | Hkv, T, topk]
    return jnp.broadcast_to(block_idx, block_idx.shape[:1] + (q_idx.shape[2],) + block_idx.shape[2:])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, *,
               cache: MSACache | None = None, capture: bool | str = False, step_state: Any = None):
    """x: [B, T, d]. Returns (y [B, T, d], aux) with aux: kl_loss, metrics (training), cache (decoding),
    block_idx (capture) and attention_probs (capture=True, not "selection")."""
    msa = self.msa
    q, k, v = self.project(x, positions)
    if not self.document_mask:
      segment_ids = None
    q_idx, k_idx = self.indexer(jax.lax.stop_gradient(x) if msa.detach_index_input else x, positions)
    q_idx = self._index_queries(q_idx)
    if context.shards() > 1:
      self._check_context_parallel(cache, capture)
      out, aux = self._attend_context_parallel(q, k, v, q_idx, k_idx, segment_ids, step_state)
      return self.output(out.astype(self.dtype)), aux
    aux: dict[str, Any] = {}
    q_offset = None
    if cache is not None:
      q_offset = cache.length
      cache = cache.update(k, v, k_idx)
      k, v, k_idx, aux["cache"] = cache.kv.k, cache.kv.v, cache.k_idx, cache
      segment_ids = None

    def dense(q, k, v, q_offset, segment_ids):
      return dense_attention(q, k, v, impl=self.impl, q_offset=q_offset, segment_ids=segment_ids)

    out, more = self._attend(q, k, v, q_idx, k_idx, segment_ids, q_offset, step_state, capture, dense)
    aux.update(more)
    return self.output(out.astype(self.dtype)), aux

  def _attend_context_parallel(self, q, k, v, q_idx, k_idx, segment_ids, step_state):
    """`_attend` with the sequence split over `context` (models/attention/context.py): index keys, K, V and the
    segment ids gathered, selection, sparse attention and KL per device over its own queries."""
    keys = {"k": (k, KV_AXES), "v": (v, KV_AXES), "k_idx": (k_idx, INDEX_KEY_AXES)}
    if segment_ids is not None:
      keys["segment_ids"] = (segment_ids, TOKEN_AXES)
    queries = {"q": (q, Q_AXES), "q_idx": (q_idx, INDEX_QUERY_AXES)}

    def dense(q, k, v, q_offset, segment_ids):
      return flash_attention(q, k, v, q_offset=q_offset, segment_ids=segment_ids)

    def core(qs, ks, q_offset, step):
      out, aux = self._attend(qs["q"], ks["k"], ks["v"], qs["q_idx"], ks["k_idx"], ks.get("segment_ids"), q_offset,
                              None if step is None else {"step": step}, False, dense)
      return out, aux

    step = None if step_state is None else step_state["step"]
    return context.context_parallel(core, queries, keys, Q_AXES, step)

  def _attend(self, q, k, v, q_idx, k_idx, segment_ids, q_offset, step_state, capture: bool | str, dense):
    """The attention of queries q [B, T, Hq, D] at slots q_offset + t (None: S - T) over keys k, v [B, S, Hkv, D]
    with index queries / keys q_idx [B, T, Hkv, d_idx], k_idx [B, S, d_idx] and key segment ids [B, S] (or None).
    `dense(q, k, v, q_offset, segment_ids)` is the warmup's dense attention. Returns (out [B, T, Hq, D], aux)."""
    msa = self.msa
    aux: dict[str, Any] = {}
    ops = dict(block_size=msa.block_size, q_offset=q_offset, implementation=msa.impl)
    seg = {} if segment_ids is None else {"segment_ids": segment_ids}
    block_idx = self._select(q_idx, k_idx, ops, seg)  # [B, Hkv, T, topk]
    training = step_state is not None
    in_warmup = training and msa.warmup_steps > 0
    # On the Pallas kernels the KL reuses the attention forward's log-sum-exp (LSE fusion): a training step then
    # does no dense work besides the index scoring inside select_blocks.
    fuse_lse = msa.impl == "pallas" and training and not in_warmup and not capture
    lse = None

    def sparse():
      return msa_ops.sparse_attention(q, k, v, block_idx, **ops, **seg)

    if capture:  # analysis: the probabilities the sparse branch actually uses, and the selection itself
      out = sparse()
      if captures_probs(capture):
        aux["attention_probs"] = selected_probs(q, k, block_idx, block_size=msa.block_size, q_offset=q_offset,
                                                segment_ids=segment_ids)
      aux["block_idx"] = block_idx
    elif in_warmup:
      out = jax.lax.cond(step_state["step"] < msa.warmup_steps, lambda: dense(q, k, v, q_offset, segment_ids),
                         sparse)
    elif fuse_lse:
      out, lse = msa_ops.sparse_attention_with_lse(q, k, v, block_idx, block_size=msa.block_size,
                                                   q_offset=q_offset, **seg)
    else:
      out = sparse()
    if training:
      aux.update(self._kl_and_metrics(q, k, q_idx, k_idx, block_idx, ops, seg, lse, q_offset, segment_ids,
                                      step_state["step"], in_warmup))
    return out, aux

  def _kl_and_metrics(self, q, k, q_idx, k_idx, block_idx, ops, seg, lse, q_offset, segment_ids, step,
                      in_warmup: bool) -> dict[str, Any]:
    """The index branch's KL loss (dense target during warmup) and the selection's recall metrics."""
    msa = self.msa

    def kl_of(idx):
      return msa_ops.kl_loss(q, k, q_idx, k_idx, idx, **ops, **seg, lse=lse)

    if in_warmup:
      kl = jax.lax.cond(step < msa.warmup_steps, lambda: kl_of(None), lambda: kl_of(block_idx))
    else:
      kl = kl_of(block_idx)

    def diagnostics():
      return block_metrics(q, k, block_idx, block_size=msa.block_size,
                           q_offset=k.shape[1] - q.shape[1] if q_offset is None else q_offset,
                           segment_ids=segment_ids, num_queries=msa.metric_queries,
                           key=jax.random.fold_in(jax.random.key(0), step), local_blocks=msa.local_blocks)

    if msa.metrics_every == 1:
      metrics = diagnostics()
    else:
      # The trainer logs the metrics of steps whose count after the update (step + 1) is a multiple of its
      # log_every, and of the first step: with N dividing log_every those are exactly the steps computed here.
      due = (step == 0) | ((step + 1) % msa.metrics_every == 0)
      # Both branches take a zero from each input: inside context parallelism's shard_map their outputs must vary
      # over the same mesh axes, and a metric that is a constant (group_jaccard with one KV group) varies over none.
      zero = jax.lax.stop_gradient(sum(jnp.zeros_like(a.reshape(-1)[0], jnp.float32) for a in (q, k, block_idx)))
      varying = lambda tree: jax.tree.map(lambda m: m + zero.astype(m.dtype), tree)  # noqa: E731
      skipped = varying(jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(diagnostics)))
      metrics = jax.lax.cond(due, lambda: varying(diagnostics()), lambda: skipped)
    return {"kl_loss": kl, "metrics": {"kl": kl, **metrics}}
