"""``ds_fpquant.matmul_fp8``: the drop-in for ``deepspeed.ops.fp_quantizer.matmul_fp8`` (issue 27).

Laid out like DeepSpeed's ``tests/unit/ops/fp_quantizer/test_fp8_gemm.py``: its test body first (its shapes, dtype,
group size and calls), then ``patch_deepspeed``, then what DeepSpeed's test does not try. Every result is checked
elementwise against the fp64 ``exact = inp @ dequantize(weight)``: each code's value from the oracle's ml_dtypes
table (not ds_fpquant's decoder) times its group's scale, in fp64 (:func:`_weight64`), with SPEC 8.2's bound
(``unit.linear_bound.assert_product_within_bound``):

    ``|y - exact| <= 2 K 2^-24 sum_k |x_k| |w_k| + eps(dtype) |exact| + tiny(dtype)``

Derivation for matmul_fp8: each of the K terms of a dot product goes through at most ``K + 1`` fp32 roundings,
``w = fl(decode(q) * s)``, ``fl(x * w)`` and at most ``K - 1`` additions in any order (torch's matmul, the panels'
``addmm_``), each of relative size at most ``u' = u / (1 + u)``, ``u = 2^-24``; so the fp32 result is within
``gamma = (1 + u')^(K+1) - 1`` times ``sum |x||w|`` of ``exact`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2.2 and 3.1). The one rounding to ``inp``'s dtype adds at most ``eps' (|exact| + gamma sum|x||w|)``
(``eps' = eps / (1 + eps)``) or, for a result that rounds to a subnormal of the dtype, ``tiny`` (half its smallest
subnormal). ``(1 + eps') gamma <= 2 K u`` for every ``K >= 2`` (``(K + 1)(1 + 2^-8)(1 + 2^-20) <= 2 K``), and
every test here has ``K >= 2`` or ``K = 0``.
"""

import inspect
import sys

import deepspeed
import pytest
import torch
from deepspeed.linear import QuantizationConfig
from deepspeed.ops.fp_quantizer import Quantizer
from deepspeed.ops.op_builder import FPQuantizerBuilder
from unit.linear_bound import assert_product_within_bound
from unit.oracle import code_values

import ds_fpquant as fpq
from ds_fpquant import FP_Quantize, matmul_fp8
from ds_fpquant.integration import fp8_gemm as fp8_gemm_module
from ds_fpquant.integration.originals import REPLACED

pytestmark = pytest.mark.usefixtures("quiet_fallback")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
E4M3 = torch.tensor(code_values("e4m3"), dtype=torch.float64)  # the value of each of the 256 codes (NaN codes NaN)


def _weight64(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``dequantize(weight)`` in fp64: ``decode(q[k, n]) * s[(k * N + n) // G]`` (exact: 4 bits times 24 bits),
    shaped like ``codes`` ``(K, N)``; the groups run along the flattened weight (SPEC 2 flat grouping)."""
    flat = codes.cpu().view(torch.uint8).reshape(-1).long()
    s = scales.cpu().reshape(-1).double()
    return (E4M3[flat] * s[torch.arange(flat.numel()) // group_size]).reshape(codes.shape)


def _assert_within_bound(x: torch.Tensor, w64: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y = matmul_fp8(x, weight, ...)`` has ``x``'s leading dims, dtype and device, and is within SPEC 8.2's
    bound of the fp64 ``exact = x @ w64`` (``w64`` = :func:`_weight64`, ``(K, N)``), NaN exactly where ``exact``
    is NaN. Returns ``exact`` ``(M, N)``."""
    k, n = w64.shape
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], n) and y.device == x.device
    # |y - exact| <= 2 K 2^-24 sum_k |x_k| |w_k| + eps(dtype) |exact| + tiny(dtype), elementwise: K + 1 fp32
    # roundings per term (fl(decode(q) * s), fl(x * w), K - 1 additions) and one rounding to x's dtype (module doc)
    return assert_product_within_bound(x, w64.T, None, y)


def _quantized(k, n, group_size, seed=0, device=DEVICE, quantizer=None):
    """(quantizer, e4m3 meta codes (K, N), fp32 scales (num_groups, 1)) of a random bf16 (K, N) weight, made as
    DeepSpeed's test makes them."""
    gen = torch.Generator().manual_seed(seed)
    weight_bf16 = torch.randn(k, n, generator=gen).to(torch.bfloat16).to(device)
    q = quantizer or FP_Quantize(group_size=group_size)
    weight, _ = q.quantize(weight_bf16.data, q_bits=8, return_meta_tensor=True)
    return q, weight, q.get_scales()


