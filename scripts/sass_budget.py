#!/usr/bin/env python3
"""The instruction budget of the CUDA GEMV, read from its SASS (issue 28).

Builds ``csrc/fp_quantizer/fp_quantize_cuda.cu`` (every CUDA kernel of the op) for sm_90 with the nvcc flags of
``FPQuantizerBuilder`` (no GPU needed), disassembles it with ``cuobjdump -sass`` and prints, per GEMV instantiation
(format x activation dtype x rows of x), its steady-state loop:

- the loop is found from the SASS itself: every backward branch ``BRA`` to a lower address closes a loop from its
  target to the branch; the steady-state loop is the smallest loop that holds the most ``FFMA`` instructions (the
  products of the linear: one ``FFMA`` per weight and row of x);
- *weights per iteration* = ``FFMA`` in that loop / rows of x the instantiation serves (its ``kRows`` template
  argument; a kernel without one serves up to 16 rows, all unrolled in its loop), less one when that leaves one
  more than a power of two: SPEC 8.1's kernels add one ``FFMA`` per chunk and row, the group scale times the
  chunk's partial sum;
- *instructions per weight* = the loop's instructions / weights per iteration (static counts: a predicated-off
  instruction still counts, the cost of a taken branch is not modelled);
- registers, stack, shared memory from ``cuobjdump -res-usage``, spill bytes from ``ptxas -v``.

Usage::

    CUDA_HOME=/usr/local/cuda python scripts/sass_budget.py [--json OUT.json] [--sass SASS_FILE --ptxas LOG]

``--sass``/``--ptxas`` read a listing made before instead of building. Exit status 0; the budgets themselves are
asserted by ``tests/unit/ops/fp_quantizer/test_op_builders.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
#: Rows of x a GEMV instantiation without a ``kRows`` template argument unrolls (the kernel before issue 28).
DEFAULT_ROWS = 16

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)")


@dataclass
class Loop:
    start: int  # address of the first instruction (the branch target)
    end: int  # address of the backward branch
    instructions: int
    ffma: int


@dataclass
class KernelBudget:
    name: str  # demangled
    fmt: str
    dtype: str
    rows: int
    variant: str
    loop_instructions: int
    weights_per_iteration: float
    instructions_per_weight: float
    registers: Optional[int] = None
    stack: Optional[int] = None
    shared: Optional[int] = None
    spill_bytes: Optional[int] = None


def split_functions(sass: str) -> Dict[str, List[Tuple[int, str]]]:
    """``cuobjdump -sass`` text -> {mangled name: [(address, instruction text)]}."""
    out = {}
    marks = list(_FUNCTION.finditer(sass))
    for i, mark in enumerate(marks):
        body = sass[mark.end():marks[i + 1].start() if i + 1 < len(marks) else len(sass)]
        out[mark.group(1)] = [(int(a, 16), text.strip()) for a, text in _INSTRUCTION.findall(body)]
    return out


def loops(instructions: List[Tuple[int, str]]) -> List[Loop]:
    """Every loop closed by a backward branch: from the target to the last branch back to it."""
    ends: Dict[int, int] = {}
    for address, text in instructions:
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= address:
            target = int(m.group(1), 16)
            ends[target] = max(ends.get(target, address), address)
    out = []
    for start, end in ends.items():
        body = [text for a, text in instructions if start <= a <= end]
        ffma = sum(1 for text in body if re.search(r"\bFFMA\b", text))
        out.append(Loop(start, end, len(body), ffma))
    return out


def steady_state_loop(instructions: List[Tuple[int, str]]) -> Optional[Loop]:
    """The smallest loop holding the most FFMA; None when no loop has one."""
    candidates = [loop for loop in loops(instructions) if loop.ffma > 0]
    if not candidates:
        return None
    most = max(loop.ffma for loop in candidates)
    return min((loop for loop in candidates if loop.ffma == most), key=lambda loop: loop.instructions)


def demangle(names: List[str]) -> Dict[str, str]:
    try:
        run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, run.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def _format_names() -> Dict[Tuple[int, int], str]:
    sys.path.insert(0, str(REPO))
    import ds_fpquant as fpq
    from ds_fpquant.numerics.formats import get_format

    return {(get_format(f).ebits, get_format(f).mbits): f for f in fpq.FORMATS}


def describe(demangled: str, formats: Dict[Tuple[int, int], str]) -> Tuple[str, str, int, str]:
    """(format, dtype, rows of x, the other template arguments) of a GEMV instantiation's demangled name."""
    m = re.search(r"FormatTraits<(\d+), (\d+),", demangled)
    fmt = formats.get((int(m.group(1)), int(m.group(2))), f"e{m.group(1)}m{m.group(2)}") if m else "?"
    dtype = "fp32" if re.search(r"[<, ]float[,>]", demangled) else next(
        (d.lower() for d in ("Bf16", "Fp16") if f"fpq::{d}" in demangled), "?")
    args = demangled.split("<", 1)[1].rsplit(">", 1)[0] if "<" in demangled else ""
    rest = [a.strip() for a in re.sub(r"fpq::FormatTraits<[^>]*>", "", args).split(",")[2:]]
    rows = DEFAULT_ROWS
    numbers = [a for a in rest if re.fullmatch(r"\d+", a)]
    if numbers:  # the new kernels: <F, T, kRows, ...>
        rows = int(numbers[0])
    variant = ",".join(a for a in rest if not re.fullmatch(r"\d+", a)) or "-"
    return fmt, dtype, rows, variant


