"""The CUDA GEMV kernel (``gemv_kernel`` in fp_gemv_kernels.cuh: SPEC 8.1's formula, exact codes, group partial
sums times the group scale, fp32, for up to 8 rows of x) executed in the CPU emulation under ASan/UBSan, against
the fp64 reference and the error bound every linear path is held to (unit/linear_bound.py, SPEC 8.2, with the
exact weights decode(q) * s). Called with exactly the arguments ``ds_fpquant.linear`` passes
the compiled op, for every element format, fp32 / E8M0 / NVFP4 / 2-D block scales, each dtype, ragged K
(groups and rows not multiples of 16 codes), misaligned buffers and a partial last block of rows."""

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound
from unit.ops.fp_quantizer.emulation.cuda_emulation import run_gemv
from unit.oracle import special_input

import ds_fpquant as fpq

FORMATS = list(fpq.FORMATS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 3, 8]


def weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).clamp(max=4)


def check(op, x, qt, bias=None):
    bias = None if bias is None else bias.to(x.dtype)  # a layer's bias has the activations' dtype
    y = run_gemv(op, x, qt, bias)
    assert y.shape == (x.shape[0], qt.shape[0]) and y.dtype == x.dtype
    assert_linear_within_bound(x, qt, bias, y)
    return y


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,group_size", [(300, 128), (129, 16), (7, 3), (256, 32), (40, 7), (1, 1), (48, 48)])
def test_gemv_row_groups(sm90, fmt, dtype, k, group_size):
    qt = fpq.quantize(weight(19, k, k), fmt, group_size)  # 19 rows: a partial last block of 8 warps
    bias = torch.randn(19)
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        check(sm90, x, qt, bias if m != 3 else None)


@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_e8m0_and_nvfp4_scales(sm90, preset, dtype):
    qt = fpq.quantize(weight(24, 200, 1), preset)
    for m in ROWS:
        check(sm90, torch.randn(m, 200).to(dtype), qt, torch.randn(24))


@pytest.mark.parametrize("block", [(128, 128), (3, 5), (16, 64)])
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e3m2"])
def test_gemv_2d_blocks(sm90, block, scale_format, fmt):
    qt = fpq.quantize(weight(37, 300, 2), fmt, block=block, scale_format=scale_format)
    check(sm90, torch.randn(5, 300).to(torch.bfloat16), qt, torch.randn(37))


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e4m7"])
def test_gemv_non_finite_weights_and_inputs(sm90, fmt):
    """A NaN weight poisons only its output feature; Inf inputs give Inf/NaN exactly where fp64 does."""
    w = weight(10, 64, 3)
    w[2, 5] = float("nan")
    qt = fpq.quantize(w, fmt, 16)
    x = special_input((4, 64), torch.float32, seed=3)
    x[1, 7] = float("inf")
    check(sm90, x, qt)


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_gemv_misaligned_buffers(sm90, offset):
    sm90.misalign = {"x": offset, "codes": offset - 1, "scales": 4, "bias": offset, "y": offset}
    for fmt, dtype in [("e4m3", torch.bfloat16), ("e2m1", torch.float16), ("e3m2", torch.bfloat16)]:
        qt = fpq.quantize(weight(9, 256, offset), fmt, 128)
        check(sm90, torch.randn(2, 256).to(dtype), qt, torch.randn(9))


def test_gemv_many_rows_and_empty(sm90):
    qt = fpq.quantize(weight(1000, 96, 4), "e4m3", 32)
    check(sm90, torch.randn(8, 96), qt, torch.randn(1000))
    assert sm90.last_launch.grid_x == 125 and sm90.last_launch.block_x == 256
    y = run_gemv(sm90, torch.randn(0, 96), qt, None)
    assert y.shape == (0, 1000) and sm90.last_launch is None


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e2m3"])
def test_gemv_every_m(sm90, fmt):
    """M = 1..8 (instantiations for 1, 2, 4, 8 rows: the rows past M are zeros and are not written), whole groups
    (the unmasked loop) and ragged ones, K over several shared-memory tiles."""
    for k, group_size in [(4096, 64), (1000, 100)]:
        qt = fpq.quantize(weight(9, k, k), fmt, group_size)
        for m in range(1, 9):
            check(sm90, torch.randn(m, k).to(torch.bfloat16), qt, torch.randn(9))


@pytest.mark.parametrize("arch", [890, None])
def test_gemv_other_archs(emulated_ops, arch):
    """sm_89 (the hardware e4m3 -> f16 conversion) and the software build (the codec's decode instead)."""
    op = emulated_ops[arch]
    for fmt in ["e4m3", "e5m2", "e2m1"]:
        qt = fpq.quantize(weight(11, 256, 5), fmt, 32)
        check(op, special_input((3, 256), torch.float32, seed=5), qt, torch.randn(11))
