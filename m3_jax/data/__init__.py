"""Text data: corpus preparation from packaged English text, byte-level BPE, and grain LM pipelines.

    from m3_jax import data
    data.prepare("/work/main/data")                      # once; cached (or: python -m m3_jax.data DIR)
    tok = data.Tokenizer.from_data_dir("/work/main/data")
    it = iter(data.make_train_dataset("/work/main/data", seq_len=1024, global_batch_size=32, seed=0))
    batch = next(it)                                     # inputs/targets/segment_ids/positions/loss_mask

Images and video (m3_jax.data.vision, m3_jax.data.vision_pipeline):
    data.prepare("/work/main/data", vision=True)         # or: python -m m3_jax.data DIR --vision
    spec = data.VisionSpec(height=32, width=32, patch_size=4, num_frames=8)
    it = iter(data.make_mm_train_dataset(d, spec=spec, seq_len=512, global_batch_size=32, seed=0,
                                         vision_weight=0.25))   # + images/image_valid/videos/video_valid
"""
from m3_jax.data.corpus import ALL_SOURCES, DEFAULT_SOURCES, Manifest, load_manifest, prepare
from m3_jax.data.pipeline import BATCH_KEYS, list_sources, make_eval_batches, make_train_dataset
from m3_jax.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_bpe
from m3_jax.data.vision import load_vision_manifest, prepare_vision
from m3_jax.data.vision_pipeline import (MM_BATCH_KEYS, VisionSpec, list_mm_sources, make_mm_eval_batches,
                                         make_mm_train_dataset)

__all__ = [
    "ALL_SOURCES", "DEFAULT_SOURCES", "Manifest", "load_manifest", "prepare",
    "BATCH_KEYS", "list_sources", "make_eval_batches", "make_train_dataset",
    "SPECIAL_TOKENS", "Tokenizer", "train_bpe",
    "load_vision_manifest", "prepare_vision", "MM_BATCH_KEYS", "VisionSpec", "list_mm_sources",
    "make_mm_eval_batches", "make_mm_train_dataset",
]
