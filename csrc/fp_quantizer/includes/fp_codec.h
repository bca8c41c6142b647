// ds_fpquant codec: the one implementation of SPEC 1, 3.1, 4 and 5 shared by the CPU kernels
// (compiled as C++) and the CUDA kernels (compiled by nvcc). No torch includes. The fp16 / bf16
// input and output conversions are in fp_io.h.
//
// Everything is plain IEEE fp32 arithmetic plus integer bit manipulation, written to match the
// torch reference (ds_fpquant/reference.py) bit for bit. On the device the fp32 operations are
// the explicit round-to-nearest intrinsics, so --use_fast_math / -ftz cannot change results.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FPQ_HD __host__ __device__ __forceinline__
#else
#define FPQ_HD inline
#endif

namespace fpq {

// ---------------------------------------------------------------------------------------------
// fp32 bit helpers and IEEE round-to-nearest operations
// ---------------------------------------------------------------------------------------------
constexpr int kF32ManBits = 23;
constexpr int kF32Bias = 127;
constexpr uint32_t kF32AbsMask = 0x7fffffffu;
constexpr uint32_t kF32InfBits = 0x7f800000u;
constexpr uint32_t kF32QuietNan = 0x7fc00000u;
constexpr uint32_t kScaleFloorBits = 0x00800000u;  // 2^-126, the smallest normal fp32 (SPEC 3.1)

FPQ_HD uint32_t f32_bits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

FPQ_HD float bits_f32(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

FPQ_HD float mul_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;  // the CPU build uses -ffp-contract=off and no -ffast-math
#endif
}

FPQ_HD float add_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

FPQ_HD float div_rn(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

FPQ_HD bool f32_is_finite(uint32_t bits) { return (bits & kF32AbsMask) < kF32InfBits; }

// ---------------------------------------------------------------------------------------------
// Format traits (SPEC 1). Mirrors ds_fpquant/formats.py; a test compares the two tables.
// Only ebits, mbits and the meaning of the top exponent code are given; the rest is derived.
// ---------------------------------------------------------------------------------------------
enum class TopCode : int {
    kIeee = 0,            // all-ones exponent: Inf (mantissa 0) or NaN. e5m2.
    kNanOnlyAllOnes = 1,  // only S.1..1.1..1 is NaN. e4m3.
    kFinite = 2,          // every code finite: no NaN, no Inf. FP6, FP4, e4m7.
};

template <int kE, int kM, TopCode kTopCode>
struct FormatTraits {
    static constexpr int kEbits = kE;
    static constexpr int kMbits = kM;
    static constexpr TopCode kTop = kTopCode;
    static constexpr int kBits = 1 + kE + kM;
    static constexpr int kBias = (1 << (kE - 1)) - 1;
    static constexpr int kEmin = 1 - kBias;
    static constexpr int kMaxBiasedExp = kTopCode == TopCode::kIeee ? (1 << kE) - 2 : (1 << kE) - 1;
    static constexpr int kMaxManAtTop = kTopCode == TopCode::kNanOnlyAllOnes ? (1 << kM) - 2 : (1 << kM) - 1;
    static constexpr int kEmax = kMaxBiasedExp - kBias;
    static constexpr bool kHasInf = kTopCode == TopCode::kIeee;
    static constexpr bool kHasNan = kTopCode != TopCode::kFinite;
    static constexpr uint32_t kSignBit = 1u << (kBits - 1);
    static constexpr uint32_t kCodeMask = (1u << kBits) - 1;
    static constexpr uint32_t kMaxCode = (uint32_t(kMaxBiasedExp) << kM) | uint32_t(kMaxManAtTop);
    static constexpr uint32_t kNanCode = kHasNan ? kSignBit - 1 : 0;  // S.1..1.1..1 (SPEC 3.3)
    static constexpr uint32_t kInfCode = kHasInf ? ((1u << kE) - 1) << kM : kNanCode;
    // fp32 bit patterns of the limits; every limit of every format is an fp32 value.
    static constexpr uint32_t kFmaxBits =
        (uint32_t(kEmax + kF32Bias) << kF32ManBits) | (uint32_t(kMaxManAtTop) << (kF32ManBits - kM));
    static constexpr uint32_t kMinNormalBits = uint32_t(kEmin + kF32Bias) << kF32ManBits;
    static constexpr uint32_t kSubnormalStepBits = uint32_t(kEmin - kM + kF32Bias) << kF32ManBits;
    // M = 2^(emin - m + 23): the fp32 ulp of M is the format's subnormal step, so fl(a + M)
    // rounds a to the subnormal grid (RNE by the fp32 adder) and its low bits are the code.
    static constexpr uint32_t kMagicBits = uint32_t(kEmin - kM + kF32ManBits + kF32Bias) << kF32ManBits;
    static constexpr int kRoundShift = kF32ManBits - kM;
    static constexpr uint32_t kRebias = uint32_t(kF32Bias - kBias) << kM;

    static_assert(kE >= 2 && kE <= 8 && kM >= 1 && kM <= 10, "format outside the codec's range");
    static_assert(kEmin - kM + kF32Bias > 0, "subnormal step must be a normal fp32");
};

// The element formats, once (SPEC 1): X(Type, name, exponent bits, mantissa bits, top code). The traits
// types (E4M3, ...), the Format ids, the dispatch switch, the supported-formats message and the binding's
// name table are all generated from this list. Max finite values: e4m3 1.75 * 2^8 = 448, e5m2
// 1.75 * 2^15 = 57344, e3m2 1.75 * 2^4 = 28, e2m3 1.875 * 2^2 = 7.5, e2m1 1.5 * 2^2 = 6,
// e4m7 (2 - 2^-7) * 2^8 = 510.
#define FPQ_FORMATS(X)                                  \
    X(E4M3, "e4m3", 4, 3, TopCode::kNanOnlyAllOnes)     \
    X(E5M2, "e5m2", 5, 2, TopCode::kIeee)               \
    X(E3M2, "e3m2", 3, 2, TopCode::kFinite)             \
    X(E2M3, "e2m3", 2, 3, TopCode::kFinite)             \
    X(E2M1, "e2m1", 2, 1, TopCode::kFinite)             \
    X(E4M7, "e4m7", 4, 7, TopCode::kFinite)

#define FPQ_TRAITS_ALIAS(Type, name, ebits, mbits, top) using Type = FormatTraits<ebits, mbits, top>;
FPQ_FORMATS(FPQ_TRAITS_ALIAS)
#undef FPQ_TRAITS_ALIAS

// ---------------------------------------------------------------------------------------------
// Scales (SPEC 3.1)
// ---------------------------------------------------------------------------------------------

// |x| for finite x, 0 for NaN/Inf: the amax of a group ignores non-finite elements.
FPQ_HD float finite_abs(float x)
{
    const uint32_t a = f32_bits(x) & kF32AbsMask;
    return a < kF32InfBits ? bits_f32(a) : 0.0f;
}

// s = max(fl(amax / fmax), 2^-126); s = 1 when amax == 0.
template <class F>
FPQ_HD float scale_from_amax(float amax)
{
    const float s = div_rn(amax, bits_f32(F::kFmaxBits));
    const float floored = f32_bits(s) < kScaleFloorBits ? bits_f32(kScaleFloorBits) : s;
    return amax == 0.0f ? 1.0f : floored;
}

// r = fl(1 / s), from the stored s.
FPQ_HD float multiplier_from_scale(float s) { return div_rn(1.0f, s); }

// ---------------------------------------------------------------------------------------------
// E8M0 power-of-two scales (SPEC 3.2): s = 2^e stored as the byte e + 127; 255 is NaN.
// ---------------------------------------------------------------------------------------------
constexpr int kE8m0Bias = 127;
constexpr int kE8m0MaxExponent = 127;  // 2^127, byte 254
constexpr uint32_t kE8m0Nan = 255;
enum class ScaleMode : int { kFp32 = 0, kE8m0Ceil = 1, kE8m0Floor = 2 };

// Exact fp32 2^k for integer k in [-149, 127].
FPQ_HD float pow2f(int k)
{
    return bits_f32(k >= -126 ? uint32_t(k + kF32Bias) << kF32ManBits : 1u << (k + 149));
}

// e of SPEC 3.2 from the bits of amax (finite, >= 0), in [-127, 127 - emax_elem]. floor: floor(log2
// amax) - emax_elem. ceil: the smallest e with amax <= fmax * 2^e, which is one more than floor
// exactly when amax's significand exceeds fmax's (both normalised to [1, 2)). Both are capped at
// 127 - emax_elem, so that fmax * 2^e and every decoded value stay finite (binds only for ceil near
// FLT_MAX; the elements above fmax * 2^e then saturate). A subnormal amax is first scaled by 2^64
// (exact) to read its exponent and significand.
template <class F>
FPQ_HD int e8m0_exponent(uint32_t amax_bits, bool ceil)
{
    constexpr int kCap = kE8m0MaxExponent - F::kEmax;
    if (amax_bits == 0) { return 0; }
    const bool subnormal = (amax_bits >> kF32ManBits) == 0;
    const uint32_t bits = subnormal ? f32_bits(mul_rn(bits_f32(amax_bits), pow2f(64))) : amax_bits;
    const int e_log2 = int(bits >> kF32ManBits) - kF32Bias - (subnormal ? 64 : 0);
    int e = e_log2 - F::kEmax;
    if (ceil && (bits & 0x7fffffu) > (F::kFmaxBits & 0x7fffffu)) { ++e; }
    e = e > kCap ? kCap : e;
    return e < -127 ? -127 : e;
}

// The scale of one group (SPEC 3.1-3.3), the one rule both kernels use: the multiplier r its elements
// encode with (fl(1/s) from the stored fp32 s, or the exact 2^-e for E8M0) and what is stored: the fp32
// scale (`given`, a caller's, or from amax) or the E8M0 byte e + 127. In a format without a NaN code, a
// group holding NaN/Inf (`nonfinite`) stores NaN instead (fp32 quiet NaN, byte 255): SPEC 3.3.
struct GroupScale {
    float multiplier;
    float stored;          // ScaleMode::kFp32
    uint8_t stored_byte;   // the E8M0 modes
};

template <class F>
FPQ_HD GroupScale group_scale(uint32_t amax_bits, bool nonfinite, ScaleMode mode, const float* given)
{
    const bool fault = !F::kHasNan && nonfinite;
    GroupScale out{0.0f, 0.0f, 0};
    if (mode == ScaleMode::kFp32) {
        const float s = given ? *given : scale_from_amax<F>(bits_f32(amax_bits));
        out.multiplier = multiplier_from_scale(s);
        out.stored = fault ? bits_f32(kF32QuietNan) : s;
    } else {
        const int e = e8m0_exponent<F>(amax_bits, mode == ScaleMode::kE8m0Ceil);
        out.multiplier = pow2f(-e);
        out.stored_byte = uint8_t(fault ? kE8m0Nan : uint32_t(e + kE8m0Bias));
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// Element encoding (SPEC 4, round to nearest even; SPEC 3.3 specials)
//
//  1. non-finite x: NaN code / Inf code (sign kept) where the format has them, else code 0;
//  2. v = fl(x * r), a = min(|v|, fmax): saturation before rounding equals after (RNE is
//     monotonic and fmax is representable) and maps an overflowed product to fmax;
//  3. a >= min normal: RNE on the fp32 pattern, then re-bias the exponent:
//
//        0 | eeeeeeee | mmm r ssss...s        keep m bits, r = round bit, s = sticky bits
//        add (2^(22-m) - 1) + lowest kept bit, drop 23-m bits; a carry moves into the exponent
//
//  4. a < min normal: fl(a + M) with M = 2^(emin - m + 23) rounds onto the subnormal grid;
//     bits(sum) - bits(M) is the code (2^m = the smallest normal when it rounds up);
//  5. put the sign back (a magnitude that rounds to 0 keeps it: the -0 code).
// ---------------------------------------------------------------------------------------------
template <class F>
FPQ_HD uint32_t encode_finite_magnitude(float v)
{
    const float a_raw = bits_f32(f32_bits(v) & kF32AbsMask);
    const float fmax = bits_f32(F::kFmaxBits);
    const float a = a_raw < fmax ? a_raw : fmax;
    const uint32_t ab = f32_bits(a);
    const uint32_t rounded = ab + ((1u << (F::kRoundShift - 1)) - 1) + ((ab >> F::kRoundShift) & 1u);
    const uint32_t normal = (rounded >> F::kRoundShift) - F::kRebias;
    const uint32_t subnormal = f32_bits(add_rn(a, bits_f32(F::kMagicBits))) - F::kMagicBits;
    return ab < F::kMinNormalBits ? subnormal : normal;
}

// Code of x scaled by r (r finite, > 0).
template <class F>
FPQ_HD uint32_t encode_rne(float x, float r)
{
    const uint32_t xb = f32_bits(x);
    const uint32_t sign = (xb >> 31) << (F::kBits - 1);
    const uint32_t mag = encode_finite_magnitude<F>(mul_rn(x, r));
    const bool is_inf = (xb & kF32AbsMask) == kF32InfBits;
    const uint32_t special = F::kHasNan ? (sign | (is_inf ? F::kInfCode : F::kNanCode)) : 0u;
    return f32_is_finite(xb) ? (sign | mag) : special;
}

// ---------------------------------------------------------------------------------------------
// Stochastic rounding (SPEC 4) with Philox4x32-10 random words
// ---------------------------------------------------------------------------------------------
struct PhiloxOut {
    uint32_t v[4];
};

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11; Random123 known-answer vectors in the tests).
FPQ_HD PhiloxOut philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1)
{
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
    constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key bumps (golden ratio, sqrt(3) - 1)
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += kW0;
            k1 += kW1;
        }
        const uint64_t p0 = uint64_t(kM0) * c0;
        const uint64_t p1 = uint64_t(kM1) * c2;
        const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0);
        const uint32_t hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return {{c0, c1, c2, c3}};
}

