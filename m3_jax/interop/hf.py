"""HF MiniMax-M3 checkpoints (config.json + safetensors) in and out of our NNX text model.

Our parameters are laid out for einsum and sharding ([in, heads, head_dim], gate/up on their own axis); HF's are
torch Linear [out, in]. Every tensor has one rule below giving both directions, so load and save are exact
inverses. Loading streams tensor by tensor onto the target shardings: no host ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.interop import safetensors_io
from m3_jax.models.config import TextConfig
from m3_jax.models.transformer import TextModel

# Keys HF itself drops on load (multi-token-prediction heads are not part of the causal LM).
IGNORED = (re.compile(r"(^|\.)mtp\."),)


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: tuple  # path in nnx.to_pure_dict(state)
  hf: str
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _linear(shape_ours: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF [out, in] <-> ours [in, *out_dims] (q/k/v projections, router, lm_head, down projections)."""
  return (lambda w: w.T.reshape(shape_ours)), (lambda w: w.reshape(shape_ours[0], -1).T)


def _out_proj(shape_ours: tuple[int, ...]) -> tuple[Callable, Callable]:
  """HF [out, in] <-> ours [*in_dims, out] (o_proj: [Hq, D, d])."""
  return (lambda w: w.T.reshape(shape_ours)), (lambda w: w.reshape(-1, shape_ours[-1]).T)


def _gate_up(d: int, i: int) -> tuple[Callable, Callable]:
  """HF [2I, d] (gate rows first) <-> ours [d, 2, I]."""
  return (lambda w: w.reshape(2, i, d).transpose(2, 0, 1)), (lambda w: w.transpose(1, 2, 0).reshape(2 * i, d))


def _experts_gate_up(e: int, d: int, i: int) -> tuple[Callable, Callable]:
  """HF [E, 2I, d] <-> ours [E, d, 2, I]."""
  return (lambda w: w.reshape(e, 2, i, d).transpose(0, 3, 1, 2)), \
         (lambda w: w.transpose(0, 2, 3, 1).reshape(e, 2 * i, d))


def _same():
  return (lambda w: w), (lambda w: w)


def _transpose_last2():
  return (lambda w: np.swapaxes(w, -1, -2)), (lambda w: np.swapaxes(w, -1, -2))


