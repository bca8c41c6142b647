// The CUDA weight-only linear of ds_fpquant for up to kGemvMaxRows (16) rows of x on tensor cores (SPEC 8.1: y =
// sum_g s_g * (sum_{j in g} x_j * decode(q_j)) + b; SPEC 8.2's tensor-core bound), and its launch plan, without any
// launch syntax like the quantize kernels (fp_quantize_kernels.cuh): fp_quantize_cuda.cu launches it with `<<<>>>`, the
// CPU emulation (tests/unit/ops/fp_quantizer/emulation/) runs it as plain C++. The includer provides the CUDA names
// first (nvcc's headers, or the emulation's).
//
// Work split. A block of 4 warps owns 64 weight rows (a *tile*) and a range of K (a *split*; several splits of a tile
// when N alone does not fill the GPU). Warp w owns rows 16w .. 16w + 15: they are the 16-row side (A, row-major) of
// mma.sync.m16n8k16; the rows of x are its 8-column side (B), one n-tile for m <= 8, two for m <= 16. The mma
// multiplies bf16 (bf16 and fp32 x) or f16 (fp16 x) operands with fp32 accumulation.
//
// Codes to fragments. Every code of every format is a bf16 and an f16 value (SPEC 8.1), so each is decoded exactly
// into the A fragment: e4m3 by cvt.rn.f16x2.e4m3x2, e5m2 by a byte permute (its f16 high byte), both widened to bf16
// through fp32 for bf16 x; e2m1 by Marlin's bit placement (q & 0x80008000) | ((q & 0x70007000) >> 6) and one exact
// multiply by 2^126 (bf16; 2^14 and shift 3 for f16); e3m2, e2m3, e4m7 by placing sign and magnitude bits and one
// exact multiply by 2^(bias_t - bias) (subnormal codes become bf16 / f16 subnormals first, then normal values).
// The k order is permuted within each k16 step so that a lane's codes are contiguous in the packed row (SPEC 6): lane
// (r = lane / 4, c = lane % 4) takes kLane consecutive codes of rows r and r + 8 per *window* of 4 x kLane positions
// (LDS of 12-24 bytes per row), and x is read in the same permuted order from shared memory (LDS.128 of the raw rows,
// a PRMT per pair where the decoder pairs codes 4 or 8 apart); the sum over k is the same sum.
//
// Groups. The mma chain of a group restarts at the group's first step (C = 0) and ends at its last; the chain's fp32
// result times the group's scale is added to the lane's fp32 total by one FFMA per output (SPEC 8.1: the scale
// multiplies the group's partial sum; a chain never spans two groups; a split boundary inside a group ends one chain
// and starts the next). SPEC 8.2 bounds the tensor core's accumulation inside a chain.
//
// Memory. The block streams its codes and x through a ring of kGemvStages stages (about 512 bytes of codes per row
// each: GemvCodes<F, T>::kStageK positions) with cp.async (16-byte copies, commit_group / wait_group: kGemvStages - 1 stages in flight), the aligned path; shapes it
// cannot take (groups that are not a whole number of k16 steps in a window, code rows or x not 16-byte aligned) fill
// the same ring synchronously with byte loads, each group padded to whole k16 steps with zero codes and zero x (the
// padded path). The block's scales are decoded to fp32 into shared memory once, while the first stages are in flight.
//
// Split-K. With several splits per tile each block writes its fp32 partial sums to a workspace; the last block of a
// tile to finish (an atomic counter) adds the partials in split order, adds the bias and rounds once (SPEC 8.1), so
// the bits do not depend on which block finishes last.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "fp_quantize_kernels.cuh"

#ifndef FPQ_DYNAMIC_SHARED  // the emulation brings its own
#define FPQ_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace fpq {
namespace cuda_kernels {

constexpr int kGemvWarps = 4;                      // warps per block, one m16 tile each
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvBlockRows = 16 * kGemvWarps;    // weight rows per block (a tile)
constexpr int kGemvStages = 3;                     // ring stages (kGemvStages - 1 in flight)
constexpr int kGemvMaxSplits = 4096;
constexpr int kGemvMaxShared = 227 << 10;         // sm_90's most dynamic shared memory per block


// ---- bit-level helpers -------------------------------------------------------------------------------------------

__device__ __forceinline__ float f16_lo_to_f32(uint32_t h)
{
    __half2 v;
    memcpy(&v, &h, 4);
    return __low2float(v);
}

__device__ __forceinline__ float f16_hi_to_f32(uint32_t h)
{
    __half2 v;
    memcpy(&v, &h, 4);
    return __high2float(v);
}

// a * b per half, RN (HMUL2 / HMUL2.BF16): exact when b holds powers of two and the products are representable;
// subnormal inputs kept (mul.rn.f16x2 without .ftz; bf16 has no flush-to-zero).
template <bool kBf16>
__device__ __forceinline__ uint32_t mul_x2(uint32_t a, uint32_t b)
{
    uint32_t out;
    if constexpr (kBf16) {
        __nv_bfloat162 x, y;
        memcpy(&x, &a, 4);
        memcpy(&y, &b, 4);
        const __nv_bfloat162 r = __hmul2(x, y);
        memcpy(&out, &r, 4);
    } else {
        __half2 x, y;
        memcpy(&x, &a, 4);
        memcpy(&y, &b, 4);
        const __half2 r = __hmul2(x, y);
        memcpy(&out, &r, 4);
    }
    return out;
}

// An f16 pair holding exact bf16 values (decoded e4m3 / e5m2 codes, NaN and Inf included) as a bf16 pair: both halves
// widened to fp32 (exact) and packed by cvt.rn.bf16x2.f32 (exact here).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t h)
{
    const __nv_bfloat162 b = __floats2bfloat162_rn(f16_lo_to_f32(h), f16_hi_to_f32(h));
    uint32_t out;
    memcpy(&out, &b, 4);
    return out;
}

// prmt.b32 (default mode) with a selector whose nibbles have bit 3 clear (no sign replication): CUDA's __byte_perm
// masks a selector that is not a constant with 0x7777 first (one LOP3 more); the emulation's __byte_perm reports a
// nibble with bit 3 set.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector)
{
#if defined(__CUDA_ARCH__) && !defined(FPQ_CUDA_EMULATION)
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
#else
    return __byte_perm(a, b, selector);
#endif
}

// x << s for s >= 0, x >> -s otherwise (s a compile-time constant).
template <int kShift>
__device__ __forceinline__ uint32_t shift_left(uint32_t x)
{
    if constexpr (kShift >= 0) {
        return x << kShift;
    } else {
        return x >> -kShift;
    }
}

// A value the compiler must keep in a register rather than recompute from threadIdx where it is used (nvcc would
// rematerialize the lane's shared-memory offsets in every stage of the loop).
template <class V>
__device__ __forceinline__ V pinned(V v)
{
#if defined(__CUDA_ARCH__) && !defined(FPQ_CUDA_EMULATION)
    static_assert(sizeof(V) == 4, "32-bit values");
    if constexpr (std::is_same<V, float>::value) {
        asm volatile("" : "+f"(v));
    } else {
        asm volatile("" : "+r"(v));
    }
#endif
    return v;
}

// ---- tensor core, cp.async ---------------------------------------------------------------------------------------

// d = a * b + c, mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (the warp's fragments, PTX ISA
// "Matrix Fragments for mma.m16n8k16 with floating point type").
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          const float (&c)[4])
{
#if defined(FPQ_CUDA_EMULATION)
    fpq_emu::mma_m16n8k16_f32(kBf16, d, a, b0, b1, c);
#else
    if constexpr (kBf16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%11,%12,%13};"
            : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    }
