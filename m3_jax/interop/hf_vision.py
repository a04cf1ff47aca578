"""HF MiniMax-M3 VL checkpoints (config.json + safetensors) into our `VLModel`, and HF's patch layout.

The text tower is read by `m3_jax.interop.hf.load(path, text_only=True)` (all of its name layouts); this file adds
the vision tower and the projector, in either of the layouts a VL checkpoint comes in (tests/fixtures/hf/NOTES.md
§9a):
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
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.interop import hf, safetensors_io
from m3_jax.models.config import VLConfig, VisionConfig
from m3_jax.models.multimodal import VLModel

VISION = "model.vision_tower."
PROJ = "model.multi_modal_projector."
# Vision tower / projector tensors in either layout.
VISION_NAMES = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.")


@dataclasses.dataclass(frozen=True)
class Rule:
  ours: tuple  # path in nnx.to_pure_dict(state) of the VLModel
  hf: str  # HF's in-memory name
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


def _lin(shape_ours):
  """HF [out, in] <-> ours [in, *out_dims]."""
  return (lambda w: w.T.reshape(shape_ours)), (lambda w: w.reshape(shape_ours[0], -1).T)


def _lin_in(shape_ours):
  """HF [out, in] <-> ours [*in_dims, out]."""
  return (lambda w: w.T.reshape(shape_ours)), (lambda w: w.reshape(-1, shape_ours[-1]).T)


def _reshape(shape_ours, shape_hf):
  return (lambda w: w.reshape(shape_ours)), (lambda w: w.reshape(shape_hf))


def _same():
  return (lambda w: w), (lambda w: w)


def vision_rules(cfg: VLConfig) -> list[Rule]:
  """One rule per tensor of the vision tower and the projector."""
  v = cfg.vision
  d, h, hd, inter = v.hidden_size, v.num_attention_heads, v.head_dim, v.intermediate_size
  m, pj, dt = v.spatial_merge_size, cfg.projector_hidden_size, cfg.text.hidden_size
  V, P = ("vision_tower",), ("multi_modal_projector",)
  # Conv3d weight [out, C, tp, p, p] <-> ours [tp, p, p, C, out].
  out = [Rule(V + ("patch_embed",), VISION + "embeddings.proj.weight",
              lambda w: w.transpose(2, 3, 4, 1, 0), lambda w: w.transpose(4, 3, 0, 1, 2)),
         Rule(V + ("pre_layernorm", "weight"), VISION + "pre_layrnorm.weight", *_same()),
         Rule(V + ("pre_layernorm", "bias"), VISION + "pre_layrnorm.bias", *_same())]
  for i in range(v.num_hidden_layers):
    L, n = V + ("layers", i), f"{VISION}layers.{i}."
    for ln in ("layer_norm1", "layer_norm2"):
      out += [Rule(L + (ln, "weight"), n + ln + ".weight", *_same()),
              Rule(L + (ln, "bias"), n + ln + ".bias", *_same())]
    for proj in ("q_proj", "k_proj", "v_proj"):
      out += [Rule(L + ("self_attn", proj), n + f"self_attn.{proj}.weight", *_lin((d, h, hd))),
              Rule(L + ("self_attn", proj + "_bias"), n + f"self_attn.{proj}.bias", *_reshape((h, hd), (d,)))]
    out += [Rule(L + ("self_attn", "out_proj"), n + "self_attn.out_proj.weight", *_lin_in((h, hd, d))),
            Rule(L + ("self_attn", "out_proj_bias"), n + "self_attn.out_proj.bias", *_same()),
            Rule(L + ("mlp", "fc1", "kernel"), n + "mlp.fc1.weight", *_lin((d, inter))),
            Rule(L + ("mlp", "fc1", "bias"), n + "mlp.fc1.bias", *_same()),
            Rule(L + ("mlp", "fc2", "kernel"), n + "mlp.fc2.weight", *_lin((inter, d))),
            Rule(L + ("mlp", "fc2", "bias"), n + "mlp.fc2.bias", *_same())]
  out += [Rule(P + ("linear_1", "kernel"), PROJ + "linear_1.weight", *_lin((d, pj))),
          Rule(P + ("linear_1", "bias"), PROJ + "linear_1.bias", *_same()),
          Rule(P + ("linear_2", "kernel"), PROJ + "linear_2.weight", *_lin((pj, dt))),
          Rule(P + ("linear_2", "bias"), PROJ + "linear_2.bias", *_same()),
          Rule(P + ("merge_linear_1",), PROJ + "merge_linear_1.weight", *_lin_in((m * m, dt, pj))),
          Rule(P + ("merge_linear_1_bias",), PROJ + "merge_linear_1.bias", *_same()),
          Rule(P + ("merge_linear_2", "kernel"), PROJ + "merge_linear_2.weight", *_lin((pj, dt))),
          Rule(P + ("merge_linear_2", "bias"), PROJ + "merge_linear_2.bias", *_same())]
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

def read_config(path: str, *, text_overrides: dict | None = None, vision_overrides: dict | None = None,
                **overrides) -> VLConfig:
  """VLConfig of a VL checkpoint directory; the text part as `hf.read_config` resolves it."""
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  if raw.get("model_type") != "minimax_m3_vl" or "vision_config" not in raw:
    raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r} without a vision_config is not a "
                     "MiniMax-M3 VL model (text-only checkpoints load with m3_jax.interop.hf.load)")
  fields = {f.name for f in dataclasses.fields(VLConfig)} - {"text", "vision"}
  kw = {k: v for k, v in raw.items() if k in fields}
  kw.update(overrides)
  return VLConfig(text=hf.read_config(path, **(text_overrides or {})),
                  vision=VisionConfig.from_hf_dict(raw["vision_config"], **(vision_overrides or {})), **kw)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def load(path: str, *, text_overrides: dict | None = None, vision_overrides: dict | None = None, mesh=None,
         **overrides) -> tuple[VLModel, VLConfig]:
  """Loads an HF MiniMax-M3 VL checkpoint directory. Returns (model, config).
  text_overrides / vision_overrides set TextConfig / VisionConfig fields, e.g. vision_overrides={"max_frames": 2}."""
  text_model, text_cfg = hf.load(path, mesh=mesh, text_only=True, **(text_overrides or {}))
  # The vision side takes the precision the text side was loaded in (the stored one unless overridden).
  vision_overrides = {"dtype": text_cfg.dtype, "param_dtype": text_cfg.param_dtype, **(vision_overrides or {})}
  cfg = read_config(path, vision_overrides=vision_overrides, **overrides).replace(text=text_cfg)
  ckpt = safetensors_io.Checkpoint(path)
  stored = {hf_vision_name(n): n for n in ckpt.names if VISION_NAMES.search(n)}
  rs = vision_rules(cfg)
  missing = [r.hf for r in rs if r.hf not in stored]
  unexpected = sorted(stored[n] for n in set(stored) - {r.hf for r in rs})
  if missing or unexpected:
    raise ValueError(f"{path}: vision tensors do not match config.json: missing {missing[:20]}"
                     f"{' ...' if len(missing) > 20 else ''}, unexpected {unexpected[:20]}"
                     f"{' ...' if len(unexpected) > 20 else ''}")
  abstract = nnx.eval_shape(lambda: VLModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  shardings = None
  if mesh is not None:
    from m3_jax.core.sharding import state_shardings  # noqa: PLC0415
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
  pure["language_model"] = nnx.to_pure_dict(nnx.state(text_model))
  for r in rs:
    want = _get(pure, r.ours)
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
    _set(pure, r.ours, jax.device_put(arr, _get(shardings, r.ours)) if shardings else jnp.asarray(arr))
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
