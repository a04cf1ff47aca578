"""Small building blocks of the M3 text tower: parameters with logical axes, RMSNorm, partial RoPE, SwiGLU-OAI MLP."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.core.sharding import constrain


def param(rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], *, std: float | None = None,
          dtype=jnp.float32, init: str = "normal") -> nnx.Param:
  """A Param carrying `logical_axes` metadata (read by `sharding.state_shardings`)."""
  if len(axes) != len(shape):
    raise ValueError(f"param: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
  if init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
  """Gemma-style RMSNorm: normalise in f32, scale by (1 + w) with w initialised to 0, cast back."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.weight = param(None, (dim,), ("norm",), init="zeros", dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(rotary_dim: int, theta: float) -> jax.Array:
  """[rotary_dim // 2] inverse frequencies; the exponent is over `rotary_dim`, not the head dim (HF partial RoPE)."""
  return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """NeoX ("rotate half") rotation of the first R = 2 * cos.shape[-1] channels of x; the rest pass through.

  x: [..., D]; cos, sin: f32, broadcastable to [..., R / 2]. Channel c pairs with c + R / 2:
  (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the same rotation as HF's `x * cat(cos, cos) + rotate_half(x) *
  cat(sin, sin)`. Computed in f32 and cast back to x.dtype. Text RoPE and the vision tower's 3D RoPE both use it.
  """
  r = 2 * cos.shape[-1]
  rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
  x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([out, rest], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, *, rotary_dim: int, theta: float) -> jax.Array:
  """NeoX ("rotate half") RoPE on the first `rotary_dim` channels; the rest pass through.

  x: [B, T, H, D]; positions: [B, T] int. Angles are computed in f32 and the result is cast to x.dtype.
  """
  if rotary_dim == 0:
    return x
  angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(rotary_dim, theta)  # [B, T, R/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, R/2]
  sin = jnp.sin(angles)[:, :, None, :]
  return rotate_half(x, cos, sin)


def swiglu_oai(gate: jax.Array, up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """MiniMax-M3 / gpt-oss gate: g = min(g, limit); u = clip(u, -limit, limit); (u + 1) * g * sigmoid(alpha g)."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


class DenseMLP(nnx.Module):
  """SwiGLU-OAI MLP. `gate_up: [d_model, 2, I]` keeps gate (index 0) and up (index 1) apart so that
  splitting `I` over the `tensor` axis never mixes them (HF stores them concatenated as [2I, d_model])."""

  def __init__(self, d_model: int, intermediate: int, *, alpha: float, limit: float, rngs: nnx.Rngs,
               std: float = 0.02, param_dtype=jnp.float32, dtype=jnp.float32):
    self.alpha, self.limit, self.dtype = alpha, limit, dtype
    self.gate_up = param(rngs, (d_model, 2, intermediate), ("embed", None, "mlp"), std=std, dtype=param_dtype)
    self.down = param(rngs, (intermediate, d_model), ("mlp", "embed"), std=std, dtype=param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [..., d_model] -> [..., d_model]."""
    gu = jnp.einsum("...d,dgi->...gi", x, self.gate_up[...].astype(self.dtype))  # [..., 2, I]
    h = swiglu_oai(gu[..., 0, :], gu[..., 1, :], alpha=self.alpha, limit=self.limit)  # [..., I]
    if h.ndim == 3:
      h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
    return jnp.einsum("...i,id->...d", h, self.down[...].astype(self.dtype))
