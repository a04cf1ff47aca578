"""HF MiniMax-M3 VL checkpoints (config.json + safetensors) into our `VLModel`, and HF's patch layout.

Two on-disk layouts are accepted (tests/fixtures/hf/NOTES.md §9a):
* the original MiniMax layout, which HF transformers 5.x `save_pretrained` writes for the VL model (and presumably
  the layout of the released checkpoint): `language_model.model.*`, `language_model.lm_head.weight`,
  `vision_tower.vision_model.*`, `multi_modal_projector.linear_{1,2}`, `patch_merge_mlp.linear_{1,2}`, per-expert
  `block_sparse_moe.experts.{e}.w{1,2,3}`, separate gate/up projections, `index_{q,k}_{proj,norm}`;
* HF's in-memory names (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
  `lm_head.weight`).
The original layout is translated lazily into the in-memory names; the text tower then uses the rules of
`m3_jax.interop.hf` and the vision side the rules below.

HF's image/video processors hand the tower `pixel_values` [patches, C * tp * p * p]: per item, rows in
(t, h-block, w-block, i < m, j < m) order, each row flattened as (C, tp, p, p). Ours takes frames [F, H, W, C];
`hf_patches_to_frames` / `frames_to_hf_patches` convert, and `hf_patch_order` permutes our (t, h, w) grid outputs
into HF's row order.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.interop import hf, safetensors_io
from m3_jax.interop.hf import Rule
from m3_jax.models.config import VLConfig, VisionConfig
from m3_jax.models.multimodal import VLModel

TEXT = "model.language_model."
VISION = "model.vision_tower."
PROJ = "model.multi_modal_projector."


# ---- the vision side's rules (ours <-> HF in-memory names) --------------------------------------------------------

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
  v = cfg.vision
  d, h, hd, inter = v.hidden_size, v.num_attention_heads, v.head_dim, v.intermediate_size
  tp, p, c, m = v.temporal_patch_size, v.patch_size, v.num_channels, v.spatial_merge_size
  pj, dt = cfg.projector_hidden_size, cfg.text.hidden_size
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


def rules(cfg: VLConfig) -> list[Rule]:
  """Every tensor of the VL model: text rules of m3_jax.interop.hf (under language_model) + vision rules."""
  text = [Rule(("language_model",) + r.ours, r.hf, r.to_ours, r.to_hf)
          for r in hf.rules(cfg.text, prefix=TEXT, head="lm_head.weight")]
  return text + vision_rules(cfg)


# ---- the original MiniMax layout, seen through HF's in-memory names -------------------------------------------

_ORIGINAL_RENAMES = (
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^language_model\.model\."), TEXT),
    (re.compile(r"^vision_tower\.vision_model\.embeddings\.patch_embedding\."), VISION + "embeddings.proj."),
    (re.compile(r"^vision_tower\.vision_model\.encoder\.layers\."), VISION + "layers."),
    (re.compile(r"^vision_tower\.vision_model\."), VISION),
    (re.compile(r"^multi_modal_projector\.linear_"), PROJ + "linear_"),
    (re.compile(r"^patch_merge_mlp\.linear_"), PROJ + "merge_linear_"),
    (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."),
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.block_sparse_moe\.shared_experts\.down_proj\."), ".mlp.shared_experts.down_proj."),
)


class OriginalLayout:
  """A read-only view of an original-layout checkpoint under HF's in-memory names (`names`, `get`). Tensors that
  HF fuses are fused on read: gate/up projections (gate first), and the per-expert w1/w3 (gate/up) and w2 (down)
  stacked over experts (NOTES.md §1)."""

  _EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
  _GATE_UP = re.compile(r"^(.*)\.(mlp|block_sparse_moe\.shared_experts)\.(gate|up)_proj\.weight$")

  def __init__(self, ckpt):
    self.ckpt = ckpt
    self._make: dict[str, Callable[[], np.ndarray]] = {}
    experts: dict[str, dict[str, dict[int, str]]] = {}
    pairs: dict[str, dict[str, str]] = {}
    for name in ckpt.names:
      if any(p.search(name) for p in hf.IGNORED):
        continue
      mapped = self._rename(name)
      if (mo := self._EXPERT.match(mapped)) is not None:
        experts.setdefault(mo.group(1), {}).setdefault(mo.group(3), {})[int(mo.group(2))] = name
      elif (mo := self._GATE_UP.match(mapped)) is not None:
        where = ".mlp." if mo.group(2) == "mlp" else ".mlp.shared_experts."
        pairs.setdefault(mo.group(1) + where + "gate_up_proj.weight", {})[mo.group(3)] = name
      else:
        self._make[mapped] = lambda n=name: self.ckpt.get(n)
    for layer, ws in experts.items():
      if set(ws) != {"w1", "w2", "w3"} or len({len(x) for x in ws.values()}) != 1:
        raise ValueError(f"original checkpoint: incomplete experts under {layer}: {sorted(ws)} with "
                         f"{[len(x) for x in ws.values()]} experts")
      e = sorted(ws["w1"])
      if e != list(range(len(e))):
        raise ValueError(f"original checkpoint: experts of {layer} are numbered {e}, expected 0..{len(e) - 1}")
      self._make[layer + ".mlp.experts.gate_up_proj"] = lambda w=ws, e=e: np.stack(
          [np.concatenate([self.ckpt.get(w["w1"][i]), self.ckpt.get(w["w3"][i])], 0) for i in e])
      self._make[layer + ".mlp.experts.down_proj"] = lambda w=ws, e=e: np.stack([self.ckpt.get(w["w2"][i]) for i in e])
    for fused, parts in pairs.items():
      if set(parts) != {"gate", "up"}:
        raise ValueError(f"original checkpoint: {fused} needs gate_proj and up_proj, found only {sorted(parts)}")
      self._make[fused] = lambda p=parts: np.concatenate([self.ckpt.get(p["gate"]), self.ckpt.get(p["up"])], 0)

  @staticmethod
  def _rename(name: str) -> str:
    for pattern, repl in _ORIGINAL_RENAMES:
      name = pattern.sub(repl, name)
    return name

  @property
  def names(self) -> list[str]:
    return list(self._make)

  def get(self, name: str) -> np.ndarray:
    return self._make[name]()


def is_original_layout(names) -> bool:
  return any(n.startswith(("language_model.", "vision_tower.vision_model.")) for n in names)


# ---- loading ----------------------------------------------------------------------------------------------------

def read_config(path: str, *, text_overrides: dict | None = None, vision_overrides: dict | None = None,
                **overrides) -> VLConfig:
  with open(os.path.join(path, "config.json")) as f:
    raw = json.load(f)
  if raw.get("model_type") not in ("minimax_m3_vl", None):
    raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r} is not a MiniMax-M3 VL model "
                     "(text-only checkpoints load with m3_jax.interop.hf.load)")
  return VLConfig.from_hf_dict(raw, text_overrides=text_overrides, vision_overrides=vision_overrides, **overrides)


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
  """Loads an HF MiniMax-M3 VL checkpoint directory (either layout). Returns (model, config).
  vision_overrides can set our own fields, e.g. {"max_frames": 2} or {"dtype": "bfloat16"}."""
  cfg = read_config(path, text_overrides=text_overrides, vision_overrides=vision_overrides, **overrides)
  ckpt = safetensors_io.Checkpoint(path)
  if is_original_layout(ckpt.names):
    ckpt = OriginalLayout(ckpt)
  names = set(ckpt.names)
  rs = rules(cfg)
  abstract = nnx.eval_shape(lambda: VLModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  pure = nnx.to_pure_dict(state)
  shardings = None
  if mesh is not None:
    from m3_jax.train.sharding import state_shardings  # noqa: PLC0415
    shardings = nnx.to_pure_dict(state_shardings(state, mesh))
  expected = {r.hf for r in rs}
  missing = [r.hf for r in rs if r.hf not in names]
  unexpected = sorted(n for n in names - expected if not any(p.search(n) for p in hf.IGNORED))
  if missing or unexpected:
    raise ValueError(f"{path}: checkpoint does not match config: missing {missing[:20]}"
                     f"{' ...' if len(missing) > 20 else ''}, unexpected {unexpected[:20]}"
                     f"{' ...' if len(unexpected) > 20 else ''}")
  for r in rs:
    want = _get(pure, r.ours)
    w = np.asarray(ckpt.get(r.hf))
    try:
      arr = r.to_ours(w)
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
