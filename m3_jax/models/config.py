"""Typed model configuration for the M3 text tower, the vision tower and the VL model.

Field names follow HF transformers' `MiniMaxM3VLTextConfig` so that a real `config.json` maps 1:1 onto
`TextConfig.from_hf_dict` (resolved in models/hf_config.py). Modules receive typed dims read from this dataclass
(e.g. `AttentionDims.from_config`), never the whole ml_collections experiment config. Parameter and FLOP counts are
in models/flops.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from m3_jax.models.attention import LAYER_TYPES
from m3_jax.models.attention.dense import ATTENTION_IMPLS
from m3_jax.models.hf_config import resolve_text_config

# mlp_layer_types values. "sparse" is HF's name for a MoE MLP layer; we keep it (not "moe") so that HF configs, our
# exported model_config.json files and the experiment configs all read the same word.
MLP_DENSE = "dense"
MLP_MOE = "sparse"
MLP_LAYER_TYPES = (MLP_DENSE, MLP_MOE)
MOE_IMPLS = ("ragged", "dense", "capacity", "expert_parallel")
GROUPED_MATMUL_IMPLS = ("xla", "tiled", "mosaic", "tokamax")
# With remat: "full" recomputes the whole layer in the backward; "save_selection" keeps each MSA layer's block
# selection (int32 [B, Hkv, T, topk]) from the forward, so the recompute skips the index scoring and the top-k;
# "save_matmuls" keeps every matmul, attention and kernel output and recomputes only the elementwise, layout and
# gather work between them (what XLA's fusion recomputes anyway when the layers are not scanned).
REMAT_POLICIES = ("full", "save_selection", "save_matmuls")
# msa_selection values: "per_group" is M3 (one block set per query and GQA group); "shared" is the ablation of one
# set per query for all groups (DeepSeek DSA's design applied to GQA).
MSA_SELECTIONS = ("per_group", "shared")


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """The M3 text model. Defaults are the real MiniMax-M3 text tower (428B total parameters)."""

  vocab_size: int = 200064
  hidden_size: int = 6144
  num_hidden_layers: int = 60
  num_attention_heads: int = 64
  num_key_value_heads: int = 4
  head_dim: int = 128
  # Channels of each head rotated by RoPE (NeoX layout on the first `rotary_dim` dims); HF stores it either as
  # `rotary_dim` or as `rope_parameters.partial_rotary_factor * head_dim`.
  rotary_dim: int = 64
  rope_theta: float = 5_000_000.0
  rms_norm_eps: float = 1e-6
  dense_intermediate_size: int = 12288
  intermediate_size: int = 3072  # per routed expert
  shared_intermediate_size: int = 3072
  num_local_experts: int = 128
  num_experts_per_tok: int = 4
  routed_scaling_factor: float = 2.0
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  layer_types: tuple[str, ...] = ("full_attention",) * 3 + ("minimax_m3_sparse",) * 57
  mlp_layer_types: tuple[str, ...] = (MLP_DENSE,) * 3 + (MLP_MOE,) * 57
  tie_word_embeddings: bool = False
  initializer_range: float = 0.02
  # MSA index branch (HF names); used by `minimax_m3_sparse` layers.
  index_n_heads: int = 4
  index_head_dim: int = 128
  index_block_size: int = 128
  index_topk_blocks: int = 16
  index_local_blocks: int = 1
  # MSA training (ours): KL weight per MSA layer, indexer warmup steps (dense attention + dense KL target), and
  # the input detach of the index branch (True always, except for the paper's ablation).
  kl_weight: float = 1.0
  warmup_steps: int = 0
  detach_index_input: bool = True
  # Ablation of the paper's per-group selection (ours): "shared" picks one block set per query for all KV groups,
  # ranked by the index scores summed over the index heads (sum_h q_idx_h . k_idx, i.e. one index query
  # sum_h q_idx_h: the select kernels run it as a single head, the sparse kernels get the set broadcast to every
  # group). Its KL trains that summed score toward the mean attention of all query heads (see MSAAttention).
  msa_selection: str = "per_group"
  msa_impl: str = "xla"  # pallas_kernels.msa implementation: xla | reference | pallas
  msa_index_fp8: bool = False  # select blocks from fp8 (e4m3) index q/k, one scale per vector (quantize_index)
  msa_metric_queries: int = 64  # queries sampled per step for the recall metrics
  # recall metrics (dense scores of the sampled queries, argsorts) on step 0 and every N-th step, NaN between
  msa_metrics_every: int = 1
  # Ours, not HF's: implementation switches and training-only knobs.
  attention_impl: str = "xla"
  # Packed rows hold several documents; True masks attention between them (exact per-document training). False
  # attends causally across the whole row, which lets cuDNN skip the upper triangle instead of reading a mask.
  document_mask: bool = True
  moe_impl: str = "ragged"
  # moe_impl="expert_parallel": ragged's function with the experts split over the `expert` mesh axis (all-to-all
  # token exchange, dropless; models/moe_parallel.py). moe_impl="capacity": each expert takes at most
  # capacity_factor * N * k / E tokens per batch (GShard-style buffers that shard over `expert`); assignments past
  # that are dropped. ragged, dense and expert_parallel never drop.
  capacity_factor: float = 1.25
  # The grouped matmuls of the dropless paths (ragged, expert_parallel): "xla" (jax.lax.ragged_dot, any backend;
  # on CPU and in its GPU backward it copies the rows per expert), "tiled" (scanned one-expert tiles: memory
  # bounded everywhere), "mosaic" (Hopper kernels shipped with JAX, our VJP) or "tokamax" (optional package).
  # See pallas_kernels/grouped_matmul.
  grouped_matmul_impl: str = "xla"
  # moe_impl="expert_parallel": each device sends its tokens through the all-to-all exchange this many at a time
  # (a scan over chunks, each rematerialised in the backward), so the fixed-size slot buffers, ep x min(k, E / ep)
  # rows per token, are bounded by the chunk instead of growing with the tokens per device (long contexts).
  # 0: all of them at once. Must divide the tokens per device.
  moe_chunk_tokens: int = 0
  # Load balancing, either way or both: `router_aux_loss_coef` x the balance loss in the train loss (HF's field, the
  # one place its coefficient lives), and aux-loss-free balancing (ours; how M3 and DeepSeek-V3 train): after each
  # optimizer step every MoE layer's e_score_correction_bias moves by router_bias_update_rate x sign(mean load -
  # expert load), computed from that step's routing. 0 leaves the bias as loaded (HF parity).
  router_aux_loss_coef: float = 0.001
  router_bias_update_rate: float = 0.0
  dtype: str = "float32"  # activation / compute dtype; parameters are kept in `param_dtype`
  param_dtype: str = "float32"
  remat: bool = False
  remat_policy: str = "full"  # one of REMAT_POLICIES (used when remat is True)
  # Consecutive layers of one (layer type, MLP type) run as one `jax.lax.scan` over their parameters stacked on a
  # leading layer axis (models/transformer.py LayerStack): compile time stops growing with depth. The state layout
  # changes (`layers/<run>/layer/...` with a leading axis); HF checkpoints map to it either way (interop/hf.py).
  scan_layers: bool = False

  def __post_init__(self):
    # Lists from JSON/ml_collections become tuples so the config stays hashable (it is a jit static argument).
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
    self.validate()

  def validate(self) -> None:
    """Raises ValueError naming the field for any inconsistent setting (runs before any compilation)."""
    def bad(msg):
      raise ValueError(f"TextConfig: {msg}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "dense_intermediate_size", "intermediate_size"):
      if int(getattr(self, name)) <= 0:
        bad(f"{name}={getattr(self, name)} must be positive")
    if self.num_attention_heads % self.num_key_value_heads:
      bad(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
          f"num_key_value_heads={self.num_key_value_heads} (GQA needs whole groups)")
    if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
      bad(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
    if len(self.layer_types) != self.num_hidden_layers:
      bad(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers={self.num_hidden_layers}")
    if len(self.mlp_layer_types) != self.num_hidden_layers:
      bad(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, num_hidden_layers={self.num_hidden_layers}")
    for i, t in enumerate(self.layer_types):
      if t not in LAYER_TYPES:
        bad(f"layer_types[{i}]={t!r}; expected one of {LAYER_TYPES}")
    for i, t in enumerate(self.mlp_layer_types):
      if t not in MLP_LAYER_TYPES:
        bad(f"mlp_layer_types[{i}]={t!r}; expected one of {MLP_LAYER_TYPES}")
    if MLP_MOE in self.mlp_layer_types:
      if not 0 < self.num_experts_per_tok <= self.num_local_experts:
        bad(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_local_experts="
            f"{self.num_local_experts}]")
    if self.msa_selection not in MSA_SELECTIONS:
      bad(f"msa_selection={self.msa_selection!r}; expected one of {MSA_SELECTIONS}")
    if "minimax_m3_sparse" in self.layer_types:
      for name in ("index_block_size", "index_topk_blocks"):
        if int(getattr(self, name)) <= 0:
          bad(f"{name}={getattr(self, name)} must be positive (MSA layers select index_topk_blocks blocks of "
              "index_block_size keys)")
      if not 0 <= self.index_local_blocks <= self.index_topk_blocks:
        bad(f"index_local_blocks={self.index_local_blocks} must be in [0, index_topk_blocks="
            f"{self.index_topk_blocks}] (the forced local blocks take selection slots)")
    if self.attention_impl not in ATTENTION_IMPLS:
      bad(f"attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
    if self.moe_impl not in MOE_IMPLS:
      bad(f"moe_impl={self.moe_impl!r}; expected one of {MOE_IMPLS}")
    if self.moe_chunk_tokens < 0:
      bad(f"moe_chunk_tokens={self.moe_chunk_tokens} must be >= 0 (0: exchange all tokens at once)")
    if self.grouped_matmul_impl not in GROUPED_MATMUL_IMPLS:
      bad(f"grouped_matmul_impl={self.grouped_matmul_impl!r}; expected one of {GROUPED_MATMUL_IMPLS}")
    if self.remat_policy not in REMAT_POLICIES:
      bad(f"remat_policy={self.remat_policy!r}; expected one of {REMAT_POLICIES}")
    if not isinstance(self.scan_layers, bool):
      bad(f"scan_layers={self.scan_layers!r} must be True or False")
    if self.router_bias_update_rate < 0:
      bad(f"router_bias_update_rate={self.router_bias_update_rate} must be >= 0 (0: no aux-loss-free balancing)")
    if self.router_aux_loss_coef < 0:
      bad(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0 (0: no balance loss)")
    if self.capacity_factor <= 0:
      bad(f"capacity_factor={self.capacity_factor} must be positive")
    if self.tie_word_embeddings:
      bad("tie_word_embeddings=True is not supported: MiniMax-M3 has untied embeddings")

  def replace(self, **kw) -> "TextConfig":
    return dataclasses.replace(self, **kw)

  # ---- HF config.json interop ---------------------------------------------------------------------------------
  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **overrides) -> "TextConfig":
    """Builds from an HF `config.json` dict (text config, or a VL config's `text_config`), resolved exactly as HF
    5.23 resolves it (legacy field names, RoPE precedence): one reader, models/hf_config.py."""
    kw = resolve_text_config(d)
    kw.update(overrides)
    return cls(**kw)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["layer_types"] = list(self.layer_types)
    d["mlp_layer_types"] = list(self.mlp_layer_types)
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "TextConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"TextConfig: unknown fields {unknown}; known fields are {sorted(fields)}")
    return cls(**d)


def msa_token_budget(block_size: int, tokens: int = 2048) -> dict[str, int]:
  """TextConfig overrides that let each (query, group) read `tokens` keys in blocks of `block_size`:
  `TextConfig(**msa_token_budget(16))` is block 16 x top 128, the token-granular arm beside M3's block 128 x top 16
  at the same budget. The Pallas GPU kernels need a power-of-two block_size >= 16 (xla takes any)."""
  for name, v in (("block_size", block_size), ("tokens", tokens)):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
      raise ValueError(f"msa_token_budget: {name}={v!r}; expected a positive int")
  if tokens % block_size:
    raise ValueError(f"msa_token_budget: tokens={tokens} is not a multiple of block_size={block_size} (the budget "
                     "is a whole number of blocks)")
  return {"index_block_size": block_size, "index_topk_blocks": tokens // block_size}


VISION_ACTS = ("gelu", "gelu_pytorch_tanh", "quick_gelu")
VISION_ATTENTION_IMPLS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """The M3 vision tower (a ViT with 3D axial RoPE). Defaults are the real MiniMax-M3 tower.

  Field names follow HF transformers' `MiniMaxM3VLVisionConfig` (`rope_parameters.rope_theta` becomes
  `rope_theta`). `max_frames` is ours: the temporal patches (groups of `temporal_patch_size` frames) per attention
  segment. Patches attend to every patch of their segment and to nothing outside it; `max_frames=1` is per-frame
  attention. HF expresses the same thing in its video processor (`vision_segment_max_frames`, default 4), which
  cuts each video into chunks of at most that many temporal patches before the tower; the temporal RoPE position
  restarts at 0 in every chunk, and ours restarts in every segment.
  """

  hidden_size: int = 1280
  intermediate_size: int = 5120
  num_hidden_layers: int = 32
  num_attention_heads: int = 16
  num_channels: int = 3
  image_size: int = 2016  # HF's nominal size; the tower accepts any multiple of patch_size * spatial_merge_size
  patch_size: int = 14
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  hidden_act: str = "gelu"  # exact (erf) GELU, as HF's ACT2FN["gelu"]
  layer_norm_eps: float = 1e-5
  attention_dropout: float = 0.0
  rope_theta: float = 10000.0
  initializer_range: float = 0.02
  # Ours, not HF's.
  max_frames: int = 4
  attention_impl: str = "xla"
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    def bad(msg):
      raise ValueError(f"VisionConfig: {msg}")

    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                 "patch_size", "temporal_patch_size", "spatial_merge_size", "max_frames"):
      if int(getattr(self, name)) <= 0:
        bad(f"{name}={getattr(self, name)} must be positive")
    if self.hidden_size % self.num_attention_heads:
      bad(f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}")
    if self.rope_axis_dim == 0:
      bad(f"head_dim={self.head_dim} is too small for 3D RoPE (each of t, h, w needs at least 2 channels, so "
          "head_dim >= 6)")
    if self.hidden_act not in VISION_ACTS:
      bad(f"hidden_act={self.hidden_act!r}; expected one of {VISION_ACTS}")
    if self.attention_dropout != 0.0:
      bad(f"attention_dropout={self.attention_dropout} is not implemented (M3 uses 0.0)")
    if self.attention_impl not in VISION_ATTENTION_IMPLS:
      bad(f"attention_impl={self.attention_impl!r}; expected one of {VISION_ATTENTION_IMPLS}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def rope_axis_dim(self) -> int:
    """Channels per axis (t, h, w) before the cos/sin duplication: HF's `2 * ((head_dim // 3) // 2)`."""
    return 2 * ((self.head_dim // 3) // 2)

  @property
  def rotary_dim(self) -> int:
    """Channels of each head rotated by 3D RoPE (the rest pass through): 78 of 80 for M3."""
    return 3 * self.rope_axis_dim

  @property
  def patch_dim(self) -> int:
    return self.temporal_patch_size * self.patch_size * self.patch_size * self.num_channels

  @property
  def pixels_per_token(self) -> int:
    """Side of the square of pixels behind one merged visual token (patch_size * spatial_merge_size)."""
    return self.patch_size * self.spatial_merge_size

  def num_visual_tokens(self, frames: int, height: int, width: int) -> int:
    """Merged visual tokens of one item of `frames` frames (an image has temporal_patch_size frames)."""
    return (frames // self.temporal_patch_size) * (height // self.pixels_per_token) * (width // self.pixels_per_token)

  def replace(self, **kw) -> "VisionConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], **overrides) -> "VisionConfig":
    """Builds from an HF `vision_config` dict (or a whole VL config.json dict)."""
    d = dict(d.get("vision_config", d))
    rope = d.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
      raise ValueError(f"VisionConfig: rope_parameters.rope_type={rope['rope_type']!r}; the M3 tower uses 'axial'")
    if "rope_theta" not in d and "rope_theta" in rope:
      d["rope_theta"] = rope["rope_theta"]
    if d.get("vision_segment_max_frames") is not None:  # the video processor's name for max_frames
      d.setdefault("max_frames", d["vision_segment_max_frames"])
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields}
    kw.update(overrides)
    return cls(**kw)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "VisionConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"VisionConfig: unknown fields {unknown}; known fields are {sorted(fields)}")
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class VLConfig:
  """Vision tower + projector + M3 text tower. Token ids default to the real M3 tokenizer's; our own BPE
  tokenizer (m3_jax/data/tokenizer.py) uses 2 (<image>) and 3 (<video>)."""

  text: TextConfig = dataclasses.field(default_factory=TextConfig)
  vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
  image_token_index: int = 200025
  video_token_index: int = 200026
  projector_hidden_size: int = 6144

  def __post_init__(self):
    if isinstance(self.text, dict):
      object.__setattr__(self, "text", TextConfig.from_dict(self.text))
    if isinstance(self.vision, dict):
      object.__setattr__(self, "vision", VisionConfig.from_dict(self.vision))
    self.validate()

  def validate(self) -> None:
    def bad(msg):
      raise ValueError(f"VLConfig: {msg}")

    if not isinstance(self.text, TextConfig) or not isinstance(self.vision, VisionConfig):
      bad(f"text and vision must be TextConfig and VisionConfig, got {type(self.text).__name__} and "
          f"{type(self.vision).__name__}")
    for name in ("image_token_index", "video_token_index"):
      v = getattr(self, name)
      if not 0 <= v < self.text.vocab_size:
        bad(f"{name}={v} is outside the text vocabulary [0, {self.text.vocab_size})")
    if self.image_token_index == self.video_token_index:
      bad(f"image_token_index and video_token_index are both {self.image_token_index}")
    if self.projector_hidden_size <= 0:
      bad(f"projector_hidden_size={self.projector_hidden_size} must be positive")

  @property
  def merged_hidden_size(self) -> int:
    """Input width of the patch-merge MLP: spatial_merge_size**2 projected patches side by side."""
    return self.text.hidden_size * self.vision.spatial_merge_size ** 2

  def replace(self, **kw) -> "VLConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any], *, text_overrides: dict | None = None,
                   vision_overrides: dict | None = None, **overrides) -> "VLConfig":
    """Builds from an HF MiniMax-M3 VL `config.json` dict (`text_config` + `vision_config` + token ids)."""
    for key in ("text_config", "vision_config"):
      if key not in d:
        raise ValueError(f"VLConfig.from_hf_dict: the dict has no {key!r} (keys: {sorted(d)}); is it a VL config?")
    fields = {f.name for f in dataclasses.fields(cls)} - {"text", "vision"}
    kw = {k: v for k, v in d.items() if k in fields}
    kw.update(overrides)
    return cls(text=TextConfig.from_hf_dict(d["text_config"], **(text_overrides or {})),
               vision=VisionConfig.from_hf_dict(d["vision_config"], **(vision_overrides or {})), **kw)

  def to_dict(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["text"], d["vision"] = self.text.to_dict(), self.vision.to_dict()
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "VLConfig":
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(f"VLConfig: unknown fields {unknown}; known fields are {sorted(fields)}")
    d = dict(d)
    if isinstance(d.get("text"), dict):
      d["text"] = TextConfig.from_dict(d["text"])
    if isinstance(d.get("vision"), dict):
      d["vision"] = VisionConfig.from_dict(d["vision"])
    return cls(**d)
