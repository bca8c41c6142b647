"""NVIDIA ModelOpt checkpoints (``quant_method: "modelopt"``, ``hf_quant_config.json``) as ds_fpquant tensors.

What nvidia-modelopt 0.47's ``export_hf_checkpoint`` writes (read from its source, ``modelopt/torch/export/`` and
``modelopt/torch/quantization/qtensor/``, and checked on files it wrote):

- ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", ...}, "quantization": {"quant_algo": "FP8" |
  "FP8_PER_CHANNEL_PER_TOKEN" | "NVFP4" | "W4A16_NVFP4" | "fp8_pb_wo" | "fp8_pb_real" | "MXFP8" | "mxfp4" |
  "W4A8_MXFP4_FP8" | ..., "group_size": 16 (NVFP4), 32 (MXFP8, W4A8_MXFP4_FP8; none written for mxfp4),
  "exclude_modules": [fnmatch patterns],
  "kv_cache_quant_algo": ...}}``; ``config.json``'s ``quantization_config`` then has ``quant_method: "modelopt"``
  and the same ``quant_algo`` (plus compressed-tensors-style ``config_groups`` and ``ignore``).
- FP8: ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` fp32, a multiplier (``w = q * s``):
  0-dim (per tensor, ``FP8``) or ``(N,)`` (per output channel, ``FP8_PER_CHANNEL_PER_TOKEN``; ``(N, 1)`` read too);
  ``<m>.input_scale`` fp32 0-dim (static, ``FP8`` only).
- NVFP4: ``<m>.weight`` ``uint8`` ``(N, K/2)``, two e2m1 codes a byte, the first in the low nibble (the packing of
  SPEC 6); ``<m>.weight_scale`` ``float8_e4m3fn`` ``(N, K/16)``; ``<m>.weight_scale_2`` fp32 0-dim, a multiplier:
  ``w = q * fl(fp32(weight_scale) * weight_scale_2)``, exactly SPEC 3.4's ``fl(decode(q) * fl(decode(c) * t))``;
  ``<m>.input_scale`` fp32 0-dim (W4A4 ``NVFP4``; none for ``W4A16_NVFP4``).
- ``fp8_pb_wo`` (``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``, weight-only): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``,
  ``<m>.weight_scale`` fp32 multipliers of 128x128 blocks, shape ``(ceil(N/128), 1, ceil(K/128), 1)`` (ModelOpt's
  block amax shape; 0-dim when the matrix is one block; ``(ceil(N/128), ceil(K/128))`` read too), partial edge
  blocks allowed: ``w = fp32(q) * s``, read as ds_fpquant's ``block=(128, 128)``. The block size is not recorded
  in the files; 128 is the preset's (a scale shape that does not fit it is refused). ``fp8_pb_real`` (the same
  preset after ``mtq.compress``, real-quantized weights): the same tensors, ``weight_scale`` ``(ceil(N/128),
  ceil(K/128))``.
- ``MXFP8`` (``MXFP8_DEFAULT_CFG``): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` ``uint8``
  E8M0 bytes ``(N, K/32)``, ``w = fp32(q) * 2^(byte - 127)``: ds_fpquant's ``mxfp8_e4m3`` as stored.
- ``mxfp4`` (``MXFP4_DEFAULT_CFG``): ``<m>.weight`` ``uint8`` ``(N, K/2)``, two e2m1 codes a byte, the first in
  the low nibble (SPEC 6), ``<m>.weight_scale`` ``uint8`` E8M0 ``(N, K/32)``: ds_fpquant's ``mxfp4`` as stored.
  ``W4A8_MXFP4_FP8``: the same weight tensors (FP8 activations, no ``input_scale`` written by 0.47's export).
  The MX algos quantize activations dynamically (no ``input_scale``); ``K`` must be a multiple of 32.

``FP8``'s ``input_scale`` is applied: the linears run static per-tensor W8A8 (SPEC 8.3) unless ``load_quantized``
is given ``activation=None``; ``NVFP4``'s (FP4 activations) and experts' are not: those layers load weight-only and
:class:`~ds_fpquant.checkpoint.layouts.StaticActivationScalesWarning` says so once per load. Every ``input_scale``
is kept in ``model.ds_fpquant_activation_scales``. Registered in
:mod:`ds_fpquant.checkpoint.layouts` under ``quant_method: "modelopt"``, and found through ``hf_quant_config.json``
when ``config.json`` has no ``quantization_config``.
"""

from __future__ import annotations

