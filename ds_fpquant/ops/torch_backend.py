"""The torch reference as a backend: the row pipeline of SPEC 2-6 in plain torch, with the interface of the
compiled ops (``quantize``, ``dequantize``, ``linear``; :func:`ds_fpquant.ops.backends.resolve` returns this module
or a compiled one), so the public functions call every backend the same way. It is also the readable
reference the compiled kernels are checked against bit for bit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds_fpquant.numerics.codec import decode, encode, encode_stochastic, ieee_denormals
from ds_fpquant.numerics.formats import get_format
from ds_fpquant.numerics.packing import ceil_div, pack_rows, unpack_rows
from ds_fpquant.numerics.philox import random_words
from ds_fpquant.numerics.scales import fp32_groups, fp32_scales, group_amax, group_scales

__all__ = ["quantize", "dequantize", "linear", "WITH_CUDA", "BF16_QUIET_NAN"]

#: Like the CPU-only compiled op: no CUDA kernels (CUDA tensors are computed with torch's CUDA ops).
WITH_CUDA = False


#: The bf16 NaN every backend writes (the quiet NaN the C++ codec and c10::BFloat16 produce).
BF16_QUIET_NAN = 0x7FC0


def quantize(x2: torch.Tensor, fmt: str, group_size: int, given_scales: Optional[torch.Tensor], stochastic: bool,
             seed: int, offset: int, e8m0: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp ``(R, K)`` -> (uint8 packed codes ``(R, row_bytes)``, scales ``(R, ceil(K/G))``).

    ``stochastic``: SPEC 4 stochastic rounding with the Philox stream ``(seed, offset)``, else
    round-to-nearest-even. ``e8m0`` is the E8M0 ``scale_rounding`` (``"ceil"``/``"floor"``, SPEC 3.2;
    scales are then uint8 bytes), ``""`` for fp32 scales (SPEC 3.1); ``given_scales``: a caller's fp32 ones.
    """
    f = get_format(fmt)
    rows, k = x2.shape
    n_groups = ceil_div(k, group_size)
    pad = n_groups * group_size - k
    groups = fp32_groups(x2, group_size)
    stored, used = group_scales(*group_amax(groups), f, e8m0 or None, given_scales)
    r = torch.ones((), dtype=torch.float32, device=used.device) / used  # fl(1/s); exact 2^-e for E8M0
    if not stochastic:
        codes = encode(groups, r.unsqueeze(-1), f)
    else:  # random word of each element by its flat index (row * K + column), SPEC 4
        words = random_words(rows * k, seed, offset, device=x2.device).view(rows, k)
        if pad:
            words = torch.nn.functional.pad(words, (0, pad))
        codes = encode_stochastic(groups, r.unsqueeze(-1), words.view(rows, n_groups, group_size), f)
    codes = codes.view(rows, n_groups * group_size)[:, :k]
    return pack_rows(codes, group_size, f.bits), stored


def dequantize(packed: torch.Tensor, scales: torch.Tensor, k: int, fmt: str, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``(R, row_bytes)`` + fp32 scales ``(R, ceil(K/G))`` -> ``dtype`` ``(R, K)`` (SPEC 5)."""
    f = get_format(fmt)
    values = decode(unpack_rows(packed, k, group_size, f.bits), f)
    per_element = scales.repeat_interleave(group_size, dim=1)[:, :k]
    y = (values * per_element).to(dtype)  # one fp32 multiply, then RNE to dtype
    if dtype == torch.bfloat16:  # one NaN pattern on every backend (torch's cast may give 0xFFFF)
        y.view(torch.int16).masked_fill_(torch.isnan(y), BF16_QUIET_NAN)
    return y


#: Bytes of the fp32 group partial sums ``(groups, m, rows)`` the reference's linear holds per panel of weight rows.
PANEL_PARTIALS_BYTES = 32 * 2**20


def linear(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, kind: str, block_rows: int, tensor_scale: float,
           bias: Optional[torch.Tensor], fmt: str, group_size: int) -> torch.Tensor:
    """SPEC 8's linear for the compiled op's ``linear`` arguments, in plain torch (its readable reference):
    ``y[m, n] = sum_g s[n, g] * (sum_{j in g} x2[m, j] * decode(q[n, j])) + bias[n]``, fp32 throughout, one
    rounding to ``x2``'s dtype.

    ``x2`` ``(M, K)`` fp32 / fp16 / bf16; the weight's packed ``codes`` ``(N, row_bytes)`` and stored ``scales``
    (``kind`` ``"fp32"`` / ``"e8m0"`` / ``"e4m3"`` NVFP4 codes times ``tensor_scale``), one scale row per
    ``block_rows`` rows; ``bias`` ``(N,)`` in ``x2``'s dtype or None. The codes are decoded exactly (never rounded
    with their scale); each group's partial sum (a batched fp32 matmul over groups) is multiplied by its scale
    and the groups are added in fp32. Weight rows go in panels whose partial sums stay within
    ``PANEL_PARTIALS_BYTES``. Returns ``(M, N)`` of ``x2``'s dtype.
    """
    f = get_format(fmt)
    n, (m, k) = codes.shape[0], x2.shape
    g = min(group_size, max(k, 1))
    groups = ceil_div(k, g)
    pad = groups * g - k
    with torch.no_grad(), ieee_denormals():
        s = fp32_scales(scales, kind, torch.tensor(tensor_scale, dtype=torch.float32, device=scales.device))
        s = s.repeat_interleave(min(block_rows, max(n, 1)), dim=0)[:n].reshape(n, groups)  # Br >= N: one row of tiles
        xg = torch.nn.functional.pad(x2.float(), (0, pad)).view(m, groups, g).transpose(0, 1)  # (groups, M, G)
        y = torch.empty(m, n, dtype=torch.float32, device=x2.device)
        rows = max(1, PANEL_PARTIALS_BYTES // max(1, 4 * groups * m))
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            w = decode(unpack_rows(codes[n0:n1], k, g, f.bits), f)  # exact: decode(q), fp32
            w = torch.nn.functional.pad(w, (0, pad)).view(n1 - n0, groups, g).permute(1, 2, 0)  # (groups, G, rows)
            partial = torch.bmm(xg, w)  # (groups, M, rows): each group's partial sum
            y[:, n0:n1] = (partial * s[n0:n1].t().unsqueeze(1)).sum(0)
        if bias is not None:
            y += bias.float()
    return y.to(x2.dtype)
