"""Layers quantized in place: ``module.weight`` (2-D) of any layer whose forward uses it, such as DeepSpeed's AutoTP
``LinearLayer`` / ``LinearAllreduce``, stored as codes and scales (:mod:`ds_fpquant.nn.quantized_params`)."""

from __future__ import annotations

from typing import Optional

import torch

from ds_fpquant.linear.w8a8 import check_activation
from ds_fpquant.nn.quantized_params import install
from ds_fpquant.tensor.quantize import quantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["quantize_weight_in_place", "install_quantized_weight"]


def quantize_weight_in_place(module: torch.nn.Module, fmt: str = "e4m3", group_size: Optional[int] = None, *,
                             compute_dtype: Optional[str] = None, backend: str = "auto", activation: Optional[str] = None,
                             **quantize_kwargs) -> int:
    """Store ``module.weight`` (2-D) as FP codes + scales and dequantize it around each forward.

    For layers that are not plain ``nn.Linear`` but use ``self.weight`` in their forward, such as
    DeepSpeed's AutoTP ``LinearLayer`` / ``LinearAllreduce`` (each rank quantizes its own shard).
    The ``weight`` parameter is replaced by the buffers ``weight_codes`` and ``weight_scales``; a
    forward pre-hook puts a :class:`~ds_fpquant.linear.weights.QuantizedWeight` (``compute_dtype``, default:
    the input's dtype) in place, whose ``matmul`` / ``F.linear`` run the fused op without a dequantized
    copy, and a forward hook drops it again. Returns the bytes of the stored weight.
    """
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(module).__name__}.weight must be a 2-D tensor to be quantized")
    check_activation(activation)
    qt = quantize(weight.detach(), fmt, group_size, backend=backend, **quantize_kwargs)
    install_quantized_weight(module, qt, compute_dtype=compute_dtype, backend=backend, activation=activation)
    return qt.nbytes


def install_quantized_weight(module: torch.nn.Module, qt: QuantizedTensor, *, compute_dtype: Optional[str] = None,
                             backend: str = "auto", activation: Optional[str] = None) -> None:
    """Make ``qt`` (an ``(out, in)`` weight's codes and scales) the weight of ``module`` as
    :func:`quantize_weight_in_place` does: the ``weight`` parameter (if any) is replaced by the buffers and
    the forward hooks. Used for AutoTP shards of a model that was quantized before it was sharded."""
    install(module, "weight", [qt], stacked=False, compute_dtype=compute_dtype, backend=backend, activation=activation)
