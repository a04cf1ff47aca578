"""The M3 vision-language model: vision tower + projector + text tower, visual tokens in placeholder positions.

`VLModel(cfg, rngs=...)(inputs, positions, segment_ids, images=..., image_valid=..., videos=..., video_valid=...)`
returns `(logits [B, L, V] f32, aux)` like `TextModel`. The batch is the text batch plus the pixels (the contract in
m3_jax/core/batch.py), as the vision data pipelines (m3_jax/data/) emit them:

* `images` [B, N_img, tp, H, W, C] (a frame repeated temporal_patch_size times), `videos` [B, N_vid, F, H, W, C],
  with `image_valid` / `video_valid` bool [B, N]; an absent key means "no items of that modality".
* In row b, the k-th `<image>` token (reading order) is replaced by the k-th visual token of the row's valid images
  (items in order, each item's tokens in merged (t, h, w) raster order); the same for `<video>`.
* Placeholder counts are checked eagerly by `check_batch` before jit; inside jit the merge uses static shapes.

With `capture_attention=True`, aux also holds `text_to_visual_attention` [layers, heads]: for each text query, the
sum of its attention probabilities over visual-token keys, averaged over the text queries that can see at least one
visual token (causal, same packed document); `text_to_visual_queries` is that number of queries.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3_jax.core.sharding import constrain
from m3_jax.models.attention.dense import captures_probs
from m3_jax.models.config import VLConfig, VisionConfig
from m3_jax.models.transformer import TextModel
from m3_jax.models.vision import Projector, VisionTower, check_pixels

# batch key -> (valid key, token id field of VLConfig, frames axis must equal temporal_patch_size)
MODALITIES = {"images": ("image_valid", "image_token_index", True),
              "videos": ("video_valid", "video_token_index", False)}


def tokens_per_item(pixels_shape, vcfg: VisionConfig) -> int:
  """Merged visual tokens of one item of a [B, N, F, H, W, C] pixel array."""
  f, h, w = pixels_shape[2], pixels_shape[3], pixels_shape[4]
  return vcfg.num_visual_tokens(f, h, w)


def check_batch(batch: Mapping[str, Any], cfg: VLConfig) -> dict[str, np.ndarray]:
  """Eager (numpy) validation of a multimodal batch before it enters jit.

  Raises ValueError naming the key, its shape and what was expected: pixel shapes (frames a multiple of
  temporal_patch_size, images exactly temporal_patch_size frames, H and W multiples of patch * merge, channels),
  validity masks, and, per row, that the number of `<image>` (`<video>`) placeholders equals the number of valid
  items times the tokens per item. Returns the placeholder counts per row {"images": [B], "videos": [B]}.
  """
  if "inputs" not in batch:
    raise ValueError(f"check_batch: the batch has no 'inputs' (keys: {sorted(batch)})")
  ids = np.asarray(batch["inputs"])
  if ids.ndim != 2:
    raise ValueError(f"check_batch: inputs must be [B, L], got shape {ids.shape}")
  b = ids.shape[0]
  counts = {}
  for key, (valid_key, id_field, image_like) in MODALITIES.items():
    token = getattr(cfg, id_field)
    n_placeholders = (ids == token).sum(axis=1)
    counts[key] = n_placeholders
    if key not in batch:
      if n_placeholders.any():
        row = int(np.argmax(n_placeholders > 0))
        raise ValueError(f"check_batch: row {row} has {int(n_placeholders[row])} placeholder tokens {token} "
                         f"({id_field}) but the batch has no {key!r}")
      if valid_key in batch:
        raise ValueError(f"check_batch: {valid_key!r} is present without {key!r}")
      continue
    pixels = batch[key]
    shape = tuple(pixels.shape)
    if len(shape) != 6 or shape[0] != b:
      raise ValueError(f"check_batch: {key} must be [B={b}, items, frames, height, width, channels], got {shape}")
    check_pixels(np.empty((0,) + shape[2:], np.float32), cfg.vision, what=f"check_batch: {key} [B, N, ...]")
    if image_like and shape[2] != cfg.vision.temporal_patch_size:
      raise ValueError(f"check_batch: {key} of shape {shape} has {shape[2]} frames; an image is one frame repeated "
                       f"temporal_patch_size={cfg.vision.temporal_patch_size} times")
    valid = np.ones(shape[:2], bool) if valid_key not in batch else np.asarray(batch[valid_key])
    if valid.shape != shape[:2] or valid.dtype != np.bool_:
      raise ValueError(f"check_batch: {valid_key} must be bool {shape[:2]}, got {valid.dtype} {valid.shape}")
    per_item = tokens_per_item(shape, cfg.vision)
    expected = valid.sum(axis=1) * per_item
    for row in np.nonzero(expected != n_placeholders)[0]:
      raise ValueError(
          f"check_batch: row {row} has {int(n_placeholders[row])} placeholder tokens {token} ({id_field}) but "
          f"{int(valid[row].sum())} valid {key} x {per_item} tokens each = {int(expected[row])} visual tokens "
          f"({key} shape {shape}); the counts must match exactly")
  return counts


def merge_visual_tokens(x: jax.Array, ids: jax.Array, token: int, features: jax.Array,
                        valid: jax.Array) -> jax.Array:
  """Replaces the placeholder embeddings of `token` by visual tokens, per row and in order.

  x: [B, L, D] text embeddings; ids: [B, L]; features: [B, N, n, D] (n tokens per item); valid: bool [B, N].
  The k-th placeholder of row b takes token k % n of the (k // n)-th valid item of row b. Static shapes: every
  position gathers a candidate and a select keeps it only at placeholders (counts are `check_batch`'s job).
  """
  b, n_items, n_tok, d = features.shape
  if n_items == 0 or n_tok == 0:
    return x
  is_ph = ids == token  # [B, L]
  k = jnp.cumsum(is_ph, axis=1) - 1  # placeholder rank in its row
  # Valid items first, in their original order: a stable sort on "is invalid".
  order = jnp.argsort(~valid, axis=1, stable=True)  # [B, N]
  item_rank = jnp.clip(k // n_tok, 0, n_items - 1)
  item = jnp.take_along_axis(order, item_rank, axis=1)  # [B, L]
  flat = features.reshape(b, n_items * n_tok, d)
  src = jnp.clip(item * n_tok + k % n_tok, 0, n_items * n_tok - 1)
  gathered = jnp.take_along_axis(flat, src[..., None], axis=1)  # [B, L, D]
  return jnp.where(is_ph[..., None], gathered.astype(x.dtype), x)


def text_to_visual_mass(probs: jax.Array, is_visual: jax.Array, segment_ids: jax.Array | None):
  """probs: [B, H, T, T] one layer's attention; is_visual: bool [B, T]. Returns ([H] mean mass, query count)."""
  t = is_visual.shape[1]
  mass = jnp.einsum("bhts,bs->bht", probs.astype(jnp.float32), is_visual.astype(jnp.float32))
  visible = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, S]
  if segment_ids is not None:
    visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
  sees_visual = jnp.any(visible & is_visual[:, None, :], axis=-1)  # [B, T]
  queries = sees_visual & ~is_visual
  if segment_ids is not None:
    queries = queries & (segment_ids > 0)
  w = queries.astype(jnp.float32)
  count = w.sum()
  return jnp.einsum("bht,bt->h", mass, w) / jnp.maximum(count, 1.0), count


class VLModel(nnx.Module):
  """Vision tower + projector + M3 text tower (HF: vision_tower, multi_modal_projector, language_model)."""

  def __init__(self, cfg: VLConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    v = cfg.vision
    self.vision_tower = VisionTower(v, rngs=rngs)
    self.multi_modal_projector = Projector(v.hidden_size, cfg.projector_hidden_size, cfg.text.hidden_size,
                                           v.spatial_merge_size, rngs=rngs, std=v.initializer_range,
                                           param_dtype=jnp.dtype(v.param_dtype), dtype=jnp.dtype(v.dtype))
    self.language_model = TextModel(cfg.text, rngs=rngs)

  def moe_layers(self):
    """The text tower's [(layer index, MoE)] (TextModel.moe_layers)."""
    return self.language_model.moe_layers()

  def update_router_biases(self, expert_load: jax.Array, rate: float) -> None:
    """The text tower's aux-loss-free balancing step (TextModel.update_router_biases)."""
    self.language_model.update_router_biases(expert_load, rate)

  def encode(self, pixels: jax.Array, *, max_frames: int | None = None) -> jax.Array:
    """pixels [B, N, F, H, W, C] -> visual tokens [B, N, n_tokens, d_text] (text compute dtype)."""
    b, n = pixels.shape[:2]
    feats = self.vision_tower(pixels.reshape((b * n,) + pixels.shape[2:]), max_frames=max_frames)
    tokens = self.multi_modal_projector(feats)  # [B*N, n_tokens, D]
    tokens = tokens.reshape(b, n, tokens.shape[1], tokens.shape[2]).astype(jnp.dtype(self.cfg.text.dtype))
    return tokens

  def embed(self, inputs: jax.Array, *, images=None, image_valid=None, videos=None, video_valid=None,
            max_frames: int | None = None) -> jax.Array:
    """Text embeddings of `inputs` [B, L] with the visual tokens merged in. Returns [B, L, d_text]."""
    x = self.language_model.embed(inputs)
    for pixels, valid, token in ((images, image_valid, self.cfg.image_token_index),
                                 (videos, video_valid, self.cfg.video_token_index)):
      if pixels is None or pixels.shape[1] == 0:
        continue
      if valid is None:
        valid = jnp.ones(pixels.shape[:2], bool)
      x = merge_visual_tokens(x, inputs, token, self.encode(pixels, max_frames=max_frames), valid)
    return constrain(x, ("activation_batch", "activation_length", "activation_embed"))

  def __call__(self, inputs: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               *, images: jax.Array | None = None, image_valid: jax.Array | None = None,
               videos: jax.Array | None = None, video_valid: jax.Array | None = None,
               loss_mask: jax.Array | None = None, capture_attention: bool | str = False, step_state: Any = None,
               max_frames: int | None = None, head: bool = True):
    """inputs: [B, L] token ids with placeholders; positions, segment_ids, loss_mask: [B, L] as for TextModel.
    max_frames overrides cfg.vision.max_frames (the ViT segment length). Returns (logits [B, L, V] f32, aux), or
    (hidden [B, L, d], aux) with head=False (TextModel's)."""
    if inputs.ndim != 2:
      raise ValueError(f"VLModel: inputs must be [B, L] token ids, got shape {inputs.shape}")
    x = self.embed(inputs, images=images, image_valid=image_valid, videos=videos, video_valid=video_valid,
                   max_frames=max_frames)
    logits, aux = self.language_model(inputs_embeds=x, positions=positions, segment_ids=segment_ids,
                                      loss_mask=loss_mask, capture_attention=capture_attention,
                                      step_state=step_state, head=head)
    if captures_probs(capture_attention):
      is_visual = (inputs == self.cfg.image_token_index) | (inputs == self.cfg.video_token_index)
      per_layer = [text_to_visual_mass(p, is_visual, segment_ids) for p in aux["attention_probs"]]
      aux["text_to_visual_attention"] = jnp.stack([m for m, _ in per_layer])  # [layers, heads]
      aux["text_to_visual_queries"] = per_layer[0][1] if per_layer else jnp.zeros((), jnp.float32)
    return logits, aux

  def head_logits(self, x: jax.Array) -> jax.Array:
    return self.language_model.head_logits(x)
