"""Shared pieces of this project's DeepSpeed op builders.

Sources and include paths resolve from the installed package: ``op_builder/`` is installed as
``ds_fpquant/op_builder`` next to ``ds_fpquant/csrc`` (package data), and in a source checkout
``op_builder/`` sits next to ``csrc/``; either way the sources are ``<parent of this folder>/csrc``.
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

#: Root of the C++/CUDA sources.
CSRC = Path(__file__).resolve().parent.parent / "csrc"
#: The builders' own code (it defines the flags), hashed into the build folder's name with the sources.
BUILDERS = Path(__file__).resolve().parent
#: Environment variables that change what a build produces.
BUILD_ENV = ("CXX", "CC", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME")
#: Environment variable naming the CPU op's target: a ``-march`` (``-mcpu`` on PowerPC) value such as
#: ``x86-64-v3`` for a build that runs on every AVX2 machine; unset or ``native``: this machine's CPU.
CPU_ARCH_VAR = "DS_FPQUANT_CPU_ARCH"
#: What a target name may look like (gcc/clang ``-march`` values: ``native``, ``x86-64-v3``, ``znver4``,
#: ``sapphirerapids``, ``armv8.2-a+fp16``, ``power9``).
_TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
#: Flags that would let the compiler change fp32 results (SPEC 3.1: no fast-math, no FTZ).
FAST_MATH_FLAGS = ("--use_fast_math", "-use_fast_math", "-ffast-math", "-Ofast")


def csrc_path(*parts: str) -> str:
    """Absolute path of a file under ``csrc/`` (DeepSpeed keeps absolute paths as they are)."""
    return str(CSRC.joinpath(*parts))


def without_fast_math(args: List[str]) -> List[str]:
    """``args`` minus any flag that enables fast-math approximations or flush-to-zero."""
    return [a for a in args if a not in FAST_MATH_FLAGS and not a.startswith(("-ftz=true", "--ftz=true"))]


class BuildSettingError(ValueError):
    """A build setting names no build (``DS_FPQUANT_CPU_ARCH``): the caller's to fix, raised to every call that
    needs the op instead of falling back to the torch backend."""


def _arch_setting() -> str:
    """``$DS_FPQUANT_CPU_ARCH``, '' when unset or ``native`` (both: DeepSpeed's native target)."""
    value = os.environ.get(CPU_ARCH_VAR, "").strip()
    return "" if value == "native" else value


def cpu_arch_flag(native_flag: str) -> str:
    """The CPU op's target flag: DeepSpeed's ``native_flag`` (``-march=native``, ``-mcpu=native`` on
    PowerPC) with its value replaced by ``$DS_FPQUANT_CPU_ARCH`` when that names another target.

    Raises:
        BuildSettingError: ``DS_FPQUANT_CPU_ARCH`` is not a target name (letters, digits, ``_.+-``).
    """
    value = _arch_setting()
    if not value:
        return native_flag
    if not _TARGET_NAME.fullmatch(value):
        raise BuildSettingError(f"{CPU_ARCH_VAR}={value!r} is not a target name; allowed: 'native' or a -march value "
                                f"of the compiler such as 'x86-64-v2', 'x86-64-v3', 'x86-64-v4', 'znver4'")
    option = native_flag.split("=", 1)[0] if "=" in native_flag else "-march"
    return f"{option}={value}"


_macros: Dict[tuple, str] = {}  # (compiler, flags) -> its answer; only answers are kept, never failures


def _predefined_macros(cxx: str, flags: tuple) -> tuple:
    """(exit status, sorted macro lines or why not) of ``cxx flags -dM -E`` on an empty file."""
    key = (cxx, flags)
    if key in _macros:
        return 0, _macros[key]
    cmd = [*shlex.split(cxx), *flags, "-dM", "-E", "-x", "c++", os.devnull]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, f"{' '.join(cmd)}: {exc}"
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return proc.returncode, f"{' '.join(cmd)}: exit status {proc.returncode}" + (f": {lines[0]}" if lines else "")
    _macros[key] = "\n".join(sorted(proc.stdout.splitlines()))
    return 0, _macros[key]


def resolved_target(cxx: str, flags: tuple) -> str:
    """What the compiler ``cxx`` makes of the target ``flags`` (``-march=native`` and the like): its predefined
    macros, sorted, one per line. These are what the ``#if defined(__AVX512F__)`` paths of ``csrc/`` see, and
    they name the compiler version and the CPU (``__znver4__``, ``__AVX512FP16__`` ...), so the same flag
    string on two different CPUs resolves to two different answers.

    A compiler that cannot run at all answers with why: no build can happen with it, and its build's own
    error (or ``is_compatible``) says so.

    Raises:
        BuildSettingError: ``DS_FPQUANT_CPU_ARCH`` names a target and the compiler, which works with its
            default target, refuses ``flags``.
    """
    flags = tuple(flags)
    status, answer = _predefined_macros(cxx, flags)
    if status == 0:
        return answer
    if flags and _arch_setting() and _predefined_macros(cxx, ())[0] == 0:
        raise BuildSettingError(f"the compiler refuses the CPU target {' '.join(flags)} ({CPU_ARCH_VAR}="
                                f"{os.environ[CPU_ARCH_VAR]!r}): {answer}")
    return f"no answer: {answer}"


def target_flags(args: List[str]) -> tuple:
    """The flags of ``args`` that choose the instruction set (``-march=``, ``-mcpu=``, ``-mtune=``, ``-m<isa>``)."""
    return tuple(a for a in args if re.match(r"-m(arch|cpu|tune)=|-m(no-)?(avx|sse|fma|f16c|bmi|amx)", a))


def cxx_std_flag() -> str:
    """The C++ standard torch's headers need (C++20 from torch 2.12, as DeepSpeed's builders use)."""
    import torch

    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


class ProjectOpMixin:
    """What both builders share: NAME-derived names, and a ``load()`` that imports a prebuilt module
    (``DS_BUILD_*=1 pip install .``) before JIT-building.

    DeepSpeed's own ``load()`` only knows its own prebuilt ops (``deepspeed.git_version_info``).
    """

    _modules: Dict[str, object] = {}
    NAME = ""

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        """Module name of the prebuilt op (``DS_BUILD_*=1 pip install``)."""
        return f"ds_fpquant.ops.{self.NAME}_op"

    def build_name(self) -> str:
        """The JIT build's module and folder name: ``NAME`` plus a hash of everything the build depends
        on (every file under ``csrc/``, the builders' code, the compiler flags, the torch, CUDA and Python
        versions, the build environment variables, and what the compiler makes of the target flags on this
        machine: :func:`resolved_target`). Each source tree, torch and CPU gets its own folder in torch's
        extension cache, so any number of checkouts and venvs coexist and none rebuilds over another, and a
        cache shared between machines (a home directory on NFS) never hands a ``-march=native`` build of one
        CPU to another; identical trees on identical targets share one build.

        Raises:
            BuildSettingError: ``DS_FPQUANT_CPU_ARCH`` is invalid or refused by the compiler.
        """
        import torch

        digest = hashlib.sha256()
        for root in (CSRC, BUILDERS):
            for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
                digest.update(f"{path.relative_to(root.parent)}\0".encode())
                digest.update(path.read_bytes())
        args = self.cxx_args()
        facts = [type(self).__name__, torch.__version__, str(torch.version.cuda), sys.version.split()[0],
                 *args, *self.extra_ldflags(), *(f"{k}={os.environ.get(k, '')}" for k in BUILD_ENV),
                 resolved_target(os.environ.get("CXX", "c++"), target_flags(args))]
        digest.update("\0".join(facts).encode())
        return f"{self.NAME}_{digest.hexdigest()[:16]}"

    def build_directory(self) -> str:
        """The folder of the JIT build (created if missing), in torch's extension cache."""
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(self.build_name(), verbose=False)

    def jit_load(self, verbose=True):
        """DeepSpeed's ``jit_load`` of the sources under :meth:`build_name`, under an OS-level lock on
        the build folder.

        torch serialises builds with a lock *file* that a killed build leaves behind, after which
        every later load waits forever. This ``flock`` is released by the OS when its holder dies, so
        whoever holds it knows that any torch lock file left is stale and removes it. Concurrent
        processes build once; the others wait here, then load the built module.
        """
        name, self.name = self.name, self.build_name()
        try:
            try:
                import fcntl
            except ImportError:  # not POSIX: torch's own lock only
                return super().jit_load(verbose)
            build_dir = self.build_directory()
            with open(os.path.join(build_dir, "ds_fpquant.flock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                stale = os.path.join(build_dir, "lock")
                if os.path.exists(stale):
                    os.remove(stale)
                return super().jit_load(verbose)
        finally:
            self.name = name

    def load(self, verbose: bool = False):
        if self.name in ProjectOpMixin._modules:
            return ProjectOpMixin._modules[self.name]
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError:
            module = self.jit_load(verbose)
        ProjectOpMixin._modules[self.name] = module
        return module

    @staticmethod
    def compiler_missing_reason() -> str:
        """Why a C++ build cannot run here ('' when a compiler and ninja are present)."""
        cxx = os.environ.get("CXX", "c++")
        words = shlex.split(cxx)  # e.g. CXX="ccache g++"
        if not words or shutil.which(words[0]) is None:
            return f"no C++ compiler ({cxx!r} not on PATH; set CXX)"
        if shutil.which("ninja") is None:
            try:
                import ninja  # noqa: F401  (the pip package puts ninja on PATH of the venv)
            except ImportError:
                return "ninja is not installed (pip install ninja)"
        return ""


def cuda_tool(name: str) -> str:
    """Path of a CUDA binary tool (``nvcc``, ``cuobjdump``, ``nvdisasm``): the toolkit's under
    ``CUDA_HOME``, else the ``nvidia-cuda-*`` pip package's. The tool's folder is put on ``PATH``
    (cuobjdump runs nvdisasm for sm_90 code).

    Raises:
        FileNotFoundError: the tool is in neither place.
    """
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [os.path.join(cuda_home, "bin", name)]
    try:
        import nvidia
        for root in nvidia.__path__:
            candidates += glob.glob(os.path.join(root, "*", "bin", name))
    except ImportError:
        pass
    for path in candidates:
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, 0o755)  # the pip wheels ship the binaries without the exec bit
            os.environ["PATH"] = os.path.dirname(path) + os.pathsep + os.environ.get("PATH", "")
            return path
    raise FileNotFoundError(f"{name} not found under CUDA_HOME={cuda_home} or in the nvidia-cuda-* pip packages "
                            f"(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