#endif
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: 16 bytes to shared memory, the last 16 - src_bytes zero-filled
// (no bytes read for src_bytes = 0); complete at the cp_async_wait that covers its commit group.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, uint32_t src_bytes)
{
#if defined(FPQ_CUDA_EMULATION)
    fpq_emu::cp_async(dst, src, 16, src_bytes);
#else
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit()
{
#if defined(FPQ_CUDA_EMULATION)
    fpq_emu::cp_async_commit_group();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// cp.async.wait_group kPending: every commit group of this thread but the kPending most recent is complete.
template <int kPending>
__device__ __forceinline__ void cp_async_wait()
{
#if defined(FPQ_CUDA_EMULATION)
    fpq_emu::cp_async_wait_group(kPending);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// ---- window geometry per format ----------------------------------------------------------------------------------
//
// A stage holds kStageK positions of the block's 64 rows (about 512 bytes of codes per row; half as many positions
// for fp32 x with e2m1 and FP6, whose fp32 x would not fit three stages at 16 rows) and of x's m rows. A warp consumes
// it in windows of 4 x kLane positions: lane (r, c) decodes kLane codes of the window for rows r and r + 8, which
// serve kSteps = kLane / 4 mma steps. The lane's codes are kLane / kPiece pieces of kPiece consecutive codes: piece j
// at positions j * 4 kPiece + c * kPiece of the window, so that each k16 step lies in one block of 4 kPiece
// positions. kPiece = kLane: one contiguous piece per lane (groups of whole windows); kPiece = G / 4 for groups of 16,
// 32 or 64 (a step never spans two groups; the window holds kLane / kPiece groups). T: x's element type (the window's
// geometry does not depend on it; the stage's does).
template <class F, class T = Bf16>
struct GemvCodes {
    static constexpr int kLane = F::kBits == 4 ? 32 : 16;  // codes per lane, row and window
    static constexpr int kSteps = kLane / 4;
    static constexpr int kWindow = 16 * kSteps;            // positions per window: 64, or 128 for e2m1
    static constexpr int kHalve = sizeof(T) == 4 && (F::kBits == 4 || F::kBits == 6) ? 2 : 1;
    static constexpr int kStageK = (F::kBits == 8 ? 512 : F::kBits == 4 ? 1024 : F::kBits == 6 ? 640 : 320) / kHalve;
    static constexpr int kWindows = kStageK / kWindow;     // 8, 8, 10, 5 (fp32 x: 8, 4, 5, 5)
    static constexpr int kLaneBytes = kLane * F::kBits / 8;  // 16 (8- and 4-bit), 12 (FP6), 24 (e4m7)
    static constexpr int kWindowBytes = kWindow * F::kBits / 8;
    static constexpr int kRowBytes = kStageK * F::kBits / 8;  // one row of a stage: 512, 512, 480, 480 (or half)
    // Shared-memory row stride: the 8 rows x 4 lanes of a load instruction hit distinct banks (16-byte lanes: rows
    // 64 bytes apart modulo 128; FP6's 4-byte loads: rows 12 words apart modulo 32; e4m7's 8-byte loads: 8 words).
    static constexpr int kRowStride = kLaneBytes == 16 ? kRowBytes + (64 - kRowBytes % 128 + 128) % 128
                                      : kLaneBytes == 12 ? kRowBytes + (12 - (kRowBytes / 4) % 32 + 32) % 32 * 4
                                                         : kRowBytes + (8 - (kRowBytes / 4) % 32 + 32) % 32 * 4;
    static constexpr int kRowChunks = kRowBytes / 16;  // 16-byte chunks of one row of a stage: 32, 32, 30, 30
    static_assert(kStageK % kWindow == 0 && kRowBytes % 16 == 0 && kRowStride % 16 == 0, "stage geometry");
};

// The piece layouts the aligned path has, per format (kPiece < kLane: groups of 4 kPiece).
template <class F>
__host__ __device__ constexpr bool gemv_has_piece(int piece)
{
    return piece == GemvCodes<F>::kLane || (F::kBits == 8 && (piece == 4 || piece == 8)) ||
           (F::kBits == 4 && (piece == 4 || piece == 8 || piece == 16)) ||
           ((F::kBits == 6 || F::kBits == 12) && piece == 8);
}

// x in a stage: m rows of kStageK elements, 16 bytes of padding per row (LDS.128 of 8 rows x 4 lanes conflict free).
template <class F, class T>
struct GemvX {
    static constexpr int kRowBytes = GemvCodes<F, T>::kStageK * int(sizeof(T));
    static constexpr int kStride = kRowBytes + 16;
    static constexpr int kRowChunks = kRowBytes / 16;
};

// ---- window decoders: a lane's kLane codes of one row -> exact bf16 / f16 pairs ------------------------------------
//
// WindowDecode<F, kBf16, kPiece>::decode(w, h): w the lane's kLane codes of one row (load_window: little-endian words of
// the code stream, SPEC 6, its pieces one after another), h[p] the pair of the lane's codes code_of(p, 0) (low half)
// and code_of(p, 1) (high half). Step s of the window takes pairs 2s (k slots 2c, 2c + 1 of its m16n8k16) and 2s + 1
// (slots 2c + 8, 2c + 9); every pairing keeps a step's four codes in one piece.

// e4m3 -> f16 pair: the sm_89+ conversion (exact, NaN to NaN); the codec's decode in the emulation's software build.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_codes)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_codes), __NV_E4M3);
    return uint32_t(r.x) | uint32_t(r.y) << 16;
#else
    return uint32_t(f32_to_fp16_bits(fpq::decode<E4M3>(two_codes & 0xffu))) |
           uint32_t(f32_to_fp16_bits(fpq::decode<E4M3>((two_codes >> 8) & 0xffu))) << 16;
#endif
}

// Placed decoding (e3m2, e2m3, e4m7): the code's sign at bit 15 and its magnitude with its mantissa's top bit at the
// target's (value decode(q) * 2^(bias - bias_t), subnormals included: the target's exponent is at least as wide), then
// one exact multiply of the pair by 2^(bias_t - bias).
template <class F, bool kBf16>
struct Placed {
    static constexpr int kTargetMbits = kBf16 ? 7 : 10;
    static constexpr int kTargetBias = kBf16 ? 127 : 15;
    static constexpr int kMag = F::kBits - 1;
    static constexpr uint32_t kScaleHalf = uint32_t(kTargetBias - F::kBias + kTargetBias) << kTargetMbits;
    static constexpr uint32_t kScale = kScaleHalf | kScaleHalf << 16;
    static_assert(kTargetMbits >= F::kMbits && (kBf16 ? 8 : 5) >= F::kEbits, "the target holds every code");
    __device__ __forceinline__ static uint32_t half(uint32_t code)
    {
        return (code >> kMag) << 15 | (code & ((1u << kMag) - 1)) << (kTargetMbits - F::kMbits);
    }
};

// e3m2, e2m3 (16 codes in 12 bytes) and e4m7 (16 codes in 24 bytes): pair p takes the codes first(p) and first(p) +
// kDelta, which sit at the same bit offset modulo 8 (FP6: 4 codes apart, e4m7: 2), so one PRMT gathers their bytes into
// a word with the two codes 16 bits apart (the first at byte kPlace, its partner at byte kPlace + 2); then one shift
// each places both signs (bit 15, 31) and both magnitudes (the code's mantissa top bit at the target's, value decode(q)
// * 2^(bias - bias_t): subnormal codes become target subnormals), one LOP and one LOP3 merge them, and one exact
// multiply of the pair by 2^(bias_t - bias) (Placed) finishes it; a shift of 0 costs nothing (class 2 of FP6, class 1
// of e4m7 place their sign, e4m7's class 0 its magnitude, without one).
template <class F, bool kBf16, int kPiece, class Enable = void>
struct WindowDecode {
    static_assert(!F::kHasNan && !F::kHasInf && (F::kBits == 6 || F::kBits == 12), "the gathered formats");
    using P = Placed<F, kBf16>;
    static constexpr int kLane = GemvCodes<F>::kLane;
    static constexpr int kWords = GemvCodes<F>::kLaneBytes / 4;
    static constexpr int kDelta = F::kBits == 6 ? 4 : 2;
    static constexpr int kMagLow = P::kTargetMbits - F::kMbits;  // where the magnitude's low bit goes in a half
    static constexpr uint32_t kMagMask = ((1u << P::kMag) - 1) << kMagLow;
    __device__ __forceinline__ static constexpr int first(int p)
    {
        return F::kBits == 6 ? p % 4 + 8 * (p / 4) : p % 2 + 4 * (p / 2);
    }
    __device__ __forceinline__ static constexpr int code_of(int p, int e) { return first(p) + kDelta * e; }
    static constexpr bool kXPermuted = true;  // x chunks stored in pair order (permute_x_chunk)
    __device__ __forceinline__ static constexpr int offset(int i) { return i * F::kBits % 8; }
    __device__ __forceinline__ static constexpr int span(int i) { return (offset(i) + F::kBits + 7) / 8; }
    // the byte of the gathered word that takes code i's first byte: its sign lands on bit 15 if a byte move can do it
    __device__ __forceinline__ static constexpr int place(int i)
    {
        return span(i) == 1 && offset(i) + F::kBits == 8 ? 1 : span(i) == 1 ? 1 : 0;
    }
    template <int p>
    __device__ __forceinline__ static uint32_t pair(const uint32_t (&w)[kWords])
    {
        constexpr int a = first(p), b = a + kDelta;
        constexpr int byte_a = a * F::kBits / 8, byte_b = b * F::kBits / 8, n = span(a);
        constexpr int lo = byte_a / 4, hi = (byte_b + n - 1) / 4;  // the words holding the four bytes
        static_assert(hi - lo <= 1 && span(b) == n && offset(b) == offset(a), "a pair gathers from two words");
        constexpr int kPlace = place(a);
        constexpr auto src = [](int byte) { return byte / 4 == lo ? byte % 4 : 4 + byte % 4; };
        constexpr uint32_t sel = uint32_t(src(byte_a)) << (4 * kPlace) |
                                 uint32_t(src(byte_a + n - 1)) << (4 * (kPlace + n - 1)) |
                                 uint32_t(src(byte_b)) << (4 * (kPlace + 2)) |
                                 uint32_t(src(byte_b + n - 1)) << (4 * (kPlace + n + 1));
        const uint32_t g = prmt(w[lo], w[hi], sel);
        constexpr int at = 8 * kPlace + offset(a);  // the first code's low bit in g
        constexpr int sign_shift = 15 - (at + F::kBits - 1), mag_shift = kMagLow - at;
        const uint32_t sign = shift_left<sign_shift>(g) & 0x80008000u;
        const uint32_t mag = shift_left<mag_shift>(g) & (kMagMask | kMagMask << 16);
        return mul_x2<kBf16>(sign | mag, P::kScale);
    }
    template <int... kP>
    __device__ __forceinline__ static void decode_all(const uint32_t (&w)[kWords], uint32_t (&h)[kLane / 2],
                                                      std::integer_sequence<int, kP...>)
    {
        ((h[kP] = pair<kP>(w)), ...);
    }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kLane / 2])
    {
        decode_all(w, h, std::make_integer_sequence<int, kLane / 2>{});
    }
};

