"""The error bound of a quantized linear (every backend, every path) against an fp64 reference built from
the torch backend's dequantized weight (itself checked bit for bit against the oracle elsewhere)."""

import torch

import ds_fpquant as fpq

EPS_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: Half the output dtype's smallest subnormal: the absolute rounding error of a tiny result.
TINY_OUT = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def assert_linear_within_bound(x, qt, bias, y):
    """``y`` of a quantized linear against fp64 ``x @ dequantize(qt, x.dtype)^T + bias``: every path multiplies
    by the SPEC 5 weights in x's dtype and differs only in the order of its fp32 sums (and one rounding to
    x's dtype), so ``|y - ref| <= 2 K eps32 sum|x||w| + eps(out) |ref|`` elementwise (plus half the output
    dtype's smallest subnormal), NaN exactly where the reference is NaN, the same Inf where it is Inf."""
    w = fpq.dequantize(qt, x.dtype, backend="torch").double()
    x64 = x.double().reshape(-1, w.shape[1])
    ref = x64 @ w.T
    size = x64.abs() @ w.abs().T
    if bias is not None:
        ref, size = ref + bias.double(), size + bias.double().abs()
    y64 = y.double().reshape(ref.shape)
    k = w.shape[1]
    tol = 2 * k * 2.0**-24 * size + EPS_OUT[x.dtype] * ref.abs() + TINY_OUT[x.dtype]
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y64), nan), "NaN positions differ from the reference"
    inf = torch.isinf(ref)  # an Inf input with finite weights: the same signed Inf
    assert torch.equal(y64[inf], ref[inf]), "Inf results differ from the reference"
    finite = ~nan & ~inf
    err = (y64 - ref).abs()[finite]
    assert bool((err <= tol[finite]).all()), f"max error {err.max().item():.3e} over bound {tol[finite].max().item():.3e}"
    assert y.dtype == x.dtype
