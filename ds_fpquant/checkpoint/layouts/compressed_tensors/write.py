"""Writing the compressed-tensors layout (``quant_method: "compressed-tensors"``, the conventions of
compressed-tensors 0.20.1 that :mod:`ds_fpquant.checkpoint.layouts.compressed_tensors.read` reads; ``docs/checkpoints.md``).

What is written, per quantized weight ``<m>`` (``(N, K)``), by ``format``:

- ``float-quantized`` (``e4m3`` with fp32 scales): ``<m>.weight`` ``float8_e4m3fn`` ``(N, K)`` and ``<m>.weight_scale``
  fp32 multipliers (``w = q * s``), strategy ``tensor`` ``(1,)`` (``granularity="tensor"``), ``channel`` ``(N, 1)``
  (``granularity="channel"``), ``block`` ``(ceil(N/Br), ceil(K/Bc))`` (``block=(Br, Bc)``) or ``group``
  ``(N, ceil(K/G))`` (``group_size=G``).
- ``mxfp8-quantized`` (``mxfp8_e4m3``): e4m3 ``<m>.weight`` and ``uint8`` E8M0 ``<m>.weight_scale`` ``(N, K/32)``.
- ``mxfp4-pack-quantized`` (``mxfp4``): ``<m>.weight_packed`` ``uint8`` ``(N, K/2)`` (SPEC 6 packing, the first code in
  the low nibble, as compressed-tensors packs) and E8M0 ``<m>.weight_scale``.
- ``mxfp6-pack-quantized`` (``mxfp6_e2m3``; compressed-tensors' only 6-bit float is E2M3): ``<m>.weight_packed``
  ``uint8`` ``(N, 3K/4)``, SPEC 6's bit stream as it is (four codes a 3-byte little-endian word, the first in the
  lowest bits: byte for byte what its ``pack_fp6_to_uint8`` writes) and E8M0 ``<m>.weight_scale`` ``(N, K/32)``.
- ``nvfp4-pack-quantized`` (``nvfp4``): ``<m>.weight_packed``, ``<m>.weight_scale`` ``float8_e4m3fn`` ``(N, K/16)`` and
  ``<m>.weight_global_scale`` fp32 ``(1,)``, a divisor ``g`` (:func:`global_scale`).

``quantization_config``: one ``config_groups.group_0`` with ``targets: ["Linear"]``, the ``weights`` arguments
(``num_bits``, ``type: "float"``, ``symmetric``, ``dynamic: false``, ``strategy`` and ``group_size`` /
``block_structure``; the MX formats ``scale_dtype: "torch.uint8"``, as compressed-tensors' ``MXFP8A16`` /
``MXFP4A16`` / ``MXFP6A16`` presets dump them), ``input_activations`` static per tensor (:data:`STATIC_INPUT`,
``<m>.input_scale`` ``(1,)``) for layers that run static W8A8 (SPEC 8.3) and none otherwise; ``format``,
``quantization_status: "compressed"`` and ``ignore`` (the linears left unquantized).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

from ds_fpquant.checkpoint.layouts.compressed_tensors.read import METHOD
from ds_fpquant.numerics.formats import WHOLE
from ds_fpquant.version import __version__

__all__ = ["LAYOUT", "GlobalScaleRoundingWarning", "check", "to_parts", "quantization_config", "global_scale"]

#: the ``layout=`` name of this layout
LAYOUT = METHOD

#: what this layout holds, for messages
HOLDS = ("e4m3 with fp32 scales (granularity 'tensor' or 'channel', block=(Br, Bc), group_size=G), mxfp8_e4m3, "
         "mxfp4, mxfp6_e2m3, nvfp4")

#: the MX presets' weights arguments besides num_bits (compressed-tensors 0.20.1's MXFP*A16 presets: E8M0 scales)
_MX_ARGS = {"strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}

#: ds_fpquant preset -> (compressed-tensors format, the weights arguments)
_MX = {"mxfp8_e4m3": ("mxfp8-quantized", {"num_bits": 8, **_MX_ARGS}),
       "mxfp4": ("mxfp4-pack-quantized", {"num_bits": 4, **_MX_ARGS}),
       "mxfp6_e2m3": ("mxfp6-pack-quantized", {"num_bits": 6, **_MX_ARGS}),
       "nvfp4": ("nvfp4-pack-quantized", {"num_bits": 4, "strategy": "tensor_group", "group_size": 16})}


class GlobalScaleRoundingWarning(UserWarning):
    """compressed-tensors divides an NVFP4 group scale by ``weight_global_scale`` (``fl(decode(c) / g)``), ds_fpquant
    multiplies by the tensor scale (``fl(decode(c) * t)``); for some weights no fp32 ``g`` gives the same value for
    every group scale code the weight uses, and compressed-tensors' dequantized weight then differs from
    ds_fpquant's by at most ``2^-22`` of its magnitude (fp32, before rounding to the model dtype;
    ``docs/checkpoints.md``). ds_fpquant's own loader reads the codes and scales exactly either way."""


