"""MiniMax Sparse Attention (MSA) ops: block selection, block-sparse attention and the indexer's KL loss.

`api` validates and dispatches on `implementation=`; `reference` is the small-size oracle, `xla` the scalable
implementation for every backend, `pallas*` the Triton kernels (KV-outer sparse attention and KL, fused selection;
interpret mode off the GPU). `sparse_decode` is one decoding step over caches of different lengths.
"""

from pallas_kernels.msa.api import (kl_loss, quantize_index, select_blocks, sparse_attention,
                                    sparse_attention_with_lse, sparse_decode)

__all__ = ["select_blocks", "sparse_attention", "sparse_attention_with_lse", "kl_loss", "sparse_decode",
           "quantize_index"]
