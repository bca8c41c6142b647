"""The two layouts ds_fpquant writes, read (``docs/checkpoints.md``; writing: :mod:`.write`).

- ``quant_method: "fp8"`` for e4m3 / e5m2 with fp32 scales: ``<m>.weight`` is a ``torch.float8_e4m3fn`` (or
  ``float8_e5m2``) tensor of the weight's shape and ``<m>.weight_scale_inv`` the fp32 block scales
  ``(ceil(N/Br), ceil(K/Bc))`` (the multiplier: ``w = q * s``), with ``weight_block_size: [Br, Bc]``: the
  block-FP8 layout of DeepSeek-V3 that vLLM, SGLang and transformers load. Row groups of ``G`` are blocks
  ``[1, G]``. Reading also takes E8M0 ``weight_scale_inv`` (``float8_e8m0fnu`` / ``uint8``).
- ``quant_method: "ds_fpquant"`` for everything else (FP6, FP4, e4m7, E8M0 / MX, NVFP4): ``<m>.weight`` is
  ``uint8`` packed codes ``(N, row_bytes)`` (SPEC 6), ``<m>.weight_scale`` the scales as
  :class:`ds_fpquant.QuantizedTensor` holds them (fp32, E8M0 bytes as ``uint8``, NVFP4 e4m3 codes as
  ``float8_e4m3fn``) and, for NVFP4, ``<m>.weight_scale_2`` the fp32 per-tensor scale.

:func:`from_parts` turns those named tensors into a :class:`~ds_fpquant.QuantizedTensor` and :func:`check_qconfig`
reads ``config.json``'s description of them (:mod:`.write` has the other direction).

Under the same ``"fp8"``, the per-tensor FP8 of AutoFP8 and transformers' older FP8 checkpoints (no
``weight_block_size``) is read too. AutoFP8 per-tensor FP8 (read only): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` one
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

from ds_fpquant.checkpoint.hf_files import CONFIG
from ds_fpquant.checkpoint.layouts import registry as layouts
from ds_fpquant.checkpoint.layouts.registry import checked
from ds_fpquant.numerics.choices import ALL_SCALE_FORMATS
from ds_fpquant.numerics.formats import FORMATS, FP8_DTYPES, PRESETS
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

FP8_METHOD, OWN_METHOD = "fp8", "ds_fpquant"


#: dtypes of ``weight_scale_inv`` in block-FP8 checkpoints: multipliers, or E8M0 exponent bytes (SPEC 3.2).
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


E8M0_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


#: Suffixes of the tensors that belong to a quantized weight, in both layouts.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2")


#: The tensors of one quantized weight in each layout (besides ``weight``); NVFP4 adds ``weight_scale_2``.
REQUIRED_PARTS = {FP8_METHOD: ("weight", "weight_scale_inv"), OWN_METHOD: ("weight", "weight_scale")}


def _pair(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))


def check_qconfig(qconfig, path: Path) -> Dict[str, Any]:
    """The ``quantization_config`` of a checkpoint, checked field by field (``ValueError``)."""
    where = f"{str(path / CONFIG)!r}: quantization_config"
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") not in (FP8_METHOD, OWN_METHOD):
        raise ValueError(f"{where}={qconfig!r}; expected quant_method {FP8_METHOD!r} or {OWN_METHOD!r} "
                         f"(write one with `ds-fpquant quantize`)")
    block = qconfig.get("weight_block_size")
    if qconfig["quant_method"] == FP8_METHOD:
        if block is None:
            raise ValueError(f"{where} has no weight_block_size: per-tensor FP8 checkpoints are not supported; "
                             f"ds_fpquant reads block-FP8 checkpoints")
    else:
        if qconfig.get("fmt") not in (*FORMATS, *PRESETS):
            raise ValueError(f"{where}.fmt={qconfig.get('fmt')!r}; allowed: {', '.join([*FORMATS, *PRESETS])}")
        group_size = qconfig.get("group_size")
        if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size >= 1):
            raise ValueError(f"{where}.group_size={group_size!r} must be an int >= 1")
        if qconfig.get("scale_format") not in ALL_SCALE_FORMATS:
            raise ValueError(f"{where}.scale_format={qconfig.get('scale_format')!r}; allowed: {', '.join(ALL_SCALE_FORMATS)}")
    if block is not None and not _pair(block):
        raise ValueError(f"{where}.weight_block_size={block!r} must be [Br, Bc], two ints >= 1")
    own = qconfig.get("ds_fpquant") or {}
    if not isinstance(own, dict):
        raise ValueError(f"{where}.ds_fpquant={own!r} must be an object")
    if own.get("weight_dtype", "float32") not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"{where}.ds_fpquant.weight_dtype={own.get('weight_dtype')!r}; allowed: float32, "
                         f"float16, bfloat16")
    transposed = own.get("transposed", [])
    if not isinstance(transposed, list) or not all(isinstance(n, str) for n in transposed):
        raise ValueError(f"{where}.ds_fpquant.transposed={transposed!r} must be a list of module names")
    return own


def from_parts(name: str, parts: Dict[str, torch.Tensor], shape, qconfig: Dict[str, Any], dtype: torch.dtype):
    """The checked :class:`QuantizedTensor` of the weight of module ``name`` from its checkpoint tensors."""

    method = qconfig["quant_method"]
    required = REQUIRED_PARTS[method] + (("weight_scale_2",) if qconfig.get("fmt") == "nvfp4" else ())
    missing = [f"{name}.{p}" for p in required if p not in parts]
    extra = [f"{name}.{p}" for p in parts if p not in required]
    if missing or extra:
        raise ValueError(f"{name}: a {method!r} weight has the tensors {', '.join(required)}; "
                         f"missing: {missing}, unexpected: {extra}")
    weight = parts["weight"]
    if method == FP8_METHOD:
        fmts = {v: k for k, v in FP8_DTYPES.items()}
        scales = parts["weight_scale_inv"]
        if weight.dtype not in fmts or scales.dtype not in (*FP8_SCALE_DTYPES, *E8M0_SCALE_DTYPES):
            raise ValueError(f"{name}: a quant_method='fp8' weight is float8_e4m3fn/float8_e5m2 with a float32/bfloat16/"
                             f"float16 or E8M0 (float8_e8m0fnu, uint8) weight_scale_inv; got {weight.dtype} and "
                             f"{scales.dtype}")
        br, bc = qconfig["weight_block_size"]
        e8m0 = scales.dtype in E8M0_SCALE_DTYPES  # 2^(byte - 127), as DeepSeek-V3.1-style ue8m0 releases store them
        qt = QuantizedTensor(codes=weight.view(torch.uint8),
                             scales=scales.view(torch.uint8) if e8m0 else scales.to(torch.float32),  # exact widening
                             shape=torch.Size(shape), dtype=dtype, fmt=fmts[weight.dtype], group_size=bc,
                             block=(br, bc), scale_format="e8m0" if e8m0 else "fp32")
    else:
        block = qconfig.get("weight_block_size")
        scales = parts["weight_scale"]
        if weight.dtype != torch.uint8:
            raise ValueError(f"{name}.weight: a 'ds_fpquant' weight is uint8 packed codes, got {weight.dtype}")
        if qconfig["fmt"] == "nvfp4" and scales.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.weight_scale: NVFP4 group scales are float8_e4m3fn, got {scales.dtype}")
        qt = QuantizedTensor(codes=weight, scales=scales.view(torch.uint8) if qconfig["fmt"] == "nvfp4" else scales,
                             shape=torch.Size(shape), dtype=dtype, fmt=qconfig["fmt"],
                             group_size=block[1] if block else qconfig["group_size"],
                             block=tuple(block) if block else None, scale_format=qconfig["scale_format"],
                             tensor_scale=parts.get("weight_scale_2"))
    return checked(name, qt)


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
