"""The M3 vision tower (ViT with Conv3d patches, 3D axial RoPE and segment attention) and its projector.

`VisionTower(cfg)(pixels)`: pixels [N, F, H, W, C] (N items of F frames; an image is one frame repeated
`temporal_patch_size` times) -> patch features [N, F / tp, H / p, W / p, hidden] in (t, h, w) grid order.
`Projector(...)(features)` -> merged visual tokens [N, (F / tp) * (H / (p m)) * (W / (p m)), d_text] in (t, h, w)
raster order of the merged grid: the order in which they replace `<image>` / `<video>` placeholders.

Attention: the temporal patches of an item are cut into segments of `max_frames`; every patch attends to every
patch of its segment (full 3D attention) and to nothing else. Segments are computed as separate rows of one
batched attention (cost O(N * segment) rather than O(N^2)); a last, shorter segment is padded with masked keys.
HF's tower has no such notion: its video processor cuts videos into chunks of at most `vision_segment_max_frames`
temporal patches, each its own item whose temporal RoPE positions start at 0. Ours restart per segment too, so
`max_frames = vision_segment_max_frames` reproduces HF exactly (tests/fixtures/hf/vl_segments).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.core.sharding import constrain
from m3_jax.models.attention.core import key_length_mask, masked_attention
from m3_jax.models.config import VisionConfig
from m3_jax.models.layers import param, rotate_half

_ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_embed")


def activation(name: str):
  if name == "gelu":
    return lambda x: jax.nn.gelu(x, approximate=False)
  if name == "gelu_pytorch_tanh":
    return lambda x: jax.nn.gelu(x, approximate=True)
  if name == "quick_gelu":
    return lambda x: x * jax.nn.sigmoid(1.702 * x)
  raise ValueError(f"activation {name!r}; expected gelu, gelu_pytorch_tanh or quick_gelu")


def _const(shape: Sequence[int], axes: Sequence[str | None], value: float, dtype) -> nnx.Param:
  return nnx.Param(jnp.full(tuple(shape), value, dtype), logical_axes=tuple(axes))


class LayerNorm(nnx.Module):
  """LayerNorm with scale and bias, computed in f32 (torch.nn.LayerNorm semantics, biased variance)."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.weight = _const((dim,), ("norm",), 1.0, param_dtype)
    self.bias = _const((dim,), ("norm",), 0.0, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Module):
  """y = x @ kernel + bias with kernel [d_in, d_out] (HF's torch Linear stores kernel.T)."""

  def __init__(self, d_in: int, d_out: int, axes: tuple[str | None, str | None], *, rngs: nnx.Rngs, std: float,
               param_dtype=jnp.float32, dtype=jnp.float32):
    self.dtype = dtype
    self.kernel = param(rngs, (d_in, d_out), axes, std=std, dtype=param_dtype)
    self.bias = _const((d_out,), (axes[1],), 0.0, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.einsum("...i,io->...o", x, self.kernel[...].astype(self.dtype)) + self.bias[...].astype(self.dtype)


# ---- 3D axial RoPE ----------------------------------------------------------------------------------------------

def rope_inv_freq_3d(cfg: VisionConfig) -> np.ndarray:
  """[rope_axis_dim / 2] inverse frequencies, shared by the t, h and w axes (HF's axial rope)."""
  sd = cfg.rope_axis_dim
  return 1.0 / (cfg.rope_theta ** (np.arange(0, sd, 2, dtype=np.float64) / sd))


def patch_positions(num_temporal: int, grid_h: int, grid_w: int, max_frames: int) -> np.ndarray:
  """int32 [num_temporal, grid_h, grid_w, 3]: the (t, h, w) RoPE position of every patch of an item.

  t counts temporal patches from 0 inside each segment of `max_frames` (t mod max_frames), as HF does for each
  video chunk; h and w are the patch row and column.
  """
  t, h, w = np.meshgrid(np.arange(num_temporal) % max_frames, np.arange(grid_h), np.arange(grid_w), indexing="ij")
  return np.stack([t, h, w], axis=-1).astype(np.int32)


def apply_rope_3d(x: jax.Array, positions: jax.Array, cfg: VisionConfig) -> jax.Array:
  """3D axial RoPE on the first `cfg.rotary_dim` channels of each head; the rest pass through.

  x: [..., S, heads, head_dim]; positions: [S, 3] (t, h, w). Frequencies are laid out t-block, h-block, w-block
  (each rope_axis_dim / 2 wide) and duplicated (HF's cat(freqs, freqs)); channel c pairs with c + rotary_dim / 2
  (NeoX rotate-half). Angles in f32; the result is cast back to x.dtype.
  """
  r = cfg.rotary_dim
  inv = jnp.asarray(rope_inv_freq_3d(cfg), jnp.float32)
  angles = positions.astype(jnp.float32)[:, :, None] * inv  # [S, 3, sd / 2]
  angles = angles.reshape(angles.shape[0], r // 2)[:, None, :]  # [S, 1, R / 2]
  return rotate_half(x, jnp.cos(angles), jnp.sin(angles))


# ---- attention -------------------------------------------------------------------------------------------------

def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None, *, impl: str = "xla"):
  """Bidirectional attention inside each row of segments. q, k, v: [G, S, H, D]; kv_len: int32 [G], the number of
  real (unpadded) keys of each row, or None when no row is padded. Returns [G, S, H, D]."""
  if impl == "cudnn":
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, implementation="cudnn")
  if impl != "xla":
    raise ValueError(f"vision attention impl {impl!r}; expected 'xla' or 'cudnn'")
  mask = None if kv_len is None else key_length_mask(kv_len, k.shape[1])  # [G, 1, 1, S]
  return masked_attention(q, k, v, mask)


