"""The CUDA tensor-core GEMV (``gemv_mma_kernel`` / ``gemv_fp32_kernel`` in fp_gemv_kernels.cuh: SPEC 8.1's formula,
exact codes in mma.sync fragments, group chains times the group scale, for up to 16 rows of x) executed in the CPU
emulation under ASan/UBSan (mma.sync with the worst-case accumulation SPEC 8.2 allows, cp.async poisoned until its
wait_group), against the fp64 reference and SPEC 8.2's tensor-core bound (unit/linear_bound.py with the exact weights
decode(q) * s). Called with exactly the arguments ``ds_fpquant.linear`` passes the compiled op, for every element
format, fp32 / E8M0 / NVFP4 / 2-D block scales, each dtype, the aligned path (every lane layout: whole windows, groups
of 16, 32, 64) and the padded one (ragged K and groups, misaligned buffers), split K, M = 1..16 and a partial last
tile of rows."""

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound, exact_weight, tensor_core_roundings
from unit.ops.fp_quantizer.emulation.cuda_emulation import run_gemv
from unit.oracle import special_input

import ds_fpquant as fpq

FORMATS = list(fpq.FORMATS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROWS = [1, 3, 8, 9, 16]


def weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).clamp(max=4)


def check(op, x, qt, bias=None):
    bias = None if bias is None else bias.to(x.dtype)  # a layer's bias has the activations' dtype
    y = run_gemv(op, x, qt, bias)
    assert y.shape == (x.shape[0], qt.shape[0]) and y.dtype == x.dtype
    assert_linear_within_bound(x, qt, bias, y, tensor_cores=True)
    return y


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,group_size", [(300, 128), (129, 16), (7, 3), (256, 32), (40, 7), (1, 1), (48, 48)])
def test_gemv_row_groups(sm90, fmt, dtype, k, group_size):
    qt = fpq.quantize(weight(19, k, k), fmt, group_size)  # 19 rows: a partial tile of 64
    bias = torch.randn(19)
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        check(sm90, x, qt, bias if m != 3 else None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [16, 32, 64, 128, 1024])
def test_gemv_aligned_layouts(sm90, fmt, dtype, group_size):
    """The aligned path (cp.async ring, several stages per block, the ring reused) with each lane layout: groups of
    whole windows, the piece layouts of groups 16 / 32 / 64 where the format has them, one group per row; M = 1 and 16
    (one and two n-tiles)."""
    k = 1024
    qt = fpq.quantize(weight(70, k, group_size), fmt, group_size)
    for m in (1, 16):
        check(sm90, torch.randn(m, k).to(dtype), qt, torch.randn(70))
        assert sm90.last_launch.grid_x == 2 and sm90.last_launch.block_x == 128


@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_e8m0_and_nvfp4_scales(sm90, preset, dtype):
    qt = fpq.quantize(weight(24, 512, 1), preset)
    for m in ROWS:
        check(sm90, torch.randn(m, 512).to(dtype), qt, torch.randn(24))


@pytest.mark.parametrize("block", [(128, 128), (3, 5), (16, 64), (64, 32)])
@pytest.mark.parametrize("scale_format", ["fp32", "e8m0"])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e3m2"])
def test_gemv_2d_blocks(sm90, block, scale_format, fmt):
    qt = fpq.quantize(weight(137, 512, 2), fmt, block=block, scale_format=scale_format)
    check(sm90, torch.randn(5, 512).to(torch.bfloat16), qt, torch.randn(137))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1", "e4m7"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_non_finite_weights_and_inputs(sm90, fmt, dtype):
    """A NaN weight poisons only its output feature; Inf inputs give Inf/NaN exactly where fp64 does (e5m2's Inf codes
    too), through the mma's special values."""
    w = weight(10, 256, 3)
    w[2, 5] = float("nan")
    if fmt == "e5m2":
        w[4, 9] = float("inf")
    qt = fpq.quantize(w, fmt, 32)
    x = special_input((4, 256), torch.float32, seed=3).to(dtype)
    x[1, 7] = float("inf")
    check(sm90, x, qt)


@pytest.mark.parametrize("offset", [2, 4, 8])
def test_gemv_misaligned_buffers(sm90, offset):
    """Code rows or x off 16 bytes take the padded path (byte loads); scales, bias and y at any offset."""
    for fmt, dtype in [("e4m3", torch.bfloat16), ("e2m1", torch.float16), ("e3m2", torch.bfloat16),
                       ("e4m7", torch.float32)]:
        at = offset * dtype.itemsize // 2  # whole elements of x's dtype (a tensor starts aligned to its element)
        sm90.misalign = {"x": at, "codes": offset - 1, "scales": 4, "bias": at, "y": at}
        qt = fpq.quantize(weight(9, 512, offset), fmt, 128)
        check(sm90, torch.randn(2, 512).to(dtype), qt, torch.randn(9))


def test_gemv_split_k_and_tiles(sm90):
    """Few tiles on many SMs split K (the last block of a tile adds the splits in order); many tiles do not."""
    qt = fpq.quantize(weight(130, 4096, 4), "e4m3", 128)
    x = torch.randn(4, 4096).to(torch.bfloat16)
    sm90.num_sms = 132
    y_split = check(sm90, x, qt, torch.randn(130))
    launch = sm90.last_launch
    assert (launch.grid_x, launch.block_x) == (3, 128) and launch.grid_y == 8  # 8 stages of 512 codes, one per split
    sm90.num_sms = 1
    y_whole = check(sm90, x, qt, torch.randn(130))
    assert sm90.last_launch.grid_y == 1
    assert y_split.shape == y_whole.shape
    y = run_gemv(sm90, torch.randn(0, 4096), qt, None)
    assert y.shape == (0, 130) and sm90.last_launch is None


