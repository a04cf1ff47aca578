"""Data: text and image/video from packages, prepared once into a directory, read by grain pipelines.

    from m3_jax import data
    data.prepare("/work/main/data")                      # once; cached (or: python -m m3_jax.data DIR)
    tok = data.load_tokenizer("/work/main/data")
    it = iter(data.make_train_dataset("/work/main/data", seq_len=1024, global_batch_size=32, seed=0))
    batch = next(it)                                     # the keys of m3_jax.core.batch.TEXT_KEYS

Long documents (whole books, manuals, repository-level code; a separate directory, minutes to build):
    data.prepare("/tmp/long_data", profile="long")      # or: python -m m3_jax.data DIR --profile=long

Images and video:
    data.prepare("/work/main/data", vision=True)         # or: python -m m3_jax.data DIR --vision
    spec = data.VisionSpec(height=32, width=32, patch_size=4, num_frames=8)
    it = iter(data.make_mm_train_dataset(d, spec=spec, seq_len=512, global_batch_size=32, seed=0,
                                         vision_weight=0.25))   # + images/image_valid/videos/video_valid

From an experiment config (what the trainer calls): `data.inputs.prepare / train_iterator / eval_sets`.

The modules, text and vision side by side:
    text_sources, vision_sources   where each source comes from and how it is read (rdata: R files, for austen)
    long_sources                   the long profile's sources: whole books and manuals, code per package directory
    text_prepare, vision_prepare   prepare / prepare_vision: splits, tokenizer, files on disk, manifests, CLI
    text_pipeline, vision_pipeline grain datasets: packing, mixing, eval batches
    captions, motion               captions of images and clips; the synthetic-motion clip renderer
    tokenizer, fetch, common       byte-level BPE; package downloads; shared helpers
    inputs                         experiment config -> prepared data, iterators, eval sets
"""
from m3_jax.data import inputs
from m3_jax.data.text_pipeline import list_sources, make_eval_batches, make_train_dataset
from m3_jax.data.text_prepare import Manifest, load_manifest, load_tokenizer, prepare
from m3_jax.data.tokenizer import Tokenizer, train_bpe
from m3_jax.data.vision_pipeline import VisionSpec, list_mm_sources, make_mm_eval_batches, make_mm_train_dataset
from m3_jax.data.vision_prepare import VisionManifest, load_vision_manifest, prepare_vision

__all__ = [
    "inputs",
    "Manifest", "load_manifest", "load_tokenizer", "prepare", "Tokenizer", "train_bpe",
    "list_sources", "make_eval_batches", "make_train_dataset",
    "VisionManifest", "load_vision_manifest", "prepare_vision",
    "VisionSpec", "list_mm_sources", "make_mm_eval_batches", "make_mm_train_dataset",
]