class VisionAttention(nnx.Module):
  """Multi-head self-attention with biases (HF q/k/v/out_proj), 3D RoPE on q and k, no q/k norm."""

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
    self.cfg, self.dtype = cfg, dtype
    d, h, hd, std = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.initializer_range
    for name in ("q_proj", "k_proj", "v_proj"):
      setattr(self, name, param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), std=std, dtype=param_dtype))
      setattr(self, name + "_bias", _const((h, hd), ("q_heads", "head_dim"), 0.0, param_dtype))
    self.out_proj = param(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"), std=std, dtype=param_dtype)
    self.out_proj_bias = _const((d,), ("norm",), 0.0, param_dtype)

  def __call__(self, x: jax.Array, positions: jax.Array, kv_len: jax.Array | None) -> jax.Array:
    """x: [G, S, d] (one segment per row); positions: [S, 3]; kv_len: [G] or None. Returns [G, S, d]."""
    dt = self.dtype

    def proj(name):
      return (jnp.einsum("gsd,dhk->gshk", x, getattr(self, name)[...].astype(dt))
              + getattr(self, name + "_bias")[...].astype(dt))  # [G, S, H, hd]

    q = apply_rope_3d(proj("q_proj"), positions, self.cfg)
    k = apply_rope_3d(proj("k_proj"), positions, self.cfg)
    v = proj("v_proj")
    q = constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
    k = constrain(k, ("activation_batch", "activation_length", "activation_heads", None))
    v = constrain(v, ("activation_batch", "activation_length", "activation_heads", None))
    o = segment_attention(q, k, v, kv_len, impl=self.cfg.attention_impl)  # [G, S, H, hd]
    return jnp.einsum("gshk,hkd->gsd", o, self.out_proj[...].astype(dt)) + self.out_proj_bias[...].astype(dt)


class VisionMLP(nnx.Module):

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
    kw = dict(rngs=rngs, std=cfg.initializer_range, param_dtype=param_dtype, dtype=dtype)
    self.act = activation(cfg.hidden_act)
    self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, ("embed", "mlp"), **kw)
    self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, ("mlp", "embed"), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.act(self.fc1(x))
    h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
    return self.fc2(h)