def check(fmt: str, group_size: Optional[int], block, scale_format: str) -> Dict[str, Any]:
    """The ``format`` and ``weights`` arguments of weights quantized with these settings (``group_size``,
    ``block`` and ``scale_format`` resolved, as a :class:`~ds_fpquant.QuantizedTensor` holds them).

    Raises:
        ValueError: a combination compressed-tensors cannot hold (names the layout, ``fmt`` and what it holds).
    """
    block = tuple(block) if block else None
    if fmt in _MX:
        name, weights = _MX[fmt]
        return {"format": name, "weights": {**weights, "type": "float", "symmetric": True, "dynamic": False}}
    if fmt != "e4m3" or scale_format != "fp32":
        raise ValueError(f"layout={LAYOUT!r} cannot hold fmt={fmt!r} with scale_format={scale_format!r}; it holds "
                         f"{HOLDS}")
    if block == (WHOLE, WHOLE):
        args: Dict[str, Any] = {"strategy": "tensor"}
    elif (block or (1, group_size)) == (1, WHOLE):
        args = {"strategy": "channel"}
    elif block is None or block[0] == 1:
        args = {"strategy": "group", "group_size": block[1] if block else group_size}
    elif WHOLE in block:
        raise ValueError(f"layout={LAYOUT!r} cannot hold fmt={fmt!r} with block={block!r} (a whole side); it holds "
                         f"{HOLDS}")
    else:
        args = {"strategy": "block", "block_structure": list(block)}
    return {"format": "float-quantized",
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **args}}


def _e4m3_values() -> torch.Tensor:
    return torch.arange(128, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)[:127]


def _step(g: torch.Tensor, k: int) -> torch.Tensor:
    """``g`` moved ``k`` fp32 ulps (positive finite ``g``, as an integer step on its bits)."""
    return (g.view(torch.int32) + k).view(torch.float32)


def global_scale(t: torch.Tensor, codes: Optional[torch.Tensor] = None, search: int = 8):
    """``(g, exact)``: the fp32 divisor ``weight_global_scale`` for the NVFP4 tensor scale ``t`` (0-d fp32).

    ``g`` depends on ``t`` only (so weights sharing ``t``, q/k/v and gate/up, share ``g``): the first of
    ``fl(1/t)`` and its neighbours within ``search`` ulps with ``fl(1/g) == t`` (ds_fpquant reads ``t`` back
    exactly) and ``fl(c / g) == fl(c * t)`` for every finite positive e4m3 value ``c``, else ``fl(1/t)``.
    ``exact``: whether ``fl(c / g) == fl(c * t)`` for every code of ``codes`` (the weight's e4m3 group scale codes,
    ``uint8``; all codes when ``None``; the NaN code ``0x7F`` is NaN both ways), i.e. compressed-tensors'
    ``fl(decode(q) * fl(decode(c) / g))`` equals ds_fpquant's ``fl(decode(q) * fl(decode(c) * t))`` bit for bit.
    Exact for every power-of-two ``t``."""
    t = t.detach().to("cpu", torch.float32).reshape(())
    values = _e4m3_values()
    target = values * t
    first = torch.ones((), dtype=torch.float32) / t
    chosen = first
    for k in sorted(range(-search, search + 1), key=abs):
        g = _step(first, k)
        if torch.equal(torch.ones((), dtype=torch.float32) / g, t) and torch.equal(values / g, target):
            chosen = g
            break
    used = torch.unique(codes.reshape(-1)).long() if codes is not None else None
    used = values if used is None else values[used[used < 127]]
    return chosen, bool(torch.equal(used / chosen, used * t))


