#!/usr/bin/env python3
"""The instruction budget of the CUDA GEMV, read from its SASS (issues 28 and 37).

Builds ``csrc/fp_quantizer/fp_quantize_cuda.cu`` (every CUDA kernel of the op) for sm_90 with the nvcc flags of
``FPQuantizerBuilder`` (no GPU needed), disassembles it with ``cuobjdump -sass`` and counts every GEMV instantiation
two ways, in *lane instructions per weight*: warp instructions issued x 32 / (N x K) for one launch.

1. **Loop only** (issue 28, ``loop_per_weight_static``): the steady-state loop found from the backward branches (the
   smallest loop that holds the most ``FFMA``), its static instruction count / the weights one lane handles per
   iteration (``FFMA`` / rows of x, less the scale's ``FFMA`` per chunk and row).
2. **Whole kernel** (issue 37, ``whole_per_weight``): the control-flow graph of the function (basic blocks, taken and
   fall-through edges of every ``BRA`` and predicated ``EXIT``, loops from the back edges, their nesting), every
   basic block weighted by the number of times a warp executes it in the stated launch. ``loop_per_weight`` is the
   executed share of the kernel's steady-state loop in the same count.

Counting convention. A warp instruction counts 32 lane instructions whatever its guard predicate (a predicated-off
instruction issues all the same) and however many lanes are active (a divergent side, or the code after a lane's
``EXIT``, issues for the warp). ``BRA``, ``EXIT``, ``BSSY``, ``BSYNC``, ``BAR`` and ``NOP`` inside reachable code
are instructions like any other; the blocks no edge reaches (nvcc's ``BRA`` to itself after the last ``EXIT`` and
the ``NOP`` padding) are not counted. A warp whose lanes disagree on a branch runs both sides (a side's count is the
number of times *any* lane takes it); the paths join at the branch's immediate post-dominator (where nvcc's
``BSYNC`` reconverges them).

Execution counts. The CFG is found from the SASS; what it cannot know (how often a loop turns, which side of a
branch a launch takes) is declared per kernel family by a :class:`KernelModel` (the models are the first thing below;
``KernelModel``'s docstring says how to write one). The model names every loop of the function and its trip count
as a function of the launch (N, K, M, G, scale format) and the instantiation, and every conditional branch of every
loop body (tails, ragged groups, zero-filled staging, exits) with the fraction of its executions after which a warp
runs each side. The script checks that the CFG has exactly the model's loop tree and exactly its number of branches
in every loop body (and their kinds), so a kernel change that adds or removes a loop or a branch fails loudly
(:class:`ModelMismatch`, with the CFG as found) and never silently miscounts. Block counts then follow from the
control dependences of each loop body (its acyclic graph, inner loops as one node each): a block that every path
through the body passes executes as often as the body's entry; a block on one side of a branch as often as the
branch's block times that side's fraction.

Resources per instantiation: registers, stack, static shared memory from ``cuobjdump -res-usage`` (on sm_90 its
``SHARED`` includes the 1 KiB the driver reserves per block), spill bytes from ``ptxas -v``, the dynamic shared
memory from the model; resident blocks and warps per SM at sm_90's limits (:data:`SM90`); weight bytes in flight per
SM (what one block keeps outstanding, from the model, times the resident blocks); shared-memory bytes per weight
(every ``LDS``/``LDSM``/``STS``/``STSM``/``LDGSTS`` of the SASS: bytes per lane x 32 x its block's count / N x K).

Usage::

    CUDA_HOME=/usr/local/cuda python scripts/sass_budget.py [--json OUT.json] [--keep DIR]
    python scripts/sass_budget.py --sass DIR/kernels.sass --res-usage DIR/res_usage.txt --ptxas DIR/ptxas.log
    python scripts/sass_budget.py --sass ... --cfg 'Li4ELi3E.*Bf16ELi1ELb1E'  # one function's CFG and block counts

``--sass``/``--res-usage``/``--ptxas`` read a listing made before (``--keep`` writes one) instead of building. Exit
status 0; the budgets are asserted by ``tests/unit/ops/fp_quantizer/test_op_builders.py``, the counter itself on
canned listings by ``test_sass_budget.py``; ``docs/gpu.md`` counts one case by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Union

REPO = Path(__file__).resolve().parents[1]
#: Rows of x a GEMV instantiation without a ``kRows`` template argument unrolls (the kernel before issue 28).
DEFAULT_ROWS = 16

#: sm_90 (H100 / H200) limits for residency: registers, shared memory (bytes; the most a block can configure is
#: 227 KiB + the 1 KiB reserved), warps and blocks per SM; registers are allocated per warp in units of 256, shared
#: memory per block in units of 128 bytes.
SM90 = {"registers": 65536, "shared": 228 << 10, "warps": 64, "blocks": 32, "register_unit": 256, "shared_unit": 128}


# ======================================================================================================================
# 1. Kernel models: what the SASS cannot say. Declare a new kernel family here.
# ======================================================================================================================

@dataclass(frozen=True)
class Launch:
    """One GEMV call: y (m, n) = x (m, k) @ W (n, k)^T, W in `fmt` with one scale per `group_size` codes of a row."""
    fmt: str
    x_dtype: str  # "fp32" | "fp16" | "bf16"
    m: int
    n: int
    k: int
    group_size: int
    scale_format: str = "fp32"  # "fp32" | "e8m0" | "e4m3" (NVFP4: e4m3 codes times the tensor scale)
    bias: bool = False

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.k}"


@dataclass(frozen=True)
class Instance:
    """A kernel instantiation, from its demangled name."""
    mangled: str
    name: str
    fmt: str
    dtype: str
    rows: int
    variant: str
    bits: int


#: A fraction or trip count: a number, or a function of the model's derived launch values ``d``.
Number = Union[float, int, Callable[[Any], float]]


@dataclass(frozen=True)
class Branch:
    """A conditional branch of a loop body (or of the function outside every loop), in address order.

    The branches of a body are its blocks whose last instruction is a conditional ``BRA`` or ``EXIT`` with two
    distinct successors in the body's acyclic graph (a loop's back edge and its exits lead to the body's end, an inner
    loop is one node): a loop's own latch is no branch. ``taken`` / ``fallthrough``: of the warp executions of the
    branch's block, the fraction after which the warp runs the blocks of that side (the blocks control dependent on
    that edge); a warp whose lanes disagree runs both, so the two may add up to more than 1. A side with no blocks of
    its own (it goes straight to the join, to an ``EXIT``, to the back edge) needs no fraction: use :func:`Skip` or
    :func:`Exit`, which also check the polarity. ``match``: a regex (or a function of ``d`` giving one) searched in
    :func:`describe_branch`'s text of the branch followed by `` | block: `` and its block's instructions, to check
    that the rule sits on the branch meant (the side with the division, a guard's constant).
    """
    what: str
    taken: Number = 0.0
    fallthrough: Number = 1.0
    match: Union[str, Callable[[Any], str]] = ""
    kind: str = "branch"  # "skip": the taken side has no blocks; "exit": a conditional EXIT; "branch": two sides


def Skip(what: str, run: Number, match: Union[str, Callable[[Any], str]] = "") -> Branch:
    """A branch around a piece of code (``@P BRA join``): `run` is the fraction of executions after which the warp
    runs the fall-through side. The taken side must have no blocks of its own."""
    return Branch(what, 0.0, run, match, "skip")


def Exit(what: str, stay: Number, match: Union[str, Callable[[Any], str]] = "") -> Branch:
    """A conditional ``EXIT``: `stay` is the fraction of executions after which the warp goes on (some lane stays)."""
    return Branch(what, 0.0, stay, match, "exit")


@dataclass(frozen=True)
class Loop:
    """A loop of the kernel (or, as :attr:`KernelModel.body`, the function itself, ``trips=1``).

    ``trips``: header executions per entry into the loop, averaged over the launch's entries (for a rotated
    ``do { } while`` loop: its iterations; a warp turns as often as its busiest lane). ``branches``: the body's
    conditional branches in address order (not counting those of inner loops), a sequence or a function of ``d``
    giving one. ``loops``: the loops directly inside, in address order.
    """
    name: str
    trips: Number = 1
    branches: Union[Sequence[Branch], Callable[[Any], Sequence[Branch]]] = ()
    loops: Tuple["Loop", ...] = ()


@dataclass(frozen=True)
class KernelModel:
    """What a kernel family's SASS does not say: its loops, trip counts, branch fractions and launch geometry.

    To declare a kernel family (one ``__global__`` template, all its instantiations):

    1. ``match``: a regex on the demangled name that selects the family's functions; ``describe`` turns a demangled
       name into an :class:`Instance` (format, x dtype, rows of x, the other template arguments as ``variant``).
    2. ``runs(inst, launch)``: whether the host launcher picks this instantiation for the launch (exactly one per
       launch, or the launch is reported as not covered); ``max_m``: the largest M the family serves.
    3. ``derive(inst, launch)``: a namespace ``d`` of whatever the trip counts and fractions need, and three values the
       script reads: ``d.blocks`` (grid size), ``d.threads`` (per block), ``d.dynamic_smem`` (bytes per block).
    4. ``body``: the :class:`Loop` tree, the function itself at the root (``trips=1``, its ``branches`` those outside
       every loop), each loop with ``trips`` and ``branches`` as functions of ``d``. Write it by reading
       ``--cfg REGEX``: it prints each body's blocks in address order, its branches (guard, target, what each side
       holds) and the loop tree as found; the script refuses a model whose tree or branch counts differ.
    5. ``inflight(d, loops)``: the weight bytes one block keeps in flight (stages x stage bytes for a ``cp.async`` /
       TMA ring; for a kernel that consumes its loads in the same iteration, what its warps have outstanding);
       ``loops`` maps each loop's name to its instruction texts, to read the load widths from the SASS.
    6. ``steady``: the name of the steady-state loop (``loop_per_weight``), ``phases``: column labels of the table
       (``prologue`` / ``epilogue``: the blocks outside every loop before / after the first loop, then loop names).
    7. ``probe(inst)``: a launch that runs `inst`, for the instantiations no stated launch runs (ragged variants),
       so that the model is checked against every function of the family.

    A branch's fraction or a trip count is exact when it is the ratio over the whole launch (executions of the side /
    executions of the branch's block; header executions / entries), so a model may enumerate warps and iterations of
    a block in Python to get it (today's GEMV does, for its staging loops). Data-dependent branches (a NaN scale byte)
    need a stated assumption in ``what``.
    """
    family: str
    match: str
    describe: Callable[[str], Instance]
    runs: Callable[[Instance, Launch], bool]
    derive: Callable[[Instance, Launch], Any]
    body: Loop
    inflight: Callable[[Any, Dict[str, List[str]]], float]
    steady: str
    max_m: int
    phases: Tuple[str, ...] = ()
    probe: Optional[Callable[[Instance], Launch]] = None


# ---- today's GEMV (csrc/fp_quantizer/includes/fp_gemv_kernels.cuh: gemv_kernel<F, T, kRows, kFull>) -------------
#
# One warp per weight row, 8 warps per block. Per tile of kTile chunks: the block stages x (kTile x kCodes positions,
# 256 threads a step, zeros past the row) and the 8 rows' chunk scales (8 x kTile, 256 a step), then each warp runs
# its row over the tile's chunks, lane l taking chunks l, l + 32, ...; the tail adds the lanes by shuffles and lane m
# stores row m of y. Loops: tile { x staging, scale staging, weight loop }.

_GEMV_WARPS = 8
_GEMV_THREADS = 256
_GEMV_SHARED = 48 << 10  # kGemvSharedBytes


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _gemv_codes(bits: int) -> int:
    return 32 if bits == 4 else 16  # ChunkDecode<F>::kCodes


def gemv_full(bits: int, k: int, group_size: int) -> bool:
    """gemv_full<F> for aligned code buffers: whole chunks per group, a power of two of them, whole groups per row."""
    codes = _gemv_codes(bits)
    chunk = codes * bits // 8
    align = 16 if chunk % 16 == 0 else 8 if chunk % 8 == 0 else 4
    cpg = group_size // codes
    row_bytes = (k // group_size) * _ceil(group_size * bits, 8) + _ceil((k % group_size) * bits, 8)
    return group_size % codes == 0 and cpg & (cpg - 1) == 0 and k % group_size == 0 and row_bytes % align == 0


def _gemv_describe(demangled: str) -> Instance:
    fmt, dtype, rows, variant = describe(demangled, _format_names())
    return Instance("", demangled, fmt, dtype, rows, variant, _format_bits()[fmt])


def _gemv_runs(inst: Instance, launch: Launch) -> bool:
    rows = 1 if launch.m <= 1 else 2 if launch.m <= 2 else 4 if launch.m <= 4 else 8  # gemv_rows_for
    full = gemv_full(inst.bits, launch.k, launch.group_size)
    return (inst.fmt == launch.fmt and inst.dtype == launch.x_dtype and inst.rows == rows
            and inst.variant == ("true" if full else "false"))


def _gemv_derive(inst: Instance, launch: Launch) -> SimpleNamespace:
    d = SimpleNamespace(inst=inst, launch=launch, rows=inst.rows, m=launch.m, n=launch.n, k=launch.k,
                        g=launch.group_size, full=inst.variant == "true")
    d.codes = _gemv_codes(inst.bits)
    d.chunk_bytes = d.codes * inst.bits // 8
    stride = d.codes + 4
    d.tile = _GEMV_SHARED // (4 * (d.rows * stride + _GEMV_WARPS)) // 32 * 32  # GemvTile::kChunks
    d.dynamic_smem = 4 * (d.rows * d.tile * stride + _GEMV_WARPS * d.tile)  # GemvTile::kBytes
    d.n_groups = _ceil(d.k, d.g)
    d.cpg = _ceil(d.g, d.codes)
    d.n_chunks = d.n_groups * d.cpg
    d.blocks, d.threads = _ceil(d.n, _GEMV_WARPS), _GEMV_THREADS
    d.warps = d.blocks * _GEMV_WARPS
    d.tiles = _ceil(d.n_chunks, d.tile)
    d.row_warps = d.n / d.warps  # fraction of warps with a weight row (has_row)
    in_tile = [min(d.tile, d.n_chunks - t * d.tile) for t in range(d.tiles)]
    d.weight_trips = sum(_ceil(c, 32) for c in in_tile) / max(d.tiles, 1)
    _gemv_staging(d)
    return d


def _gemv_staging(d: SimpleNamespace) -> None:
    """The staging loops' trip counts and branch fractions, by enumerating every warp, tile and iteration of a block
    (lane predicates as in the kernel; a warp runs a side when any active lane does)."""
    x_limit, s_limit = d.tile * d.codes, _GEMV_WARPS * d.tile
    # one block of each kind: full blocks (8 rows) and the last one (n % 8 rows)
    kinds = [(d.n // _GEMV_WARPS, _GEMV_WARPS)] + ([(1, d.n % _GEMV_WARPS)] if d.n % _GEMV_WARPS else [])
    x = dict(entries=0, iters=0, valid=0, load=0)
    s = dict(entries=0, iters=0, valid=0)
    for count, rows_in_block in kinds:
        for t in range(d.tiles):
            f0 = t * d.tile
            for w in range(_GEMV_WARPS):
                x["entries"] += count * (32 * w < x_limit)
                for i0 in range(32 * w, x_limit, _GEMV_THREADS):
                    active = [i for i in range(i0, i0 + 32) if i < x_limit]
                    x["iters"] += count
                    f = [(f0 + i // d.codes, i % d.codes) for i in active]
                    chunk_ok = [c < d.n_chunks for c, _ in f]
                    x["valid"] += count * any(chunk_ok)
                    x["load"] += count * (d.m > 0 and any(ok and _gemv_x_valid(d, c, pos)
                                                         for ok, (c, pos) in zip(chunk_ok, f)))
                s["entries"] += count * (32 * w < s_limit)
                for i0 in range(32 * w, s_limit, _GEMV_THREADS):
                    active = [i for i in range(i0, i0 + 32) if i < s_limit]
                    s["iters"] += count
                    s["valid"] += count * any(f0 + i % d.tile < d.n_chunks and i // d.tile < rows_in_block
                                              for i in active)
    d.x_trips = x["iters"] / x["entries"]
    d.x_valid = x["valid"] / x["iters"]
    d.x_load = x["load"] / x["iters"]
    d.s_trips = s["iters"] / s["entries"]
    d.s_valid = s["valid"] / s["iters"]
    d.x_run = sum(count * sum(32 * w < x_limit for w in range(_GEMV_WARPS)) for count, _ in kinds) / d.warps
    d.s_run = sum(count * sum(32 * w < s_limit for w in range(_GEMV_WARPS)) for count, _ in kinds) / d.warps


def _gemv_x_valid(d: SimpleNamespace, chunk: int, pos: int) -> bool:
    g, c = divmod(chunk, d.cpg)
    return c * d.codes + pos < min(d.g, d.k - g * d.g)


def _gemv_top_branches(d: SimpleNamespace) -> List[Branch]:
    out = [Skip("n_chunks < 1: no tile loop", run=float(d.n_chunks >= 1)),
           Exit("!has_row: the warps past the last weight row", stay=d.row_warps)]
    if d.rows == 1:
        return out + [Exit("lane != 0 || rows_x < 1: lane 0 stores", stay=float(d.m >= 1)),
                      Branch("a.bias == nullptr", taken=float(not d.launch.bias), fallthrough=float(d.launch.bias),
                             match=r"fallthrough: [^|]*LDG")]
    for r in range(d.rows - 1):
        out.append(Skip(f"lane == {r} && {r} < rows_x: the store of row {r}", run=float(r < d.m),
                        match=r"fallthrough: [^|]*STG"))
        if r == 0 and d.rows == 8 and d.inst.dtype == "fp16":  # nvcc 13.0 predicates the bias load elsewhere
            out.append(Branch("a.bias == nullptr (row 0)", taken=float(not d.launch.bias),
                              fallthrough=float(d.launch.bias), match=r"fallthrough: [^|]*LDG"))
    return out + [Exit(f"lane != {d.rows - 1} || {d.rows - 1} >= rows_x: the store of the last row",
                       stay=float(d.rows - 1 < d.m))]


def _gemv_x_branches(d: SimpleNamespace) -> List[Branch]:
    out = [Skip("f >= n_chunks: a zero-filled position (no group division)", run=d.x_valid,
                match=r"fallthrough: [^|]*I2F")]
    if d.rows == 1:  # wider instantiations predicate the loads of x
        out.append(Skip("!valid || m >= rows_x: no load of x", run=d.x_load, match=r"fallthrough: [^|]*LDG"))
    return out


def _gemv_scale_branches(d: SimpleNamespace) -> List[Branch]:
    kind = d.launch.scale_format
    return [Skip("f >= n_chunks || r >= n: a zero scale", run=d.s_valid, match=r"fallthrough: [^|]*I2F"),
            Branch("scale_kind == fp32", taken=float(kind == "fp32"), fallthrough=float(kind != "fp32"),
                   match=r"taken: [^|]*LDG\.E(?![.\w])"),
            Branch("scale_kind == e8m0 (else NVFP4's e4m3)", taken=float(kind == "e8m0"),
                   fallthrough=float(kind == "e4m3")),
            Skip("E8M0 byte 255 (NaN) skips the power of two: scales assumed finite", run=1.0)]


def _gemv_inflight(d: SimpleNamespace, loops: Dict[str, List[str]]) -> float:
    """One stage: each lane of a warp with a row loads one chunk (kChunkBytes) per weight-loop iteration and consumes
    it in the same iteration (``unroll 1``), so a block keeps 8 x 32 x kChunkBytes in flight (512 B per warp for 8-
    and 4-bit codes). The loop's loads in the SASS must cover the chunk (nvcc loads some e4m7 words twice)."""
    per_lane = sum(global_load_bytes(opcode(text)) for text in loops["weight"])
    if per_lane < d.chunk_bytes:
        raise ModelMismatch(f"the weight loop loads {per_lane} bytes per lane, less than a chunk ({d.chunk_bytes})")
    return _GEMV_WARPS * d.row_warps * 32 * d.chunk_bytes


GEMV = KernelModel(
    family="gemv_kernel<F, T, kRows, kFull>",
    match=r"gemv_kernel<",
    describe=_gemv_describe,
    runs=_gemv_runs,
    derive=_gemv_derive,
    body=Loop("kernel", 1, _gemv_top_branches, loops=(
        Loop("tile", lambda d: d.tiles, lambda d: [  # the staging guards' constants check the model's kTile
            Skip("threadIdx.x >= kTile * kCodes: no x staging", run=d.x_run,
                 match=rf"block: .*ISETP\.GT\.AND P\d, PT, R\d+, {d.tile * d.codes - 1:#x}, PT"),
            Skip("threadIdx.x >= 8 * kTile: no scale staging", run=d.s_run,
                 match=rf"block: .*ISETP\.GT\.AND P\d, PT, R\d+, {_GEMV_WARPS * d.tile - 1:#x}, PT"),
            Skip("!has_row: no weight loop", run=d.row_warps),
            Skip("f0 + lane >= f_end: the weight loop's guard", run=1.0)], loops=(
            Loop("x staging", lambda d: d.x_trips, _gemv_x_branches),
            Loop("scale staging", lambda d: d.s_trips, _gemv_scale_branches),
            Loop("weight", lambda d: d.weight_trips),
        )),
    )),
    inflight=_gemv_inflight,
    steady="weight",
    max_m=8,
    phases=("prologue", "tile", "x staging", "scale staging", "weight", "epilogue"),
    probe=lambda inst: Launch(inst.fmt, inst.dtype, inst.rows, 4100, 4096, 128 if inst.variant == "true" else 96),
)

#: Every kernel family the script counts; a family none of whose functions is in the SASS is skipped.
MODELS: Tuple[KernelModel, ...] = (GEMV,)
#: The functions of the listing the script reads (mangled names containing this); a family's kernels must be among them.
FUNCTIONS = "gemv"

#: The stated launches (issue 37): two layer shapes (N x K), three scale layouts, M = 1, 2, 4, 8, 16 where the family
#: has them, every x dtype; NVFP4 for e2m1 only.
SHAPES = ((4096, 4096), (11008, 4096))
SCALE_LAYOUTS = (("fp32", 128), ("e8m0", 32), ("e4m3", 16))
ROWS_OF_X = (1, 2, 4, 8, 16)
X_DTYPES = ("bf16", "fp16", "fp32")


def launches(formats: Iterable[str], max_m: int) -> List[Launch]:
    out = []
    for fmt in formats:
        for scale_format, g in SCALE_LAYOUTS:
            if scale_format == "e4m3" and fmt != "e2m1":
                continue
            for n, k in SHAPES:
                for m in ROWS_OF_X:
                    if m <= max_m:
                        out += [Launch(fmt, x, m, n, k, g, scale_format) for x in X_DTYPES]
    return out


# ======================================================================================================================
# 2. SASS -> control-flow graph
# ======================================================================================================================

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH = re.compile(r"\bBRA\b[^;]*?0x([0-9a-f]+)")
_GUARD = re.compile(r"^@(!?U?P(?:[0-9]|T))\s+")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")
_OPERAND_PREDICATE = re.compile(r"^BRA(?:\.\S+)?\s+!?U?P[0-9T]\s*,")
_UNSUPPORTED = ("CALL", "RET", "BRX", "BRXU", "JMP", "JMX", "JMXU")
EXIT = -1  # the successor of an EXIT
SINK = ("end", -1)  # where a loop body's back edges, its exits and the function's EXITs lead


def split_functions(sass: str) -> Dict[str, List[Tuple[int, str]]]:
    """``cuobjdump -sass`` text -> {mangled name: [(address, instruction text)]}."""
    out = {}
    marks = list(_FUNCTION.finditer(sass))
    for i, mark in enumerate(marks):
        body = sass[mark.end():marks[i + 1].start() if i + 1 < len(marks) else len(sass)]
        out[mark.group(1)] = [(int(a, 16), text.strip()) for a, text in _INSTRUCTION.findall(body)]
    return out


def opcode(text: str) -> str:
    """The opcode with its modifiers, without the guard predicate: ``@!P0 LDG.E.128 R8, ...`` -> ``LDG.E.128``."""
    body = _GUARD.sub("", text.strip())
    return body.split()[0] if body else ""


class ModelMismatch(ValueError):
    """The SASS does not have the loops or branches the kernel family's model declares."""


@dataclass
class Block:
    start: int
    instructions: List[Tuple[int, str]]
    succs: List[Tuple[str, int]] = field(default_factory=list)  # ("taken" | "fallthrough", start or EXIT)


@dataclass
class FoundLoop:
    header: int
    body: FrozenSet[int]  # block starts
    parent: Optional["FoundLoop"] = None
    children: List["FoundLoop"] = field(default_factory=list)


class CFG:
    """The basic blocks of one function reachable from its entry, their edges, dominators and natural loops.

    Leaders: the first instruction, every branch target, the instruction after a ``BRA`` / ``EXIT``. A conditional
    ``BRA`` (guard predicate, predicate operand, ``BRA.DIV``) has a taken and a fall-through edge, an unconditional
    one the taken edge; a guarded ``EXIT`` falls through as well. Loops: the natural loop of every back edge (an edge
    to a block that dominates its source; any other retreating edge is irreducible flow and raises), merged per
    header, nested by inclusion. Calls, returns and indirect branches raise (not modelled).
    """

    def __init__(self, instructions: List[Tuple[int, str]]):
        if not instructions:
            raise ValueError("a function without instructions")
        addresses = [a for a, _ in instructions]
        leaders = {addresses[0]}
        for i, (a, text) in enumerate(instructions):
            base = opcode(text).split(".")[0]
            if base in _UNSUPPORTED:
                raise ValueError(f"{opcode(text)} at {a:#06x}: calls, returns and indirect branches are not modelled")
            if base in ("BRA", "EXIT", "BPT"):
                if base == "BRA":
                    leaders.add(int(_TARGET.search(text).group(1), 16))
                if i + 1 < len(instructions):
                    leaders.add(addresses[i + 1])
        starts = sorted(leaders)
        index = {a: i for i, a in enumerate(addresses)}
        blocks = {}
        for j, start in enumerate(starts):
            stop = index[starts[j + 1]] if j + 1 < len(starts) else len(instructions)
            block = Block(start, instructions[index[start]:stop])
            block.succs = self._succs(block.instructions[-1][1], starts[j + 1] if j + 1 < len(starts) else None)
            blocks[start] = block
        self.entry = starts[0]
        reached, stack = set(), [self.entry]
        while stack:
            s = stack.pop()
            if s == EXIT or s in reached:
                continue
            if s not in blocks:
                raise ValueError(f"control reaches {s} outside the function")
            reached.add(s)
            stack.extend(t for _, t in blocks[s].succs)
        self.blocks: Dict[int, Block] = {s: b for s, b in blocks.items() if s in reached}
        self._dominators()
        self._loops()

    @staticmethod
    def _succs(text: str, following: Optional[int]) -> List[Tuple[str, int]]:
        op = opcode(text)
        base = op.split(".")[0]
        guard = _GUARD.match(text.strip())
        if guard is not None and guard.group(1) == "!PT":
            return [("fallthrough", following)]
        conditional = (guard is not None and guard.group(1) != "PT") or op.startswith("BRA.DIV") or bool(
            _OPERAND_PREDICATE.match(_GUARD.sub("", text.strip())))
        if base == "BRA":
            target = [("taken", int(_TARGET.search(text).group(1), 16))]
            return target + ([("fallthrough", following)] if conditional else [])
        if base in ("EXIT", "BPT"):
            return [("taken", EXIT)] + ([("fallthrough", following)] if conditional else [])
        return [("fallthrough", following)]

    def successors(self, start: int) -> List[int]:
        return [t for _, t in self.blocks[start].succs if t != EXIT]

    def _dominators(self) -> None:
        order, seen = [], {self.entry}
        stack = [(self.entry, iter(self.successors(self.entry)))]
        while stack:
            node, it = stack[-1]
            nxt = next((t for t in it if t not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(self.successors(nxt))))
        rpo = order[::-1]
        rank = {s: i for i, s in enumerate(rpo)}
        self.preds: Dict[int, List[int]] = {s: [] for s in self.blocks}
        for s in self.blocks:
            for t in self.successors(s):
                self.preds[t].append(s)
        everything = frozenset(self.blocks)
        dom = {s: everything for s in self.blocks}
        dom[self.entry] = frozenset([self.entry])
        changed = True
        while changed:
            changed = False
            for s in rpo[1:]:
                new = frozenset.intersection(*[dom[p] for p in self.preds[s]]) | {s}
                if new != dom[s]:
                    dom[s], changed = new, True
        self.dom = dom
        self.back_edges = []
        for s in self.blocks:
            for t in self.successors(s):
                if rank[t] <= rank[s]:
                    if t not in dom[s]:
                        raise ValueError(f"irreducible control flow: {s:#06x} -> {t:#06x} enters a loop not at its "
                                         "head")
                    self.back_edges.append((s, t))

    def _loops(self) -> None:
        bodies: Dict[int, set] = {}
        for latch, header in self.back_edges:
            body = bodies.setdefault(header, {header})
            stack = [latch]
            while stack:
                s = stack.pop()
                if s not in body:
                    body.add(s)
                    stack.extend(self.preds[s])
        loops = [FoundLoop(h, frozenset(b)) for h, b in sorted(bodies.items())]
        for loop in loops:
            outer = [o for o in loops if o is not loop and loop.body < o.body]
            loop.parent = min(outer, key=lambda o: len(o.body)) if outer else None
            if loop.parent is not None:
                loop.parent.children.append(loop)
        self.loops = loops
        self.top_loops = [loop for loop in loops if loop.parent is None]
        self.innermost: Dict[int, Optional[FoundLoop]] = {}
        for s in self.blocks:
            holders = [loop for loop in loops if s in loop.body]
            self.innermost[s] = min(holders, key=lambda loop: len(loop.body)) if holders else None

    def tree(self) -> str:
        """The loop tree, each loop as its first and last instruction: ``[0x05e0..0x1780 [0x0690..0x0a50] ...]``."""
        def show(loop):
            inner = " ".join(show(c) for c in loop.children)
            end = max(self.blocks[s].instructions[-1][0] for s in loop.body)
            return f"[{loop.header:#06x}..{end:#06x}{' ' + inner if inner else ''}]"
        return " ".join(show(loop) for loop in self.top_loops) or "(no loop)"


@dataclass
class Region:
    """One loop body (or the function outside every loop) as an acyclic graph: its own blocks ``("b", start)``, each
    loop directly inside as one node ``("L", header)``, and :data:`SINK` for the back edges, exits and EXITs."""
    loop: Optional[FoundLoop]
    entry: tuple
    nodes: List[tuple]  # topological order, the entry first
    succs: Dict[tuple, List[Tuple[str, tuple]]]
    branches: List[tuple]  # block nodes with two distinct successors, by address
    ipdom: Dict[tuple, tuple]
    control: Dict[tuple, List[Tuple[tuple, str]]]  # node -> the (branch, side) edges it is control dependent on


def region(cfg: CFG, loop: Optional[FoundLoop]) -> Region:
    def node_of(t: int) -> tuple:
        if t == EXIT or (loop is not None and (t == loop.header or t not in loop.body)):
            return SINK
        inner = cfg.innermost[t]
        if inner is loop:
            return ("b", t)
        while inner.parent is not loop:
            inner = inner.parent
        if t != inner.header:
            raise ValueError(f"{t:#06x} enters the loop at {inner.header:#06x} not at its head")
        return ("L", inner.header)

    succs: Dict[tuple, List[Tuple[str, tuple]]] = {}
    for s in cfg.blocks:
        if cfg.innermost[s] is loop:
            succs[("b", s)] = [(kind, node_of(t)) for kind, t in cfg.blocks[s].succs]
    for child in (loop.children if loop is not None else cfg.top_loops):
        exits = {node_of(t) for s in child.body for _, t in cfg.blocks[s].succs if t == EXIT or t not in child.body}
        if len(exits) != 1:
            raise ValueError(f"the loop at {child.header:#06x} leaves to {len(exits)} places; one exit is modelled")
        succs[("L", child.header)] = [("exit", exits.pop())]
    entry = ("b", loop.header) if loop is not None else node_of(cfg.entry)
    order, state = [], {entry: 1}
    stack = [(entry, iter([t for _, t in succs[entry]]))]
    while stack:
        node, it = stack[-1]
        nxt = None
        for t in it:
            if t != SINK and state.get(t) == 1:
                raise ValueError(f"a cycle through {t} that is no natural loop")
            if t != SINK and t not in state:
                nxt = t
                break
        if nxt is None:
            state[node] = 2
            order.append(node)
            stack.pop()
        else:
            state[nxt] = 1
            stack.append((nxt, iter([t for _, t in succs[nxt]])))
    order.reverse()
    pdom = {SINK: frozenset([SINK])}
    for node in reversed(order):
        pdom[node] = frozenset.intersection(*[pdom[t] for _, t in succs[node]]) | {node}
    ipdom = {node: max(pdom[node] - {node}, key=lambda p: len(pdom[p])) for node in order}
    branches = sorted((n for n in order if n[0] == "b" and len({t for _, t in succs[n]}) > 1), key=lambda n: n[1])
    control: Dict[tuple, List[Tuple[tuple, str]]] = {n: [] for n in order}
    for x in branches:
        for side, s in succs[x]:
            p = s
            while p != ipdom[x]:
                control[p].append((x, side))
                p = ipdom[p]
    return Region(loop, entry, order, succs, branches, ipdom, control)


def side_nodes(reg: Region, x: tuple, side: str) -> List[tuple]:
    return [n for n in reg.nodes if (x, side) in reg.control[n]]


def node_text(cfg: CFG, node: tuple) -> List[str]:
    if node[0] == "b":
        return [t for _, t in cfg.blocks[node[1]].instructions]
    loop = next(loop for loop in cfg.loops if loop.header == node[1])
    return [t for s in sorted(loop.body) for _, t in cfg.blocks[s].instructions]


def describe_branch(cfg: CFG, reg: Region, x: tuple) -> str:
    """``0x0720 @P1 BRA 0x950 | taken: - | fallthrough: 34 IABS I2F.RP ...``: the branch and what each side holds
    (its instructions' opcodes; ``EXIT`` for a side that exits, ``-`` for a side with no blocks)."""
    block = cfg.blocks[x[1]]
    address, text = block.instructions[-1]
    parts = [f"{address:#06x} {text}"]
    for side, _ in reg.succs[x]:
        nodes = side_nodes(reg, x, side)
        ops = [opcode(t) for n in nodes for t in node_text(cfg, n)]
        held = f"{len(ops)} " + " ".join(ops) if ops else ("EXIT" if opcode(text) == "EXIT" and side == "taken"
                                                          else "-")
        parts.append(f"{side}: {held}")
    return " | ".join(parts)


# ======================================================================================================================
# 3. Weighting the blocks
# ======================================================================================================================

def _value(number: Number, d: Any) -> float:
    return float(number(d) if callable(number) else number)


def _model_tree(loop: Loop) -> str:
    inner = " ".join(_model_tree(c) for c in loop.loops)
    return f"[{loop.name}{' ' + inner if inner else ''}]"


@dataclass
class Count:
    """Warp executions of every block of one function for one launch, and what follows from them."""
    warp_instructions: float
    blocks: Dict[int, float]  # block start -> warp executions
    own: Dict[str, float]  # region name -> warp instructions of its own blocks ("prologue" / "epilogue" outside)
    total: Dict[str, float]  # loop name -> warp instructions of the loop, inner loops included
    loop_text: Dict[str, List[str]]  # loop name -> its instructions
    shared_read: float  # lane bytes
    shared_write: float


def weigh(cfg: CFG, model: KernelModel, d: Any) -> Count:
    """Every block's warp executions for the launch ``d`` describes: ``d.blocks x d.threads / 32`` warps enter the
    function; each loop's header runs ``trips`` times per entry; within a body, a block runs as often as the body's
    entry when no branch controls it, else as its controlling branch's block times the fraction of that side."""
    found_tree, model_tree = cfg.tree(), _model_tree(model.body)

    def check(found: List[FoundLoop], declared: Tuple[Loop, ...], where: str) -> None:
        if len(found) != len(declared):
            raise ModelMismatch(f"{model.family}: {len(found)} loops in {where} of the SASS, {len(declared)} in the "
                                f"model; found {found_tree}, declared {model_tree}")
        for f, m in zip(found, declared):
            check(f.children, m.loops, f"loop {m.name!r}")

    check(cfg.top_loops, model.body.loops, "the function")
    counts: Dict[int, float] = {}
    own: Dict[str, float] = {}
    total: Dict[str, float] = {}
    loop_text: Dict[str, List[str]] = {}
    first_loop = cfg.top_loops[0].header if cfg.top_loops else math.inf

    def visit(found: Optional[FoundLoop], declared: Loop, entries: float) -> float:
        reg = region(cfg, found)
        rules = list(declared.branches(d) if callable(declared.branches) else declared.branches)
        where = f"{model.family}, {'the function' if found is None else 'loop ' + repr(declared.name)}"
        if len(rules) != len(reg.branches):
            listing = "\n".join(f"  {describe_branch(cfg, reg, x)}" for x in reg.branches)
            raise ModelMismatch(f"{where}: {len(reg.branches)} branches in the SASS, {len(rules)} in the model "
                                f"({[r.what for r in rules]}):\n{listing}")
        fraction: Dict[tuple, Dict[str, float]] = {}
        for x, rule in zip(reg.branches, rules):
            text = describe_branch(cfg, reg, x)
            last = cfg.blocks[x[1]].instructions[-1][1]
            if rule.kind == "exit" and opcode(last) != "EXIT":
                raise ModelMismatch(f"{where}: {rule.what!r} is declared an EXIT, the SASS has {text}")
            if rule.kind == "skip" and side_nodes(reg, x, "taken"):
                raise ModelMismatch(f"{where}: {rule.what!r} is declared a skip (taken side empty), the SASS has "
                                    f"{text}")
            pattern = rule.match(d) if callable(rule.match) else rule.match
            haystack = text + " | block: " + " ; ".join(t for _, t in cfg.blocks[x[1]].instructions)
            if pattern and not re.search(pattern, haystack):
                raise ModelMismatch(f"{where}: {rule.what!r} should match {pattern!r}, the SASS has {haystack}")
            fraction[x] = {"taken": _value(rule.taken, d), "fallthrough": _value(rule.fallthrough, d)}
        trips = _value(declared.trips, d)
        freq = {reg.entry: entries * trips}
        children = {c.header: (c, m) for c, m in zip(found.children if found else cfg.top_loops, declared.loops)}
        subtotal = 0.0
        for node in reg.nodes[1:]:
            deps = reg.control[node]
            if len(deps) > 1:
                raise ModelMismatch(f"{where}: the block at {node[1]:#06x} depends on {len(deps)} branches "
                                    f"({', '.join(f'{x[1]:#06x} {s}' for x, s in deps)}); not modelled")
            freq[node] = freq[reg.entry] if not deps else freq[deps[0][0]] * fraction[deps[0][0]][deps[0][1]]
        for node in reg.nodes:
            if node[0] == "b":
                block = cfg.blocks[node[1]]
                counts[node[1]] = freq[node]
                n = freq[node] * len(block.instructions)
                name = declared.name if found is not None else "prologue" if node[1] < first_loop else "epilogue"
                own[name] = own.get(name, 0.0) + n
                subtotal += n
            else:
                child, child_model = children[node[1]]
                loop_text[child_model.name] = node_text(cfg, node)
                subtotal += visit(child, child_model, freq[node])
        if found is not None:
            total[declared.name] = subtotal
        return subtotal

    warps = d.blocks * d.threads / 32
    whole = visit(None, model.body, warps)
    read = write = 0.0
    for start, n in counts.items():
        for _, text in cfg.blocks[start].instructions:
            r, w = shared_bytes(opcode(text))
            read, write = read + 32 * n * r, write + 32 * n * w
    return Count(whole, counts, own, total, loop_text, read, write)


# ======================================================================================================================
# 4. Resources
# ======================================================================================================================

def _width(parts: Sequence[str]) -> int:
    for p in parts:
        if p in ("128", "64", "32"):
            return int(p) // 8
        if p in ("U8", "S8"):
            return 1
        if p in ("U16", "S16"):
            return 2
    return 4


def shared_bytes(op: str) -> Tuple[int, int]:
    """(bytes read, bytes written) of shared memory per lane by one instruction: ``LDS.128`` (16, 0),
    ``LDSM.16.M88.4`` (16, 0: four 8x8 b16 matrices per warp), ``STS`` (0, 4), ``LDGSTS.E.BYPASS.128`` (0, 16)."""
    parts = op.split(".")
    if parts[0] in ("LDSM", "STSM"):
        n = 16 if parts[-1] == "4" else 8 if parts[-1] == "2" else 4
        return (n, 0) if parts[0] == "LDSM" else (0, n)
    if parts[0] == "LDS":
        return _width(parts[1:]), 0
    if parts[0] in ("STS", "LDGSTS"):
        return 0, _width(parts[1:])
    if parts[0] == "ATOMS":
        return _width(parts[1:]), _width(parts[1:])
    return 0, 0


def global_load_bytes(op: str) -> int:
    """Bytes per lane of a global load (``LDG.E.128`` 16, ``LDG.E.U8`` 1); 0 for anything else."""
    parts = op.split(".")
    return _width(parts[1:]) if parts[0] == "LDG" else 0


def resident_blocks(registers: int, threads: int, shared: int) -> int:
    """Blocks of `threads` threads with `registers` registers each and `shared` bytes per block that fit on one SM at
    :data:`SM90`'s limits."""
    warps = _ceil(threads, 32)
    per_warp = _ceil(max(registers, 1) * 32, SM90["register_unit"]) * SM90["register_unit"]
    by_registers = SM90["registers"] // (per_warp * warps)
    smem = _ceil(shared, SM90["shared_unit"]) * SM90["shared_unit"]
    by_shared = SM90["shared"] // smem if smem else SM90["blocks"]
    return min(SM90["blocks"], SM90["warps"] // warps, by_registers, by_shared)


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


# ======================================================================================================================
# 5. The loop-only count of issue 28 (per instantiation)
# ======================================================================================================================

@dataclass
class LoopFigure:
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
    mangled: str = ""


def loops(instructions: List[Tuple[int, str]]) -> List[LoopFigure]:
    """Every loop closed by a backward branch: from the target to the last branch back to it (static ranges)."""
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
        out.append(LoopFigure(start, end, len(body), ffma))
    return out


def steady_state_loop(instructions: List[Tuple[int, str]]) -> Optional[LoopFigure]:
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


def _format_bits() -> Dict[str, int]:
    sys.path.insert(0, str(REPO))
    import ds_fpquant as fpq
    from ds_fpquant.numerics.formats import get_format

    return {f: get_format(f).bits for f in fpq.FORMATS}


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


def budgets(sass: str, res_usage: str = "", ptxas_log: str = "", match: str = "gemv") -> List[KernelBudget]:
    """Issue 28's loop-only figure of every function whose mangled name contains `match`."""
    return _budgets(split_functions(sass), res_usage, ptxas_log, match)


def _budgets(functions: Dict[str, List[Tuple[int, str]]], res_usage: str, ptxas_log: str,
             match: str) -> List[KernelBudget]:
    functions = {n: ins for n, ins in functions.items() if match in n}
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
                                spills.get(mangled), mangled))
    return out


