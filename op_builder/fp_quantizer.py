"""``FPQuantizerBuilder``: the CUDA op (sm_89+ hardware fp8 conversions; CPU kernels included).

Differences from DeepSpeed's ``CUDAOpBuilder`` defaults, each on purpose:

- ``--use_fast_math`` is dropped (SPEC 3.1; the kernels also use the ``__f*_rn`` intrinsics).
- The nvcc flags do not depend on ``build_for_cpu``: DeepSpeed's ``jit_load`` sets it whenever no
  GPU is visible, which would otherwise drop every nvcc flag on a GPU-less build machine.
- With no GPU visible and ``TORCH_CUDA_ARCH_LIST`` unset, sm_90 is targeted (instead of failing).
"""

from __future__ import annotations

import os
import shutil

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, installed_cuda_version

from .builder import ProjectOpMixin, csrc_path, cxx_std_flag, without_fast_math
from .fp_quantizer_cpu import CPU_SOURCES

#: Oldest compute capability with the hardware fp8 conversions this op is built for.
MIN_COMPUTE_CAPABILITY = (8, 9)
#: Architecture targeted when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset (Hopper).
DEFAULT_ARCH = "9.0"


class FPQuantizerBuilder(ProjectOpMixin, CUDAOpBuilder):
    """Builds ``csrc/fp_quantizer`` with nvcc: CUDA kernels, CPU kernels, torch binding."""

    BUILD_VAR = "DS_BUILD_FPQUANT"
    NAME = "ds_fpquant"

    def sources(self):
        return [
            csrc_path("fp_quantizer", "fp_quantize_cuda.cu"),
            *CPU_SOURCES,
            csrc_path("fp_quantizer", "fp_quantize_binding.cpp"),
        ]

    def include_paths(self):
        return [csrc_path("fp_quantizer", "includes")]

    def cxx_args(self):
        return without_fast_math(super().cxx_args()) + [
            "-DFPQ_WITH_CUDA", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"
        ]

    def extra_ldflags(self):
        return ["-fopenmp"]

    def nvcc_args(self):
        import torch

        if self.jit_mode and not getattr(self, "_jit_arch_list", None) and not os.environ.get(
                "TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            self._jit_arch_list = DEFAULT_ARCH  # GPU-less build machine: target Hopper
        threads = min(os.cpu_count() or 1, 8)
        args = [
            "-O3", cxx_std_flag(), "-DFPQ_WITH_CUDA", "--ftz=false", "--prec-div=true", "--prec-sqrt=true",
            "--fmad=false", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"--threads={threads}"
        ]
        if os.environ.get("DS_DEBUG_CUDA_BUILD", "0") == "1":
            args.append("--ptxas-options=-v")
        return without_fast_math(args + self.compute_capability_args())

    def filter_ccs(self, ccs):
        kept, pruned = [], []
        for cc in ccs:
            major, minor = cc.split(".")
            ok = (int(major), int(minor.split("+")[0])) >= MIN_COMPUTE_CAPABILITY
            (kept if ok else pruned).append([major, minor])
        if pruned:
            self.warning(f"{self.NAME}: dropped compute capabilities below "
                         f"{'.'.join(map(str, MIN_COMPUTE_CAPABILITY))}: {['.'.join(c) for c in pruned]}")
        return kept

    def incompatible_reason(self) -> str:
        """'' when this op can be built (and run) here, else why not."""
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build (no torch.version.cuda)"
        from torch.utils.cpp_extension import CUDA_HOME
        if CUDA_HOME is None or shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is None:
            return "nvcc not found (set CUDA_HOME to a CUDA toolkit)"
        reason = self.compiler_missing_reason()
        if reason:
            return reason
        sys_major, _ = installed_cuda_version()
        torch_major = int(torch.version.cuda.split(".")[0])
        if sys_major != torch_major:
            return f"CUDA major mismatch: nvcc is CUDA {sys_major}, torch was built with CUDA {torch.version.cuda}"
        if torch.cuda.is_available():
            cc = torch.cuda.get_device_capability()
            if cc < MIN_COMPUTE_CAPABILITY:
                return (f"GPU compute capability {cc[0]}.{cc[1]} < "
                        f"{'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} (no hardware fp8 conversions)")
        return ""

    def is_compatible(self, verbose=False):
        reason = self.incompatible_reason()
        self.error_log = reason or None
        if reason and verbose:
            self.warning(f"{self.NAME}: {reason}")
        return not reason
