"""Quantized forms: receivers holding FP8 weights, quantized once on the trainer (docs/quantized.md)."""

from weightsync.quant.replica import fp8_expected, fp8_holding, quantizable
from weightsync.wire.forms import Form, declared_forms, wire_name
from weightsync.wire.fp8 import dequantize_blocks, quantize_blocks

__all__ = [
    "Form",
    "declared_forms",
    "dequantize_blocks",
    "fp8_expected",
    "fp8_holding",
    "quantizable",
    "quantize_blocks",
    "wire_name",
]
