"""The two on-disk layouts of a quantized weight (``docs/checkpoints.md``).

- ``quant_method: "fp8"`` for e4m3 / e5m2 with fp32 scales: ``<m>.weight`` is a ``torch.float8_e4m3fn`` (or
  ``float8_e5m2``) tensor of the weight's shape and ``<m>.weight_scale_inv`` the fp32 block scales
  ``(ceil(N/Br), ceil(K/Bc))`` (the multiplier: ``w = q * s``), with ``weight_block_size: [Br, Bc]``: the
  block-FP8 layout of DeepSeek-V3 that vLLM, SGLang and transformers load. Row groups of ``G`` are blocks
  ``[1, G]``. Reading also takes E8M0 ``weight_scale_inv`` (``float8_e8m0fnu`` / ``uint8``).
- ``quant_method: "ds_fpquant"`` for everything else (FP6, FP4, e4m7, E8M0 / MX, NVFP4): ``<m>.weight`` is
  ``uint8`` packed codes ``(N, row_bytes)`` (SPEC 6), ``<m>.weight_scale`` the scales as
  :class:`ds_fpquant.QuantizedTensor` holds them (fp32, E8M0 bytes as ``uint8``, NVFP4 e4m3 codes as
  ``float8_e4m3fn``) and, for NVFP4, ``<m>.weight_scale_2`` the fp32 per-tensor scale.

:func:`to_parts` and :func:`from_parts` convert a :class:`~ds_fpquant.QuantizedTensor` to and from those
named tensors; :func:`quantization_config` and :func:`check_qconfig` write and read ``config.json``'s
description of them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from ds_fpquant.checkpoint.hf_files import CONFIG
from ds_fpquant.numerics.choices import ALL_SCALE_FORMATS
from ds_fpquant.numerics.formats import FORMATS, FP8_DTYPES, PRESETS
from ds_fpquant.numerics.scales import SCALE_FLOOR
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor
from ds_fpquant.version import __version__

__all__ = ["FP8_METHOD", "OWN_METHOD", "to_parts", "from_parts", "quantization_config", "check_qconfig", "whole_blocks", "checked", "check_scale_values"]

FP8_METHOD, OWN_METHOD = "fp8", "ds_fpquant"


#: dtypes of ``weight_scale_inv`` in block-FP8 checkpoints: multipliers, or E8M0 exponent bytes (SPEC 3.2).
FP8_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


E8M0_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)


#: Suffixes of the tensors that belong to a quantized weight, in both layouts.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".weight_scale_2")


#: The tensors of one quantized weight in each layout (besides ``weight``); NVFP4 adds ``weight_scale_2``.
REQUIRED_PARTS = {FP8_METHOD: ("weight", "weight_scale_inv"), OWN_METHOD: ("weight", "weight_scale")}


def whole_blocks(shape: Sequence[int], block: Sequence[int]) -> bool:
    """Whether a loader that infers the block from the scales' shape (``rows // scale_rows``, as
    transformers' FP8 loader does) reads a ``shape`` matrix with ``block`` blocks correctly: each side is
    a multiple of its block or fits in one."""
    return all(n <= b or n % b == 0 for n, b in zip(shape, block))


def to_parts(qt, method: str) -> Dict[str, torch.Tensor]:
    """The tensors that store ``qt`` in the checkpoint layout, by name (``weight``, ``weight_scale_inv``,
    ``weight_scale``, ``weight_scale_2``), on the CPU."""
    if method == FP8_METHOD:
        return {"weight": qt.codes.view(FP8_DTYPES[qt.fmt]).cpu(), "weight_scale_inv": qt.scales.cpu()}
    parts = {"weight": qt.codes.cpu(),
             "weight_scale": (qt.scales.view(torch.float8_e4m3fn) if qt.fmt == "nvfp4" else qt.scales).cpu()}
    if qt.tensor_scale is not None:
        parts["weight_scale_2"] = qt.tensor_scale.cpu()
    return parts


def _pair(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))


def quantization_config(method: str, layout: Dict[str, Any], not_converted: List[str], transposed: List[str],
                         weight_dtype: str) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config`` for a checkpoint in ``method``'s layout."""
    qconfig: Dict[str, Any] = {"quant_method": method, "fmt": layout["fmt"]}
    if method == FP8_METHOD:
        qconfig.update(activation_scheme="dynamic", weight_block_size=layout["weight_block_size"])
    else:
        qconfig.update(layout, codes="uint8, SPEC 6 row packing")
    qconfig.update(modules_to_not_convert=not_converted, ignored_layers=not_converted,
                   ds_fpquant={"version": __version__, "transposed": transposed, "weight_dtype": weight_dtype})
    return qconfig


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


def checked(name: str, qt, scale_values: bool = True):
    """``qt`` validated (``qt.validate()``) and, with ``scale_values``, its scale values checked
    (:func:`check_scale_values`); ``ValueError`` / ``TypeError`` naming ``name``. Every reader's last step."""
    try:
        qt.validate()
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    if scale_values:
        check_scale_values(name, qt)
    return qt


def check_scale_values(name: str, qt) -> None:
    """Stored scales must be what SPEC 3 can produce: fp32 scales positive (NaN marks a faulty group),
    NVFP4 scale codes non-negative and a finite tensor scale >= 2^-126; E8M0 bytes are all valid."""
    if qt.scale_format == "fp32":
        bad = ~(torch.isnan(qt.scales) | ((qt.scales > 0) & torch.isfinite(qt.scales)))
        if bool(bad.any()):
            raise ValueError(f"{name}: scales must be finite and > 0 (or NaN for a faulty group, SPEC 3.3); "
                             f"found {qt.scales[bad].reshape(-1)[0].item()!r}")
    if qt.tensor_scale is not None:
        if bool((qt.scales >= 0x80).any()):
            raise ValueError(f"{name}.weight_scale: NVFP4 group scale codes are non-negative e4m3 (SPEC 3.4); "
                             f"found a negative one")
        t = qt.tensor_scale.item()
        if not (math.isfinite(t) and t >= SCALE_FLOOR):
            raise ValueError(f"{name}.weight_scale_2={t!r}: the NVFP4 tensor scale is finite and >= 2^-126 (SPEC 3.4)")