def _deepspeed_stand_in(group_size: int):
    """An instance of DeepSpeed's own ``FP_Quantize`` class without its ``__init__`` (which builds DeepSpeed's CUDA
    op: on a CPU-only DeepSpeed it raises ``ValueError: This op had not been implemented on CPU backend``)."""
    import deepspeed.ops.fp_quantizer.quantize as ds_quantize

    theirs = REPLACED.get((ds_quantize, "FP_Quantize"), ds_quantize.FP_Quantize)  # DeepSpeed's, patched or not
    assert theirs is not FP_Quantize
    stand_in = theirs.__new__(theirs)
    stand_in.group_size = group_size
    return stand_in


# ---- DeepSpeed's test_fp8_gemm.py ------------------------------------------------------------------------------

N_DS, H_DS, G_DS = 8192, 4096, 128


@pytest.fixture(scope="module")
def deepspeed_weight():
    """DeepSpeed's weight: ``randn(H, N)`` bf16 quantized by ``FP_Quantize(QuantizationConfig(group_size=128))``
    with ``return_meta_tensor=True`` (once for every M), and its exact fp64 value."""
    # DeepSpeed's test builds FP_Quantize(group_size=128); its 0.19 class takes a QuantizationConfig (q_dtype
    # FPQuantizerBuilder.get_default_quant_dtype(): torch.uint8 for its CUDA op). ds_fpquant's takes both and reads
    # only the group size.
    fpq_ = FP_Quantize(quantization_config=QuantizationConfig(q_dtype=torch.uint8, group_size=G_DS))
    fpq_, weight, scale = _quantized(H_DS, N_DS, G_DS, seed=27, quantizer=fpq_)
    return fpq_, weight, scale, _weight64(weight, scale, G_DS)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("q_bits", [8], ids=["qbits8"])
@pytest.mark.parametrize("M", [1, 2, 4, 8, 32, 64, 128, 256, 512, 1024, 2048])
def test_fp_quant(dtype, q_bits, M, deepspeed_weight):
    """DeepSpeed's test body: ``matmul_fp8(x, weight, fpq.get_scales(), 128, fpq)`` for x ``(M, 4096)`` and a
    ``(4096, 8192)`` weight, every element against the fp64 product within the bound.

    DeepSpeed's own check, a mean relative error under 0.004 against ``torch.matmul(x, fpq.dequantize(weight,
    scale=fpq.scale))``, is applied against the fp64 product instead: that reference multiplies by the weights
    rounded to bf16 in a bf16 matmul, and on this CPU it is itself 0.010 (M=1) to 0.017 (M=8, 64) from the fp64
    product by that measure, where matmul_fp8 is 0.0014 from it (measured with this test's weight and x), so the
    difference of the two is mostly the reference's error and fails DeepSpeed's threshold."""
    fpq_, weight, scale, w64 = deepspeed_weight
    assert q_bits == 8 and weight.shape == (H_DS, N_DS) and weight.dtype == torch.uint8
    x = torch.randn(M, H_DS, generator=torch.Generator().manual_seed(M), dtype=torch.float32).to(dtype).to(DEVICE)
    out = matmul_fp8(x, weight, scale, G_DS, fpq_)
    exact = _assert_within_bound(x, w64, out)
    out64 = out.cpu().double()
    error = ((out64 - exact).abs() / (out64.abs() + 1e-5)).sum() / out.numel()
    assert 0.004 > error, f"failed on batch-size {M} with error {error}"


