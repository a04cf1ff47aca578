"""Chunked prefill and token-by-token decoding with per-layer caches (each attention class owns its cache type:
dense layers a KVCache, MSA layers keys, values and index keys).

One compiled prefill per chunk length and one compiled decode step serve every position: the caches are fixed
size buffers and their fill level is a traced scalar, so positions never enter a shape.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from m3_jax.models.transformer import LayerStack, TextModel


def init_caches(model: TextModel, batch: int, max_len: int, dtype=None) -> list[Any]:
  """One empty cache per layer, of the type its attention asks for; dtype defaults to the compute dtype."""
  dtype = jnp.dtype(model.cfg.dtype) if dtype is None else dtype
  caches = []
  for entry in model.layers:  # a scanned stack's layers share one attention module (and so one cache type)
    layer, n = (entry.layer, entry.count) if isinstance(entry, LayerStack) else (entry, 1)
    caches += [layer.self_attn.init_cache(batch, max_len, dtype) for _ in range(n)]
  return caches


def make_step(model: TextModel) -> Callable:
  """Returns jitted `step(state, ids [B, T], caches) -> (logits [B, T, V], caches)` for prefill or decode."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def step(state, ids, caches):
    m = nnx.merge(graphdef, state)
    logits, aux = m(ids, caches=caches)
    return logits, aux["caches"]

  return lambda ids, caches: step(state, ids, caches)


def prefill(step: Callable, ids: jax.Array, caches: list[Any], *, chunk: int | None = None
            ) -> tuple[jax.Array, list[Any]]:
  """Feeds ids [B, T] through `step` in pieces of `chunk` tokens (None: one call), so a long prompt needs the
  activations of one chunk at a time and one compiled step per chunk length. Returns (logits of the last piece
  [B, t, V], caches)."""
  t = ids.shape[1]
  chunk = t if chunk is None else int(chunk)
  if chunk < 1 or t < 1:
    raise ValueError(f"prefill: chunk={chunk} and prompt length {t} must be >= 1")
  for lo in range(0, t, chunk):
    logits, caches = step(ids[:, lo:lo + chunk], caches)
  return logits, caches


def sample(logits: jax.Array, key: jax.Array, *, temperature: float, top_p: float) -> jax.Array:
  """logits: [B, V] -> token ids [B]. temperature 0 is greedy; top_p keeps the smallest nucleus above p."""
  if temperature <= 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / temperature
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    keep_sorted = cum - jax.nn.softmax(sorted_logits, axis=-1) < top_p  # always keeps the top token
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model: TextModel, prompt: jax.Array, *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, max_len: int | None = None,
             on_token: Callable[[jax.Array], None] | None = None, prefill_chunk: int | None = None,
             step: Callable | None = None) -> jax.Array:
  """prompt: [B, T0] int32 -> generated ids [B, max_new_tokens] (stops early once every row produced eos_id).
  `on_token` is called with each new [B] token array (streaming). `prefill_chunk` splits the prompt's prefill
  (see `prefill`); `step` reuses a `make_step(model)` across calls (each new one compiles again)."""
  b, t0 = prompt.shape
  max_len = max_len or t0 + max_new_tokens
  if t0 + max_new_tokens > max_len:
    raise ValueError(f"prompt length {t0} + max_new_tokens {max_new_tokens} exceeds max_len {max_len}")
  step = step or make_step(model)
  caches = init_caches(model, b, max_len)
  logits, caches = prefill(step, prompt, caches, chunk=prefill_chunk)
  return continue_decoding(step, logits[:, -1], caches, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, eos_id=eos_id, on_token=on_token)


def continue_decoding(step: Callable, last: jax.Array, caches: list[Any], *, max_new_tokens: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
                      on_token: Callable[[jax.Array], None] | None = None) -> jax.Array:
  """Decoding after a prefill: `last` [B, V] are the logits of the prompt's last position and `caches` hold the
  prompt. Returns the generated ids [B, n <= max_new_tokens] (see `generate`)."""
  b = last.shape[0]
  key = jax.random.key(seed)
  out, done = [], jnp.zeros((b,), bool)
  for i in range(max_new_tokens):
    key, sub = jax.random.split(key)
    tok = sample(last, sub, temperature=temperature, top_p=top_p)
    out.append(tok)
    if on_token is not None:
      on_token(tok)
    if eos_id is not None:
      done = done | (tok == eos_id)
      if bool(jnp.all(done)):
        break
    if i + 1 < max_new_tokens:
      logits, caches = step(tok[:, None], caches)
      last = logits[:, -1]
  return jnp.stack(out, axis=1)
