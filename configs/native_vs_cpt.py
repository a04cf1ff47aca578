r"""Native vs continued-pretraining (CPT) multimodal training under the same text-token budget.

  python -m m3_jax.main --config=configs/native_vs_cpt.py:arm=native --workdir=workdirs/nvc_native
  python -m m3_jax.main --config=configs/native_vs_cpt.py:arm=cpt_predecay,lr_scale=0.3,seed=1 --workdir=/tmp/p
  python -m experiments.native_vs_cpt --size=cpu --data_dir=data --sweep_dir=workdirs/native_vs_cpt

One model (a small VL model: ViT + projector + a dense M3-shaped text tower), one WSD schedule, one text stream
per seed; the arms differ only in when multimodal rows join and, for `cpt_predecay`, in the LR from then on:

  text_only     no multimodal rows (data.mm.vision_rows = 0): the reference
  native        text + image/video captions from step 0
  cpt_decay     text only through warmup and the stable phase; vision from the first step of the WSD decay
  cpt_predecay  vision from `predecay_at` of the way through the stable phase (default half-way), and from that
                step on the scheduled LR is multiplied by `lr_scale` (a CPT phase that re-tunes its LR)

Vision is extra (data.mm.vision_rows, m3_jax/data/vision_pipeline.py): every batch holds the `batch_size` text rows
of the text pipeline, identical across arms for a seed, plus `vision_rows` multimodal rows (padding rows before
the arm's vision start, so one compiled step serves the run). Every arm logs `data/text_tokens` and
`data/text_hash` (a running hash of the text rows), so equal text can be checked, not assumed. `text_only` with
`lr_scale` != 1 is the LR control of cpt_predecay (same LR change, no vision).

Held-out evaluation ten times along the run: every text source (the text-capability measure), every image source
(image-caption loss), synthetic_video (video-caption loss) and real_clips.

Sizes: `micro` (tests: seconds), `cpu` (`make run`: the five arm settings in ~10 minutes on 2 cores: 2-layer
width-64 text tower, seq 64, 16 text + 4 vision rows, 500 steps), `gpu` (the H200 run: 4-layer width-256 text tower,
2-layer width-128 ViT, seq 512, 32 text + 8 vision rows, 1000 steps, bf16 compute).
"""

from m3_jax.train.config_lib import parse_arg
from m3_jax.train.defaults import vl_config

ARMS = ("text_only", "native", "cpt_decay", "cpt_predecay")

# size -> text layers, text width, vision layers, vision width, image side, video frames, images / videos per row,
#         seq_len, text rows, vision rows, steps, learning rate, eval batch size, eval batches per source
SIZES = {
    "micro": dict(layers=1, width=32, v_layers=1, v_width=24, side=14, frames=4, images=2, videos=1, seq_len=64,
                  batch=4, vision_rows=2, steps=10, lr=3e-3, eval_batch=4, eval_batches=1),
    "cpu": dict(layers=2, width=64, v_layers=1, v_width=32, side=28, frames=4, images=3, videos=2, seq_len=64,
                batch=16, vision_rows=4, steps=500, lr=3e-3, eval_batch=16, eval_batches=3),
    # 28x28 pixels (4 visual tokens per image, 16 per 8-frame video) keep the host's pixel work small: every row of
    # a batch, text rows included, carries the same item slots
    "gpu": dict(layers=4, width=256, v_layers=2, v_width=128, side=28, frames=8, images=12, videos=4, seq_len=512,
                batch=32, vision_rows=8, steps=1000, lr=2e-3, eval_batch=32, eval_batches=6),
}


def vision_start(arm: str, steps: int, warmup: int, decay_start: int, predecay_at: float) -> int:
  """The first step whose batch carries multimodal rows (steps: never); also where lr_scale starts."""
  if arm == "native":
    return 0
  if arm == "cpt_decay":
    return decay_start
  if arm in ("cpt_predecay", "text_only"):  # text_only: only where its LR control (lr_scale != 1) switches
    return warmup + int(round(predecay_at * (decay_start - warmup)))
  raise ValueError(f"arm={arm!r}; expected one of {ARMS}")


