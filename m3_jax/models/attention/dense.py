"""Dense GQA self-attention of the M3 text tower (`full_attention` layers), its KV cache, and the dense attention
dispatch (`attention_impl`: xla, cuDNN, or cuDNN on packed documents).

Per-head Gemma RMSNorm on q and k, partial NeoX RoPE, grouped-query attention with causal and segment (packing)
masks. MSA layers (msa.py) reuse this projection path and swap the core.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.core.sharding import constrain
from m3_jax.models.attention import context
from m3_jax.models.attention.core import causal_mask, masked_attention
from m3_jax.models.layers import RMSNorm, apply_rope, param
from pallas_kernels.flash_attention import flash_attention

# cudnn_packed: cuDNN with packed documents on its offsets layout (`packed_cudnn_attention`); checked on an H100
# against the f32 reference (experiments/check_packed_attention.py, 2026-12-07), the GPU configs' default. `cudnn`
# keeps the boolean-mask route (6.4x slower at 32K) for comparison.
ATTENTION_IMPLS = ("xla", "cudnn", "cudnn_packed")
# Logical axes of the attention activations (core/sharding.py maps them to the mesh).
Q_AXES = ("activation_batch", "activation_length", "activation_heads", None)  # q, out [B, T, Hq, D]
KV_AXES = ("activation_batch", "activation_length", "activation_kv_heads", None)  # k, v [B, S, Hkv, D]
TOKEN_AXES = ("activation_batch", "activation_length")  # segment ids [B, T]
# capture="selection" returns the MSA layers' block selections only: dense layers keep their flash / cuDNN path,
# where capture=True materialises every layer's [B, Hq, T, S] probabilities (terabytes at a 64K prompt).
CAPTURE_SELECTION = "selection"
CAPTURES = (False, True, CAPTURE_SELECTION)


def captures_probs(capture) -> bool:
  """Whether a `capture` value (False, True or CAPTURE_SELECTION) asks for attention probabilities."""
  return bool(capture) and capture != CAPTURE_SELECTION


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "xla", q_offset: int | None = None,
                    segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
                    return_probs: bool = False):
  """Causal GQA attention. q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; query t sits at slot q_offset + t
  (default S - T). Returns out [B, T, Hq, D] (and probs [B, Hq, T, S] f32 if return_probs, xla only)."""
  t, s = q.shape[1], k.shape[1]
  if q_offset is not None and t > 1 and segment_ids is None and kv_segment_ids is None and not return_probs:
    # A prefill chunk against a fixed-size cache: the masked path's scores would be [B, Hq, T, S] f32 (8 rows x 8
    # heads x 4096 x 64K = 64 GiB); the blockwise XLA kernel holds one block pair at a time and skips the cache's
    # unwritten future blocks.
    return flash_attention(q, k, v, q_offset=q_offset, implementation="xla")
  # Decoding passes a traced q_offset over a fixed-size cache: that path stays on XLA (cuDNN's causal mode assumes
  # the queries are the last T of S keys).
  use_cudnn = impl in ("cudnn", "cudnn_packed") and not return_probs and q_offset is None
  q_offset = s - t if q_offset is None else q_offset
  kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  q_pos = q_offset + jnp.arange(t)
  k_pos = jnp.arange(s)
  if use_cudnn:
    if impl == "cudnn_packed" and segment_ids is not None and t == s and kv_segment_ids is segment_ids:
      return packed_cudnn_attention(q, k, v, segment_ids)
    mask = None
    if segment_ids is not None or t != s:
      mask = causal_mask(q_pos, k_pos, segment_ids, kv_segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None, implementation="cudnn")
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention impl {impl!r}; expected one of {ATTENTION_IMPLS}")
  return masked_attention(q, k, v, causal_mask(q_pos, k_pos, segment_ids, kv_segment_ids),
                          return_probs=return_probs)


def segment_runs(segment_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The packed row as runs of equal segment ids (padding, id 0, is a run too, so every token belongs to one):
  segment_ids int [B, T] -> (lengths [B, M], offsets [B, M + 1], runs [B]) with M = max_runs, -1 past the row's
  `runs` (cuDNN's packed-layout convention). For a row with more than M runs only `runs` is meaningful (the caller
  checks it)."""
  T = segment_ids.shape[1]
  new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  runs = jnp.sum(new, axis=1, dtype=jnp.int32)  # [B]
  starts = jax.vmap(lambda f: jnp.nonzero(f, size=max_runs, fill_value=T)[0])(new).astype(jnp.int32)  # [B, M]
  ends = jnp.concatenate([starts[:, 1:], jnp.full_like(starts[:, :1], T)], axis=1)
  live = jnp.arange(max_runs)[None, :] < runs[:, None]
  lengths = jnp.where(live, ends - starts, -1)
  offsets = jnp.where(jnp.arange(max_runs + 1)[None, :] < jnp.minimum(runs, max_runs)[:, None],
                      jnp.pad(starts, ((0, 0), (0, 1)), constant_values=T), -1)
  return lengths, offsets, runs


