"""Bounds for results the contract does not fix bit for bit (SPEC 8, issue 24): anything summed in fp32 by a matmul
whose kernel, and so the order of its sums, the machine chooses (BLAS, oneDNN, inductor, autograd).

- one quantized linear (every backend, every path) against an fp64 reference built from the exact weights
  (codes times scales, :func:`exact_weight`; the CUDA paths: the torch backend's dequantized weight, itself
  checked bit for bit against the oracle elsewhere): the fp32 summation bound;
  :class:`LinearCalls` applies it to every quantized linear of a model's forward; a product with any other fp64
  weight (DeepSpeed's ``matmul_fp8`` layout): :func:`assert_product_within_bound`;
- any other fp32 matmul (gradients): :func:`matmul_within_bound`;
- a whole model evaluated two ways: :func:`assert_as_accurate_as`, against the fp64 evaluation of the model
  holding the dequantized weights (:func:`dequantized_model`).

Where both sides run the same calls on the same tensors in the same order, tests compare bits and say so.
"""

import torch

import ds_fpquant as fpq
from ds_fpquant.nn.quantized_params import quantized_experts

EPS_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: Half the output dtype's smallest subnormal: the absolute rounding error of a tiny result.
TINY_OUT = {torch.float32: 2.0**-150, torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
#: Half fp32's smallest subnormal (2^-149): the most an fp32 product, FMA or scale multiply whose result is
#: subnormal errs by, absolutely (SPEC 8.2's underflow term); fp32's smallest normal.
ETA32, NORMAL32 = 2.0**-150, 2.0**-126


def exact_weight(qt):
    """The weight SPEC 8's linear multiplies by, in fp64: ``decode(q) * s`` exactly (the codes decoded by the codec,
    the group scales as SPEC 3 defines them: fp32 as stored, E8M0 ``2^(b-127)``, NVFP4 ``decode_e4m3(c) * t``)."""
    codes, scales = exact_parts(qt)
    return codes * scales


def exact_parts(qt):
    """``(decode(q), s)``: the decoded codes and each weight's group scale, ``(N, K)`` fp64 each (their product is
    :func:`exact_weight`)."""
    from ds_fpquant.linear.weight_only import scale_layout
    from ds_fpquant.numerics.codec import decode
    from ds_fpquant.numerics.formats import NVFP4_SCALE_FORMAT, get_format
    from ds_fpquant.numerics.packing import row_bytes, unpack_rows
    from ds_fpquant.numerics.scales import e8m0_decode

    n, k = qt.shape
    g = min(qt.group_size, max(k, 1))
    f = qt.format
    codes = qt.codes.view(torch.uint8).reshape(n, row_bytes(k, g, f.bits)).cpu()
    d = decode(unpack_rows(codes, k, g, f.bits), f).double()
    scales, kind, block_rows, t = scale_layout(qt)
    scales = scales.cpu()
    if kind == "e8m0":
        s = e8m0_decode(scales).double()
    elif kind == NVFP4_SCALE_FORMAT:
        s = (decode(scales, get_format(NVFP4_SCALE_FORMAT)).float() * t).double()  # SPEC 3.4: fl(decode(c) * t)
    else:
        s = scales.double()
    s = s.repeat_interleave(block_rows, dim=0)[:n].repeat_interleave(g, dim=1)[:, :k]
    return d, s


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tensor_core_roundings(k: int, group_size: int) -> int:
    """SPEC 8.2's count for the CUDA tensor-core GEMV (K input features, groups of ``group_size`` along K; a 2-D
    block's ``Bc``): a group's ``g = min(G, K)`` products accumulate in one mma chain, whose tensor-core additions
    (blocks of at least 8 products, aligned and truncated to 24 bits, the sum truncated) err by at most ``2 u (g +
    n_b)`` of the chain's absolute sum with ``n_b <= 2 ceil(g / 16)`` blocks: ``2 (g + 2 ceil(g / 16))``; then the
    scale times the chain plus the running total (one FFMA), the later chains of the block, the split-K partial sums
    (at most ``ceil(K / G) + ceil(K / 256)`` splits) and the bias: ``2 ceil(K / G) + ceil(K / 256) + 2``."""
    g = min(group_size, max(k, 1))
    return 2 * (g + 2 * ceil_div(g, 16)) + 2 * ceil_div(k, g) + ceil_div(k, 256) + 2


def assert_linear_within_bound(x, qt, bias, y, weights="exact", tensor_cores=False):
    """``y`` of a quantized linear against fp64 ``x @ w^T + bias``, SPEC 8's bound. ``weights="exact"`` (every CPU
    path, the torch backend and the CUDA GEMV): ``w`` = :func:`exact_weight`, the codes times their group scales
    exactly; ``"rounded"`` (the CUDA panels): ``w = dequantize(qt, x.dtype)``, the SPEC 5 weights in x's dtype.
    Either way the path differs from the reference only in the order and rounding of its fp32 sums (and one rounding
    to x's dtype): :func:`assert_product_within_bound`, with :func:`tensor_core_roundings` instead of ``K + 2`` for
    the CUDA GEMV (``tensor_cores=True``: its mma chains truncate)."""
    if weights == "exact":
        codes, scales = exact_parts(qt)
        w = codes * scales
    else:
        assert weights == "rounded", weights
        w, scales = fpq.dequantize(qt, x.dtype, backend="torch").double().cpu(), None
    roundings = tensor_core_roundings(qt.shape[1], qt.group_size) if tensor_cores else None
    groups = ceil_div(qt.shape[1], min(qt.group_size, max(qt.shape[1], 1))) if scales is not None else 0
    assert_product_within_bound(x, w, bias, y, roundings, scales=scales, groups=groups, truncations=tensor_cores)


def underflow_units(x64, w, scales=None, groups=0, truncations=False):
    """SPEC 8.2's ``U`` for each output ``(M, N)``: how many times ``ETA32`` (half fp32's smallest subnormal) the
    operations whose results are subnormal may err by, absolutely: ``U = 1 + groups + sum_k (c max(1, |s_k|) + |x_k|
    [0 < |w_k| < 2^-126])``: the bias; each group's scale multiply (``groups`` per output); term ``k``'s product or
    the FMA that adds it (``c = 1``; 4 for the tensor cores' truncations, ``truncations``), which the group scale
    ``s_k`` multiplies afterwards where the kernel scales partial sums (``max(1, |s_k|)`` covers that and the fp32
    panels, whose products are not scaled afterwards); and an fp32 weight ``fl(decode(q) * s)`` that is subnormal
    (the panels: its error times ``|x_k|``). Additions add nothing: an fp32 sum whose result is subnormal is exact.
    ``scales`` ``(N, K)``: each weight's group scale (``None``: products not scaled afterwards)."""
    c = 4.0 if truncations else 1.0
    per_term = (c * scales.abs().clamp(min=1.0)).sum(1) if scales is not None else torch.full((w.shape[0],),
                                                                                              c * w.shape[1])
    subnormal = ((w.abs() < NORMAL32) & (w != 0)).double()
    return 1 + groups + per_term.double().reshape(1, -1) + x64.abs() @ subnormal.T


def assert_product_within_bound(x, w, bias, y, roundings=None, scales=None, groups=0, truncations=False):
    """``y`` (in ``x``'s dtype) of any path that multiplies ``x`` by the fp64 weight ``w`` ``(N, K)`` with fp32
    products and sums (any order) and one rounding to x's dtype, against fp64 ``ref = x @ w^T + bias`` (the bias
    rounded to x's dtype, as every path adds it): elementwise ``|y - ref| <= 2 n eps32 sum|x||w| + eps(out) |ref| +
    tiny(out) + (1 + 2 n eps32) ETA32 U`` with ``n = K + 2`` roundings per term unless `roundings` says otherwise
    and ``U`` of :func:`underflow_units` (``scales``: the group scale of each weight, ``groups``: group scale
    multiplies per output, ``truncations``: the tensor cores' mma chains) (SPEC 8.2), NaN exactly where the reference is NaN, the same Inf where it is Inf. Returns
    ``ref``."""
    x64 = x.detach().double().cpu().reshape(-1, w.shape[1])
    ref = x64 @ w.T
    size = x64.abs() @ w.abs().T
    if bias is not None:  # every path adds the bias rounded to x's dtype (SPEC 8)
        b = bias.to(x.dtype).double().cpu()
        ref, size = ref + b, size + b.abs()
    y64 = y.detach().double().cpu().reshape(ref.shape)
    k = w.shape[1]
    # gamma_n <= 2 n eps32 with n = K + 2 roundings per term: its product, <= K - 1 additions, the group scale
    # times its partial sum, the bias (SPEC 8.2); K = 1 meets 3 (a GEMV run drew one 2 K eps32 missed); plus the
    # absolute error of the operations whose results are subnormal, each carried through at most n roundings
    n = k + 2 if roundings is None else roundings
    gamma = 2 * n * 2.0**-24
    tol = gamma * size + EPS_OUT[x.dtype] * ref.abs() + TINY_OUT[x.dtype]
    tol = tol + (1 + gamma) * ETA32 * underflow_units(x64, w, None if scales is None else scales.cpu(), groups,
                                                      truncations)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y64), nan), "NaN positions differ from the reference"
    inf = torch.isinf(ref)  # an Inf input with finite weights: the same signed Inf
    assert torch.equal(y64[inf], ref[inf]), "Inf results differ from the reference"
    finite = ~nan & ~inf
    err = (y64 - ref).abs()[finite]
    assert bool((err <= tol[finite]).all()), f"max error {err.max().item():.3e} over bound {tol[finite].max().item():.3e}"
    assert y.dtype == x.dtype
    return ref


