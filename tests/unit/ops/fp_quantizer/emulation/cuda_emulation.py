"""Build and drive the CPU emulation of the CUDA kernels (no GPU, no CUDA runtime: g++ only).

:func:`build` compiles ``emulated_op.cpp`` (the kernels of ``csrc/fp_quantizer/includes/
fp_quantize_kernels.cuh`` and ``fp_gemv_kernels.cuh`` under ``cuda_emulation.h``) with AddressSanitizer and
UndefinedBehaviorSanitizer, for an emulated ``__CUDA_ARCH__`` (900, 890, or ``None`` for the software
codec path), cached by the hash of every source and flag. :class:`EmulatedCudaOp` has the compiled
op's ``quantize`` / ``dequantize`` signatures, so the public API runs on it unchanged (see
:func:`installed_as_cpu_op`); each call is served by a persistent emulation process. A fault in the
kernels (ASan, UBSan, a divergent shuffle, a deadlock, an unwritten output byte) kills that process
and raises :class:`EmulationFault` with its report.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch
from unit.oracle import assert_bitwise_equal

import ds_fpquant as fpq
from ds_fpquant.numerics.formats import get_format
from ds_fpquant.numerics.packing import row_bytes
from ds_fpquant.ops import backends

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[4]
KERNEL_INCLUDES = REPO / "csrc" / "fp_quantizer" / "includes"
SOURCES = (HERE / "emulated_op.cpp", HERE / "cuda_emulation.h")
CXX = os.environ.get("CXX", "g++")
#: -Wconversion: an implicit narrowing of the kernels' 64-bit index arithmetic fails the build (no test
#: reaches 2^31 elements); float-cast-overflow: host and GPU differ on out-of-range float -> int casts.
FLAGS = ("-std=gnu++17", "-O1", "-g", "-fsanitize=address,undefined,float-cast-overflow", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wconversion",
         "-Wno-sign-conversion", "-Wno-unknown-pragmas", "-Werror")
#: The sanitizers stop at the first error; no leak check (the process is killed at the end of the tests).
ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
       "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}

#: The process aborts a request after 300 s itself (emulated_op.cpp); this also covers a stuck pipe.
RESPONSE_TIMEOUT_S = 330
_MAGIC = 0x31554D4551504655
_REQUEST = struct.Struct("<Q8i4q2Q6q3q2ifi2i")
_RESPONSE = struct.Struct("<Q5q3Q2q2qQ")
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # fpq::DType
_SCALE_MODES = {"": 0, "ceil": 1, "floor": 2}  # fpq::ScaleMode
_SCALE_KINDS = {"fp32": 0, "e8m0": 1, "e4m3": 2}  # fpq::LinearScale


@dataclass
class WorkspaceInfo:
    """The split-K counters' workspace after a linear call, as the launcher keeps it (fp_gemv_workspace.h)."""

    created: int  # buffers created on the device so far, every stream
    capacity: int  # counters of the call's stream's buffer (0: none yet)
    counters: int  # its address


class EmulationFault(AssertionError):
    """The emulated kernel did something a GPU would fault on or that breaks the launch contract."""


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def cache_dir() -> Path:
    return Path(os.environ.get("DS_FPQUANT_EMULATION_CACHE", Path.home() / ".cache" / "ds_fpquant" / "emulation"))


