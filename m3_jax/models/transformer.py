"""The M3 text tower: embeddings, decoder layers (dense or MSA attention x dense MLP or MoE), final norm, LM head.

`TextModel(cfg, rngs=...)(input_ids, positions, segment_ids)` returns `(logits [B, T, V] f32, aux)`, where aux holds
the auxiliary losses and metrics (`moe_aux_loss`, `expert_load`, MSA's `kl_loss` and per-layer metrics) and,
with `capture_attention=True`, per-layer attention probabilities and MSA selections for analysis
(`capture_attention="selection"`: the MSA selections alone, with every layer on its usual attention path).

With `scan_layers=True` every run of two or more consecutive layers of one (layer type, MLP type) is a `LayerStack`
(one `jax.lax.scan` over parameters stacked on a leading layer axis); `layer_locations(cfg)` says where each layer's
parameters live in either layout and `stack_layers` / `unstack_layers` convert a pure-dict state between them.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.core.sharding import constrain
from m3_jax.models.attention import make_attention
from m3_jax.models.attention.dense import CAPTURES, captures_probs
from m3_jax.models.attention.msa import SELECTION_NAME
from m3_jax.models.config import MLP_DENSE, TextConfig
from m3_jax.models.layers import DenseMLP, RMSNorm, param
from m3_jax.models.moe import MoE, MoEDims


# The logical name of a scanned stack's leading layer axis (core/sharding.py maps it to no mesh axis).
LAYER_AXIS = "layers"

# Primitives cheap enough to recompute in the backward: elementwise, layout and gather work, which XLA fuses into the
# backward's own kernels. Everything else (dot_general, attention and Pallas / Mosaic kernels, sorts, reductions)
# stays saved.
_RECOMPUTED_PRIMITIVES = frozenset((
    "abs", "add", "add_any", "and", "broadcast_in_dim", "clamp", "concatenate", "convert_element_type", "copy", "cos",
    "div", "dynamic_slice", "eq", "erf", "exp", "exp2", "gather", "ge", "gt", "integer_pow", "iota", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "one_minus_square", "or", "pad", "pow",
    "reduce_precision", "reshape", "rev", "rsqrt", "select_n", "sharding_constraint", "sign", "sin", "slice", "split",
    "sqrt", "square", "squeeze", "sub", "tanh", "transpose"))


def _save_matmuls(prim, *_, **__) -> bool:
  return prim.name not in _RECOMPUTED_PRIMITIVES


# TextConfig.remat_policy -> jax.checkpoint policy (None: save nothing, recompute the whole layer).
_REMAT_POLICIES = {"full": None, "save_selection": jax.checkpoint_policies.save_only_these_names(SELECTION_NAME),
                   "save_matmuls": _save_matmuls}


def _dtype(name: str):
  return jnp.dtype(name)


def _remat(fn, policy: str | None, *, prevent_cse: bool = True):
  """fn under jax.checkpoint with the named TextConfig.remat_policy; policy None: fn itself (no remat)."""
  if policy is None:
    return fn
  return jax.checkpoint(fn, policy=_REMAT_POLICIES[policy], prevent_cse=prevent_cse)


def layer_runs(layer_types: Sequence[str], mlp_layer_types: Sequence[str]) -> list[tuple[int, int]]:
  """(first layer, length) of every run of consecutive layers with the same (layer type, MLP type), in order.
  M3: [(0, 3), (3, 57)] (dense attention + dense MLP, then MSA + MoE)."""
  runs: list[tuple[int, int]] = []
  kinds = list(zip(layer_types, mlp_layer_types))
  for i, kind in enumerate(kinds):
    if runs and kinds[runs[-1][0]] == kind:
      runs[-1] = (runs[-1][0], runs[-1][1] + 1)
    else:
      runs.append((i, 1))
  return runs


def layer_locations(cfg: TextConfig) -> list[tuple[tuple, int | None]]:
  """For every layer i: (path of its DecoderLayer in the model's state, row of the leading layer axis or None).
  Unscanned: (("layers", i), None); scanned, a run of one stays a plain layer (("layers", run), None), a longer
  run is a stack (("layers", run, "layer"), i - first)."""
  if not cfg.scan_layers:
    return [(("layers", i), None) for i in range(cfg.num_hidden_layers)]
  out = []
  for r, (first, n) in enumerate(layer_runs(cfg.layer_types, cfg.mlp_layer_types)):
    out += [(("layers", r), None)] if n == 1 else [(("layers", r, "layer"), j) for j in range(n)]
  return out


def per_layer_keys(cfg: TextConfig, key: tuple) -> list[tuple[tuple, int | None]]:
  """A flat state key of the model `cfg` builds -> [(the unscanned model's key, row of the leading layer axis or
  None)]: one entry per layer a stacked variable holds, the key itself for everything else."""
  if not cfg.scan_layers or key[:1] != ("layers",):
    return [(key, None)]
  first, n = layer_runs(cfg.layer_types, cfg.mlp_layer_types)[key[1]]
  if n == 1:
    return [(("layers", first) + key[2:], None)]
  return [(("layers", first + j) + key[3:], j) for j in range(n)]  # key[2] is the stack's "layer"


def _stack_variables(*vs: nnx.Variable) -> nnx.Variable:
  """Equal-shaped Variables of consecutive layers -> one Variable [L, ...], its logical axes behind LAYER_AXIS."""
  axes = vs[0].get_metadata().get("logical_axes")
  meta = {} if axes is None else {"logical_axes": (LAYER_AXIS,) + tuple(axes)}
  return vs[0].replace(jnp.stack([v.get_value() for v in vs]), **meta)


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


class LayerStack(nnx.Module):
  """`count` (>= 2) consecutive decoder layers of one (layer type, MLP type), from layer `first` on, run by one
  `jax.lax.scan`: `layer` is one DecoderLayer whose every variable holds the `count` layers' values on a leading
  axis (logical name "layers", never sharded), so XLA compiles one layer body for the whole run.

  Why jax.lax.scan over (graphdef, stacked state) and not nnx.scan: the forward reads the variables and mutates
  none, so a pure scan over the split state is exact (the same split / merge as the unscanned remat path), our
  `logical_axes` metadata stays ours to prefix (nnx's transform_metadata updates its own sharding metadata, not
  this key), and decoding takes per-layer slices of the same state (`layer_at`).
  """

  def __init__(self, layers: Sequence[DecoderLayer], first: int):
    kinds = {(layer.layer_type, layer.mlp_type) for layer in layers}
    if len(layers) < 2 or len(kinds) != 1:
      raise ValueError(f"LayerStack: needs >= 2 layers of one (layer type, MLP type), got {len(layers)} of {kinds}")
    self.first, self.count = first, len(layers)
    self.layer_type, self.mlp_type = layers[0].layer_type, layers[0].mlp_type
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    self.layer = nnx.merge(graphdef, jax.tree.map(_stack_variables, *states,
                                                  is_leaf=lambda v: isinstance(v, nnx.Variable)))

  def layer_at(self, j: int) -> DecoderLayer:
    """Layer `first + j` as a DecoderLayer over row j of the stacked variables: a read-only view (decoding)."""
    graphdef, state = nnx.split(self.layer)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[j], state))

  def __call__(self, x, positions, segment_ids, mask, *, capture=False, step_state=None,
               remat_policy: str | None = None):
    """x: [B, T, d] -> (x [B, T, d], aux of DecoderLayer with every leaf stacked [count, ...] in layer order).
    remat_policy: each layer's body under jax.checkpoint with that TextConfig.remat_policy (None: no remat, which
    under the scan means "save_matmuls": see below)."""
    graphdef, state = nnx.split(self.layer)

    def body(x, layer_state):
      layer = nnx.merge(graphdef, layer_state)
      return layer(x, positions, segment_ids, mask, capture=capture, step_state=step_state)

    # Without remat, autodiff of a scan saves every intermediate the backward reads, stacked [count, ...] by the
    # forward loop, and XLA cannot fuse across the loop boundary: f32 upcasts of bf16 activations (norms, RoPE,
    # SwiGLU) were written out as stacks at twice their size: small_lm's scanned step needed 2.5-2.8x the temporaries
    # of the unrolled one and ran 1.5x (dense) to 1.6x (MoE) slower on an H100. Unrolled, XLA recomputes that
    # elementwise work inside the backward's fusions; "save_matmuls" asks the scan for the same (BENCHMARKS.md,
    # 2026-12-07: temporaries below the unrolled step's, 1.3x faster than before).
    policy = "save_matmuls" if remat_policy is None else remat_policy
    # The scan already keeps XLA from merging the recompute into the forward: CSE prevention would only add
    # barriers (jax.checkpoint's documentation recommends prevent_cse=False under scan).
    return jax.lax.scan(_remat(body, policy, prevent_cse=False), x, state)


def _get(tree: dict, path: tuple) -> Any:
  for k in path:
    tree = tree[k]
  return tree


def _stack_arrays(*xs):
  """numpy in, numpy out (exact host conversions); jax arrays stack on device."""
  return np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)


def unstack_layers(pure: dict, cfg: TextConfig) -> dict:
  """A pure-dict state (`nnx.to_pure_dict`) of the model `cfg` builds -> the unscanned model's layout (`layers`
  keyed by layer index; stacked rows sliced out). Unscanned configs come back as they are. Exact: slices only.
  A partial state (e.g. the router biases alone) keeps the layers it has."""
  if not cfg.scan_layers or "layers" not in pure:
    return pure
  per_layer = {}
  for i, (path, row) in enumerate(layer_locations(cfg)):
    try:
      sub = _get(pure, path)
    except KeyError:
      continue
    per_layer[i] = sub if row is None else jax.tree.map(lambda a, r=row: a[r], sub)
  return {**pure, "layers": per_layer}


def stack_layers(pure: dict, cfg: TextConfig) -> dict:
  """The inverse of `unstack_layers`: an unscanned model's pure-dict state -> the layout of the model `cfg` builds
  (each run's layers stacked on a new leading axis). Exact: numpy stays numpy, values are only copied."""
  if not cfg.scan_layers or "layers" not in pure:
    return pure
  layers, src = {}, pure["layers"]
  for r, (first, n) in enumerate(layer_runs(cfg.layer_types, cfg.mlp_layer_types)):
    have = [first + j in src for j in range(n)]
    if not any(have):  # a partial state without this run
      continue
    if not all(have):
      raise ValueError(f"stack_layers: layers {first}..{first + n - 1} form one stack, but the state has only "
                       f"{[first + j for j in range(n) if have[j]]} of them")
    layers[r] = src[first] if n == 1 else {"layer": jax.tree.map(_stack_arrays, *[src[first + j] for j in range(n)])}
  return {**pure, "layers": layers}


class TextModel(nnx.Module):

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = _dtype(cfg.param_dtype)
    # Embedding std 1.0 would make the first residual stream dwarf the layers; 0.02 matches HF's initializer.
    self.embed_tokens = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                              std=cfg.initializer_range, dtype=pd)
    # Built layer by layer in both layouts, so a scanned model starts from the unscanned one's values, stacked.
    layers = [DecoderLayer(cfg, lt, mt, rngs=rngs) for lt, mt in zip(cfg.layer_types, cfg.mlp_layer_types)]
    if cfg.scan_layers:
      runs = layer_runs(cfg.layer_types, cfg.mlp_layer_types)
      layers = [layers[first] if n == 1 else LayerStack(layers[first:first + n], first) for first, n in runs]
    self.layers = nnx.List(layers)  # DecoderLayer, or LayerStack for a scanned run
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=pd)
    self.lm_head = param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), std=cfg.initializer_range,
                         dtype=pd)

  def _runs(self) -> list[tuple[int, int, Any]]:
    """(first layer index, number of layers, DecoderLayer or LayerStack) for every entry of `layers`."""
    out, i = [], 0
    for seg in self.layers:
      n = seg.count if isinstance(seg, LayerStack) else 1
      out.append((i, n, seg))
      i += n
    return out

  def moe_layers(self) -> list[tuple[int, MoE]]:
    """[(layer index, its MoE)] in the order of the rows of aux["expert_load"]. The layers of a scanned stack share
    the stack's MoE, whose variables hold one row per layer (`e_score_correction_bias` [count, E])."""
    return [(i + j, seg.layer.mlp if isinstance(seg, LayerStack) else seg.mlp)
            for i, n, seg in self._runs() if seg.mlp_type != MLP_DENSE for j in range(n)]

  def update_router_biases(self, expert_load: jax.Array, rate: float) -> None:
    """Aux-loss-free balancing of every MoE layer (in place) from a forward's aux["expert_load"] [L_moe, E]; a
    stack's bias rows take their layers' rows."""
    n_moe = len(self.moe_layers())
    if expert_load.shape[0] != n_moe:
      raise ValueError(f"update_router_biases: expert_load has {expert_load.shape[0]} rows, the model "
                       f"{n_moe} MoE layers")
    row = 0
    for _, n, seg in self._runs():
      if seg.mlp_type == MLP_DENSE:
        continue
      if isinstance(seg, LayerStack):
        seg.layer.mlp.update_bias(expert_load[row:row + n], rate)
      else:
        seg.mlp.update_bias(expert_load[row], rate)
      row += n

  def embed(self, input_ids: jax.Array) -> jax.Array:
    x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(_dtype(self.cfg.dtype))
    return constrain(x, ("activation_batch", "activation_length", "activation_embed"))

  def _run_layers(self, x, positions, segment_ids, mask, caches, capture: bool | str, step_state):
    """Every layer in order -> (x, [aux of layer i for every layer i]). Stacks scan unless decoding with caches,
    where each layer runs on its slice of the stacked variables with its own cache."""
    policy = self.cfg.remat_policy if self.cfg.remat and caches is None else None
    auxes = []

    def plain(layer, x, cache):
      def run(layer, x):
        return layer(x, positions, segment_ids, mask, cache=cache, capture=capture, step_state=step_state)
      if policy is None:
        return run(layer, x)
      # layers do not mutate state in the forward, so split/merge around the checkpoint is exact
      graphdef, state = nnx.split(layer)
      return _remat(lambda st, x: run(nnx.merge(graphdef, st), x), policy)(state, x)

    for first, n, seg in self._runs():
      if isinstance(seg, LayerStack) and caches is None:
        x, stacked = seg(x, positions, segment_ids, mask, capture=capture, step_state=step_state,
                         remat_policy=policy)
        auxes += [jax.tree.map(lambda a, j=j: a[j], stacked) for j in range(n)]
        continue
      for j in range(n):
        layer = seg.layer_at(j) if isinstance(seg, LayerStack) else seg
        x, aux = plain(layer, x, None if caches is None else caches[first + j])
        auxes.append(aux)
    return x, auxes

  def __call__(self, input_ids: jax.Array | None = None, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, *, inputs_embeds: jax.Array | None = None,
               loss_mask: jax.Array | None = None, caches: list | None = None, capture_attention: bool | str = False,
               step_state: Any = None, head: bool = True):
    """input_ids: [B, T] int (or inputs_embeds [B, T, d]); positions: [B, T] (default arange, offset by the cache
    length when decoding); segment_ids: [B, T] packing ids (None: one sequence per row).
    Returns (logits [B, T, V] f32, aux); with head=False (hidden [B, T, d] after the final norm, aux), for a loss
    that applies `head_logits` a chunk of tokens at a time."""
    if (input_ids is None) == (inputs_embeds is None):
      raise ValueError("TextModel: pass exactly one of input_ids and inputs_embeds")
    if capture_attention not in CAPTURES:
      raise ValueError(f"TextModel: capture_attention={capture_attention!r}, expected one of {CAPTURES}")
    x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.astype(_dtype(self.cfg.dtype))
    b, t = x.shape[:2]
    if positions is None:
      start = 0 if caches is None else caches[0].length
      positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = loss_mask if loss_mask is not None else (None if segment_ids is None else segment_ids > 0)
    x, auxes = self._run_layers(x, positions, segment_ids, mask, caches, capture_attention, step_state)
    x = self.norm(x)
    logits = self.head_logits(x) if head else x
    return logits, _collect_aux(auxes, capture=capture_attention, decoding=caches is not None)

  def head_logits(self, x: jax.Array) -> jax.Array:
    """Final-norm hidden states [B, T, d] -> logits [B, T, V] f32."""
    logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))


