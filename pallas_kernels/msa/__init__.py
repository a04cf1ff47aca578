"""MiniMax Sparse Attention (MSA) ops: block selection, block-sparse attention and the indexer's KL loss.

`api` validates and dispatches on `implementation=`; `reference` is the small-size oracle, `xla` the scalable
implementation for every backend.
"""

from pallas_kernels.msa.api import kl_loss, select_blocks, sparse_attention

__all__ = ["select_blocks", "sparse_attention", "kl_loss"]
