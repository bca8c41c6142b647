"""The roofline of ``ds-fpquant bench --linear``: the machine's two limits, measured in the same run as the rows,
and the time no linear can beat.

* **Read bandwidth** (GB/s, 1e9 bytes/s): a float32 ``.sum()`` over a buffer of several last-level caches
  (:func:`ds_fpquant.cli.bench.linear.read_bandwidth`).
* **Peak dot-product rate** (GFLOP/s, 1e9 floating-point operations per second, a multiply-add counted as 2) of
  each instruction the kernels multiply with: register-only loops in the compiled CPU op
  (``csrc/fp_quantizer/fp_peak_cpu.cpp``, ``dot_peak_gflops``) on the bench's thread count. The kinds
  (:data:`PEAK_KINDS`): ``fp32_fma_ymm`` (AVX2 ``vfmadd231ps ymm``, every x86-64 CPU with AVX2 + FMA),
  ``fp32_fma_zmm`` (``vfmadd231ps zmm``), ``bf16_dot_zmm`` (AVX-512 BF16 ``vdpbf16ps zmm``) and ``amx_bf16``
  (AMX ``tdpbf16ps``); the last three only where the op is built for a CPU that has them (and, for AMX, Linux
  grants the process the tile-data permission).

A row's roofline time is ``max(weight bytes / bandwidth, 2 * M * N * K / peak)``: reading its weights once at the
streaming bandwidth, or doing its multiply-adds at the peak of the instruction it runs (:func:`row_peak`), whichever
is longer. Its share of the roofline is ``roofline ms / measured ms`` (100%: at the limit; above 100% only where
part of the weights came from a cache). Which peak applies to which row (``row_peak``):

* ``nn.Linear fp32``: fp32 FMA, zmm where the CPU has AVX-512F (MKL / oneDNN's sgemm picks its kernel from the
  CPU), else ymm.
* ``nn.Linear bf16``: where torch's oneDNN takes bf16 matmuls (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``:
  AVX-512 BW/VL/DQ CPUs): AMX ``tdpbf16ps`` on AMX-BF16 CPUs, ``vdpbf16ps`` on AVX-512 BF16 CPUs, else fp32 FMA zmm
  (oneDNN widens bf16 to fp32 there); elsewhere (AVX2 machines) ATen's own bf16 gemm, which widens to fp32 and
  multiplies with fp32 FMAs at torch's CPU capability width (``torch.backends.cpu.get_cpu_capability()``:
  ``AVX512`` zmm, else ymm).
* ``torch int8pack`` / ``torch int4pack``: fp32 FMA at torch's capability width (ATen's ``int8mm_kernel.cpp`` and
  ``int4mm_kernel.cpp`` widen the codes and ``x`` to fp32 and use ``Vectorized<float>`` FMAs).
* ``fused`` (``ds_fpquant.linear.linear``) and ``dequantize + matmul``: by the op's ``cpu_paths()``: bf16 ``x``:
  ``tdpbf16ps`` where a path names AMX, ``vdpbf16ps`` where the op has ``bf16_dot``; otherwise, and for fp32 ``x``,
  fp32 FMA, zmm where the op is an AVX-512 build (``fast_decode``), else ymm. This is the best instruction the op
  has for ``x``'s dtype, whichever kernel a given ``M`` takes.

Where the wanted peak was not measured (its loop is not in this build, or the CPU cannot run it) the best measured
fp32 FMA peak stands in and the row's ``peak`` field says so; with no peak at all (no compiled op) the roofline is
the bandwidth term alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["PEAK_KINDS", "PEAK_TRIALS", "PEAK_SECONDS", "CPU_FEATURES", "Peak", "KernelFacts", "measure_peaks",
           "cpu_flags", "kernel_facts", "row_peak", "roofline_ms", "peaks_environment", "features_text"]

#: The peak loops of ``fp_peak_cpu.cpp``: kind -> the instruction it repeats.
PEAK_KINDS = {"fp32_fma_ymm": "vfmadd231ps ymm", "fp32_fma_zmm": "vfmadd231ps zmm",
              "bf16_dot_zmm": "vdpbf16ps zmm", "amx_bf16": "tdpbf16ps"}

#: Timed runs of each peak loop (the best one counts) and their length in seconds (the default run).
PEAK_TRIALS = 3
PEAK_SECONDS = 0.2

#: The ``/proc/cpuinfo`` flags the environment line records (the instruction sets the kernels and torch choose by).
CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                "avx512_vbmi", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclass
class Peak:
    """One peak loop: its kind, the instruction, the measured GFLOP/s (``None`` where it could not run) and why not."""

    kind: str
    instruction: str
    gflops: Optional[float]
    unavailable: str = ""


def measure_peaks(op, threads: int, min_seconds: float = PEAK_SECONDS, trials: int = PEAK_TRIALS) -> Dict[str, Peak]:
    """Every peak loop of the compiled op ``op`` (``backends.load_op("cpu")[0]``; ``None``: no compiled op, no
    peaks), timed on ``threads`` OpenMP threads where this machine runs it."""
    if op is None or not hasattr(op, "dot_peak_kinds"):
        return {}
    peaks = {}
    for info in op.dot_peak_kinds():
        gflops = None
        if not info["unavailable"]:
            gflops = float(op.dot_peak_gflops(info["name"], threads, min_seconds, trials))
        peaks[info["name"]] = Peak(info["name"], info["instruction"], gflops, info["unavailable"])
    return peaks


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags (the first ``flags`` line of ``/proc/cpuinfo``); empty where there is none."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class KernelFacts:
    """What decides which instruction each row multiplies with (see the module doc)."""

    flags: frozenset  # /proc/cpuinfo flags
    op_paths: Tuple[str, ...]  # the compiled op's cpu_paths() (() without the op)
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", ...
    mkldnn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported()


def kernel_facts(op) -> KernelFacts:
    """This machine's :class:`KernelFacts`; ``op`` is the compiled CPU op or ``None``."""
    try:
        mkldnn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        mkldnn_bf16 = False
    paths = tuple(op.cpu_paths()) if op is not None and hasattr(op, "cpu_paths") else ()
    return KernelFacts(cpu_flags(), paths, torch.backends.cpu.get_cpu_capability(), mkldnn_bf16)


