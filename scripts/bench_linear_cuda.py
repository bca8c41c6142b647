"""The quantized linear on a CUDA device against bf16 cuBLAS and its peers, measured in one run (scripts/gpu_check.sh).

Model-sized passes that the L2 cache cannot flatter (issue 42): each shape is a stack of L distinct layers, L chosen
so that the *smallest* quantized pass (the format of fewest bytes per layer, codes plus scales) reads at least
``L2_FACTOR`` = 4 times the L2; one timed pass runs all L layers (as a decode step reads every weight once), time
per layer. For M <= 16 each pass is captured in a CUDA graph and replayed, so launch overhead does not hide the
kernels (``graph`` in each row: false where the pass could not be captured and ran eagerly). ``--layers`` fixes L;
it is refused (before any kernel runs) where the smallest quantized pass would be under 4x the L2 (the device's, or
``--l2-bytes``).

The ceiling is measured in the same run: ``copy_tbps``, a device-to-device copy of 2 GiB, counted as bytes read +
bytes written per second. Every row is one JSON line, printed the moment it is measured (``--json`` appends the
same lines to a file):

- ``kind="copy"``: the ceiling.
- ``kind="linear"``, per (shape, M, format or peer): ``ms`` per layer, ``vs_bf16`` (bf16 ms / this ms: above 1 is
  faster than bf16 cuBLAS), ``weight_tbps`` (weight bytes per layer / ms), ``of_copy`` (weight_tbps / copy_tbps)
  and ``rel_err``: ||y - F.linear(x, dequantize(W))|| / ||F.linear(x, dequantize(W))|| in fp32 for the first layer
  (a fast wrong kernel shows here; for W8A8 it includes the activations' quantization).
  Formats: ``e4m3`` (G=128), ``e4m3/128x128`` (2-D blocks), ``e4m3/128x128+w8a8`` (the same weights, activations
  quantized per token to e4m3: ``activation="e4m3"``, torch._scaled_mm's blockwise FP8 GEMM), ``e2m1`` (G=32),
  ``nvfp4``, ``e3m2`` (G=128), any other element format with G=128; ``path="linear"`` is
  ``ds_fpquant.linear.linear`` (the tensor-core GEMV for M <= 16, panels + cuBLAS beyond). Peers: ``bf16``
  (``F.linear``, cuBLAS), ``scaled_mm`` (torch._scaled_mm with per-tensor e4m3 weights and x quantized per tensor
  on each call, the W8A8 a user would pick; its time includes x's quantization) and, for M <= 16,
  ``path="panels"`` (each weight-only format through the panels + cuBLAS path at the same M).
- ``kind="quantize"`` / ``"dequantize"``: bf16 -> e4m3 (G=128), mxfp4, nvfp4 of ``--quant-gib`` GiB of bf16, CUDA and
  torch backends; ``tbps`` (bytes read + written per second) and ``of_copy``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Tuple

import torch
import torch.nn.functional as F

from ds_fpquant import FORMATS as ELEMENT_FORMATS
from ds_fpquant import quantize
from ds_fpquant.linear import linear
from ds_fpquant.numerics.formats import get_format
from ds_fpquant.numerics.packing import row_bytes

SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (28672, 8192))
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
W8A8 = "e4m3/128x128+w8a8"
FORMATS = ("e4m3", "e4m3/128x128", W8A8, "e2m1", "nvfp4", "e3m2")
#: quantize(fmt, **kwargs) of each named format; any other element format: G=128
QUANTIZE_KWARGS = {"e4m3/128x128": ("e4m3", {"block": (128, 128)}), W8A8: ("e4m3", {"block": (128, 128)}),
                   "e2m1": ("e2m1", {"group_size": 32}), "nvfp4": ("nvfp4", {})}
PEERS = ("bf16", "scaled_mm")
QUANT_FORMATS = ("e4m3", "mxfp4", "nvfp4")
L2_FACTOR = 4
GEMV_MAX_ROWS = 16


def quantize_args(fmt: str):
    """(fmt, kwargs) for ds_fpquant.quantize of a format name of this script."""
    return QUANTIZE_KWARGS.get(fmt, (fmt, {"group_size": 128}))


def layer_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes of one quantized (n, k) layer: codes plus scales (plus NVFP4's 4-byte tensor scale), as
    ``QuantizedTensor.nbytes`` counts them."""
    name, kwargs = quantize_args(fmt)
    if name == "nvfp4":  # G=16, one e4m3 byte a group, a fp32 tensor scale
        return n * row_bytes(k, 16, 4) + n * math.ceil(k / 16) + 4
    bits = get_format(name).bits
    if "block" in kwargs:
        br, bc = kwargs["block"]
        return n * row_bytes(k, k, bits) + math.ceil(n / br) * math.ceil(k / bc) * 4
    g = kwargs["group_size"]
    return n * row_bytes(k, g, bits) + n * math.ceil(k / g) * 4


