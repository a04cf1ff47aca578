"""A closed-form model of one device's bytes during a training step, as a function of sequence length and mesh.

The AOT report (train/aot.py) prints it beside XLA's compiled memory analysis, so the model is checked on every
compile; `longest_sequence` inverts it (how long a sequence fits per device count, before compiling anything).
State (parameters, AdamW moments, gradients) is counted exactly from the shardings; activations are modelled for
the layouts we train long contexts with: `remat=True` (every layer's input saved, one layer recomputed at a time in
the backward), bf16 or f32 compute, context parallelism over `context`. The terms were read off XLA's buffer
assignment (`--xla_dump_to`: the memory-usage report) of small_msa and M3 at 128K-1M tokens.

Per device; n = local tokens = batch x T / (batch axes x context), S = T, tp = tensor, dt = compute bytes. Always
live in the backward:
  state              params + moments (exact), + one f32 gradient the size of the params
  layer_inputs       L x n x d x dt                  the saved residual stream, one copy per layer (full remat)
  weight_gather      FSDP (and context): one layer's weights gathered in dt, twice (forward and recompute)
and the largest of three phases, which are not live at the same time:
  attention          one attention layer recomputed and differentiated: n x (q, k, v, out, index q/k widths) x
                     (dt + 4), each value and its f32 gradient; plus what scales with the whole sequence
                     (`whole_sequence`): MSA's recall diagnostics, msa_metric_queries x Hq / tp x S x 4 B x 3
                     (scores, probabilities and masks of the sampled queries against every key), and with
                     context > 1 the gathered keys, S x 2 Hkv / tp x D x (2 dt + 8) (K and V, their block-major
                     copies, f32 upcasts and f32 gradients before the reduce-scatter) and the MSA index key
                     S x d_idx x (dt + 8)
  mlp                one MLP recomputed and differentiated: n x (gate, up (f32 products), hidden) x (dt + 4); the
                     MoE's slots (with moe_chunk_tokens those of one chunk)
  logits             loss_chunk (or n) x V / tp x 4 x 3: f32 logits, their softmax and gradient
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
  """The modelled activation terms (module docstring) in bytes per device; `whole_sequence` is the part of
  `attention` that scales with the whole sequence (S), not with the device's share of it (n)."""
  ctx = int(mesh_shape.get("context", 1))
  tp = int(mesh_shape.get("tensor", 1))
  ep = int(mesh_shape.get("expert", 1))
  batch_axes = int(mesh_shape.get("data", 1)) * int(mesh_shape.get("fsdp", 1)) * ep
  n = batch * seq_len / (batch_axes * ctx)
  dt, d, hd = _itemsize(cfg.dtype), cfg.hidden_size, cfg.head_dim
  hq, hkv = cfg.num_attention_heads / tp, max(cfg.num_key_value_heads / tp, 1)
  grad = dt + 4  # a value in the compute dtype and its f32 gradient
  attn = (2 * hq + 2 * hkv) * hd + 4 * d  # q, out, k, v per token, + norms and the residual adds
  msa = any(issubclass(attention_class(lt), MSAAttention) for lt in cfg.layer_types)
  if msa:
    attn += (hkv + 1) * cfg.index_head_dim  # index queries (one head per group) and the index key
  s_keys = batch / batch_axes * seq_len  # keys of this device's rows: their whole sequences
  # MSA's recall diagnostics, compiled into every step (a cond picks the steps they run on)
  whole = cfg.msa_metric_queries * hq * s_keys * 4 * 3 if msa else 0.0
  if ctx > 1:  # the gathered keys
    whole += s_keys * 2 * hkv * hd * (2 * dt + 8) + (s_keys * cfg.index_head_dim * (dt + 8) if msa else 0.0)
  mlp_dense = 3 * cfg.dense_intermediate_size / tp  # gate, up (f32 products) and the hidden
  k, e = cfg.num_experts_per_tok, cfg.num_local_experts
  # expert parallel: a send, a receive and a return buffer of min(k, E / ep) slots per token and shard, for the
  # tokens of one exchange (moe_chunk_tokens of them at a time when set: the chunks are rematerialised)
  slots = k if cfg.moe_impl != "expert_parallel" else 3 * ep * min(k, e // ep)
  moe_rows = min(n, cfg.moe_chunk_tokens) if cfg.moe_impl == "expert_parallel" and cfg.moe_chunk_tokens else n
  moe = moe_rows * slots * (d + 3 * cfg.intermediate_size / tp) + n * 3 * cfg.shared_intermediate_size / tp
  has_moe = any(t != MLP_DENSE for t in cfg.mlp_layer_types)
  counts = param_count(cfg)
  fsdp = int(mesh_shape.get("fsdp", 1)) * ctx
  per_layer = (counts["total"] - 2 * cfg.vocab_size * d) / cfg.num_hidden_layers
  return {
      "layer_inputs": cfg.num_hidden_layers * n * d * dt,
      "weight_gather": 0.0 if fsdp == 1 else 2 * per_layer / (tp * ep) * dt,
      "attention": n * attn * grad + whole,
      "whole_sequence": whole,
      "mlp": max(n * mlp_dense, moe if has_moe else 0) * grad,
      "logits": (loss_chunk or n) * (cfg.vocab_size / tp) * 4 * 3,
  }


PHASES = ("attention", "mlp", "logits")


def model_bytes(cfg: TextConfig, mesh_shape: dict, batch: int, seq_len: int, state_bytes: float,
                param_bytes: float, loss_chunk: int = 0) -> dict:
  """All terms, with state = params + optimizer (exact, from the shardings) + an f32 gradient of the params, and
  total = state + layer_inputs + weight_gather + the largest phase."""
  terms = {"state": state_bytes + param_bytes, **activation_bytes(cfg, mesh_shape, batch, seq_len, loss_chunk)}
  terms["total"] = (terms["state"] + terms["layer_inputs"] + terms["weight_gather"]
                    + max(terms[p] for p in PHASES))
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
  peak = max(PHASES, key=lambda p: terms[p])
  phases = ", ".join(f"{p} {terms[p] / GIB:,.2f}" + (f" (whole sequence {terms['whole_sequence'] / GIB:,.2f})"
                                                       if p == "attention" and terms["whole_sequence"] else "")
                     for p in PHASES)
  return (f"state {terms['state'] / GIB:,.2f}, layer_inputs {terms['layer_inputs'] / GIB:,.2f}, weight_gather "
          f"{terms['weight_gather'] / GIB:,.2f}, + the largest phase of [{phases}]: {peak} -> "
          f"{terms['total'] / GIB:,.2f} GiB")
