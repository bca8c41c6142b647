// What the CPU kernel files share beyond the kernel interface (fp_quantize.h): which AVX-512 paths this
// build compiles, decided once from the compiler's target macros (-march=native, or DS_FPQUANT_CPU_ARCH's
// target; none in a portable build such as x86-64-v3), the layout constants of the CPU linear, and the
// entry point of the bf16 register path (fp_linear_bf16_cpu.cpp) that the linear dispatch
// (fp_linear_cpu.cpp) calls. linear_cpu_paths() reports the FPQ_* paths. No torch includes.
//
// The decoders of fp_row_decode_cpu.h and fp_bf16_weights_cpu.h are in an unnamed namespace, as they
// were when the CPU linear was one file: each kernel file gets its own internal copies, which the
// compiler inlines or calls directly as before; with external linkage, calls left out of line would go
// through the shared object's PLT (default visibility), and the hot loops measured up to 25% slower.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fp_quantize.h"

// fast_decode: 16 codes a step decoded in an AVX-512 register (fp_row_decode_cpu.h).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FPQ_FAST_DECODE 1
#endif

// bf16_dot: bf16 x multiplied in bf16 pairs by vdpbf16ps (the buffered micro-kernel of fp_linear_cpu.cpp).
#if defined(FPQ_FAST_DECODE) && defined(__AVX512BF16__)
#define FPQ_BF16_DOT 1
#endif

// direct_bf16: the register path, 32 bf16 weights a step with no buffer (fp_bf16_weights_cpu.h).
#if defined(FPQ_BF16_DOT) && defined(__AVX512VBMI__)
#define FPQ_DIRECT_BF16 1
#endif

namespace fpq {
namespace cpu_kernels {

constexpr int64_t kLanes = 16;           // fp32 lanes of one AVX-512 vector; chunks are multiples of it
constexpr int64_t kPad = kLinearPad;     // x rows and decoded chunks are zero-padded to a multiple of this

#if defined(FPQ_BF16_DOT)
constexpr bool kStagesBf16 = true;
#else
constexpr bool kStagesBf16 = false;
#endif

#if defined(FPQ_DIRECT_BF16)
// y = x @ dequant(W)^T by the register path for bf16 x (fp_linear_bf16_cpu.cpp); false, having done
// nothing, where it does not apply (not a 4- or 8-bit format, groups not a multiple of 16 codes, more
// rows of x than it takes).
bool linear_bf16_direct(Format fmt, const LinearArgs& args);
#endif

}  // namespace cpu_kernels
}  // namespace fpq
