"""The AVX-512 BF16 / AMX GEMM of the CPU linear (issue 44, ``csrc/fp_quantizer/fp_linear_gemm_avx512_cpu.cpp``):
``avx512_gemm`` (vdpbf16ps) and ``amx_gemm`` (tdpbf16ps), each held to SPEC 8.2's bound for every format, scale layout
(fp32, E8M0, NVFP4, 2-D blocks), the group sizes 16, 32, 48, 100, 128, 256, ragged K and N, M at and around the
crossovers and the kernels' own blocks, fp32 / bf16 / fp16 x, rows of x with bf16 subnormals (which the instructions
read as zero: those rows are recomputed exactly); and a test-only build with deliberate faults (a dropped or misplaced
group scale, a stale panel, swapped VNNI pairs) that these checks must catch.

Builds without AVX-512 BF16 + VBMI skip (the x86-64-v3 pass of .ci/run); ``DS_FPQUANT_CPU_AMX=0`` sends an AMX
machine's calls to the vdpbf16ps kernel, so both kernels run here where the CPU has AMX.
"""

import pytest
import torch
from unit.linear.test_cpu_kernels import _kernel, _weight, _x
from unit.linear_bound import assert_linear_within_bound

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.ops import backends

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _op():
    op, why = backends.load_op("cpu")
    if op is None:
        pytest.skip(f"no compiled CPU op: {why}")
    if "direct_bf16" not in op.cpu_paths():
        pytest.skip(f"the op has no AVX-512 BF16 + VBMI kernels: {op.cpu_paths()}")
    return op


@pytest.fixture(params=["amx", "avx512"])
def kernel(request, monkeypatch):
    """Which GEMM the calls take: AMX (where this machine has it) or vdpbf16ps (DS_FPQUANT_CPU_AMX=0)."""
    op = _op()
    if request.param == "amx":
        if "amx" not in op.cpu_paths():
            pytest.skip(f"no AMX here: {op.cpu_paths()}")
    else:
        monkeypatch.setenv("DS_FPQUANT_CPU_AMX", "0")
    return op, request.param


def _expected(kernel, x, qt):
    """The GEMM that takes these rows: AMX for groups of a multiple of 16 (any x), vdpbf16ps for bf16 x, else the
    AVX2 GEMM (fp32 / fp16 x without AMX)."""
    if kernel == "amx" and qt.group_size % 16 == 0:
        return "amx_gemm"
    return "avx512_gemm" if x.dtype == torch.bfloat16 else "avx2_gemm"


# (format, quantize kwargs): every format, scale layout and group size of the issue; K = 1000 and N = 137 are ragged
# against every block (chunks of 256, tiles of 64 weight rows, AMX's 32 columns)
LAYOUTS = [("e4m3", {"group_size": 128}), ("e4m3", {"group_size": 16}), ("e5m2", {"group_size": 32}),
           ("e2m1", {"group_size": 48}), ("e2m1", {"group_size": 100}), ("e2m1", {"group_size": 256}),
           ("e3m2", {"group_size": 32}), ("e2m3", {"group_size": 100}), ("e4m7", {"group_size": 128}),
           ("mxfp4", {}), ("nvfp4", {}), ("mxfp8_e4m3", {}), ("e4m3", {"block": (128, 128)}),
           ("e2m1", {"block": (5, 32), "scale_format": "e8m0"}), ("e3m2", {"group_size": 2**31 - 1})]