template <bool kBf16, int kPiece>
struct WindowDecode<E4M3, kBf16, kPiece> {
    static constexpr int kLane = 16, kWords = 4;
    static constexpr bool kXPermuted = false;  // adjacent codes pair up: x needs no permutation
    __device__ __forceinline__ static constexpr int code_of(int p, int e) { return 2 * p + e; }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kLane / 2])
    {
#pragma unroll
        for (int v = 0; v < kWords; ++v) {
            const uint32_t lo = e4m3x2_to_f16x2(w[v] & 0xffffu), hi = e4m3x2_to_f16x2(w[v] >> 16);
            h[2 * v] = kBf16 ? f16x2_to_bf16x2(lo) : lo;
            h[2 * v + 1] = kBf16 ? f16x2_to_bf16x2(hi) : hi;
        }
    }
};

// e5m2 is the upper byte of an f16 (Inf and NaN included): one byte permute per pair.
template <bool kBf16, int kPiece>
struct WindowDecode<E5M2, kBf16, kPiece> {
    static constexpr int kLane = 16, kWords = 4;
    static constexpr bool kXPermuted = false;
    __device__ __forceinline__ static constexpr int code_of(int p, int e) { return 2 * p + e; }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kLane / 2])
    {
#pragma unroll
        for (int v = 0; v < kWords; ++v) {
            const uint32_t lo = prmt(w[v], 0u, 0x1404), hi = prmt(w[v], 0u, 0x3424);  // [0, c0, 0, c1], [0, c2, 0, c3]
            h[2 * v] = kBf16 ? f16x2_to_bf16x2(lo) : lo;
            h[2 * v + 1] = kBf16 ? f16x2_to_bf16x2(hi) : hi;
        }
    }
};

// e2m1: a word holds 8 codes (nibble j in bits 4j .. 4j + 3); pair j of a word takes nibbles j and j + 4, whose bits
// are 16 apart, so one shift places both signs (bit 15, 31) and one both magnitudes (Marlin's bit placement: bf16 bits
// 8..6, f16 bits 11..9), then one exact multiply by 2^126 (bf16) or 2^14 (f16). Nibble j of word v is the lane's code
// 8v + j; with pieces of 4 codes (groups of 16) load_window interleaves the bytes of two pieces A, B as [A0, B0, A1, B1],
// so that the pairs (A0, A2), (A1, A3), (B0, B2), (B1, B3) keep each step in one group.
template <bool kBf16, int kPiece>
struct WindowDecode<E2M1, kBf16, kPiece> {
    static constexpr int kLane = 32, kWords = 4;
    static constexpr int kMagLow = kBf16 ? 6 : 9;  // bit of the magnitude's low bit in the target half
    static constexpr uint32_t kMagMask = 0x7u << kMagLow | 0x7u << (kMagLow + 16);
    static constexpr uint32_t kScale = kBf16 ? 0x7e807e80u : 0x74007400u;  // 2^126, 2^14
    __device__ __forceinline__ static constexpr int code_of(int p, int e)
    {
        return kPiece == 4 ? 8 * (p / 4) + 4 * (p % 4 / 2) + p % 2 + 2 * e : 8 * (p / 4) + p % 4 + 4 * e;
    }
    // x in pair order: (j, j + 4) of 8 codes; pieces of 4 (groups of 16): (j, j + 2) of each piece
    static constexpr bool kXPermuted = true;
    template <int j>
    __device__ __forceinline__ static uint32_t pair(uint32_t q)
    {
        return mul_x2<kBf16>((shift_left<12 - 4 * j>(q) & 0x80008000u) | (shift_left<kMagLow - 4 * j>(q) & kMagMask),
                             kScale);
    }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kLane / 2])
    {
#pragma unroll
        for (int v = 0; v < kWords; ++v) {
            h[4 * v] = pair<0>(w[v]);
            h[4 * v + 1] = pair<1>(w[v]);
            h[4 * v + 2] = pair<2>(w[v]);
            h[4 * v + 3] = pair<3>(w[v]);
        }
    }
};

// Pair order of an 8-element chunk of x (D::kXPermuted): slot 2q + e holds element code_of(q, e) (q < 4: the pairs of
// one chunk of a lane's codes), so that the lane's raw pairs are its B pairs.
template <class D>
__host__ __device__ constexpr int chunk_element(int slot)
{
    return D::code_of(slot / 2, slot % 2);
}

// One 16-byte chunk of 16-bit x (8 elements, 4 words) in pair order, in place: one PRMT per word.
template <class D>
__device__ __forceinline__ void permute_x_chunk(uint8_t* chunk)
{
    static_assert(chunk_element<D>(0) >= 0 && chunk_element<D>(7) < 8, "a chunk's pairs stay in the chunk");
    uint4* p = reinterpret_cast<uint4*>(chunk);
    const uint4 v = *p;
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int i0 = chunk_element<D>(2 * q), i1 = chunk_element<D>(2 * q + 1);
        out[q] = prmt(w[i0 / 2], w[i1 / 2], uint32_t(i0 % 2 * 2) | uint32_t(i0 % 2 * 2 + 1) << 4 |
                                                uint32_t(4 + i1 % 2 * 2) << 8 | uint32_t(5 + i1 % 2 * 2) << 12);
    }
    *p = make_uint4(out[0], out[1], out[2], out[3]);
}

// ---- the plan of one launch --------------------------------------------------------------------------------------

// Computed on the host by gemv_plan, passed by value to the kernel. Positions are *virtual* k positions: the aligned
// path's are K's own; the padded path pads each group to group_steps * 16 positions (zero codes, zero x).
struct GemvPlan {
    int32_t m, n, k;
    int32_t group_size;     // G (at most K)
    int32_t group_steps;    // k16 steps per group (aligned: G / 16, or all of K for one group; padded: ceil(G / 16))
    int32_t n_groups;       // ceil(K / G)
    int32_t total_steps;    // virtual k16 steps of a row
    int32_t total_stages;   // ceil(total_steps * 16 / kStageK)
    int32_t split_stages;   // stages per split
    int32_t splits;         // grid.y
    int32_t tiles;          // grid.x: ceil(N / 64)
    int32_t stage_bytes;    // one ring stage: 64 code rows, then m rows of x
    int32_t x_offset;       // bytes from a stage's start to its x
    int32_t scale_stride;   // floats per row of the block's staged scales (4 mod 8: conflict-free LDS.128)
    int32_t scale_groups;   // the groups a block stages per row: the most a split touches, a multiple of 8
    int32_t scale_offset;   // bytes from the start of shared memory to the staged scales
    int32_t smem_bytes;     // dynamic shared memory of a block
    int32_t window_mode;    // groups of whole windows: windows per group (1 << 30: one group); 0: the piece layouts
    int32_t aligned;        // 1: the aligned path (cp.async ring)
    int64_t group_bytes;    // bytes of a full group's codes (padded path)
    int64_t row_bytes;      // bytes of a row of codes
    uint32_t steps_magic;   // v / group_steps == (umulhi(v, steps_magic) + v) >> steps_shift, v < 2^31 (padded)
    int32_t steps_shift;
};

// ---- producers: fill one ring stage --------------------------------------------------------------------------------

// The aligned path: 16-byte cp.async copies of the stage's 64 code rows, two lanes per row (lane h of a pair copies
// chunks h, h + 2, ...: each instruction moves 32 consecutive bytes of 16 rows), and of x's rows (kRowChunks lanes
// per row, kRows / (128 / kRowChunks) passes, the passes past m predicated off); at K's end the bytes past the row
// are zero-filled.
template <class F, class T, int kRows>
struct AlignedProducer {
    using C = GemvCodes<F, T>;
    using X = GemvX<F, T>;
    static constexpr int kCodeChunks = C::kRowChunks / 2 + C::kRowChunks % 2;  // per lane and stage (odd: lane 0 more)
    static constexpr int kXRowsPerPass = kGemvThreads / X::kRowChunks;         // whole rows of x per pass
    static_assert(kXRowsPerPass >= 1, "a row of x per pass at least");
    const uint8_t* code_src;  // the lane's first chunk at the next stage to issue
    const uint8_t* x_src;
    int64_t x_pass_bytes;     // kXRowsPerPass rows of x
    uint32_t code_dst, x_dst;
    int32_t whole;            // stages left that are whole (no byte past the row)
    int32_t x_row;            // the lane's row of x in pass 0 (kRows: none, the lanes past whole rows of a pass)
    int32_t code_col, x_col;  // the lane's first byte within a row of a stage

    __device__ __forceinline__ void init(const GemvArgs& a, const GemvPlan& p, int row0, int stage0, int tid)
    {
        const int row = min(row0 + (tid >> 1), p.n - 1);  // rows past N copy the last row
        code_col = (tid & 1) * 16;
        code_dst = pinned(uint32_t((tid >> 1) * C::kRowStride + code_col));
        code_src = a.w.codes + int64_t(row) * p.row_bytes + int64_t(stage0) * C::kRowBytes + code_col;
        x_row = tid < kXRowsPerPass * X::kRowChunks ? tid / X::kRowChunks : kRows;
        x_col = tid % X::kRowChunks * 16;
        x_dst = pinned(uint32_t(p.x_offset + x_row * X::kStride + x_col));
        const int64_t x_row_bytes = int64_t(p.k) * int64_t(sizeof(T));
        x_pass_bytes = x_row_bytes * kXRowsPerPass;
        x_src = static_cast<const uint8_t*>(a.x) + int64_t(x_row) * x_row_bytes + int64_t(stage0) * X::kRowBytes + x_col;
        const int64_t whole_code = p.row_bytes / C::kRowBytes - stage0, whole_x = x_row_bytes / X::kRowBytes - stage0;
        whole = int32_t(max(int64_t(0), min(whole_code, whole_x)));
    }

