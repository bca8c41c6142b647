"""Drop-in for DeepSpeed's ``matmul_fp8`` (``deepspeed.ops.fp_quantizer.matmul_fp8``): ``inp @ W`` for a ``(K, N)``
weight ``W`` held as ``FP_Quantize``'s e4m3 codes and fp32 group scales (issue 27).

DeepSpeed's ``matmul_fp8(inp, weight, scale, quantization_group_size, quantizer)`` takes the weight as
``FP_Quantize.quantize(w, q_bits=8, return_meta_tensor=True)`` makes it: e4m3 codes shaped like ``w`` and one fp32
scale per group of ``quantization_group_size`` consecutive elements of the *flattened* weight (SPEC 2 flat
grouping, SPEC 6.1; a short last group keeps its own scale). Its Triton kernel and its fallback
(``torch.matmul(inp, quantizer.dequantize(weight, scale=scale))``) both compute ``inp @ dequantize(weight)``,
with the weights rounded to bf16 / fp16 (the Triton kernel reads the scales as groups inside rows,
``s[k * (N // G) + n // G]``, which are the flat groups only where ``G`` divides ``N``). This one computes the
fallback's product, flat groups for every ``G``, under this project's linear contract (SPEC 8):

    ``y = round_to_dtype( sum_k inp[..., k] * w[k, n] )``, ``w[k, n] = fl(decode(q[k, n]) * s[(k * N + n) // G])``

products and sums in fp32, one rounding of the result to ``inp``'s dtype; within SPEC 8.2's bound
``|y - exact| <= 2 K 2^-24 sum_k |x_k| |w_k| + eps(dtype) |exact| + tiny(dtype)`` of the fp64 product with the
exact weights ``decode(q) * s``.

Why panels and not the fused small-M kernel: the fused kernel (SPEC 8.1) multiplies each group's partial sum
*over the contracted dim* by the group's scale. Here the groups run along ``N``, the output dim (and across rows
of ``W`` where ``G`` does not divide ``N``), so every product ``inp[k] * w[k, n]`` of a dot product has its own
scale and there is no partial sum to scale. The weight therefore takes SPEC 8.1's fp32-panel path: panels of
``PANEL_BYTES`` of weight rows are decoded as ``fl(decode(q) * s)`` in fp32 (one fp32 rounding per weight,
inside the bound) by :func:`ds_fpquant.dequantize` (the compiled CPU or CUDA op where it loads, the torch
reference otherwise; never the whole weight in full precision at once), and accumulated in fp32 by torch's
matmul, ``y32 += inp32[:, k0:k1] @ w[k0:k1]``. On CUDA tensors that matmul follows torch's fp32 settings
(``torch.backends.cuda.matmul.allow_tf32`` / ``torch.set_float32_matmul_precision`` may make it TF32, which the
bound does not cover); the CUDA path has not been run on a GPU.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ds_fpquant.integration.fp_quantizer import FP_Quantize
from ds_fpquant.integration.originals import REPLACED
from ds_fpquant.numerics import checks
from ds_fpquant.numerics.choices import BACKENDS
from ds_fpquant.numerics.packing import ceil_div
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantize import dequantize
from ds_fpquant.tensor.quantized_tensor import QuantizedTensor

__all__ = ["matmul_fp8", "PANEL_BYTES"]

#: Bytes of one panel of weight rows decoded in fp32 (a few MiB: it stays in the last-level cache while the
#: matmul reads it; at least one row per panel).
PANEL_BYTES = 4 * 2**20

#: The element format: DeepSpeed's matmul_fp8 decodes e4m3 (its Triton kernel's bit conversion; its fallback
#: dequantizes with FP_Quantize's defaults q_bits=8, q_mantisa_bits=3).
FMT = "e4m3"

#: Code dtypes read as the e4m3 bytes: uint8 / int8 (what FP_Quantize makes and takes) and float8_e4m3fn (the same
#: bytes as a float8 view).
CODE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)

#: Bytes of each little-endian fp32 scale (SPEC 6.1).
SCALE_BYTES = 4

#: ``codes(ga, gb)``: the codes of whole groups ``ga .. gb-1`` as ``(gb - ga, G)``; ``segment(g, a, b)``: codes
#: ``a .. b-1`` of group ``g`` as ``(1, b - a)``.
_Codes = Tuple[Callable[[int, int], torch.Tensor], Callable[[int, int, int], torch.Tensor]]


def _deepspeed_fp_quantize() -> type:
    """DeepSpeed's own ``FP_Quantize`` class, whether or not :func:`ds_fpquant.patch_deepspeed` replaced the name."""
    import deepspeed.ops.fp_quantizer.quantize as ds_quantize

    return REPLACED.get((ds_quantize, "FP_Quantize"), ds_quantize.FP_Quantize)


