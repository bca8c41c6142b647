"""The quantized linear on a CUDA device against bf16 ``nn.Linear``, measured in one run (scripts/gpu_check.sh).

Model-sized: each shape is a stack of L distinct layers whose bf16 weights add up to at least twice the
GPU's L2 cache, and one timed pass runs all L (as one decode step of a model reads every weight once);
time per layer. For M <= 16 each pass is captured in a CUDA graph and replayed, so launch overhead does
not hide the kernels. Reported per (shape, M, format): ms per layer, the ratio bf16 ms / this ms (above
1: faster than bf16) and the weight bytes read per second as a share of the device's peak bandwidth
(``--peak-tbps``, 4.8 for an H200).

Formats: e4m3 (G=128), e2m1 (G=32), nvfp4 and e4m3 with 128x128 blocks, weight-only through
``ds_fpquant.linear.linear`` (the GEMV kernel up to 8 rows of x, panels of decoded rows + cuBLAS beyond),
and ``e4m3+w8a8``: e4m3 weights in 128x128 blocks with the activations quantized per token
(``activation="e4m3"``: this project's quantize kernel, then torch._scaled_mm's blockwise FP8 GEMM; a log
line says so if it falls back).
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


def _quantize(w: torch.Tensor, fmt: str):
    if fmt in ("e4m3/128x128", W8A8):
        return quantize(w, "e4m3", block=(128, 128))
    return quantize(w, fmt, {"e4m3": 128, "e2m1": 32}.get(fmt))


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--peak-tbps", type=float, default=4.8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
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
            for fmt, qts in quantized.items():
                activation = "e4m3" if fmt == W8A8 else None
                ms = _time_pass(lambda: [linear(x, qt, activation=activation) for qt in qts], m, args.repeat) / layers
                nbytes = qts[0].nbytes
                rows.append(dict(n=n, k=k, m=m, fmt=fmt, ms=ms, vs_bf16=base / ms, weight_tbps=nbytes / ms / 1e9))
            for r in rows[-1 - len(quantized):]:
                print(f"{r['n']}x{r['k']} M={r['m']:5d} {r['fmt']:>15}: {r['ms']:.4f} ms/layer, "
                      f"{r['vs_bf16']:.2f}x bf16, weights {r['weight_tbps']:.2f} TB/s "
                      f"({100 * r['weight_tbps'] / args.peak_tbps:.0f}% of peak)", flush=True)
        weights = quantized = None  # freed before the next shape's weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=props.name, l2_bytes=l2, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
