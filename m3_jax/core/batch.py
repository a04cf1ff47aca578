"""The batch contract: the keys every training / eval batch carries and the fixed special-token ids.

The data pipelines produce these keys, the models read them and the trainer checks them; this file is the one
place that names them. Token ids are those of the byte-level BPE that `m3_jax.data.train_bpe` builds: the special
tokens are added first, so their ids are their positions in SPECIAL_TOKENS.
"""

from __future__ import annotations

# Every batch: int32 [B, T] each. `inputs` are token ids, `targets` the next tokens, `segment_ids` the packed
# document of each slot (0 = padding), `positions` RoPE positions restarting per document, `loss_mask` the slots
# whose target is trained on (text tokens of a multimodal row).
TEXT_KEYS: tuple[str, ...] = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
# A multimodal batch adds pixels and validity masks (VLModel keyword arguments): images [B, N, F, H, W, C] f32,
# image_valid [B, N] bool, and the same for videos. A text batch has none of them.
VISUAL_KEYS: tuple[str, ...] = ("images", "image_valid", "videos", "video_valid")
MM_KEYS: tuple[str, ...] = TEXT_KEYS + VISUAL_KEYS

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|pad|>",
    "<|endoftext|>",
    "<image>",
    "<video>",
    "<|image_start|>",
    "<|image_end|>",
    "<|video_start|>",
    "<|video_end|>",
    *(f"<|reserved_{i}|>" for i in range(8)),
)
PAD, EOT, IMAGE, VIDEO, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = range(8)
# Tokens that frame the visual placeholders: never a valid target inside a text-only loss.
VISUAL_MARKERS: tuple[int, ...] = (IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END)
