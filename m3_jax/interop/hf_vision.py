"""HF MiniMax-M3 VL checkpoints (config.json + safetensors) into our `VLModel`, and HF's patch layout.

`m3_jax.interop.hf.load(path)` reads a VL checkpoint's text tower (all of its name layouts) and hands it to
`load_vision`, which adds the vision tower and the projector, in either of the layouts a VL checkpoint comes in
(tests/fixtures/hf/NOTES.md §9a):
* MiniMax's release layout, which HF transformers 5.x `save_pretrained` also writes for the VL model:
  `vision_tower.vision_model.{embeddings.patch_embedding, pre_layrnorm, encoder.layers.N.*}`,
  `multi_modal_projector.linear_{1,2}`, `patch_merge_mlp.linear_{1,2}`;
* HF's in-memory names: `model.vision_tower.{embeddings.proj, pre_layrnorm, layers.N.*}`,
  `model.multi_modal_projector.{linear_1, linear_2, merge_linear_1, merge_linear_2}`.

HF's image/video processors hand the tower `pixel_values` [patches, C * tp * p * p]: per item, rows in
(t, h-block, w-block, i < m, j < m) order, each row flattened as (C, tp, p, p). Ours takes frames [F, H, W, C];
`hf_patches_to_frames` / `frames_to_hf_patches` convert, and `hf_patch_order` permutes our (t, h, w) grid outputs
into HF's row order.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.core.sharding import state_shardings
from m3_jax.interop import safetensors_io
from m3_jax.interop.rules import Rule, get_path, linear, linear_out, same, set_path
from m3_jax.models.config import TextConfig, VLConfig, VisionConfig
from m3_jax.models.multimodal import VLModel
from m3_jax.models.transformer import TextModel

VISION = "model.vision_tower."
PROJ = "model.multi_modal_projector."
# Vision tower / projector tensors of a `minimax_m3_vl` checkpoint in either layout (hf.py drops them on
# text_only loads).
VISION_NAMES = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.")


def _reshape(shape_ours, shape_hf):
  return (lambda w: w.reshape(shape_ours)), (lambda w: w.reshape(shape_hf))


def vision_rules(cfg: VLConfig) -> list[Rule]:
  """One rule per tensor of the vision tower and the projector."""
  v = cfg.vision
  d, h, hd, inter = v.hidden_size, v.num_attention_heads, v.head_dim, v.intermediate_size
  m, pj, dt = v.spatial_merge_size, cfg.projector_hidden_size, cfg.text.hidden_size
  V, P = ("vision_tower",), ("multi_modal_projector",)
  # Conv3d weight [out, C, tp, p, p] <-> ours [tp, p, p, C, out].
  out = [Rule(V + ("patch_embed",), VISION + "embeddings.proj.weight",
              lambda w: w.transpose(2, 3, 4, 1, 0), lambda w: w.transpose(4, 3, 0, 1, 2)),
         Rule(V + ("pre_layernorm", "weight"), VISION + "pre_layrnorm.weight", *same()),
         Rule(V + ("pre_layernorm", "bias"), VISION + "pre_layrnorm.bias", *same())]
  for i in range(v.num_hidden_layers):
    L, n = V + ("layers", i), f"{VISION}layers.{i}."
    for ln in ("layer_norm1", "layer_norm2"):
      out += [Rule(L + (ln, "weight"), n + ln + ".weight", *same()),
              Rule(L + (ln, "bias"), n + ln + ".bias", *same())]
    for proj in ("q_proj", "k_proj", "v_proj"):
      out += [Rule(L + ("self_attn", proj), n + f"self_attn.{proj}.weight", *linear(d, h, hd)),
              Rule(L + ("self_attn", proj + "_bias"), n + f"self_attn.{proj}.bias", *_reshape((h, hd), (d,)))]
    out += [Rule(L + ("self_attn", "out_proj"), n + "self_attn.out_proj.weight", *linear_out(h, hd, d)),
            Rule(L + ("self_attn", "out_proj_bias"), n + "self_attn.out_proj.bias", *same()),
            Rule(L + ("mlp", "fc1", "kernel"), n + "mlp.fc1.weight", *linear(d, inter)),
            Rule(L + ("mlp", "fc1", "bias"), n + "mlp.fc1.bias", *same()),
            Rule(L + ("mlp", "fc2", "kernel"), n + "mlp.fc2.weight", *linear(inter, d)),
            Rule(L + ("mlp", "fc2", "bias"), n + "mlp.fc2.bias", *same())]
  out += [Rule(P + ("linear_1", "kernel"), PROJ + "linear_1.weight", *linear(d, pj)),
          Rule(P + ("linear_1", "bias"), PROJ + "linear_1.bias", *same()),
          Rule(P + ("linear_2", "kernel"), PROJ + "linear_2.weight", *linear(pj, dt)),
          Rule(P + ("linear_2", "bias"), PROJ + "linear_2.bias", *same()),
          Rule(P + ("merge_linear_1",), PROJ + "merge_linear_1.weight", *linear_out(m * m, dt, pj)),
          Rule(P + ("merge_linear_1_bias",), PROJ + "merge_linear_1.bias", *same()),
          Rule(P + ("merge_linear_2", "kernel"), PROJ + "merge_linear_2.weight", *linear(pj, dt)),
          Rule(P + ("merge_linear_2", "bias"), PROJ + "merge_linear_2.bias", *same())]
  return out


_RELEASE_RENAMES = (
    (re.compile(r"^vision_tower\.vision_model\.embeddings\.patch_embedding\."), VISION + "embeddings.proj."),
    (re.compile(r"^vision_tower\.vision_model\.encoder\.layers\."), VISION + "layers."),
    (re.compile(r"^vision_tower\.vision_model\."), VISION),
    (re.compile(r"^multi_modal_projector\.linear_"), PROJ + "linear_"),
    (re.compile(r"^patch_merge_mlp\.linear_"), PROJ + "merge_linear_"),
)


def hf_vision_name(stored: str) -> str:
  """A stored vision/projector tensor name (either layout) -> HF's in-memory name."""
  for pattern, repl in _RELEASE_RENAMES:
    stored = pattern.sub(repl, stored)
  return stored


