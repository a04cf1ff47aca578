r"""Tiny M3-shaped vision-language model for a 2-core CPU: native multimodal training from step 0.

  python -m m3_jax.main --config=configs/tiny_vlm.py --workdir=workdirs/tiny_vlm
  python -m m3_jax.main --config=configs/tiny_vlm.py:steps=100,vision_weight=0.25 --workdir=/tmp/vlm

The text tower is tiny_lm's (dense first layer, then MoE); the vision tower is a 2-layer ViT of width 64 with
7x7 patches, temporal patch 2, 2x2 merge and 3D attention over segments of `max_frames` temporal patches. Images
and frames are 28x28 (4 visual tokens per image, 4 per temporal patch of a video). Each batch mixes text rows
with multimodal rows (`vision_weight` of them): image-caption examples from the packaged image sources and
video-caption examples of synthetic motion (real images moved by code; see m3_jax/data/motion.py). Held-out loss,
perplexity and accuracy are reported per source: the text sources, every image source, synthetic_video (with
the direction/object tokens that need temporal order) and the real clips (evaluation only).
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import vl_config


def get_config(arg=None):
  a = parse_arg(arg, moe=True, steps=300, batch_size=16, seq_len=128, layers=4, vision_layers=2, vision_width=64,
                patch=7, image_size=28, frames=4, max_frames=2, vision_weight=0.5)
  c = vl_config()
  m = c.model
  m.vocab_size = 8192
  m.hidden_size = 128
  m.num_hidden_layers = a.layers
  m.num_attention_heads = 4
  m.num_key_value_heads = 2
  m.head_dim = 32
  m.rotary_dim = 16
  m.rope_theta = 10000.0
  m.dense_intermediate_size = 384
  m.intermediate_size = 128
  m.shared_intermediate_size = 128
  m.num_local_experts = 8
  m.num_experts_per_tok = 2
  m.layer_types = ("full_attention",) * a.layers
  m.mlp_layer_types = ("dense",) + ("sparse" if a.moe else "dense",) * (a.layers - 1)

  v = c.vision
  v.hidden_size = a.vision_width
  v.intermediate_size = 4 * a.vision_width
  v.num_hidden_layers = a.vision_layers
  v.num_attention_heads = 4
  v.patch_size = a.patch
  v.temporal_patch_size = 2
  v.spatial_merge_size = 2
  v.image_size = a.image_size
  v.max_frames = a.max_frames
  c.vl.projector_hidden_size = 2 * m.hidden_size

  d = c.data.mm
  d.height = d.width = a.image_size
  d.num_frames = a.frames
  d.max_images_per_row = 4
  d.max_videos_per_row = 2
  d.vision_weight = a.vision_weight
  d.text_in_mm_rows = 0.2  # fills the rest of a multimodal row with text (short captions leave room)
  d.min_objects, d.max_objects = 1, 2

  c.train.steps = a.steps
  c.train.batch_size = a.batch_size
  c.train.seq_len = a.seq_len
  c.train.log_every = 10
  c.train.eval_every = 100
  c.optim.learning_rate = 3e-3
  c.optim.warmup_steps = 30
  c.checkpoint.every = 100
  c.eval.batch_size = 16
  c.eval.max_batches = 2
  return c