// The four random words of block b = i / 4 (elements 4b .. 4b+3) for (seed, offset).
FPQ_HD PhiloxOut random_block(uint64_t seed, uint64_t offset, uint64_t block)
{
    return philox4x32_10(uint32_t(offset), uint32_t(offset >> 32), uint32_t(block), uint32_t(block >> 32),
                         uint32_t(seed), uint32_t(seed >> 32));
}

// |v| = M * 2^eu (fp32 significand M, ulp 2^eu); the target's step at |v| is 2^eq; k = eq - eu
// bits are dropped: lo = M >> k steps, D = M mod 2^k. Up one step iff D * 2^32 > u * 2^k, compared
// exactly with both sides shifted (D < 2^24, so capping u's shift at 31 changes nothing).
template <class F>
FPQ_HD uint32_t encode_stochastic(float x, float r, uint32_t u)
{
    const uint32_t xb = f32_bits(x);
    const uint32_t sign = (xb >> 31) << (F::kBits - 1);
    const float v = mul_rn(x, r);
    const uint32_t a = f32_bits(v) & kF32AbsMask;
    const uint32_t exp_field = a >> kF32ManBits;
    const uint32_t frac = a & ((1u << kF32ManBits) - 1);
    const uint64_t significand = exp_field == 0 ? frac : (frac | (1u << kF32ManBits));
    const int e_unbiased = exp_field == 0 ? 1 - kF32Bias : int(exp_field) - kF32Bias;
    const int e_target = e_unbiased > F::kEmin ? e_unbiased : F::kEmin;
    int k = (e_target - F::kMbits) - (e_unbiased - kF32ManBits);
    k = k < 62 ? k : 62;
    const uint64_t dropped = significand & ((uint64_t(1) << k) - 1);
    const uint32_t lo_code = (uint32_t(e_target - F::kEmin) << F::kMbits) + uint32_t(significand >> k);
    const int d_shift = k < 32 ? 32 - k : 0;
    const int u_shift = k > 32 ? (k - 32 < 31 ? k - 32 : 31) : 0;
    const uint32_t up = (dropped << d_shift) > (uint64_t(u) << u_shift) ? 1u : 0u;
    const uint32_t mag = a >= F::kFmaxBits ? F::kMaxCode : lo_code + up;
    const bool is_inf = (xb & kF32AbsMask) == kF32InfBits;
    const uint32_t special = F::kHasNan ? (sign | (is_inf ? F::kInfCode : F::kNanCode)) : 0u;
    return f32_is_finite(xb) ? (sign | mag) : special;
}

