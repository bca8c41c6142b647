"""``ds-fpquant bench --linear``: the quantized linear layer against ``nn.Linear`` and torch's own weight-only
kernels, all in one run.

For each weight shape ``(N, K)``, token count ``M`` and format, activations ``x (M, K)`` go through
``nn.Linear`` in fp32 (fp32 ``x``) and in bf16 (bf16 ``x``), through the two torch peer kernels (:mod:`.peers`:
int8 per output channel by ``_weight_int8pack_mm``, int4 G=128 by ``_weight_int4pack_mm_for_cpu``, bf16 ``x``,
quantized from the same random weights and checked against ``x @ dequant(W)^T`` before they are timed) and
through :func:`ds_fpquant.linear.linear` (the fused op) with bf16 and with fp32 ``x`` (``x_dtypes``); with
``with_dequantize`` also through ``F.linear(x, dequantize(W, bf16))`` (dequantize + matmul, what
``FPQuantizedLinear`` did before the fused op). Two settings:

* cache-resident: one layer called again and again (its weights stay in the last-level cache);
* model-sized: a pass over ``L`` distinct layers whose bf16 weights add up to at least ``llc_multiple``
  (default 8) times the last-level cache, as one decode step of a real model reads them, so that even the
  4-bit weights of the pass exceed the cache twice; time per layer.

The streaming read bandwidth of this run is a float32 ``.sum()`` over a buffer of several times the
last-level cache; each model-sized row reports the GB/s of weight bytes it reads (codes + scales, or the
bf16 / fp32 weight) and the share of that bandwidth. A ``copy_`` of one layer's bf16 weights (model-sized)
is kept as the read + write figure. Ratios are ``bf16 nn.Linear ms / this ms`` within the same setting (above
1: faster than bf16); ``model_vs_fp32`` is the same against fp32 ``nn.Linear`` (the fp32-``x`` summary's).

A case is timed ``repeat`` times after a warm-up call, the model-sized pass ``max(3, repeat // 2)`` times after a
warm-up pass; a case whose warm-up call takes more than :data:`SLOW_CALL_MS` (the large-M rows, compute-bound
and steady, most of a full run's time) is timed :data:`SLOW_REPEAT` times and its passes get no warm-up of their
own (the resident calls just ran the same code).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ds_fpquant.cli.bench import peers
from ds_fpquant.cli.common import median_ms, parse_scheme, ratio_text, report
from ds_fpquant.linear import linear
from ds_fpquant.tensor.quantize import dequantize, quantize

MIB = 2**20


DEFAULT_SHAPES = ((4096, 4096), (11008, 4096))


DEFAULT_TOKENS = (1, 4, 16, 64, 256)


#: Timed runs per case when ``--repeat`` is not given.
DEFAULT_REPEAT = 7


#: Table formats: element format or preset, "/BrxBc" for 2-D blocks. ``mxfp4`` is the E8M0 row (e2m1, G=32,
#: power-of-two scales).
DEFAULT_FORMATS = ("e4m3", "e2m1", "mxfp4", "nvfp4", "e4m3/128x128")


#: dtypes of ``x`` for the fused rows (``nn.Linear`` has one of each: bf16 and fp32; the peers take bf16).
X_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


#: A case whose warm-up call takes longer (ms) is timed :data:`SLOW_REPEAT` times instead of ``repeat``.
SLOW_CALL_MS = 50.0


SLOW_REPEAT = 3


#: The issue's figure for the development machine, used when sysfs does not say.
FALLBACK_LLC_MIB = 260


#: bf16 weights of the model-sized pass, in last-level caches: 8 makes the 4-bit rows read 2x the cache.
DEFAULT_LLC_MULTIPLE = 8.0


#: The read-bandwidth buffer, in last-level caches (from :data:`MIN_READ_MIB` to :data:`MAX_READ_MIB`).
READ_LLC_MULTIPLE = 16


MIN_READ_MIB = 64


MAX_READ_MIB = 2048


READ_IMPL = "read bandwidth (fp32 sum)"


COPY_IMPL = "copy_ bf16 weights"


PEER_IMPLS = {"int8pack": "torch int8pack", "int4pack": "torch int4pack"}


@dataclass
class LinearResult:
    n: int
    k: int
    m: int
    #: "nn.Linear fp32" | "nn.Linear bf16" | "torch int8pack" | "torch int4pack" | "dequantize + matmul" | "fused"
    #: | "copy_ bf16 weights" | "read bandwidth (fp32 sum)"
    impl: str
    fmt: str
    layers: int  # distinct layers in the model-sized pass
    resident_ms: Optional[float]
    model_ms: float
    resident_vs_bf16: Optional[float] = None
    model_vs_bf16: Optional[float] = None
    #: the column name of the summary table ("bf16 F.linear", "torch int4pack g128", "ds_fpquant e4m3 g128", ...)
    label: str = ""
    #: bytes of weights one call reads: codes + scales (+ zeros), or the bf16 / fp32 weight; the read row: its buffer
    weight_bytes: Optional[int] = None
    #: weight_bytes / model_ms: GB/s (1e9 bytes) of weights read in the model-sized pass
    model_gbps: Optional[float] = None
    #: model_gbps / the read bandwidth of the same run
    of_read_bw: Optional[float] = None
    #: the peer rows: max |y - x @ dequant(W)^T| as a share of the bound of peers.check_peer (<= 1 to be timed)
    peer_check: Optional[float] = None
    #: dtype of x: "bf16" | "fp32" ("-": the read-bandwidth and copy rows)
    x: str = "bf16"
    #: fp32 nn.Linear's model-sized ms / this one's (the fp32-x summary's ratio)
    model_vs_fp32: Optional[float] = None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """CPUs this process may run on (its affinity; ``os.cpu_count()`` where that is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> Optional[str]:
    """The 1/5/15-minute load averages when the run ends (a shared machine's other work shows here)."""
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return None


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


def scheme_label(qt) -> str:
    """``"e4m3 g128"``, ``"nvfp4 g16"``, ``"e4m3 128x128"``: a quantized weight's format and scaling."""
    if qt.block is not None:
        return f"{qt.fmt} {qt.block[0]}x{qt.block[1]}"
    return f"{qt.fmt} g{qt.group_size}"


def read_bandwidth(nbytes: int, repeat: int) -> Tuple[float, float]:
    """``(ms, GB/s)`` of a float32 ``.sum()`` over a buffer of ``nbytes`` (pages touched before timing): the
    streaming read bandwidth the model-sized rows are compared with."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    ms = median_ms(lambda: buf.sum(), repeat)
    return ms, buf.numel() * 4 / ms / 1e6


def _times_ms(fn: Callable[[], object], n: int) -> List[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_case(call: Callable, layer_set: Sequence, repeat: int) -> Tuple[float, float]:
    """``(resident ms, model-sized ms per layer)`` of ``call`` on ``layer_set[0]`` again and again and on a pass over
    ``layer_set``; the repeats as the module doc says."""
    first = _times_ms(lambda: call(layer_set[0]), 1)[0]  # the warm-up
    slow = first > SLOW_CALL_MS
    reps = min(repeat, SLOW_REPEAT) if slow else repeat
    resident = statistics.median(_times_ms(lambda: call(layer_set[0]), reps))
    passes = min(reps, max(SLOW_REPEAT, repeat // 2))
    pass_fn = lambda: [call(w) for w in layer_set]  # noqa: E731
    if not slow:
        pass_fn()
    return resident, statistics.median(_times_ms(pass_fn, passes)) / len(layer_set)


def _peer_weights(kind: str, masters: Sequence[torch.Tensor]) -> Optional[List[peers.PeerWeight]]:
    make = peers.int8pack_weight if kind == "int8pack" else peers.int4pack_weight
    try:  # the first layer keeps its fp64 weight for the check before timing
        return [make(w, torch.bfloat16, keep_dequantized=(i == 0)) for i, w in enumerate(masters)]
    except ValueError:  # int4pack: K not a multiple of 128 or N not of 16
        return None


def run(shapes: Sequence[Tuple[int, int]], tokens: Sequence[int], formats: Sequence[str], repeat: int = 5,
        llc: Optional[int] = None, progress: bool = True, llc_multiple: float = DEFAULT_LLC_MULTIPLE,
        read_bytes: Optional[int] = None, with_peers: bool = True, x_dtypes: Sequence[str] = tuple(X_DTYPES),
        with_dequantize: bool = False) -> List[LinearResult]:
    """The rows of the bench (the read-bandwidth row first); see the module doc. ``x_dtypes``: the dtypes of ``x``
    the fused rows run with (``"bf16"``, ``"fp32"``).

    Raises:
        RuntimeError: a peer kernel's output is not ``x @ dequant(W)^T`` for its own quantization.
    """
    llc = llc_bytes() if llc is None else llc
    if read_bytes is None:
        read_bytes = min(max(READ_LLC_MULTIPLE * llc, MIN_READ_MIB * MIB), MAX_READ_MIB * MIB)
    read_ms, read_gbps = read_bandwidth(read_bytes, repeat)
    results: List[LinearResult] = [LinearResult(0, 0, 0, READ_IMPL, "-", 1, None, read_ms, label=READ_IMPL,
                                                weight_bytes=read_bytes, model_gbps=read_gbps, of_read_bw=1.0, x="-")]
    torch.manual_seed(0)
    with torch.no_grad():
        for n, k in shapes:
            layers = max(1, math.ceil(llc_multiple * llc / (2 * n * k)))
            masters = [torch.randn(n, k) * 0.02 for _ in range(layers)]
            bf16_weights = [w.bfloat16() for w in masters]
            # (impl, fmt, x) -> bytes of weight one call reads, summary column name
            nbytes: Dict[Tuple[str, str, str], int] = {("nn.Linear fp32", "-", "fp32"): 4 * n * k,
                                                       ("nn.Linear bf16", "-", "bf16"): 2 * n * k}
            labels: Dict[Tuple[str, str, str], str] = {("nn.Linear fp32", "-", "fp32"): "fp32 F.linear",
                                                       ("nn.Linear bf16", "-", "bf16"): "bf16 F.linear"}
            peer_sets: Dict[Tuple[str, str, str], List[peers.PeerWeight]] = {}  # one per layer
            if with_peers:
                for kind in ("int8pack", "int4pack"):
                    made = _peer_weights(kind, masters)
                    if made is None:
                        if progress:
                            print(f"bench --linear: {n}x{k}: no {PEER_IMPLS[kind]} row (K a multiple of "
                                  f"{peers.INT4_GROUP} and N of 16 needed)", flush=True)
                        continue
                    key = (PEER_IMPLS[kind], "int8 per channel" if kind == "int8pack" else f"int4 g{peers.INT4_GROUP}",
                           "bf16")
                    peer_sets[key] = made
                    nbytes[key] = made[0].nbytes
                    labels[key] = "torch int8pack" if kind == "int8pack" else f"torch int4pack g{peers.INT4_GROUP}"
            quantized = {fmt: [_quantize(w, fmt) for w in masters] for fmt in formats}
            for fmt, qts in quantized.items():
                scheme = scheme_label(qts[0])
                for xd in x_dtypes:
                    nbytes[("fused", fmt, xd)] = qts[0].nbytes
                    labels[("fused", fmt, xd)] = f"ds_fpquant {scheme}" + ("" if xd == "bf16" else f" ({xd} x)")
                if with_dequantize:
                    nbytes[("dequantize + matmul", fmt, "bf16")] = qts[0].nbytes
                    labels[("dequantize + matmul", fmt, "bf16")] = f"dequantize + matmul {scheme}"
            copy_dst = [torch.empty_like(w) for w in bf16_weights]
            copy_ms = median_ms(lambda: [d.copy_(s) for d, s in zip(copy_dst, bf16_weights)], repeat) / layers
            copy_gbps = 2 * n * k / copy_ms / 1e6
            results.append(LinearResult(n, k, 0, COPY_IMPL, "-", layers, None, copy_ms, label=COPY_IMPL,
                                        weight_bytes=2 * n * k, model_gbps=copy_gbps, of_read_bw=copy_gbps / read_gbps,
                                        x="-"))
            copy_dst = None  # freed before the layers are timed
            for m in tokens:
                if progress:
                    print(f"bench --linear: {n}x{k}, M={m}, {layers} layers", flush=True)
                x = torch.randn(m, k).bfloat16()
                xs = {name: x.to(dtype) for name, dtype in X_DTYPES.items()}
                calls: List[Tuple[Tuple[str, str, str], Callable, list]] = [
                    (("nn.Linear fp32", "-", "fp32"), lambda w: F.linear(xs["fp32"], w), masters),
                    (("nn.Linear bf16", "-", "bf16"), lambda w: F.linear(x, w), bf16_weights),
                ]
                checks: Dict[Tuple[str, str, str], float] = {}
                for key, made in peer_sets.items():  # checked before it is timed
                    checks[key] = peers.check_peer(x, made[0])
                    if not checks[key] <= 1:
                        raise RuntimeError(f"{key[0]} ({n}x{k}, M={m}) is not x @ dequant(W)^T: error "
                                           f"{checks[key]:.3g} times the bound")
                    calls.append((key, lambda p: peers.peer_linear(x, p), made))
                for fmt in formats:
                    if with_dequantize:
                        calls.append((("dequantize + matmul", fmt, "bf16"),
                                      lambda qt: F.linear(x, dequantize(qt, torch.bfloat16)), quantized[fmt]))
                    for xd in x_dtypes:
                        calls.append((("fused", fmt, xd), lambda qt, xx=xs[xd]: linear(xx, qt), quantized[fmt]))
                rows = []
                for key, call, layer_set in calls:
                    resident, model = time_case(call, layer_set, repeat)
                    gbps = nbytes[key] / model / 1e6
                    rows.append(LinearResult(n, k, m, key[0], key[1], layers, resident, model, label=labels[key],
                                             weight_bytes=nbytes[key], model_gbps=gbps, of_read_bw=gbps / read_gbps,
                                             peer_check=checks.get(key), x=key[2]))
                base = next(r for r in rows if r.impl == "nn.Linear bf16")
                base32 = next(r for r in rows if r.impl == "nn.Linear fp32")
                for r in rows:
                    r.resident_vs_bf16 = base.resident_ms / r.resident_ms
                    r.model_vs_bf16 = base.model_ms / r.model_ms
                    r.model_vs_fp32 = base32.model_ms / r.model_ms
                results += rows
            for made in peer_sets.values():
                made[0].dequantized = None
    return results


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def format_table(results: Sequence[LinearResult]) -> str:
    """Every row: resident and model-sized ms with their ratios to bf16, and the model-sized GB/s of weights read."""
    lines = ["| N x K | M | impl | fmt | x | resident ms | vs bf16 | model-sized ms (per layer) | vs bf16 | weight MiB | "
             "GB/s | of read bw |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        resident = "-" if r.resident_ms is None else f"{r.resident_ms:.3f}"
        m = "-" if r.m == 0 else str(r.m)
        shape = "-" if r.n == 0 else f"{r.n}x{r.k}"
        mib = "-" if r.weight_bytes is None else f"{r.weight_bytes / MIB:.2f}"
        gbps = "-" if r.model_gbps is None else f"{r.model_gbps:.1f}"
        layers = "" if r.impl == READ_IMPL else f" ({r.layers} layers)"
        lines.append(f"| {shape} | {m} | {r.impl} | {r.fmt} | {r.x} | {resident} | {ratio_text(r.resident_vs_bf16)} | "
                     f"{r.model_ms:.3f}{layers} | {ratio_text(r.model_vs_bf16)} | {mib} | {gbps} | {_pct(r.of_read_bw)} |")
    return "\n".join(lines)


#: The summary's columns: bf16, the peers, then the fused rows (dequantize + matmul: the full table only).
SUMMARY_IMPLS = ("nn.Linear bf16", "torch int8pack", "torch int4pack", "fused")


def _titled_table(title: str, columns, headers, rows, cell) -> List[str]:
    """A title line, a blank line (markdown wants one before a table), the M x columns grid, a blank line."""
    return [title, "", "| M | " + " | ".join(headers) + " |", "|---|" + "---|" * len(headers),
            *_grid(rows, columns, cell), ""]


def _grid(rows: Sequence[LinearResult], columns: Sequence[str], text: Callable[[LinearResult], str]) -> List[str]:
    cell = {(r.m, r.label): r for r in rows}
    out = []
    for m in dict.fromkeys(r.m for r in rows):
        out.append(f"| {m} | " + " | ".join(text(cell[m, c]) if (m, c) in cell else "-" for c in columns) + " |")
    return out


def format_summary(results: Sequence[LinearResult]) -> str:
    """Per weight shape, the issue's two model-sized tables for bf16 ``x``: ms per layer with the ratio to bf16
    ``F.linear`` in brackets, and the GB/s of weight bytes read with the share of the run's read bandwidth; then,
    where the run has fused rows with fp32 ``x``, their ms with the ratio to fp32 ``F.linear``."""
    read = next((r for r in results if r.impl == READ_IMPL), None)
    out = []
    for n, k in dict.fromkeys((r.n, r.k) for r in results if r.m):
        shape_rows = [r for r in results if (r.n, r.k) == (n, k) and r.m]
        rows = [r for r in shape_rows if r.impl in SUMMARY_IMPLS and r.x == "bf16"]
        columns = list(dict.fromkeys(r.label for r in rows))
        layers = shape_rows[0].layers
        bf16_mib = 2 * n * k * layers / MIB
        out += _titled_table(f"{n}x{k}, bf16 x, model-sized: {layers} distinct layers per pass ({bf16_mib:.0f} MiB "
                             "of bf16 weights); ms per layer (ratio to bf16 F.linear)", columns, columns, rows,
                             lambda r: f"{r.model_ms:.3f} ({ratio_text(r.model_vs_bf16)})")
        read_text = "" if read is None else (f": {read.model_gbps:.1f} GB/s, fp32 sum over "
                                             f"{read.weight_bytes / MIB:.0f} MiB")
        mib = {r.label: r.weight_bytes / MIB for r in rows}
        out += _titled_table(f"{n}x{k}, bf16 x, GB/s of weight bytes read (share of the read bandwidth{read_text}); "
                             "weight MiB per layer in the header", columns,
                             [f"{c} ({mib[c]:.2f} MiB)" for c in columns], rows,
                             lambda r: f"{r.model_gbps:.1f} ({_pct(r.of_read_bw)})")
        rows32 = [r for r in shape_rows if r.x == "fp32" and r.impl in ("nn.Linear fp32", "fused")]
        if any(r.impl == "fused" for r in rows32):
            columns = list(dict.fromkeys(r.label for r in rows32))
            out += _titled_table(f"{n}x{k}, fp32 x, model-sized as above; ms per layer (ratio to fp32 F.linear, the "
                                 "fp32 weight)", columns, columns, rows32,
                                 lambda r: f"{r.model_ms:.3f} ({ratio_text(r.model_vs_fp32)})")
    return "\n".join(out).rstrip("\n")


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
                       help=f"formats, presets or e.g. e4m3/128x128 (default {' '.join(DEFAULT_FORMATS)})")
    group.add_argument("--x-dtypes", nargs="+", choices=list(X_DTYPES), metavar="DTYPE",
                       help="dtypes of x for the fused rows (default bf16 fp32)")
    group.add_argument("--llc-mib", type=float, help="last-level cache size for the model-sized pass (default: sysfs)")
    group.add_argument("--llc-multiple", type=float, default=DEFAULT_LLC_MULTIPLE,
                       help="bf16 weights of the model-sized pass in last-level caches (default "
                            f"{DEFAULT_LLC_MULTIPLE:g}: the 4-bit rows then still read twice the cache)")
    group.add_argument("--read-mib", type=float, help="buffer of the read-bandwidth sum (default "
                       f"{READ_LLC_MULTIPLE}x the last-level cache, {MIN_READ_MIB} to {MAX_READ_MIB} MiB)")
    group.add_argument("--no-peers", action="store_true", help="leave out the torch int8pack / int4pack rows")
    group.add_argument("--with-dequantize", action="store_true",
                       help="add the dequantize + matmul rows (F.linear(x, dequantize(W, bf16)), bf16 x)")


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
    for name in ("llc_mib", "read_mib", "llc_multiple"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    llc = None if args.llc_mib is None else int(args.llc_mib * MIB)
    if args.quick and llc is None:
        llc = MIB  # a smoke run: a few layers, not a model's worth
    llc = llc or llc_bytes()
    read_bytes = None if args.read_mib is None else int(args.read_mib * MIB)
    repeat = args.repeat or DEFAULT_REPEAT
    x_dtypes = list(dict.fromkeys(args.x_dtypes or X_DTYPES))
    t0 = time.perf_counter()
    results = run(shapes, tokens, formats, repeat=repeat, llc=llc, llc_multiple=args.llc_multiple,
                  read_bytes=read_bytes, with_peers=not args.no_peers, x_dtypes=x_dtypes,
                  with_dequantize=args.with_dequantize)
    read = results[0]
    machine_llc = llc_bytes() / MIB
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(), "cores": cpu_cores(),
           "machine_llc_mib": machine_llc, "llc_mib": llc / MIB, "llc_multiple": args.llc_multiple, "read_gbps": round(read.model_gbps, 2),
           "read_mib": read.weight_bytes / MIB, "repeat": repeat, "run_s": round(time.perf_counter() - t0, 1),
           "load_average": load_average()}
    report(env, format_summary(results) + "\n\nEvery row:\n\n" + format_table(results), results, args.json,
           getattr(args, "results", None), f"ds-fpquant bench --linear, {cpu_name()}, {cpu_cores()} cores, "
           f"{machine_llc:g} MiB last-level cache", getattr(args, "command_line", None))
    return 0