def _check_quantizer(quantizer, group_size: int) -> None:
    """``quantizer``: ``None`` (DeepSpeed's Triton path never reads it) or an ``FP_Quantize`` (this project's or
    DeepSpeed's) quantizing in groups of ``group_size``."""
    if quantizer is None:
        return
    if not isinstance(quantizer, (FP_Quantize, _deepspeed_fp_quantize())):
        raise TypeError(f"quantizer must be an FP_Quantize (ds_fpquant.FP_Quantize or DeepSpeed's "
                        f"deepspeed.ops.fp_quantizer.FP_Quantize) or None, got {type(quantizer).__name__}")
    own = getattr(quantizer, "group_size", None)
    if own != group_size:
        raise ValueError(f"quantization_group_size={group_size} but quantizer.group_size={own!r}: the weight's "
                         f"scales belong to one group size (DeepSpeed's Triton kernel reads the first, its fallback "
                         f"the second)")


def _check_codes(weight) -> torch.Tensor:
    """``weight``'s bytes as uint8 (a view)."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor of e4m3 codes (uint8, int8 or float8_e4m3fn), got "
                        f"{type(weight).__name__}")
    if weight.dtype not in CODE_DTYPES:
        raise TypeError(f"weight.dtype={weight.dtype} is not supported; allowed: torch.uint8, torch.int8, "
                        f"torch.float8_e4m3fn (the e4m3 codes of FP_Quantize.quantize(w, q_bits=8, "
                        f"return_meta_tensor=True))")
    return weight.view(torch.uint8)


def _groups_note(count: int, num_groups: int, k: int, n: int, g: int) -> str:
    """Why ``num_groups`` scales are expected, and a hint where ``count`` is what a group size that does not divide
    ``K * N`` would give without the short last group."""
    note = f"one per group of quantization_group_size={g} along the flattened ({k}, {n}) weight: ceil({k * n}/{g})"
    if (k * n) % g and count == (k * n) // g:
        note += (f"; quantization_group_size={g} does not divide K*N={k * n}, and FP_Quantize keeps the last "
                 f"{(k * n) % g} elements as a short group with its own scale (SPEC 2): its scale is missing")
    return note


def _fp32_scales(scale, num_groups: int, k: int, n: int, g: int, device) -> torch.Tensor:
    """``scale`` as fp32 ``(num_groups,)``: fp32 values (``FP_Quantize.get_scales()``, ``(num_groups, 1)``; any
    shape of ``num_groups`` values, read in order) or their little-endian bytes (``FP_Quantize.scale``, uint8 / int8 ``(num_groups, 4)``)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a torch.Tensor (fp32 scales, or their bytes uint8 (num_groups, 4)) or None, "
                        f"got {type(scale).__name__}")
    if scale.dtype == torch.float32:
        if scale.numel() != num_groups:  # any shape, as DeepSpeed's Triton kernel reads them: in order
            raise ValueError(f"scale has {scale.numel()} fp32 values (shape {tuple(scale.shape)}); expected "
                             f"{num_groups}, {_groups_note(scale.numel(), num_groups, k, n, g)}")
        checks.check_device("scale", scale, device)
        return scale.reshape(num_groups)
    if scale.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"scale.dtype={scale.dtype} is not supported; allowed: torch.float32 (get_scales()) or "
                        f"torch.uint8 / torch.int8 bytes (num_groups, 4) (FP_Quantize.scale)")
    if tuple(scale.shape) != (num_groups, SCALE_BYTES):
        rows = scale.shape[0] if scale.dim() == 2 and scale.shape[1] == SCALE_BYTES else -1
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected ({num_groups}, {SCALE_BYTES}), the fp32 "
                         f"scales' bytes: {_groups_note(rows, num_groups, k, n, g)}")
    checks.check_device("scale", scale, device)
    # an owning contiguous copy: the fp32 view needs 4-byte aligned rows
    return scale.view(torch.uint8).clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(num_groups)


def _meta_codes(codes: torch.Tensor, group_size: int) -> _Codes:
    """Accessors of meta codes (one byte per element, row-major)."""
    flat = codes.reshape(-1)  # a view of contiguous codes (a copy of the bytes otherwise)

    def whole(ga: int, gb: int) -> torch.Tensor:
        return flat[ga * group_size:gb * group_size].view(gb - ga, group_size)

    def segment(g: int, a: int, b: int) -> torch.Tensor:
        return flat[g * group_size + a:g * group_size + b].view(1, b - a)

    return whole, segment