def test_a_real_deepspeed_fp_quantize():
    """The quantizer DeepSpeed's test makes, where DeepSpeed's FP quantizer op exists (its CUDA build): its codes and
    ``get_scales()`` (a fp32 view of its scale bytes) through matmul_fp8, within the bound. A CPU-only DeepSpeed has
    no such op (its ``FP_Quantize()`` raises), so there this is skipped as DeepSpeed skips its own test; the
    stand-in of DeepSpeed's class (:func:`_deepspeed_stand_in`) runs in the other tests."""
    if not deepspeed.ops.__compatible_ops__[FPQuantizerBuilder.NAME]:
        pytest.skip("DeepSpeed's FPQuantizer op is not available on this system (a real DeepSpeed FP_Quantize cannot "
                    "be made), as DeepSpeed's own test_fp8_gemm.py skips")
    from deepspeed.ops.fp_quantizer.quantize import FP_Quantize as DeepSpeedFPQuantize

    theirs = DeepSpeedFPQuantize(QuantizationConfig(group_size=128))
    w = torch.randn(256, 384, dtype=torch.bfloat16, device=DEVICE)  # DeepSpeed's quantize takes bf16 only
    weight, _ = theirs.quantize(w, q_bits=8, return_meta_tensor=True)
    scale = theirs.get_scales()
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=DEVICE)
    _assert_within_bound(x, _weight64(weight, scale, 128), matmul_fp8(x, weight, scale, 128, theirs))


# ---- the same parameters as DeepSpeed's function ---------------------------------------------------------------


def test_the_signature_is_deepspeeds():
    """DeepSpeed's parameters, names and order (so every positional or keyword call of DeepSpeed's works); what
    ds_fpquant adds is keyword-only with a default; ``quantizer`` defaults to None (DeepSpeed's Triton path never
    reads it; older DeepSpeed called ``matmul_fp8(inp, weight, scale, quantization_group_size)``)."""
    from deepspeed.ops.fp_quantizer.fp8_gemm import matmul_fp8 as theirs

    assert theirs is not matmul_fp8
    ours, deepspeeds = inspect.signature(matmul_fp8).parameters, inspect.signature(theirs).parameters
    assert list(ours)[:len(deepspeeds)] == list(deepspeeds) == ["inp", "weight", "scale", "quantization_group_size",
                                                                  "quantizer"]
    for name, theirs_p in deepspeeds.items():
        assert ours[name].kind == theirs_p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
        assert theirs_p.default is inspect.Parameter.empty or ours[name].default == theirs_p.default
    assert ours["quantizer"].default is None
    extra = [p for name, p in ours.items() if name not in deepspeeds]
    assert extra and all(p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is not p.empty for p in extra)


def test_deepspeeds_calls_give_the_same_result():
    """Positional, keyword (DeepSpeed's names), four arguments (older DeepSpeed): the same calls on the same
    tensors, so the same bits."""
    q, weight, scale = _quantized(24, 40, 32, seed=2)
    x = torch.randn(3, 24, dtype=torch.bfloat16, device=DEVICE)
    y = matmul_fp8(x, weight, scale, 32, q)
    _assert_within_bound(x, _weight64(weight, scale, 32), y)
    assert torch.equal(matmul_fp8(inp=x, weight=weight, scale=scale, quantization_group_size=32, quantizer=q), y)
    assert torch.equal(matmul_fp8(x, weight, scale, 32), y)
    assert torch.equal(matmul_fp8(x, weight, scale, quantization_group_size=32, quantizer=None), y)


# ---- through patch_deepspeed() ---------------------------------------------------------------------------------


def test_patch_deepspeed_installs_matmul_fp8():
    """After ``patch_deepspeed()`` DeepSpeed's two names (the package's and ``fp8_gemm``'s) are ours, and DeepSpeed's
    own calls (``FP_Quantize`` from its package, then its ``matmul_fp8``) run it; an instance of DeepSpeed's own
    class is still taken for one; ``unpatch_deepspeed()`` puts DeepSpeed's function back in both."""
    import deepspeed.ops.fp_quantizer as ds_fp
    import deepspeed.ops.fp_quantizer.fp8_gemm as ds_fp8_gemm

    original = ds_fp8_gemm.matmul_fp8
    assert ds_fp.matmul_fp8 is original and original is not matmul_fp8
    fpq.patch_deepspeed()
    try:
        assert ds_fp.matmul_fp8 is matmul_fp8 and ds_fp8_gemm.matmul_fp8 is matmul_fp8
        from deepspeed.ops.fp_quantizer import FP_Quantize as DeepSpeedName
        from deepspeed.ops.fp_quantizer import matmul_fp8 as ds_matmul_fp8
        assert DeepSpeedName is FP_Quantize and ds_matmul_fp8 is matmul_fp8
        q = DeepSpeedName(quantization_config=QuantizationConfig(group_size=64))
        q, weight, scale = _quantized(96, 160, 64, seed=1, quantizer=q)
        x = torch.randn(5, 96, dtype=torch.bfloat16, device=DEVICE)
        y = ds_matmul_fp8(x, weight, scale, 64, q)
        _assert_within_bound(x, _weight64(weight, scale, 64), y)
        # DeepSpeed's class is ours while patched; its original is still a quantizer matmul_fp8 takes
        assert torch.equal(ds_fp8_gemm.matmul_fp8(x, weight, scale, 64, _deepspeed_stand_in(64)), y)
        fpq.patch_deepspeed()  # a second patch changes nothing
        assert ds_fp.matmul_fp8 is matmul_fp8 and ds_fp8_gemm.matmul_fp8 is matmul_fp8
    finally:
        fpq.unpatch_deepspeed()
    assert ds_fp.matmul_fp8 is original and ds_fp8_gemm.matmul_fp8 is original
    assert not REPLACED