    // Copies the next stage into `dst`; `stage`: its index from the row's first stage (for K's end).
    __device__ __forceinline__ void issue(uint8_t* dst, const GemvPlan& p, int stage)
    {
        if (--whole >= 0) {  // a whole stage
#pragma unroll
            for (int u = 0; u < kCodeChunks; ++u) {
                if (C::kRowChunks % 2 == 0 || u + 1 < kCodeChunks || code_col == 0) {  // odd chunk counts: lane 0 more
                    cp_async16(dst + code_dst + 32 * u, code_src + 32 * u, 16);
                }
            }
            copy_x(dst, p, x_src, 16);
        } else {  // K's end: the bytes past the row are zero-filled (no bytes read for src_bytes = 0)
            // the bytes left in the row from the lane's first chunk, clamped to a stage (32-bit arithmetic per chunk)
            const int code_left = int(min(int64_t(C::kRowBytes), p.row_bytes - int64_t(stage) * C::kRowBytes - code_col));
            const int64_t x_left = int64_t(p.k) * int64_t(sizeof(T)) - int64_t(stage) * X::kRowBytes - x_col;
#pragma unroll
            for (int u = 0; u < kCodeChunks; ++u) {
                if (C::kRowChunks % 2 == 0 || u + 1 < kCodeChunks || code_col == 0) {
                    const uint32_t n = uint32_t(min(max(code_left - 32 * u, 0), 16));
                    cp_async16(dst + code_dst + 32 * u, code_src + (n ? 32 * u : 0), n);
                }
            }
            const uint32_t n = uint32_t(max(int64_t(0), min(int64_t(16), x_left)));
            copy_x(dst, p, x_src, n);
        }
        code_src += C::kRowBytes, x_src += X::kRowBytes;
    }

    // The lane's chunk of each of its rows of x (x_row, x_row + kXRowsPerPass, ... < m): n bytes of it (zero fill).
    __device__ __forceinline__ void copy_x(uint8_t* dst, const GemvPlan& p, const uint8_t* src, uint32_t n) const
    {
        uint8_t* d = dst + x_dst;
#pragma unroll 1
        for (int m = x_row; m < p.m; m += kXRowsPerPass) {
            cp_async16(d, n ? src : x_src, n);
            src += x_pass_bytes, d += kXRowsPerPass * X::kStride;
        }
    }

    // The lane's own chunks of x in a landed stage, in the decoder's pair order (after this lane's wait_group: no other
    // lane's copies are involved; the next __syncthreads publishes them).
    template <class D>
    __device__ __forceinline__ void permute(uint8_t* stage, const GemvPlan& p) const
    {
        uint8_t* d = stage + x_dst;
#pragma unroll 1
        for (int m = x_row; m < p.m; m += kXRowsPerPass) {
            permute_x_chunk<D>(d);
            d += kXRowsPerPass * X::kStride;
        }
    }
};

// The padded path: each (row, k16 step) of the stage read with byte loads from its group (zero codes past the group's
// codes), and x likewise (zeros past the group; in the decoder's pair order for 16-bit x when D::kXPermuted); v /
// group_steps by a magic multiply.
template <class F, class T, class D>
struct PaddedProducer {
    static constexpr bool kPermute = sizeof(T) == 2 && D::kXPermuted;
    using C = GemvCodes<F, T>;
    using X = GemvX<F, T>;
    static constexpr int kStepBytes = 2 * F::kBits;  // 16 codes
    static constexpr int kStepsPerStage = C::kStageK / 16;

    __device__ __forceinline__ static int group_of(const GemvPlan& p, int v)
    {
        return int((__umulhi(uint32_t(v), p.steps_magic) + uint32_t(v)) >> p.steps_shift);
    }

    __device__ __forceinline__ static void fill(uint8_t* dst, const GemvArgs& a, const GemvPlan& p, int row0,
                                                int first_step, int tid)
    {
        // codes: 64 rows x 16 steps
#pragma unroll 1
        for (int u = tid; u < kGemvBlockRows * kStepsPerStage; u += kGemvThreads) {
            const int row = u / kStepsPerStage, s = u % kStepsPerStage, v = first_step + s;
            const int g = group_of(p, v), j0 = (v - g * p.group_steps) * 16;
            const int glen = min(p.group_size, p.k - g * p.group_size);
            const int n_valid = v < p.total_steps ? max(0, min(16, glen - j0)) : 0;
            const int n_bytes = (n_valid * F::kBits + 7) / 8;
            const uint8_t* src = a.w.codes + int64_t(min(row0 + row, p.n - 1)) * p.row_bytes +
                                 int64_t(g) * p.group_bytes + j0 * F::kBits / 8;
            uint32_t words[kStepBytes / 4];
#pragma unroll
            for (int wi = 0; wi < kStepBytes / 4; ++wi) {
                uint32_t word = 0;
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    const int i = 4 * wi + b;
                    word |= (i < n_bytes ? uint32_t(src[i]) : 0u) << (8 * b);
                }
                const int bit0 = 32 * wi, valid_bits = n_valid * F::kBits;
                word &= valid_bits >= bit0 + 32 ? 0xffffffffu : valid_bits <= bit0 ? 0u : (1u << (valid_bits - bit0)) - 1u;
                words[wi] = word;
            }
            uint8_t* out = dst + row * C::kRowStride + s * kStepBytes;
            memcpy(out, words, kStepBytes);
        }
        // x: m rows x 16 steps x 16 elements
        const T* x = static_cast<const T*>(a.x);
#pragma unroll 1
        for (int u = tid; u < p.m * kStepsPerStage; u += kGemvThreads) {
            const int m = u / kStepsPerStage, s = u % kStepsPerStage, v = first_step + s;
            const int g = group_of(p, v), j0 = (v - g * p.group_steps) * 16;
            const int glen = min(p.group_size, p.k - g * p.group_size);
            const int n_valid = v < p.total_steps ? max(0, min(16, glen - j0)) : 0;
            const T* src = x + int64_t(m) * p.k + int64_t(g) * p.group_size + j0;
            T* out = reinterpret_cast<T*>(dst + p.x_offset + m * X::kStride) + s * 16;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int e = kPermute ? i / 8 * 8 + chunk_element<D>(i % 8) : i;
                out[i] = e < n_valid ? src[e] : T{};
            }
        }
    }
};

// ---- the block's scales --------------------------------------------------------------------------------------------

// Group scales g0 .. g0 + p.scale_groups - 1 of the block's 64 rows, decoded to fp32 (SPEC 3: fp32 as stored, E8M0
// 2^(b - 127) with byte 255 NaN, NVFP4 fl(decode_e4m3(c) * t); zero past the last group) into scales[row *
// scale_stride + g], eight groups at a time, two lanes per row. The one-byte kinds go through a table of the 256 bytes'
// values (`table`, 1 KiB, filled once per block): a load per scale instead of its decode.
__device__ __forceinline__ float e8m0_to_f32(uint32_t byte)
{
    return bits_f32(byte == kE8m0Nan ? kF32QuietNan : byte == 0 ? 0x00400000u : byte << kF32ManBits);
}

__device__ __forceinline__ void stage_scales(float* scales, float* table, const GemvArgs& a, const GemvPlan& p,
                                             int row0, int g0, int tid)
{
    const int row = tid >> 1;
    // once per block, 32-bit: rows < N < 2^31 and block_rows <= N (ds_fpquant.linear clamps it)
    const int64_t scale_row = uint32_t(min(row0 + row, p.n - 1)) / uint32_t(a.w.block_rows);
    const int64_t base = scale_row * a.w.scale_cols + g0;
    const int first = 8 * (tid & 1);  // lane pair: groups first .. first + 7, + 16, ...
    float* out = scales + row * p.scale_stride + first;
    int left = p.n_groups - g0 - first;  // groups of the row from the lane's next one
    if (a.w.scale_kind == LinearScale::kFp32) {
        const float* src = static_cast<const float*>(a.w.scales) + base + first;
#pragma unroll 1
        for (int g = first; g < p.scale_groups; g += 16, src += 16, out += 16, left -= 16) {
            float s[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) { s[i] = i < left ? src[i] : 0.0f; }
            reinterpret_cast<float4*>(out)[0] = make_float4(s[0], s[1], s[2], s[3]);
            reinterpret_cast<float4*>(out)[1] = make_float4(s[4], s[5], s[6], s[7]);
        }
        return;
    }
    static_assert(kGemvThreads == 128, "two table entries per thread");
    if (a.w.scale_kind == LinearScale::kE8m0) {
        table[tid] = e8m0_to_f32(uint32_t(tid)), table[tid + 128] = e8m0_to_f32(uint32_t(tid + 128));
    } else {  // NVFP4: e4m3 codes times the tensor scale
        const uint32_t two = e4m3x2_to_f16x2(uint32_t(tid) | uint32_t(tid + 128) << 8);
        table[tid] = __fmul_rn(f16_lo_to_f32(two), a.w.tensor_scale);
        table[tid + 128] = __fmul_rn(f16_hi_to_f32(two), a.w.tensor_scale);
    }
    __syncthreads();
    const uint8_t* src = static_cast<const uint8_t*>(a.w.scales) + base + first;
#pragma unroll 1
    for (int g = first; g < p.scale_groups; g += 16, src += 16, out += 16, left -= 16) {
        float s[8];
        if (left >= 8) {  // the row's groups go on: no guard per load
#pragma unroll
            for (int i = 0; i < 8; ++i) { s[i] = table[src[i]]; }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) { s[i] = i < left ? table[src[i]] : 0.0f; }
        }
        reinterpret_cast<float4*>(out)[0] = make_float4(s[0], s[1], s[2], s[3]);
        reinterpret_cast<float4*>(out)[1] = make_float4(s[4], s[5], s[6], s[7]);
    }
}

