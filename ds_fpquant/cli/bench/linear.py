"""``ds-fpquant bench --linear``: the quantized linear layer against ``nn.Linear``, all in one run.

For each weight shape ``(N, K)``, token count ``M`` and format, bf16 activations ``(M, K)`` go through
``nn.Linear`` in fp32 and in bf16, through ``F.linear(x, dequantize(W, bf16))`` (dequantize +
matmul, what ``FPQuantizedLinear`` did before the fused op) and through :func:`ds_fpquant.linear.linear`
(the fused op). Two settings:

* cache-resident: one layer called again and again (its weights stay in the last-level cache);
* model-sized: a pass over ``L`` distinct layers whose bf16 weights add up to at least twice the
  last-level cache, as one decode step of a real model reads them; time per layer.

A ``copy_`` of one layer's bf16 weights (model-sized) gives the memory bandwidth of this run.
Ratios are ``bf16 nn.Linear ms / this ms`` within the same setting (above 1: faster than bf16).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ds_fpquant.cli.common import median_ms, parse_scheme, report
from ds_fpquant.linear import linear
from ds_fpquant.tensor.quantize import dequantize, quantize

MIB = 2**20


DEFAULT_SHAPES = ((4096, 4096), (11008, 4096))


DEFAULT_TOKENS = (1, 4, 16, 64, 256)


#: Table formats: element format or preset, "/BrxBc" for 2-D blocks.
DEFAULT_FORMATS = ("e4m3", "e2m1", "nvfp4", "e4m3/128x128")


#: The issue's figure for the development machine, used when sysfs does not say.
FALLBACK_LLC_MIB = 260


@dataclass
class LinearResult:
    n: int
    k: int
    m: int
    impl: str  # "nn.Linear fp32" | "nn.Linear bf16" | "dequantize + matmul" | "fused" | "copy_ bf16 weights"
    fmt: str
    layers: int  # distinct layers in the model-sized pass
    resident_ms: Optional[float]
    model_ms: float
    resident_vs_bf16: Optional[float] = None
    model_vs_bf16: Optional[float] = None


def llc_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size of the largest CPU cache (sysfs ``index*/size``), else :data:`FALLBACK_LLC_MIB`. Entries that are
    not caches (``uevent``) or cannot be read are skipped, each on its own."""
    sizes = []
    try:
        entries = [e for e in os.listdir(root) if e.startswith("index")]
    except OSError:
        entries = []
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "size")) as fh:
                text = fh.read().strip().upper()
            scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else FALLBACK_LLC_MIB * MIB


def _quantize(w: torch.Tensor, fmt: str):
    fmt, block = parse_scheme(fmt)
    return quantize(w, fmt, block=block)


