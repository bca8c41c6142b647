// The CPU linear (SPEC 8): y = x @ W^T for a row-grouped (or 2-D block) quantized W, as
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))
// in fp32: each code decoded exactly (never rounded with its scale), the group scale multiplying the
// group's partial sum. The bias and the one rounding to x's dtype are the binding's.
// linear_cpu_kernel is the one dispatch (by the build's ISA, m, the format and the grouping):
//  * "avx512_register" (builds for AVX-512 BF16 + VBMI, m <= kAvx512MaxM, 4-, 6- and 8-bit codes in groups of a
//    multiple of 16): the register-blocked kernel (fp_linear_small_m_cpu.cpp).
//  * "avx2_gemv" (AVX2 + FMA builds, AVX-512 ones included; m <= kGemvMaxM, e4m3 / e5m2 in groups of a multiple
//    of 16, e2m1 in groups of 16 or a multiple of 32): weight rows streamed (fp_linear_gemv_avx2_cpu.cpp).
//  * "amx_gemm" / "avx512_gemm" (AVX-512 BF16 + VBMI builds; AMX where the CPU has it and Linux grants the tile data):
//    the rest where the codes are bf16 values and the groups even (bf16 x; fp32 x on AMX, groups of a multiple of 32
//    for AMX): decode-once bf16 panels (fp_linear_gemm_avx512_cpu.cpp).
//  * "avx2_gemm" (AVX2 + FMA builds, everything else, any m): decode-once panels (fp_linear_gemm_avx2_cpu.cpp).
//  * "portable" (builds without AVX2 + FMA, such as non-x86 ones): here, OpenMP over weight rows. Each row is decoded
//    once into an fp32 buffer (decode(q) exactly, the shared codec), and every row of x takes its group partial
//    sums in 16 fp32 lanes, times the group scale, added in fp32. ds_fpquant.linear.weight_only sends these builds
//    only up to SMALL_M rows of x and multiplies panels of decode_rows (fp_dequantize_cpu.cpp) beyond.
// No torch includes.

#include <algorithm>
#include <string>
#include <vector>

#include "fp_kernels_cpu.h"
#include "fp_row_decode_cpu.h"
#include "ieee_denormals.h"

namespace fpq {
namespace {

using namespace cpu_kernels;

// sum_j x[j] * w[j] over j < len, in 16 fp32 lanes (vectorized; the lanes are added at the end).
inline float group_dot(const float* __restrict x, const float* __restrict w, int64_t len)
{
    float lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) { lanes[l] += x[j + l] * w[j + l]; }
    }
    for (int64_t l = 0; j + l < len; ++l) { lanes[l] += x[j + l] * w[j + l]; }
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) { sum += lanes[l]; }
    return sum;
}

template <class F, class X>
void linear_groups(const LinearArgs& a)
{
    const int64_t k_padded = ceil_div(a.k, kLinearPad) * kLinearPad;
    const int64_t g_size = a.group_size, groups = a.scale_cols;
    const int64_t full_group_bytes = group_bytes(g_size, F::kBits);
    // x in fp32 (bf16 and fp16 values widen exactly)
    std::vector<float> x32(size_t(a.m * k_padded));
    const X* x = static_cast<const X*>(a.x);
    for (int64_t i = 0; i < a.m * k_padded; ++i) { x32[size_t(i)] = load_f32(x[i]); }
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        std::vector<float> w(static_cast<size_t>(k_padded)), scales(static_cast<size_t>(groups));
        std::vector<uint32_t> codes(static_cast<size_t>(g_size + 8));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < a.n; ++n) {
            const uint8_t* row = a.codes + n * a.row_bytes;
            for (int64_t g = 0; g < groups; ++g) {  // decode(q) exactly: the codes times 1
                const int64_t start = g * g_size, glen = std::min(g_size, a.k - start);
                decode_codes<F, float, float>(row + g * full_group_bytes, glen, 0, glen, 1.0f, w.data() + start,
                                              codes.data());
            }
            decode_row_scales(a, n, scales.data());
            for (int64_t m = 0; m < a.m; ++m) {
                const float* xr = x32.data() + m * k_padded;
                float total = 0.0f;
                for (int64_t g = 0; g < groups; ++g) {
                    const int64_t start = g * g_size;
                    total += scales[size_t(g)] * group_dot(xr + start, w.data() + start, std::min(g_size, a.k - start));
                }
                a.y[m * a.n + n] = total;
            }
        }
    }
}

}  // namespace

