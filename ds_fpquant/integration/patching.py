"""``patch_deepspeed`` / ``unpatch_deepspeed``: ds_fpquant behind DeepSpeed's own names (opt-in)."""

from __future__ import annotations

import torch

from ds_fpquant.integration.inference import (
    check_kernel_inject,
    init_inference,
    init_inference_with,
    is_quantized_model,
    split_fp_section,
)
from ds_fpquant.integration.originals import REPLACED, original_init_inference

__all__ = ["patch_deepspeed", "unpatch_deepspeed"]


def _deepspeed_init_inference(model: torch.nn.Module, config=None, **kwargs):
    """``deepspeed.init_inference`` after :func:`patch_deepspeed`: a config (dict or JSON path) or keyword
    with an ``fp_quantization`` section goes through :func:`init_inference`; anything else to DeepSpeed's
    own function unchanged (a quantized model with ``replace_with_kernel_inject=True`` gets the clear
    error instead of an AttributeError from inside DeepSpeed)."""
    section, rest, other = split_fp_section(config, kwargs)
    if section is not None:
        return init_inference(model, config, **kwargs)
    if is_quantized_model(model):  # pre-quantized (load_quantized, apply): AutoTP needs the stand-ins
        return init_inference_with(model, None, rest, other)
    check_kernel_inject(model, False, rest, other)
    return original_init_inference()(model, config, **kwargs)


def _rebuild_quantized_parameter(data, quantization_config, quantizer):
    """Unpickle a ``deepspeed.linear.QuantizedParameter`` as that class (torch's ``Parameter``
    pickling would rebuild a plain ``Parameter``). ``data`` is already quantized, so nothing is
    quantized again."""
    from deepspeed.linear.quantization import QuantizedParameter

    return QuantizedParameter(data, quantization_config=quantization_config, quantizer=quantizer)


def _reduce_quantized_parameter(self, protocol):
    return _rebuild_quantized_parameter, (self.data, self.quantization_config, self.quantizer)


def _matmul_fp8_owners() -> list:
    """The DeepSpeed modules that define DeepSpeed's ``matmul_fp8`` name: ``deepspeed.ops.fp_quantizer`` and
    ``deepspeed.ops.fp_quantizer.fp8_gemm``, each where it imports and has the name (a DeepSpeed without the fp8
    GEMM has neither)."""
    import deepspeed.ops.fp_quantizer as ds_fp

    owners = [ds_fp]
    try:
        import deepspeed.ops.fp_quantizer.fp8_gemm as ds_fp8_gemm
    except ImportError:
        pass
    else:
        owners.append(ds_fp8_gemm)
    return [m for m in owners if "matmul_fp8" in vars(m)]


def patch_deepspeed() -> None:
    """Plug ds_fpquant into DeepSpeed's own names (opt-in; undo with :func:`unpatch_deepspeed`).

    - ``deepspeed.init_inference(model, config)`` accepts the ``fp_quantization`` section in its config
      (dict or JSON path) or as ``fp_quantization=`` and applies it as :func:`init_inference` does
      (tp 1 and AutoTP); without the section it is DeepSpeed's function unchanged.
    - DeepSpeed's ``FP_Quantize`` resolves to :class:`ds_fpquant.FP_Quantize`:
      ``deepspeed.linear.QuantizedParameter`` / ``QuantizedLinear`` / ``OptimizedLinear`` built without
      an explicit ``quantizer=`` use this project's quantizer (``copy.deepcopy`` of a
      ``QuantizedParameter`` needs that: DeepSpeed rebuilds it with a default quantizer), and a pickled
      ``QuantizedParameter`` unpickles as one.
    - DeepSpeed's ``matmul_fp8`` (``deepspeed.ops.fp_quantizer.matmul_fp8`` and
      ``deepspeed.ops.fp_quantizer.fp8_gemm.matmul_fp8``, each where the module imports and has the name) is
      :func:`ds_fpquant.matmul_fp8`. As for ``FP_Quantize``, a module that imported DeepSpeed's name before the
      patch keeps the object it imported; look it up after the patch, or call ``ds_fpquant.matmul_fp8``.
    """
    import deepspeed
    import deepspeed.linear.quantization as ds_linear_quant
    import deepspeed.ops.fp_quantizer as ds_fp
    import deepspeed.ops.fp_quantizer.quantize as ds_fp_quantize

    from ds_fpquant.integration.fp8_gemm import matmul_fp8
    from ds_fpquant.integration.fp_quantizer import FP_Quantize

    qp = ds_linear_quant.QuantizedParameter
    if not REPLACED:
        REPLACED.update({(m, "FP_Quantize"): m.FP_Quantize for m in (ds_fp, ds_fp_quantize, ds_linear_quant)})
        REPLACED[(qp, "__reduce_ex__")] = qp.__dict__.get("__reduce_ex__")
        REPLACED[(deepspeed, "init_inference")] = deepspeed.init_inference
        REPLACED.update({(m, "matmul_fp8"): m.matmul_fp8 for m in _matmul_fp8_owners()})
    for module, attr in REPLACED:
        if attr == "FP_Quantize":
            module.FP_Quantize = FP_Quantize
        elif attr == "matmul_fp8":
            module.matmul_fp8 = matmul_fp8
    qp.__reduce_ex__ = _reduce_quantized_parameter
    deepspeed.init_inference = _deepspeed_init_inference


def unpatch_deepspeed() -> None:
    """Undo :func:`patch_deepspeed`."""
    for (owner, attr), original in REPLACED.items():
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    REPLACED.clear()
