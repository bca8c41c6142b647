"""``FP_Quantize.selective_dequantize`` of the top-k experts against a full ``dequantize``, one run.

vLLM's ``deepspeedfp`` method calls ``selective_dequantize(buf, top_k_ids)`` every MoE forward; it
should cost the selected experts, not all of them. For ``E`` experts of ``N x K`` weights quantized
with ``FP_Quantize`` (flat groups of ``G``), this prints the median time and the peak temporary
memory of a full dequantize and of selecting ``k`` experts, and their ratios, all measured in this
run. Peak memory is the high-water mark above the memory in use before the call: on CUDA from
``torch.cuda.max_memory_allocated``, on the CPU from the process's ``VmHWM`` (reset through
``/proc/self/clear_refs`` before each call; glibc is told to mmap allocations >= 64 KiB so that
freed tensors leave the resident set).

    .venv/bin/python benchmarks/selective_dequantize.py                 # 64 experts of 1024x1024, k=2
    .venv/bin/python benchmarks/selective_dequantize.py --experts 8 --rows 64 --cols 64 --device cpu
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys

import torch

from ds_fpquant import FP_Quantize
from ds_fpquant.cli.bench.ops import make_timer
from ds_fpquant.ops import backends

MIB = 2**20


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _mmap_large_allocations() -> None:
    """glibc: serve allocations of 64 KiB and more with mmap, so that a free returns them to the OS
    and the resident set follows the live tensors (otherwise freed heap pages hide a new peak)."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL(None).mallopt(m_mmap_threshold, 64 * 1024)


def peak_bytes(fn, device: torch.device) -> int:
    """Bytes allocated at the peak of ``fn()`` above what was in use before it (its result included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
            fh.write("5")
        before = _proc_status("VmRSS")
        result = fn()
        peak = _proc_status("VmHWM") - before
    del result
    return max(peak, 0)


def _backend(device: torch.device) -> str:
    reason = backends.op_status(device.type)
    return f"compiled {device.type} op" if not reason else f"torch reference ({reason})"


def run(experts: int, rows: int, cols: int, top_k: int, group_size: int, q_bits_list, device: torch.device,
        repeat: int) -> str:
    if device.type == "cpu":
        _mmap_large_allocations()  # for peak_bytes; set before anything runs so that timings see the same allocator
    measure = make_timer(device, repeat=repeat, warmup=2)
    torch.manual_seed(0)
    w = (torch.randn(experts, rows, cols, dtype=torch.bfloat16) * 0.02).to(device)
    ids = torch.randperm(experts)[:top_k].to(torch.int32).to(device)
    lines = [f"{experts} experts of {rows}x{cols} bf16 ({w.numel() * 2 / MIB:.2f} MiB), top-k={top_k}, "
             f"G={group_size}, device {device}, backend {_backend(device)}, torch {torch.__version__}, "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
             "",
             "| q_bits | call | ms | peak temporary MiB | time ratio | memory ratio |",
             "|---|---|---|---|---|---|"]
    cases = []
    for q_bits in q_bits_list:
        q = FP_Quantize(group_size=group_size)
        buf = q.quantize(w, q_bits=q_bits)
        full = q.dequantize(buf, q_bits=q_bits)
        chosen = q.selective_dequantize(buf, ids, q_bits=q_bits)
        if not torch.equal(chosen.view(torch.int16), full.index_select(0, ids.long()).view(torch.int16)):
            raise AssertionError("selective_dequantize differs from the rows of dequantize")
        del full, chosen
        calls = {"dequantize (all experts)": lambda q=q, buf=buf, b=q_bits: q.dequantize(buf, q_bits=b),
                 f"selective_dequantize (k={top_k})":
                     lambda q=q, buf=buf, b=q_bits: q.selective_dequantize(buf, ids, q_bits=b)}
        cases.append((q_bits, calls, {name: measure(fn) for name, fn in calls.items()}))
    for q_bits, calls, seconds in cases:
        peaks = {name: peak_bytes(fn, device) for name, fn in calls.items()}
        base = "dequantize (all experts)"
        for name in calls:
            # below one 64 KiB mmap the resident set does not resolve the peak: no memory ratio
            memory = f"{peaks[base] / peaks[name]:.1f}x" if peaks[name] >= 64 * 1024 else "-"
            lines.append(f"| {q_bits} | {name} | {seconds[name] * 1e3:.3f} | {peaks[name] / MIB:.2f} | "
                         f"{seconds[base] / seconds[name]:.1f}x | {memory} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=512, help="FP_Quantize group size (DeepSpeed's default 512)")
    parser.add_argument("--q-bits", type=int, nargs="+", default=[8, 6], help="DeepSpeed q_bits (default mantissa bits)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    for name in ("experts", "rows", "cols", "top_k", "group_size", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        parser.error(f"--top-k={args.top_k} is more than --experts={args.experts}")
    print(run(args.experts, args.rows, args.cols, args.top_k, args.group_size, args.q_bits, torch.device(args.device),
              args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
