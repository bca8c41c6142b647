"""``ds-fpquant bench``: quantize / dequantize throughput, next to the baselines of the same run.

For bf16 input on one device, each available backend (the compiled op of the device and the torch
reference) is timed against what a user would otherwise write: torch composite ops (``abs().amax``,
divide, clamp, ``.to(float8)``), a bare ``x.to(torch.float8_e4m3fn)`` cast, and a plain ``copy_``
of the input (the bandwidth ceiling). Effective GB/s counts bytes read plus bytes written. Each
number is the median of repeated runs after a warm-up (CUDA events on a GPU). Ratios compare
numbers measured in this run only.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ds_fpquant.cli.bench import generate as bench_generate
from ds_fpquant.cli.bench import linear as bench_linear
from ds_fpquant.cli.common import make_timer, report, results_paths
from ds_fpquant.numerics.formats import FORMATS, FP8_DTYPES
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantize import dequantize, quantize

MIB = 2**20


DEFAULT_SIZES_MIB = (1, 4, 16, 64, 256)


QUICK_SIZES_MIB = (1, 16)


DEFAULT_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m1")


DEFAULT_GROUPS = (32, 128, 1024)


QUICK_GROUPS = (128,)


#: The torch reference keeps int64 intermediates; above this input size it is left out.
TORCH_BACKEND_MAX_MIB = 64


MAX_MIB = 64 * 1024  # inputs up to 64 GiB (the H200 holds about 139 GiB)


ROW = 4096  # elements per row of the benchmark tensors (a multiple of every group size above)


@dataclass
class Result:
    op: str  # "quantize" | "dequantize" | "copy" | "cast"
    impl: str  # backend name or baseline name
    fmt: str
    group_size: int
    size_mib: float
    ms: float
    gbps: float
    vs_composite: Optional[float] = None  # composite time / this time (speed-up)
    vs_cast: Optional[float] = None  # bare-cast time / this time
    vs_copy: Optional[float] = None  # this GB/s / copy GB/s (share of the bandwidth ceiling)


def composite_quantize(x: torch.Tensor, fmt: str, group_size: int):
    """What a user writes with torch ops: per-group amax, scale, divide, clamp, cast."""
    fmax = FORMATS[fmt].fmax
    groups = x.view(-1, group_size).float()
    scale = (groups.abs().amax(dim=1, keepdim=True) / fmax).clamp_min(2.0**-126)
    return (groups / scale).clamp(-fmax, fmax).to(FP8_DTYPES[fmt]), scale


def composite_dequantize(codes: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    return (codes.float() * scale).to(torch.bfloat16).view(shape)


def available_backends(device: torch.device) -> List[str]:
    names = ["torch"]
    if device.type in ("cpu", "cuda") and backends.load_op(device.type)[0] is not None:
        names.insert(0, device.type)
    return names


def run(device: torch.device, sizes_mib: Sequence[float], formats: Sequence[str], groups: Sequence[int],
        repeat: int = 7, warmup: int = 2, progress: bool = True) -> List[Result]:
    from tqdm.auto import tqdm

    measure = make_timer(device, repeat, warmup)
    impls = available_backends(device)
    results: List[Result] = []
    plan = [(size, fmt, g) for size in sizes_mib for fmt in formats for g in groups]
    bar = tqdm(total=len(plan), desc="bench", unit="case", disable=not progress)
    for size in sizes_mib:
        n = int(size * MIB) // 2 // ROW * ROW
        x = torch.randn(n // ROW, ROW, device=device).to(torch.bfloat16)
        out = torch.empty_like(x)
        t_copy = measure(lambda: out.copy_(x))
        copy_gbps = 4 * n / t_copy / 1e9
        results.append(Result("copy", "torch copy_", "-", 0, size, t_copy * 1e3, copy_gbps))
        cast_times: Dict[str, float] = {}
        for fmt in formats:
            if fmt in FP8_DTYPES:
                cast_times[fmt] = measure(lambda: x.to(FP8_DTYPES[fmt]))
                results.append(Result("cast", "torch .to(float8)", fmt, 0, size, cast_times[fmt] * 1e3,
                                      3 * n / cast_times[fmt] / 1e9, vs_copy=(3 * n / cast_times[fmt] / 1e9) / copy_gbps))
            bits = FORMATS[fmt].bits
            for g in groups:
                q_bytes = 2 * n + n * bits / 8 + 4 * n / g
                t_comp_q = t_comp_d = None
                if fmt in FP8_DTYPES and ROW % g == 0:  # composite ops need whole groups per row
                    t_comp_q = measure(lambda: composite_quantize(x, fmt, g))
                    codes, scale = composite_quantize(x, fmt, g)
                    t_comp_d = measure(lambda: composite_dequantize(codes, scale, x.shape))
                    results.append(Result("quantize", "torch composite", fmt, g, size, t_comp_q * 1e3,
                                          q_bytes / t_comp_q / 1e9, 1.0, cast_times[fmt] / t_comp_q,
                                          q_bytes / t_comp_q / 1e9 / copy_gbps))
                    results.append(Result("dequantize", "torch composite", fmt, g, size, t_comp_d * 1e3,
                                          q_bytes / t_comp_d / 1e9, 1.0, None, q_bytes / t_comp_d / 1e9 / copy_gbps))
                for impl in impls:
                    if impl == "torch" and size > TORCH_BACKEND_MAX_MIB:
                        continue
                    t_q = measure(lambda: quantize(x, fmt, g, backend=impl))
                    qt = quantize(x, fmt, g, backend=impl)
                    t_d = measure(lambda: dequantize(qt, backend=impl))
                    for op, t, t_comp in (("quantize", t_q, t_comp_q), ("dequantize", t_d, t_comp_d)):
                        gbps = q_bytes / t / 1e9
                        results.append(Result(op, impl, fmt, g, size, t * 1e3, gbps,
                                              t_comp / t if t_comp else None,
                                              cast_times[fmt] / t if op == "quantize" and fmt in cast_times else None,
                                              gbps / copy_gbps))
                bar.update()
        x = out = None  # freed before the next size's input
    bar.close()
    return results


def _ratio(v: Optional[float], pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if pct else f"{v:.2f}x"


def format_table(results: Sequence[Result]) -> str:
    lines = ["| op | impl | fmt | G | MiB | ms | GB/s | vs composite | vs bare cast | of copy GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.op} | {r.impl} | {r.fmt} | {r.group_size or '-'} | {r.size_mib:g} | {r.ms:.3f} | "
                     f"{r.gbps:.2f} | {_ratio(r.vs_composite)} | {_ratio(r.vs_cast)} | {_ratio(r.vs_copy, True)} |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "platform": platform.platform(), "processor": platform.processor() or platform.machine()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ds-fpquant bench", description="Quantize / dequantize throughput of "
                                     "each backend next to baselines measured in the same run.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES_MIB} MiB and G={QUICK_GROUPS}")
    parser.add_argument("--sizes", type=float, nargs="+", help="input sizes in MiB of bf16")
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(DEFAULT_FORMATS))
    parser.add_argument("--group-sizes", type=int, nargs="+", help="group sizes G")
    parser.add_argument("--repeat", type=int, help="timed runs per case, median reported (default 7; --generate: "
                        f"{bench_generate.DEFAULT_REPEAT})")
    parser.add_argument("--json", metavar="PATH", help="also write the results and environment as JSON")
    parser.add_argument("--results", metavar="NAME", help="also write the run as benchmarks/results/NAME.md (the "
                        "printed tables, the command, date, commit and machine) and NAME.json (every row), from the "
                        "repository root; a NAME with a folder in it is used as given; existing files are not "
                        "overwritten")
    bench_linear.add_arguments(parser)
    bench_generate.add_arguments(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.repeat is not None and args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.linear and args.generate:
        parser.error("--linear and --generate are two benches: give one")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: the folder does not exist")
    if args.results:
        taken = [p for p in results_paths(args.results) if os.path.exists(p)]
        if taken:
            parser.error(f"--results {args.results}: {' and '.join(taken)} already exist(s); choose another name")
        folder = os.path.dirname(os.path.abspath(results_paths(args.results)[0]))
        while not os.path.isdir(folder):  # the nearest folder that exists must take the new ones
            folder = os.path.dirname(folder)
        if not os.access(folder, os.W_OK):
            parser.error(f"--results {args.results}: cannot write under {folder}")
    args.command_line = "ds-fpquant bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.linear:
        return bench_linear.main(args, parser)
    if args.generate:
        return bench_generate.main(args, parser)
    sizes = args.sizes or (QUICK_SIZES_MIB if args.quick else DEFAULT_SIZES_MIB)
    groups = args.group_sizes or (QUICK_GROUPS if args.quick else DEFAULT_GROUPS)
    min_mib = 2 * ROW / MIB  # one row of bf16
    bad_sizes = [s for s in sizes if not (math.isfinite(s) and min_mib <= s <= MAX_MIB)]
    if bad_sizes:
        parser.error(f"--sizes {bad_sizes}: each size must be between {min_mib:g} and {MAX_MIB} MiB")
    if any(g < 1 for g in groups):
        parser.error(f"--group-sizes {list(groups)}: group sizes must be >= 1")
    results = run(device, sizes, args.formats, groups, repeat=args.repeat or 7)
    report(environment(device), format_table(results), results, args.json, args.results,
           f"ds-fpquant bench ({device.type})", args.command_line)
    return 0
