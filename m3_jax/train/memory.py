"""A closed-form model of one device's bytes during a training step, as a function of sequence length and mesh.

The AOT report (train/aot.py) prints it beside XLA's compiled memory analysis, so the model is checked on every
compile; `longest_sequence` inverts it (how long a sequence fits per device count, before compiling anything).
State (parameters, AdamW moments, gradients) is counted exactly from the shardings; activations are modelled for
the layouts we train long contexts with: `remat=True` (every layer's input saved, one layer recomputed at a time in
the backward), bf16 or f32 compute, context parallelism over `context`.

Terms (per device; n = local tokens = batch x T / (batch axes x context), S = T, tp = tensor, dt = compute bytes):
  state              params + moments (exact), + one f32 gradient the size of the params
  layer_inputs       L x n x d x dt                  the saved residual stream, one copy per layer (full remat)
  layer_work         one layer recomputed and differentiated: n x (per-token widths of q, k, v, attention out,
                     the MLP's hidden (f32 gate/up products), the MoE's slots; with moe_chunk_tokens the slots of
                     one chunk) x (dt + 4): each value and its f32 gradient, the largest layer type counted
  gathered_kv        context > 1: the all-gathered keys of one layer, S x (2 Hkv / tp x D + index dim) x (dt + 4)
                     (values and the f32 gradients that are reduce-scattered back)
  logits             loss_chunk (or n) x V / tp x 4 x 3: f32 logits, their softmax and gradient
  weight_gather      FSDP: one layer's weights gathered in dt, twice (forward and the backward's recompute)
"""

from __future__ import annotations

import numpy as np

from m3_jax.models.attention import attention_class
from m3_jax.models.attention.msa import MSAAttention
from m3_jax.models.config import MLP_DENSE, TextConfig
from m3_jax.models.flops import param_count

GIB = 2**30


def _itemsize(dtype: str) -> int:
  return np.dtype(dtype).itemsize


def activation_bytes(cfg: TextConfig, mesh_shape: dict, batch: int, seq_len: int, loss_chunk: int = 0) -> dict:
  """The modelled activation terms (module docstring) in bytes per device."""
  ctx = int(mesh_shape.get("context", 1))
  tp = int(mesh_shape.get("tensor", 1))
  ep = int(mesh_shape.get("expert", 1))
  batch_axes = int(mesh_shape.get("data", 1)) * int(mesh_shape.get("fsdp", 1)) * ep
  n = batch * seq_len / (batch_axes * ctx)
  dt, d, hd = _itemsize(cfg.dtype), cfg.hidden_size, cfg.head_dim
  hq, hkv = cfg.num_attention_heads / tp, max(cfg.num_key_value_heads / tp, 1)
  grad = dt + 4  # a value in the compute dtype and its f32 gradient
  attn = (2 * hq + 2 * hkv) * hd  # q, out, k, v per token
  msa = any(issubclass(attention_class(lt), MSAAttention) for lt in cfg.layer_types)
  if msa:
    attn += (hkv + 1) * cfg.index_head_dim  # index queries (one head per group) and the index key
  mlp_dense = 3 * cfg.dense_intermediate_size / tp  # gate, up (f32 products) and the hidden
  k, e = cfg.num_experts_per_tok, cfg.num_local_experts
  # expert parallel: a send, a receive and a return buffer of min(k, E / ep) slots per token and shard, for the
  # tokens of one exchange (moe_chunk_tokens of them at a time when set: the chunks are rematerialised)
  slots = k if cfg.moe_impl != "expert_parallel" else 3 * ep * min(k, e // ep)
  moe_rows = min(n, cfg.moe_chunk_tokens) if cfg.moe_impl == "expert_parallel" and cfg.moe_chunk_tokens else n
  moe = moe_rows * slots * (d + 3 * cfg.intermediate_size / tp) + n * 3 * cfg.shared_intermediate_size / tp
  has_moe = any(t != MLP_DENSE for t in cfg.mlp_layer_types)
  mlp = max(n * mlp_dense, moe if has_moe else 0)
  terms = {
      "layer_inputs": cfg.num_hidden_layers * n * d * dt,
      "layer_work": (n * (attn + 4 * d) + mlp) * grad,  # + norms and the residual adds
      "gathered_kv": 0.0 if ctx == 1 else seq_len * (2 * hkv * hd + (cfg.index_head_dim if msa else 0)) * grad,
      "logits": (loss_chunk or n) * (cfg.vocab_size / tp) * 4 * 3,
  }
  counts = param_count(cfg)
  fsdp = int(mesh_shape.get("fsdp", 1)) * ctx
  per_layer = (counts["total"] - 2 * cfg.vocab_size * d) / cfg.num_hidden_layers
  terms["weight_gather"] = 0.0 if fsdp == 1 else 2 * per_layer / (tp * ep) * dt
  return terms


def model_bytes(cfg: TextConfig, mesh_shape: dict, batch: int, seq_len: int, state_bytes: float,
                param_bytes: float, loss_chunk: int = 0) -> dict:
  """All terms, with state = params + optimizer (exact, from the shardings) + an f32 gradient of the params."""
  terms = {"state": state_bytes + param_bytes, **activation_bytes(cfg, mesh_shape, batch, seq_len, loss_chunk)}
  terms["total"] = sum(terms.values())
  return terms


def longest_sequence(cfg: TextConfig, mesh_shape: dict, batch: int, state_bytes: float, param_bytes: float,
                     budget: float, loss_chunk: int = 0, multiple: int = 1) -> int:
  """The longest T (a multiple of `multiple`) whose modelled total fits `budget` bytes (0 if none does)."""
  def fits(units):  # T = units x multiple
    t = units * multiple
    return model_bytes(cfg, mesh_shape, batch, t, state_bytes, param_bytes, loss_chunk)["total"] <= budget

  if not fits(1):
    return 0
  lo, hi = 1, 2  # fits(lo), and hi doubles until it does not (the modelled bytes grow with T)
  while fits(hi):
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
  return lo * multiple


def fmt(terms: dict) -> str:
  return ", ".join(f"{k} {v / GIB:,.2f}" for k, v in terms.items() if k != "total") + \
      f" -> {terms['total'] / GIB:,.2f} GiB"