def test_gemv_split_k_counters_created_once_per_stream(sm90):
    """Issue 42: no memset per call. The split-K counters live in the launcher's workspace per device and stream
    (fp_gemv_workspace.h), zero-filled when created and reused by every later launch on that stream: the last block of
    each tile leaves its counter at 0 (the emulation fails a launch after which one is not, and runs each request's
    launch twice on the same buffer, the second trusting the first's reset)."""
    qt = fpq.quantize(weight(130, 4096, 5), "e2m1", 32)
    x = torch.randn(3, 4096).to(torch.bfloat16)
    sm90.stream = 1001
    check(sm90, x, qt, torch.randn(130))
    first = sm90.last_workspace
    assert sm90.last_launch.grid_y > 1 and first.capacity >= sm90.last_launch.grid_x and first.counters != 0
    for m, dtype in [(1, torch.float16), (16, torch.bfloat16), (9, torch.float32)]:  # other kernels, same stream
        check(sm90, torch.randn(m, 4096).to(dtype), qt)
        assert sm90.last_launch.grid_y > 1 and sm90.last_workspace == first
    check(sm90, x[:, :2048], fpq.quantize(weight(70, 2048, 6), "e4m3", 128))  # another layer
    assert sm90.last_launch.grid_y > 1 and sm90.last_workspace == first
    sm90.stream = 1002  # another stream: a buffer of its own, created once too
    check(sm90, x, qt)
    other = sm90.last_workspace
    assert other.created == first.created + 1 and other.counters not in (0, first.counters)
    check(sm90, x, qt)
    assert sm90.last_workspace == other
    sm90.stream = 1001
    check(sm90, x, qt)
    assert sm90.last_workspace.counters == first.counters and sm90.last_workspace.created == other.created


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1", "e2m3"])
def test_gemv_every_m(sm90, fmt):
    """M = 1..16 (instantiations for 8 and 16 rows: B columns past M repeat a row of x and are not written), whole
    groups (the aligned path) and ragged ones (padded), K over several stages."""
    for k, group_size in [(2048, 64), (1000, 100)]:
        qt = fpq.quantize(weight(9, k, k), fmt, group_size)
        for m in range(1, 17):
            check(sm90, torch.randn(m, k).to(torch.bfloat16), qt, torch.randn(9))


@pytest.mark.parametrize("arch", [890, None])
def test_gemv_other_archs(emulated_ops, arch):
    """sm_89 (the hardware e4m3 -> f16 conversion) and the software build (the codec's decode instead)."""
    op = emulated_ops[arch]
    for fmt in ["e4m3", "e5m2", "e2m1"]:
        qt = fpq.quantize(weight(11, 256, 5), fmt, 32)
        for dtype in DTYPES:
            check(op, special_input((3, 256), torch.float32, seed=5).to(dtype), qt, torch.randn(11))


def test_gemv_subnormal_codes(sm90):
    """Codes in each format's subnormal range (exponent field 0) decode exactly: through bf16 subnormals and the exact
    multiply by 2^(127 - bias) (bf16 x), f16 subnormals (fp16 x), widened to fp32 (fp32 x)."""
    for fmt, f in fpq.FORMATS.items():
        w = torch.full((16, 256), f.min_normal)
        w[:, 1::2] = f.min_subnormal * (torch.arange(128) % (2 ** f.mbits - 1) + 1)  # every subnormal code
        w[:, ::4] *= -1
        qt = fpq.quantize(w, fmt, 128, scales=torch.ones(16, 2))
        d = exact_weight(qt)
        assert bool(((d.abs() < f.min_normal) & (d != 0)).any()), fmt
        for dtype in DTYPES:
            check(sm90, torch.randn(2, 256).to(dtype), qt)


def test_gemv_tensor_core_truncation(sm90):
    """The emulated mma truncates (SPEC 8.2's worst case): one chain of 4096 products, the first 1, then 4094 just below
    the accumulator's alignment unit 2^-23 (each lost to truncation; one rounding to nearest per addition would round
    each up and lose almost nothing), the last -1 (the result cancels, so the accumulation error shows through the bf16
    output): the error is almost the whole exact result and inside SPEC 8.2's tensor-core bound."""
    k = 4096
    qt = fpq.quantize(torch.ones(16, k), "e4m3", k, scales=torch.ones(16, 1))
    x = torch.full((1, k), (2 - 2.0**-7) * 2.0**-24)  # a bf16 value
    x[0, 0], x[0, -1] = 1.0, -1.0
    x = x.to(torch.bfloat16)
    sm90.num_sms = 1  # one block: one chain over K
    y = run_gemv(sm90, x, qt, None)
    assert sm90.last_launch.grid_y == 1
    exact = (x.double() @ exact_weight(qt).T)[0, 0].item()
    size = (x.double().abs() @ exact_weight(qt).abs().T)[0, 0].item()
    err = abs(y[0, 0].double().item() - exact)
    assert err > 0.9 * exact  # the small products are lost against the accumulator of 1
    assert err <= 2 * tensor_core_roundings(k, k) * 2.0**-24 * size + 2.0**-8 * abs(exact)
    assert_linear_within_bound(x, qt, None, y, tensor_cores=True)
