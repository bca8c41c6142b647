"""The compiled CPU op's linear kernels (issue 36, ``csrc/fp_quantizer``): which kernel runs for which build and M
(``linear_kernel``, the dispatch of ``fp_linear_cpu.cpp``), each within SPEC 8.2's bound at the edges of its own
structure, and every way a model reaches the quantized linear ending in them.

On an AVX2 build (x86-64-v3, this session's Zen CPU) M <= 4 rows of x take the AVX2 GEMV where its layout applies
(e4m3 / e5m2 with groups of a multiple of 16, e2m1 with groups of 16 or a multiple of 32), everything else the AVX2
GEMM (16 weight rows per tile, 256 columns per panel, 6 rows of x per micro-kernel call); an AVX-512 BF16 + VBMI build
runs its register kernel up to 32 rows first, and past it the AVX-512 BF16 / AMX GEMM (issue 44,
test_cpu_gemm_avx512.py) where the groups are even. The bound (``unit.linear_bound``) holds whichever ran; the cases
below sit at and around each of those edges, so that each kernel's own boundaries are crossed on any CPU.
"""

import dataclasses

import pytest
import torch
from unit.linear_bound import assert_linear_within_bound, exact_weight

import ds_fpquant as fpq
from ds_fpquant.linear import linear, weight_only
from ds_fpquant.numerics.packing import pack_rows, row_bytes
from ds_fpquant.ops import backends

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: every compiled kernel of the CPU linear (fp_linear_cpu.cpp)
KERNELS = ("avx2_gemv", "avx2_gemm", "avx512_register", "avx512_gemm", "amx_gemm")


def _op():
    op, why = backends.load_op("cpu")
    if op is None:
        pytest.skip(f"no compiled CPU op: {why}")
    return op


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k).clamp(max=4)


def _x(m, k, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(dtype)


def _kernel(op, x, qt):
    scales, kind, block_rows, tensor_scale = weight_only.scale_layout(qt)
    n, k = qt.shape
    codes = qt.codes.view(torch.uint8).reshape(n, row_bytes(k, qt.group_size, qt.format.bits)).contiguous()
    return op.linear_kernel(x.reshape(-1, qt.shape[1]).contiguous(), codes, scales, kind, block_rows, tensor_scale,
                            qt.format.name, min(qt.group_size, max(qt.shape[1], 1)))


def _expected_kernel(paths, fmt, group_size, m, x_dtype=torch.float32):
    """The dispatch of fp_linear_cpu.cpp, written out: by the build's paths, M, the format's bits, the group and x's
    dtype (every format's codes are bf16 values, e4m7's 7 mantissa bits included)."""
    bits = fpq.get_format(fmt).bits
    amx = "direct_bf16" in paths and "amx" in paths and group_size % 16 == 0
    small_m = (7 if group_size % 32 == 0 else 12) if amx else 32  # the crossovers of fp_kernels_cpu.h
    if "direct_bf16" in paths and m <= small_m and bits in (4, 6, 8) and group_size % 16 == 0:
        return "avx512_register"
    if "avx2_fma" in paths:
        gemv = (bits == 8 and group_size % 16 == 0) or (fmt == "e2m1" and (group_size == 16 or group_size % 32 == 0))
        if m <= 4 and gemv:
            return "avx2_gemv"
        if "direct_bf16" in paths and group_size % 2 == 0:
            if "amx" in paths and group_size % 16 == 0:
                return "amx_gemm"
            if x_dtype == torch.bfloat16:
                return "avx512_gemm"
        return "avx2_gemm"
    return "portable"


@pytest.mark.parametrize("fmt,group_size", [("e4m3", 128), ("e4m3", 100), ("e5m2", 16), ("e2m1", 16), ("e2m1", 32),
                                            ("e2m1", 48), ("e3m2", 32), ("e4m7", 64)])
def test_the_dispatch_names_the_kernel_for_each_build_and_m(fmt, group_size):
    op = _op()
    paths = op.cpu_paths()
    qt = fpq.quantize(_weight(20, 256, 1), fmt, group_size)
    for m in (1, 4, 5, 7, 8, 12, 13, 32, 33, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 256).to(dtype)
            assert _kernel(op, x, qt) == _expected_kernel(paths, fmt, group_size, m, dtype), (paths, m, dtype)
    assert _kernel(op, torch.randn(0, 256), qt) == "none"


def test_an_avx2_build_never_takes_the_fp32_panels():
    """Where the op has the AVX2 kernels, every M runs in the op (no fp32 panels through torch's matmul)."""
    op = _op()
    assert weight_only.cpu_gemm(op) == ("avx2_fma" in op.cpu_paths())


# (format, quantize kwargs): both GEMV layouts, the GEMM's byte, nibble and generic panels, every scale layout
LAYOUTS = [("e4m3", {"group_size": 128}), ("e4m3", {"group_size": 16}), ("e5m2", {"group_size": 32}),
           ("e2m1", {"group_size": 16}), ("e2m1", {"group_size": 64}), ("e2m1", {"group_size": 100}),
           ("e2m1", {"group_size": 7}), ("e3m2", {"group_size": 32}), ("e2m3", {"group_size": 100}),
           ("e4m7", {"group_size": 256}), ("mxfp4", {}), ("nvfp4", {}), ("mxfp8_e5m2", {"scale_rounding": "floor"}),
           ("e4m3", {"block": (128, 128)}), ("e2m1", {"block": (5, 32), "scale_format": "e8m0"}),
           ("e4m3", {"group_size": 2**31 - 1})]


def _id(layout):
    return layout[0] + "".join(f"-{k}={v}" for k, v in layout[1].items())


@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 7, 8, 12, 13, 31, 32, 33])
def test_each_kernel_edge_within_the_bound(layout, m):
    """M at the GEMV limit (4 / 5), the micro-kernel's blocks of 6 rows (6, 7, 12, 13), the AMX crossovers (7 / 8,
    12 / 13) and the AVX-512 limit
    (32 / 33); N = 37 (two full tiles of 16 and a ragged one), K = 1000 (three full panels of 256 and a ragged
    one, groups of 100 / 128 / 1000 cut by panels, a row that ends inside a decode unit)."""
    fmt, kwargs = layout
    index = LAYOUTS.index(layout) * 11 + m
    dtype = DTYPES[index % 3]
    qt = fpq.quantize(_weight(37, 1000, index), fmt, **kwargs)
    x = _x(m, 1000, dtype, index)
    bias = _x(1, 37, dtype, index + 1)[0] if index % 2 else None
    assert_linear_within_bound(x, qt, bias, linear(x, qt, bias))


