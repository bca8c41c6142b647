"""ds_fpquant: FP8 / FP6 / FP4 group quantization for DeepSpeed, correct to the bit.

Public API (see docs/api.md): :func:`quantize`, :func:`dequantize`, :class:`QuantizedTensor`, the
DeepSpeed drop-ins :class:`FP_Quantize` and :func:`matmul_fp8`, and the format table :data:`FORMATS`.
"""

from ds_fpquant.integration.hf import hook as _hf_hook
from ds_fpquant.numerics.formats import FORMATS, PRESETS, FPFormat, get_format
from ds_fpquant.tensor.quantize import dequantize, quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor
from ds_fpquant.version import __version__

__all__ = ["quantize", "dequantize", "QuantizedTensor", "FP_Quantize", "matmul_fp8", "FORMATS", "PRESETS", "FPFormat",
           "get_format", "apply", "init_inference", "patch_deepspeed", "unpatch_deepspeed", "FPQuantizationConfig",
           "FPQuantizedLinear", "quantize_checkpoint", "load_quantized", "save_quantized", "DsFpQuantConfig",
           "__version__"]

# These need DeepSpeed (FP_Quantize subclasses its Quantizer, matmul_fp8 takes one; the config is a DeepSpeed config
# model); DeepSpeed is imported only when one of them is asked for.
_LAZY = {
    "FP_Quantize": "integration.fp_quantizer",
    "matmul_fp8": "integration.fp8_gemm",
    "apply": "integration.inference",
    "init_inference": "integration.inference",
    "patch_deepspeed": "integration.patching",
    "unpatch_deepspeed": "integration.patching",
    "FPQuantizationConfig": "config",
    "FPQuantizedLinear": "nn.quantized_linear",
    "quantize_checkpoint": "checkpoint.writer",
    "load_quantized": "checkpoint.reader",
    "save_quantized": "checkpoint.writer",
    "DsFpQuantConfig": "integration.hf.config",
}


# quant_method "ds_fpquant" for transformers' from_pretrained: registered when transformers' quantizer registry is
# imported (or now, if it is); nothing of transformers is imported here.
_hf_hook.install()


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ds_fpquant' has no attribute {name!r}")
