"""ds_fpquant: FP8 / FP6 / FP4 group quantization for DeepSpeed, correct to the bit.

Public API (see docs/api.md): :func:`quantize`, :func:`dequantize`, :class:`QuantizedTensor`, the
DeepSpeed drop-in :class:`FP_Quantize`, and the format table :data:`FORMATS`.
"""

from .api import dequantize, quantize
from .formats import FORMATS, PRESETS, FPFormat, get_format
from .quantized_tensor import QuantizedTensor

__version__ = "0.1.0"

__all__ = ["quantize", "dequantize", "QuantizedTensor", "FP_Quantize", "FORMATS", "PRESETS", "FPFormat",
           "get_format", "apply", "init_inference", "patch_deepspeed", "unpatch_deepspeed", "FPQuantizationConfig",
           "FPQuantizedLinear", "quantize_checkpoint", "load_quantized", "save_quantized", "__version__"]

# These need DeepSpeed (FP_Quantize subclasses its Quantizer; the config is a DeepSpeed config
# model); DeepSpeed is imported only when one of them is asked for.
_LAZY = {
    "FP_Quantize": "fp_quantizer",
    "apply": "integration",
    "init_inference": "integration",
    "patch_deepspeed": "integration",
    "unpatch_deepspeed": "integration",
    "FPQuantizationConfig": "config",
    "FPQuantizedLinear": "module",
    "quantize_checkpoint": "checkpoint",
    "load_quantized": "loader",
    "save_quantized": "checkpoint",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ds_fpquant' has no attribute {name!r}")