@pytest.mark.parametrize("fmt,group_size", [("e4m3", 64), ("e5m2", 16), ("e4m3", 100), ("e4m7", 32)])
@pytest.mark.parametrize("m", [1, 4, 9])
@pytest.mark.parametrize("scale", [255.0, 300.0, 7e4, 1e30])
def test_activations_too_large_to_scale_take_the_exact_weights(fmt, group_size, m, scale):
    """The 8-bit kernels multiply x by 2^(127 - bias) instead of each placed code where that is exact (|x| below
    2^(128 - 120) = 256 for e4m3, 2^16 for e5m2); larger x takes the codes times 2^(127 - bias). Both sides of each
    limit, fp32 and bf16 x."""
    qt = fpq.quantize(_weight(21, 192, m), fmt, group_size)
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(m, 192, dtype, m)
        x[0, 5] = scale
        assert_linear_within_bound(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("layout", [("e4m3", {"group_size": 128}), ("e5m2", {"group_size": 16}),
                                    ("e3m2", {"group_size": 48}), ("e2m1", {"group_size": 16}), ("mxfp4", {}),
                                    ("nvfp4", {})], ids=_id)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 33])
def test_bf16_subnormal_and_tiny_x_within_the_bound(layout, m):
    """bf16 x with subnormals (below 2^-126) and with normals so small that their products with the smallest codes
    are fp32 subnormals, in one row of several: the AVX-512 kernel's vdpbf16ps reads such inputs as zero and flushes
    such sums, so these calls must take a path that keeps them (SPEC 8.2 has no exception for them). Weights of
    scale ~1, so a flushed row would come out 0 instead of about 2^-120."""
    fmt, kwargs = layout
    qt = fpq.quantize(_weight(37, 1000, m), fmt, **kwargs)
    x = _x(m, 1000, torch.bfloat16, m)
    tiny = (_x(1, 1000, torch.float32, m + 1)[0] * 2.0**-131).to(torch.bfloat16)  # subnormal bf16, some zero
    x[m // 2] = tiny
    assert (x[m // 2].float().abs() < 2.0**-126).all() and (x[m // 2] != 0).sum() > 500
    assert_linear_within_bound(x, qt, None, linear(x, qt))
    x[m // 2] = (tiny.float() * 2.0**12).to(torch.bfloat16)  # normals near 2^-119: products below 2^-126
    assert_linear_within_bound(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("n", [1, 15, 16, 17])
@pytest.mark.parametrize("m", [2, 40])
def test_fewer_weight_rows_than_threads_split_the_rows_of_x(n, m):
    """One tile for both threads: the GEMM splits the rows of x instead (and a single weight row)."""
    for fmt in ("e4m3", "e2m1", "e3m2"):
        qt = fpq.quantize(_weight(n, 200, n), fmt, 32)
        x = _x(m, 200, torch.bfloat16, m)
        assert_linear_within_bound(x, qt, None, linear(x, qt))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e4m7"])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_every_code_through_the_gemv_and_the_gemm_panels(fmt, m):
    """Every code of the format (subnormals, the largest codes, signed zeros, e4m3 NaN, e5m2 Inf / NaN), laid out
    so that each weight row holds each code at a different column: 16 weight rows (one GEMM tile) of 4096 / 2^bits
    repeats, x a power of two per column. Rows with a NaN / Inf code come out as the codec's formula gives them."""
    bits = fpq.get_format(fmt).bits
    count = 1 << bits
    k = max(count, 64)
    codes = (torch.arange(16)[:, None] * 7 + torch.arange(k)[None, :]).remainder(count).to(torch.int32)
    template = fpq.quantize(torch.zeros(16, k), fmt, 64, scales=torch.full((16, k // 64), 0.375))
    qt = dataclasses.replace(template, codes=pack_rows(codes, 64, bits).view(template.codes.dtype)
                             .reshape(template.codes.shape))
    x = torch.zeros(m, k)
    x[:, :] = 2.0 ** -(torch.arange(k) % 7).float()
    x[-1, 3] = -1.5
    for dtype in DTYPES:
        y = linear(x.to(dtype), qt)
        assert_linear_within_bound(x.to(dtype), qt, None, y)
    assert torch.isnan(exact_weight(qt)).any() == fpq.get_format(fmt).has_nan


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("m", [1, 3, 5, 40])
@pytest.mark.parametrize("column", [0, 130, 299])
def test_a_row_with_a_non_finite_code_is_recomputed_exactly(value, m, column):
    """e5m2 keeps Inf codes and NaN, e4m3 NaN: the row's outputs are what the fp64 formula gives (Inf, or NaN where
    Inf meets a zero x or an opposite Inf), wherever the code sits (first unit, inside, in the row's tail), and no
    other row changes."""
    for fmt in ("e5m2", "e4m3"):
        w = _weight(33, 300, m)
        w[9, column] = value
        w[20, column] = -value if fmt == "e5m2" else value
        qt = fpq.quantize(w, fmt, 32)
        x = _x(m, 300, torch.bfloat16, m)
        x[0, column] = 0.0  # Inf x 0: NaN in row 0 of x only
        y = linear(x, qt)
        assert_linear_within_bound(x, qt, None, y)


def test_a_group_scale_of_each_weight_row_and_group_enters_once():
    """One group scale of one weight row set apart (x 3) moves only that row's outputs, by the group's share: a
    mislaid scale (another row's lane, another group) or a scale applied per weight would move others."""
    for fmt, g, m in (("e4m3", 32, 1), ("e4m3", 32, 9), ("e2m1", 16, 2), ("e2m1", 16, 40), ("e3m2", 64, 7)):
        qt = fpq.quantize(_weight(40, 256, 3), fmt, g)
        x = _x(m, 256, torch.float32, 4)
        y = linear(x, qt)
        scales = qt.scales.clone()
        row, group = 21, 2
        if scales.dtype == torch.uint8:  # E8M0 exponent + 1: twice the scale
            scales[row, group] += 1
        else:
            scales[row, group] *= 3
        moved = dataclasses.replace(qt, scales=scales)
        y2 = linear(x, moved)
        assert_linear_within_bound(x, moved, None, y2)
        others = torch.ones(40, dtype=torch.bool)
        others[row] = False
        assert torch.equal(y2[:, others], y[:, others]), f"{fmt} m={m}: other rows changed"


class _SpyOp:
    """The compiled CPU op, recording which kernel each linear call runs; its fp32 panels are refused."""

    def __init__(self, op):
        self._op = op
        self.kernels = []

    def __getattr__(self, name):
        return getattr(self._op, name)

    def linear(self, x, codes, scales, kind, block_rows, tensor_scale, bias, fmt, group_size):
        self.kernels.append((x.shape[0], self._op.linear_kernel(x, codes, scales, kind, block_rows, tensor_scale, fmt,
                                                                 group_size)))
        return self._op.linear(x, codes, scales, kind, block_rows, tensor_scale, bias, fmt, group_size)

    def decode_rows(self, *args, **kwargs):
        raise AssertionError("the fp32 panels ran")


@pytest.fixture
def spy(monkeypatch):
    op = _op()
    if "avx2_fma" not in op.cpu_paths():
        pytest.skip(f"the op has no AVX2 kernels: {op.cpu_paths()}")
    recorder = _SpyOp(op)
    monkeypatch.setitem(backends._ops, "cpu", (recorder, ""))  # the op every CPU call resolves to
    return recorder


def _ran_the_kernels(spy, rows):
    """Every recorded call ran a compiled kernel: the GEMM for more rows than the GEMV and the AVX-512 kernel
    take, the GEMV / AVX-512 kernel for few; and some call had ``rows`` rows of x."""
    assert spy.kernels, "no quantized linear reached the compiled op"
    for m, kernel in spy.kernels:
        assert kernel in KERNELS, (m, kernel)
        if m > 32:
            assert kernel in ("avx2_gemm", "avx512_gemm", "amx_gemm"), (m, kernel)
    assert any(m == rows for m, _ in spy.kernels), (rows, spy.kernels)
    spy.kernels.clear()


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64)).eval()


def test_layers_apply_and_load_quantized_reach_the_kernels(spy, tmp_path):
    layer = fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(64, 48), "e4m3", 32)
    with torch.no_grad():
        for m in (1, 40):
            layer(torch.randn(m, 64))
            _ran_the_kernels(spy, m)
    model = _llama()
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    quantized = fpq.apply(model, {"fp_quantization": {"fmt": "e2m1", "group_size": 16}})
    with torch.no_grad():
        quantized(ids)
    _ran_the_kernels(spy, 40)
    _llama().save_pretrained(tmp_path / "src")
    fpq.quantize_checkpoint(tmp_path / "src", tmp_path / "q", "e4m3", progress=False)
    with torch.no_grad():
        fpq.load_quantized(tmp_path / "q")(ids)
    _ran_the_kernels(spy, 40)


def test_experts_in_place_static_w8a8_and_compiled_reach_the_kernels(spy):
    from unit.moe_models import tiny_moe

    from ds_fpquant.integration import inference as integration
    from ds_fpquant.nn.in_place import quantize_weight_in_place

    moe = integration.apply(tiny_moe("mixtral"), {"fp_quantization": {"fmt": "mxfp4", "exclude": ["self_attn"]}})
    with torch.no_grad():
        moe(torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(2)))
    assert spy.kernels and all(k in KERNELS for _, k in spy.kernels)
    spy.kernels.clear()
    in_place = torch.nn.Linear(64, 24)  # an AutoTP layer's weight quantized in place: DeepSpeed's F.linear runs it
    quantize_weight_in_place(in_place, "nvfp4")
    with torch.no_grad():
        in_place(torch.randn(50, 64))
    _ran_the_kernels(spy, 50)
    static = fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(64, 32), "e4m3", 64, activation="e4m3",
                                               input_scale=torch.tensor(0.05))
    with torch.no_grad():
        static(torch.randn(36, 64).bfloat16())
    _ran_the_kernels(spy, 36)
    compiled = torch.compile(fpq.FPQuantizedLinear.from_linear(torch.nn.Linear(64, 32), "e2m1", 32), fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled(torch.randn(48, 64))
    _ran_the_kernels(spy, 48)