def packed_cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                           max_runs: int | None = None) -> jax.Array:
  """Causal attention inside each packed document on cuDNN's packed (ragged offsets) layout: q [B, T, Hq, D],
  k, v [B, T, Hkv, D], segment_ids [B, T] contiguous runs -> [B, T, Hq, D].

  The boolean-mask route turns the segment mask into a [B, 1, T, T] bias that cuDNN reads on every tile (2 GiB at
  32K in bf16; it took small_lm from 45% to 31% MFU); here cuDNN gets each document's offset and length and skips
  the blocks across documents. jax.nn.dot_product_attention does not expose the offsets, so this calls jax's cuDNN
  wrapper directly. Rows with more than `max_runs` runs (default T // 128, at least 16) take the blockwise XLA
  flash attention with segment ids instead (a lax.cond: both branches are compiled, the packed one runs whenever
  the row fits). The fallback is not the boolean-mask route because XLA assigns memory to both branches whether
  they run or not, and that route's [B, 1, T, T] bias (512 MiB at 16K in bf16) is quadratic in T. The XLA kernel
  needs memory for one block pair at a time and is slower than cuDNN, which matters only for rows with many short
  documents.
  """
  from jax._src.cudnn.fused_attention_stablehlo import MaskType  # noqa: PLC0415
  from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention  # noqa: PLC0415

  T = q.shape[1]
  M = max_runs or max(16, T // 128)
  lengths, offsets, runs = segment_runs(segment_ids, M)

  def packed():
    return cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
                           scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL)

  def blockwise():
    return flash_attention(q, k, v, segment_ids=segment_ids, implementation="xla")

  return jax.lax.cond(jnp.all(runs <= M), packed, blockwise)


@flax.struct.dataclass
class KVCache:
  """Keys and values of one layer in fixed-size buffers with a traced fill level, so one compiled prefill and one
  compiled decode step serve every position."""

  k: jax.Array  # [B, S_max, Hkv, D]
  v: jax.Array  # [B, S_max, Hkv, D]
  length: jax.Array  # int32 []: slots filled so far (the same for every row of the batch)

  @classmethod
  def empty(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *, dtype=jnp.float32) -> "KVCache":
    kv = jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype)
    return cls(k=kv, v=kv, length=jnp.zeros((), jnp.int32))

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

  def update(self, k: jax.Array, v: jax.Array) -> "KVCache":
    """Writes T new slots at `length`. k, v: [B, T, Hkv, D]."""
    at = (0, self.length, 0, 0)
    new_k = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), at)
    new_v = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), at)
    return self.replace(k=new_k, v=new_v, length=self.length + k.shape[1])


@dataclasses.dataclass(frozen=True)
class AttentionDims:
  """What dense attention reads of the model config: shapes, RoPE, norm epsilon and the implementation switches."""

  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int
  rope_theta: float
  eps: float
  impl: str = "xla"  # ATTENTION_IMPLS
  # False attends causally across a packed row (lets cuDNN skip the upper triangle instead of reading a mask).
  document_mask: bool = True

  @classmethod
  def from_config(cls, cfg) -> "AttentionDims":
    """The attention fields of a TextConfig (shared by dense and MSA layers)."""
    return cls(d_model=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
               head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_theta, eps=cfg.rms_norm_eps,
               impl=cfg.attention_impl, document_mask=cfg.document_mask)


