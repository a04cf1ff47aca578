"""Dense causal GQA attention whose memory stays O(block_q * block_k) beyond its inputs and outputs, for context
parallelism: each device attends its local queries, at a (traced) offset, to the all-gathered keys of a long
sequence.

`api.flash_attention` validates and dispatches on `implementation=`: `xla` (blockwise online softmax under a custom
VJP, `xla.py`: every backend, the T x S scores never exist) and `reference` (the masked softmax over the whole
score matrix: small sizes only).
"""

from pallas_kernels.flash_attention.api import IMPLEMENTATIONS, flash_attention

__all__ = ["flash_attention", "IMPLEMENTATIONS"]
