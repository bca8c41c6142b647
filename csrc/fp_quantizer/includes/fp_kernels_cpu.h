// What the CPU kernel files share beyond the kernel interface (fp_quantize.h): which AVX-512 paths this
// build compiles, decided once from the compiler's target macros (-march=native, or DS_FPQUANT_CPU_ARCH's
// target; none in a portable build such as x86-64-v3), the layout constants of the CPU linear, and the
// entry point of the register-blocked linear (fp_linear_small_m_cpu.cpp) that the linear dispatch
// (fp_linear_cpu.cpp) calls. linear_cpu_paths() reports the FPQ_* paths. No torch includes.
//
// The decoders of fp_row_decode_cpu.h and fp_bf16_weights_cpu.h are in an unnamed namespace, as they
// were when the CPU linear was one file: each kernel file gets its own internal copies, which the
// compiler inlines or calls directly as before; with external linkage, calls left out of line would go
// through the shared object's PLT (default visibility), and the hot loops measured up to 25% slower.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fp_quantize.h"

// fast_decode: 16 codes a step decoded in an AVX-512 register (fp_row_decode_cpu.h).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FPQ_FAST_DECODE 1
#endif

// bf16_dot: AVX-512 BF16 (vdpbf16ps, vcvtne2ps2bf16), used by the bf16 dequantize.
#if defined(FPQ_FAST_DECODE) && defined(__AVX512BF16__)
#define FPQ_BF16_DOT 1
#endif

// direct_bf16: + VBMI: the bf16 dequantize's 32-wide steps (fp_bf16_weights_cpu.h) and the register-blocked
// linear (byte-table decode, fp_raw_decode_cpu.h; fp_linear_small_m_cpu.cpp).
#if defined(FPQ_BF16_DOT) && defined(__AVX512VBMI__)
#define FPQ_DIRECT_BF16 1
#endif

// amx: + AMX-BF16 (tdpbf16ps) on Linux, the AMX path of the AVX-512 GEMM (fp_linear_gemm_avx512_cpu.cpp), which
// runs where Linux grants the tile data (amx_usable()).
#if defined(FPQ_DIRECT_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define FPQ_AMX 1
#endif

// avx2_fma: AVX2 + FMA, the AVX2 linear (exact decoders fp_avx2_decode_cpu.h; the GEMV
// fp_linear_gemv_avx2_cpu.cpp and the GEMM fp_linear_gemm_avx2_cpu.cpp). Every x86-64-v3 build has it, the
// AVX-512 builds too.
#if defined(__AVX2__) && defined(__FMA__)
#define FPQ_AVX2_FMA 1
#endif

namespace fpq {
namespace cpu_kernels {

constexpr int64_t kLanes = 16;           // fp32 lanes of one AVX-512 vector; chunks are multiples of it

#if defined(FPQ_DIRECT_BF16)
// SPEC 8's y = sum_g s_g * (x . decode(q))_g (fp32, no bias) by the register-blocked kernel
// (fp_linear_small_m_cpu.cpp) for any m: x bf16 (x_bf16) or fp32, rows zero-padded to kLinearPad columns;
// false, having done nothing, where it does not apply (not a 4-, 6- or 8-bit format, groups not a multiple
// of 16 codes).
bool linear_small_m(Format fmt, const LinearArgs& args, bool x_bf16);
bool linear_small_m_applies(Format fmt, const LinearArgs& args);  // whether linear_small_m runs these arguments
// rows of x up to which linear_cpu runs the register-blocked kernel (the crossover measured in earlier sessions on
// AVX-512 BF16 machines); more rows take the AVX2 GEMM
constexpr int64_t kAvx512MaxM = 32;

// The AVX-512 BF16 / AMX GEMM (fp_linear_gemm_avx512_cpu.cpp), SPEC 8's y for any m (x rows as for linear_small_m):
// decode-once bf16 panels of 64 weight rows, x packed in VNNI pairs; vdpbf16ps ("avx512_gemm": bf16 x, codes that are
// bf16 values, groups of an even size) or tdpbf16ps ("amx_gemm": also fp32 x, split exactly into three bf16 parts;
// groups of a multiple of 32; FPQ_AMX builds where Linux grants the tile data). linear_gemm_avx512_kernel: which of
// the two runs these arguments (x bf16 when args.weight_dtype is bf16), kPortable where neither applies.
bool amx_usable();
CpuLinearKernel linear_gemm_avx512_kernel(Format fmt, const LinearArgs& args);
// Rows of x up to which the register-blocked kernel stays ahead of the AMX GEMM (tiles of K = 32: groups of a multiple
// of 32; K = 16: other multiples of 16), measured on a 2-core Sapphire Rapids (issue 44; 4096x4096, bf16 x, ms,
// register kernel / amx_gemm): M=8 e4m3 g128 1.91 / 1.48, e2m1 g128 1.71 / 1.23, mxfp4 2.15 / 1.68, nvfp4 2.08 / 3.14;
// M=16 nvfp4 3.78 / 2.72; M=6 e4m3 1.57 / ~1.5. The vdpbf16ps GEMM keeps kAvx512MaxM (M=32 / 33 e4m3: 7.37 / 8.13).
constexpr int64_t kAmxSmallMaxM32 = 7;
constexpr int64_t kAmxSmallMaxM16 = 12;
void linear_gemm_avx512(Format fmt, const LinearArgs& args, bool x_bf16, CpuLinearKernel kernel);
#endif

#if defined(FPQ_AVX2_FMA)
// SPEC 8's y = sum_g s_g * (x . decode(q))_g (fp32, no bias), x rows as for linear_small_m, by the AVX2 kernels:
// the GEMV (weight rows streamed, K in the lanes, m <= kGemvMaxM) where it applies (e4m3 / e5m2 with groups of a
// multiple of 16 codes, e2m1 with groups of 16 or a multiple of 32; returns false, having done nothing, otherwise),
// and the GEMM (decoded panels of 16 weight rows, N in the lanes; every format and layout, any m).
constexpr int64_t kGemvMaxM = 4;
bool linear_gemv_avx2(Format fmt, const LinearArgs& args, bool x_bf16);
bool linear_gemv_avx2_applies(Format fmt, const LinearArgs& args);  // whether linear_gemv_avx2 runs these arguments
void linear_gemm_avx2(Format fmt, const LinearArgs& args, bool x_bf16);
#endif

}  // namespace cpu_kernels
}  // namespace fpq
