"""The M3 text tower: embeddings, decoder layers (dense or MSA attention x dense MLP or MoE), final norm, LM head.

`TextModel(cfg, rngs=...)(input_ids, positions, segment_ids)` returns `(logits [B, T, V] f32, aux)`, where aux holds
the auxiliary losses and metrics (`moe_aux_loss`, `expert_load`, MSA's `kl_loss` and per-layer metrics) and,
with `capture_attention=True`, per-layer attention probabilities for analysis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.core.sharding import constrain
from m3_jax.models.attention import make_attention
from m3_jax.models.attention.msa import SELECTION_NAME
from m3_jax.models.config import MLP_DENSE, TextConfig
from m3_jax.models.layers import DenseMLP, RMSNorm, param
from m3_jax.models.moe import MoE, MoEDims


# TextConfig.remat_policy -> jax.checkpoint policy (None: save nothing, recompute the whole layer).
_REMAT_POLICIES = {"full": None, "save_selection": jax.checkpoint_policies.save_only_these_names(SELECTION_NAME)}


def _dtype(name: str):
  return jnp.dtype(name)


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

  def __init__(self, cfg: TextConfig, layer_type: str, mlp_type: str, *, rngs: nnx.Rngs):
    pd, dt, std = _dtype(cfg.param_dtype), _dtype(cfg.dtype), cfg.initializer_range
    self.layer_type, self.mlp_type = layer_type, mlp_type
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.self_attn = make_attention(cfg, layer_type, rngs=rngs, std=std, param_dtype=pd, dtype=dt)
    if mlp_type == MLP_DENSE:
      self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size, alpha=cfg.swiglu_alpha,
                          limit=cfg.swiglu_limit, rngs=rngs, std=std, param_dtype=pd, dtype=dt)
    else:
      self.mlp = MoE(MoEDims.from_config(cfg), impl=cfg.moe_impl, rngs=rngs, std=std, param_dtype=pd, dtype=dt)

  def __call__(self, x, positions, segment_ids, mask, *, cache=None, capture=False, step_state=None):
    h, attn_aux = self.self_attn(self.input_layernorm(x), positions, segment_ids, cache=cache, capture=capture,
                                 step_state=step_state)
    x = x + h
    y = self.post_attention_layernorm(x)
    if self.mlp_type == MLP_DENSE:
      y, mlp_aux = self.mlp(y), {}
    else:
      y, mlp_aux = self.mlp(y, mask)
    x = constrain(x + y, ("activation_batch", "activation_length", "activation_embed"))
    return x, {**attn_aux, **mlp_aux}


class TextModel(nnx.Module):

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = _dtype(cfg.param_dtype)
    # Embedding std 1.0 would make the first residual stream dwarf the layers; 0.02 matches HF's initializer.
    self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                              std=cfg.initializer_range, dtype=pd)
    self.layers = nnx.List([DecoderLayer(cfg, lt, mt, rngs=rngs)
                            for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), std=cfg.initializer_range,
                         dtype=pd)

  def moe_layers(self) -> list[tuple[int, MoE]]:
    """[(layer index, its MoE)] in the order of the rows of aux["expert_load"]."""
    return [(i, layer.mlp) for i, layer in enumerate(self.layers) if layer.mlp_type != MLP_DENSE]

  def update_router_biases(self, expert_load: jax.Array, rate: float) -> None:
    """Aux-loss-free balancing of every MoE layer (in place) from a forward's aux["expert_load"] [L_moe, E]."""
    moes = self.moe_layers()
    if expert_load.shape[0] != len(moes):
      raise ValueError(f"update_router_biases: expert_load has {expert_load.shape[0]} rows, the model "
                       f"{len(moes)} MoE layers")
    for (_, moe), load in zip(moes, expert_load):
      moe.update_bias(load, rate)

  def embed(self, input_ids: jax.Array) -> jax.Array:
    x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(_dtype(self.cfg.dtype))
    return constrain(x, ("activation_batch", "activation_length", "activation_embed"))

  def __call__(self, input_ids: jax.Array | None = None, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, inputs_embeds: jax.Array | None = None,
               loss_mask: jax.Array | None = None, caches: list | None = None, capture_attention: bool = False,
               step_state: Any = None, head: bool = True):
    """input_ids: [B, T] int (or inputs_embeds [B, T, d]); positions: [B, T] (default arange, offset by the cache
    length when decoding); segment_ids: [B, T] packing ids (None: one sequence per row).
    Returns (logits [B, T, V] f32, aux); with head=False (hidden [B, T, d] after the final norm, aux), for a loss
    that applies `head_logits` a chunk of tokens at a time."""
    if (input_ids is None) == (inputs_embeds is None):
      raise ValueError("TextModel: pass exactly one of input_ids and inputs_embeds")
    x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.astype(_dtype(self.cfg.dtype))
    b, t = x.shape[:2]
    if positions is None:
      start = 0 if caches is None else caches[0].length
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = loss_mask if loss_mask is not None else (None if segment_ids is None else segment_ids > 0)
    moe_losses, loads, kls, probs, layer_metrics, new_caches, block_idx = [], [], [], [], {}, [], []

    def run(layer, x, positions, segment_ids, mask, cache):
      return layer(x, positions, segment_ids, mask, cache=cache, capture=capture_attention, step_state=step_state)

    if self.cfg.remat and caches is None:
      plain = run

      def run(layer, *args):  # noqa: F811  (layers do not mutate state in the forward, so split/merge is exact)
        graphdef, state = nnx.split(layer)
        return jax.checkpoint(lambda st, *a: plain(nnx.merge(graphdef, st), *a),
                              policy=_REMAT_POLICIES[self.cfg.remat_policy])(state, *args)
    for i, layer in enumerate(self.layers):
      x, aux = run(layer, x, positions, segment_ids, mask, None if caches is None else caches[i])
      if "moe_aux_loss" in aux:
        moe_losses.append(aux["moe_aux_loss"])
        loads.append(aux["expert_load"])
      if "kl_loss" in aux:
        kls.append(aux["kl_loss"])
      if capture_attention:
        probs.append(aux.get("attention_probs"))
        block_idx.append(aux.get("block_idx"))  # MSA layers: [B, Hkv, T, topk]; None for dense layers
      if "cache" in aux:
        new_caches.append(aux["cache"])
      for k, v in aux.get("metrics", {}).items():
        layer_metrics[f"layer{i}/{k}"] = v
    x = self.norm(x)
    logits = self.head_logits(x) if head else x
    out_aux: dict[str, Any] = {
        "moe_aux_loss": sum(moe_losses) / len(moe_losses) if moe_losses else jnp.zeros((), jnp.float32),
        "kl_loss": sum(kls) if kls else jnp.zeros((), jnp.float32),
        "metrics": layer_metrics,
    }
    if loads:
      out_aux["expert_load"] = jnp.stack(loads)  # [num_moe_layers, E]
    if capture_attention:
      out_aux["attention_probs"] = probs
      out_aux["block_idx"] = block_idx
    if caches is not None:
      out_aux["caches"] = new_caches
    return logits, out_aux

  def head_logits(self, x: jax.Array) -> jax.Array:
    """Final-norm hidden states [B, T, d] -> logits [B, T, V] f32."""
    logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