// ---------------------------------------------------------------------------------------------
// Decoding (SPEC 5): code -> exact fp32 value; NaN codes -> quiet NaN, Inf codes -> +-Inf.
// ---------------------------------------------------------------------------------------------
template <class F>
FPQ_HD float decode(uint32_t code)
{
    constexpr uint32_t kExpAllOnes = (1u << F::kEbits) - 1;
    constexpr uint32_t kManAllOnes = (1u << F::kMbits) - 1;
    const uint32_t exp = (code >> F::kMbits) & kExpAllOnes;
    const uint32_t man = code & kManAllOnes;
    const uint32_t sign = (code >> (F::kBits - 1)) << 31;
    // subnormal: man * 2^(emin - m), exact in fp32
    const float sub = mul_rn(float(man), bits_f32(F::kSubnormalStepBits));
    const uint32_t normal = ((exp + uint32_t(kF32Bias - F::kBias)) << kF32ManBits) | (man << F::kRoundShift);
    const uint32_t finite = sign | (exp == 0 ? f32_bits(sub) : normal);
    // specials, written as selects so that loops over codes vectorize
    const bool top = exp == kExpAllOnes;
    const uint32_t ieee_special = man == 0 ? (sign | kF32InfBits) : kF32QuietNan;
    const bool is_nan_only = F::kTop == TopCode::kNanOnlyAllOnes && top && man == kManAllOnes;
    const bool is_ieee_special = F::kTop == TopCode::kIeee && top;
    return bits_f32(is_ieee_special ? ieee_special : (is_nan_only ? kF32QuietNan : finite));
}