// ---- the epilogue --------------------------------------------------------------------------------------------------

// The block's results, kN per lane: value v[i] for x row m[i] and weight row n[i]. One split: y = round(v + bias)
// (SPEC 8.1: bias added in fp32, one rounding to x's dtype). Several: this split's partial sums to the workspace; the
// tile's last block to arrive (counter) adds the splits in split order, adds the bias and rounds.
template <class T, int kN>
__device__ __forceinline__ void gemv_epilogue(const GemvArgs& a, const GemvPlan& p, uint8_t* smem, const float (&v)[kN],
                                              const int (&m)[kN], const int (&n)[kN], int row0, int split, int tid)
{
    T* y = static_cast<T*>(a.y);
    const T* bias = static_cast<const T*>(a.bias);
    if (p.splits == 1) {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
            if (m[i] < p.m && n[i] < p.n) {
                const float b = bias ? load_f32(bias[n[i]]) : 0.0f;
                y[int64_t(m[i]) * p.n + n[i]] = store_from_f32<T>(__fadd_rn(v[i], b));
            }
        }
        return;
    }
    float* ws = a.workspace + int64_t(split) * p.m * p.n;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
        if (m[i] < p.m && n[i] < p.n) { ws[int64_t(m[i]) * p.n + n[i]] = v[i]; }
    }
    __threadfence();  // this block's partials visible before its arrival is counted
    __syncthreads();
    int* last = reinterpret_cast<int*>(smem + p.smem_bytes - 16);
    if (tid == 0) { *last = atomicAdd(a.counters + blockIdx.x, 1) == p.splits - 1; }
    __syncthreads();
    if (!*last) { return; }
    __threadfence();
    const int64_t plane = int64_t(p.m) * p.n;
#pragma unroll 1
    for (int i = tid; i < kGemvBlockRows * p.m; i += kGemvThreads) {
        const int mi = i / kGemvBlockRows, ni = row0 + i % kGemvBlockRows;
        if (ni < p.n) {
            const float* src = a.workspace + int64_t(mi) * p.n + ni;
            float acc = __ldcg(src);
#pragma unroll 1
            for (int s = 1; s < p.splits; ++s) { acc = __fadd_rn(acc, __ldcg(src + s * plane)); }
            const float b = bias ? load_f32(bias[ni]) : 0.0f;
            y[int64_t(mi) * p.n + ni] = store_from_f32<T>(__fadd_rn(acc, b));
        }
    }
    if (tid == 0) { a.counters[blockIdx.x] = 0; }  // ready for the next launch on this workspace
}

// ---- shared-memory loads of a window ---------------------------------------------------------------------------------

// The lane's codes of one row in a window (`row` at the window's first byte in the stage), pieces in order.
template <class F, int kPiece>
__device__ __forceinline__ void load_window(const uint8_t* row, int c, uint32_t (&w)[GemvCodes<F>::kLaneBytes / 4])
{
    constexpr int kLane = GemvCodes<F>::kLane, kPieces = kLane / kPiece, kPieceBytes = kPiece * F::kBits / 8;
    if constexpr (kPieceBytes == 2) {  // e2m1, groups of 16: two pieces per word, bytes interleaved [A0, B0, A1, B1]
#pragma unroll
        for (int v = 0; v < kPieces / 2; ++v) {
            const uint32_t a = *reinterpret_cast<const uint16_t*>(row + (8 * v + c) * kPieceBytes);
            const uint32_t b = *reinterpret_cast<const uint16_t*>(row + (8 * v + 4 + c) * kPieceBytes);
            w[v] = prmt(a, b, 0x5140);
        }
    } else if constexpr (kPieceBytes == 6) {  // FP6, groups of 32: 6-byte pieces at 2-byte offsets, made one bit stream
        uint64_t piece[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int offset = (4 * j + c) * kPieceBytes;
            const uint32_t* src = reinterpret_cast<const uint32_t*>(row + (offset & ~3));
            piece[j] = (uint64_t(src[1]) << 32 | src[0]) >> (8 * (offset & 3));
        }
        w[0] = uint32_t(piece[0]);
        w[1] = (uint32_t(piece[0] >> 32) & 0xffffu) | uint32_t(piece[1]) << 16;
        w[2] = uint32_t(piece[1] >> 16);
    } else {  // whole words per piece
        constexpr int kWords = kPieceBytes / 4;
#pragma unroll
        for (int j = 0; j < kPieces; ++j) {
            const uint8_t* src = row + (4 * j + c) * kPieceBytes;
            if constexpr (kWords % 4 == 0) {
#pragma unroll
                for (int q = 0; q < kWords / 4; ++q) {
                    const uint4 v = reinterpret_cast<const uint4*>(src)[q];
                    w[j * kWords + 4 * q] = v.x, w[j * kWords + 4 * q + 1] = v.y;
                    w[j * kWords + 4 * q + 2] = v.z, w[j * kWords + 4 * q + 3] = v.w;
                }
            } else if constexpr (kWords % 2 == 0) {
#pragma unroll
                for (int q = 0; q < kWords / 2; ++q) {
                    const uint2 v = reinterpret_cast<const uint2*>(src)[q];
                    w[j * kWords + 2 * q] = v.x, w[j * kWords + 2 * q + 1] = v.y;
                }
            } else {
#pragma unroll
                for (int q = 0; q < kWords; ++q) { w[j * kWords + q] = reinterpret_cast<const uint32_t*>(src)[q]; }
            }
        }
    }
}

// The lane's x of one row of x in a window (`row` at the window's first element), as pairs raw[q] = (x[2q], x[2q + 1])
// of the lane's positions in piece order.
template <class T, int kLane, int kPiece>
__device__ __forceinline__ void load_x_window(const T* row, int c, uint32_t (&raw)[kLane / 2])
{
    static_assert(sizeof(T) == 2, "16-bit x");
    constexpr int kPieces = kLane / kPiece, kWords = kPiece / 2;  // words of one piece
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
        const T* src = row + (4 * j + c) * kPiece;
        if constexpr (kWords % 4 == 0) {
#pragma unroll
            for (int q = 0; q < kWords / 4; ++q) {
                const uint4 v = reinterpret_cast<const uint4*>(src)[q];
                raw[j * kWords + 4 * q] = v.x, raw[j * kWords + 4 * q + 1] = v.y;
                raw[j * kWords + 4 * q + 2] = v.z, raw[j * kWords + 4 * q + 3] = v.w;
            }
        } else {
            const uint2 v = *reinterpret_cast<const uint2*>(src);
            raw[j * kWords] = v.x, raw[j * kWords + 1] = v.y;
        }
    }
}

// The B pairs in the decoder's order: xb[p] = (x[code_of(p, 0)], x[code_of(p, 1)]) from the raw pairs: as they are when
// the stage's x is stored in pair order (D::kXPermuted), else by one PRMT per pair that is not two adjacent elements.
template <class D, int kLane>
__device__ __forceinline__ void x_pairs(const uint32_t (&raw)[kLane / 2], uint32_t (&xb)[kLane / 2])
{
#pragma unroll
    for (int p = 0; p < kLane / 2; ++p) {
        const int i0 = D::code_of(p, 0), i1 = D::code_of(p, 1);
        if (D::kXPermuted || (i0 == 2 * p && i1 == 2 * p + 1)) {
            xb[p] = raw[p];
        } else {
            xb[p] = prmt(raw[i0 / 2], raw[i1 / 2], uint32_t(i0 % 2 * 2) | uint32_t(i0 % 2 * 2 + 1) << 4 |
                                                      uint32_t(4 + i1 % 2 * 2) << 8 | uint32_t(5 + i1 % 2 * 2) << 12);
        }
    }
}

// ---- the tensor-core consumer ---------------------------------------------------------------------------------------

// One warp's fp32 state on the tensor-core path: the running mma chain and the total, per n-tile (c0, c1: row r,
// x rows 8t + 2c, 8t + 2c + 1; c2, c3: row r + 8).
template <int kNT>
struct MmaState {
    float chain[kNT][4];
    float total[kNT][4];
};

// total += scale * chain (one FFMA per output: the group's partial sum times its scale, SPEC 8.1), chain = 0.
template <int kNT>
__device__ __forceinline__ void flush(MmaState<kNT>& st, float s_r, float s_r8)
{
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
        st.total[t][0] = __fmaf_rn(s_r, st.chain[t][0], st.total[t][0]);
        st.total[t][1] = __fmaf_rn(s_r, st.chain[t][1], st.total[t][1]);
        st.total[t][2] = __fmaf_rn(s_r8, st.chain[t][2], st.total[t][2]);
        st.total[t][3] = __fmaf_rn(s_r8, st.chain[t][3], st.total[t][3]);
#pragma unroll
        for (int i = 0; i < 4; ++i) { st.chain[t][i] = 0.0f; }
    }
}

