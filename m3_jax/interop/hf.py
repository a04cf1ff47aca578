"""HF MiniMax-M3 checkpoints (config.json + safetensors) in and out of our NNX text model.

    from m3_jax.interop.hf import load, save
    model, config = load(path)                 # or load(path, dtype="bfloat16", mesh=mesh)
    logits, aux = model(input_ids)             # input_ids: int [B, T] -> logits [B, T, vocab]
    save(model, config, out_dir)               # HF's text layout; load(out_dir) gives the same model back

config.json: the text-only `minimax_m3_vl_text` layout or the full `minimax_m3_vl` one (its `text_config`), with the
legacy names HF 5.23's `MiniMaxM3VLTextConfig` maps, resolved exactly as HF resolves them (m3_jax/models/hf_config.py).

Tensors: one `model.safetensors` or a sharded set (`model.safetensors.index.json`), in any of three name layouts:
  hf       `model.*` + `lm_head.weight`: what `MiniMaxM3VLForCausalLM.save_pretrained` writes (the canonical names);
  hf_vl    `model.language_model.*`: the VL model's text tower as HF holds it in memory;
  minimax  `language_model.model.*`: MiniMax's release layout, which HF 5.23 also writes for the VL model
           (`block_sparse_moe`, per-expert w1/w3/w2, split gate_proj/up_proj, `index_{q,k}_proj`).
A `minimax_m3_vl` checkpoint loads as the VL model (this file reads its text tower, `hf_vision.load_vision` adds the
vision tower and projector); `text_only=True` loads just the text tower and drops the vision tensors explicitly
(never silently).

Our parameters are laid out for einsum and sharding ([in, heads, head_dim], gate/up on their own axis); HF's are
torch Linear [out, in]. Every tensor has one `Rule` (interop/rules.py) giving both directions, so load and save are
exact inverses.
Loading streams tensor by tensor onto the target shardings: with a mesh, each device's shard is sliced out of the
memory-mapped file, so no host ever holds the whole model (and, in the hf layouts, not even a whole tensor).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.core.sharding import state_shardings
from m3_jax.interop import hf_vision, safetensors_io
from m3_jax.interop.rules import Rule, get_path, linear, linear_out, same, set_path, transpose_last2
from m3_jax.models.attention import attention_class
from m3_jax.models.attention.msa import MSAAttention
from m3_jax.models.config import MLP_DENSE, TextConfig, VLConfig
from m3_jax.models.hf_config import hf_config_dict, resolve_text_config
from m3_jax.models.multimodal import VLModel
from m3_jax.models.transformer import TextModel, layer_locations

# Keys HF itself drops on load (multi-token-prediction heads are not part of the causal LM).
IGNORED = (re.compile(r"(^|\.)mtp\."),)
LAYOUTS = ("hf", "hf_vl", "minimax")


# ---- config.json ------------------------------------------------------------------------------------------------

def _stored_dtype(raw: dict) -> str | None:
  for d in (raw.get("text_config") or {}, raw):
    v = d.get("dtype", d.get("torch_dtype"))
    if isinstance(v, str) and v != "auto":
      return v
  return None


def read_config(path: str | dict, **overrides) -> TextConfig:
  """TextConfig from a checkpoint directory, a config.json path or its parsed dict; `overrides` set our own
  fields (dtype, param_dtype, attention_impl, moe_impl, ...) or replace HF ones."""
  raw, where = _raw_config(path)
  return TextConfig(**{**resolve_text_config(raw, where), **overrides})


def _raw_config(path: str | dict) -> tuple[dict, str]:
  if isinstance(path, dict):
    return path, "config"
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.exists(file):
    raise FileNotFoundError(f"{path}: no config.json")
  with open(file) as f:
    try:
      raw = json.load(f)
    except ValueError as e:  # UnicodeDecodeError included
      raise ValueError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise ValueError(f"{file}: a JSON {type(raw).__name__}, not the config object")
  return raw, file


# ---- tensor rules -----------------------------------------------------------------------------------------------

def _gate_up(d: int, i: int) -> tuple[Callable, Callable]:
  """HF [2I, d] (gate rows first) <-> ours [d, 2, I]."""
  return (lambda w: w.reshape(2, i, d).transpose(2, 0, 1)), (lambda w: w.transpose(1, 2, 0).reshape(2 * i, d))


def _experts_gate_up(e: int, d: int, i: int) -> tuple[Callable, Callable]:
  """HF [E, 2I, d] <-> ours [E, d, 2, I]."""
  return (lambda w: w.reshape(e, 2, i, d).transpose(0, 3, 1, 2)), \
         (lambda w: w.transpose(0, 2, 3, 1).reshape(e, 2 * i, d))


def _rule(ours: tuple, hf: str, hf_shape: tuple[int, ...], maps: tuple) -> Rule:
  return Rule(ours, hf, *maps, hf_shape=hf_shape)


def _attention_rules(cfg: TextConfig, layer_type: str, p: str, L: tuple) -> list[Rule]:
  """Layer `L`'s attention (HF names under `p`); MSA layers add their indexer."""
  d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  A, a = L + ("self_attn",), p + "self_attn."
  out = [_rule(A + ("q_proj",), a + "q_proj.weight", (hq * hd, d), linear(d, hq, hd)),
         _rule(A + ("k_proj",), a + "k_proj.weight", (hkv * hd, d), linear(d, hkv, hd)),
         _rule(A + ("v_proj",), a + "v_proj.weight", (hkv * hd, d), linear(d, hkv, hd)),
         _rule(A + ("o_proj",), a + "o_proj.weight", (d, hq * hd), linear_out(hq, hd, d)),
         _rule(A + ("q_norm", "weight"), a + "q_norm.weight", (hd,), same()),
         _rule(A + ("k_norm", "weight"), a + "k_norm.weight", (hd,), same())]
  if issubclass(attention_class(layer_type), MSAAttention):
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    IX, ix = A + ("indexer",), a + "indexer."
    out += [_rule(IX + ("q_proj",), ix + "q_proj.weight", (hi * di, d), linear(d, hi, di)),
            _rule(IX + ("k_proj",), ix + "k_proj.weight", (di, d), linear(d, di)),
            _rule(IX + ("q_norm", "weight"), ix + "q_norm.weight", (di,), same()),
            _rule(IX + ("k_norm", "weight"), ix + "k_norm.weight", (di,), same())]
  return out


