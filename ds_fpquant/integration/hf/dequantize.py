"""``model.dequantize()`` of a model ds_fpquant loaded through transformers (:meth:`DsFpQuantHfQuantizer._dequantize`):
plain layers holding the dequantized weights."""

from __future__ import annotations

from typing import Optional

import torch

from ds_fpquant.nn.model_walk import parent_module
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear
from ds_fpquant.nn.quantized_params import dequantize_in_place, quantized_params

__all__ = ["dequantize_model"]


def dequantize_model(model: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """Replace every :class:`FPQuantizedLinear` of ``model`` by an ``nn.Linear`` holding its dequantized weight
    (``(out, in)``, SPEC 5) and bias, and every in-place quantized parameter (expert stacks) by the parameter holding
    its dequantized weight; ``dtype``: of the weights (default: each the dtype it was quantized from). On the
    device of the quantized layer. Returns ``model``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FPQuantizedLinear):
            weight = module.dequantized_weight(dtype)
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                     device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            if module.bias is not None:
                linear.bias = torch.nn.Parameter(module.bias.detach().to(weight.dtype), requires_grad=False)
            parent, child = parent_module(model, name)
            setattr(parent, child, linear)
        else:
            for pname in list(quantized_params(module)):
                dequantize_in_place(module, pname, dtype)
    return model