// total += scale * chain without clearing the chain (the next group's first step starts it afresh: kPeriod).
template <int kNT>
__device__ __forceinline__ void add_scaled(MmaState<kNT>& st, float s_r, float s_r8)
{
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
        st.total[t][0] = __fmaf_rn(s_r, st.chain[t][0], st.total[t][0]);
        st.total[t][1] = __fmaf_rn(s_r, st.chain[t][1], st.total[t][1]);
        st.total[t][2] = __fmaf_rn(s_r8, st.chain[t][2], st.total[t][2]);
        st.total[t][3] = __fmaf_rn(s_r8, st.chain[t][3], st.total[t][3]);
    }
}

// mma step s of a window: chain = A_s B_s + chain, or A_s B_s + 0 for a group's first step (kFresh).
template <bool kFresh, bool kBf16, int kNT, int kPairs>
__device__ __forceinline__ void mma_step(MmaState<kNT>& st, const uint32_t (&ha)[kPairs], const uint32_t (&hb)[kPairs],
                                         const uint32_t (&xb)[kNT][kPairs], int s)
{
    const uint32_t a[4] = {ha[2 * s], hb[2 * s], ha[2 * s + 1], hb[2 * s + 1]};
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
        if constexpr (kFresh) {
            const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_16816<kBf16>(st.chain[t], a, xb[t][2 * s], xb[t][2 * s + 1], zero);
        } else {
            mma_16816<kBf16>(st.chain[t], a, xb[t][2 * s], xb[t][2 * s + 1], st.chain[t]);
        }
    }
}

// n consecutive staged scales (n = 1, 2, 4 or 8; the row's first at a multiple of 4 floats, the run at a multiple of
// n: vector loads).
template <int kN>
__device__ __forceinline__ void load_scales(const float* src, float (&out)[kN])
{
    if constexpr (kN % 4 == 0) {
#pragma unroll
        for (int q = 0; q < kN / 4; ++q) {
            const float4 v = reinterpret_cast<const float4*>(src)[q];
            out[4 * q] = v.x, out[4 * q + 1] = v.y, out[4 * q + 2] = v.z, out[4 * q + 3] = v.w;
        }
    } else if constexpr (kN == 2) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        out[0] = v.x, out[1] = v.y;
    } else {
        static_assert(kN == 1, "1, 2, 4 or 8 scales");
        out[0] = *src;
    }
}

// How a window meets group ends: kNone (none), kLast (a group ends at the window's last step), kPeriod (groups of
// kPeriod steps, the piece layouts).
enum class WindowEnds { kNone, kLast, kPeriod };

// The window's steps; `srow_r` / `srow_r8`: the scales of rows r and r + 8 at the chain's group. Returns the groups
// ended.
template <WindowEnds kEnds, int kPeriod, int kSteps, bool kBf16, int kNT, int kPairs>
__device__ __forceinline__ int window_steps(MmaState<kNT>& st, const uint32_t (&ha)[kPairs],
                                            const uint32_t (&hb)[kPairs], const uint32_t (&xb)[kNT][kPairs],
                                            const float* srow_r, const float* srow_r8)
{
    if constexpr (kEnds == WindowEnds::kPeriod) {  // the window starts a group: every group lies in it
        constexpr int kGroups = kSteps / kPeriod;
        float s_r[kGroups], s_r8[kGroups];
        load_scales<kGroups>(srow_r, s_r);
        load_scales<kGroups>(srow_r8, s_r8);
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
            if (s % kPeriod == 0) {
                mma_step<true, kBf16>(st, ha, hb, xb, s);
            } else {
                mma_step<false, kBf16>(st, ha, hb, xb, s);
            }
            if (s % kPeriod == kPeriod - 1) { add_scaled(st, s_r[s / kPeriod], s_r8[s / kPeriod]); }
        }
        return kGroups;
    } else {
#pragma unroll
        for (int s = 0; s < kSteps; ++s) { mma_step<false, kBf16>(st, ha, hb, xb, s); }
        if constexpr (kEnds == WindowEnds::kLast) {
            flush(st, *srow_r, *srow_r8);
            return 1;
        }
        return 0;
    }
}

// ---- the kernels -----------------------------------------------------------------------------------------------------

// What both kernels share: the block's place, its ring of stages and their producer, its scales. The stage loop:
// next(j) (every lane's stage j landed and in pair order, every warp done with stage j - 1: refill that buffer),
// consume stage j, done(j) (this lane's copies of stage j + 1 landed: its x chunks to pair order).
template <class F, class T, int kRows, bool kAligned, class D>
struct GemvBlock {
    using C = GemvCodes<F, T>;
    using X = GemvX<F, T>;
    static constexpr int kStepsPerStage = C::kStageK / 16;
    static constexpr bool kPermute = sizeof(T) == 2 && D::kXPermuted;
    uint8_t* smem;
    float* scales;
    uint8_t* buffer_next;  // stage j's buffer at next(j); then stage j + 1's
    uint8_t* buffer_free;  // the buffer next(j) refills: stage j - 1's (the ring's last one for j = 0)
    int row0, split, stage0, n_stages, first_step, g0;
    AlignedProducer<F, T, kRows> producer;

    __device__ __forceinline__ void start(uint8_t* shared, const GemvArgs& a, const GemvPlan& p, int tid)
    {
        smem = shared;
        scales = reinterpret_cast<float*>(smem + p.scale_offset);
        row0 = int(blockIdx.x) * kGemvBlockRows, split = int(blockIdx.y);
        stage0 = split * p.split_stages;
        n_stages = min(p.split_stages, p.total_stages - stage0);
        first_step = stage0 * kStepsPerStage;
        g0 = first_step / p.group_steps;  // the block's first group (once per block)
        // the first kGemvStages - 1 stages in flight (aligned) or filled (padded), then the scales
        if constexpr (kAligned) {
            producer.init(a, p, row0, stage0, tid);
#pragma unroll
            for (int j = 0; j < kGemvStages - 1; ++j) {
                if (j < n_stages) { producer.issue(smem + j * p.stage_bytes, p, stage0 + j); }
                cp_async_commit();
            }
        } else {
#pragma unroll 1
            for (int j = 0; j < kGemvStages - 1 && j < n_stages; ++j) {
                PaddedProducer<F, T, D>::fill(smem + j * p.stage_bytes, a, p, row0, first_step + j * kStepsPerStage,
                                              tid);
            }
        }
        stage_scales(scales, reinterpret_cast<float*>(smem + p.smem_bytes - 16 - 1024), a, p, row0, g0, tid);
        buffer_next = smem, buffer_free = smem + (kGemvStages - 1) * p.stage_bytes;
        if constexpr (kAligned) {
            cp_async_wait<kGemvStages - 2>();  // this lane's copies of stage 0
            if constexpr (kPermute) { producer.template permute<D>(smem, p); }
        }
    }

    __device__ __forceinline__ const uint8_t* next(const GemvArgs& a, const GemvPlan& p, int j, int tid)
    {
        __syncthreads();
        const int refill = j + kGemvStages - 1;
        if constexpr (kAligned) {
            if (refill < n_stages) { producer.issue(buffer_free, p, stage0 + refill); }
            cp_async_commit();
        } else {
            if (refill < n_stages) {
                PaddedProducer<F, T, D>::fill(buffer_free, a, p, row0, first_step + refill * kStepsPerStage, tid);
            }
        }
        uint8_t* const stage = buffer_next;
        buffer_free = stage;
        buffer_next = stage + p.stage_bytes == smem + kGemvStages * p.stage_bytes ? smem : stage + p.stage_bytes;
        return stage;
    }

    __device__ __forceinline__ void done(const GemvPlan& p, int j)
    {
        if constexpr (kAligned) {
            cp_async_wait<kGemvStages - 2>();  // this lane's copies of stage j + 1
            if constexpr (kPermute) {
                if (j + 1 < n_stages) { producer.template permute<D>(buffer_next, p); }
            }
        }
    }

    // windows (window_mode > 0) left in the chain's group at the block's start
    __device__ __forceinline__ int windows_left(const GemvPlan& p) const
    {
        return p.window_mode - (first_step / C::kSteps) % p.window_mode;
    }
};

// y (m, n) = x (m, k) @ W^T + bias on tensor cores, bf16 or fp16 x (kRows: 8 or 16, the rows of x the instantiation
// serves; kPiece: the lane layout; kAligned: the cp.async ring, else the padded path).
template <class F, class T, int kRows, int kPiece, bool kAligned>
__global__ void __launch_bounds__(kGemvThreads) gemv_mma_kernel(GemvArgs a, GemvPlan p)
{
    static_assert(!std::is_same<T, float>::value, "fp32 x: gemv_fp32_kernel");
    static_assert(gemv_has_piece<F>(kPiece) && (kAligned || kPiece == GemvCodes<F>::kLane), "no such layout");
    constexpr bool kBf16 = std::is_same<T, Bf16>::value;
    constexpr int kNT = kRows / 8;
    using C = GemvCodes<F, T>;
    using D = WindowDecode<F, kBf16, kPiece>;
    using X = GemvX<F, T>;
    constexpr int kLane = C::kLane, kPairs = kLane / 2, kSteps = C::kSteps;
    constexpr bool kWhole = kPiece == kLane;  // groups of whole windows
    FPQ_DYNAMIC_SHARED(uint4, smem4);
    const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int r = lane >> 2, c = lane & 3;
    GemvBlock<F, T, kRows, kAligned, D> blk;
    blk.start(reinterpret_cast<uint8_t*>(smem4), a, p, tid);

    MmaState<kNT> st;
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) { st.chain[t][i] = 0.0f, st.total[t][i] = 0.0f; }
    }
    const float* srow_r = blk.scales + (warp * 16 + r) * p.scale_stride;  // at the chain's group
    const float* srow_r8 = srow_r + 8 * p.scale_stride;
    int x_rows[kNT];