def _wanted_kind(impl: str, x: str, facts: KernelFacts) -> Tuple[str, str]:
    """(peak kind, what the row runs) by the rules of the module doc."""
    torch_fma = "fp32_fma_zmm" if facts.torch_capability.startswith("AVX512") else "fp32_fma_ymm"
    if impl == "nn.Linear fp32":
        return ("fp32_fma_zmm" if "avx512f" in facts.flags else "fp32_fma_ymm"), "MKL / oneDNN sgemm, fp32 FMA"
    if impl == "nn.Linear bf16":
        if facts.mkldnn_bf16:
            if "amx_bf16" in facts.flags:
                return "amx_bf16", "oneDNN bf16 matmul on AMX"
            if "avx512_bf16" in facts.flags:
                return "bf16_dot_zmm", "oneDNN bf16 matmul, vdpbf16ps"
            return "fp32_fma_zmm", "oneDNN bf16 matmul widened to fp32 (no bf16 dot product on this CPU)"
        return torch_fma, "ATen's bf16 gemm widened to fp32 (no oneDNN bf16 on this CPU)"
    if impl.startswith("torch int"):
        return torch_fma, "ATen's tinygemm kernel, codes widened to fp32"
    if x == "bf16" and any("amx" in p for p in facts.op_paths):
        return "amx_bf16", "ds_fpquant's AMX path"
    if x == "bf16" and "bf16_dot" in facts.op_paths:
        return "bf16_dot_zmm", "ds_fpquant's vdpbf16ps path"
    if "fast_decode" in facts.op_paths:
        return "fp32_fma_zmm", "ds_fpquant's AVX-512 fp32 path"
    return "fp32_fma_ymm", "ds_fpquant's fp32 path (fp32 multiply-adds, or torch's fp32 matmul on decoded panels)"


def row_peak(impl: str, x: str, facts: KernelFacts, peaks: Dict[str, Peak]) -> Tuple[str, Optional[float]]:
    """``(peak text, GFLOP/s)`` for a row (``impl`` and ``x`` as in ``LinearResult``): the kind it runs, or the
    best measured fp32 FMA kind with the reason where that one was not measured; ``(why, None)`` without peaks."""
    kind, runs = _wanted_kind(impl, x, facts)
    peak = peaks.get(kind)
    if peak is not None and peak.gflops is not None:
        return f"{kind} ({runs})", peak.gflops
    why = "not in this build" if peak is None else peak.unavailable
    for stand_in in ("fp32_fma_zmm", "fp32_fma_ymm"):
        other = peaks.get(stand_in)
        if other is not None and other.gflops is not None:
            return f"{stand_in} ({runs}; {kind} not measured: {why})", other.gflops
    return f"none ({kind} not measured: {why})", None


def roofline_ms(weight_bytes: float, macs: float, read_gbps: float, peak_gflops: Optional[float]) -> Tuple[float, str]:
    """``(ms, bound)``: ``max(weight_bytes / read bandwidth, 2 * macs / peak)`` in milliseconds and which term is the
    larger (``"memory"`` or ``"compute"``); the bandwidth term alone where there is no peak.

    Raises:
        ValueError: a bandwidth or peak that is not a positive number, or negative bytes or MACs.
    """
    if not read_gbps > 0 or (peak_gflops is not None and not peak_gflops > 0):
        raise ValueError(f"read_gbps={read_gbps} and peak_gflops={peak_gflops} must be > 0")
    if weight_bytes < 0 or macs < 0:
        raise ValueError(f"weight_bytes={weight_bytes} and macs={macs} must be >= 0")
    memory = weight_bytes / read_gbps / 1e6
    compute = 0.0 if peak_gflops is None else 2 * macs / peak_gflops / 1e6
    return max(memory, compute), ("compute" if compute > memory else "memory")


def peaks_environment(peaks: Dict[str, Peak]) -> Dict[str, object]:
    """The environment fields of the peaks: ``peak_gflops`` {kind: GFLOP/s}, ``peak_instructions`` {kind:
    instruction} and, where some could not run, ``peak_unavailable`` {kind: why}."""
    env: Dict[str, object] = {"peak_gflops": {k: round(p.gflops, 1) for k, p in peaks.items() if p.gflops is not None},
                              "peak_instructions": {k: p.instruction for k, p in peaks.items()}}
    missing = {k: p.unavailable for k, p in peaks.items() if p.gflops is None}
    if missing:
        env["peak_unavailable"] = missing
    return env


def features_text(flags: Sequence[str]) -> str:
    """The :data:`CPU_FEATURES` among ``flags``, space-separated (``"-"``: none)."""
    return " ".join(f for f in CPU_FEATURES if f in flags) or "-"
