"""The CUDA kernels (csrc/fp_quantizer/includes/fp_quantize_kernels.cuh) executed without a GPU, in the
CPU emulation of the launch model under AddressSanitizer and UndefinedBehaviorSanitizer, bit for bit
against the torch reference.

The public API runs unchanged on the emulated op (installed as the ``"cpu"`` compiled op), so every
path the CUDA op serves is exercised as it is on a GPU: RNE and stochastic quantize, dequantize, fp32
and E8M0 scales, caller-given scales (``scales=``, NVFP4, 2-D blocks), row and flat grouping. Shapes
hit each kernel path: teams of 1..32 lanes, ragged rows, numel < G, empty tensors, misaligned base
pointers, code rows that are not 4-byte aligned, and grids whose grid-stride loop wraps. Each emulated
launch also runs a second time with the blocks in reverse order and the outputs pre-filled with 0xFF
instead of 0x00; the two must agree (emulated_op.cpp), so no output byte is left unwritten.
"""

import pytest
import torch
from unit.ops.fp_quantizer.emulation.cuda_emulation import DTYPES, installed_as_cpu_op, lanes_per_group
from unit.ops.fp_quantizer.emulation.cuda_emulation import check_against_reference as check
from unit.oracle import fp8_values, special_input

import ds_fpquant as fpq

FORMATS = list(fpq.FORMATS)
#: Teams of 1 (G <= 8), 2, 4, 8, 16 and 32 lanes (G > 128); 1536/1537: the largest group DeepSpeed's kernel
#: launched and one past it.
GROUP_SIZES = [1, 3, 8, 9, 16, 32, 33, 64, 100, 128, 256, 1536, 1537]


def test_group_sizes_cover_every_team_size():
    assert sorted({lanes_per_group(g) for g in GROUP_SIZES}) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_sm90_matches_reference(sm90, fmt, dtype, group_size):
    """Ragged rows (K = 2G + 5) and one row with fewer elements than a group, NaN/Inf/zero groups."""
    for shape in [(3, 2 * group_size + 5), (1, max(group_size - 1, 1))]:
        check(sm90, special_input(shape, dtype, seed=group_size), fmt, group_size)
    launch = sm90.last_launch
    assert launch is not None and launch.block_x == 256
    assert 1 << launch.team_log2 == lanes_per_group(min(group_size, max(group_size - 1, 1)))


