"""``ds-fpquant bench --linear``: the quantized linear layer against ``nn.Linear`` and torch's own weight-only
kernels, all in one run, each row next to the machine's roofline.

For each weight shape ``(N, K)``, token count ``M`` and format, activations ``x (M, K)`` go through
``nn.Linear`` in fp32 (fp32 ``x``) and in bf16 (bf16 ``x``), through the two torch peer kernels (:mod:`.peers`:
int8 per output channel by ``_weight_int8pack_mm``, int4 G=128 by ``_weight_int4pack_mm_for_cpu``, bf16 ``x``,
quantized from the same random weights; each one's output is checked against ``x @ dequant(W)^T`` before it is
timed) and through :func:`ds_fpquant.linear.linear` (the fused op, whichever kernel it takes for that ``M``) with
bf16 and with fp32 ``x`` (``x_dtypes``); with ``with_dequantize`` also through ``F.linear(x, dequantize(W, bf16))``
(dequantize + matmul, what ``FPQuantizedLinear`` did before the fused op). Two settings:

* cache-resident: one layer called again and again;
* model-sized: a pass over ``L`` distinct layers, ``L`` chosen per weight kind so that the pass reads at least
  ``llc_multiple`` (default 4) last-level caches of that kind's own weight bytes (codes + scales, or the bf16 /
  fp32 weight), as one forward of a real model reads them; time per layer.

The machine's two limits are measured in the same run (:mod:`.roofline`), at its start and again at its end (the
higher of the two counts: :func:`merge_limits`): the streaming read bandwidth (a float32 ``.sum()`` over a buffer
of several last-level caches) and the peak dot-product rate of each instruction the kernels multiply with
(register-only loops in the compiled op, on the bench's thread count). Each model-sized row reports
the GB/s of weight bytes it reads, its share of the read bandwidth, its roofline time
``max(weight bytes / bandwidth, 2 * M * N * K / peak)`` with the peak of the instruction it runs, and the share of
that time it reaches. A ``copy_`` of the bf16 weights (model-sized) is kept as the read + write figure. Ratios are
``bf16 nn.Linear ms / this ms`` within the same setting (above 1: faster than bf16); ``model_vs_fp32`` is the same
against fp32 ``nn.Linear`` (the fp32-``x`` summary's).

Repetition adapts to the cost of a case (:func:`time_case`): one warm-up call; then, for a case whose warm-up call
took at most :data:`SLOW_CALL_MS`, up to ``repeat`` resident calls within :data:`RESIDENT_SECONDS`, a warm-up pass
and up to ``repeat`` model-sized passes within :data:`CASE_SECONDS`; a slower case (compute-bound: large ``M``) gets
no resident calls and one pass, medians reported.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ds_fpquant.cli.bench import peers, roofline
from ds_fpquant.cli.common import median_ms, parse_scheme, ratio_text, report
from ds_fpquant.linear import linear
from ds_fpquant.ops import backends
from ds_fpquant.tensor.quantize import dequantize, quantize

MIB = 2**20


#: Llama-7B/13B's attention and MLP shapes (N x K: 4096x4096, 11008x4096 up/gate, 4096x11008 down), Llama-3-8B /
#: Mistral-7B's MLP (14336x4096, 4096x14336) and one expert of a fine-grained MoE (768x2048, Qwen3-30B-A3B's).
DEFAULT_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (768, 2048))


#: Rows of x: decoding one sequence (1), batched decoding (2 .. 64), prefill chunks (256, 1024).
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)


#: The most timed calls / passes per case when ``--repeat`` is not given.
DEFAULT_REPEAT = 7


#: Table formats: element format or preset, "/BrxBc" for 2-D blocks. ``mxfp4`` is the E8M0 row (e2m1, G=32,
#: power-of-two scales).
DEFAULT_FORMATS = ("e4m3", "e2m1", "mxfp4", "nvfp4", "e4m3/128x128")


#: dtypes of ``x`` for the fused rows (``nn.Linear`` has one of each: bf16 and fp32; the peers take bf16).
X_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


#: A case whose warm-up call takes longer (ms) is compute-bound (a 4096x4096 bf16 layer streams in ~1 ms): no
#: resident calls, and no warm-up pass before its passes.
SLOW_CALL_MS = 50.0


#: Seconds the resident calls of a fast case aim at (at least 1 call, at most ``repeat``).
RESIDENT_SECONDS = 0.2


#: Seconds the timed model-sized passes of a case aim at (at least 1 pass, at most ``repeat``).
CASE_SECONDS = 0.5


#: The issue's figure for the development machine, used when sysfs does not say.
FALLBACK_LLC_MIB = 260


#: Each weight kind's model-sized pass reads at least this many last-level caches of its own bytes.
DEFAULT_LLC_MULTIPLE = 4.0


#: The read-bandwidth buffer, in last-level caches (from :data:`MIN_READ_MIB` to :data:`MAX_READ_MIB`).
READ_LLC_MULTIPLE = 16


MIN_READ_MIB = 64


MAX_READ_MIB = 2048


#: Output columns of a peer kernel checked against ``x @ dequant(W)^T`` (every row of ``x``; the fp64 reference of
#: all of a 14336-row layer would cost more than timing it).
PEER_CHECK_ROWS = 256


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
    layers: int  # distinct layers in the model-sized pass of this row
    resident_ms: Optional[float]  # None: a slow (compute-bound) case, not timed resident
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
    #: multiply-adds of one call: M * N * K
    macs: int = 0
    #: the peak this row's roofline uses: its kind, what the row runs (roofline.row_peak), and its GFLOP/s
    peak: str = ""
    peak_gflops: Optional[float] = None
    #: max(weight_bytes / read bandwidth, 2 * macs / peak) in ms, and which term is larger ("memory" | "compute")
    roofline_ms: Optional[float] = None
    bound: str = ""
    #: roofline_ms / model_ms: the share of the roofline reached (1: at the limit)
    of_roofline: Optional[float] = None
    #: timed resident calls and model-sized passes of this case (the adaptive repetition)
    resident_calls: int = 0
    passes: int = 0


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


def cpu_steal_seconds(path: str = "/proc/stat") -> Optional[float]:
    """CPU seconds the hypervisor has taken from this machine's CPUs since boot (the ``steal`` column of
    ``/proc/stat``'s ``cpu`` line; 0 on bare metal), ``None`` where it is not known. Its growth over a run is time
    the run's threads were ready but not running."""
    try:
        with open(path) as fh:
            fields = fh.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
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



