"""Layer 5, nn: ``FPQuantizedLinear``, layers and expert stacks quantized in place, the buffers and hooks they share,
and walking a model's modules."""