def _buffer_codes(buf: torch.Tensor, group_size: int) -> _Codes:
    """Accessors of a SPEC 6.1 buffer: group ``g``'s codes are ``buf[g, :G]``."""
    def whole(ga: int, gb: int) -> torch.Tensor:
        return buf[ga:gb, :group_size]

    def segment(g: int, a: int, b: int) -> torch.Tensor:
        return buf[g:g + 1, a:b]

    return whole, segment


def _decode(codes: _Codes, scales: torch.Tensor, group_size: int, e0: int, e1: int, backend: str) -> torch.Tensor:
    """Elements ``e0 .. e1-1`` of the flattened weight, ``fl(decode(q) * s)`` in fp32 (SPEC 5), as a 1-D tensor:
    whole groups in one dequantize of ``(groups, G)``, a group cut by ``e0`` or ``e1`` as its own row (only the
    codes in the range are decoded, whatever the group size)."""
    whole, segment = codes
    g = group_size
    ga, gb = ceil_div(e0, g), e1 // g  # whole groups: ga .. gb-1
    if ga > gb:  # the range lies inside one group
        pieces = [(segment(gb, e0 - gb * g, e1 - gb * g), scales[gb:gb + 1])]
    else:
        pieces = []
        if e0 < ga * g:
            pieces.append((segment(ga - 1, e0 - (ga - 1) * g, g), scales[ga - 1:ga]))
        if ga < gb:
            pieces.append((whole(ga, gb), scales[ga:gb]))
        if gb * g < e1:
            pieces.append((segment(gb, 0, e1 - gb * g), scales[gb:gb + 1]))
    values = []
    for c, s in pieces:
        rows, k = c.shape
        qt = QuantizedTensor(codes=c, scales=s.reshape(rows, 1), shape=torch.Size((rows, k)), dtype=torch.float32,
                             fmt=FMT, group_size=k)
        values.append(dequantize(qt, torch.float32, backend=backend).reshape(-1))
    return values[0] if len(values) == 1 else torch.cat(values)



