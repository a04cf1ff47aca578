"""HF `config.json` <-> TextConfig keyword arguments, as pure dict code (no tensors, no model, no config class).

`resolve_text_config(raw)` reads the text-only `minimax_m3_vl_text` layout or the full `minimax_m3_vl` one (its
`text_config`), with the legacy names HF 5.23's `MiniMaxM3VLTextConfig` maps (`sparse_attention_config`,
`moe_layer_freq`, `num_experts`, top-level `rope_theta` / `partial_rotary_factor`, `rope_scaling`), resolved exactly
as HF resolves them. `hf_config_dict(cfg)` writes the canonical text layout back. TextConfig.from_hf_dict
(models/config.py) and m3_jax/interop/hf.py both read through here.
"""

from __future__ import annotations

from typing import Any

MODEL_TYPES = ("minimax_m3_vl_text", "minimax_m3_vl")
# MiniMaxM3VLTextConfig's class defaults for what the resolution needs when config.json omits it (TextConfig's
# defaults are the same real model).
HF_DEFAULT_THETA = 5_000_000.0  # MiniMaxM3VLTextConfig.default_theta
HF_DEFAULT_LAYERS = 60
HF_DEFAULT_HEAD_DIM = 128

# TextConfig fields that come from config.json under the same name (HF's class defaults equal ours for all of
# them; layer_types, mlp_layer_types, rotary_dim and rope_theta are resolved below).
HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "rms_norm_eps", "dense_intermediate_size", "intermediate_size", "shared_intermediate_size",
             "num_local_experts", "num_experts_per_tok", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit",
             "tie_word_embeddings", "initializer_range", "index_n_heads", "index_head_dim", "index_block_size",
             "index_topk_blocks", "index_local_blocks", "router_aux_loss_coef")
_LEGACY_SPARSE = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                  "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                  "index_local_blocks": "sparse_local_block"}
# HF's layer-type values, which TextConfig keeps as they are: "sparse" in mlp_layer_types is a MoE MLP.
_DENSE_ATTENTION, _MSA = "full_attention", "minimax_m3_sparse"
_MLP_DENSE, _MLP_MOE = "dense", "sparse"


def _text_part(raw: dict, where: str) -> dict:
  mt = raw.get("model_type")
  if mt not in MODEL_TYPES + (None,):
    raise ValueError(f"{where}: model_type {mt!r} is not a MiniMax-M3 model; expected one of {MODEL_TYPES}")
  if mt == "minimax_m3_vl" or "text_config" in raw:
    return dict(raw.get("text_config") or {})  # HF builds the text config from class defaults when it is null
  return dict(raw)


def _layer_types(t: dict, legacy: dict, n: int) -> tuple[list[str], list[str]]:
  """(layer_types, mlp_layer_types): HF's lists, else the legacy per-layer flags, else HF's defaults."""
  layer_types = t.get("layer_types")
  if layer_types is None and "sparse_attention_freq" in legacy:
    layer_types = [_MSA if f else _DENSE_ATTENTION for f in legacy["sparse_attention_freq"]]
  mlp_types = t.get("mlp_layer_types")
  if mlp_types is None and t.get("moe_layer_freq") is not None:
    mlp_types = [_MLP_MOE if f else _MLP_DENSE for f in t["moe_layer_freq"]]
  return (layer_types if layer_types is not None else [_DENSE_ATTENTION] * n,
          mlp_types if mlp_types is not None else [_MLP_MOE] * n)


def _rope(t: dict, head_dim: int, where: str) -> tuple[int, float]:
  """(rotary_dim, rope_theta). `rope_scaling` (legacy) replaces rope_parameters; top-level rope_theta /
  partial_rotary_factor only fill what the dict lacks. HF's modeling code reads the rotated width from
  partial_rotary_factor alone (a missing factor rotates the whole head; the `rotary_dim` field is never read), so
  we follow what HF computes."""
  rope = dict(t.get("rope_scaling") or t.get("rope_parameters") or {})
  if any(isinstance(v, dict) for v in rope.values()):
    raise ValueError(f"{where}: per-layer-type rope_parameters {sorted(rope)} are not supported by MiniMax-M3")
  rope.setdefault("rope_theta", t.get("rope_theta", HF_DEFAULT_THETA))
  if t.get("partial_rotary_factor") is not None:
    rope.setdefault("partial_rotary_factor", t["partial_rotary_factor"])
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type != "default":
    raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; MiniMax-M3 uses 'default' RoPE")
  return int(head_dim * float(rope.get("partial_rotary_factor", 1.0))), float(rope["rope_theta"])


def resolve_text_config(raw: dict, where: str = "config.json") -> dict[str, Any]:
  """The text model's settings as HF 5.23 resolves them (MiniMaxM3VLTextConfig.__post_init__ and the RoPE
  standardisation of PreTrainedConfig), as TextConfig keyword arguments. `where` names the source in errors."""
  t = _text_part(raw, where)
  if "num_experts" in t:  # HF's attribute_map alias
    if "num_local_experts" in t and t["num_local_experts"] != t["num_experts"]:
      raise ValueError(f"{where}: num_experts={t['num_experts']} and num_local_experts={t['num_local_experts']} "
                       "disagree")
    t["num_local_experts"] = t.pop("num_experts")
  kw = {k: t[k] for k in HF_FIELDS if k in t and t[k] is not None}
  # The legacy block overrides the flat index_* fields (HF applies it after the dataclass fields).
  legacy = t.get("sparse_attention_config") or {}
  for ours, theirs in _LEGACY_SPARSE.items():
    if theirs in legacy:
      kw[ours] = legacy[theirs]
  n = int(kw.get("num_hidden_layers", HF_DEFAULT_LAYERS))
  kw["layer_types"], kw["mlp_layer_types"] = _layer_types(t, legacy, n)
  head_dim = int(kw.get("head_dim", HF_DEFAULT_HEAD_DIM))
  kw["rotary_dim"], kw["rope_theta"] = _rope(t, head_dim, where)
  return kw


def hf_config_dict(cfg) -> dict[str, Any]:
  """config.json for a text model (a TextConfig `cfg`; HF field names; partial_rotary_factor is what HF's code
  reads)."""
  d = {k: getattr(cfg, k) for k in HF_FIELDS}
  d.update(layer_types=list(cfg.layer_types), mlp_layer_types=list(cfg.mlp_layer_types), rotary_dim=cfg.rotary_dim,
           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
           model_type="minimax_m3_vl_text", architectures=["MiniMaxM3VLForCausalLM"], dtype=cfg.param_dtype)
  return d
