"""Text data: corpus preparation from packaged English text, byte-level BPE, and grain LM pipelines.

    from m3_jax import data
    data.prepare("/work/main/data")                      # once; cached (or: python -m m3_jax.data DIR)
    tok = data.Tokenizer.from_data_dir("/work/main/data")
    it = iter(data.make_train_dataset("/work/main/data", seq_len=1024, global_batch_size=32, seed=0))
    batch = next(it)                                     # inputs/targets/segment_ids/positions/loss_mask
"""
from m3_jax.data.corpus import ALL_SOURCES, DEFAULT_SOURCES, Manifest, load_manifest, prepare
from m3_jax.data.pipeline import BATCH_KEYS, list_sources, make_eval_batches, make_train_dataset
from m3_jax.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_bpe

__all__ = [
    "ALL_SOURCES", "DEFAULT_SOURCES", "Manifest", "load_manifest", "prepare",
    "BATCH_KEYS", "list_sources", "make_eval_batches", "make_train_dataset",
    "SPECIAL_TOKENS", "Tokenizer", "train_bpe",
]
