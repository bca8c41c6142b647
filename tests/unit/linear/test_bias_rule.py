"""Issue 43 (2): one rule for the bias on every path and build (SPEC 8.1): the bias rounded to ``x``'s dtype, added
in fp32, one rounding at the end. The probe's bias is not a bf16 / fp16 value: ``x = 1 - 2^-8``, ``w = -1``, ``b = 1
+ 2^-12`` gives exactly ``2^-8`` (``b`` rounds to 1); a path that adds the unrounded bias gives ``2^-8 + 2^-12``.
M runs across every crossover of the CPU dispatch (the AVX2 GEMV's 4 rows, the micro-kernel's blocks of 6, the
AVX-512 register kernel's and ``SMALL_M``'s 32, the portable build's fp32 panels beyond) on whichever build runs the
suite (``.ci/run`` runs this file on the native build, on x86-64-v3 and on the portable x86-64-v2 build)."""

import pytest
import torch

import ds_fpquant as fpq
from ds_fpquant.linear import linear
from ds_fpquant.linear.weight_only import SMALL_M

#: both sides of each crossover: GEMV (4 / 5), micro-kernel blocks (6, 7, 12, 13), 32 / 33, the issue's 48, 64, 65
M_EDGES = (1, 4, 5, 6, 7, 12, 13, 32, 33, 48, 64, 65)
X, BIAS, EXPECTED = 1 - 2.0**-8, 1 + 2.0**-12, 2.0**-8
#: weights whose exact value is -1 (E8M0 scales: decode(q) * 2^e exactly): the GEMV layout, nibbles, six bits
LAYOUTS = [("e4m3", 128), ("e2m1", 32), ("e3m2", 32)]


def _probe(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.zeros(m, k, dtype=dtype)
    x[:, 0] = X
    x[m // 2, 1] = 0.5  # one row that differs, so that rows are not all one value
    return x


def _weight(n: int, k: int) -> torch.Tensor:
    w = torch.zeros(n, k)
    w[:, 0] = -1.0
    w[:, 1:] = torch.linspace(-0.5, 0.5, k - 1)  # other columns: x is zero there except in one row
    return w


def test_the_crossovers_lie_inside_the_probed_m():
    assert max(SMALL_M.values()) in M_EDGES and max(SMALL_M.values()) + 1 in M_EDGES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("fmt,group_size", LAYOUTS)
def test_weight_only_bias_is_rounded_to_x_dtype_at_every_m(fmt, group_size, backend, dtype):
    n, k = 24, 256
    qt = fpq.quantize(_weight(n, k), fmt, group_size, scale_format="e8m0")
    assert float(fpq.dequantize(qt, torch.float32)[0, 0]) == -1.0
    bias = torch.full((n,), BIAS)
    assert float(bias.to(dtype)[0]) == 1.0  # the probe's bias is not a value of x's dtype
    for m in M_EDGES:
        x = _probe(m, k, dtype)
        y = linear(x, qt, bias, backend=backend)
        rows = [r for r in range(m) if r != m // 2]
        assert y[rows].eq(EXPECTED).all(), f"m={m}: {y[rows].unique().tolist()} (the unrounded bias gives " \
                                           f"{EXPECTED + 2.0**-12})"
        # the rule, on every row and output: the bias as x's dtype gives the same bits
        assert torch.equal(y, linear(x, qt, bias.to(dtype), backend=backend)), f"m={m}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_bias_is_rounded_to_x_dtype_at_every_m(dtype):
    """Dynamic and static W8A8 add the bias by the same rule (they used to add it unrounded)."""
    n, k = 16, 256
    qt = fpq.quantize(_weight(n, k), "e4m3", 128)
    bias = torch.full((n,), BIAS)
    input_scale = torch.tensor(2.0**-6)
    for m in M_EDGES:
        x = _probe(m, k, dtype)
        dynamic = linear(x, qt, bias, activation="e4m3")
        rows = [r for r in range(m) if r != m // 2]
        # x_hat = 448 * fl(amax / 448) and w = -448 * fl(1 / 448): within 2^-22 of the probe, 2^-8 after rounding
        assert dynamic[rows].eq(EXPECTED).all(), f"m={m}: {dynamic[rows].unique().tolist()}"
        assert torch.equal(dynamic, linear(x, qt, bias.to(dtype), activation="e4m3")), f"m={m}"
        static = linear(x, qt, bias, activation="e4m3", input_scale=input_scale)
        assert torch.equal(static, linear(x, qt, bias.to(dtype), activation="e4m3", input_scale=input_scale)), m