def get_config(arg=None):
  a = parse_arg(arg, arm="native", lr_scale=1.0, size="cpu", seed=0, steps=0, predecay_at=0.5, vision_rows=0,
                lr=0.0, attn="xla")
  if a.size not in SIZES:
    raise ValueError(f"size={a.size!r}; expected one of {sorted(SIZES)}")
  if a.arm not in ARMS:
    raise ValueError(f"arm={a.arm!r}; expected one of {ARMS}")
  if a.lr_scale != 1.0 and a.arm not in ("cpt_predecay", "text_only"):
    raise ValueError(f"lr_scale={a.lr_scale} is for arm=cpt_predecay (or text_only, its LR control); arm={a.arm!r}")
  if not 0.0 <= a.predecay_at < 1.0:
    raise ValueError(f"predecay_at={a.predecay_at}: expected a fraction of the stable phase in [0, 1)")
  z = SIZES[a.size]
  c = vl_config()
  m = c.model
  width, layers = z["width"], z["layers"]
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
  v.hidden_size = z["v_width"]
  v.intermediate_size = 4 * z["v_width"]
  v.num_hidden_layers = z["v_layers"]
  v.num_attention_heads = 4 if z["v_width"] >= 64 else 2
  v.patch_size = 7
  v.temporal_patch_size = 2
  v.spatial_merge_size = 2
  v.image_size = z["side"]
  v.max_frames = 4
  # capture_attention (the attention-map analysis) always runs on xla; training may use cudnn on a GPU.
  v.attention_impl = m.attention_impl = a.attn
  if a.size == "gpu":
    m.dtype = v.dtype = "bfloat16"  # parameters stay f32
  c.vl.projector_hidden_size = 2 * width

  steps = a.steps or z["steps"]
  c.train.steps = steps
  c.train.batch_size = z["batch"]
  c.train.seq_len = z["seq_len"]
  c.train.seed = a.seed
  c.train.log_every = max(1, min(50, steps // 20))
  # ten held-out evaluations along the run (plus step 0); two in the seconds-long micro runs
  c.train.eval_every = max(1, steps // (2 if a.size == "micro" else 10))
  o = c.optim
  o.schedule = "wsd"
  o.learning_rate = a.lr or z["lr"]
  o.warmup_steps = max(1, steps // 20)
  o.decay_fraction = 0.2
  o.min_lr_ratio = 0.1
  # the decay phase starts where optimizer.wsd_decay_start puts it (the formula is repeated here so the config
  # stays free of the optimizer module; tests/test_native_vs_cpt.py checks they agree)
  decay_start = max(o.warmup_steps, steps - int(round(o.decay_fraction * steps)))
  start = vision_start(a.arm, steps, o.warmup_steps, decay_start, a.predecay_at)
  o.lr_scale = a.lr_scale
  o.lr_scale_from = start if a.lr_scale != 1.0 else 0

  d = c.data.mm
  d.height = d.width = z["side"]
  d.num_frames = z["frames"]
  d.max_images_per_row = z["images"]
  d.max_videos_per_row = z["videos"]
  d.vision_weight = 0.0  # vision rows are extra, never instead of text rows
  d.vision_rows = 0 if a.arm == "text_only" else (a.vision_rows or z["vision_rows"])
  d.vision_start_step = start if d.vision_rows else 0
  d.text_in_mm_rows = 0.0  # multimodal rows hold captioned items only: no text beyond the shared text stream
  d.caption_first_prob = 0.25
  d.min_objects, d.max_objects = 1, 2
  d.eval_num_clips = 64
  if a.size == "gpu":
    c.data.num_workers = 8  # synthesising clips on the host must keep up with the GPU

  c.checkpoint.every = 0  # only at the end (and on SIGTERM)
  c.eval.batch_size = z["eval_batch"]
  c.eval.max_batches = z["eval_batches"]
  c.eval.sources = ""  # every held-out set: text sources, image sources, synthetic_video, real_clips
  return c
