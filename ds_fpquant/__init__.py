"""ds_fpquant: FP8 / FP6 / FP4 group quantization for DeepSpeed, correct to the bit.

Public API (see API.md): :func:`quantize`, :func:`dequantize`, :class:`QuantizedTensor`, the
DeepSpeed drop-in :class:`FP_Quantize`, and the format table :data:`FORMATS`.
"""

from .api import QuantizedTensor, dequantize, quantize
from .formats import FORMATS, PRESETS, FPFormat, get_format

__version__ = "0.1.0"

__all__ = ["quantize", "dequantize", "QuantizedTensor", "FP_Quantize", "FORMATS", "PRESETS", "FPFormat",
           "get_format", "__version__"]


def __getattr__(name):
    # FP_Quantize subclasses DeepSpeed's Quantizer; import DeepSpeed only when it is asked for.
    if name == "FP_Quantize":
        from .fp_quantizer import FP_Quantize
        return FP_Quantize
    raise AttributeError(f"module 'ds_fpquant' has no attribute {name!r}")
