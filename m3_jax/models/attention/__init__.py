"""Attention of the M3 text tower: a registry from layer type (TextConfig.layer_types, HF's names) to class.

    core.py             the one masked-softmax core (masks, softmax, weighted sum)
    dense.py            AttentionDims, KVCache, Attention (`full_attention`), the xla / cuDNN dispatch
    msa.py              MSADims, MSACache, Indexer, MSAAttention (`minimax_m3_sparse`)
    msa_diagnostics.py  MSA's recall metrics and materialised probabilities (analysis only)

A new attention variant is one file with its class plus one line in `ATTENTION`. The class keeps the contract of
`dense.Attention` (subclassing it gives all of it): `dims_from_config(cfg)` reads the TextConfig into its own frozen
dims dataclass; `__init__(dims, *, rngs, std, param_dtype, dtype)`; `__call__(x, positions, segment_ids, *, cache,
capture, step_state) -> (y, aux)`; `init_cache(batch, max_len, dtype)` its decoding cache (models/decode.py);
`param_count(dims)` and `score_flops_per_token(dims, seq_len)`, which models/flops.py sums over the layers.
Nothing here imports models/config.py (config.py reads `LAYER_TYPES` from here to validate).
"""

from __future__ import annotations

from flax import nnx

from m3_jax.models.attention.dense import Attention
from m3_jax.models.attention.msa import MSAAttention

ATTENTION: dict[str, type[Attention]] = {
    "full_attention": Attention,
    "minimax_m3_sparse": MSAAttention,
}
LAYER_TYPES = tuple(ATTENTION)


def attention_class(layer_type: str) -> type[Attention]:
  """The class registered for `layer_type` (raises ValueError naming the known types)."""
  if layer_type not in ATTENTION:
    raise ValueError(f"attention layer type {layer_type!r}; expected one of {LAYER_TYPES}")
  return ATTENTION[layer_type]


def make_attention(cfg, layer_type: str, *, rngs: nnx.Rngs, std: float, param_dtype, dtype) -> Attention:
  """One layer's attention, built from a TextConfig `cfg` (read through the class's `dims_from_config`)."""
  cls = attention_class(layer_type)
  return cls(cls.dims_from_config(cfg), rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype)