def time_case(call: Callable, layer_set: Sequence, repeat: int,
              check: Optional[Callable[[object], None]] = None) -> Tuple[Optional[float], float, int, int]:
    """``(resident ms or None, model-sized ms per layer, resident calls, passes)`` of ``call`` on ``layer_set[0]``
    again and again and on passes over ``layer_set``, repeated as the module doc says. ``check`` gets the output of
    the warm-up call before anything is timed (it raises to stop the bench)."""
    t0 = time.perf_counter()
    out = call(layer_set[0])  # the warm-up
    first = (time.perf_counter() - t0) * 1e3
    if check is not None:
        check(out)
    out = None
    slow = first > SLOW_CALL_MS
    resident, calls = None, 0
    if not slow:
        calls = max(1, min(repeat, int(RESIDENT_SECONDS * 1e3 / max(first, 1e-3))))
        resident = statistics.median(_times_ms(lambda: call(layer_set[0]), calls))
    pass_fn = lambda: [call(w) for w in layer_set]  # noqa: E731
    passes = max(1, min(repeat, int(CASE_SECONDS * 1e3 / ((resident or first) * len(layer_set)))))
    if not slow:
        pass_fn()
    return resident, statistics.median(_times_ms(pass_fn, passes)) / len(layer_set), calls, passes


@dataclass
class _WeightKind:
    """One kind of weight of a shape (fp32, bf16, a peer's, a format's): its layers (made one master at a time),
    the bytes one call reads, and how many layers its pass needs."""

    make: Callable[[torch.Tensor, int], object]
    layers: List[object] = field(default_factory=list)
    nbytes: int = 0
    count: int = 1