class VisionBlock(nnx.Module):
  """Pre-LN ViT block: x + attn(ln1(x)), then h + mlp(ln2(h))."""

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32):
    kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    self.layer_norm1 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)
    self.self_attn = VisionAttention(cfg, **kw)
    self.layer_norm2 = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=param_dtype)
    self.mlp = VisionMLP(cfg, **kw)

  def __call__(self, x, positions, kv_len):
    x = x + self.self_attn(self.layer_norm1(x), positions, kv_len)
    x = x + self.mlp(self.layer_norm2(x))
    return constrain(x, _ACTIVATION_AXES)


# ---- the tower -------------------------------------------------------------------------------------------------

def check_pixels(pixels, cfg: VisionConfig, *, what: str = "pixels") -> None:
  """Static shape checks of a [N, F, H, W, C] input (raises ValueError naming the argument)."""
  shape = tuple(pixels.shape)
  if len(shape) != 5:
    raise ValueError(f"{what}: expected [items, frames, height, width, channels], got shape {shape}")
  _, f, h, w, c = shape
  if f % cfg.temporal_patch_size or f == 0:
    raise ValueError(f"{what} of shape {shape}: frames={f} must be a positive multiple of temporal_patch_size="
                     f"{cfg.temporal_patch_size} (an image is one frame repeated temporal_patch_size times)")
  m = cfg.pixels_per_token
  if h % m or w % m or h == 0 or w == 0:
    raise ValueError(f"{what} of shape {shape}: height={h} and width={w} must be positive multiples of "
                     f"patch_size * spatial_merge_size = {m}")
  if c != cfg.num_channels:
    raise ValueError(f"{what} of shape {shape}: {c} channels, expected num_channels={cfg.num_channels}")