def matmul_fp8(inp: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor], quantization_group_size: int,
               quantizer=None, *, backend: str = "auto") -> torch.Tensor:
    """``inp @ dequantize(weight)`` for an e4m3 ``(K, N)`` weight quantized by ``FP_Quantize``: the drop-in for
    ``deepspeed.ops.fp_quantizer.matmul_fp8`` (same parameters, names and order; DeepSpeed's own code path:
    ``deepspeed/ops/fp_quantizer/fp8_gemm.py``). Results follow the linear contract (module doc, SPEC 8).

    Args:
        inp: activations ``(..., K)``, fp32 / fp16 / bf16 (DeepSpeed's kernels take bf16 / fp16), any leading dims
            (DeepSpeed's Triton kernel takes 2-D only; 1-D ``(K,)`` gives ``(N,)`` as ``torch.matmul``), any strides.
        weight: the e4m3 codes ``(K, N)`` of ``FP_Quantize.quantize(w, q_bits=8, return_meta_tensor=True)``:
            uint8 (what it returns), int8 or float8_e4m3fn (the same bytes). Read as e4m3 as DeepSpeed reads them
            (codes of another 8-bit format, ``q_mantisa_bits=2``, are not told apart by their bytes). With
            ``scale=None``: the buffer of ``FP_Quantize.quantize(w, q_bits=8)`` (uint8 ``(num_groups, G + 4)``,
            SPEC 6.1), the weight's ``(K, N)`` then being ``quantizer.orig_shape`` (DeepSpeed's fallback reads it
            so too).
        scale: the weight's scales (multipliers, SPEC 3): fp32, ``quantizer.get_scales()`` ``(num_groups, 1)`` (or
            any shape of ``num_groups`` values), or their little-endian bytes, ``quantizer.scale`` uint8 / int8
            ``(num_groups, 4)``; ``num_groups = ceil(K * N / G)``. ``None``: ``weight`` is a whole buffer.
        quantization_group_size: ``G``, the group size the weight was quantized with: an int >= 1, any value
            (groups run along the flattened weight, across rows where ``G`` does not divide ``N``, a short last
            group where it does not divide ``K * N``).
        quantizer: the ``FP_Quantize`` that quantized the weight (:class:`ds_fpquant.FP_Quantize`, or DeepSpeed's
            class), whose ``group_size`` must be ``G``; or ``None`` (the default, as DeepSpeed's Triton path never
            reads it; older DeepSpeed called ``matmul_fp8`` with four arguments). Needed with ``scale=None``.
        backend: keyword only, not in DeepSpeed's signature: ``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"torch"``,
            who decodes the weight panels (``ds_fpquant.dequantize``'s backends).

    Returns:
        ``(..., N)`` in ``inp``'s dtype on ``inp``'s device, differentiable in ``inp``: ``inp @ w`` with
        ``w = fl(decode(q) * s)`` in fp32, products and sums in fp32, one rounding to ``inp``'s dtype, within
        SPEC 8.2's bound of the exact product. NaN codes and NaN scales make NaN exactly the outputs they enter.
        Empty shapes are legal: ``M = 0`` or ``N = 0`` give an empty result, ``K = 0`` zeros.

    Raises:
        TypeError: ``inp`` not a tensor or not fp32 / fp16 / bf16; ``weight`` not a tensor of uint8 / int8 /
            float8_e4m3fn; ``scale`` not a tensor of fp32 / uint8 / int8 (nor ``None``);
            ``quantization_group_size`` not an int; ``quantizer`` not an ``FP_Quantize`` (nor ``None``);
            ``backend`` not a str.
        ValueError: ``inp`` 0-dim, ``inp.shape[-1] != K``, ``weight`` not 2-D, a scale count other than
            ``ceil(K * N / G)`` (the message says when ``G`` does not divide ``K * N`` and the short group's scale
            is missing), scale bytes not ``(num_groups, 4)``, ``quantization_group_size < 1`` or not
            ``quantizer.group_size``, ``scale=None`` without a 2-D ``quantizer.orig_shape`` or with a buffer of
            another shape, tensors on different devices, an unknown ``backend`` or one for another device. All
            raised before any kernel runs. (RuntimeError: ``backend="cpu"`` / ``"cuda"`` whose op does not load.)
    """
    checks.check_tensor("inp", inp)
    if inp.dim() < 1:
        raise ValueError("inp must have at least 1 dim (..., K), got a 0-dim tensor")
    g = checks.check_int("quantization_group_size", quantization_group_size, 1)
    _check_quantizer(quantizer, g)
    codes = _check_codes(weight)
    checks.check_choice("backend", backend, BACKENDS)
    if scale is None:  # DeepSpeed's fallback dequantizes a whole buffer to the quantizer's orig_shape
        orig = None if quantizer is None else getattr(quantizer, "orig_shape", None)
        if orig is None or len(orig) != 2:
            raise ValueError(f"scale=None takes weight as FP_Quantize's buffer and needs the (K, N) weight shape "
                             f"from quantizer.orig_shape; got quantizer.orig_shape={orig!r} (pass the scales, or "
                             f"the quantizer that quantized the (K, N) weight)")
        k, n = checks.check_shape("quantizer.orig_shape", orig)
        num_groups = ceil_div(k * n, g)
        checks.check_byte_tensor("weight", codes, (num_groups, g + SCALE_BYTES))
        scales = codes[:, g:].clone(memory_format=torch.contiguous_format).view(torch.float32).reshape(num_groups)
        accessors = _buffer_codes(codes, g)
    else:
        if codes.dim() != 2:
            raise ValueError(f"weight must be the 2-D (K, N) codes of FP_Quantize.quantize(w, q_bits=8, "
                             f"return_meta_tensor=True), got shape {tuple(weight.shape)}")
        k, n = codes.shape
        num_groups = ceil_div(k * n, g)
        scales = _fp32_scales(scale, num_groups, k, n, g, codes.device)
        accessors = _meta_codes(codes, g)
    if inp.shape[-1] != k:
        raise ValueError(f"inp has {inp.shape[-1]} features (shape {tuple(inp.shape)}); the weight has K={k} rows "
                         f"(weight (K, N) = ({k}, {n}))")
    checks.check_device("inp", inp, codes.device)
    backends.resolve(backend, codes.device)  # a backend for another device, or a compiled op that cannot load

    lead = inp.shape[:-1]
    m = math.prod(lead)
    x32 = inp.reshape(m, k).to(torch.float32)  # exact for bf16 / fp16
    if m == 0 or n == 0 or k == 0:  # nothing to decode: the empty product (zeros where K = 0), still in inp's graph
        return (x32 @ x32.new_zeros((k, n))).to(inp.dtype).reshape(*lead, n)
    rows = max(1, PANEL_BYTES // (n * 4))
    y32 = None
    for k0 in range(0, k, rows):
        k1 = min(k, k0 + rows)
        panel = _decode(accessors, scales, g, k0 * n, k1 * n, backend).view(k1 - k0, n)
        part = x32[:, k0:k1]
        y32 = part @ panel if y32 is None else y32.addmm_(part, panel)
    return y32.to(inp.dtype).reshape(*lead, n)