@pytest.mark.parametrize("arch", [890, None], ids=["sm89", "software"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_other_archs_match_reference(emulated_ops, arch, fmt, dtype):
    """sm_89 takes the same hardware fp8 branch as sm_90; unset __CUDA_ARCH__ takes the software codec."""
    op = emulated_ops[arch]
    for group_size in [1, 8, 32, 100, 1537]:
        check(op, special_input((3, 2 * group_size + 5), dtype, seed=group_size), fmt, group_size,
              out_dtypes=[torch.float32])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [1, 3, 32, 100, 1537])
def test_stochastic_matches_reference(sm90, fmt, dtype, group_size):
    """SPEC 4: the same Philox words per element on every backend; offsets that start mid-block."""
    x = special_input((3, 2 * group_size + 5), dtype, seed=7 * group_size)
    for seed, offset in [(0, 0), (0x0123456789ABCDEF, 3), (2**64 - 1, 2**40 + 1)]:
        check(sm90, x, fmt, group_size, rounding="stochastic", seed=seed, offset=offset, out_dtypes=[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("scale_rounding", ["ceil", "floor"])
@pytest.mark.parametrize("group_size", [1, 32, 100, 1537])
def test_e8m0_scales_match_reference(sm90, fmt, scale_rounding, group_size):
    x = special_input((3, 2 * group_size + 5), torch.bfloat16, seed=group_size)
    check(sm90, x, fmt, group_size, scale_format="e8m0", scale_rounding=scale_rounding)
    tiny = torch.tensor([[2.0**-140, -(2.0**-149), 0.0, 2.0**-127]])  # subnormal amax, E8M0 at its floor
    check(sm90, tiny, fmt, 4, scale_format="e8m0", scale_rounding=scale_rounding)
    f = fpq.get_format(fmt)  # SPEC 3.2 cap: amax at FLT_MAX and one fp32 step either side of fmax * 2^(127 - emax)
    boundary = torch.tensor(f.fmax * 2.0 ** (127 - f.emax), dtype=torch.float32)
    near = [torch.finfo(torch.float32).max, torch.nextafter(boundary, boundary * 2).item(), boundary.item(),
            torch.nextafter(boundary, boundary * 0).item()]
    top = torch.tensor([[a, -a / 3, 1.0, 0.0] for a in near])
    check(sm90, top, fmt, 4, scale_format="e8m0", scale_rounding=scale_rounding)


@pytest.mark.parametrize("preset", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("grouping", ["row", "flat"])
def test_presets_match_reference(sm90, preset, grouping):
    """MX (E8M0 computed in the kernel) and NVFP4 (e4m3 group scales given to the kernel, SPEC 3.4)."""
    for shape in [(5, 301), (2, 16), (1, 7)]:
        check(sm90, special_input(shape, torch.bfloat16, seed=shape[1]), preset, grouping=grouping)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [(128, 128), (3, 5), (1, 7), (64, 1537)])
def test_blocks_match_reference(sm90, fmt, block):
    """2-D blocks: the kernels encode with the given per-segment scales (SPEC 2, 3)."""
    check(sm90, special_input((130, 300), torch.float16, seed=block[0]), fmt, block=block)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [1, 16, 100])
def test_given_scales_match_reference(sm90, fmt, group_size):
    """scales=: from the floor 2^-126 (every element saturates) up; a row of zeros."""
    x = special_input((4, 3 * group_size + 1), torch.float32, seed=group_size)
    x[1] = 0.0
    n_groups = -(-x.shape[1] // group_size)
    scales = torch.exp2(torch.randint(-126, 20, (4, n_groups)).float())
    scales[0, 0] = 2.0**-126
    check(sm90, x, fmt, group_size, scales=scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group_size", [3, 32, 1537])
def test_flat_grouping_matches_reference(sm90, fmt, group_size):
    check(sm90, special_input((5, 301), torch.bfloat16, seed=1), fmt, group_size, grouping="flat")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [2, 4, 8])
def test_misaligned_base_pointers(sm90, fmt, dtype, offset):
    """Every buffer starts `offset` bytes past a 256-byte boundary (whole elements for x and out; the codes
    at any byte, as a codes view into a larger buffer has): the vector loads/stores must fall back to
    scalar ones (UBSan reports a misaligned uint4/float4 access, as a GPU faults on one)."""
    element = torch.empty((), dtype=dtype).element_size()
    if offset % element:
        pytest.skip(f"{dtype} elements are {element} bytes: a {offset}-byte offset is not an element boundary")
    for group_size in [8, 64, 1537]:
        sm90.misalign = {"x": offset, "out": offset, "codes": offset - 1, "given": 4, "scales": 4}
        check(sm90, special_input((3, 2 * group_size + 8), dtype, seed=offset), fmt, group_size, out_dtypes=[dtype])
        check(sm90, special_input((2, 100), dtype, seed=offset), fmt, 16, scales=torch.full((2, 7), 0.5),
              out_dtypes=[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k,group_size", [(5, 5), (5, 3), (13, 8), (6, 6), (10, 4), (9, 1)])
def test_code_rows_not_word_aligned(sm90, fmt, k, group_size):
    """Rows whose code bytes are not a multiple of 4: every row but the first starts off a word boundary."""
    check(sm90, special_input((7, k), torch.float32, seed=k), fmt, group_size)


@pytest.mark.parametrize("max_blocks", [1, 2, 3])
@pytest.mark.parametrize("group_size", [1, 8, 100, 1537])
def test_grid_stride_loop_wraps(sm90, max_blocks, group_size):
    """A grid capped below the number of teams: each team loops over several groups, warps stay uniform."""
    sm90.max_blocks = max_blocks
    rows = 4 * (256 * max_blocks // lanes_per_group(group_size)) + 3
    x = special_input((rows, group_size + 3), torch.bfloat16, seed=max_blocks)
    check(sm90, x, "e2m1", group_size, out_dtypes=[torch.bfloat16])
    check(sm90, x, "e4m3", group_size, rounding="stochastic", seed=5, out_dtypes=[torch.bfloat16])
    launch = sm90.last_launch
    assert launch.grid_x == max_blocks and launch.grid_stride_wraps


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_and_smaller_than_a_group(sm90, fmt):
    for shape in [(1, 3), (1, 1), (7,)]:
        check(sm90, special_input(shape, torch.float32, seed=3), fmt, 128)
        assert sm90.last_launch.total_groups == 1
    for shape in [(0, 5), (4, 0)]:
        check(sm90, torch.empty(shape), fmt, 128)
        assert sm90.last_launch is None  # launch_over_groups launches nothing when there are no groups


def test_hardware_fp8_conversion_is_exercised(emulated_ops):
    """The sm_89+ branch converts through __nv_cvt_float2_to_fp8x2; every e4m3/e5m2 value and midpoint
    between neighbours (ties to even), and values past the largest finite one (satfinite), agree with
    the software path of the unset arch and with the reference."""
    for fmt in ["e4m3", "e5m2"]:
        values = fp8_values(fmt)
        mids = (values[1:] + values[:-1]) / 2
        x = torch.cat([values, mids, torch.tensor([1e30, -1e30, 3.4e38])]).view(1, -1)
        scales = torch.ones(1, 1)
        for arch in [900, 890, None]:
            op = emulated_ops[arch]
            with installed_as_cpu_op(op):
                fpq.quantize(x, fmt, x.shape[1], scales=scales, backend="cpu")
            # sm_89+: every element (in chunks of 8, in both runs of the launch) through the emulated cvt
            conversions = op.last_fp8_conversions
            assert conversions >= 2 * x.numel() if arch is not None else conversions == 0, (arch, conversions)
            check(op, x, fmt, x.shape[1], scales=scales, out_dtypes=[torch.float32])