def _id(layout):
    return layout[0] + "".join(f"-{k}={v}" for k, v in layout[1].items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("m", [33, 47, 64, 97])
def test_every_layout_within_the_bound(kernel, layout, m):
    """M just past the small-M kernels (33), a ragged block of 16 rows (47), whole blocks (64), and more rows than one
    vdpbf16ps call (97); bf16, fp32 and fp16 x in turn."""
    op, which = kernel
    fmt, kwargs = layout
    index = LAYOUTS.index(layout) * 4 + [33, 47, 64, 97].index(m)
    qt = fpq.quantize(_weight(137, 1000, index), fmt, **kwargs)
    dtype = DTYPES[index % 3]
    x = _x(m, 1000, dtype, index)
    assert _kernel(op, x, qt) == _expected(which, x, qt)
    bias = _x(1, 137, dtype, index + 1)[0] if index % 2 else None
    assert_linear_within_bound(x, qt, bias, linear(x, qt, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt,group_size", [("e4m3", 128), ("e5m2", 16), ("e2m1", 32), ("e4m7", 64)])
def test_rows_of_x_with_subnormal_parts_are_recomputed(kernel, dtype, fmt, group_size):
    """Rows of x with a bf16 subnormal, or an element whose product with the smallest code is below 2^-126 (which
    vdpbf16ps / tdpbf16ps would flush), next to ordinary rows: every row within the bound, the tiny products kept
    (a weight of large scale makes them visible in y)."""
    op, which = kernel
    k = 320
    w = _weight(70, k, 5)
    half = dtype == torch.float16  # fp16 x has no such values (they widen to normal fp32): ordinary rows, fp16 y
    w[:, :8] = 1.0 if half else 2.0**100  # large group scales on the first group: tiny x there gives a visible y
    qt = fpq.quantize(w, fmt, group_size)
    x = _x(40, k, torch.float32, 6)
    x[3, 1] = 2.0**-130    # a bf16 subnormal
    x[17, 5] = -2.0**-118  # normal, but times a subnormal code it would underflow
    x[20, :] = 0.0
    x[20, 2] = 2.0**-126 * 1.5
    x[39, 300] = 2.0**-149 if dtype == torch.float32 else 2.0**-133  # fp32 / bf16 subnormal in a later chunk
    x = x.to(dtype)
    assert _kernel(op, x, qt) == _expected(which, x, qt)
    y = linear(x, qt)
    assert_linear_within_bound(x, qt, None, y)
    assert half or y[20].abs().max() > 0


def test_non_finite_codes_and_x(kernel):
    """e5m2 Inf / NaN and e4m3 NaN codes (their weight rows recomputed by the codec) and Inf / NaN in x."""
    for fmt in ("e5m2", "e4m3"):
        w = _weight(70, 300, 8)
        w[9, 130] = float("inf") if fmt == "e5m2" else float("nan")
        w[65, 3] = float("nan")
        qt = fpq.quantize(w, fmt, 32)
        for dtype in (torch.bfloat16, torch.float32):
            x = _x(40, 300, dtype, 9)
            x[0, 130] = 0.0
            x[5, 7] = float("inf")
            x[6, 8] = float("nan")
            assert_linear_within_bound(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("n", [1, 63, 64, 65])
def test_fewer_tiles_than_threads_and_ragged_tiles(kernel, n):
    """One weight tile (or part of one): the rows of x split between threads; a tile of 64 rows and one row more."""
    for fmt, dtype in (("e4m3", torch.bfloat16), ("e2m1", torch.float32), ("nvfp4", torch.bfloat16)):
        qt = fpq.quantize(_weight(n, 520, n), fmt, 32 if fmt != "nvfp4" else 16)
        x = _x(300, 520, dtype, n)
        assert_linear_within_bound(x, qt, None, linear(x, qt))


# -- deliberate faults ------------------------------------------------------------------------------------------
MUTANTS = {1: "group scale dropped", 2: "the next group's scale", 3: "stale panel (first chunk's codes reused)",
           4: "x's VNNI pairs swapped", 5: "rows of x with subnormal parts left to the instructions"}


@pytest.fixture(scope="module")
def mutant_op():
    """The CPU op built with -DFPQ_TEST_MUTANTS ($FPQ_GEMM_MUTANT picks the fault per call), once per session."""
    op = _op()
    from ds_fpquant.op_builder.fp_quantizer_cpu import FPQuantizerCPUBuilder

    class MutantBuilder(FPQuantizerCPUBuilder):
        NAME = "ds_fpquant_cpu_gemm_mutants"

        def cxx_args(self):
            return [*super().cxx_args(), "-DFPQ_TEST_MUTANTS=1"]

    del op
    return MutantBuilder().load()


def _battery(kernel):
    """A few calls that reach every mutated line: two chunks, several groups, ragged K, bf16 and fp32 x."""
    for fmt, g, dtype in (("e4m3", 128, torch.bfloat16), ("e2m1", 32, torch.float32), ("nvfp4", 16, torch.bfloat16),
                          ("e3m2", 100, torch.bfloat16)):
        if kernel == "avx512" and dtype != torch.bfloat16:
            continue
        qt = fpq.quantize(_weight(70, 600, g), fmt, g)
        x = _x(40, 600, dtype, g)
        assert_linear_within_bound(x, qt, None, linear(x, qt))
    # a row of x whose only nonzero element is a bf16 subnormal, against a group of large scale
    w = _weight(70, 600, 1)
    w[:, :32] *= 2.0**100
    qt = fpq.quantize(w, "e4m3", 32)
    x = _x(40, 600, torch.bfloat16, 1)
    x[3] = 0.0
    x[3, 0] = 2.0**-130
    assert_linear_within_bound(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_each_fault_is_caught(kernel, mutant_op, monkeypatch, mutant):
    monkeypatch.setitem(backends._ops, "cpu", (mutant_op, ""))
    _, which = kernel
    monkeypatch.setenv("FPQ_GEMM_MUTANT", "0")
    _battery(which)  # the test build without a fault passes
    monkeypatch.setenv("FPQ_GEMM_MUTANT", str(mutant))
    with pytest.raises(AssertionError):
        _battery(which)
