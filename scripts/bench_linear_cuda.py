"""The quantized linear on a CUDA device against bf16 ``nn.Linear``, measured in one run (scripts/gpu_check.sh).

Model-sized: each shape is a stack of L distinct layers whose bf16 weights add up to at least twice the
GPU's L2 cache, and one timed pass runs all L (as one decode step of a model reads every weight once);
time per layer. For M <= 16 each pass is captured in a CUDA graph and replayed, so launch overhead does
not hide the kernels. Reported per (shape, M, format): ms per layer, the ratio bf16 ms / this ms (above
1: faster than bf16) and the weight bytes read per second as a share of the device's peak bandwidth
(``--peak-tbps``, 4.8 for an H200).

Formats: e4m3 (G=128), e2m1 (G=32), nvfp4 and e4m3 with 128x128 blocks, weight-only through
``ds_fpquant.linear.linear`` (the tensor-core GEMV up to 16 rows of x, panels of decoded rows + cuBLAS beyond),
and ``e4m3+w8a8``: e4m3 weights in 128x128 blocks with the activations quantized per token
(``activation="e4m3"``: this project's quantize kernel, then torch._scaled_mm's blockwise FP8 GEMM; a log
line says so if it falls back); any other element format of ``ds_fpquant.FORMATS`` with G=128.

``--paths gemv panels`` times each weight-only format twice: ``gemv`` is ``linear`` (the GEMV for M <= 16),
``panels`` the panels + cuBLAS path that larger M takes, called directly at the same M (what M <= 16 ran on
before the GEMV covered it). ``hbm_tbps``: the bytes a pass must move at least (codes, scales, x, y) per
second, the GEMV's achieved HBM bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from ds_fpquant import quantize
from ds_fpquant.linear import linear

SHAPES = ((8192, 8192), (28672, 8192), (7168, 2048), (4096, 4096))
TOKENS = (1, 4, 16, 64, 256, 4096)
FORMATS = ("e4m3", "e4m3+w8a8", "e2m1", "nvfp4", "e4m3/128x128")
#: Rows run with the activations quantized too (W8A8, torch._scaled_mm's blockwise FP8 GEMM).
W8A8 = "e4m3+w8a8"


PATHS = ("gemv", "panels")


def _quantize(w: torch.Tensor, fmt: str):
    if fmt in ("e4m3/128x128", W8A8):
        return quantize(w, "e4m3", block=(128, 128))
    return quantize(w, fmt, {"e2m1": 32, "nvfp4": None}.get(fmt, 128))


def _panels_linear(x: torch.Tensor, qt, bias=None) -> torch.Tensor:
    """The CUDA panels + cuBLAS path of the weight-only linear (``weight_only._panels``, what M > GEMV_MAX_ROWS runs),
    at any M."""
    from ds_fpquant.linear import weight_only

    return weight_only._panels(x, qt, bias, weight_only.CUDA_PANEL_BYTES,
                               weight_only._dequantizing_decoder(qt, x, "auto"))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (no device needed: gpu_check's arguments are checked on CPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="N x K of each layer")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="M, rows of x")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS),
                        help=f"{', '.join(FORMATS)} or any element format (G=128)")
    parser.add_argument("--paths", nargs="+", default=["gemv"], choices=PATHS,
                        help="weight-only paths to time: gemv (linear: the GEMV for M <= 16), panels (panels + "
                        "cuBLAS at any M)")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--peak-tbps", type=float, default=4.8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import ds_fpquant as fpq

    for shape in args.shapes:
        dims = shape.lower().split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            parser.error(f"--shapes: {shape!r} is not N x K (two positive integers, e.g. 4096x4096)")
    for fmt in args.formats:
        if fmt not in FORMATS and fmt not in fpq.FORMATS:
            parser.error(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)} or {', '.join(fpq.FORMATS)}")
    if any(m < 1 for m in args.tokens):
        parser.error(f"--tokens: {args.tokens} must be positive")
    return args


def _time_pass(fn, m: int, repeat: int) -> float:
    """Median ms of fn() (one pass over the layers): graph-replayed for m <= 16."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if m <= 16:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear_cuda: needs a CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    print(f"{props.name}, L2 {l2 / 2**20:.0f} MiB, peak {args.peak_tbps} TB/s (given)")
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        layers = max(1, math.ceil(2 * l2 / (n * k * 2)))
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16).cuda() for _ in range(layers)]
        quantized = {fmt: [_quantize(w, fmt) for w in weights] for fmt in args.formats}
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = _time_pass(lambda: [F.linear(x, w) for w in weights], m, args.repeat) / layers
            rows.append(dict(n=n, k=k, m=m, fmt="bf16 nn.Linear", ms=base, vs_bf16=1.0,
                             weight_tbps=n * k * 2 / base / 1e9))
            io_bytes = 2 * m * (n + k)  # x read, y written (bf16)
            first = len(rows) - 1
            for fmt, qts in quantized.items():
                activation = "e4m3" if fmt == W8A8 else None
                for path in args.paths if activation is None else ["gemv"]:
                    if path == "gemv":
                        fn = lambda: [linear(x, qt, activation=activation) for qt in qts]  # noqa: E731
                    else:
                        fn = lambda: [_panels_linear(x, qt) for qt in qts]  # noqa: E731
                    ms = _time_pass(fn, m, args.repeat) / layers
                    nbytes = qts[0].nbytes
                    rows.append(dict(n=n, k=k, m=m, fmt=fmt, path=path, ms=ms, vs_bf16=base / ms,
                                     weight_tbps=nbytes / ms / 1e9, hbm_tbps=(nbytes + io_bytes) / ms / 1e9))
            rows[first]["hbm_tbps"] = (n * k * 2 + io_bytes) / base / 1e9
            for r in rows[first:]:
                print(f"{r['n']}x{r['k']} M={r['m']:5d} {r['fmt']:>15} {r.get('path', ''):>6}: {r['ms']:.4f} ms/layer, "
                      f"{r['vs_bf16']:.2f}x bf16, weights {r['weight_tbps']:.2f} TB/s, HBM {r['hbm_tbps']:.2f} TB/s "
                      f"({100 * r['hbm_tbps'] / args.peak_tbps:.0f}% of peak)", flush=True)
        weights = quantized = None  # freed before the next shape's weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=props.name, l2_bytes=l2, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
