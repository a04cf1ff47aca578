r"""Video captioning where temporal order matters: how many temporal patches should one ViT attention segment span?

  python -m m3_jax.main --config=configs/vit3d_frames.py:max_frames=4 --workdir=workdirs/vit3d_mf4
  python -m m3_jax.main --config=configs/vit3d_frames.py:max_frames=1,size=micro,steps=20 --workdir=/tmp/mf1
  python -m experiments.vit3d_frames --size=gpu --data_dir=data --sweep_dir=experiments/results/vit3d_frames

Every training row holds synthetic-motion clips (real images from the packaged image sources moved along straight
lines by code, m3_jax/data/motion.py) with templated captions that name the objects in order of appearance and the
direction each moves in ("First a sneaker goes left, then the digit 7 goes up."). A single frame cannot tell a
direction or an order, so the caption tokens that name them (the held-out set's `direction_mask` and
`object_mask`) need temporal information. The sweep argument `max_frames` in {1, 2, 4, 8} is the ViT's segment
length in temporal patches: 1 is per-frame attention (frames meet only in the language model), 8 is full 3D
attention over the clip (clips have `frames` = 16 frames = 8 temporal patches of 2). Text rows are off
(vision_weight = 1): nothing but video captions is trained, so differences come from the tower.

Sizes: `micro` (a CI smoke test: seconds on a CPU), `cpu` (minutes on a 2-core CPU), `gpu` (the H200 run: a 4-layer
ViT of width 256 on 56x56 frames, 128 visual tokens per clip; a few minutes per setting).
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import vl_config

MAX_FRAMES = (1, 2, 4, 8)

# size -> (text layers, text width, vision layers, vision width, image side, seq_len, batch, steps, eval clips)
SIZES = {
    "micro": (1, 32, 1, 24, 14, 64, 4, 6, 8),
    "cpu": (2, 64, 2, 64, 28, 128, 8, 300, 128),
    "gpu": (4, 256, 4, 256, 56, 384, 32, 3000, 1024),
}


def get_config(arg=None):
  a = parse_arg(arg, max_frames=4, size="cpu", steps=0, batch_size=0, frames=16, seed=0, lr=1e-3, attn="xla")
  if a.size not in SIZES:
    raise ValueError(f"size={a.size!r}; expected one of {sorted(SIZES)}")
  layers, width, v_layers, v_width, side, seq_len, batch, steps, eval_clips = SIZES[a.size]
  c = vl_config()
  m = c.model
  m.vocab_size = 8192
  m.hidden_size = width
  m.num_hidden_layers = layers
  m.num_attention_heads = 4 if width >= 64 else 2
  m.num_key_value_heads = 2 if width >= 64 else 1
  m.head_dim = width // m.num_attention_heads
  m.rotary_dim = m.head_dim // 2
  m.rope_theta = 10000.0
  m.dense_intermediate_size = 3 * width
  m.layer_types = ("full_attention",) * layers
  m.mlp_layer_types = ("dense",) * layers

  v = c.vision
  v.hidden_size = v_width
  v.intermediate_size = 4 * v_width
  v.num_hidden_layers = v_layers
  v.num_attention_heads = 4 if v_width >= 64 else 2
  v.patch_size = 7
  v.temporal_patch_size = 2
  v.spatial_merge_size = 2
  v.image_size = side
  v.max_frames = a.max_frames
  v.attention_impl = m.attention_impl = a.attn  # xla: segment attention cost shows in the step time as computed
  if a.size == "gpu":
    m.dtype = v.dtype = "bfloat16"  # parameters stay f32
  c.vl.projector_hidden_size = 2 * width

  d = c.data.mm
  d.height = d.width = side
  d.num_frames = a.frames
  d.max_images_per_row = 0  # video only
  d.max_videos_per_row = 2
  d.vision_weight = 1.0
  d.sources = "synthetic_video=1"
  d.caption_first_prob = 0.0  # the caption follows the clip: every caption token can see the whole clip
  d.min_objects, d.max_objects = 1, 3
  d.eval_num_clips = eval_clips
  d.prepare_sources = "fashion_mnist,opencv_digits,emoji" if a.size != "micro" else "fashion_mnist"
  d.sprite_sources = d.prepare_sources
  if a.size == "micro":
    d.max_items = "fashion_mnist=400"
  if a.size == "gpu":
    c.data.num_workers = 8  # synthesising clips on the host must keep up with the GPU

  c.train.steps = a.steps or steps
  c.train.batch_size = a.batch_size or batch
  c.train.seq_len = seq_len
  c.train.seed = a.seed
  c.train.log_every = max(1, min(50, c.train.steps // 10))
  # Ten held-out evaluations along the run: how soon the directions are learned (they tend to come suddenly).
  c.train.eval_every = c.train.steps if a.size == "micro" else max(1, c.train.steps // 10)
  c.optim.learning_rate = a.lr
  c.optim.warmup_steps = max(1, c.train.steps // 20)
  c.checkpoint.every = 0  # only at the end
  c.eval.batch_size = min(c.train.batch_size, 32)
  c.eval.max_batches = 1000  # the whole held-out set (eval_num_clips clips)
  c.eval.sources = "synthetic_video"
  return c