// ---------------------------------------------------------------------------------------------
// Packing (SPEC 6): a group's codes form a little-endian bit stream. It repeats every pack unit
// of lcm(b, 8) bits: kCodes codes fill kBytes bytes (b=8: 1/1, b=4: 2/1, b=6: 4/3, b=12: 2/3).
// ---------------------------------------------------------------------------------------------
constexpr int gcd_int(int a, int b) { return b == 0 ? a : gcd_int(b, a % b); }

template <int kBitsPerCode>
struct PackUnit {
    static constexpr int kUnitBits = kBitsPerCode / gcd_int(kBitsPerCode, 8) * 8;
    static constexpr int kCodes = kUnitBits / kBitsPerCode;
    static constexpr int kBytes = kUnitBits / 8;
    static_assert(kUnitBits <= 32, "a pack unit must fit a 32-bit word");
};

FPQ_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

FPQ_HD int64_t group_bytes(int64_t g, int bits) { return (g * bits + 7) / 8; }

FPQ_HD int64_t row_bytes(int64_t k, int64_t group_size, int bits)
{
    return (k / group_size) * group_bytes(group_size, bits) + group_bytes(k % group_size, bits);
}

// Or the unit's codes into one word: code j at bits [j*b, (j+1)*b).
template <int kBitsPerCode>
FPQ_HD uint32_t pack_unit(const uint32_t* codes)
{
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < PackUnit<kBitsPerCode>::kCodes; ++j) { word |= codes[j] << (j * kBitsPerCode); }
    return word;
}

template <int kBitsPerCode>
FPQ_HD uint32_t unpack_code(uint32_t word, int j)
{
    return (word >> (j * kBitsPerCode)) & ((1u << kBitsPerCode) - 1);
}

// ---------------------------------------------------------------------------------------------
// Formats the kernels are built for; the one dispatch point of each backend switches on these ids
// and raises (listing the supported values) on anything else. Element I/O types: fp_io.h.
// ---------------------------------------------------------------------------------------------
#define FPQ_FORMAT_ID(Type, name, ebits, mbits, top) k##Type,
enum class Format : int { FPQ_FORMATS(FPQ_FORMAT_ID) };  // kE4M3 = 0, ... in the list's order
#undef FPQ_FORMAT_ID
#define FPQ_FORMAT_NAME(Type, name, ebits, mbits, top) name,
constexpr const char* kFormatNames[] = {FPQ_FORMATS(FPQ_FORMAT_NAME)};  // indexed by Format
#undef FPQ_FORMAT_NAME
constexpr int kNumFormats = int(sizeof(kFormatNames) / sizeof(kFormatNames[0]));

}  // namespace fpq