def _collect_aux(auxes: list[dict], *, capture: bool | str, decoding: bool) -> dict[str, Any]:
  """The model's aux from every layer's (in layer order): the MoE balance loss averaged and the KL summed over the
  layers that have them, expert_load [num_moe_layers, E], metrics as `layer{i}/NAME`, per-layer attention
  probabilities (capture=True) and MSA selections (capture=True or "selection"), the new caches (decoding)."""
  moe_losses = [a["moe_aux_loss"] for a in auxes if "moe_aux_loss" in a]
  loads = [a["expert_load"] for a in auxes if "moe_aux_loss" in a]
  kls = [a["kl_loss"] for a in auxes if "kl_loss" in a]
  out: dict[str, Any] = {
      "moe_aux_loss": sum(moe_losses) / len(moe_losses) if moe_losses else jnp.zeros((), jnp.float32),
      "kl_loss": sum(kls) if kls else jnp.zeros((), jnp.float32),
      "metrics": {f"layer{i}/{k}": v for i, a in enumerate(auxes) for k, v in a.get("metrics", {}).items()},
  }
  if loads:
    out["expert_load"] = jnp.stack(loads)  # [num_moe_layers, E]
  if captures_probs(capture):
    out["attention_probs"] = [a.get("attention_probs") for a in auxes]
  if capture:
    out["block_idx"] = [a.get("block_idx") for a in auxes]  # MSA layers: [B, Hkv, T, topk]; None for dense layers
  if decoding:
    out["caches"] = [a["cache"] for a in auxes if "cache" in a]
  return out
