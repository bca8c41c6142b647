// The machine's peak dot-product rates for the roofline of `ds-fpquant bench --linear` (fp_peak_cpu.cpp):
// register-only loops of the multiply-add instructions the CPU linear and torch's CPU kernels run, on a given
// number of OpenMP threads. No torch includes.
#pragma once

#include <string>
#include <vector>

namespace fpq {

// One peak loop: the instruction it repeats and what one instruction computes.
struct PeakKind {
    std::string name;              // "fp32_fma_ymm", "fp32_fma_zmm", "bf16_dot_zmm", "amx_bf16"
    std::string instruction;       // "vfmadd231ps ymm", "vfmadd231ps zmm", "vdpbf16ps zmm", "tdpbf16ps"
    double flops_per_instruction;  // floating-point operations of one instruction, a multiply-add counted as 2
    int accumulators;              // independent accumulator registers (AMX: tiles) the loop keeps in flight
    std::string unavailable;       // "" where this CPU and OS run it, else why not
};

// Every loop this build has, available or not; where one is unavailable, `unavailable` says why (the CPU lacks
// the instruction, the OS does not enable its register state, Linux refused the AMX tile-data permission, or the
// build is not for x86-64). Asking for the AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM) happens here, once per
// process, where the CPU has AMX-BF16.
std::vector<PeakKind> peak_kinds();

// GFLOP/s (1e9 floating-point operations per second, a multiply-add counted as 2) of `threads` OpenMP threads,
// each running the loop of `kind` on registers only: the best of `trials` timed runs of at least `min_seconds`
// each (the first run sizes the loop), after a warm-up run of about a tenth of that.
//
// Throws std::invalid_argument: `kind` is not one of peak_kinds() or is unavailable here (with the reason),
// threads < 1, trials < 1, or min_seconds not in (0, 10].
double peak_gflops(const std::string& kind, int threads, double min_seconds, int trials);

// Linux's per-process permission for the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked
// once per process: "" once granted, else why not. Defined in builds for AMX-BF16 on Linux (FPQ_PEAK_AMX of
// fp_peak_cpu.cpp); the peak loop and the AMX GEMM (fp_linear_gemm_avx512_cpu.cpp) ask before any tile instruction.
std::string amx_permission();

}  // namespace fpq
