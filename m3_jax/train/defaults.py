"""The full set of experiment-config keys with their defaults; each `configs/*.py` starts from `base_config()`.

Every key exists here, so a typo on the command line (`--config.trian.steps=5`) is refused by the locked config.
"""

import ml_collections

from m3_jax.models.config import TextConfig, VLConfig, VisionConfig


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # The text model (TextConfig's fields; `model.router_aux_loss_coef` weighs the MoE load-balance loss).
  c.model = ml_collections.ConfigDict(TextConfig().to_dict())
  c.model.layer_types = tuple(c.model.layer_types)
  c.model.mlp_layer_types = tuple(c.model.mlp_layer_types)

  c.data = ml_collections.ConfigDict()
  c.data.dir = "data"
  c.data.use_builtin = True  # the package-shipped English corpus (DESIGN.md §4)
  c.data.sources = ()  # built-in sources to prepare; () = the default set
  c.data.num_workers = 0  # grain worker processes (0: in-process, deterministic on any machine)
  # Bring your own text: "NAME=GLOB[,GLOB...][;NAME2=GLOB...]", e.g. "notes=/data/notes/*.txt".
  c.data.text_files = ""
  c.data.vocab_size = 8192
  # Synthetic long-context task rows (m3_jax.data.long_tasks: passkey, needles, kv, variable tracking) as a share
  # of the training rows, loss on the answer only; names "" = every task. Text configs only. questions > 1: each
  # task row asks that many questions about its haystack (more retrieval signal per row); text_loss: the row's
  # haystack text is trained on too; placement "interleaved" puts each question (with its answer) at a random
  # point after its needle instead of after the haystack ("end"); lengths "512,2048,16384": each task row packs
  # examples of one of these lengths, each its own segment (short ones teach retrieval; needs document_mask).
  c.data.tasks = ml_collections.ConfigDict(dict(share=0.0, names="", questions=1, text_loss=False,
                                                placement="end", lengths=""))

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.batch_size = 16
  c.train.seq_len = 256
  c.train.seed = 0
  c.train.log_every = 10
  c.train.eval_every = 200
  # "FIRST,LAST": write a jax.profiler trace of train steps FIRST..LAST (1-based, inclusive) to WORKDIR/profile
  # (TensorBoard / xprof read it; a Perfetto trace.json.gz beside it). "" = no trace.
  c.train.profile_steps = ""
  # Divergence: a step whose loss, gradient, update or new parameters are not finite stops the run before anything
  # of it is saved. loss_spike > 0 also stops it when a logged loss exceeds loss_spike x the lowest loss logged so
  # far in the run (e.g. 10). 0: off.
  c.train.loss_spike = 0.0
  # Positions per chunk of the output layer and loss (0: all at once; must divide seq_len). Long contexts: the
  # [B, T, V] f32 logits and their gradient are the largest activations (64 KiB per token at V = 8192); chunked,
  # only one [B, loss_chunk, V] chunk's exist at a time and the backward recomputes each chunk's logits.
  c.train.loss_chunk = 0

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 1e-3
  c.optim.schedule = "cosine"  # cosine | wsd | constant
  c.optim.warmup_steps = 100
  c.optim.decay_fraction = 0.2  # wsd only
  c.optim.decay_shape = "linear"
  c.optim.min_lr_ratio = 0.1
  # From step lr_scale_from on, the scheduled learning rate is multiplied by lr_scale (a continued-pretraining phase
  # that re-tunes its LR; configs/native_vs_cpt.py). 1.0: the schedule unchanged.
  c.optim.lr_scale = 1.0
  c.optim.lr_scale_from = 0
  c.optim.weight_decay = 0.1
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.grad_clip = 1.0

  # Warm start from an export directory (--mode=export): matching parameters are copied, new ones (MSA's index
  # branch when converting a dense model) are freshly initialised. Ignored when WORKDIR already has a checkpoint.
  c.init_from = ""

  # context > 1 splits every sequence over that many devices (context parallelism; README "Long context on a
  # cluster" says how to pick it beside data / fsdp / expert).
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1, context=1))

  c.checkpoint = ml_collections.ConfigDict()
  # 0: only at the end (and on SIGTERM / Ctrl-C). A fresh run also saves its initial state as step 0.
  c.checkpoint.every = 500
  c.checkpoint.keep = 3
  c.checkpoint.async_save = True

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 16
  c.eval.max_batches = 8
  c.eval.sources = ""  # comma-separated held-out sets to evaluate ("" = every prepared source)

  c.export = ml_collections.ConfigDict()
  c.export.path = ""  # default WORKDIR/export
  c.export.dtype = "bfloat16"  # "" keeps the training dtype
  return c


def vl_config() -> ml_collections.ConfigDict:
  """base_config() plus the vision-language sections; a config with a `vision` section trains the VLModel.

  `model` stays the text tower; `vision` is the VisionConfig (HF names + our `max_frames`); `vl` holds the rest of
  VLConfig (placeholder ids of our tokenizer, projector width); `data.mm` shapes and mixes the multimodal batches
  of m3_jax/data/vision_pipeline.py.
  """
  c = base_config()
  c.vision = ml_collections.ConfigDict(VisionConfig().to_dict())
  vl = VLConfig.__dataclass_fields__
  c.vl = ml_collections.ConfigDict(dict(
      image_token_index=2, video_token_index=3,  # <image>, <video> of m3_jax/data/tokenizer.py
      projector_hidden_size=vl["projector_hidden_size"].default))

  m = c.data.mm = ml_collections.ConfigDict()
  # Static pixel shapes of every image / video frame (multiples of patch_size * spatial_merge_size).
  m.height = 56
  m.width = 56
  m.num_frames = 8  # frames per video item (a multiple of temporal_patch_size)
  m.max_images_per_row = 4  # 0: no image keys in the batch
  m.max_videos_per_row = 1  # 0: no video keys in the batch
  # Share of each batch's rows that are multimodal (the rest are the text pipeline's rows, in the same order as a
  # text-only run); 0 before step `vision_start_step` (vision added late, e.g. at the LR decay).
  m.vision_weight = 0.5
  m.vision_start_step = 0
  # > 0: vision is extra instead: every batch is train.batch_size text rows (all of a text-only run's rows, in the
  # same order) plus vision_rows multimodal rows, padding rows before vision_start_step (vision_weight must be 0).
  m.vision_rows = 0
  # Train sources and element shares, "NAME=W[,NAME=W]" from the image sources and synthetic_video; "" = the
  # pipeline's defaults over everything prepared.
  m.sources = ""
  m.text_in_mm_rows = 0.0  # share of text pieces packed into the multimodal rows
  m.caption_first_prob = 0.25
  m.sprite_sources = ""  # image sources that synthetic clips take their objects from; "" = the pipeline's default
  m.min_objects = 1  # synthetic motion: objects per clip
  m.max_objects = 3
  # What to prepare: vision sources ("" = all: the image sources and the real clips) and per-source item caps
  # ("NAME=N[,NAME=N]", merged over the preparation defaults).
  m.prepare_sources = ""
  m.max_items = ""
  # Held-out synthetic clips (made from held-out sprites); eval.sources picks among all held-out sets: the text
  # sources, every prepared image source, synthetic_video and real_clips (those the shapes allow).
  m.eval_num_clips = 64
  return c
