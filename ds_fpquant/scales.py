"""The scales a quantize call starts from, for every backend: a caller's fp32 scales (checked), the tile
scales of 2-D blocks (SPEC 2, 3) and NVFP4's two-level scales (SPEC 3.4). The backends then encode the
rows with these per-group fp32 scales, so all give the same bits."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import checks
from .formats import NVFP4_ELEMENT_FORMAT, NVFP4_SCALE_FORMAT, FPFormat, get_format
from .packing import ceil_div
from .reference import SCALE_FLOOR, fp32_groups, group_amax, group_scales, nvfp4_tensor_scale

__all__ = ["block_scales", "nvfp4_scales", "clear_groups", "check_given_scales"]


def block_scales(x2: torch.Tensor, f: FPFormat, block: Tuple[int, int], e8m0: Optional[str]):
    """2-D blocks (SPEC 2, 3): (stored tile scales ``(ceil(N/Br), ceil(K/Bc))``, and the fp32 scale of
    each (row, Bc-segment) ``(N, ceil(K/Bc))`` that the row kernels encode with).

    Codes are laid out exactly as row grouping with ``G = Bc``; only the scales differ, so every
    backend quantizes with these per-segment scales and gives the same bits.
    """
    br, bc = block
    n, k = x2.shape
    nr, nc = ceil_div(n, br), ceil_div(k, bc)
    x32 = torch.nn.functional.pad(x2.to(torch.float32), (0, nc * bc - k, 0, nr * br - n))
    tiles = x32.view(nr, br, nc, bc).permute(0, 2, 1, 3).reshape(nr, nc, br * bc)
    stored, used = group_scales(*group_amax(tiles), f, e8m0)
    return stored, used.repeat_interleave(br, dim=0)[:n].contiguous()


def nvfp4_scales(x2: torch.Tensor, group_size: int):
    """NVFP4 scales (SPEC 3.4) of ``x2`` ``(R, K)`` in groups of ``group_size`` along K.

    Returns ``(stored, t, used, zero)``: the stored e4m3 group scale codes (uint8 ``(R, ceil(K/G))``,
    ``0x7F`` for a group with NaN/Inf), the 0-d fp32 tensor scale ``t``, the fp32 scale each group's
    elements encode with (``s = fl(decode(c) * t)``; 1.0 where ``zero``, whose codes are then cleared)
    and the bool mask of the groups whose codes are all 0: ``s == 0``, or ``s`` so small (below
    2^-128) that ``r = fl(1/s)`` overflows (read as ``s == 0``; SPEC 3.4 does not cover it).
    """
    element, scale_code = get_format(NVFP4_ELEMENT_FORMAT), get_format(NVFP4_SCALE_FORMAT)
    amax, nonfinite = group_amax(fp32_groups(x2, group_size))
    amax_tensor = amax.amax() if amax.numel() else torch.zeros((), dtype=torch.float32, device=x2.device)
    t = nvfp4_tensor_scale(amax_tensor, element, scale_code)
    stored, s = group_scales(amax, nonfinite, element, tensor_scale=t)  # 0x7F marks a fault (SPEC 3.4)
    zero = ~torch.isfinite(torch.ones((), dtype=torch.float32, device=s.device) / s)
    return stored, t, torch.where(zero, torch.ones_like(s), s), zero


def clear_groups(packed: torch.Tensor, zero: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """Set every code of the groups in ``zero`` ``(R, n_groups)`` to 0 in the packed rows ``(R, row_bytes)``
    (each group starts on a byte and takes ``ceil(g * bits / 8)`` bytes, SPEC 6)."""
    group_bytes = ceil_div(group_size * bits, 8)
    group_of_byte = torch.arange(packed.shape[1], device=packed.device) // group_bytes
    return packed.masked_fill_(zero[:, group_of_byte], 0)


def check_given_scales(scales, expected_shape, device) -> torch.Tensor:
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor of float32, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales.dtype={scales.dtype} is not supported; allowed: torch.float32")
    if tuple(scales.shape) != tuple(expected_shape):
        raise ValueError(f"scales has shape {tuple(scales.shape)}; expected {tuple(expected_shape)} "
                         f"(one scale per group, SPEC 2)")
    checks.check_device("scales", scales, device)
    bad = ~(torch.isfinite(scales) & (scales >= SCALE_FLOOR))
    if bool(bad.any()):
        first = scales.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(f"scales must be finite and >= 2^-126 (SPEC 3.1) so that r = 1/s is finite; "
                         f"found {first!r}")
    return scales