#pragma unroll
    for (int t = 0; t < kNT; ++t) { x_rows[t] = min(8 * t + r, p.m - 1); }  // B columns past m repeat a row of x
    int left = kWhole ? blk.windows_left(p) : 0;
    const uint32_t code_off = pinned(uint32_t((warp * 16 + r) * C::kRowStride));  // the lane's rows in a stage
    uint32_t x_off[kNT];
#pragma unroll
    for (int t = 0; t < kNT; ++t) { x_off[t] = pinned(uint32_t(p.x_offset + x_rows[t] * X::kStride)); }

#pragma unroll 1
    for (int j = 0; j < blk.n_stages; ++j) {
        const uint8_t* stage = blk.next(a, p, j, tid);
        const uint8_t* code_r = stage + code_off;
#pragma unroll
        for (int w = 0; w < C::kWindows; ++w) {
            uint32_t wa[C::kLaneBytes / 4], wb[C::kLaneBytes / 4];
            load_window<F, kPiece>(code_r + w * C::kWindowBytes, c, wa);
            load_window<F, kPiece>(code_r + 8 * C::kRowStride + w * C::kWindowBytes, c, wb);
            uint32_t ha[kPairs], hb[kPairs];
            D::decode(wa, ha);
            D::decode(wb, hb);
            uint32_t xb[kNT][kPairs];
#pragma unroll
            for (int t = 0; t < kNT; ++t) {
                uint32_t raw[kPairs];
                load_x_window<T, kLane, kPiece>(reinterpret_cast<const T*>(stage + x_off[t]) + w * C::kWindow, c, raw);
                x_pairs<D, kLane>(raw, xb[t]);
            }
            int ended;
            if constexpr (!kWhole) {
                ended = window_steps<WindowEnds::kPeriod, kPiece / 4, kSteps, kBf16>(st, ha, hb, xb, srow_r, srow_r8);
            } else if (--left == 0) {
                ended = window_steps<WindowEnds::kLast, 1, kSteps, kBf16>(st, ha, hb, xb, srow_r, srow_r8);
                left = p.window_mode;
            } else {
                ended = window_steps<WindowEnds::kNone, 1, kSteps, kBf16>(st, ha, hb, xb, srow_r, srow_r8);
            }
            srow_r += ended, srow_r8 += ended;
        }
        blk.done(p, j);
    }
    if constexpr (kAligned) { cp_async_wait<0>(); }  // the trailing empty groups
    if (kWhole && left != p.window_mode) { flush(st, *srow_r, *srow_r8); }  // the block ends inside a group

    // y, or this split's partial sums
    const int n_r = blk.row0 + warp * 16 + r;
    float out[4 * kNT];
    int out_m[4 * kNT], out_n[4 * kNT];
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[4 * t + i] = st.total[t][i];
            out_m[4 * t + i] = 8 * t + 2 * c + (i & 1);
            out_n[4 * t + i] = n_r + (i >> 1) * 8;
        }
    }
    gemv_epilogue<T, 4 * kNT>(a, p, blk.smem, out, out_m, out_n, blk.row0, blk.split, tid);
}

// The same for fp32 x on CUDA cores: the codes decoded as for bf16 x and widened to fp32, one FFMA per weight and row
// of x (fp32 x has no exact tensor-core path inside SPEC 8.2: docs/gpu.md). Each lane accumulates its share of rows
// r and r + 8 for every row of x; the four lanes of a row add theirs at the end.
template <class F, int kRows, int kPiece, bool kAligned>
__global__ void __launch_bounds__(kGemvThreads, 1) gemv_fp32_kernel(GemvArgs a, GemvPlan p)
{
    static_assert(gemv_has_piece<F>(kPiece) && (kAligned || kPiece == GemvCodes<F>::kLane), "no such layout");
    static_assert(kRows % 4 == 0, "each lane of a row writes kRows / 4 rows of x");
    using T = float;
    using C = GemvCodes<F, T>;
    using D = WindowDecode<F, true, kPiece>;
    using X = GemvX<F, T>;
    constexpr int kLane = C::kLane, kPairs = kLane / 2, kSteps = C::kSteps;
    constexpr bool kWhole = kPiece == kLane;
    FPQ_DYNAMIC_SHARED(uint4, smem4);
    const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int r = lane >> 2, c = lane & 3;
    GemvBlock<F, T, kRows, kAligned, D> blk;
    blk.start(reinterpret_cast<uint8_t*>(smem4), a, p, tid);

    float part[2][kRows], total[2][kRows];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int m = 0; m < kRows; ++m) { part[h][m] = 0.0f, total[h][m] = 0.0f; }
    }
    const float* srow_r = blk.scales + (warp * 16 + r) * p.scale_stride;
    const float* srow_r8 = srow_r + 8 * p.scale_stride;
    int left = kWhole ? blk.windows_left(p) : 0;

#pragma unroll 1
    for (int j = 0; j < blk.n_stages; ++j) {
        const uint8_t* stage = blk.next(a, p, j, tid);
        const uint8_t* code_r = stage + (warp * 16 + r) * C::kRowStride;
        const float* xs = reinterpret_cast<const float*>(stage + p.x_offset);
#pragma unroll 1
        for (int w = 0; w < C::kWindows; ++w) {
            uint32_t wa[C::kLaneBytes / 4], wb[C::kLaneBytes / 4];
            load_window<F, kPiece>(code_r + w * C::kWindowBytes, c, wa);
            load_window<F, kPiece>(code_r + 8 * C::kRowStride + w * C::kWindowBytes, c, wb);
            uint32_t ha[kPairs], hb[kPairs];
            D::decode(wa, ha);
            D::decode(wb, hb);
            // the steps of the window that end a group
            uint32_t ends = 0;
            if constexpr (!kWhole) {
#pragma unroll
                for (int s = 0; s < kSteps; ++s) { ends |= uint32_t(s % (kPiece / 4) == kPiece / 4 - 1) << s; }
            } else if (--left == 0) {
                ends = 1u << (kSteps - 1), left = p.window_mode;
            }
            int ended = 0;
            // sub-windows of 16 codes (pairs 8h .. 8h + 7, steps 4h .. 4h + 3: e2m1 has two), so that the weights of
            // one and the 2 x kRows sums stay in registers
#pragma unroll
            for (int h = 0; h < kLane / 16; ++h) {
                float fa[16], fb[16];  // the weights at the sub-window's codes 16h + i (bf16 -> fp32: exact)
#pragma unroll
                for (int q = 8 * h; q < 8 * h + 8; ++q) {
                    fa[D::code_of(q, 0) - 16 * h] = __uint_as_float(ha[q] << 16);
                    fa[D::code_of(q, 1) - 16 * h] = __uint_as_float(ha[q] & 0xffff0000u);
                    fb[D::code_of(q, 0) - 16 * h] = __uint_as_float(hb[q] << 16);
                    fb[D::code_of(q, 1) - 16 * h] = __uint_as_float(hb[q] & 0xffff0000u);
                }
                int gi = ended;  // groups ended before this sub-window (the same for every row of x)
#pragma unroll
                for (int m = 0; m < kRows; ++m) {
                    if (m < p.m) {
                        float xv[16];  // x at the sub-window's codes, 4 consecutive codes (one piece) a load
#pragma unroll
                        for (int t = 0; t < 4; ++t) {
                            const int i = 16 * h + 4 * t, piece = i / kPiece;
                            const float4 v = *reinterpret_cast<const float4*>(
                                xs + m * (X::kStride / 4) + w * C::kWindow + (4 * piece + c) * kPiece + i % kPiece);
                            xv[4 * t] = v.x, xv[4 * t + 1] = v.y, xv[4 * t + 2] = v.z, xv[4 * t + 3] = v.w;
                        }
                        gi = ended;
#pragma unroll
                        for (int s = 4 * h; s < 4 * h + 4; ++s) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int i = D::code_of(2 * s + e / 2, e % 2) - 16 * h;
                                part[0][m] = __fmaf_rn(fa[i], xv[i], part[0][m]);
                                part[1][m] = __fmaf_rn(fb[i], xv[i], part[1][m]);
                            }
                            if (ends >> s & 1u) {
                                total[0][m] = __fmaf_rn(srow_r[gi], part[0][m], total[0][m]);
                                total[1][m] = __fmaf_rn(srow_r8[gi], part[1][m], total[1][m]);
                                part[0][m] = 0.0f, part[1][m] = 0.0f;
                                ++gi;
                            }
                        }
                    }
                }
                ended = gi;
            }
            srow_r += ended, srow_r8 += ended;
        }
        blk.done(p, j);
    }
    if constexpr (kAligned) { cp_async_wait<0>(); }
    const bool pending = kWhole && left != p.window_mode;
    // the four lanes of a row add their shares (after the pending chain)
    float out[kRows / 2];
    int out_m[kRows / 2], out_n[kRows / 2];
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = total[h][m];
            if (pending) { v = __fmaf_rn(h ? *srow_r8 : *srow_r, part[h][m], v); }
            v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, 1));
            v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, 2));
            if (m % 4 == c) {
                out[2 * (m / 4) + h] = v;
                out_m[2 * (m / 4) + h] = m;
                out_n[2 * (m / 4) + h] = blk.row0 + warp * 16 + r + 8 * h;
            }
        }
    }
    gemv_epilogue<T, kRows / 2>(a, p, blk.smem, out, out_m, out_n, blk.row0, blk.split, tid);
}