def matmul_within_bound(a, b, got, extra=0.0):
    """``got`` (an fp32 result of ``a @ b``, any summation order: BLAS, oneDNN, autograd's backward) against the
    fp64 product: ``|got - a @ b| <= 2 K eps32 (|a| @ |b|) + extra`` elementwise (the standard bound
    ``gamma_K sum|a||b|`` of a K-term fp32 dot product, ``gamma_K <= 2 K 2^-24`` for ``K 2^-24 <= 1/2``;
    Higham, Accuracy and Stability of Numerical Algorithms, 3.1). ``extra``: further roundings the caller
    derives. Returns the fp64 product."""
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    tol = 2 * a.shape[-1] * 2.0**-24 * (a64.abs() @ b64.abs()) + extra
    err = (got.double() - exact).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3e} over bound {tol.max().item():.3e}"
    return exact


class LinearCalls:
    """Every call of the quantized linear (``ds_fpquant.linear.linear``, which ``FPQuantizedLinear`` and the
    ``QuantizedWeight`` stand-ins of expert stacks and AutoTP layers run) while recording: ``(x, qt, bias, y)``
    each, so that a model's forward can be checked call by call against ``assert_linear_within_bound``."""

    def __init__(self, monkeypatch):
        from ds_fpquant.linear import weights as weights_module
        from ds_fpquant.nn import quantized_linear as layer_module

        self.calls = []
        original = weights_module.linear

        def recording(x, qt, bias=None, **kwargs):
            y = original(x, qt, bias, **kwargs)
            self.calls.append((x.detach().clone(), qt, None if bias is None else bias.detach().clone(), y.detach(),
                               kwargs.get("activation")))
            return y

        monkeypatch.setattr(weights_module, "linear", recording)  # QuantizedWeight's F.linear / matmul
        monkeypatch.setattr(layer_module, "fused_linear", recording)  # FPQuantizedLinear.forward

    def assert_each_within_bound(self):
        """Each recorded weight-only call within :func:`assert_linear_within_bound` of its own inputs."""
        assert self.calls, "no quantized linear ran"
        for x, qt, bias, y, activation in self.calls:
            assert activation is None, "W8A8 calls have their own bound (test_w8a8.py)"
            assert_linear_within_bound(x, qt, bias, y)