def to_parts(qt, fmt_info: Dict[str, Any], inexact: List[str], name: str) -> Dict[str, torch.Tensor]:
    """The tensors that store ``qt`` (a weight quantized with the settings :func:`check` accepted) by part name
    (``weight`` / ``weight_packed``, ``weight_scale``, ``weight_global_scale``), on the CPU; ``name`` is added to
    ``inexact`` when its NVFP4 group scales cannot be reproduced exactly through a divisor (:func:`global_scale`)."""
    fmt = fmt_info["format"]
    n = qt.shape[0]
    if fmt == "float-quantized":
        strategy = fmt_info["weights"]["strategy"]
        scales = qt.scales.reshape(1) if strategy == "tensor" else (
            qt.scales.reshape(n, 1) if strategy == "channel" else qt.scales)
        return {"weight": qt.codes.view(torch.float8_e4m3fn).cpu(), "weight_scale": scales.cpu()}
    if fmt == "mxfp8-quantized":
        return {"weight": qt.codes.view(torch.float8_e4m3fn).cpu(), "weight_scale": qt.scales.cpu()}
    if fmt in ("mxfp4-pack-quantized", "mxfp6-pack-quantized"):  # SPEC 6's packed bytes, compressed-tensors' too
        return {"weight_packed": qt.codes.cpu(), "weight_scale": qt.scales.cpu()}
    g, exact = global_scale(qt.tensor_scale, qt.scales)
    if not exact:
        inexact.append(name)
    return {"weight_packed": qt.codes.cpu(), "weight_scale": qt.scales.view(torch.float8_e4m3fn).cpu(),
            "weight_global_scale": g.reshape(1)}


def warn_inexact(inexact: Sequence[str], stacklevel: int = 3) -> None:
    """One :class:`GlobalScaleRoundingWarning` for the NVFP4 weights ``inexact`` (if any)."""
    if inexact:
        warnings.warn(GlobalScaleRoundingWarning(
            f"{len(inexact)} NVFP4 weights have tensor scales t for which no fp32 weight_global_scale g gives "
            f"fl(c / g) == fl(c * t) for all their group scale codes c: compressed-tensors' dequantization of them "
            f"differs from ds_fpquant's by at most 2^-22 of |w| (fp32; ds_fpquant's loader reads them exactly): "
            f"{', '.join(inexact[:8])}{' ...' if len(inexact) > 8 else ''}"), stacklevel=stacklevel)


#: ``input_activations`` of layers with static per-tensor FP8 input scales (``<m>.input_scale`` ``(1,)``; SPEC 8.3),
#: as compressed-tensors' ``FP8`` preset writes them
STATIC_INPUT = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "tensor"}


def quantization_config(fmt_info: Dict[str, Any], not_converted: Sequence[str], static: bool = False) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config``: compressed-tensors' ``QuantizationConfig`` as it dumps it; with
    ``static``, the layers' activations are quantized statically per tensor (:data:`STATIC_INPUT`)."""
    return {"quant_method": METHOD, "format": fmt_info["format"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(fmt_info["weights"]),
                                          "input_activations": dict(STATIC_INPUT) if static else None,
                                          "output_activations": None,
                                          "format": fmt_info["format"]}},
            "ignore": list(not_converted), "kv_cache_scheme": None, "global_compression_ratio": None,
            "producer": {"name": "ds_fpquant", "version": __version__}}
