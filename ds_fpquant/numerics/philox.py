"""Philox4x32-10 on int64 torch tensors (Salmon et al., SC'11): the random words of stochastic rounding
(SPEC 4), the same words on every backend."""

from __future__ import annotations

from typing import Tuple

import torch

from ds_fpquant.numerics.packing import ceil_div

#: Philox4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57


PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


PHILOX_ROUNDS = 10


_U32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of ``a * m`` for int64 tensors holding uint32 values.

    The 64-bit product would overflow int64, so it is built from 16-bit partial products.
    """
    a1, a0 = a >> 16, a & 0xFFFF
    m1, m0 = m >> 16, m & 0xFFFF
    mid = a1 * m0 + a0 * m1  # < 2^33
    low = a0 * m0 + ((mid & 0xFFFF) << 16)  # < 2^33
    hi = a1 * m1 + (mid >> 16) + (low >> 32)
    return hi & _U32, low & _U32


def philox4x32_10(counter, key) -> Tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors of uint32 values: ``counter`` 4 tensors, ``key`` 2 ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for rnd in range(PHILOX_ROUNDS):
        if rnd:
            k0, k1 = (k0 + PHILOX_W0) & _U32, (k1 + PHILOX_W1) & _U32
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(n: int, seed: int, offset: int, device=None) -> torch.Tensor:
    """The 32-bit random words of elements ``0 .. n-1`` (SPEC 4), as int64 in ``[0, 2^32)``.

    Element ``i`` takes output word ``i % 4`` of Philox4x32-10 with key ``(seed lo, seed hi)``
    and counter ``(offset lo, offset hi, (i // 4) lo, (i // 4) hi)``.
    """
    blocks = torch.arange(ceil_div(n, 4), dtype=torch.int64, device=device)
    zeros = torch.zeros_like(blocks)
    counter = (zeros + (offset & _U32), zeros + (offset >> 32), blocks & _U32, blocks >> 32)
    words = torch.stack(philox4x32_10(counter, (seed & _U32, seed >> 32)), dim=1)
    return words.reshape(-1)[:n]