def run(shapes: Sequence[Tuple[int, int]], tokens: Sequence[int], formats: Sequence[str], repeat: int = 5,
        llc: Optional[int] = None, progress: bool = True) -> List[LinearResult]:
    llc = llc_bytes() if llc is None else llc
    results: List[LinearResult] = []
    torch.manual_seed(0)
    with torch.no_grad():
        for n, k in shapes:
            layers = max(1, math.ceil(2 * llc / (2 * n * k)))
            masters = [torch.randn(n, k) * 0.02 for _ in range(layers)]
            weights: Dict[str, list] = {"nn.Linear fp32": masters, "nn.Linear bf16": [w.bfloat16() for w in masters]}
            quantized = {fmt: [_quantize(w, fmt) for w in masters] for fmt in formats}
            copy_src, copy_dst = weights["nn.Linear bf16"], [torch.empty_like(w) for w in weights["nn.Linear bf16"]]
            copy_ms = median_ms(lambda: [d.copy_(s) for d, s in zip(copy_dst, copy_src)], repeat) / layers
            results.append(LinearResult(n, k, 0, "copy_ bf16 weights", "-", layers, None, copy_ms))
            copy_dst = None  # freed before the layers are quantized
            for m in tokens:
                if progress:
                    print(f"bench --linear: {n}x{k}, M={m}, {layers} layers", flush=True)
                x = torch.randn(m, k).bfloat16()
                x32 = x.float()
                calls: List[Tuple[str, str, Callable]] = [
                    ("nn.Linear fp32", "-", lambda w: F.linear(x32, w)),
                    ("nn.Linear bf16", "-", lambda w: F.linear(x, w)),
                ]
                for fmt in formats:
                    calls.append(("dequantize + matmul", fmt, lambda qt: F.linear(x, dequantize(qt, torch.bfloat16))))
                    calls.append(("fused", fmt, lambda qt: linear(x, qt)))
                rows = []
                for impl, fmt, call in calls:
                    layer_set = weights[impl] if fmt == "-" else quantized[fmt]
                    resident = median_ms(lambda: call(layer_set[0]), repeat)
                    model = median_ms(lambda: [call(w) for w in layer_set], max(3, repeat // 2)) / layers
                    rows.append(LinearResult(n, k, m, impl, fmt, layers, resident, model))
                base = next(r for r in rows if r.impl == "nn.Linear bf16")
                for r in rows:
                    r.resident_vs_bf16 = base.resident_ms / r.resident_ms
                    r.model_vs_bf16 = base.model_ms / r.model_ms
                results += rows
    return results


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_table(results: Sequence[LinearResult]) -> str:
    lines = ["| N x K | M | impl | fmt | resident ms | vs bf16 | model-sized ms (per layer) | vs bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        resident = "-" if r.resident_ms is None else f"{r.resident_ms:.3f}"
        m = "-" if r.m == 0 else str(r.m)
        lines.append(f"| {r.n}x{r.k} | {m} | {r.impl} | {r.fmt} | {resident} | {_x(r.resident_vs_bf16)} | "
                     f"{r.model_ms:.3f} ({r.layers} layers) | {_x(r.model_vs_bf16)} |")
    return "\n".join(lines)


def _shape(text: str) -> Tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NxK (e.g. 4096x4096)") from None
    if n < 1 or k < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: N and K must be >= 1")
    return n, k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--linear (quantized linear layer against nn.Linear)")
    group.add_argument("--linear", action="store_true", help="benchmark the quantized linear layer instead")
    group.add_argument("--shapes", type=_shape, nargs="+", metavar="NxK", help="weight shapes (default 4096x4096 "
                       "11008x4096)")
    group.add_argument("--tokens", type=int, nargs="+", metavar="M", help="rows of x (default 1 4 16 64 256)")
    group.add_argument("--linear-formats", nargs="+", metavar="FMT",
                       help="formats, presets or e.g. e4m3/128x128 (default e4m3 e2m1 nvfp4 e4m3/128x128)")
    group.add_argument("--llc-mib", type=float, help="last-level cache size for the model-sized pass (default: sysfs)")


def main(args, parser: argparse.ArgumentParser) -> int:
    if args.device != "cpu":
        parser.error("--linear measures the CPU op (the CUDA linear path is issue 14's); use --device cpu")
    shapes = args.shapes or ([(512, 512)] if args.quick else DEFAULT_SHAPES)
    tokens = args.tokens or ([1, 16] if args.quick else DEFAULT_TOKENS)
    if any(m < 1 for m in tokens):
        parser.error(f"--tokens {tokens}: each M must be >= 1")
    formats = args.linear_formats or DEFAULT_FORMATS
    for fmt in formats:
        try:
            _quantize(torch.zeros(2, 2), fmt)
        except (TypeError, ValueError) as exc:
            parser.error(f"--linear-formats {fmt}: {exc}")
    if args.llc_mib is not None and not args.llc_mib > 0:
        parser.error(f"--llc-mib must be > 0, got {args.llc_mib}")
    llc = None if args.llc_mib is None else int(args.llc_mib * MIB)
    if args.quick and llc is None:
        llc = 4 * MIB  # a smoke run: a few layers, not a model's worth
    results = run(shapes, tokens, formats, repeat=args.repeat, llc=llc)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "llc_mib": (llc or llc_bytes()) / MIB}
    report(env, format_table(results), results, args.json)
    return 0