class Attention(nnx.Module):
  """Dense GQA attention (`full_attention` layers). Weights are [in, heads, head_dim] for einsum and sharding;
  m3_jax/interop maps them to HF's [out, in] Linear layout.

  The contract every registered attention class keeps (models/attention/__init__.py): `dims_from_config(cfg)`,
  `__init__(dims, *, rngs, std, param_dtype, dtype)`, `__call__(x, positions, segment_ids, *, cache, capture,
  step_state) -> (y, aux)`, `init_cache(batch, max_len, dtype)`, and the closed-form counts `param_count(dims)` and
  `score_flops_per_token(dims, seq_len)` that models/flops.py sums.
  """

  def __init__(self, dims: AttentionDims, *, rngs: nnx.Rngs, std: float = 0.02, param_dtype=jnp.float32,
               dtype=jnp.float32):
    self.dims, self.impl, self.dtype = dims, dims.impl, dtype
    self.document_mask = dims.document_mask
    dm, hq, hkv, hd = dims.d_model, dims.num_heads, dims.num_kv_heads, dims.head_dim
    self.q_proj = param(rngs, (dm, hq, hd), ("embed", "q_heads", "head_dim"), std=std, dtype=param_dtype)
    self.k_proj = param(rngs, (dm, hkv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=param_dtype)
    self.v_proj = param(rngs, (dm, hkv, hd), ("embed", "kv_heads", "head_dim"), std=std, dtype=param_dtype)
    self.o_proj = param(rngs, (hq, hd, dm), ("q_heads", "head_dim", "embed"), std=std, dtype=param_dtype)
    self.q_norm = RMSNorm(hd, eps=dims.eps, param_dtype=param_dtype)
    self.k_norm = RMSNorm(hd, eps=dims.eps, param_dtype=param_dtype)

  @classmethod
  def dims_from_config(cls, cfg) -> AttentionDims:
    """The dims this class is built from, read from a TextConfig (the one place the config is read)."""
    return AttentionDims.from_config(cfg)

  @classmethod
  def param_count(cls, dims: AttentionDims) -> int:
    """Parameters of one layer's attention: q, k, v, o projections and the q/k norms."""
    d, hq, hkv, hd = dims.d_model, dims.num_heads, dims.num_kv_heads, dims.head_dim
    return d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 2 * hd

  @classmethod
  def score_flops_per_token(cls, dims: AttentionDims, seq_len: int) -> float:
    """Training FLOPs per token (fwd + bwd = 3x fwd) of QK^T and PV, the part not in 6 x parameters: causal
    attention reads T / 2 keys on average (as in the PaLM appendix)."""
    return 6 * 2 * (seq_len / 2) * dims.num_heads * dims.head_dim

  def init_cache(self, batch: int, max_len: int, dtype) -> KVCache:
    """An empty decoding cache for this layer."""
    return KVCache.empty(batch, max_len, self.dims.num_kv_heads, self.dims.head_dim, dtype=dtype)

  def project(self, x: jax.Array, positions: jax.Array):
    """x: [B, T, d_model] -> q [B, T, Hq, D], k, v [B, T, Hkv, D] with q/k norm and RoPE applied."""
    dims, dt = self.dims, self.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.q_proj[...].astype(dt))  # [B, T, Hq, D]
    k = jnp.einsum("btd,dhk->bthk", x, self.k_proj[...].astype(dt))  # [B, T, Hkv, D]
    v = jnp.einsum("btd,dhk->bthk", x, self.v_proj[...].astype(dt))  # [B, T, Hkv, D]
    q = apply_rope(self.q_norm(q), positions, rotary_dim=dims.rotary_dim, theta=dims.rope_theta)
    k = apply_rope(self.k_norm(k), positions, rotary_dim=dims.rotary_dim, theta=dims.rope_theta)
    q, k, v = constrain(q, Q_AXES), constrain(k, KV_AXES), constrain(v, KV_AXES)
    return q, k, v

  def _check_context_parallel(self, cache, capture: bool | str) -> None:
    if cache is not None or capture:
      raise ValueError(f"{type(self).__name__}: {'decoding' if cache is not None else 'capture_attention'} runs on a "
                       "mesh without context parallelism (mesh context=1); the sequence split over `context` is "
                       "for training and evaluation forwards")

  def _attend_context_parallel(self, q, k, v, segment_ids) -> jax.Array:
    """Causal attention of the whole sequence with T split over `context` (models/attention/context.py): K, V and
    the segment ids gathered, each device's two query chunks through the blockwise XLA flash attention (any
    backend, traced offsets, O(blocks) memory; cuDNN's fused kernel takes no query offset). -> [B, T, Hq, D]."""
    keys = {"k": (k, KV_AXES), "v": (v, KV_AXES)}
    if segment_ids is not None:
      keys["segment_ids"] = (segment_ids, TOKEN_AXES)

    def core(qs, ks, q_offset, _):
      return flash_attention(qs["q"], ks["k"], ks["v"], q_offset=q_offset, segment_ids=ks.get("segment_ids")), {}

    out, _ = context.context_parallel(core, {"q": (q, Q_AXES)}, keys, Q_AXES)
    return out

  def output(self, o: jax.Array) -> jax.Array:
    """o: [B, T, Hq, D] -> [B, T, d_model]."""
    return jnp.einsum("bthk,hkd->btd", o, self.o_proj[...].astype(self.dtype))

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None, *,
               cache: KVCache | None = None, capture: bool | str = False, step_state: Any = None):
    """x: [B, T, d_model]; positions: [B, T] (RoPE positions, restarting per packed document).
    step_state (the training step, read by MSA's warmup) is unused by dense attention.
    Returns (y [B, T, d_model], aux dict)."""
    del step_state
    q, k, v = self.project(x, positions)
    aux = {}
    q_offset = None
    if not self.document_mask:
      segment_ids = None
    if context.shards() > 1:
      self._check_context_parallel(cache, capture)
      return self.output(self._attend_context_parallel(q, k, v, segment_ids)), aux
    if cache is not None:  # decoding: attend over the whole buffer; unwritten slots lie in every query's future
      q_offset = cache.length
      cache = cache.update(k, v)
      k, v, aux["cache"] = cache.k, cache.v, cache
      segment_ids = None  # generation is one sequence per row
    probs = captures_probs(capture)
    res = dense_attention(q, k, v, impl=self.impl, q_offset=q_offset, segment_ids=segment_ids, return_probs=probs)
    if probs:
      res, aux["attention_probs"] = res
    return self.output(res), aux