def _mlp_rules(cfg: TextConfig, mlp_type: str, p: str, L: tuple) -> list[Rule]:
  """Layer `L`'s dense MLP or MoE (router, its bias, stacked experts, shared expert)."""
  d, M = cfg.hidden_size, L + ("mlp",)
  if mlp_type == MLP_DENSE:
    di = cfg.dense_intermediate_size
    return [_rule(M + ("gate_up",), p + "mlp.gate_up_proj.weight", (2 * di, d), _gate_up(d, di)),
            _rule(M + ("down",), p + "mlp.down_proj.weight", (d, di), transpose_last2())]
  e, i, si = cfg.num_local_experts, cfg.intermediate_size, cfg.shared_intermediate_size
  return [_rule(M + ("router",), p + "mlp.gate.weight", (e, d), transpose_last2()),
          _rule(M + ("e_score_correction_bias",), p + "mlp.gate.e_score_correction_bias", (e,), same()),
          _rule(M + ("gate_up",), p + "mlp.experts.gate_up_proj", (e, 2 * i, d), _experts_gate_up(e, d, i)),
          _rule(M + ("down",), p + "mlp.experts.down_proj", (e, d, i), transpose_last2()),
          _rule(M + ("shared", "gate_up"), p + "mlp.shared_experts.gate_up_proj.weight", (2 * si, d),
                _gate_up(d, si)),
          _rule(M + ("shared", "down"), p + "mlp.shared_experts.down_proj.weight", (d, si), transpose_last2())]


