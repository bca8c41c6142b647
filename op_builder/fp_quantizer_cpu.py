"""``FPQuantizerCPUBuilder``: the compiled CPU op (C++ with OpenMP, no CUDA toolkit needed).

It is compiled for this machine's CPU (DeepSpeed's ``-march=native``): the AVX-512 paths of the CPU
kernels (``includes/fp_kernels_cpu.h``) where the CPU has them, portable loops otherwise.
``DS_FPQUANT_CPU_ARCH`` names another target (``x86-64-v3``: any AVX2 machine; ``x86-64-v2``), for a build
shared by different CPUs.
Either way the build folder is named after what the compiler makes of the target on this machine
(``builder.resolved_target``), so each CPU gets its own build.
"""

from __future__ import annotations

from deepspeed.ops.op_builder.builder import OpBuilder

from .builder import ProjectOpMixin, cpu_arch_flag, csrc_path, cxx_std_flag

#: The CPU kernels (csrc/README.md), compiled into both ops: quantize, dequantize, the linear's dispatch and
#: portable path, its AVX-512 register-blocked kernel, the AVX2 GEMV and GEMM, the AVX-512 BF16 / AMX GEMM, and the
#: peak dot-product loops of the bench's roofline.
CPU_SOURCES = tuple(csrc_path("fp_quantizer", name) for name in (
    "fp_quantize_cpu.cpp", "fp_dequantize_cpu.cpp", "fp_linear_cpu.cpp", "fp_linear_small_m_cpu.cpp",
    "fp_linear_gemv_avx2_cpu.cpp", "fp_linear_gemm_avx2_cpu.cpp", "fp_linear_gemm_avx512_cpu.cpp",
    "fp_peak_cpu.cpp"))


class FPQuantizerCPUBuilder(ProjectOpMixin, OpBuilder):
    """Builds ``csrc/fp_quantizer`` (shared codec header + CPU kernels + torch binding) as C++."""

    BUILD_VAR = "DS_BUILD_FPQUANT_CPU"
    NAME = "ds_fpquant_cpu"

    def sources(self):
        return [*CPU_SOURCES, csrc_path("fp_quantizer", "fp_quantize_binding.cpp")]

    def include_paths(self):
        return [csrc_path("fp_quantizer", "includes")]

    def cxx_args(self):
        # -ffp-contract=off: no fused multiply-adds (SPEC 3.1: each fp32 operation rounds on its own).
        # -fno-trapping-math: lets loops with selects vectorize; it changes no result (no FP traps used).
        return ["-O3", cxx_std_flag(), self.cpu_arch(), "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
                "-Wall", "-Wno-unknown-pragmas"]

    _native_flag = None  # DeepSpeed's answer, asked once per process (it runs py-cpuinfo: about a second)

    def cpu_arch(self):
        """DeepSpeed's ``-march=native`` (``-mcpu=native`` on PowerPC), or ``$DS_FPQUANT_CPU_ARCH``'s target.

        Raises:
            BuildSettingError: (a ValueError) ``DS_FPQUANT_CPU_ARCH`` is not a target name.
        """
        if FPQuantizerCPUBuilder._native_flag is None:
            FPQuantizerCPUBuilder._native_flag = super().cpu_arch()
        return cpu_arch_flag(FPQuantizerCPUBuilder._native_flag)

    def extra_ldflags(self):
        return ["-fopenmp"]

    def is_compatible(self, verbose=False):
        reason = self.compiler_missing_reason()
        if reason and verbose:
            self.warning(f"{self.NAME}: {reason}")
        self.error_log = reason or None
        return not reason and super().is_compatible(verbose)