def rms_error(got, exact) -> float:
    """The RMS of ``got - exact``, in fp64."""
    return (got.double() - exact.double()).pow(2).mean().sqrt().item()


def assert_as_accurate_as(got, baseline, exact, multiplier=2.0):
    """``got`` and ``baseline``: two fp32 evaluations of one function (a whole model) whose operations differ
    only in the order of their fp32 sums (inductor's fused norms and activations against eager; a tensor-
    parallel split of the matmuls; another matmul kernel), ``exact`` its fp64 evaluation. Reordering sums
    changes which roundings happen, not their size, so ``got`` must be about as close to ``exact`` as
    ``baseline``: RMS error at most ``multiplier`` times the baseline's, plus one fp32 rounding of the output
    (``2^-24`` of its RMS). The criterion of torch's own compiled-model accuracy checks
    (``torch._dynamo.utils.same`` with an fp64 reference, multiplier 2 for fp32); it does not depend on which
    kernels this CPU runs."""
    assert_rms_errors_comparable(rms_error(got, exact), rms_error(baseline, exact), rms_error(exact, 0 * exact),
                                 multiplier)


def assert_rms_errors_comparable(got_error, baseline_error, exact_rms, multiplier=2.0):
    """:func:`assert_as_accurate_as` on the RMS errors (and the exact values' RMS) computed elsewhere."""
    floor = 2.0**-24 * exact_rms
    assert got_error <= multiplier * baseline_error + floor, (
        f"RMS error {got_error:.3e} against fp64 over {multiplier} x the baseline's {baseline_error:.3e} + {floor:.3e}")


def dequantized_model(model, quantized):
    """A copy of the full-precision ``model`` with each weight that ``quantized`` (``apply`` or ``load_quantized``
    of it) holds quantized replaced by its SPEC 5 dequantized weight in fp32: the function the quantized
    model computes, to be evaluated in fp64 (``.double()``) as the exact value of :func:`assert_as_accurate_as`."""
    import copy

    from ds_fpquant.nn.quantized_linear import FPQuantizedLinear

    deq = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if quantized_experts(module):
                raise NotImplementedError(f"{name}: quantized expert stacks are not replaced here")
            if isinstance(module, FPQuantizedLinear):
                target = deq.get_submodule(name)
                if not isinstance(target, torch.nn.Linear):  # a Conv1D holds the weight transposed
                    raise TypeError(f"{name} is a {type(target).__name__}; only nn.Linear weights are replaced")
                target.weight.copy_(module.dequantized_weight(torch.float32))
    return deq