def build(arch: Optional[int], headers: Optional[Dict[str, str]] = None) -> Path:
    """The emulation executable for ``__CUDA_ARCH__ = arch`` (unset for ``None``), built once per source hash.

    ``headers`` maps file names of ``csrc/fp_quantizer/includes`` to replacement texts (the deliberately
    broken kernels of the fault-injection tests): the build then uses a copy of that folder with them.
    """
    flags = list(FLAGS) + ([f"-D__CUDA_ARCH__={arch}"] if arch is not None else [])
    headers = dict(headers or {})
    sources = {path.name: path.read_text() for path in sorted(KERNEL_INCLUDES.iterdir())}
    unknown = set(headers) - set(sources)
    if unknown:
        raise ValueError(f"headers={sorted(unknown)} are not in {KERNEL_INCLUDES}")
    sources.update(headers)
    version = subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([CXX, version, *flags]).encode())
    for name, text in [*sorted(sources.items()), *((p.name, p.read_text()) for p in SOURCES)]:
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    out = cache_dir() / f"emulated_op-sm{arch or 'none'}-{digest.hexdigest()[:20]}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        includes = KERNEL_INCLUDES
        if headers:  # a whole copy, so that headers including each other see the replaced texts
            includes = Path(tmp, "includes")
            includes.mkdir()
            for name, text in sources.items():
                (includes / name).write_text(text)
        exe = Path(tmp, "emulated_op")
        proc = subprocess.run([CXX, *flags, f"-I{includes}", f"-I{HERE}", str(HERE / "emulated_op.cpp"), "-o", str(exe)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CUDA emulation failed:\n{proc.stderr[-4000:]}")
        os.replace(exe, out)  # atomic: a concurrent build of the same hash gives the same file
    return out


@dataclass
class LaunchInfo:
    """The launch the last call made (None: the geometry had no groups, nothing was launched)."""

    grid_x: int
    block_x: int
    team_log2: int
    total_groups: int
    threads: int
    grid_y: int = 1  # the GEMV: splits of K
    shared_bytes: int = 0  # the GEMV: dynamic shared memory per block

    @property
    def grid_stride_wraps(self) -> bool:
        """Whether a team had more than one group (the grid-stride loop went round)."""
        return (self.grid_x * self.block_x) >> self.team_log2 < self.total_groups


class EmulatedCudaOp:
    """The compiled CUDA op's ``quantize``/``dequantize`` (fp_quantize_binding.cpp signatures, CPU tensors
    in and out), executed by the CUDA kernels in the emulation.

    Attributes set by tests: ``misalign`` (bytes each buffer's start is moved off its 256-byte aligned
    allocation: keys ``x``, ``given``, ``codes``, ``scales``, ``out``), ``max_blocks`` (grid cap; the
    kernels' grid-stride loops take the rest), ``num_sms`` (the SM count the GEMV's plan fills: fewer tiles than
    it asks for split K), ``stream`` (the stream id linear launches on: the split-K counters are per device and
    stream). ``last_launch`` describes the last call's launch, ``last_workspace`` the split-K counters' workspace after
    the last linear call (one process: it lives as long as the process, like the CUDA op's in a torch process).
    """

    def __init__(self, arch: Optional[int], headers: Optional[Dict[str, str]] = None):
        self.arch = arch
        self.exe = build(arch, headers)
        self.misalign: Dict[str, int] = {}
        self.max_blocks = 1 << 20
        self.num_sms = 132  # the GEMV's plan: the SM count it fills (an H100 / H200 SXM)
        self.stream = 0
        self.last_workspace: Optional[WorkspaceInfo] = None
        self.last_launch: Optional[LaunchInfo] = None
        self.last_fp8_conversions = 0  # values the last call put through the emulated sm_89+ fp8 conversion
        self.calls = 0
        self._proc: Optional[subprocess.Popen] = None
        self._stderr = None

    # ---- process ----
    def _start(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._stderr = tempfile.TemporaryFile()
            self._proc = subprocess.Popen([str(self.exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._stderr, env={**os.environ, **ENV})
        return self._proc

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=30)
        self._proc = None

    def _fault(self, what: str) -> EmulationFault:
        proc, self._proc = self._proc, None
        with contextlib.suppress(Exception):
            proc.kill()
        proc.wait()
        self._stderr.seek(0)
        report = self._stderr.read().decode(errors="replace")
        lines = [line for line in report.splitlines() if "swapcontext" not in line]
        keys = ("ERROR: AddressSanitizer", "runtime error:", "cuda-emulation:")
        reason = next((line.strip() for line in lines if any(key in line for key in keys)), "no report")
        return EmulationFault(f"{what}: the emulated CUDA kernel failed (exit {proc.returncode}): {reason}\n"
                              + "\n".join(lines)[-6000:])

    def _call(self, header: bytes, inputs: Sequence[bytes], out_sizes: Sequence[int], what: str):
        proc = self._start()
        try:
            proc.stdin.write(header)
            for buf in inputs:
                proc.stdin.write(buf)
            proc.stdin.flush()
            if not select.select([proc.stdout], [], [], RESPONSE_TIMEOUT_S)[0]:
                raise self._fault(f"{what}: no response within {RESPONSE_TIMEOUT_S} s")
            raw = proc.stdout.read(_RESPONSE.size)
            if len(raw) != _RESPONSE.size:
                raise self._fault(what)
            outs = [proc.stdout.read(n) for n in out_sizes]
        except BrokenPipeError:
            raise self._fault(what) from None
        if any(len(o) != n for o, n in zip(outs, out_sizes)):
            raise self._fault(what)
        (magic, launched, grid_x, block_x, team_log2, total, threads, _, conversions, grid_y, shared, ws_created,
         ws_capacity, ws_counters) = _RESPONSE.unpack(raw)
        assert magic == _MAGIC
        self.calls += 1
        self.last_launch = LaunchInfo(grid_x, block_x, team_log2, total, threads, grid_y, shared) if launched else None
        self.last_fp8_conversions = conversions
        self.last_workspace = WorkspaceInfo(ws_created, ws_capacity, ws_counters)
        return outs

    def _request(self, op, f, dtype, rows, k, group_size, scale_mode=0, stochastic=False, has_given=False,
                 seed=0, offset=0, misalign=(), m=0, block_rows=1, scale_cols=0, scale_kind=0, has_bias=False,
                 tensor_scale=1.0, num_sms=0, stream=0) -> bytes:
        misalign = (*misalign, *(0,) * (6 - len(misalign)))
        return _REQUEST.pack(_MAGIC, op, f.ebits, f.mbits, _DTYPES[dtype], scale_mode, int(stochastic),
                             int(has_given), 0, rows, k, group_size, self.max_blocks, seed, offset, *misalign,
                             m, block_rows, scale_cols, scale_kind, int(has_bias), tensor_scale, num_sms, stream, 0)

    # ---- the op interface ----
    def quantize(self, x, fmt, group_size, given_scales, stochastic, seed, offset, e8m0):
        """x (rows, k) contiguous fp32/fp16/bf16 -> [codes uint8 (rows, row_bytes), scales (rows, ceil(k/G))]."""
        f = get_format(fmt)
        rows, k = x.shape
        group_size = min(group_size, max(k, 1))  # as the binding does
        n_groups = -(-k // group_size)
        nbytes = row_bytes(k, group_size, f.bits)
        m = self.misalign
        header = self._request(0, f, x.dtype, rows, k, group_size, _SCALE_MODES[e8m0], stochastic,
                               given_scales is not None, seed, offset,
                               (m.get("x", 0), m.get("given", 0), m.get("codes", 0), m.get("scales", 0)))
        inputs = [_raw(x)] + ([_raw(given_scales)] if given_scales is not None else [])
        scale_dtype = torch.uint8 if e8m0 else torch.float32
        scale_size = rows * n_groups * (1 if e8m0 else 4)
        codes, scales = self._call(header, inputs, [rows * nbytes, scale_size], f"quantize {fmt} G={group_size}")
        return [_tensor(codes, torch.uint8, (rows, nbytes)), _tensor(scales, scale_dtype, (rows, n_groups))]

    def dequantize(self, codes, scales, k, fmt, group_size, out_dtype):
        """codes (rows, row_bytes) uint8 + fp32 scales (rows, ceil(k/G)) -> (rows, k) of ``out_dtype``."""
        f = get_format(fmt)
        rows = codes.shape[0]
        group_size = min(group_size, max(k, 1))
        m = self.misalign
        header = self._request(1, f, out_dtype, rows, k, group_size,
                               misalign=(m.get("codes", 0), m.get("scales", 0), m.get("out", 0)))
        size = rows * k * torch.empty((), dtype=out_dtype).element_size()
        (out,) = self._call(header, [_raw(codes), _raw(scales)], [size], f"dequantize {fmt} G={group_size}")
        return _tensor(out, out_dtype, (rows, k))


    def linear(self, x, codes, scales, scale_kind, block_rows, tensor_scale, bias, fmt, group_size):
        """The CUDA binding's linear for m <= 16 rows (the tensor-core GEMV): x (m, k) fp32/fp16/bf16, codes
        (n, row_bytes), scales ``(ceil(n / block_rows), ceil(k / G))`` of ``scale_kind`` ("fp32", "e8m0",
        "e4m3" with ``tensor_scale``), optional bias (n,) -> y (m, n) of x's dtype."""
        f = get_format(fmt)
        m, k = x.shape
        n = codes.shape[0]
        group_size = min(group_size, max(k, 1))
        kind = _SCALE_KINDS[scale_kind]
        mis = self.misalign
        header = self._request(2, f, x.dtype, n, k, group_size, has_bias=bias is not None,
                               misalign=(mis.get("x", 0), mis.get("codes", 0), mis.get("scales", 0),
                                         mis.get("bias", 0), mis.get("y", 0)),
                               m=m, block_rows=block_rows, scale_cols=scales.shape[1], scale_kind=kind,
                               tensor_scale=tensor_scale, num_sms=self.num_sms, stream=self.stream)
        inputs = [_raw(x), _raw(codes), _raw(scales)] + ([_raw(bias.to(x.dtype))] if bias is not None else [])
        size = m * n * x.element_size()
        (y,) = self._call(header, inputs, [size], f"linear {fmt} G={group_size} m={m}")
        return _tensor(y, x.dtype, (m, n))


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(raw: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


@contextlib.contextmanager
def installed_as_cpu_op(op: EmulatedCudaOp):
    """While in scope, ``backend="cpu"`` calls of the public API run on ``op`` (CPU tensors in, the
    emulated CUDA kernels doing the work), exactly as ``backend="cuda"`` calls run the compiled op."""
    saved = backends._ops.get("cpu")
    backends._ops["cpu"] = (op, "")
    try:
        yield op
    finally:
        if saved is None:
            backends._ops.pop("cpu", None)
        else:
            backends._ops["cpu"] = saved


def build_all(specs: Sequence[Tuple[Optional[int], Optional[Dict[str, str]]]]) -> None:
    """Build the executables of the ``(arch, headers)`` pairs, in parallel (one compiler per core)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(specs), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda spec: build(*spec), specs))


def start_ops(archs: Sequence[Optional[int]]) -> Dict[Optional[int], EmulatedCudaOp]:
    """An :class:`EmulatedCudaOp` of the repository's kernels per arch."""
    build_all([(arch, None) for arch in archs])
    return {arch: EmulatedCudaOp(arch) for arch in archs}


# ---- comparisons used by the tests ----------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def lanes_per_group(group_size: int) -> int:
    """The kernels' team size: one 8-element chunk per lane, a power of two, at most a warp."""
    lanes = 1
    while lanes < 32 and 8 * lanes < group_size:
        lanes *= 2
    return lanes


def _bits(t: torch.Tensor) -> torch.Tensor:
    """16-bit outputs compared bit for bit (one NaN pattern on every backend); fp32 with NaN == NaN (a GPU
    writes the canonical NaN 0x7FFFFFFF where the CPU keeps 0x7FC00000)."""
    return t.view(torch.int16) if t.element_size() == 2 else t


def check_against_reference(op, x, fmt="e4m3", group_size=None, out_dtypes=DTYPES, **kwargs):
    """Quantize ``x`` on the emulated op and on the torch reference, dequantize both to ``out_dtypes``,
    and compare every output bit for bit. Returns the emulated result."""
    ref = fpq.quantize(x, fmt, group_size, backend="torch", **kwargs)
    with installed_as_cpu_op(op):
        got = fpq.quantize(x, fmt, group_size, backend="cpu", **kwargs)
        outs = {dtype: fpq.dequantize(got, dtype, backend="cpu") for dtype in out_dtypes}
    what = f"sm{op.arch} {fmt} G={group_size} {kwargs} {x.dtype} {tuple(x.shape)}"
    assert_bitwise_equal(got.codes, ref.codes, what + " codes")
    assert_bitwise_equal(got.scales, ref.scales, what + " scales")
    if ref.tensor_scale is not None:
        assert_bitwise_equal(got.tensor_scale, ref.tensor_scale, what + " tensor scale")
    for dtype, y in outs.items():
        assert_bitwise_equal(_bits(y), _bits(fpq.dequantize(ref, dtype, backend="torch")), what + f" -> {dtype}")
    return got


def run_gemv(op, x, qt, bias):
    """The emulated op's linear with the arguments ds_fpquant.linear.weight_only gives the compiled op for CUDA tensors."""
    from ds_fpquant.linear import weight_only as linear_module

    scales, kind, block_rows, tensor_scale = linear_module.scale_layout(qt)
    n, k = qt.shape
    codes = qt.codes.reshape(n, -1)
    b = None if bias is None else bias.to(x.dtype).contiguous()
    return op.linear(x, codes, scales, kind, block_rows, tensor_scale, b, qt.format.name, qt.group_size)