def layer_count(nbytes: int, llc: int, llc_multiple: float) -> int:
    """Distinct layers of ``nbytes`` each for a pass that reads at least ``llc_multiple`` last-level caches."""
    return max(1, math.ceil(llc_multiple * llc / max(nbytes, 1)))


#: Share of the memory available when a shape's weights are made that all its passes together may take.
MEMORY_SHARE = 0.5


def available_memory_bytes(path: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` of ``path`` in bytes, or ``None`` where the file or the field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def fit_layer_counts(counts: Dict[str, int], nbytes: Dict[str, int], budget: Optional[int]) -> Dict[str, int]:
    """The layer counts of one shape's kinds, each cut by the same factor (at least one layer each) where all the
    passes together (``sum(count * nbytes)``) would take more than ``budget`` bytes; unchanged when they fit or
    ``budget`` is ``None``. A VM that reports a host's huge last-level cache (480 MiB on a 24 GiB guest) would
    otherwise make passes that do not fit in memory."""
    total = sum(counts[name] * nbytes[name] for name in counts)
    if budget is None or total <= budget:
        return dict(counts)
    factor = budget / total
    return {name: max(1, math.floor(count * factor)) for name, count in counts.items()}


def _peer_maker(kind: str) -> Callable[[torch.Tensor, int], peers.PeerWeight]:
    make = peers.int8pack_weight if kind == "int8pack" else peers.int4pack_weight
    # the first layer keeps the first rows of its fp64 weight for the check before timing
    return lambda w, i: make(w, torch.bfloat16, keep_dequantized=(i == 0), keep_rows=PEER_CHECK_ROWS)


def _make_weights(n: int, k: int, formats: Sequence[str], with_peers: bool, llc: int, llc_multiple: float,
                  progress: bool, memory_budget: Optional[int] = None) -> Dict[str, _WeightKind]:
    """Every weight kind of one shape, each with the layers of its own model-sized pass; the masters are random
    ``N(0, 0.02^2)`` fp32 weights, made one at a time (the fp32 kind keeps as many as it needs). ``memory_budget``:
    bytes all the passes may take together (:func:`fit_layer_counts`)."""
    kinds: Dict[str, _WeightKind] = {"fp32": _WeightKind(lambda w, i: w), "bf16": _WeightKind(lambda w, i: w.bfloat16())}
    if with_peers:
        for kind in ("int8pack", "int4pack"):
            if kind == "int4pack" and (k % peers.INT4_GROUP or n % 16):
                if progress:
                    print(f"bench --linear: {n}x{k}: no {PEER_IMPLS[kind]} row (K a multiple of {peers.INT4_GROUP} "
                          "and N of 16 needed)", flush=True)
                continue
            kinds[kind] = _WeightKind(_peer_maker(kind))
    for fmt in formats:
        kinds[fmt] = _WeightKind(lambda w, i, fmt=fmt: _quantize(w, fmt))
    i = 0
    while i < max(kind.count for kind in kinds.values()):
        master = torch.randn(n, k) * 0.02
        for kind in kinds.values():
            if i < kind.count:
                kind.layers.append(kind.make(master, i))
                if i == 0:
                    kind.nbytes = weight_nbytes(kind.layers[0])
                    kind.count = layer_count(kind.nbytes, llc, llc_multiple)
        master = None
        if i == 0:
            wanted = {name: kind.count for name, kind in kinds.items()}
            fitted = fit_layer_counts(wanted, {name: kind.nbytes for name, kind in kinds.items()},
                                      memory_budget)
            if fitted != wanted and progress:
                print(f"bench --linear: {n}x{k}: layers per pass cut to fit {MEMORY_SHARE:.0%} of the available "
                      f"memory ({memory_budget / MIB:.0f} MiB): the passes read fewer than {llc_multiple:g} "
                      "last-level caches (--llc-mib / --llc-multiple set them)", flush=True)
            for name, kind in kinds.items():
                kind.count = fitted[name]
        i += 1
    return kinds


def weight_nbytes(weight) -> int:
    """Bytes one call reads of a weight: a tensor's, a peer weight's packed codes and scales, a QuantizedTensor's
    codes and scales (``.nbytes``)."""
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return int(weight.nbytes)


def _label(kind: str, weight, impl: str, x: str) -> Tuple[str, str]:
    """(fmt column, summary label) of a row."""
    if impl == "nn.Linear fp32":
        return "-", "fp32 F.linear"
    if impl == "nn.Linear bf16":
        return "-", "bf16 F.linear"
    if impl == "torch int8pack":
        return "int8 per channel", "torch int8pack"
    if impl == "torch int4pack":
        return f"int4 g{peers.INT4_GROUP}", f"torch int4pack g{peers.INT4_GROUP}"
    scheme = scheme_label(weight)
    if impl == "dequantize + matmul":
        return kind, f"dequantize + matmul {scheme}"
    return kind, f"ds_fpquant {scheme}" + ("" if x == "bf16" else f" ({x} x)")


def machine_limits(repeat: int, llc: int, read_bytes: Optional[int] = None, peak_seconds: float = roofline.PEAK_SECONDS,
                   peak_trials: int = roofline.PEAK_TRIALS):
    """``(read row, peaks, kernel facts)``: the streaming read bandwidth (:func:`read_bandwidth` over ``read_bytes``,
    default :data:`READ_LLC_MULTIPLE` last-level caches clamped to 64 MiB .. 2 GiB), the peak dot-product rates of
    the compiled op on torch's thread count (none without the op) and what decides each row's peak."""
    if read_bytes is None:
        read_bytes = min(max(READ_LLC_MULTIPLE * llc, MIN_READ_MIB * MIB), MAX_READ_MIB * MIB)
    read_ms, read_gbps = read_bandwidth(read_bytes, repeat)
    read = LinearResult(0, 0, 0, READ_IMPL, "-", 1, None, read_ms, label=READ_IMPL, weight_bytes=read_bytes,
                        model_gbps=read_gbps, of_read_bw=1.0, x="-")
    try:
        op = backends.load_op("cpu")[0]
    except ValueError:  # a build setting names no build: the rows say so when they run; no peaks
        op = None
    peaks = roofline.measure_peaks(op, torch.get_num_threads(), peak_seconds, peak_trials)
    return read, peaks, roofline.kernel_facts(op)


def merge_limits(first, second):
    """Two :func:`machine_limits` answers (the start and the end of a run) as one: the higher read bandwidth and, per
    kind, the higher peak (a limit is the best the machine does; a moment of other work only lowers a measurement)."""
    read = first[0] if first[0].model_gbps >= second[0].model_gbps else second[0]
    peaks = dict(first[1])
    for kind, peak in second[1].items():
        if peak.gflops is not None and (kind not in peaks or (peaks[kind].gflops or 0) < peak.gflops):
            peaks[kind] = peak
    return read, peaks, first[2]


def apply_limits(results: List[LinearResult], limits) -> None:
    """Put ``limits`` (a :func:`machine_limits` answer) into ``results`` in place: the read row (first) and every
    other row's share of the read bandwidth and roofline."""
    read, peaks, facts = limits
    results[0] = read
    for r in results[1:]:
        if r.model_gbps is not None:
            r.of_read_bw = r.model_gbps / read.model_gbps
        if r.m:
            add_roofline(r, read.model_gbps, facts, peaks)


def add_roofline(r: LinearResult, read_gbps: float, facts: roofline.KernelFacts, peaks: Dict[str, roofline.Peak]):
    """Fill ``r``'s peak, roofline time, bound and share of the roofline (a row with weights and MACs)."""
    r.peak, r.peak_gflops = roofline.row_peak(r.impl, r.x, facts, peaks)
    r.roofline_ms, r.bound = roofline.roofline_ms(r.weight_bytes, r.macs, read_gbps, r.peak_gflops)
    r.of_roofline = r.roofline_ms / r.model_ms


def run(shapes: Sequence[Tuple[int, int]], tokens: Sequence[int], formats: Sequence[str], repeat: int = 5,
        llc: Optional[int] = None, progress: bool = True, llc_multiple: float = DEFAULT_LLC_MULTIPLE,
        read_bytes: Optional[int] = None, with_peers: bool = True, x_dtypes: Sequence[str] = tuple(X_DTYPES),
        with_dequantize: bool = False, limits=None) -> List[LinearResult]:
    """The rows of the bench (the read-bandwidth row first); see the module doc. ``x_dtypes``: the dtypes of ``x``
    the fused rows run with (``"bf16"``, ``"fp32"``); ``limits``: :func:`machine_limits`' answer, measured here
    when not given.

    Raises:
        RuntimeError: a peer kernel's output is not ``x @ dequant(W)^T`` for its own quantization.
    """
    llc = llc_bytes() if llc is None else llc
    read, peaks, facts = machine_limits(repeat, llc, read_bytes) if limits is None else limits
    read_gbps = read.model_gbps
    results: List[LinearResult] = [read]
    torch.manual_seed(0)
    with torch.no_grad():
        warm_up_kernels(formats, x_dtypes, with_peers)
        for n, k in shapes:
            available = available_memory_bytes()
            budget = None if available is None else int(MEMORY_SHARE * available)
            kinds = _make_weights(n, k, formats, with_peers, llc, llc_multiple, progress, budget)
            bf16 = kinds["bf16"]
            copy_dst = [torch.empty_like(w) for w in bf16.layers]
            copy_ms = median_ms(lambda: [d.copy_(s) for d, s in zip(copy_dst, bf16.layers)], repeat) / bf16.count
            copy_gbps = bf16.nbytes / copy_ms / 1e6
            results.append(LinearResult(n, k, 0, COPY_IMPL, "-", bf16.count, None, copy_ms, label=COPY_IMPL,
                                        weight_bytes=bf16.nbytes, model_gbps=copy_gbps,
                                        of_read_bw=copy_gbps / read_gbps, x="-"))
            copy_dst = None  # freed before the layers are timed
            for m in tokens:
                if progress:
                    counts = ", ".join(f"{name} {kind.count}" for name, kind in kinds.items())
                    print(f"bench --linear: {n}x{k}, M={m} (layers per pass: {counts})", flush=True)
                x = torch.randn(m, k).bfloat16()
                xs = {name: x.to(dtype) for name, dtype in X_DTYPES.items()}
                # (impl, weight kind, x dtype, call, check of the warm-up output)
                calls: List[Tuple[str, str, str, Callable, Optional[Callable]]] = [
                    ("nn.Linear fp32", "fp32", "fp32", lambda w: F.linear(xs["fp32"], w), None),
                    ("nn.Linear bf16", "bf16", "bf16", lambda w: F.linear(x, w), None),
                ]
                checks: Dict[str, float] = {}
                for kind in ("int8pack", "int4pack"):
                    if kind in kinds:
                        calls.append((PEER_IMPLS[kind], kind, "bf16", lambda p: peers.peer_linear(x, p),
                                      _peer_check(kinds[kind].layers[0], x, checks, kind, n, k, m)))
                for fmt in formats:
                    if with_dequantize:
                        calls.append(("dequantize + matmul", fmt, "bf16",
                                      lambda qt: F.linear(x, dequantize(qt, torch.bfloat16)), None))
                    for xd in x_dtypes:
                        calls.append(("fused", fmt, xd, lambda qt, xx=xs[xd]: linear(xx, qt), None))
                rows = []
                for impl, kind_name, xd, call, check in calls:
                    kind = kinds[kind_name]
                    resident, model, res_calls, passes = time_case(call, kind.layers, repeat, check)
                    gbps = kind.nbytes / model / 1e6
                    fmt, label = _label(kind_name, kind.layers[0], impl, xd)
                    row = LinearResult(n, k, m, impl, fmt, kind.count, resident, model, label=label,
                                       weight_bytes=kind.nbytes, model_gbps=gbps, of_read_bw=gbps / read_gbps,
                                       peer_check=checks.get(kind_name), x=xd, macs=m * n * k,
                                       resident_calls=res_calls, passes=passes)
                    add_roofline(row, read_gbps, facts, peaks)
                    rows.append(row)
                base = next(r for r in rows if r.impl == "nn.Linear bf16")
                base32 = next(r for r in rows if r.impl == "nn.Linear fp32")
                for r in rows:
                    if base.resident_ms is not None and r.resident_ms is not None:
                        r.resident_vs_bf16 = base.resident_ms / r.resident_ms
                    r.model_vs_bf16 = base.model_ms / r.model_ms
                    r.model_vs_fp32 = base32.model_ms / r.model_ms
                results += rows
            kinds = None  # freed before the next shape's weights are made
    return results


def warm_up_kernels(formats: Sequence[str], x_dtypes: Sequence[str], with_peers: bool) -> None:
    """Every row's kernel once on a small layer (256 x 128, 4 rows of x), so that no first call of a process (a
    library's lazy setup) counts as a case's warm-up: that call decides whether a case is slow."""
    w = torch.randn(256, 128) * 0.02
    x = torch.randn(4, 128)
    F.linear(x, w)
    F.linear(x.bfloat16(), w.bfloat16())
    if with_peers:
        for make in (peers.int8pack_weight, peers.int4pack_weight):
            peers.peer_linear(x.bfloat16(), make(w))
    for fmt in formats:
        qt = _quantize(w, fmt)
        for xd in x_dtypes:
            linear(x.to(X_DTYPES[xd]), qt)


def _peer_check(p: peers.PeerWeight, x: torch.Tensor, checks: Dict[str, float], kind: str, n: int, k: int,
                m: int) -> Callable[[torch.Tensor], None]:
    """The check of a peer's warm-up output (:func:`peers.check_peer` on its first output columns); it records the
    share of the bound in ``checks[kind]``.

    Raises (when called):
        RuntimeError: the output is not ``x @ dequant(W)^T``.
    """
    def check(y):
        checks[kind] = peers.check_peer(x, p, y)
        if not checks[kind] <= 1:
            raise RuntimeError(f"{PEER_IMPLS[kind]} ({n}x{k}, M={m}) is not x @ dequant(W)^T: error "
                               f"{checks[kind]:.3g} times the bound")
    return check


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _gbps(v: Optional[float]) -> str:
    """GB/s with three significant digits (large-M rows read well under 1 GB/s)."""
    return "-" if v is None else f"{v:.3g}"


def format_table(results: Sequence[LinearResult]) -> str:
    """Every row: resident and model-sized ms with their ratios to bf16, the model-sized GB/s of weights read, the
    roofline time and the share of it reached, and the peak it uses."""
    lines = ["| N x K | M | impl | fmt | x | resident ms | vs bf16 | model-sized ms (per layer) | vs bf16 | weight MiB | "
             "GB/s | of read bw | roofline ms | bound | of roofline | peak (GFLOP/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        resident = "-" if r.resident_ms is None else f"{r.resident_ms:.3f}"
        m = "-" if r.m == 0 else str(r.m)
        shape = "-" if r.n == 0 else f"{r.n}x{r.k}"
        mib = "-" if r.weight_bytes is None else f"{r.weight_bytes / MIB:.2f}"
        gbps = _gbps(r.model_gbps)
        layers = "" if r.impl == READ_IMPL else f" ({r.layers} layers)"
        roof = "-" if r.roofline_ms is None else f"{r.roofline_ms:.3f}"
        peak = "-" if not r.peak else (r.peak.split(" (")[0] + ("" if r.peak_gflops is None else
                                                               f" ({r.peak_gflops:.0f})"))
        lines.append(f"| {shape} | {m} | {r.impl} | {r.fmt} | {r.x} | {resident} | {ratio_text(r.resident_vs_bf16)} | "
                     f"{r.model_ms:.3f}{layers} | {ratio_text(r.model_vs_bf16)} | {mib} | {gbps} | {_pct(r.of_read_bw)} | "
                     f"{roof} | {r.bound or '-'} | {_pct(r.of_roofline)} | {peak} |")
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


def limits_text(results: Sequence[LinearResult], peaks_env: Optional[Dict[str, object]] = None) -> str:
    """One line naming the run's read bandwidth and peak rates (what every roofline share is measured against)."""
    read = next((r for r in results if r.impl == READ_IMPL), None)
    parts = [] if read is None else [f"read bandwidth {read.model_gbps:.1f} GB/s (fp32 sum over "
                                     f"{read.weight_bytes / MIB:.0f} MiB)"]
    gflops = (peaks_env or {}).get("peak_gflops", {})
    instructions = (peaks_env or {}).get("peak_instructions", {})
    parts += [f"{instructions.get(kind, kind)} {value:.1f} GFLOP/s" for kind, value in gflops.items()]
    return "Roofline of this run: " + ("; ".join(parts) or "none measured") + (
        "; each row's roofline is max(weight bytes / bandwidth, 2 M N K / the peak of the instruction it runs).")


def format_summary(results: Sequence[LinearResult]) -> str:
    """Per weight shape, the model-sized tables for bf16 ``x``: ms per layer with, in brackets, the ratio to bf16
    ``F.linear``, the share of the row's roofline reached and the GB/s of weight bytes read (the README table), and
    the GB/s with the share of the run's read bandwidth; then, where the run has fused rows with fp32 ``x``, their
    ms with the ratio to fp32 ``F.linear`` and the roofline share."""
    read = next((r for r in results if r.impl == READ_IMPL), None)
    out = []
    for n, k in dict.fromkeys((r.n, r.k) for r in results if r.m):
        shape_rows = [r for r in results if (r.n, r.k) == (n, k) and r.m]
        rows = [r for r in shape_rows if r.impl in SUMMARY_IMPLS and r.x == "bf16"]
        columns = list(dict.fromkeys(r.label for r in rows))
        mib = {r.label: r.weight_bytes / MIB for r in rows}
        layers = {r.label: r.layers for r in rows}
        passes = ", ".join(f"{c} {layers[c]}" for c in columns)
        out += _titled_table(f"{n}x{k}, bf16 x, model-sized (distinct layers per pass: {passes}); ms per layer (ratio "
                             "to bf16 F.linear, share of the roofline, GB/s of weight bytes); weight MiB per layer in "
                             "the header", columns, [f"{c} ({mib[c]:.2f} MiB)" for c in columns], rows,
                             lambda r: f"{r.model_ms:.3f} ({ratio_text(r.model_vs_bf16)}, {_pct(r.of_roofline)}, "
                                       f"{_gbps(r.model_gbps)} GB/s)")
        read_text = "" if read is None else (f": {read.model_gbps:.1f} GB/s, fp32 sum over "
                                             f"{read.weight_bytes / MIB:.0f} MiB")
        out += _titled_table(f"{n}x{k}, bf16 x, GB/s of weight bytes read (share of the read bandwidth{read_text})",
                             columns, columns, rows, lambda r: f"{_gbps(r.model_gbps)} ({_pct(r.of_read_bw)})")
        rows32 = [r for r in shape_rows if r.x == "fp32" and r.impl in ("nn.Linear fp32", "fused")]
        if any(r.impl == "fused" for r in rows32):
            columns = list(dict.fromkeys(r.label for r in rows32))
            out += _titled_table(f"{n}x{k}, fp32 x, model-sized as above; ms per layer (ratio to fp32 F.linear, the "
                                 "fp32 weight; share of the roofline)", columns, columns, rows32,
                                 lambda r: f"{r.model_ms:.3f} ({ratio_text(r.model_vs_fp32)}, {_pct(r.of_roofline)})")
    return "\n".join(out).rstrip("\n")


def format_peaks(results: Sequence[LinearResult]) -> str:
    """Which peak each kind of row's roofline uses, and why (one line per distinct impl and x)."""
    seen = dict.fromkeys((r.impl, r.x, r.peak, r.peak_gflops) for r in results if r.m)
    lines = ["| impl | x | peak of its roofline (what it runs) | GFLOP/s |", "|---|---|---|---|"]
    for impl, x, peak, gflops in seen:
        lines.append(f"| {impl} | {x} | {peak} | {'-' if gflops is None else f'{gflops:.1f}'} |")
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
    group.add_argument("--shapes", type=_shape, nargs="+", metavar="NxK", help="weight shapes (default "
                       + " ".join(f"{n}x{k}" for n, k in DEFAULT_SHAPES) + ")")
    group.add_argument("--tokens", type=int, nargs="+", metavar="M",
                       help="rows of x (default " + " ".join(str(m) for m in DEFAULT_TOKENS) + ")")
    group.add_argument("--linear-formats", nargs="+", metavar="FMT",
                       help=f"formats, presets or e.g. e4m3/128x128 (default {' '.join(DEFAULT_FORMATS)})")
    group.add_argument("--x-dtypes", nargs="+", choices=list(X_DTYPES), metavar="DTYPE",
                       help="dtypes of x for the fused rows (default bf16 fp32)")
    group.add_argument("--llc-mib", type=float, help="last-level cache size for the model-sized pass (default: sysfs)")
    group.add_argument("--llc-multiple", type=float, default=DEFAULT_LLC_MULTIPLE,
                       help="each row's model-sized pass reads at least this many last-level caches of its own "
                            f"weight bytes (default {DEFAULT_LLC_MULTIPLE:g})")
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
    steal0 = cpu_steal_seconds()
    peak_args = (0.05, 1) if args.quick else ()
    start = machine_limits(repeat, llc, read_bytes, *peak_args)
    results = run(shapes, tokens, formats, repeat=repeat, llc=llc, llc_multiple=args.llc_multiple,
                  with_peers=not args.no_peers, x_dtypes=x_dtypes, with_dequantize=args.with_dequantize, limits=start)
    end = machine_limits(repeat, llc, read_bytes, *peak_args)  # again: the better of the two is the limit
    limits = merge_limits(start, end)
    apply_limits(results, limits)
    read, peaks, facts = limits
    machine_llc = llc_bytes() / MIB
    peaks_env = roofline.peaks_environment(peaks)
    peaks_env["peak_gflops_start_end"] = {
        kind: [None if x.get(kind) is None or x[kind].gflops is None else round(x[kind].gflops, 1)
               for x in (start[1], end[1])]
        for kind in peaks}
    steal = None if steal0 is None or cpu_steal_seconds() is None else round(cpu_steal_seconds() - steal0, 1)
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_name(), "cores": cpu_cores(),
           "cpu_features": roofline.features_text(facts.flags), "torch_cpu_capability": facts.torch_capability,
           "mkldnn_bf16": facts.mkldnn_bf16, "op_cpu_paths": " ".join(facts.op_paths) or "none (portable loops)",
           "machine_llc_mib": machine_llc, "llc_mib": llc / MIB, "llc_multiple": args.llc_multiple,
           "read_gbps": round(read.model_gbps, 2),
           "read_gbps_start_end": [round(start[0].model_gbps, 2), round(end[0].model_gbps, 2)],
           "read_mib": read.weight_bytes / MIB, **peaks_env, "repeat": repeat,
           "run_s": round(time.perf_counter() - t0, 1), "steal_s": steal, "load_average": load_average()}
    text = (limits_text(results, peaks_env) + "\n\n" + format_summary(results) + "\n\nThe peak each row's roofline "
            "uses:\n\n" + format_peaks(results) + "\n\nEvery row:\n\n" + format_table(results))
    report(env, text, results, args.json, getattr(args, "results", None),
           f"ds-fpquant bench --linear, {cpu_name()}, {cpu_cores()} cores, {machine_llc:g} MiB last-level cache",
           getattr(args, "command_line", None))
    return 0