def rules(cfg: TextConfig, prefix: str = "model.", head: str = "lm_head.weight") -> list[Rule]:
  d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  out = [Rule(("embed_tokens",), prefix + "embed_tokens.weight", *_same()),
         Rule(("norm", "weight"), prefix + "norm.weight", *_same()),
         Rule(("lm_head",), head, *_transpose_last2())]
  for li, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
    p, L = f"{prefix}layers.{li}.", ("layers", li)
    out += [Rule(L + ("input_layernorm", "weight"), p + "input_layernorm.weight", *_same()),
            Rule(L + ("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", *_same()),
            Rule(L + ("self_attn", "q_proj"), p + "self_attn.q_proj.weight", *_linear((d, hq, hd))),
            Rule(L + ("self_attn", "k_proj"), p + "self_attn.k_proj.weight", *_linear((d, hkv, hd))),
            Rule(L + ("self_attn", "v_proj"), p + "self_attn.v_proj.weight", *_linear((d, hkv, hd))),
            Rule(L + ("self_attn", "o_proj"), p + "self_attn.o_proj.weight", *_out_proj((hq, hd, d))),
            Rule(L + ("self_attn", "q_norm", "weight"), p + "self_attn.q_norm.weight", *_same()),
            Rule(L + ("self_attn", "k_norm", "weight"), p + "self_attn.k_norm.weight", *_same())]
    if lt == "minimax_m3_sparse":
      hi, di = cfg.index_n_heads, cfg.index_head_dim
      ix, IX = p + "self_attn.indexer.", L + ("self_attn", "indexer")
      out += [Rule(IX + ("q_proj",), ix + "q_proj.weight", *_linear((d, hi, di))),
              Rule(IX + ("k_proj",), ix + "k_proj.weight", *_linear((d, di))),
              Rule(IX + ("q_norm", "weight"), ix + "q_norm.weight", *_same()),
              Rule(IX + ("k_norm", "weight"), ix + "k_norm.weight", *_same())]
    M = L + ("mlp",)
    if mt == "dense":
      out += [Rule(M + ("gate_up",), p + "mlp.gate_up_proj.weight", *_gate_up(d, cfg.dense_intermediate_size)),
              Rule(M + ("down",), p + "mlp.down_proj.weight", *_transpose_last2())]
    else:
      e, i, si = cfg.num_local_experts, cfg.intermediate_size, cfg.shared_intermediate_size
      out += [Rule(M + ("router",), p + "mlp.gate.weight", *_transpose_last2()),
              Rule(M + ("e_score_correction_bias",), p + "mlp.gate.e_score_correction_bias", *_same()),
              Rule(M + ("gate_up",), p + "mlp.experts.gate_up_proj", *_experts_gate_up(e, d, i)),
              Rule(M + ("down",), p + "mlp.experts.down_proj", *_transpose_last2()),
              Rule(M + ("shared", "gate_up"), p + "mlp.shared_experts.gate_up_proj.weight", *_gate_up(d, si)),
              Rule(M + ("shared", "down"), p + "mlp.shared_experts.down_proj.weight", *_transpose_last2())]
  return out


def read_config(path: str, **overrides) -> TextConfig:
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  mt = raw.get("model_type")
  if mt not in ("minimax_m3_vl_text", "minimax_m3_vl", None):
    raise ValueError(f"{path}/config.json: model_type {mt!r} is not a MiniMax-M3 model")
  return TextConfig.from_hf_dict(raw, **overrides)


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree: dict, path: tuple, value) -> None:
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def load(path: str, *, dtype: str | None = None, mesh=None, **overrides) -> tuple[TextModel, TextConfig]:
  """Loads an HF MiniMax-M3 text checkpoint directory. Returns (model, config); `model(input_ids)` gives
  (logits [B, T, vocab], aux). dtype: compute dtype (params keep the stored precision unless param_dtype is
  overridden). mesh: place every tensor straight onto its sharding on this mesh."""
  cfg = read_config(path, **({"dtype": dtype} if dtype else {}), **overrides)
  ckpt = safetensors_io.Checkpoint(path)
  names = set(ckpt.names)
  prefix = "model."
  if not any(n.startswith("model.layers.") for n in names) and any(
      n.startswith("model.language_model.") for n in names):
    prefix = "model.language_model."
  rs = rules(cfg, prefix=prefix)
  abstract = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  shardings = None
  if mesh is not None:
    from m3_jax.train.sharding import state_shardings  # noqa: PLC0415
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
  missing = [r.hf for r in rs if r.hf not in names]
  expected = {r.hf for r in rs}
  unexpected = sorted(n for n in names - expected if not any(p.search(n) for p in IGNORED))
  if missing or unexpected:
    raise ValueError(f"{path}: checkpoint does not match config: missing {missing[:20]}"
                     f"{' ...' if len(missing) > 20 else ''}, unexpected {unexpected[:20]}"
                     f"{' ...' if len(unexpected) > 20 else ''}")
  for r in rs:
    want = _get(pure, r.ours)
    w = ckpt.get(r.hf)
    try:
      arr = r.to_ours(np.asarray(w))
    except ValueError as e:
      raise ValueError(f"{path}: tensor {r.hf} has shape {tuple(w.shape)}, which does not fit our "
                       f"{'/'.join(map(str, r.ours))} of shape {tuple(want.shape)}") from e
    if tuple(arr.shape) != tuple(want.shape):
      raise ValueError(f"{path}: tensor {r.hf} has shape {tuple(w.shape)}; expected a tensor mapping to "
                       f"{'/'.join(map(str, r.ours))} of shape {tuple(want.shape)}")
    arr = arr.astype(want.dtype)
    _set(pure, r.ours, jax.device_put(arr, _get(shardings, r.ours)) if shardings else jnp.asarray(arr))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state), cfg


def hf_config_dict(cfg: TextConfig) -> dict:
  """config.json for a text model (HF field names; partial_rotary_factor is what HF's code reads)."""
  d = {k: v for k, v in cfg.to_dict().items()
       if k not in ("attention_impl", "moe_impl", "dtype", "param_dtype", "remat")}
  d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                          "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim}
  d["model_type"] = "minimax_m3_vl_text"
  d["architectures"] = ["MiniMaxM3VLForCausalLM"]
  return d


def save(model: TextModel, config: TextConfig, path: str, *, dtype: str | None = None) -> None:
  """Writes config.json + model.safetensors in HF's text layout (the inverse of `load`)."""
  os.makedirs(path, exist_ok=True)
  pure = nnx.to_pure_dict(nnx.state(model))
  tensors = []
  for r in rules(config):
    arr = np.asarray(jax.device_get(_get(pure, r.ours)))
    if dtype is not None and np.issubdtype(arr.dtype, np.floating):
      arr = arr.astype(jnp.dtype(dtype))
    tensors.append((r.hf, np.ascontiguousarray(r.to_hf(arr))))
  safetensors_io.write(os.path.join(path, "model.safetensors"), tensors, metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config_dict(config), f, indent=2)