def layers_for(n: int, k: int, formats, l2_bytes: int, layers=None) -> int:
    """Layers per pass: the least L with L x (the smallest quantized layer's bytes) >= L2_FACTOR x l2_bytes, or
    ``layers`` checked against that. Raises ValueError naming --layers if ``layers`` is smaller."""
    smallest = min(layer_bytes(n, k, fmt) for fmt in formats)
    need = math.ceil(L2_FACTOR * l2_bytes / smallest)
    if layers is None:
        return need
    if layers < need:
        raise ValueError(f"--layers={layers} for {n}x{k}: the smallest quantized pass would read {layers * smallest} "
                         f"bytes, under {L2_FACTOR}x the L2 ({L2_FACTOR * l2_bytes} bytes); allowed: >= {need}")
    return layers


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (no device needed: refused before any kernel runs)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="N x K of each layer")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="M, rows of x")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS),
                        help=f"{', '.join(FORMATS)} or any element format (G=128)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers per pass (default: the least that makes the smallest quantized pass >= "
                        f"{L2_FACTOR}x L2); refused if smaller")
    parser.add_argument("--l2-bytes", type=int, default=None, help="the L2 to size passes by (default: the device's)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--quant-gib", type=float, default=2.0, help="GiB of bf16 for the quantize rows (0: none)")
    parser.add_argument("--json", default=None, help="append every row, one JSON line each, to this file")
    args = parser.parse_args(argv)
    for shape in args.shapes:
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            parser.error(f"--shapes: {shape!r} is not N x K (two positive integers, e.g. 4096x4096)")
    for fmt in args.formats:
        if fmt not in FORMATS and fmt not in ELEMENT_FORMATS:
            parser.error(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)} or {', '.join(ELEMENT_FORMATS)}")
    if any(m < 1 for m in args.tokens):
        parser.error(f"--tokens: {args.tokens} must be positive")
    if args.repeat < 1 or args.quant_gib < 0:
        parser.error(f"--repeat={args.repeat} must be >= 1 and --quant-gib={args.quant_gib} >= 0")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers} must be >= 1")
    if args.l2_bytes is not None:
        if args.l2_bytes < 1:
            parser.error(f"--l2-bytes={args.l2_bytes} must be positive")
        for shape in args.shapes:
            n, k = (int(v) for v in shape.lower().split("x"))
            try:
                layers_for(n, k, args.formats, args.l2_bytes, args.layers)
            except ValueError as exc:
                parser.error(str(exc))
    return args


def _time_pass(fn, repeat: int, graph: bool) -> Tuple[float, bool]:
    """(median ms of fn(), one pass over the layers; whether it was replayed from a CUDA graph). With ``graph`` the pass
    is captured once and replayed; a pass that cannot be captured (a host sync inside, e.g. NVFP4's tensor scale read
    as a float by the linear) is timed eagerly instead, and the row says so."""
    fn()
    torch.cuda.synchronize()
    run, graphed = fn, False
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on a side stream, as torch.cuda.graph's documentation does
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(cuda_graph):
                fn()
            run, graphed = cuda_graph.replay, True
        except RuntimeError:
            torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], graphed


class Emitter:
    """Prints each row as one JSON line at once (and appends it to ``path``)."""

    def __init__(self, path):
        self.fh = open(path, "a") if path else None

    def __call__(self, **row):
        line = json.dumps(row)
        print(line, flush=True)
        if self.fh:
            self.fh.write(line + "\n")
            self.fh.flush()


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _panels_linear(x: torch.Tensor, qt, bias=None) -> torch.Tensor:
    """The CUDA panels + cuBLAS path of the weight-only linear (``weight_only._panels``, what M > GEMV_MAX_ROWS runs),
    at any M."""
    from ds_fpquant.linear import weight_only

    return weight_only._panels(x, qt, bias, weight_only.CUDA_PANEL_BYTES,
                               weight_only._dequantizing_decoder(qt, x, "auto"))


