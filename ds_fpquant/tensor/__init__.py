"""Layer 3, tensor: :class:`QuantizedTensor`, ``quantize`` / ``dequantize`` (SPEC 2-7) and pieces of a quantized
matrix cut as stored."""
