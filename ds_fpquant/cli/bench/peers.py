"""The torch weight-only kernels a CPU user gets from torchao today, built here without torchao.

* ``int8pack``: ``torch.ops.aten._weight_int8pack_mm(x, w, scales)``, the CPU kernel of torchao's int8
  weight-only layout before its version-2 tensors (torchao 0.18's ``Int8WeightOnlyConfig`` converts the int8
  weight to ``x``'s dtype and calls ``mm`` instead; ``bench --generate`` has a row of its own for it): ``w`` int8 ``(N, K)``, symmetric, one scale per output channel, ``scales`` ``(N,)`` in ``x``'s dtype;
  ``y = x @ (w * scales[:, None])^T``.
* ``int4pack``: torchao's CPU int4 weight-only tensor (``Int4OpaqueTensor``, G=128) runs
  ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros)`` on the weight that
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)`` packed from int32 codes ``q`` ``(N, K)``
  in ``0..15``. ``scales_and_zeros`` is ``(K / G, N, 2)`` in ``x``'s dtype, ``[..., 0]`` the scale and
  ``[..., 1]`` the zero of group ``g`` of output channel ``n``; the kernel dequantizes
  ``w[n, j] = (q[n, j] - 8) * scale[g, n] + zero[g, n]`` with ``g = j // G`` (ATen's
  ``native/cpu/int4mm_kernel.cpp`` shifts the codes to ``-8..7``; torch's inductor unpacks a packed weight with
  ``scale = 1, zero = 8`` for that reason). torchao's asymmetric quantization (``ZeroPointDomain.FLOAT``):
  ``scale = (max - min) / 15``, ``zero = min + 8 * scale``, ``q = clamp(round((w - min) / scale), 0, 15)``.

Each peer also returns its dequantized weight in fp64, and :func:`check_peer` verifies that a peer's output is
``x @ dequant(W)^T`` for its own quantization before the bench times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["PeerWeight", "int8pack_weight", "int4pack_weight", "peer_linear", "check_peer", "PeerLinear",
           "INT4_GROUP", "INT4_INNER_K_TILES"]

#: The group size of torchao's Int4WeightOnlyConfig (its default) and of the issue's table.
INT4_GROUP = 128

#: What torchao's CPU int4 tensor (``Int4OpaqueTensor``) passes: the CPU packing takes the argument and does not
#: need it.
INT4_INNER_K_TILES = 1


@dataclass
class PeerWeight:
    """One weight in a peer's layout. ``kind`` is ``"int8pack"`` or ``"int4pack"``; ``packed`` and ``scales`` are
    what the aten op takes (``scales``: the ``(N,)`` scales or the ``(K / G, N, 2)`` scales and zeros);
    ``dequantized`` the fp64 weight the op computes with, or its first rows (kept only when asked for: it is 8 bytes
    a weight)."""

    kind: str
    packed: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    group_size: int = 0
    dequantized: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        """Bytes the op reads for the weight: the packed codes plus the scales (and zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def int8pack_weight(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16, keep_dequantized: bool = False,
                    keep_rows: Optional[int] = None) -> PeerWeight:
    """Symmetric int8 per output channel: ``scale = amax(|w[n]|) / 127``, ``q = clamp(round(w / scale), -128, 127)``;
    the scales stored in ``dtype`` (``x``'s dtype, as the op takes them). ``keep_rows``: with ``keep_dequantized``,
    keep only the first rows of the fp64 weight (:func:`check_peer` then checks those outputs)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.clamp(torch.round(w / scales[:, None]), -128, 127).to(torch.int8)
    stored = scales.to(dtype)
    rows = slice(0, keep_rows)
    deq = q[rows].double() * stored[rows].double()[:, None] if keep_dequantized else None
    return PeerWeight("int8pack", q.contiguous(), stored.contiguous(), w.shape, 0, deq)


def int4pack_weight(w: torch.Tensor, dtype: torch.dtype = torch.bfloat16, group_size: int = INT4_GROUP,
                    keep_dequantized: bool = False, keep_rows: Optional[int] = None) -> PeerWeight:
    """Asymmetric uint4 in groups of ``group_size`` along K (torchao's Int4WeightOnlyConfig, see the module doc),
    packed by ``_convert_weight_to_int4pack_for_cpu``; scales and zeros ``(K / G, N, 2)`` in ``dtype``;
    ``keep_rows`` as for :func:`int8pack_weight`.

    Raises:
        ValueError: ``K`` is not a multiple of ``group_size`` or ``N`` not of 16 (what the packing takes).
    """
    n, k = w.shape
    if k % group_size or n % 16:
        raise ValueError(f"int4pack needs K ({k}) to be a multiple of its group size {group_size} and N ({n}) "
                         "a multiple of 16")
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-6)
    zero = lo + 8 * scale
    q = torch.clamp(torch.round((groups - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32).view(n, k)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (K/G, N, 2)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), INT4_INNER_K_TILES)
    deq = None
    if keep_dequantized:
        rows = min(n, n if keep_rows is None else keep_rows)
        sz = scales_and_zeros.double().transpose(0, 1)[:rows]  # (rows, K/G, 2)
        deq = ((q[:rows].view(rows, k // group_size, group_size).double() - 8) * sz[..., :1] + sz[..., 1:])
        deq = deq.view(rows, k)
    return PeerWeight("int4pack", packed, scales_and_zeros, w.shape, group_size, deq)


def peer_linear(x: torch.Tensor, p: PeerWeight) -> torch.Tensor:
    """``x @ dequant(W)^T`` by the peer's aten op; ``x`` 2-D, in the dtype the scales were stored in."""
    if p.kind == "int8pack":
        return torch.ops.aten._weight_int8pack_mm(x, p.packed, p.scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, p.packed, p.group_size, p.scales)


def check_peer(x: torch.Tensor, p: PeerWeight, y: Optional[torch.Tensor] = None) -> float:
    """How far ``peer_linear(x, p)`` is from ``x @ dequant(W)^T`` (fp64), as a share of the bound a correct kernel
    keeps: the weights rounded to ``x``'s dtype once (the ops may multiply in it), fp32 accumulation, one rounding
    of the output to ``x``'s dtype, elementwise
    ``u * |x| @ |W|^T * (1 + K * 2^-24 / u) + u * |ref| + 2^-24 * max|ref|`` with ``u`` the unit roundoff of
    ``x``'s dtype. Returns ``max |y - ref| / bound``: at most 1 for a peer that computes what it should (a
    scales-and-zeros layout mistake gives errors of the order of ``|ref|``, far above it). Where ``p`` kept only the
    first rows of its weight, the first as many outputs of every row of ``x`` are checked; ``y`` (the peer's output
    for ``x``, e.g. of a warm-up call) saves computing it again.

    Raises:
        ValueError: ``p`` was made without ``keep_dequantized``.
    """
    if p.dequantized is None:
        raise ValueError("check_peer needs the peer weight made with keep_dequantized=True")
    y = peer_linear(x, p) if y is None else y
    y = y[..., :p.dequantized.shape[0]]
    xd = x.double()
    ref = xd @ p.dequantized.T
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(x.dtype, 2.0**-24)
    k = x.shape[-1]
    bound = u * (xd.abs() @ p.dequantized.abs().T) * (1 + k * 2.0**-24 / u) + u * ref.abs()
    bound += 2.0**-24 * float(ref.abs().max())
    return float(((y.double() - ref).abs() / bound).max())


class PeerLinear(torch.nn.Module):
    """An ``nn.Linear`` stand-in that runs a peer's aten op (``x`` of any leading shape); for ``bench --generate``.
    It does what torchao's CPU paths do with their quantized weights; not torchao itself."""

    def __init__(self, linear: torch.nn.Linear, kind: str, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        weight = linear.weight.detach()
        p = int8pack_weight(weight, dtype) if kind == "int8pack" else int4pack_weight(weight, dtype)
        self.kind, self.group_size = p.kind, p.group_size
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", p.packed)
        self.register_buffer("scales", p.scales)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().to(dtype),
                                                                         requires_grad=False)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.packed, self.scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        p = PeerWeight(self.kind, self.packed, self.scales, torch.Size((self.out_features, self.in_features)),
                       self.group_size)
        y = peer_linear(x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous(), p).view(*lead, -1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)