// ---- the plan --------------------------------------------------------------------------------------------------------

// The lane layout of the launch's aligned path (codes per lane per group block), or 0: the padded path (code rows or
// x rows not 16-byte aligned for cp.async, or groups the layouts do not cut into whole k16 steps per block).
template <class F, class T>
inline int gemv_piece(const GemvArgs& a)
{
    using C = GemvCodes<F>;
    const int64_t g = a.w.group_size, k = a.w.k;
    const bool aligned = reinterpret_cast<uintptr_t>(a.w.codes) % 16 == 0 && a.w.row_bytes % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(a.x) % 16 == 0 && (k * int64_t(sizeof(T))) % 16 == 0;
    if (!aligned) { return 0; }
    if (g >= k || g % C::kWindow == 0) { return C::kLane; }
    if (g % 16 == 0 && C::kWindow % g == 0 && gemv_has_piece<F>(int(g / 4))) { return int(g / 4); }
    return 0;
}

// (magic, shift) with v / d == (umulhi(v, magic) + v) >> shift for 0 <= v < 2^31, 1 <= d < 2^31 (Granlund-Montgomery
// round-up with the added dividend, as CUTLASS's FastDivmod).
inline void gemv_magic(uint32_t d, uint32_t& magic, int32_t& shift)
{
    int l = 0;
    while ((uint64_t(1) << l) < d) { ++l; }
    magic = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1);
    shift = l;
}

// The launch plan: 64-row tiles, and splits of K so that tiles x splits blocks give every SM about one block (its
// kGemvStages - 1 stages in flight: 60-64 KiB of codes), at most ceil(K / 256) splits (SPEC 8.2's count) unless a
// split's staged scales need more: they share the block's shared memory with the ring (up to 227 KiB), so then
// splits <= ceil(K / G). The padded path pads each group to whole windows (zero codes, zero x).
template <class F, class T>
inline GemvPlan gemv_plan(const GemvArgs& a, int num_sms, int piece)
{
    using C = GemvCodes<F, T>;
    using X = GemvX<F, T>;
    GemvPlan p{};
    const int64_t g = a.w.group_size, k = a.w.k;
    p.m = int32_t(a.w.m), p.n = int32_t(a.w.n), p.k = int32_t(k), p.group_size = int32_t(g);
    p.n_groups = int32_t(ceil_div(k, g));
    p.aligned = piece != 0;
    if (p.aligned) {
        p.total_steps = int32_t(ceil_div(k, 16));
        p.group_steps = p.n_groups == 1 ? p.total_steps : int32_t(g / 16);
    } else {
        p.group_steps = int32_t(ceil_div(g, C::kWindow) * C::kSteps);
        p.total_steps = p.n_groups * p.group_steps;
    }
    constexpr int kStepsPerStage = C::kStageK / 16;
    p.total_stages = int32_t(ceil_div(p.total_steps, kStepsPerStage));
    p.tiles = int32_t(ceil_div(a.w.n, kGemvBlockRows));
    p.x_offset = kGemvBlockRows * C::kRowStride;
    p.stage_bytes = int32_t(16 * ceil_div(p.x_offset + int64_t(p.m) * X::kStride, 16));
    p.scale_offset = kGemvStages * p.stage_bytes;
    // the staged scales take the shared memory the ring leaves: a split's groups (its whole groups and a partial one
    // at each end) within a row of stride 8 q + 4 <= room floats; one stage always fits (at most 65 groups)
    const int64_t room = (kGemvMaxShared - 16 - 1024 - int64_t(p.scale_offset)) / (4 * kGemvBlockRows);
    const int64_t max_groups = 8 * ((room - 4) / 8);
    const int64_t max_stages = std::max<int64_t>(1, (max_groups - 2) * p.group_steps / kStepsPerStage);
    const int64_t want = std::max<int64_t>(1, int64_t(std::max(num_sms, 1)) / p.tiles);  // splits: ~1 block per SM
    const int64_t max_splits = std::max<int64_t>(1, ceil_div(k, 256));  // SPEC 8.2's count of split sums
    int64_t split_stages = std::max({int64_t(1), ceil_div(p.total_stages, want), ceil_div(p.total_stages, max_splits)});
    split_stages = std::min<int64_t>(split_stages, max_stages);
    split_stages = std::max<int64_t>(split_stages, ceil_div(p.total_stages, kGemvMaxSplits));
    p.split_stages = int32_t(split_stages);
    p.splits = int32_t(ceil_div(p.total_stages, split_stages));
    const int64_t groups = ceil_div(split_stages * kStepsPerStage, p.group_steps) + 1;
    p.scale_stride = int32_t(8 * ceil_div(groups, 8) + 4);  // 4 mod 8
    p.scale_groups = int32_t(8 * ceil_div(groups, 8));
    p.smem_bytes = p.scale_offset + kGemvBlockRows * p.scale_stride * 4 + 1024 + 16;  // + the byte table, the flag
    p.window_mode = p.n_groups == 1 ? (1 << 30) : piece == C::kLane || !p.aligned ? p.group_steps / C::kSteps : 0;
    p.group_bytes = group_bytes(g, F::kBits);
    p.row_bytes = a.w.row_bytes;
    gemv_magic(uint32_t(p.group_steps), p.steps_magic, p.steps_shift);
    return p;
}

// Rows of x an instantiation is built for: 8 (one n-tile) or 16 (two).
inline int gemv_rows_for(int64_t m) { return m <= 8 ? 8 : 16; }

// The GEMV's kernel and launch: when the plan splits K, calls partials(bytes) for the split-K partial sums (any
// content: each block writes its own before the last one reads them) and counters(tiles) for the arrival counters
// (zero at the launch; the kernel leaves them zero: fp_gemv_workspace.h), then launch(kernel, grid, block,
// shared_bytes, args, plan) once; nothing without rows. Shapes the kernel's int indices cannot hold (k, n >= 2^31) and
// m > kGemvMaxRows raise.
template <class Partials, class Counters, class Launch>
void launch_gemv(Format fmt, const GemvArgs& args, int num_sms, Partials&& partials, Counters&& counters,
                 Launch&& launch)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.w.weight_dtype, [&](auto tag) {
            if (args.w.n == 0 || args.w.m == 0) { return; }
            if (args.w.k >= (int64_t(1) << 31) || args.w.n >= (int64_t(1) << 31) || args.w.m > kGemvMaxRows) {
                throw std::invalid_argument("ds_fpquant: the CUDA GEMV takes k, n < 2^31 and m <= " +
                                            std::to_string(kGemvMaxRows));
            }
            using F = decltype(f);
            using T = decltype(tag);
            constexpr int kLane = GemvCodes<F>::kLane;
            const int piece = gemv_piece<F, T>(args);
            const GemvPlan p = gemv_plan<F, T>(args, num_sms, piece);
            GemvArgs a = args;
            if (p.splits > 1) {
                a.workspace = static_cast<float*>(partials(int64_t(p.splits) * p.m * p.n * 4));
                a.counters = counters(int64_t(p.tiles));
            }
            const dim3 grid(unsigned(p.tiles), unsigned(p.splits)), block(kGemvThreads);
            auto go = [&](auto rows, auto layout, auto aligned) {
                constexpr int kRows = decltype(rows)::value, kPiece = decltype(layout)::value;
                constexpr bool kAligned = decltype(aligned)::value;
                if constexpr (std::is_same<T, float>::value) {
                    launch(gemv_fp32_kernel<F, kRows, kPiece, kAligned>, grid, block, p.smem_bytes, a, p);
                } else {
                    launch(gemv_mma_kernel<F, T, kRows, kPiece, kAligned>, grid, block, p.smem_bytes, a, p);
                }
            };
            auto with_rows = [&](auto rows) {
                using I = std::integral_constant<int, kLane>;
                if (piece == 0) {
                    go(rows, I{}, std::false_type{});
                } else if (piece == kLane) {
                    go(rows, I{}, std::true_type{});
                } else if (piece == 4) {
                    if constexpr (gemv_has_piece<F>(4)) { go(rows, std::integral_constant<int, 4>{}, std::true_type{}); }
                } else if (piece == 8) {
                    if constexpr (gemv_has_piece<F>(8)) { go(rows, std::integral_constant<int, 8>{}, std::true_type{}); }
                } else if constexpr (gemv_has_piece<F>(16) && kLane != 16) {
                    go(rows, std::integral_constant<int, 16>{}, std::true_type{});
                }
            };
            if (gemv_rows_for(args.w.m) == 8) {
                with_rows(std::integral_constant<int, 8>{});
            } else {
                with_rows(std::integral_constant<int, 16>{});
            }
        });
    });
}

}  // namespace cuda_kernels
}  // namespace fpq