class VisionTower(nnx.Module):
  """Conv3d patch embedding (stride = kernel, no bias), pre-LayerNorm, pre-LN blocks with 3D RoPE, no post-LN."""

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    tp, p, c = cfg.temporal_patch_size, cfg.patch_size, cfg.num_channels
    # Conv3d with stride = kernel is a linear map of each non-overlapping [tp, p, p, C] tube.
    self.patch_embed = param(rngs, (tp, p, p, c, cfg.hidden_size), (None, None, None, None, "embed"),
                             std=cfg.patch_dim ** -0.5, dtype=pd)
    self.pre_layernorm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, param_dtype=pd)
    self.layers = nnx.List([VisionBlock(cfg, rngs=rngs, param_dtype=pd, dtype=dt)
                            for _ in range(cfg.num_hidden_layers)])

  def embed_patches(self, pixels: jax.Array) -> jax.Array:
    """pixels [N, F, H, W, C] -> [N, F / tp, H / p, W / p, hidden]."""
    cfg = self.cfg
    n, f, h, w, c = pixels.shape
    tp, p = cfg.temporal_patch_size, cfg.patch_size
    x = pixels.astype(jnp.dtype(cfg.dtype)).reshape(n, f // tp, tp, h // p, p, w // p, p, c)
    x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7)  # [N, T, gh, gw, tp, p, p, C]
    return jnp.einsum("nthwabcx,abcxd->nthwd", x, self.patch_embed[...].astype(x.dtype))

  def __call__(self, pixels: jax.Array, *, max_frames: int | None = None) -> jax.Array:
    """pixels: [N, F, H, W, C] -> [N, F / tp, H / p, W / p, hidden]. max_frames overrides cfg.max_frames."""
    cfg = self.cfg
    check_pixels(pixels, cfg)
    mf = cfg.max_frames if max_frames is None else int(max_frames)
    if mf <= 0:
      raise ValueError(f"VisionTower: max_frames={mf} must be positive")
    x = self.embed_patches(pixels)
    n, t, gh, gw, d = x.shape
    mf = min(mf, t)  # a segment never needs more slots than the item has temporal patches
    n_seg = -(-t // mf)
    pad = n_seg * mf - t
    x = self.pre_layernorm(x)
    if pad:
      x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    s = mf * gh * gw
    x = x.reshape(n * n_seg, s, d)  # [G, S, d]: one segment per row
    positions = jnp.asarray(patch_positions(mf, gh, gw, mf).reshape(s, 3))  # the same for every segment
    kv_len = None
    if pad:  # only the last segment of each item has padded slots; its real keys come first
      lens = np.full((n_seg,), s, np.int32)
      lens[-1] = (t - (n_seg - 1) * mf) * gh * gw
      kv_len = jnp.asarray(np.tile(lens, n))
    x = constrain(x, _ACTIVATION_AXES)

    def run(layer, x):
      return layer(x, positions, kv_len)

    if cfg.remat:
      plain = run

      def run(layer, x):  # noqa: F811  (blocks do not mutate state in the forward, so split/merge is exact)
        graphdef, state = nnx.split(layer)
        return jax.checkpoint(lambda st, x: plain(nnx.merge(graphdef, st), x))(state, x)
    for layer in self.layers:
      x = run(layer, x)
    x = x.reshape(n, n_seg * mf, gh, gw, d)[:, :t]
    return x


class Projector(nnx.Module):
  """HF's MiniMaxM3VLMultiModalProjector: per patch linear_1 -> GELU -> linear_2 to the LM width, then each
  `m x m` spatial window of projected patches is concatenated ((i, j) raster order, channels last) and fused by
  merge_linear_1 -> GELU -> merge_linear_2 into one token."""

  def __init__(self, vision_hidden: int, projector_hidden: int, text_hidden: int, merge: int, *, rngs: nnx.Rngs,
               std: float = 0.02, param_dtype=jnp.float32, dtype=jnp.float32):
    self.merge, self.dtype = merge, dtype
    kw = dict(rngs=rngs, std=std, param_dtype=param_dtype, dtype=dtype)
    self.linear_1 = Linear(vision_hidden, projector_hidden, ("embed", "mlp"), **kw)
    self.linear_2 = Linear(projector_hidden, text_hidden, ("mlp", "embed"), **kw)
    # [m*m, d_text, Pj]: the window position stays its own axis so d_text can shard like every other `embed`.
    self.merge_linear_1 = param(rngs, (merge * merge, text_hidden, projector_hidden), (None, "embed", "mlp"),
                                std=std, dtype=param_dtype)
    self.merge_linear_1_bias = _const((projector_hidden,), ("mlp",), 0.0, param_dtype)
    self.merge_linear_2 = Linear(projector_hidden, text_hidden, ("mlp", "embed"), **kw)

  def project_patches(self, x: jax.Array) -> jax.Array:
    """[..., vision_hidden] -> [..., text_hidden], per patch (before the merge)."""
    return self.linear_2(activation("gelu")(self.linear_1(x.astype(self.dtype))))

  def __call__(self, features: jax.Array) -> jax.Array:
    """features: [N, T, gh, gw, vision_hidden] -> [N, T * (gh / m) * (gw / m), text_hidden]."""
    if features.ndim != 5:
      raise ValueError(f"Projector: features must be [items, T, grid_h, grid_w, hidden], got {features.shape}")
    n, t, gh, gw, _ = features.shape
    m = self.merge
    if gh % m or gw % m:
      raise ValueError(f"Projector: grid {gh}x{gw} is not a multiple of spatial_merge_size={m}")
    y = self.project_patches(features)
    dtext = y.shape[-1]
    y = y.reshape(n, t, gh // m, m, gw // m, m, dtext).transpose(0, 1, 2, 4, 3, 5, 6)  # [N, T, gh/m, gw/m, m, m, D]
    y = y.reshape(n, t * (gh // m) * (gw // m), m * m, dtext)
    h = jnp.einsum("nkqd,qdp->nkp", y, self.merge_linear_1[...].astype(self.dtype))
    h = activation("gelu")(h + self.merge_linear_1_bias[...].astype(self.dtype))
    return self.merge_linear_2(h)  # [N, tokens, D]