# ---- loading ----------------------------------------------------------------------------------------------------

def vl_config(raw: dict, text_cfg: TextConfig, *, where: str = "config.json", vision_overrides: dict | None = None,
              **overrides) -> VLConfig:
  """VLConfig of a VL config.json dict `raw` around an already resolved text config (`hf.read_config`);
  vision_overrides / overrides set VisionConfig / VLConfig fields."""
  if raw.get("model_type") != "minimax_m3_vl" or "vision_config" not in raw:
    raise ValueError(f"{where}: model_type {raw.get('model_type')!r} without a vision_config is not a "
                     "MiniMax-M3 VL model (text-only checkpoints load with m3_jax.interop.hf.load)")
  fields = {f.name for f in dataclasses.fields(VLConfig)} - {"text", "vision"}
  kw = {k: v for k, v in raw.items() if k in fields}
  kw.update(overrides)
  return VLConfig(text=text_cfg, vision=VisionConfig.from_hf_dict(raw["vision_config"], **(vision_overrides or {})),
                  **kw)


def _check_vision_names(path: str, rs: list[Rule], stored: dict[str, str]) -> None:
  missing = [r.hf for r in rs if r.hf not in stored]
  unexpected = sorted(stored[n] for n in set(stored) - {r.hf for r in rs})
  if missing or unexpected:
    raise ValueError(f"{path}: vision tensors do not match config.json: missing {missing[:20]}"
                     f"{' ...' if len(missing) > 20 else ''}, unexpected {unexpected[:20]}"
                     f"{' ...' if len(unexpected) > 20 else ''}")


