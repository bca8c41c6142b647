"""The layouts ds_fpquant writes (:mod:`ds_fpquant.checkpoint.disk_format`): block FP8 (``quant_method: "fp8"``
with ``weight_block_size``) and packed codes (``"ds_fpquant"``); and, under the same ``"fp8"``, the per-tensor
FP8 of AutoFP8 and transformers' older FP8 checkpoints (no ``weight_block_size``).

AutoFP8 per-tensor FP8 (read only): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` one
fp32 multiplier (``()`` or ``(1,)``; bf16 / fp16 widen exactly), ``w = fp32(weight) * weight_scale``;
``<m>.input_scale`` (``activation_scheme: "static"``): the linears run static per-tensor W8A8 with it (SPEC 8.3).
Read as one block ``(N, K)`` per matrix.

Block FP8 as ds_fpquant writes it may carry ``<m>.input_scale`` too (``activation_scheme: "static"``, from layers
with a static input scale): applied the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch

from ds_fpquant.checkpoint.disk_format import FP8_METHOD, OWN_METHOD, SCALE_SUFFIXES, check_qconfig, checked, from_parts
from ds_fpquant.checkpoint.hf_files import CONFIG
from ds_fpquant.checkpoint.layouts import registry as layouts
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

_FP8_CODES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def _not_converted(qconfig: Dict[str, Any], where: str):
    entries = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        value = qconfig.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}.{key}={value!r} must be a list of module names")
        entries += value
    return tuple(entries)


def _activation_scheme(qconfig: Dict[str, Any], where: str) -> str:
    scheme = qconfig.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"{where}.activation_scheme={scheme!r}; allowed: 'static', 'dynamic'")
    return scheme


def _own_reading(qconfig: Dict[str, Any], path: Path) -> layouts.Reading:
    own = check_qconfig(qconfig, path)
    method = qconfig["quant_method"]
    where = f"{str(path / CONFIG)!r}: quantization_config"
    fp8 = method == FP8_METHOD
    static = fp8 and _activation_scheme(qconfig, where) == "static"
    return layouts.Reading(
        method=method, own=own, suffixes=(".weight", *SCALE_SUFFIXES, *((".input_scale",) if fp8 else ())),
        code_dtypes=("F8_E4M3", "F8_E5M2") if fp8 else ("U8",),
        from_parts=lambda name, parts, shape, dtype: from_parts(name, parts, shape, qconfig, dtype),
        activation_parts=("input_scale",) if fp8 else (), static_input=lambda name: static,
        ignore=_not_converted(qconfig, where))


def _per_tensor_fp8(name: str, parts: Dict[str, torch.Tensor], shape, dtype) -> QuantizedTensor:
    """One AutoFP8 weight: e4m3/e5m2 codes with a single multiplier, as one ``(N, K)`` block."""
    layouts.check_parts(name, "fp8 (per-tensor)", parts, ("weight", "weight_scale"))
    weight, scale = parts["weight"], parts["weight_scale"]
    if weight.dtype not in _FP8_CODES:
        raise ValueError(f"{name}.weight: a per-tensor FP8 weight is float8_e4m3fn or float8_e5m2, got {weight.dtype}")
    if scale.numel() != 1 or scale.dim() > 1:
        raise ValueError(f"{name}.weight_scale: a per-tensor FP8 scale is one value (shape () or (1,)); got shape "
                         f"{tuple(scale.shape)} (a block-FP8 checkpoint names its weight_block_size)")
    n, k = shape
    qt = QuantizedTensor(codes=weight.view(torch.uint8), scales=layouts.widen_scales(name, "weight_scale", scale)
                         .reshape(1, 1), shape=torch.Size(shape), dtype=dtype, fmt=_FP8_CODES[weight.dtype],
                         group_size=k, block=(n, k))
    return checked(name, qt)


def _fp8_reading(qconfig: Dict[str, Any], path: Path) -> layouts.Reading:
    if qconfig.get("weight_block_size") is not None:
        return _own_reading(qconfig, path)
    where = f"{str(path / CONFIG)!r}: quantization_config"
    static = _activation_scheme(qconfig, where) == "static"
    return layouts.Reading(method=FP8_METHOD, own={}, suffixes=(".weight", ".weight_scale", ".input_scale"),
                           code_dtypes=("F8_E4M3", "F8_E5M2"), from_parts=_per_tensor_fp8,
                           activation_parts=("input_scale",), static_input=lambda name: static,
                           ignore=_not_converted(qconfig, where))


layouts.register((FP8_METHOD,), _fp8_reading)
layouts.register((OWN_METHOD,), _own_reading)