# ======================================================================================================================
# 6. Whole-kernel rows: one per instantiation and launch
# ======================================================================================================================

@dataclass
class LaunchBudget:
    fmt: str
    x_dtype: str
    m: int
    shape: str  # "NxK"
    group_size: int
    scale_format: str
    kernel: str  # demangled
    rows: int  # rows of x the instantiation serves
    variant: str
    loop_per_weight: float  # executed lane instructions of the steady-state loop per weight
    loop_per_weight_static: Optional[float]  # issue 28's static figure of the instantiation
    whole_per_weight: float
    phases_per_weight: Dict[str, float]
    registers: Optional[int]
    spills: Optional[int]
    stack: Optional[int]
    smem_bytes_per_block: int
    resident_blocks_per_sm: int
    resident_warps_per_sm: int
    inflight_bytes_per_sm: float
    smem_bytes_per_weight: float  # read + written
    smem_read_bytes_per_weight: float
    warp_instructions: float
    grid_blocks: int
    family: str


def whole_kernel(functions: Dict[str, List[Tuple[int, str]]], res_usage: str = "", ptxas_log: str = "",
                 models: Sequence[KernelModel] = MODELS, launch_list: Optional[Sequence[Launch]] = None,
                 static: Optional[Dict[str, float]] = None) -> List[LaunchBudget]:
    """One row per launch of every family whose functions are in `functions` (the stated launches unless
    `launch_list`); raises when a family lacks the instantiation a launch needs, or when its model does not fit."""
    usage, spills = parse_usage(res_usage), parse_spills(ptxas_log)
    names = demangle(sorted(functions))
    out = []
    for model in models:
        members = [n for n in sorted(functions) if re.search(model.match, names[n])]
        if not members:
            continue
        instances = [replace(model.describe(names[mangled]), mangled=mangled) for mangled in members]
        cfgs: Dict[str, CFG] = {}
        wanted = launch_list if launch_list is not None else launches(sorted({i.fmt for i in instances}), model.max_m)
        used = set()
        for launch in wanted:
            inst = _instance_for(model, instances, launch)
            used.add(inst.mangled)
            cfg = cfgs.get(inst.mangled) or cfgs.setdefault(inst.mangled, CFG(functions[inst.mangled]))
            d = model.derive(inst, launch)
            count = weigh(cfg, model, d)
            weights = launch.n * launch.k
            per = 32 / weights
            u = usage.get(inst.mangled, {})
            smem = u.get("SHARED", 0) + d.dynamic_smem
            blocks = resident_blocks(u.get("REG", 0), d.threads, smem)
            phases = {name: round(count.own.get(name, 0.0) * per, 4) for name in model.phases}
            out.append(LaunchBudget(
                launch.fmt, launch.x_dtype, launch.m, launch.shape, launch.group_size, launch.scale_format, inst.name,
                inst.rows, inst.variant, round(count.total.get(model.steady, 0.0) * per, 4),
                (static or {}).get(inst.mangled), round(count.warp_instructions * per, 4), phases, u.get("REG"),
                spills.get(inst.mangled), u.get("STACK"), smem, blocks, blocks * _ceil(d.threads, 32),
                round(model.inflight(d, count.loop_text) * blocks, 1),
                round((count.shared_read + count.shared_write) / weights, 4), round(count.shared_read / weights, 4),
                count.warp_instructions, d.blocks, model.family))
        if launch_list is None and model.probe is not None:  # the model must fit every function of the family
            for inst in instances:
                if inst.mangled not in used:
                    launch = model.probe(inst)
                    if _instance_for(model, instances, launch) is not inst:
                        raise ModelMismatch(f"{model.family}: the probe {launch} does not run {inst.name}")
                    weigh(CFG(functions[inst.mangled]), model, model.derive(inst, launch))
    return out


