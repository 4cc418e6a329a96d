"""The wire vocabulary, below the routes and sinks that use it: a tensor's quantized form
(``forms``: block FP8 with its scales, as a receiver declares it), the FP8 quantizer
(``fp8``, vLLM's convention), and a transformers model's checkpoint names (``checkpoint``:
fused experts as the per-expert matrices engines load)."""

from weightsync.wire.checkpoint import checkpoint_views, converted_items, is_converted
from weightsync.wire.forms import Form, declared_forms, is_tagged, wire_name
from weightsync.wire.fp8 import dequantize_blocks, quantize_blocks

__all__ = [
    "Form",
    "checkpoint_views",
    "converted_items",
    "declared_forms",
    "dequantize_blocks",
    "is_converted",
    "is_tagged",
    "quantize_blocks",
    "wire_name",
]
