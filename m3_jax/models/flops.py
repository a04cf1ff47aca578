"""Closed-form parameter and FLOP counts of the text tower and the vision tower (the MFU numerators, the AOT
report's model size).

Each attention class counts its own parameters and score FLOPs (`param_count(dims)`, `score_flops_per_token(dims,
seq_len)`, models/attention/); the sums here go through the layer-type registry, so a new attention variant needs
no edit in this file.
"""

from __future__ import annotations

from m3_jax.models.attention import attention_class
from m3_jax.models.config import MLP_DENSE, TextConfig, VLConfig


def _attention_counts(cfg: TextConfig, seq_len: int | None):
  """Per layer: (attention parameters, attention score FLOPs per trained token or None without seq_len)."""
  for lt in cfg.layer_types:
    cls = attention_class(lt)
    dims = cls.dims_from_config(cfg)
    yield cls.param_count(dims), None if seq_len is None else cls.score_flops_per_token(dims, seq_len)


def param_count(cfg: TextConfig) -> dict[str, int]:
  """Closed-form parameter counts: total, and active per token (routed experts counted top-k times)."""
  d = cfg.hidden_size
  total = active = 2 * cfg.vocab_size * d + d  # embed + lm_head + final norm
  for (attn, _), mt in zip(_attention_counts(cfg, None), cfg.mlp_layer_types):
    a = attn + d * 2  # + the layer's two RMSNorms
    total += a
    active += a
    if mt == MLP_DENSE:
      m = 3 * d * cfg.dense_intermediate_size
      total += m
      active += m
    else:
      expert = 3 * d * cfg.intermediate_size
      shared = 3 * d * cfg.shared_intermediate_size
      router = d * cfg.num_local_experts + cfg.num_local_experts
      total += cfg.num_local_experts * expert + shared + router
      active += cfg.num_experts_per_tok * expert + shared + router
  return {"total": total, "active": active}


def train_flops_per_token(cfg: TextConfig, seq_len: int) -> float:
  """Model FLOPs per trained token (fwd + bwd = 3x fwd), the MFU numerator.

  Matmul parameters count 6 FLOPs per token (embedding lookups excluded); each layer's attention adds its score
  FLOPs: 6 * 2 * T * Hq * D / 2 for causal dense attention (QK^T and PV, halved by the causal mask), as in the PaLM
  appendix; MSA layers count only their selected tokens (min(T / 2, topk * block)) plus the index scoring.
  """
  counts = param_count(cfg)
  matmul_params = counts["active"] - cfg.vocab_size * cfg.hidden_size  # embedding is a gather, not a matmul
  flops = 6.0 * matmul_params
  for _, score_flops in _attention_counts(cfg, seq_len):
    flops += score_flops
  return flops


def vision_flops(cfg: VLConfig, frames: int, height: int, width: int, max_frames: int | None = None) -> float:
  """Forward FLOPs (2 per multiply-add) of the vision tower + projector on one item, in closed form.

  Counts what the tower computes: matmuls over every patch slot, including the padded slots of a last, shorter
  segment, and attention scores + weighted values over each segment (4 * S^2 * hidden per segment of S
  patches: the part that grows with max_frames). Elementwise work (norms, GELU, softmax, RoPE) is left out.
  """
  v = cfg.vision
  t, gh, gw = frames // v.temporal_patch_size, height // v.patch_size, width // v.patch_size
  mf = min(int(v.max_frames if max_frames is None else max_frames), t)
  n_seg = -(-t // mf)
  seg = mf * gh * gw  # patches per segment
  slots = n_seg * seg  # patch slots computed per layer
  patches = t * gh * gw
  d, inter, pj, dt = v.hidden_size, v.intermediate_size, cfg.projector_hidden_size, cfg.text.hidden_size
  m2 = v.spatial_merge_size ** 2
  embed = 2.0 * patches * v.patch_dim * d
  per_layer = 2.0 * slots * (4 * d * d + 2 * d * inter) + 4.0 * n_seg * seg * seg * d
  projector = 2.0 * patches * (d * pj + pj * dt) + 2.0 * (patches // m2) * (m2 * dt * pj + pj * dt)
  return embed + v.num_hidden_layers * per_layer + projector
