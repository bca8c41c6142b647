"""Writing NVIDIA ModelOpt's layout (``quant_method: "modelopt"``, as nvidia-modelopt 0.47's ``export_hf_checkpoint``
writes it and :mod:`ds_fpquant.checkpoint.layouts.modelopt.read` reads it; ``docs/checkpoints.md``).

Per quantized weight ``<m>`` (``(N, K)``), by ``quant_algo`` (the spellings ModelOpt 0.47 writes):

- ``FP8`` (``e4m3``, fp32 scales, ``granularity="tensor"``): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``,
  ``<m>.weight_scale`` fp32 0-dim (a multiplier, ``w = q * s``).
- ``FP8_PER_CHANNEL_PER_TOKEN`` (``e4m3``, fp32 scales, ``granularity="channel"``): ``<m>.weight_scale`` fp32 ``(N,)``.
- ``fp8_pb_wo`` (``e4m3``, fp32 scales, ``block=(128, 128)``, the default block; ModelOpt's
  ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` fp32
  multipliers of the 128x128 blocks in ModelOpt's block amax shape ``(ceil(N/128), 1, ceil(K/128), 1)``, 0-dim when
  the matrix is one block (both as its export writes them); partial edge blocks allowed. ``hf_quant_config.json``
  records no block size (readers assume 128), so any other block is refused.
- ``MXFP8`` (``mxfp8_e4m3``): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)``, ``<m>.weight_scale`` ``uint8`` E8M0
  ``(N, K/32)``.
- ``mxfp4`` (``mxfp4``): ``<m>.weight`` ``uint8`` ``(N, K/2)`` (SPEC 6 packing, the first code in the low nibble, as
  ModelOpt's ``MXFP4QTensor`` packs), ``<m>.weight_scale`` ``uint8`` E8M0 ``(N, K/32)``.
- ``W4A16_NVFP4`` (``nvfp4``): ``<m>.weight`` ``uint8`` ``(N, K/2)`` (SPEC 6 packing, ModelOpt's), ``<m>.weight_scale``
  ``float8_e4m3fn`` ``(N, K/16)``, ``<m>.weight_scale_2`` fp32 0-dim, the multiplier ``t`` (SPEC 3.4, exactly ModelOpt's
  ``fl(decode(q) * fl(decode(c) * t))``).

The MX and NVFP4 algos need ``K`` a multiple of their group (:data:`GROUPS`; the writer refuses other weights).
``input_scale`` (fp32 0-dim) is written for layers that run static per-tensor W8A8 (SPEC 8.3; a model loaded from a
checkpoint with static input scales), under ``FP8`` only (per-tensor weights: ModelOpt's static FP8); other layouts
of static layers are refused by the writer, never dropped. ds_fpquant does not calibrate activations, so a model
quantized here has none: NVFP4 is the weight-only ``W4A16_NVFP4``, ``fp8_pb_wo`` is weight-only, ``MXFP8`` and
``mxfp4`` quantize activations dynamically, and ``FP8`` (ModelOpt has no weight-only per-tensor FP8 name) is written
without ``input_scale`` (a consumer that needs static activation scales for ``FP8`` refuses or computes them itself).

``hf_quant_config.json``: ``{"producer": {"name": "modelopt", "version": ...}, "quantization": {"quant_algo",
"kv_cache_quant_algo": null, "group_size": 16 (W4A16_NVFP4) / 32 (MXFP8; none for fp8_pb_wo and mxfp4, as ModelOpt
writes), "exclude_modules"}}``; ``config.json``'s ``quantization_config`` is what ModelOpt's
``convert_hf_quant_config_format`` makes of it (``config_groups`` for FP8 and W4A16_NVFP4 only).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ds_fpquant.checkpoint.layouts.modelopt.read import (
    FP8_BLOCK,
    HF_QUANT_CONFIG,
    MODELOPT_METHOD,
    MX_GROUP,
    NVFP4_GROUP,
)
from ds_fpquant.numerics.formats import WHOLE

__all__ = ["LAYOUT", "HF_QUANT_CONFIG", "NVFP4_GROUP", "GROUPS", "check", "to_parts", "hf_quant_config", "quantization_config"]

#: the ``layout=`` name of this layout
LAYOUT = MODELOPT_METHOD

#: the ModelOpt version whose export this layout follows (written as ``producer.version``)
MODELOPT_VERSION = "0.47.0"

HOLDS = (f"e4m3 with fp32 scales and granularity 'tensor' (FP8), 'channel' (FP8_PER_CHANNEL_PER_TOKEN) or "
         f"block=({FP8_BLOCK}, {FP8_BLOCK}) (fp8_pb_wo), mxfp8_e4m3 (MXFP8), mxfp4 (mxfp4), nvfp4 (W4A16_NVFP4)")

#: quant_algo -> the group along in_features its weights need whole (and hf_quant_config.json's group_size, but for
#: mxfp4, which ModelOpt 0.47's export writes without one)
GROUPS = {"W4A16_NVFP4": NVFP4_GROUP, "MXFP8": MX_GROUP, "mxfp4": MX_GROUP}

#: ds_fpquant preset -> quant_algo
_PRESETS = {"nvfp4": "W4A16_NVFP4", "mxfp8_e4m3": "MXFP8", "mxfp4": "mxfp4"}


def check(fmt: str, group_size: Optional[int], block, scale_format: str) -> str:
    """The ``quant_algo`` of weights quantized with these settings (resolved, as a
    :class:`~ds_fpquant.QuantizedTensor` holds them).

    Raises:
        ValueError: a combination ModelOpt's layout cannot hold (names the layout, ``fmt`` and what it holds).
    """
    block = tuple(block) if block else None
    if fmt in _PRESETS:
        return _PRESETS[fmt]
    if fmt == "e4m3" and scale_format == "fp32":
        if block == (WHOLE, WHOLE):
            return "FP8"
        if (block or (1, group_size)) == (1, WHOLE):
            return "FP8_PER_CHANNEL_PER_TOKEN"
        if block == (FP8_BLOCK, FP8_BLOCK):
            return "fp8_pb_wo"
    scaling = f"block={block!r}" if block else f"group_size={group_size!r}"
    why = (f" (ModelOpt's block FP8, fp8_pb_wo, records no block size: its readers assume {FP8_BLOCK}x{FP8_BLOCK})"
           if fmt == "e4m3" and scale_format == "fp32" and block else "")
    raise ValueError(f"layout={LAYOUT!r} cannot hold fmt={fmt!r} with scale_format={scale_format!r} and {scaling}"
                     f"{why}; it holds {HOLDS}")


def to_parts(qt, algo: str) -> Dict[str, torch.Tensor]:
    """The tensors that store ``qt`` (a weight quantized with the settings :func:`check` accepted as ``algo``) by
    part name (``weight``, ``weight_scale``, ``weight_scale_2``), on the CPU."""
    if algo == "W4A16_NVFP4":
        return {"weight": qt.codes.cpu(), "weight_scale": qt.scales.view(torch.float8_e4m3fn).cpu(),
                "weight_scale_2": qt.tensor_scale.reshape(()).cpu()}
    if algo == "mxfp4":  # packed e2m1 codes and E8M0 bytes as they are
        return {"weight": qt.codes.cpu(), "weight_scale": qt.scales.cpu()}
    if algo == "MXFP8":
        return {"weight": qt.codes.view(torch.float8_e4m3fn).cpu(), "weight_scale": qt.scales.cpu()}
    if algo == "fp8_pb_wo":  # (Nb, Kb) -> ModelOpt's block amax shape (Nb, 1, Kb, 1), 0-dim for one block
        nb, kb = qt.scales.shape
        scales = qt.scales.reshape(()) if nb * kb == 1 else qt.scales.reshape(nb, 1, kb, 1)
    else:
        scales = qt.scales.reshape(()) if algo == "FP8" else qt.scales.reshape(qt.shape[0])
    return {"weight": qt.codes.view(torch.float8_e4m3fn).cpu(), "weight_scale": scales.cpu()}


def hf_quant_config(algo: str, exclude: Sequence[str]) -> Dict[str, Any]:
    """``hf_quant_config.json``'s content."""
    quantization: Dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if algo in GROUPS and algo != "mxfp4":  # ModelOpt 0.47 writes no group_size for mxfp4
        quantization["group_size"] = GROUPS[algo]
    quantization["exclude_modules"] = list(exclude)
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quantization}


def quantization_config(algo: str, exclude: Sequence[str]) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config``, as ModelOpt 0.47's ``convert_hf_quant_config_format`` derives it
    from :func:`hf_quant_config` (compressed-tensors-style ``config_groups`` for FP8 and W4A16_NVFP4; none for
    fp8_pb_wo, MXFP8 and mxfp4, which it does not convert)."""
    qconfig: Dict[str, Any] = {}
    if algo == "FP8":
        qconfig["config_groups"] = {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}}
    elif algo == "W4A16_NVFP4":
        qconfig["config_groups"] = {"group_0": {
            "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP},
            "targets": ["Linear"]}}
    qconfig.update(ignore=list(exclude), quant_algo=algo, producer=hf_quant_config(algo, exclude)["producer"],
                   quant_method=MODELOPT_METHOD)
    return qconfig