import fnmatch
import json
import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ds_fpquant.checkpoint.layouts import registry as layouts
from ds_fpquant.checkpoint.layouts.registry import checked
from ds_fpquant.numerics.scales import SCALE_FLOOR
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["MODELOPT_METHOD", "HF_QUANT_CONFIG", "StaticInputScaleWarning", "is_modelopt", "check_config", "excluded",
           "from_parts"]

MODELOPT_METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"

#: quant_algo -> (weight format, whether activations carry a static input_scale)
#: (FP8_PER_CHANNEL_PER_TOKEN: per-channel weight scales, activations dynamic per token, no input_scale; loaded
#: weight-only like the rest)
#: (fp8_pb_wo: 128x128 FP8 blocks, weight-only; fp8_pb_real: the same after mtq.compress, (Nb, Kb) scales;
#: MXFP8, mxfp4: E8M0 groups of 32, activations dynamic MX, no input_scale; W4A8_MXFP4_FP8: mxfp4 weights, FP8
#: activations that ModelOpt 0.47 leaves dynamic, no input_scale written. The spellings are ModelOpt 0.47's: its
#: export writes "fp8_pb_wo", "fp8_pb_real" and "mxfp4" in lower case.)
ALGOS = {"FP8": ("e4m3", True), "FP8_PER_CHANNEL_PER_TOKEN": ("e4m3", False), "NVFP4": ("nvfp4", True),
         "W4A16_NVFP4": ("nvfp4", False), "fp8_pb_wo": ("e4m3_block", False), "fp8_pb_real": ("e4m3_block", False),
         "MXFP8": ("mxfp8_e4m3", False), "mxfp4": ("mxfp4", False), "W4A8_MXFP4_FP8": ("mxfp4", False)}

NVFP4_GROUP = 16
#: MX group size (OCP MX v1.0; ModelOpt's MXFP8QTensor.BLOCK_SIZE and its mxfp4 preset)
MX_GROUP = 32
#: fp8_pb_wo's block: hf_quant_config.json does not record it; ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG uses
#: 128x128 (the block TensorRT-LLM and vLLM assume for it)
FP8_BLOCK = 128


#: A ModelOpt checkpoint with static per-tensor activation scales (``input_scale``): the layouts' one warning.
StaticInputScaleWarning = layouts.StaticActivationScalesWarning


def is_modelopt(qconfig) -> bool:
    """Whether ``config.json``'s ``quantization_config`` is a ModelOpt one."""
    return isinstance(qconfig, dict) and qconfig.get("quant_method") == MODELOPT_METHOD


