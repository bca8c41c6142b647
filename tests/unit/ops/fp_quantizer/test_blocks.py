"""SPEC 2 / 6 2-D block scaling: one scale per (Br, Bc) tile, edge tiles smaller, codes laid out as
row grouping with G = Bc; bit for bit against the oracle on every backend."""

import numpy as np
import pytest
import torch
from unit.linear_bound import assert_linear_within_bound
from unit.oracle import SPEC_FMAX, assert_bitwise_equal, code_values, encode, pack_group

import ds_fpquant as fpq
from ds_fpquant.linear import linear as fused_linear
from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

FORMATS = list(fpq.FORMATS)


def _oracle(x: np.ndarray, fmt: str, br: int, bc: int):
    n, k = x.shape
    nr, nc = -(-n // br), -(-k // bc)
    scales = np.zeros((nr, nc), np.float32)
    stored = np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            tile = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].astype(np.float32)
            finite = np.isfinite(tile)
            amax = np.float32(np.abs(np.where(finite, tile, 0)).max())
            s = np.float32(1.0) if amax == 0 else max(np.float32(amax / np.float32(SPEC_FMAX[fmt])),
                                                       np.float32(2.0**-126))
            scales[i, j] = s
            stored[i, j] = np.nan if (fmt not in ("e4m3", "e5m2") and not finite.all()) else s
    per_elem = np.repeat(np.repeat(scales, br, 0)[:n], bc, 1)[:, :k]
    codes = encode(x.astype(np.float32), per_elem, fmt)
    rows = [b"".join(pack_group(row[j:j + bc], fmt) for j in range(0, k, bc)) for row in codes]
    packed = np.frombuffer(b"".join(rows), np.uint8).reshape(n, -1)
    stored_elem = np.repeat(np.repeat(stored, br, 0)[:n], bc, 1)[:, :k]
    with np.errstate(invalid="ignore"):
        deq = (code_values(fmt)[codes].astype(np.float32) * stored_elem).astype(np.float32)
    return packed, stored, deq


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,block", [((300, 200), (128, 64)), ((7, 9), (4, 4)), ((5, 3), (128, 128)),
                                         ((256, 256), (128, 128))])
def test_blocks_exact(target, fmt, shape, block):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape, generator=gen).float())
    x[0, 0] = float("nan") if shape[0] > 100 else x[0, 0]
    packed, stored, deq = _oracle(x.numpy(), fmt, *block)
    qt = fpq.quantize(x.to(target.device), fmt, block=block, backend=target.backend)
    assert qt.block == block and qt.group_size == block[1]
    assert_bitwise_equal(qt.codes.cpu(), packed, "codes")
    assert_bitwise_equal(qt.scales.cpu(), stored, "tile scales")
    assert_bitwise_equal(qt.dequantize(torch.float32, backend=target.backend).cpu(), deq, "dequantized")


def test_blocks_e8m0_and_stochastic_agree_across_backends():
    x = torch.randn(130, 70)
    for kw in (dict(scale_format="e8m0"), dict(rounding="stochastic", seed=3), dict(scale_format="e8m0",
                                                                                    scale_rounding="floor")):
        a = fpq.quantize(x, "e2m1", block=(32, 32), backend="torch", **kw)
        b = fpq.quantize(x, "e2m1", block=(32, 32), backend="cpu", **kw)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        assert torch.equal(a.dequantize(backend="torch"), b.dequantize(backend="cpu"))
    e8 = fpq.quantize(x, "e4m3", block=(64, 64), scale_format="e8m0")
    assert e8.scales.dtype == torch.uint8 and e8.scales.shape == (3, 2)


def test_block_errors():
    with pytest.raises(ValueError, match=r"block=\(2, 2\) needs a 2-D tensor"):
        fpq.quantize(torch.randn(2, 3, 4), block=(2, 2))
    with pytest.raises(ValueError, match="grouping must be 'row'"):
        fpq.quantize(torch.randn(4, 4), block=(2, 2), grouping="flat")
    with pytest.raises(TypeError, match=r"block must be a \(Br, Bc\) pair"):
        fpq.quantize(torch.randn(4, 4), block=128)
    with pytest.raises(ValueError, match=r"block\[1\]=0"):
        fpq.quantize(torch.randn(4, 4), block=(2, 0))


def test_linear_with_blocks():
    lin = torch.nn.Linear(200, 130)
    q = FPQuantizedLinear.from_linear(lin, "e4m3", block=(128, 128))
    assert "block=(128, 128)" in repr(q) and q.weight_scales.numel() == 2 * 2 * 4
    x = torch.randn(3, 200)
    qt = fpq.quantize(lin.weight.detach(), "e4m3", block=(128, 128))
    assert torch.equal(q(x), fused_linear(x, qt, lin.bias))  # the layer's forward is this call: the same bits
    assert_linear_within_bound(x, qt, lin.bias, q(x))  # against fp64 x @ dequantize(W)^T + b