def load_vision(path: str, raw: dict, text_model: TextModel, text_cfg: TextConfig, *, mesh=None,
                vision_overrides: dict | None = None) -> tuple[VLModel, VLConfig]:
  """The VL model of the checkpoint directory `path` (config.json parsed as `raw`) around its text tower, loaded by
  `hf.load(path, text_only=True)`: reads the vision tower and the projector. Returns (model, config).
  vision_overrides set VisionConfig fields, e.g. {"max_frames": 2}; by default the vision side takes the precision
  the text side was loaded in (the stored one unless overridden)."""
  vision_overrides = {"dtype": text_cfg.dtype, "param_dtype": text_cfg.param_dtype, **(vision_overrides or {})}
  cfg = vl_config(raw, text_cfg, where=f"{path}/config.json", vision_overrides=vision_overrides)
  ckpt = safetensors_io.Checkpoint(path)
  stored = {hf_vision_name(n): n for n in ckpt.names if VISION_NAMES.search(n)}
  rs = vision_rules(cfg)
  _check_vision_names(path, rs, stored)
  abstract = nnx.eval_shape(lambda: VLModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  shardings = None if mesh is None else nnx.to_pure_dict(state_shardings(state, mesh))
  pure["language_model"] = nnx.to_pure_dict(nnx.state(text_model))
  for r in rs:
    want = get_path(pure, r.ours)
    w = np.asarray(ckpt.get(stored[r.hf]))
    try:
      arr = r.to_ours(w)
    except ValueError as e:
      raise ValueError(f"{path}: tensor {stored[r.hf]} has shape {tuple(w.shape)}, which does not fit our "
                       f"{'/'.join(map(str, r.ours))} of shape {tuple(want.shape)}") from e
    if tuple(arr.shape) != tuple(want.shape):
      raise ValueError(f"{path}: tensor {stored[r.hf]} has shape {tuple(w.shape)}; expected a tensor mapping to "
                       f"{'/'.join(map(str, r.ours))} of shape {tuple(want.shape)}")
    arr = arr.astype(want.dtype)
    set_path(pure, r.ours, jax.device_put(arr, get_path(shardings, r.ours)) if shardings else jnp.asarray(arr))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state), cfg


# ---- HF's patch layout -------------------------------------------------------------------------------------------

def hf_patches_to_frames(pixel_values: np.ndarray, grid_thw, cfg: VisionConfig) -> np.ndarray:
  """One item's HF `pixel_values` rows [t*h*w, C*tp*p*p] with grid (t, h, w) in patches -> frames
  [t*tp, h*p, w*p, C] (our layout)."""
  t, h, w = (int(x) for x in grid_thw)
  tp, p, c, m = cfg.temporal_patch_size, cfg.patch_size, cfg.num_channels, cfg.spatial_merge_size
  x = np.asarray(pixel_values).reshape(t, h // m, w // m, m, m, c, tp, p, p)
  x = x.transpose(0, 6, 1, 3, 7, 2, 4, 8, 5)  # [t, tp, h/m, m, p, w/m, m, p, C]
  return x.reshape(t * tp, h * p, w * p, c)


def frames_to_hf_patches(frames: np.ndarray, cfg: VisionConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
  """The inverse: frames [F, H, W, C] -> (HF pixel_values rows, grid (t, h, w))."""
  f, hh, ww, c = frames.shape
  tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.spatial_merge_size
  t, h, w = f // tp, hh // p, ww // p
  x = np.asarray(frames).reshape(t, tp, h // m, m, p, w // m, m, p, c)
  x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [t, h/m, w/m, m, m, C, tp, p, p]
  return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


def hf_patch_order(x: np.ndarray, merge: int) -> np.ndarray:
  """Our grid features [t, h, w, ...] -> rows [t*h*w, ...] in HF's block-major (t, h-block, w-block, i, j) order."""
  t, h, w = x.shape[:3]
  rest = x.shape[3:]
  x = np.asarray(x).reshape((t, h // merge, merge, w // merge, merge) + rest)
  x = x.transpose((0, 1, 3, 2, 4) + tuple(range(5, 5 + len(rest))))
  return x.reshape((t * h * w,) + rest)