def test_patch_deepspeed_without_deepspeeds_fp8_gemm(monkeypatch):
    """A DeepSpeed without the fp8 GEMM (no ``fp8_gemm`` module to import, no ``matmul_fp8`` name): the patch
    installs the rest and adds no ``matmul_fp8``; unpatching leaves none behind."""
    import deepspeed.ops.fp_quantizer as ds_fp

    monkeypatch.delattr(ds_fp, "matmul_fp8")
    monkeypatch.setitem(sys.modules, "deepspeed.ops.fp_quantizer.fp8_gemm", None)  # its import raises ImportError
    fpq.patch_deepspeed()
    try:
        assert ds_fp.FP_Quantize is FP_Quantize and "matmul_fp8" not in vars(ds_fp)
        assert all(attr != "matmul_fp8" for _, attr in REPLACED)
    finally:
        fpq.unpatch_deepspeed()
    assert "matmul_fp8" not in vars(ds_fp) and not REPLACED


# ---- the shapes and arguments DeepSpeed's test does not try ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,n,group_size", [
    (64, 256, 128),   # groups inside rows
    (37, 100, 64),    # N not a multiple of G: groups cross rows, a short last group (3700 = 57 * 64 + 52)
    (9, 130, 128),    # 1170 = 9 * 128 + 18
    (10, 5, 128),     # one short group for the whole weight
    (33, 1000, 4096),  # G > N: each group spans rows
    (7, 3, 1),        # one scale per element
])
def test_groups_along_the_flattened_weight(target, dtype, k, n, group_size, monkeypatch):
    """Groups of G along the flattened (K, N) weight, whatever N and G (FP_Quantize keeps the tail as a short last
    group; so does matmul_fp8), with panels of 3 rows, so that groups cross the panel boundaries; every backend."""
    monkeypatch.setattr(fp8_gemm_module, "PANEL_BYTES", 3 * n * 4)
    q, weight, scale = _quantized(k, n, group_size, seed=k * n, device=target.device)
    assert scale.shape == (-(-k * n // group_size), 1)
    w64 = _weight64(weight, scale, group_size)
    for m in (1, 4, 17):
        x = torch.randn(m, k, dtype=torch.float32).to(dtype).to(target.device)
        _assert_within_bound(x, w64, matmul_fp8(x, weight, scale, group_size, q, backend=target.backend))


@pytest.mark.parametrize("k,n,g", [(37, 100, 64), (9, 130, 128), (64, 80, 32)])
def test_the_bound_rejects_a_wrong_grouping(k, n, g):
    """The check can fail: the same codes and scales with the scales indexed as groups inside rows
    (``s[k * (N // G) + n // G]``, DeepSpeed's Triton kernel's indexing, right only where G divides N) give a product
    the bound rejects; matmul_fp8's groups along the flattened weight pass. (64, 80, 32): G divides K * N, so the
    scale count is right and only the grouping is wrong."""
    q, weight, scale = _quantized(k, n, g, seed=31)
    x = torch.randn(4, k, dtype=torch.bfloat16, device=DEVICE)
    rows, cols = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
    flat = scale.cpu().reshape(-1).double()
    inside_rows = (rows * (n // g) + cols // g).clamp(max=flat.numel() - 1)
    assert not torch.equal(inside_rows, (rows * n + cols) // g)
    w_wrong = E4M3[weight.cpu().long()] * flat[inside_rows]
    y_wrong = (x.cpu().double() @ w_wrong).to(x.dtype).to(DEVICE)
    w64 = _weight64(weight, scale, g)
    with pytest.raises(AssertionError, match="max error"):
        _assert_within_bound(x, w64, y_wrong)
    _assert_within_bound(x, w64, matmul_fp8(x, weight, scale, g, q))


def test_the_bound_rejects_weights_rounded_to_bf16():
    """The contract is tighter than DeepSpeed's arithmetic: DeepSpeed's kernels multiply by the weights rounded to
    bf16 (``(decode(q) * s).to(bf16)``), an error of up to ``2^-9 |w|`` per weight, which the fp32 bound does not
    allow (here: the same product summed exactly, only the weights rounded)."""
    k, n, g = 64, 96, 32
    q, weight, scale = _quantized(k, n, g, seed=37)
    x = torch.randn(8, k, dtype=torch.bfloat16, device=DEVICE)
    w64 = _weight64(weight, scale, g)
    y_bf16_weights = (x.cpu().double() @ w64.to(torch.bfloat16).double()).to(x.dtype).to(DEVICE)
    with pytest.raises(AssertionError, match="max error"):
        _assert_within_bound(x, w64, y_bf16_weights)


@pytest.mark.parametrize("rows_per_panel", [1, 7, 64, 100])
def test_ragged_k_and_each_element_decoded_once(rows_per_panel, monkeypatch):
    """K = 100 in panels of 1, 7 (the last of 2 rows), 64 (the last of 36) or 100 rows, 3-D inp: the result within
    the bound, and every weight decoded exactly once, never more than a panel of it at a time."""
    k, n, g = 100, 48, 32
    monkeypatch.setattr(fp8_gemm_module, "PANEL_BYTES", rows_per_panel * n * 4)
    decoded = []
    real = fp8_gemm_module.dequantize

    def recording(qt, dtype=None, **kwargs):
        assert dtype == torch.float32  # the panels are decoded in fp32
        y = real(qt, dtype, **kwargs)
        decoded.append(y.numel())
        return y

    monkeypatch.setattr(fp8_gemm_module, "dequantize", recording)
    q, weight, scale = _quantized(k, n, g, seed=3)
    x = torch.randn(2, 3, k, dtype=torch.bfloat16, device=DEVICE)
    _assert_within_bound(x, _weight64(weight, scale, g), matmul_fp8(x, weight, scale, g, q))
    assert sum(decoded) == k * n and max(decoded) <= rows_per_panel * n


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_form_of_the_same_weight_gives_the_same_result(dtype):
    """Scales as ``get_scales()`` (fp32 (num_groups, 1) or flattened) or as ``fpq.scale`` bytes (uint8 or int8), codes
    as uint8, int8 or float8_e4m3fn, the whole buffer with ``scale=None``, the quantizer ours, DeepSpeed's own class
    or None: the same weights, so the same calls on the same values and the same bits."""
    k, n, g = 40, 70, 64  # 2800 = 43 * 64 + 48: a short last group
    q, weight, scale = _quantized(k, n, g, seed=5)
    x = torch.randn(3, k, dtype=torch.float32).to(dtype).to(DEVICE)
    y = matmul_fp8(x, weight, scale, g, q)
    _assert_within_bound(x, _weight64(weight, scale, g), y)
    # FP_Quantize's buffer (SPEC 6.1) of the same weight: each group's codes (the last padded with zero codes),
    # then its scale's bytes
    buffer_quantizer = FP_Quantize(group_size=g)
    w_bf16 = torch.randn(k, n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    buffer = buffer_quantizer.quantize(w_bf16, q_bits=8)
    assert torch.equal(buffer[:, g:], q.scale) and torch.equal(buffer[:, :g].reshape(-1)[:k * n], weight.reshape(-1))
    calls = {
        "scales (num_groups,)": (weight, scale.reshape(-1), q),
        "scales as a strided view": (weight, torch.cat([scale, scale], 1)[:, :1], q),
        "scale bytes uint8": (weight, q.scale, q),
        "scale bytes int8": (weight, q.scale.view(torch.int8), q),
        "codes int8": (weight.view(torch.int8), scale, q),
        "codes float8_e4m3fn": (weight.view(torch.float8_e4m3fn), scale, q),
        "non-contiguous codes": (weight.t().contiguous().t(), scale, q),
        "DeepSpeed's FP_Quantize": (weight, scale, _deepspeed_stand_in(g)),
        "no quantizer": (weight, scale, None),
        "buffer, scale=None": (buffer, None, buffer_quantizer),
    }
    for name, (w, s, quantizer) in calls.items():
        assert torch.equal(matmul_fp8(x, w, s, g, quantizer), y), name


def test_leading_dims_like_torch_matmul():
    """``inp`` of any leading dims (3-D, 4-D, and 1-D as ``torch.matmul``), contiguous or not: ``(..., K) -> (..., N)``,
    each row the 2-D call's (the same calls on equal fp32 values: the same bits), all within the bound."""
    k, n, g = 48, 40, 16
    q, weight, scale = _quantized(k, n, g, seed=7)
    w64 = _weight64(weight, scale, g)
    x = torch.randn(2, 3, 5, k, dtype=torch.bfloat16, device=DEVICE)
    flat = matmul_fp8(x.reshape(-1, k), weight, scale, g, q)
    y = matmul_fp8(x, weight, scale, g, q)
    assert y.shape == (2, 3, 5, n) and torch.equal(y.reshape(-1, n), flat)
    _assert_within_bound(x, w64, y)
    y3 = matmul_fp8(x[0], weight, scale, g, q)  # 3-D (3, 5, K)
    assert y3.shape == (3, 5, n) and torch.equal(y3.reshape(-1, n), flat[:15])
    assert torch.equal(matmul_fp8(x.reshape(-1, k)[0], weight, scale, g, q), flat[0])  # (K,) -> (N,)
    strided = x.transpose(0, 2)  # (5, 3, 2, K), not contiguous
    assert torch.equal(matmul_fp8(strided, weight, scale, g, q), matmul_fp8(strided.contiguous(), weight, scale, g, q))
    _assert_within_bound(strided, w64, matmul_fp8(strided, weight, scale, g, q))


@pytest.mark.parametrize("lead,k,n", [((0,), 16, 8), ((3,), 0, 8), ((3,), 16, 0), ((0,), 0, 0), ((2, 0), 16, 8),
                                      ((2, 3), 0, 5), ((), 0, 4)])
@pytest.mark.parametrize("scale_form", ["get_scales", "bytes", "buffer"])
def test_empty(lead, k, n, scale_form):
    """Empty shapes are legal (SPEC 7): an empty result for M = 0 or N = 0, zeros of (..., N) where K = 0 (as
    ``torch.matmul``), differentiable in ``inp``; the arguments are still checked."""
    q = FP_Quantize(group_size=8)
    weight, _ = q.quantize(torch.randn(k, n, dtype=torch.bfloat16), q_bits=8, return_meta_tensor=True)
    assert q.scale.shape == (-(-k * n // 8), 4)
    w, s = {"get_scales": (weight, q.get_scales()), "bytes": (weight, q.scale),
            "buffer": (q.quantize(torch.randn(k, n, dtype=torch.bfloat16), q_bits=8), None)}[scale_form]
    x = torch.randn(*lead, k, dtype=torch.bfloat16, requires_grad=True)
    y = matmul_fp8(x, w, s, 8, q)
    assert y.shape == (*lead, n) and y.dtype == torch.bfloat16 and not y.any()
    assert torch.equal(y, torch.matmul(x.detach(), torch.zeros(k, n, dtype=torch.bfloat16)))
    y.sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()
    with pytest.raises(ValueError, match="inp has 1 features"):
        matmul_fp8(torch.randn(*lead, 1) if k != 1 else torch.randn(*lead, 2), weight, q.get_scales(), 8, q)
    with pytest.raises(ValueError, match="scale has 1 fp32 values"):
        matmul_fp8(x, weight, torch.ones(1), 8, q)


def test_nan_codes_and_scales_reach_their_columns_only():
    """A NaN code (0x7F) makes its column NaN (as ``inp @ dequantize(weight)`` does: 0 * NaN is NaN); a NaN scale
    its group's columns; every other output within the bound."""
    k, n, g = 20, 64, 16
    q, weight, scale = _quantized(k, n, g, seed=9)
    weight, scale = weight.clone(), scale.clone()
    weight[4, 10] = 0x7F
    scale[k * n // g - 1] = float("nan")  # the last group: columns 48 .. 63 of the last row
    x = torch.randn(6, k, dtype=torch.bfloat16, device=DEVICE)
    y = matmul_fp8(x, weight, scale, g, q)
    nan_columns = torch.isnan(y).all(0).nonzero().flatten().tolist()
    others = [c for c in range(n) if c not in nan_columns]
    assert nan_columns == [10, *range(48, 64)] and not torch.isnan(y[:, others]).any()
    _assert_within_bound(x, _weight64(weight, scale, g), y)


def test_gradient_flows_to_inp(monkeypatch):
    """As DeepSpeed's fallback (``torch.matmul``), the result is differentiable in ``inp`` (here through 5 panels):
    ``d sum(y) / d inp[m, k] = sum_n w[k, n]``, the weights' fp32 values summed in fp32 (N - 1 additions of fp32
    weights ``fl(decode(q) * s)``: within ``2 N 2^-24 sum_n |w[k, n]|``, the bound's first term with N terms)."""
    k, n, g = 24, 40, 8
    monkeypatch.setattr(fp8_gemm_module, "PANEL_BYTES", 5 * n * 4)
    q, weight, scale = _quantized(k, n, g, seed=11)
    x = torch.randn(3, k, device=DEVICE, requires_grad=True)
    matmul_fp8(x, weight, scale, g, q).sum().backward()
    w64 = _weight64(weight, scale, g)
    exact = w64.sum(1).expand(3, k)
    # |grad - exact| <= 2 N 2^-24 sum_n |w[k, n]|: one rounding of each weight to fp32 and N - 1 fp32 additions
    assert bool(((x.grad.cpu().double() - exact).abs() <= 2 * n * 2.0**-24 * w64.abs().sum(1)).all())


# ---- bad inputs: ValueError / TypeError naming the parameter, before any kernel ---------------------------------


class _NotFPQuantize(Quantizer):
    """A DeepSpeed ``Quantizer`` that is no ``FP_Quantize``: its layout is not FP_Quantize's."""

    def quantize(self, input, q_bits=8, q_mantisa_bits=3, stochastic_mode=False, return_meta_tensor=False):
        raise NotImplementedError

    def dequantize(self, input_q, fp_out=None, q_bits=8, q_mantisa_bits=3, scale=None):
        raise NotImplementedError


def _bad_calls():
    """(id, arguments given -> (inp, weight, scale, group_size, quantizer, kwargs), exception, message pattern)."""
    def base(**change):
        def make(x, w, s, q):
            args = dict(inp=x, weight=w, scale=s, quantization_group_size=16, quantizer=q)
            args.update({key: value(x, w, s, q) if callable(value) else value for key, value in change.items()})
            return args
        return make

    class Duck:
        group_size = 16

    return [
        ("inp list", base(inp=lambda x, w, s, q: x.tolist()), TypeError, r"inp must be a torch.Tensor"),
        ("inp int", base(inp=lambda x, w, s, q: x.to(torch.int32)), TypeError, r"inp.dtype=torch.int32"),
        ("inp fp64", base(inp=lambda x, w, s, q: x.double()), TypeError, r"inp.dtype=torch.float64"),
        ("inp 0-dim", base(inp=lambda x, w, s, q: x[0, 0]), ValueError, r"inp must have at least 1 dim"),
        ("inp K", base(inp=lambda x, w, s, q: x[:, :31]), ValueError, r"inp has 31 features .* K=32"),
        ("inp transposed", base(inp=lambda x, w, s, q: torch.randn(32, 24, dtype=torch.bfloat16)), ValueError,
         r"inp has 24 features"),
        ("inp device", base(inp=lambda x, w, s, q: x.to("meta")), ValueError, r"inp is on meta"),
        ("weight bf16", base(weight=lambda x, w, s, q: w.to(torch.bfloat16)), TypeError, r"weight.dtype=torch.bfloat16"),
        ("weight e5m2", base(weight=lambda x, w, s, q: w.view(torch.float8_e5m2)), TypeError, r"weight.dtype"),
        ("weight array", base(weight=lambda x, w, s, q: w.numpy()), TypeError, r"weight must be a torch.Tensor"),
        ("weight 3-D", base(weight=lambda x, w, s, q: w.reshape(2, 16, 24)), ValueError, r"weight must be the 2-D"),
        ("weight 1-D", base(weight=lambda x, w, s, q: w.reshape(-1)), ValueError, r"weight must be the 2-D"),
        ("weight transposed", base(weight=lambda x, w, s, q: w.t()), ValueError, r"inp has 32 features .* K=24"),
        ("scale count", base(scale=lambda x, w, s, q: s[:-1]), ValueError, r"scale has 47 fp32 values .* expected 48"),
        ("scale bytes", base(scale=lambda x, w, s, q: q.scale[:, :3]), ValueError, r"scale has shape \(48, 3\)"),
        ("scale bytes rows", base(scale=lambda x, w, s, q: q.scale[:-1]), ValueError,
         r"scale has shape \(47, 4\); expected \(48, 4\)"),
        ("scale bf16", base(scale=lambda x, w, s, q: s.to(torch.bfloat16)), TypeError, r"scale.dtype=torch.bfloat16"),
        ("scale list", base(scale=lambda x, w, s, q: s.tolist()), TypeError, r"scale must be a torch.Tensor"),
        ("scale device", base(scale=lambda x, w, s, q: s.to("meta")), ValueError, r"scale is on meta"),
        ("G 0", base(quantization_group_size=0), ValueError, r"quantization_group_size=0"),
        ("G float", base(quantization_group_size=16.0), TypeError, r"quantization_group_size must be an int"),
        ("G bool", base(quantization_group_size=True), TypeError, r"quantization_group_size must be an int"),
        ("G mismatch", base(quantization_group_size=8), ValueError,
         r"quantization_group_size=8 but quantizer.group_size=16"),
        ("G wrong without quantizer", base(quantization_group_size=32, quantizer=None), ValueError,
         r"scale has 48 fp32 values .* expected 24, one per group of quantization_group_size=32"),
        ("quantizer str", base(quantizer="fp8"), TypeError, r"quantizer must be an FP_Quantize"),
        ("quantizer duck", base(quantizer=Duck()), TypeError, r"quantizer must be an FP_Quantize"),
        ("quantizer other", base(quantizer=_NotFPQuantize(group_size=16)), TypeError,
         r"quantizer must be an FP_Quantize .* got _NotFPQuantize"),
        ("buffer without quantizer", base(scale=None, quantizer=None), ValueError, r"scale=None .* quantizer.orig_shape"),
        ("codes as buffer", base(scale=None), ValueError, r"weight has shape \(32, 24\); expected \(48, 20\)"),
        ("backend", base(backend="gpu"), ValueError, r"backend='gpu' is not supported"),
        ("backend int", base(backend=1), TypeError, r"backend must be a str"),
        ("backend device", base(backend="cuda"), ValueError, r"backend='cuda' needs a cuda tensor"),
    ]


@pytest.mark.parametrize("name,make,error,pattern", _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_bad_inputs_raise_before_any_kernel(name, make, error, pattern, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a panel was decoded before the arguments were checked")

    monkeypatch.setattr(fp8_gemm_module, "dequantize", no_kernel)
    q, weight, scale = _quantized(32, 24, 16, seed=13, device="cpu")  # 768 = 48 groups of 16
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    args = make(x, weight, scale, q)
    backend = args.pop("backend", "auto")
    with pytest.raises(error, match=pattern):
        matmul_fp8(**args, backend=backend)


@pytest.mark.parametrize("scale_form", ["fp32", "bytes"])
def test_a_group_size_that_does_not_divide_k_times_n(scale_form):
    """G = 16 and a (10, 10) weight: 100 = 6 * 16 + 4, so FP_Quantize keeps 7 scales, the last for a short group of 4
    (SPEC 2; DeepSpeed's own FP_Quantize counts ``numel // G``). Its 7 scales are right; 6 (the tail's scale left
    out) is a ValueError that says G does not divide K * N."""
    q, weight, scale = _quantized(10, 10, 16, seed=17, device="cpu")
    given = scale if scale_form == "fp32" else q.scale
    assert given.shape[0] == 7
    x = torch.randn(3, 10, dtype=torch.bfloat16)
    _assert_within_bound(x, _weight64(weight, scale, 16), matmul_fp8(x, weight, given, 16, q))
    with pytest.raises(ValueError, match=r"expected \(?7\b.* quantization_group_size=16 does not divide K\*N=100.* "
                                         r"last 4 elements as a short group"):
        matmul_fp8(x, weight, given[:6], 16, q)