std::vector<std::string> linear_cpu_paths()
{
    std::vector<std::string> paths;
#if defined(FPQ_FAST_DECODE)
    paths.emplace_back("fast_decode");
#endif
#if defined(FPQ_BF16_DOT)
    paths.emplace_back("bf16_dot");
#endif
#if defined(FPQ_DIRECT_BF16)
    paths.emplace_back("direct_bf16");
#endif
#if defined(FPQ_AVX2_FMA)
    paths.emplace_back("avx2_fma");
#endif
#if defined(FPQ_DIRECT_BF16)
    if (cpu_kernels::amx_usable()) { paths.emplace_back("amx"); }  // tdpbf16ps: the CPU, Linux and $DS_FPQUANT_CPU_AMX
#endif
    return paths;
}

CpuLinearKernel linear_cpu_kernel(Format fmt, const LinearArgs& args)
{
#if defined(FPQ_DIRECT_BF16)
    // the AVX-512 BF16 / AMX GEMM where it applies, past the rows where the register-blocked kernel is faster
    const CpuLinearKernel gemm = cpu_kernels::linear_gemm_avx512_kernel(fmt, args);
    const int64_t small_m_max = gemm != CpuLinearKernel::kAmxGemm ? cpu_kernels::kAvx512MaxM
                                : args.group_size % 32 == 0    ? cpu_kernels::kAmxSmallMaxM32
                                                               : cpu_kernels::kAmxSmallMaxM16;
    if (args.m <= small_m_max && cpu_kernels::linear_small_m_applies(fmt, args)) {
        return CpuLinearKernel::kAvx512Register;
    }
#endif
#if defined(FPQ_AVX2_FMA)
    if (cpu_kernels::linear_gemv_avx2_applies(fmt, args)) { return CpuLinearKernel::kAvx2Gemv; }
#if defined(FPQ_DIRECT_BF16)
    if (gemm != CpuLinearKernel::kPortable) { return gemm; }
#endif
    return CpuLinearKernel::kAvx2Gemm;
#else
    (void)fmt;
    (void)args;
    return CpuLinearKernel::kPortable;
#endif
}

const char* linear_cpu_kernel_name(CpuLinearKernel kernel)
{
    switch (kernel) {
        case CpuLinearKernel::kAvx512Register: return "avx512_register";
        case CpuLinearKernel::kAvx2Gemv: return "avx2_gemv";
        case CpuLinearKernel::kAvx2Gemm: return "avx2_gemm";
        case CpuLinearKernel::kAvx512Gemm: return "avx512_gemm";
        case CpuLinearKernel::kAmxGemm: return "amx_gemm";
        case CpuLinearKernel::kPortable: break;
    }
    return "portable";
}

void linear_cpu(Format fmt, const LinearArgs& args, bool x_bf16)
{
    const CpuLinearKernel kernel = linear_cpu_kernel(fmt, args);
#if defined(FPQ_DIRECT_BF16)
    if (kernel == CpuLinearKernel::kAvx512Register && cpu_kernels::linear_small_m(fmt, args, x_bf16)) { return; }
#endif
#if defined(FPQ_AVX2_FMA)
    if (kernel == CpuLinearKernel::kAvx2Gemv && cpu_kernels::linear_gemv_avx2(fmt, args, x_bf16)) { return; }
#if defined(FPQ_DIRECT_BF16)
    if (kernel == CpuLinearKernel::kAvx512Gemm || kernel == CpuLinearKernel::kAmxGemm) {
        cpu_kernels::linear_gemm_avx512(fmt, args, x_bf16, kernel);
        return;
    }
#endif
    if (kernel != CpuLinearKernel::kPortable) {
        cpu_kernels::linear_gemm_avx2(fmt, args, x_bf16);
        return;
    }
#endif
    (void)kernel;  // kPortable
    dispatch_format(fmt, [&](auto f) {
        if (x_bf16) {
            linear_groups<decltype(f), Bf16>(args);
        } else {
            linear_groups<decltype(f), float>(args);
        }
    });
}

}  // namespace fpq