def check_config(qconfig: Optional[Dict[str, Any]], path: Path) -> Dict[str, Any]:
    """The ModelOpt description of checkpoint ``path``, from ``hf_quant_config.json``'s ``quantization`` (when the
    file is there) or ``config.json``'s ``quantization_config``, checked and normalized:
    ``{"quant_method": "modelopt", "quant_algo", "fmt", "group_size", "exclude_modules", "static_activations"}``.

    Raises:
        ValueError: neither describes a ModelOpt checkpoint, an unsupported ``quant_algo`` (allowed: FP8,
            FP8_PER_CHANNEL_PER_TOKEN, NVFP4, W4A16_NVFP4, fp8_pb_wo, fp8_pb_real, MXFP8, mxfp4,
            W4A8_MXFP4_FP8), an NVFP4 ``group_size`` other
            than 16 or an MX one other than 32, ``exclude_modules`` that is not a list of str.
    """
    source, where = qconfig, f"{str(path / 'config.json')!r}: quantization_config"
    hf_file = Path(path) / HF_QUANT_CONFIG
    if hf_file.is_file():
        try:
            source = json.loads(hf_file.read_text())["quantization"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{str(hf_file)!r} has no readable 'quantization' object: {exc}") from None
        where = f"{str(hf_file)!r}: quantization"
    if not isinstance(source, dict):
        raise ValueError(f"{where}={source!r} is not a ModelOpt quantization description")
    algo = source.get("quant_algo")
    if algo not in ALGOS:
        raise ValueError(f"{where}.quant_algo={algo!r}; ds_fpquant reads {', '.join(ALGOS)}")
    fmt, static = ALGOS[algo]
    group_size = source.get("group_size")
    if fmt == "nvfp4" and group_size not in (None, NVFP4_GROUP):
        raise ValueError(f"{where}.group_size={group_size!r}; NVFP4 has groups of {NVFP4_GROUP}")
    if fmt in ("mxfp8_e4m3", "mxfp4") and group_size not in (None, MX_GROUP):
        raise ValueError(f"{where}.group_size={group_size!r}; {algo} has groups of {MX_GROUP}")
    exclude = source.get("exclude_modules", source.get("ignore")) or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ValueError(f"{where}.exclude_modules={exclude!r} must be a list of module name patterns")
    return {"quant_method": MODELOPT_METHOD, "quant_algo": algo, "fmt": fmt,
            "group_size": {"nvfp4": NVFP4_GROUP, "mxfp8_e4m3": MX_GROUP, "mxfp4": MX_GROUP}.get(fmt),
            "exclude_modules": list(exclude),
            "static_activations": static}


def excluded(name: str, config: Dict[str, Any]) -> bool:
    """Whether module ``name`` is left unquantized by ``exclude_modules`` (``fnmatch`` patterns, as ModelOpt writes
    them: ``lm_head``, ``model.layers.*.mlp.gate``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in config["exclude_modules"])


def _expect(name: str, part: str, tensor: torch.Tensor, dtype: torch.dtype, shapes: Sequence[Tuple[int, ...]]):
    if tensor.dtype != dtype or tuple(tensor.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"{name}.{part}: a ModelOpt weight has {dtype} of shape "
                         f"{' or '.join(str(tuple(s)) for s in shapes)}; got {tensor.dtype} of shape {tuple(tensor.shape)}")


def from_parts(name: str, parts: Dict[str, torch.Tensor], shape, config: Dict[str, Any],
               dtype: torch.dtype) -> Tuple[QuantizedTensor, Optional[torch.Tensor]]:
    """The :class:`QuantizedTensor` of module ``name``'s ``(N, K)`` weight (``shape``) from its ModelOpt tensors
    ``parts`` (``weight``, ``weight_scale``, ``weight_scale_2`` for NVFP4, ``input_scale`` when the checkpoint has
    static activation scales), and the ``input_scale`` (fp32 0-dim) or ``None``. Nothing is requantized: FP8 per
    tensor is one ``(N, K)`` block, per channel blocks ``(1, K)``, ``fp8_pb_wo`` / ``fp8_pb_real`` blocks ``(128, 128)``;
    NVFP4, MXFP8 and mxfp4 (W4A8_MXFP4_FP8) are ds_fpquant's ``nvfp4``, ``mxfp8_e4m3`` and ``mxfp4`` as stored.

    Raises:
        ValueError: tensors missing or unexpected, of other dtypes or shapes, scales that are not positive and
            finite (fp32), a negative e4m3 group scale code or a tensor scale below ``2^-126``; ``K`` not a
            multiple of 16 for NVFP4 or of 32 for MXFP8 / mxfp4.
    """
    n, k = (int(v) for v in shape)
    fmt = config["fmt"]
    required = ("weight", "weight_scale") + (("weight_scale_2",) if fmt == "nvfp4" else ())
    allowed = required + ("input_scale",)
    missing = [f"{name}.{p}" for p in required if p not in parts]
    extra = [f"{name}.{p}" for p in parts if p not in allowed]
    if missing or extra:
        raise ValueError(f"{name}: a ModelOpt {config['quant_algo']} weight has the tensors {', '.join(required)} "
                         f"(and input_scale); missing: {missing}, unexpected: {extra}")
    input_scale = parts.get("input_scale")
    if input_scale is not None:
        _expect(name, "input_scale", input_scale, torch.float32, [()])
    weight, scale = parts["weight"], parts["weight_scale"]
    if fmt == "e4m3":
        _expect(name, "weight", weight, torch.float8_e4m3fn, [(n, k)])
        _expect(name, "weight_scale", scale, torch.float32, [(), (n,), (n, 1)])
        per_tensor = scale.dim() == 0
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ValueError(f"{name}.weight_scale: FP8 scales are finite and > 0; found {scale[bad].reshape(-1)[0].item()!r}")
        qt = QuantizedTensor(codes=weight.view(torch.uint8), scales=scale.reshape(1 if per_tensor else n, 1).clone(),
                             shape=torch.Size((n, k)), dtype=dtype, fmt="e4m3", group_size=k,
                             block=(n, k) if per_tensor else (1, k), scale_format="fp32")
    elif fmt == "e4m3_block":
        nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
        _expect(name, "weight", weight, torch.float8_e4m3fn, [(n, k)])
        # ModelOpt's block amax shape (Nb, 1, Kb, 1); a single block is written 0-dim
        shapes = [(nb, 1, kb, 1), (nb, kb)] + ([()] if nb * kb == 1 else [])
        if scale.dtype != torch.float32 or tuple(scale.shape) not in shapes:
            raise ValueError(f"{name}.weight_scale: a ModelOpt {config['quant_algo']} weight of shape ({n}, {k}) has float32 "
                             f"scales of {FP8_BLOCK}x{FP8_BLOCK} blocks, shape {' or '.join(map(str, shapes))} "
                             f"(hf_quant_config.json records no block size; ds_fpquant reads ModelOpt's "
                             f"{FP8_BLOCK}x{FP8_BLOCK}); got {scale.dtype} of shape {tuple(scale.shape)}")
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ValueError(f"{name}.weight_scale: FP8 scales are finite and > 0; found {scale[bad].reshape(-1)[0].item()!r}")
        qt = QuantizedTensor(codes=weight.view(torch.uint8), scales=scale.reshape(nb, kb).clone(),
                             shape=torch.Size((n, k)), dtype=dtype, fmt="e4m3", group_size=FP8_BLOCK,
                             block=(FP8_BLOCK, FP8_BLOCK), scale_format="fp32")
    elif fmt in ("mxfp8_e4m3", "mxfp4"):
        if k % MX_GROUP:
            raise ValueError(f"{name}: in_features={k} is not a multiple of {MX_GROUP}; ModelOpt {config['quant_algo']} "
                             f"quantizes whole groups of {MX_GROUP}")
        if fmt == "mxfp8_e4m3":
            _expect(name, "weight", weight, torch.float8_e4m3fn, [(n, k)])
        else:
            _expect(name, "weight", weight, torch.uint8, [(n, k // 2)])
        _expect(name, "weight_scale", scale, torch.uint8, [(n, k // MX_GROUP)])
        qt = QuantizedTensor(codes=weight.view(torch.uint8), scales=scale, shape=torch.Size((n, k)), dtype=dtype,
                             fmt=fmt, group_size=MX_GROUP, scale_format="e8m0")
    else:
        if k % NVFP4_GROUP:
            raise ValueError(f"{name}: in_features={k} is not a multiple of {NVFP4_GROUP}; ModelOpt NVFP4 packs whole groups")
        _expect(name, "weight", weight, torch.uint8, [(n, k // 2)])
        _expect(name, "weight_scale", scale, torch.float8_e4m3fn, [(n, k // NVFP4_GROUP)])
        _expect(name, "weight_scale_2", parts["weight_scale_2"], torch.float32, [()])
        t = parts["weight_scale_2"].item()
        if not (math.isfinite(t) and t >= SCALE_FLOOR):
            raise ValueError(f"{name}.weight_scale_2={t!r}: the NVFP4 tensor scale is finite and >= 2^-126 (SPEC 3.4)")
        codes = scale.view(torch.uint8)
        if bool((codes >= 0x80).any()):
            raise ValueError(f"{name}.weight_scale: NVFP4 group scale codes are non-negative e4m3; found a negative one")
        qt = QuantizedTensor(codes=weight, scales=codes, shape=torch.Size((n, k)), dtype=dtype, fmt="nvfp4",
                             group_size=NVFP4_GROUP, scale_format="e4m3", tensor_scale=parts["weight_scale_2"])
    return checked(name, qt, scale_values=False), input_scale  # scale values checked above


def _reading(qconfig: Dict[str, Any], path: Path) -> "layouts.Reading":
    config = check_config(qconfig, path)
    return layouts.Reading(
        method=MODELOPT_METHOD, own={}, suffixes=(".weight", ".weight_scale", ".weight_scale_2", ".input_scale"),
        code_dtypes=("U8",) if config["fmt"] in ("nvfp4", "mxfp4") else ("F8_E4M3",),
        from_parts=lambda name, parts, shape, dtype: from_parts(name, parts, shape, config, dtype)[0],
        activation_parts=("input_scale",),
        static_input=lambda name: config["fmt"] == "e4m3" and config["static_activations"],
        # exclude_modules are fnmatch patterns; the reading's ignore list takes "re:" entries (re.match)
        ignore=tuple("re:" + fnmatch.translate(p) for p in config["exclude_modules"]))


def _find(path: Path) -> Optional[Dict[str, Any]]:
    """``{"quant_method": "modelopt"}`` for a checkpoint with ``hf_quant_config.json`` (check_config reads it)."""
    return {"quant_method": MODELOPT_METHOD} if (Path(path) / HF_QUANT_CONFIG).is_file() else None


layouts.register((MODELOPT_METHOD,), _reading)
layouts.register_config_finder(_find)