def rules(cfg: TextConfig) -> list[Rule]:
  """One rule per tensor of the text model, in canonical (`hf` layout) names. HF names are per layer in either of
  our layouts: a layer of a scanned stack (cfg.scan_layers) is row `Rule.row` of the stack's tensor."""
  d, v = cfg.hidden_size, cfg.vocab_size
  out = [_rule(("embed_tokens",), "model.embed_tokens.weight", (v, d), same()),
         _rule(("norm", "weight"), "model.norm.weight", (d,), same()),
         _rule(("lm_head",), "lm_head.weight", (v, d), transpose_last2())]
  locations = layer_locations(cfg)
  for li, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
    p, (L, row) = f"model.layers.{li}.", locations[li]
    layer = [_rule(L + ("input_layernorm", "weight"), p + "input_layernorm.weight", (d,), same()),
             _rule(L + ("post_attention_layernorm", "weight"), p + "post_attention_layernorm.weight", (d,), same())]
    layer += _attention_rules(cfg, lt, p, L) + _mlp_rules(cfg, mt, p, L)
    out += [dataclasses.replace(r, row=row) for r in layer]
  return out


# ---- name layouts -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
  """How one canonical tensor is stored: a single tensor (`one`), gate/up halves concatenated on dim 0 (`cat`),
  per-expert tensors stacked on a new dim 0 (`stack`), or per-expert gate/up pairs (`stack_cat`, parts ordered
  w1_0, w3_0, w1_1, ...)."""
  kind: str
  parts: tuple[tuple[str, tuple[int, ...]], ...]  # (name, shape) of every stored tensor

  @property
  def names(self) -> list[str]:
    return [n for n, _ in self.parts]

  def assemble(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
    if self.kind == "one":
      return arrays[0]
    if self.kind == "cat":
      return np.concatenate(arrays, axis=0)
    if self.kind == "stack":
      return np.stack(arrays)
    return np.stack([np.concatenate(arrays[j:j + 2], axis=0) for j in range(0, len(arrays), 2)])

  def split(self, x: np.ndarray) -> list[np.ndarray]:
    if self.kind == "one":
      return [x]
    if self.kind == "cat":
      return list(np.split(x, 2, axis=0))
    if self.kind == "stack":
      return list(x)
    return [half for e in x for half in np.split(e, 2, axis=0)]


def _minimax_name(name: str) -> str:
  if name == "lm_head.weight":
    return "language_model.lm_head.weight"
  name = "language_model." + name
  name = re.sub(r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias", name)
  name = re.sub(r"\.mlp\.(gate|experts|shared_experts)\.", r".block_sparse_moe.\1.", name)
  return re.sub(r"\.self_attn\.indexer\.(q_proj|k_proj|q_norm|k_norm)\.", r".self_attn.index_\1.", name)


def source(rule: Rule, layout: str) -> Source:
  """Where the canonical tensor of `rule` is stored in `layout`."""
  name, shape = rule.hf, rule.hf_shape
  if layout == "hf":
    return Source("one", ((name, shape),))
  if layout == "hf_vl":
    return Source("one", ((name.replace("model.", "model.language_model.", 1) if name.startswith("model.")
                           else name, shape),))
  if layout != "minimax":
    raise ValueError(f"layout={layout!r}; expected one of {LAYOUTS}")
  mm = _minimax_name(name)
  if name.endswith("experts.gate_up_proj"):  # [E, 2I, d] <- w1 (gate) and w3 (up) of every expert, [I, d] each
    e, i2, d = shape
    base = mm[:-len("gate_up_proj")]
    return Source("stack_cat", tuple((f"{base}{x}.{w}.weight", (i2 // 2, d)) for x in range(e) for w in ("w1", "w3")))
  if name.endswith("experts.down_proj"):  # [E, d, I] <- w2 of every expert, [d, I] each
    base = mm[:-len("down_proj")]
    return Source("stack", tuple((f"{base}{x}.w2.weight", shape[1:]) for x in range(shape[0])))
  if name.endswith("gate_up_proj.weight"):  # [2I, d] <- gate_proj and up_proj, [I, d] each
    base = mm[:-len("gate_up_proj.weight")]
    half = (shape[0] // 2, shape[1])
    return Source("cat", ((base + "gate_proj.weight", half), (base + "up_proj.weight", half)))
  return Source("one", ((mm, shape),))


def detect_layout(names: Sequence[str]) -> str:
  names = list(names)
  if any(n.startswith("language_model.model.") for n in names):
    return "minimax"
  if any(n.startswith("model.language_model.") for n in names):
    return "hf_vl"
  if any(n.startswith("model.layers.") or n == "model.embed_tokens.weight" for n in names):
    return "hf"
  raise ValueError(f"no MiniMax-M3 text tensors among {sorted(names)[:8]}{' ...' if len(names) > 8 else ''}; "
                   "expected names under model.*, model.language_model.* or language_model.model.*")


# ---- the load plan: every tensor, its target and its sharding ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """One HF tensor's target. For a layer of a scanned stack (`rule.row` set) shape, logical_axes and sharding are
  the layer's own (the stack's without its leading layer axis); target_shape / target_sharding are the stack's."""
  rule: Rule
  source: Source
  shape: tuple[int, ...]  # ours
  dtype: Any
  logical_axes: tuple | None
  sharding: Any  # NamedSharding or None (no mesh)
  target_shape: tuple[int, ...] = ()
  target_sharding: Any = None

  @property
  def ours(self) -> str:
    path = "/".join(map(str, self.rule.ours))
    return path if self.rule.row is None else f"{path}[{self.rule.row}]"

  @property
  def kind(self) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.*.", self.rule.hf)

  def shard_shape(self) -> tuple[int, ...]:
    return tuple(self.shape) if self.sharding is None else tuple(self.sharding.shard_shape(self.shape))

  def bytes_global(self) -> int:
    return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

  def bytes_by_device(self) -> dict[Any, int]:
    """Bytes each device holds, from the sharding's index map (replicas count on every device)."""
    item = jnp.dtype(self.dtype).itemsize
    if self.sharding is None:
      return {None: self.bytes_global()}
    out = {}
    for dev, idx in self.sharding.devices_indices_map(tuple(self.shape)).items():
      out[dev] = item * math.prod(len(range(*s.indices(n))) for s, n in zip(idx, self.shape))
    return out


@dataclasses.dataclass
class LoadPlan:
  config: TextConfig
  layout: str
  mesh: Any
  entries: list[PlanEntry]
  graphdef: Any
  state: Any  # the abstract nnx.State the entries fill

  def bytes_per_device(self) -> dict[Any, int]:
    total: dict[Any, int] = {}
    for e in self.entries:
      for dev, b in e.bytes_by_device().items():
        total[dev] = total.get(dev, 0) + b
    return total

  def abstract_model(self) -> TextModel:
    """The model with ShapeDtypeStruct leaves that carry their target shardings (nothing is allocated)."""
    pure = nnx.to_pure_dict(self.state)
    for e in self.entries:
      set_path(pure, e.rule.ours, jax.ShapeDtypeStruct(e.target_shape, e.dtype, sharding=e.target_sharding))
    state = jax.tree.map(lambda x: x, self.state)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(self.graphdef, state)


def plan(cfg: TextConfig, mesh=None, *, layout: str = "hf") -> LoadPlan:
  """Every tensor of `cfg`'s text model: its stored name(s) in `layout`, our path, shape, dtype and (with a mesh)
  the sharding it is loaded onto. Shape-only: nothing is read or allocated."""
  abstract = nnx.eval_shape(lambda: TextModel(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = {k: v for k, v in nnx.to_flat_state(state)}
  shardings = None
  if mesh is not None:
    shardings = {k: v for k, v in nnx.to_flat_state(state_shardings(state, mesh))}
  entries, seen = [], set()
  for r in rules(cfg):
    if r.ours not in flat:
      raise AssertionError(f"rule for {r.hf} targets {r.ours}, which the model does not have")
    var = flat[r.ours]
    val = var.get_value()
    sh = None if shardings is None else shardings[r.ours].get_value()
    entries.append(_entry(r, source(r, layout), val, var.get_metadata().get("logical_axes"), sh))
    seen.add(r.ours)
  uncovered = sorted("/".join(map(str, k)) for k in flat if k not in seen)
  if uncovered:  # a model variable no checkpoint tensor fills would stay uninitialised
    raise AssertionError(f"no HF tensor maps to our {uncovered}")
  return LoadPlan(cfg, layout, mesh, entries, graphdef, state)


def _entry(r: Rule, src: Source, val, axes: tuple | None, sh) -> PlanEntry:
  """The plan entry of rule `r` whose target variable has value `val` (abstract) and sharding `sh`; a stack row
  takes the stack's shape, axes and sharding without the leading layer axis ("layers" is never sharded)."""
  shape = tuple(val.shape)
  if r.row is None:
    return PlanEntry(r, src, shape, val.dtype, axes, sh, shape, sh)
  row_sh = None if sh is None else jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*sh.spec[1:]))
  return PlanEntry(r, src, shape[1:], val.dtype, None if axes is None else tuple(axes[1:]), row_sh, shape, sh)


# Stored dtypes we convert exactly; anything else (int8 / fp8 quantised weights, which come with scale tensors) is
# refused rather than cast without its scales.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _check_names(path: str, entries: list[PlanEntry], shapes: dict[str, tuple], *, text_only: bool,
                 dtypes: dict[str, str] | None = None) -> None:
  """One error listing every missing, unexpected, mis-shaped and non-float tensor."""
  expected = {n: (s, e) for e in entries for n, s in e.source.parts}
  missing = [n for n in expected if n not in shapes]
  vision = [n for n in shapes if hf_vision.VISION_NAMES.search(n)]
  unexpected = sorted(n for n in shapes if n not in expected and not any(p.search(n) for p in IGNORED)
                      and not (text_only and hf_vision.VISION_NAMES.search(n)))
  misshaped = [f"{n} has shape {tuple(shapes[n])}, expected {tuple(s)} (for our {e.ours} of shape {e.shape})"
               for n, (s, e) in expected.items() if n in shapes and tuple(shapes[n]) != tuple(s)]
  dtypes = dtypes or {}
  not_float = [f"{n} ({dtypes[n]})" for n in expected if n in dtypes and dtypes[n] not in FLOAT_DTYPES]
  if not (missing or unexpected or misshaped or not_float):
    return

  def few(xs):
    return f"{xs[:20]}{f' ... ({len(xs)} in all)' if len(xs) > 20 else ''}"

  msg = [f"{path}: checkpoint does not match its config.json:"]
  if missing:
    msg.append(f"missing {few(missing)}")
  if unexpected:
    msg.append(f"unexpected {few(unexpected)}")
    if vision and not text_only:
      msg.append(f"({len(vision)} of them are vision tower / projector tensors of a VL checkpoint: pass "
                 "text_only=True to load only its text tower)")
  if misshaped:
    msg.append("mis-shaped: " + "; ".join(misshaped[:20]))
  if not_float:
    msg.append(f"not floating point (quantised checkpoints are not supported): {few(not_float)}")
  raise ValueError("\n  ".join(msg))


def _resolve(path: str, dtype: str | None, overrides: dict) -> TextConfig:
  raw, where = _raw_config(path)
  kw = resolve_text_config(raw, where)
  # dtype=None keeps the checkpoint's precision (HF's dtype="auto"): parameters and compute in the stored dtype.
  dt = dtype or _stored_dtype(raw)
  if dt is not None:
    dt = jnp.dtype(dt).name
    kw.update(dtype=dt, param_dtype=dt)
  kw.update(overrides)
  return TextConfig(**kw)


def load_plan(path: str, dtype: str | None = None, mesh=None, *, text_only: bool = False,
              **overrides) -> LoadPlan:
  """Reads config.json and the safetensors headers only (no tensor data) and checks every stored name and shape
  against the config: the plan `load` executes. Arguments as for `load`."""
  cfg = _resolve(path, dtype, overrides)
  ckpt = safetensors_io.Checkpoint(path)
  p = plan(cfg, mesh, layout=detect_layout(ckpt.names))
  _check_names(path, p.entries, {n: ckpt.shape(n) for n in ckpt.names}, text_only=text_only,
               dtypes={n: ckpt.dtype(n) for n in ckpt.names})
  return p


def _is_vl(raw: dict) -> bool:
  return raw.get("model_type") == "minimax_m3_vl" or "text_config" in raw


def load(path: str, dtype: str | None = None, mesh=None, *, text_only: bool = False, abstract: bool = False,
         vision_overrides: dict | None = None, **overrides) -> tuple[TextModel | VLModel, TextConfig | VLConfig]:
  """Loads an HF MiniMax-M3 checkpoint directory. Returns (model, config); `model(input_ids)` with input_ids an
  int array [B, T] gives (logits [B, T, vocab] f32, aux). A `minimax_m3_vl` checkpoint gives the VL model and its
  VLConfig (the vision tower and projector from `hf_vision.load_vision`), which also takes the visual inputs;
  text_only=True its text tower.

  dtype: parameter and compute dtype (None: config.json's `dtype`, i.e. the stored precision, as HF's
    dtype="auto"; float32 if the file names none). The vision tower of a VL checkpoint takes the same.
  mesh: place every tensor straight onto its sharding on this mesh (each device reads only its shard).
  text_only: load the text tower of a `minimax_m3_vl` checkpoint, dropping its vision tensors.
  abstract: read config.json and the safetensors headers only; the model's leaves are ShapeDtypeStructs carrying
    the shardings they would be loaded onto (`load_plan` gives the per-tensor table). Works on a shape-only
    checkpoint (`abstract_checkpoint`).
  vision_overrides: VisionConfig fields of a VL checkpoint, e.g. {"max_frames": 2}.
  overrides: TextConfig fields (attention_impl, moe_impl, param_dtype, ...).
  """
  raw, _ = _raw_config(path)
  vl = not text_only and _is_vl(raw)
  if vision_overrides and not vl:
    raise ValueError(f"{path}: vision_overrides={vision_overrides} given, but the text tower only is loaded "
                     f"(text_only={text_only}, model_type={raw.get('model_type')!r})")
  if vl:
    if abstract:
      raise ValueError(f"{path}: abstract=True plans the text tower only; pass text_only=True")
    text_model, text_cfg = load(path, dtype, mesh, text_only=True, **overrides)
    return hf_vision.load_vision(path, raw, text_model, text_cfg, mesh=mesh, vision_overrides=vision_overrides)
  p = load_plan(path, dtype, mesh, text_only=text_only, **overrides)
  if abstract:
    return p.abstract_model(), p.config
  ckpt = safetensors_io.Checkpoint(path)
  pure = nnx.to_pure_dict(p.state)
  stacks: dict[tuple, jax.Array] = {}  # a scanned stack's tensor, filled one layer (row) at a time
  for e in p.entries:
    view = e.rule.to_ours(_canonical(ckpt, e.source))
    assert tuple(view.shape) == e.shape, (e.rule.hf, view.shape, e.shape)
    if e.rule.row is None:
      set_path(pure, e.rule.ours, _place(view, e.dtype, e.sharding))
      continue
    if e.rule.ours not in stacks:
      stacks[e.rule.ours] = _zeros(e.target_shape, e.dtype, e.target_sharding)
    stacks[e.rule.ours] = _set_row(stacks[e.rule.ours], _place(view, e.dtype, e.sharding), e.rule.row)
  for ours, arr in stacks.items():
    set_path(pure, ours, arr)
  nnx.replace_by_pure_dict(p.state, pure)
  return nnx.merge(p.graphdef, p.state), p.config


def abstract_checkpoint(cfg: TextConfig, path: str, *, layout: str = "hf", dtype: str = "bfloat16") -> None:
  """Writes a shape-only checkpoint of `cfg`: config.json + a safetensors header naming every tensor (in `layout`)
  with its shape, and no data. `load(path, mesh=..., abstract=True)` and `load_plan` read it like the real one."""
  os.makedirs(path, exist_ok=True)
  specs = {}
  for r in rules(cfg):
    for name, shape in source(r, layout).parts:
      specs[name] = (jnp.dtype(dtype), shape)
  safetensors_io.write_header(os.path.join(path, "model.safetensors"), specs, metadata={"format": "pt"})
  d = hf_config_dict(cfg)
  d["dtype"] = jnp.dtype(dtype).name
  if layout != "hf":  # the VL layouts come with the VL config; its text part is what we read
    d = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
         "text_config": d}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(d, f, indent=2)


def _canonical(ckpt: safetensors_io.Checkpoint, src: Source) -> np.ndarray:
  """The canonical tensor: a view of the memory map for single tensors; composites are assembled in host memory
  (one tensor at a time)."""
  return src.assemble([ckpt.get(n) for n in src.names])


def _place(view: np.ndarray, dtype, sharding) -> jax.Array:
  if sharding is None:
    return jnp.asarray(np.asarray(view).astype(dtype))
  # Each addressable device gets its own slice of the (lazy) view: a host reads only the bytes its devices hold.
  return jax.make_array_from_callback(tuple(view.shape), sharding,
                                      lambda idx: np.ascontiguousarray(view[idx]).astype(dtype))


def _update_row(stack: jax.Array, row_value: jax.Array, row) -> jax.Array:
  return jax.lax.dynamic_update_index_in_dim(stack, row_value.astype(stack.dtype), row, 0)


@functools.lru_cache(maxsize=None)
def _row_setter(sharding):
  # Donated and pinned to the stack's sharding, so the update is in place: a device holds the stack plus one
  # layer, never two stacks. The row is traced: each (shape, sharding) compiles once for all its layers.
  return jax.jit(_update_row, donate_argnums=0, out_shardings=sharding)


def _set_row(stack: jax.Array, row_value: jax.Array, row: int) -> jax.Array:
  """stack [L, ...] with row `row` replaced by row_value [...] (in place)."""
  return _row_setter(stack.sharding if isinstance(stack.sharding, jax.sharding.NamedSharding) else None)(
      stack, row_value, row)


@jax.jit
def _get_row(stack: jax.Array, row) -> jax.Array:
  """stack [L, ...] -> its row `row` [...], sliced where the stack lives (the row is traced: one compile)."""
  return jax.lax.dynamic_index_in_dim(stack, row, 0, keepdims=False)


def _zeros(shape: tuple[int, ...], dtype, sharding) -> jax.Array:
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


# ---- save -------------------------------------------------------------------------------------------------------

def save(model: TextModel, config: TextConfig, path: str, *, dtype: str | None = None,
         max_shard_size: int | None = None) -> None:
  """Writes config.json + safetensors in HF's text layout (`MiniMaxM3VLForCausalLM`), the inverse of `load`.

  dtype: cast floating tensors (default: as held). max_shard_size: bytes per file; above it the tensors go to
  `model-0000i-of-0000n.safetensors` files with a `model.safetensors.index.json`, like HF's save_pretrained.
  Tensors are gathered to this host one at a time; the writer runs on one process.
  """
  os.makedirs(path, exist_ok=True)
  pure = nnx.to_pure_dict(nnx.state(model))
  tensors = []
  for r in rules(config):
    arr = get_path(pure, r.ours)
    if r.row is not None:  # one layer of a scanned stack: sliced on the devices, so only that layer is gathered
      arr = _get_row(arr, r.row)
    arr = np.asarray(jax.device_get(arr))
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
      arr = arr.astype(jnp.dtype(dtype))
    hf_arr = np.ascontiguousarray(r.to_hf(arr))
    if tuple(hf_arr.shape) != r.hf_shape:
      raise AssertionError(f"{r.hf}: wrote shape {hf_arr.shape}, expected {r.hf_shape}")
    tensors.append((r.hf, hf_arr))
  for stale in os.listdir(path):  # a previous save's files would shadow or mix with this one's
    if stale in ("model.safetensors", "model.safetensors.index.json") or re.fullmatch(
        r"model-\d+-of-\d+\.safetensors", stale):
      os.remove(os.path.join(path, stale))
  shards: list[list] = [[]]
  size = 0
  for name, arr in tensors:
    if max_shard_size is not None and shards[-1] and size + arr.nbytes > max_shard_size:
      shards.append([])
      size = 0
    shards[-1].append((name, arr))
    size += arr.nbytes
  if len(shards) == 1:
    safetensors_io.write(os.path.join(path, "model.safetensors"), shards[0], metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      safetensors_io.write(os.path.join(path, fn), shard, metadata={"format": "pt"})
      weight_map.update({name: fn for name, _ in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": sum(a.nbytes for _, a in tensors)}, "weight_map": weight_map}, f,
                indent=2)
  cfg_dict = hf_config_dict(config)
  if dtype is not None:
    cfg_dict["dtype"] = jnp.dtype(dtype).name
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg_dict, f, indent=2)
