"""The packed code layout (SPEC 6), one module for every backend.

Each group's codes form a little-endian bit stream: element ``j`` of a group occupies bits
``[j*b, (j+1)*b)`` counting from bit 0 of the group's first byte. A group of ``g`` elements takes
``ceil(g*b/8)`` bytes; padding bits are 0. Rows hold their groups one after another.

The bit stream repeats every *pack unit*: ``lcm(b, 8) / b`` codes fill ``lcm(b, 8) / 8`` bytes
exactly (b=8: 1 code in 1 byte; b=4: 2 codes in 1 byte; b=6: 4 codes in 3 bytes; b=12: 2 codes
in 3 bytes). Packing works unit by unit: the unit's codes are or-ed into one integer word, whose
bytes are written low byte first.
"""

from __future__ import annotations

import math

import torch

__all__ = ["group_bytes", "row_bytes", "codes_per_unit", "bytes_per_unit", "pack_rows", "unpack_rows"]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints ``a >= 0``, ``b >= 1``: counts of groups, blocks and bytes."""
    return -(-a // b)


def codes_per_unit(bits: int) -> int:
    """Codes in one pack unit: ``lcm(bits, 8) / bits``."""
    return math.lcm(bits, 8) // bits


def bytes_per_unit(bits: int) -> int:
    """Bytes in one pack unit: ``lcm(bits, 8) / 8``."""
    return math.lcm(bits, 8) // 8


def group_bytes(g: int, bits: int) -> int:
    """Bytes taken by a group of ``g`` codes of ``bits`` bits: ``ceil(g*bits/8)``."""
    return (g * bits + 7) // 8


def row_bytes(k: int, group_size: int, bits: int) -> int:
    """Bytes of one packed row of ``k`` elements cut into groups of ``group_size`` (SPEC 6)."""
    n_full, tail = divmod(k, group_size)
    return n_full * group_bytes(group_size, bits) + group_bytes(tail, bits)


def _pack_segment(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` int (R, n, g) -> uint8 (R, n, ceil(g*bits/8)): n groups of g codes each."""
    rows, n, g = codes.shape
    unit = codes_per_unit(bits)
    nbytes = bytes_per_unit(bits)
    units = ceil_div(g, unit)
    padded = torch.zeros((rows, n, units * unit), dtype=torch.int64, device=codes.device)
    padded[..., :g] = codes
    padded = padded.view(rows, n, units, unit)
    code_shifts = torch.arange(unit, device=codes.device, dtype=torch.int64) * bits
    words = (padded << code_shifts).sum(dim=-1)  # disjoint bit fields: sum == or
    byte_shifts = torch.arange(nbytes, device=codes.device, dtype=torch.int64) * 8
    out = ((words.unsqueeze(-1) >> byte_shifts) & 0xFF).to(torch.uint8)
    return out.view(rows, n, units * nbytes)[..., :group_bytes(g, bits)]


def _unpack_segment(packed: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    """uint8 (R, n, ceil(g*bits/8)) -> int64 codes (R, n, g); inverse of :func:`_pack_segment`."""
    rows, n, have = packed.shape
    unit = codes_per_unit(bits)
    nbytes = bytes_per_unit(bits)
    units = ceil_div(g, unit)
    padded = torch.zeros((rows, n, units * nbytes), dtype=torch.int64, device=packed.device)
    padded[..., :have] = packed
    padded = padded.view(rows, n, units, nbytes)
    byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int64) * 8
    words = (padded << byte_shifts).sum(dim=-1)
    code_shifts = torch.arange(unit, device=packed.device, dtype=torch.int64) * bits
    codes = (words.unsqueeze(-1) >> code_shifts) & ((1 << bits) - 1)
    return codes.view(rows, n, units * unit)[..., :g]


def pack_rows(codes: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """Pack codes ``(R, K)`` (any integer dtype, values < 2^bits) into uint8 ``(R, row_bytes)``.

    Groups of ``group_size`` tile each row; the last group of a row may be shorter (SPEC 2, 6).
    """
    rows, k = codes.shape
    if bits == 8:
        return codes.to(torch.uint8)
    n_full, tail = divmod(k, group_size)
    pieces = []
    if n_full:
        full = codes[:, :n_full * group_size].reshape(rows, n_full, group_size)
        pieces.append(_pack_segment(full, bits).reshape(rows, n_full * group_bytes(group_size, bits)))
    if tail:
        last = codes[:, n_full * group_size:].reshape(rows, 1, tail)
        pieces.append(_pack_segment(last, bits).reshape(rows, group_bytes(tail, bits)))
    if not pieces:
        return torch.empty((rows, 0), dtype=torch.uint8, device=codes.device)
    return torch.cat(pieces, dim=1)


def unpack_rows(packed: torch.Tensor, k: int, group_size: int, bits: int) -> torch.Tensor:
    """Unpack uint8 ``(R, row_bytes(k, group_size, bits))`` into int64 codes ``(R, k)``."""
    rows = packed.shape[0]
    if bits == 8:
        return packed.to(torch.int64)
    n_full, tail = divmod(k, group_size)
    full_bytes = n_full * group_bytes(group_size, bits)
    pieces = []
    if n_full:
        full = packed[:, :full_bytes].reshape(rows, n_full, group_bytes(group_size, bits))
        pieces.append(_unpack_segment(full, group_size, bits).reshape(rows, n_full * group_size))
    if tail:
        last = packed[:, full_bytes:].reshape(rows, 1, group_bytes(tail, bits))
        pieces.append(_unpack_segment(last, tail, bits).reshape(rows, tail))
    if not pieces:
        return torch.empty((rows, 0), dtype=torch.int64, device=packed.device)
    return torch.cat(pieces, dim=1)