def parse_usage(res_usage: str) -> Dict[str, Dict[str, int]]:
    """``cuobjdump -res-usage`` -> {mangled: {REG, STACK, SHARED, LOCAL}}."""
    out, name = {}, None
    for line in res_usage.splitlines():
        m = re.match(r"\s*Function\s+(\S+):\s*$", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            out[name] = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", line)}
            name = None
    return out


def parse_spills(ptxas_log: str) -> Dict[str, int]:
    """``ptxas -v`` output -> {mangled: spill store + load bytes}."""
    out, name = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([A-Za-z0-9_$]+)'?", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            out[name] = int(m.group(1)) + int(m.group(2))
    return out


def budgets(sass: str, res_usage: str = "", ptxas_log: str = "", match: str = "gemv") -> List[KernelBudget]:
    functions = {n: ins for n, ins in split_functions(sass).items() if match in n}
    names = demangle(sorted(functions))
    usage, spills, formats = parse_usage(res_usage), parse_spills(ptxas_log), _format_names()
    out = []
    for mangled in sorted(functions, key=lambda n: names[n]):
        fmt, dtype, rows, variant = describe(names[mangled], formats)
        loop = steady_state_loop(functions[mangled])
        weights = loop.ffma / rows if loop else 0.0
        if weights >= 3 and weights == int(weights) and (int(weights) - 1) & (int(weights) - 2) == 0:
            weights -= 1  # the scale's FFMA per chunk (a power of two of weights) and row
        per_weight = loop.instructions / weights if loop and weights else float("inf")
        u = usage.get(mangled, {})
        out.append(KernelBudget(names[mangled], fmt, dtype, rows, variant, loop.instructions if loop else 0, weights,
                                round(per_weight, 2), u.get("REG"), u.get("STACK"), u.get("SHARED"),
                                spills.get(mangled)))
    return out


def nvcc_command(source: Path, obj: Path) -> List[str]:
    """nvcc with the builder's flags, for sm_90 only, with ptxas's resource report."""
    sys.path.insert(0, str(REPO))
    from ds_fpquant.op_builder.builder import cuda_tool
    from ds_fpquant.op_builder.fp_quantizer import FPQuantizerBuilder

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # what the builder targets without a GPU
    builder = FPQuantizerBuilder()
    builder.jit_mode = False  # compute_capability_args of a JIT build would ask for a GPU
    flags, args = [], builder.nvcc_args()
    skip = False
    for a in args:  # the architecture flags are replaced by sm_90 alone ("-gencode X" or "-gencode=X")
        if skip:
            skip = False
        elif a in ("-gencode", "--generate-code", "-arch"):
            skip = True
        elif not a.startswith(("-gencode=", "--generate-code=", "-arch=")):
            flags.append(a)
    return [cuda_tool("nvcc"), *flags, "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", "-c", str(source),
            "-I", str(source.parent / "includes"), "-o", str(obj)]


def build_and_disassemble(workdir: Path) -> Tuple[str, str, str]:
    """(SASS, res-usage, ptxas log) of the CUDA op's kernels built for sm_90."""
    sys.path.insert(0, str(REPO))
    from ds_fpquant.op_builder.builder import cuda_tool

    obj = workdir / "fp_quantize_cuda.o"
    build = subprocess.run(nvcc_command(REPO / "csrc" / "fp_quantizer" / "fp_quantize_cuda.cu", obj),
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{build.stderr[-4000:]}")
    cuobjdump = cuda_tool("cuobjdump")
    cuda_tool("nvdisasm")  # puts its folder on PATH (cuobjdump runs it for sm_90)
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", str(obj)], capture_output=True, text=True, check=True).stdout
    return sass, usage, build.stderr


def table(rows: List[KernelBudget]) -> str:
    lines = ["| format | x dtype | rows of x | variant | loop instructions | weights / iteration | instructions / weight"
             " | registers | spill bytes | shared bytes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.fmt} | {r.dtype} | {r.rows} | {r.variant} | {r.loop_instructions} | "
                     f"{r.weights_per_iteration:g} | {r.instructions_per_weight:g} | {r.registers} | {r.spill_bytes} | "
                     f"{r.shared} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--sass", help="a cuobjdump -sass listing to read instead of building")
    parser.add_argument("--res-usage", help="its cuobjdump -res-usage output")
    parser.add_argument("--ptxas", help="its ptxas -v log")
    parser.add_argument("--keep", help="folder to keep the build's SASS, res-usage and ptxas log in")
    args = parser.parse_args(argv)
    if args.sass:
        read = lambda p: Path(p).read_text() if p else ""  # noqa: E731
        sass, usage, log = read(args.sass), read(args.res_usage), read(args.ptxas)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            sass, usage, log = build_and_disassemble(Path(tmp))
        if args.keep:
            keep = Path(args.keep)
            keep.mkdir(parents=True, exist_ok=True)
            for name, text in (("kernels.sass", sass), ("res_usage.txt", usage), ("ptxas.log", log)):
                (keep / name).write_text(text)
    rows = budgets(sass, usage, log)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    sys.exit(main())