def _per_tensor_e4m3(t: torch.Tensor):
    """t (bf16) -> (float8_e4m3fn codes, fp32 0-d scale): amax / 448 per tensor."""
    scale = (t.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def measure_copy(emit, repeat: int) -> float:
    """TB/s (read + written) of a 2 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms, _ = _time_pass(lambda: dst.copy_(src), repeat, graph=False)  # one launch
    tbps = 2 * src.numel() * 2 / ms / 1e9
    emit(kind="copy", bytes=2 * src.numel() * 2, ms=ms, copy_tbps=tbps)
    return tbps


def bench_shape(emit, n: int, k: int, args, l2: int, copy_tbps: float) -> None:
    layers = layers_for(n, k, args.formats, l2, args.layers)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    quantized = {fmt: [quantize(w, quantize_args(fmt)[0], **quantize_args(fmt)[1]) for w in weights]
                 for fmt in args.formats}
    dequantized = {fmt: qts[0].dequantize(torch.bfloat16) for fmt, qts in quantized.items()}
    fp8 = [_per_tensor_e4m3(w) for w in weights]
    common = dict(kind="linear", n=n, k=k, layers=layers)
    for m in args.tokens:
        x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)

        def row(fmt, path, fn, nbytes, ref_w, first):
            try:
                ms, graphed = _time_pass(lambda: [fn(i) for i in range(layers)], args.repeat, graph)
                ms /= layers
                err = _rel_err(first(), F.linear(x, ref_w))
            except RuntimeError as exc:  # e.g. cuBLASLt refusing a shape: the row says so, the run goes on
                emit(**common, m=m, fmt=fmt, path=path, error=str(exc).splitlines()[0] if str(exc) else repr(exc))
                return
            weight_tbps = nbytes / ms / 1e9
            emit(**common, m=m, fmt=fmt, path=path, ms=ms, vs_bf16=base / ms, weight_tbps=weight_tbps,
                 of_copy=weight_tbps / copy_tbps, rel_err=err, graph=graphed)

        graph = m <= GEMV_MAX_ROWS
        base, graphed = _time_pass(lambda: [F.linear(x, w) for w in weights], args.repeat, graph)
        base /= layers
        emit(**common, m=m, fmt="bf16", path="F.linear", ms=base, vs_bf16=1.0, weight_tbps=n * k * 2 / base / 1e9,
             of_copy=n * k * 2 / base / 1e9 / copy_tbps, rel_err=0.0, graph=graphed)

        def scaled_mm(i):
            xq, sx = _per_tensor_e4m3(x)
            return torch._scaled_mm(xq, fp8[i][0].t(), scale_a=sx, scale_b=fp8[i][1], out_dtype=torch.bfloat16)

        row("e4m3/tensor", "scaled_mm", scaled_mm, n * k + 4, (fp8[0][0].float() * fp8[0][1]).to(torch.bfloat16),
            lambda: scaled_mm(0))
        for fmt, qts in quantized.items():
            nbytes = qts[0].nbytes
            activation = "e4m3" if fmt == W8A8 else None
            row(fmt, "linear", lambda i, qts=qts, a=activation: linear(x, qts[i], activation=a), nbytes,
                dequantized[fmt], lambda qts=qts, a=activation: linear(x, qts[0], activation=a))
            if activation is None and m <= GEMV_MAX_ROWS:
                row(fmt, "panels", lambda i, qts=qts: _panels_linear(x, qts[i]), nbytes, dequantized[fmt],
                    lambda qts=qts: _panels_linear(x, qts[0]))


def bench_quantize(emit, args, copy_tbps: float) -> None:
    """bf16 -> each of QUANT_FORMATS and back, CUDA and torch backends, on --quant-gib GiB."""
    numel = int(args.quant_gib * 2**30) // 2 // 4096 * 4096
    x = torch.empty(numel // 4096, 4096, dtype=torch.bfloat16, device="cuda").normal_()
    for fmt in QUANT_FORMATS:
        for backend in ("cuda", "torch"):
            try:
                qt = quantize(x, fmt, 128 if fmt == "e4m3" else None, backend=backend)
                out_bytes = qt.nbytes
                ms, _ = _time_pass(lambda: quantize(x, fmt, 128 if fmt == "e4m3" else None, backend=backend),
                                   args.repeat, graph=False)
                tbps = (x.numel() * 2 + out_bytes) / ms / 1e9
                emit(kind="quantize", fmt=fmt, backend=backend, bytes_in=x.numel() * 2, bytes_out=out_bytes, ms=ms,
                     tbps=tbps, of_copy=tbps / copy_tbps)
                ms, _ = _time_pass(lambda: qt.dequantize(torch.bfloat16, backend=backend), args.repeat, graph=False)
                tbps = (x.numel() * 2 + out_bytes) / ms / 1e9
                emit(kind="dequantize", fmt=fmt, backend=backend, bytes_in=out_bytes, bytes_out=x.numel() * 2, ms=ms,
                     tbps=tbps, of_copy=tbps / copy_tbps)
                qt = None
            except (RuntimeError, ValueError) as exc:
                emit(kind="quantize", fmt=fmt, backend=backend, error=str(exc).splitlines()[0])
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear_cuda: needs a CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = args.l2_bytes or props.L2_cache_size
    emit = Emitter(args.json)
    for shape in args.shapes:  # refused before any kernel runs
        n, k = (int(v) for v in shape.lower().split("x"))
        layers_for(n, k, args.formats, l2, args.layers)
    emit(kind="device", name=props.name, l2_bytes=l2, sms=props.multi_processor_count, torch=torch.__version__)
    copy_tbps = measure_copy(emit, args.repeat)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        bench_shape(emit, n, k, args, l2, copy_tbps)
        torch.cuda.empty_cache()
    if args.quant_gib:
        bench_quantize(emit, args, copy_tbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