def _instance_for(model: KernelModel, instances: Sequence[Instance], launch: Launch) -> Instance:
    picked = [i for i in instances if i.fmt == launch.fmt and model.runs(i, launch)]
    if len(picked) != 1:
        raise ModelMismatch(f"{model.family}: {len(picked)} instantiations run {launch}")
    return picked[0]


def launch_table(rows: List[LaunchBudget], phases: Sequence[str] = GEMV.phases) -> str:
    head = ["format", "x", "M", "N x K", "G", "scales", "rows, full", *phases, "whole", "loop", "loop (issue 28)",
            "regs", "spills", "smem / block", "warps / SM", "in flight / SM", "smem B / weight"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        static = "-" if r.loop_per_weight_static is None else f"{r.loop_per_weight_static:.2f}"
        cells = [r.fmt, r.x_dtype, r.m, r.shape, r.group_size, r.scale_format, f"{r.rows}, {r.variant}",
                 *[f"{r.phases_per_weight.get(p, 0.0):.2f}" for p in phases], f"{r.whole_per_weight:.2f}",
                 f"{r.loop_per_weight:.2f}", static, r.registers, r.spills, r.smem_bytes_per_block,
                 r.resident_warps_per_sm, f"{r.inflight_bytes_per_sm / 1024:.1f} KiB", f"{r.smem_bytes_per_weight:.2f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _show_region(cfg: CFG, loop: Optional[FoundLoop], depth: int, count: Optional[Count], warps: float,
                 weights: float, out: List[str]) -> None:
    reg = region(cfg, loop)
    pad = "  " * (depth + 1)
    out.append(f"{pad}{'function' if loop is None else f'loop {loop.header:#06x}'}: {len(reg.branches)} branches")
    for node in sorted(reg.nodes, key=lambda n: n[1]):
        succ = ", ".join(f"{k} {'end' if t == SINK else f'{t[1]:#06x}'}" for k, t in reg.succs[node])
        size = len(node_text(cfg, node))
        runs = ""
        if count is not None and node[0] == "b":
            n = count.blocks[node[1]]
            runs = f"  x {n / warps:g} per warp = {n * size / warps:g} ({n * size * 32 / weights:.4f} / weight)"
        out.append(f"{pad}  {'block' if node[0] == 'b' else 'loop '} {node[1]:#06x} {size:4d} instructions -> "
                   f"{succ}{runs}")
    for i, x in enumerate(reg.branches):
        out.append(f"{pad}  branch {i}: {describe_branch(cfg, reg, x)[:300]}")
    for child in (loop.children if loop is not None else cfg.top_loops):
        _show_region(cfg, child, depth + 1, count, warps, weights, out)


def cfg_listing(functions: Dict[str, List[Tuple[int, str]]], pattern: str, models: Sequence[KernelModel] = MODELS,
                shape: Tuple[int, int] = (4096, 4096), group_size: int = 128, scale_format: str = "fp32",
                m: Optional[int] = None, bias: bool = False) -> str:
    """The CFG of every function whose mangled or demangled name matches `pattern`, for writing or checking a model:
    the loop tree, and per body its blocks (start, instructions, successors) and branches (:func:`describe_branch`).
    Where a family's model fits, each block's warp executions per warp and its share of the whole count for the
    launch (shape, G, scales, M: the instantiation's rows unless given; the model's probe if that launch does not
    run this instantiation); where it does not fit, why."""
    names = demangle(sorted(functions))
    out = []
    for mangled in sorted(functions):
        if not (re.search(pattern, mangled) or re.search(pattern, names[mangled])):
            continue
        cfg = CFG(functions[mangled])
        out.append(f"{names[mangled]}\n  loops: {cfg.tree()}")
        count, warps, weights = None, 1.0, 1.0
        model = next((mo for mo in models if re.search(mo.match, names[mangled])), None)
        if model is not None:
            inst = replace(model.describe(names[mangled]), mangled=mangled)
            launch = Launch(inst.fmt, inst.dtype, m or inst.rows, shape[0], shape[1], group_size, scale_format, bias)
            if not model.runs(inst, launch) and model.probe is not None:
                launch = model.probe(inst)
            try:
                d = model.derive(inst, launch)
                count = weigh(cfg, model, d)
                warps, weights = d.blocks * d.threads / 32, launch.n * launch.k
                out.append(f"  {model.family}, {launch}: {count.warp_instructions / warps:g} warp instructions per "
                           f"warp, {count.warp_instructions * 32 / weights:.4f} lane instructions per weight")
            except ModelMismatch as exc:
                out.append(f"  the model does not fit: {exc}")

        _show_region(cfg, None, 0, count, warps, weights, out)
    return "\n".join(out)


# ======================================================================================================================
# 7. Build, output
# ======================================================================================================================

def _op_builder():
    """(cuda_tool, FPQuantizerBuilder): the installed ``ds_fpquant.op_builder``, else the checkout's ``op_builder/``
    (what setup.py installs under that name), for an environment that has this tree on PYTHONPATH only."""
    sys.path.insert(0, str(REPO))
    try:
        from ds_fpquant.op_builder.builder import cuda_tool
        from ds_fpquant.op_builder.fp_quantizer import FPQuantizerBuilder
    except ModuleNotFoundError:
        from op_builder.builder import cuda_tool
        from op_builder.fp_quantizer import FPQuantizerBuilder
    return cuda_tool, FPQuantizerBuilder


def nvcc_command(source: Path, obj: Path) -> List[str]:
    """nvcc with the builder's flags, for sm_90 only, with ptxas's resource report."""
    cuda_tool, FPQuantizerBuilder = _op_builder()
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
    cuda_tool, _ = _op_builder()
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
    parser.add_argument("--json", help="write the whole-kernel rows (one per instantiation and launch) as JSON here")
    parser.add_argument("--sass", help="a cuobjdump -sass listing to read instead of building")
    parser.add_argument("--res-usage", help="its cuobjdump -res-usage output")
    parser.add_argument("--ptxas", help="its ptxas -v log")
    parser.add_argument("--keep", help="folder to keep the build's SASS, res-usage and ptxas log in")
    parser.add_argument("--cfg", metavar="REGEX", help="print the CFG of the GEMV functions matching REGEX, with each "
                        "block's count for the launch below, and stop")
    parser.add_argument("--shape", default="4096x4096", help="--cfg's launch: N x K (default 4096x4096)")
    parser.add_argument("--group-size", type=int, default=128, help="--cfg's launch: G (default 128)")
    parser.add_argument("--scale-format", default="fp32", choices=("fp32", "e8m0", "e4m3"),
                        help="--cfg's launch: scales (default fp32)")
    parser.add_argument("--m", type=int, help="--cfg's launch: rows of x (default: the instantiation's)")
    parser.add_argument("--bias", action="store_true", help="--cfg's launch: with a bias")
    parser.add_argument("--x-dtype", action="append", help="rows of the table for this x dtype only (repeatable; "
                        "the JSON has every dtype)")
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
    functions = {n: ins for n, ins in split_functions(sass).items() if FUNCTIONS in n}
    if args.cfg:
        n, k = (int(v) for v in args.shape.lower().split("x"))
        print(cfg_listing(functions, args.cfg, shape=(n, k), group_size=args.group_size,
                          scale_format=args.scale_format, m=args.m, bias=args.bias))
        return 0
    loop_rows = _budgets(functions, usage, log, FUNCTIONS)
    print("Loop only (issue 28): the steady-state loop's static count, per instantiation\n")
    print(table(loop_rows))
    static = {r.mangled: r.instructions_per_weight for r in loop_rows if math.isfinite(r.instructions_per_weight)}
    rows = whole_kernel(functions, usage, log, static=static)
    for model in MODELS:
        shown = [r for r in rows if r.family == model.family and (not args.x_dtype or r.x_dtype in args.x_dtype)]
        if shown:
            print(f"\nWhole kernel (issue 37), {model.family}: executed lane instructions per weight, per launch\n")
            print(launch_table(shown, model.phases))
    if args.json:
        Path(args.json).write_text("[\n" + ",\n".join(json.dumps(asdict(r)) for r in rows) + "\n]\n")  # a row a line
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    sys.exit(main())
