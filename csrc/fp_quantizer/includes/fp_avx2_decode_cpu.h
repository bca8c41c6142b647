// The AVX2 linear's exact code decoders (FPQ_AVX2_FMA: AVX2 + FMA + F16C, fp_kernels_cpu.h), SPEC 8.1: codes
// become fp32 values exactly, with no arithmetic per weight beyond bit placement and byte-table lookups; the
// group scale multiplies the group's partial sum later, never a weight. Used by the AVX2 GEMV
// (fp_linear_gemv_avx2_cpu.cpp, weight rows with K in the vector lanes) and the AVX2 GEMM
// (fp_linear_gemm_avx2_cpu.cpp, panels with N in the lanes). No torch includes.
//
// Two representations of a code's value decode(q):
//  * placed (8-bit codes, Placed8): the code's exponent and mantissa fields moved into an fp32's (a sign-extended
//    shift and a mask per 16 codes), which is decode(q) * 2^-kXExponent with kXExponent = 127 - bias exactly, the
//    subnormal codes included (they land on fp32 subnormals of the same bits). The caller multiplies x by
//    2^kXExponent instead (exact while |x| < 2^(128 - kXExponent): x_placed_ok), so x * w is the same product;
//    or multiplies the placed value by 2^kXExponent (exact) where x is larger. The codes without a finite value
//    (e4m3 NaN, e5m2 Inf / NaN) are not placed: the callers find them (specials) and recompute those rows with the
//    codec (exact_row_outputs).
//  * table (4-bit codes, Table4): decode(q) as bf16 words from two 16-entry byte tables (vpshufb), built from the
//    codec, then widened to fp32 (a bf16 is the top half of its fp32).
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "fp_row_decode_cpu.h"

namespace fpq {
namespace cpu_kernels {
namespace {  // internal linkage, see fp_kernels_cpu.h

// Whether the row of W is one bit stream (SPEC 6): code c at bit c * b of the row, which holds when every group
// fills whole bytes (G * b a multiple of 8; the short last group ends the row).
inline bool row_is_one_stream(const LinearArgs& a, int bits) { return (a.group_size * bits) % 8 == 0; }

// The scalar formula of SPEC 8.1 for weight row n and rows m0 <= m < m1 of x (bf16 when x_bf16, else fp32; rows of
// stride x_stride): codes decoded by the codec, group partial sums in fp32 times the group's scale. The AVX2
// kernels call it for the rows that hold a code without a finite value (e4m3 NaN, e5m2 Inf / NaN).
template <class F>
void exact_row_outputs(const LinearArgs& a, bool x_bf16, int64_t x_stride, int64_t n, int64_t m0, int64_t m1)
{
    const uint8_t* row = a.codes + n * a.row_bytes;
    const int64_t g_size = a.group_size, full_group_bytes = group_bytes(g_size, F::kBits);
    std::vector<float> w(size_t(a.k));
    std::vector<uint32_t> codes(size_t(g_size + 8));
    for (int64_t g = 0; g * g_size < a.k; ++g) {
        const int64_t start = g * g_size, glen = std::min(g_size, a.k - start);
        decode_codes<F, float, float>(row + g * full_group_bytes, glen, 0, glen, 1.0f, w.data() + start, codes.data());
    }
    for (int64_t m = m0; m < m1; ++m) {
        float total = 0.0f;
        for (int64_t g = 0; g * g_size < a.k; ++g) {
            const int64_t start = g * g_size, end = std::min(a.k, start + g_size);
            float sum = 0.0f;
            for (int64_t j = start; j < end; ++j) {
                const float xj = x_bf16 ? load_f32(static_cast<const Bf16*>(a.x)[m * x_stride + j])
                                        : static_cast<const float*>(a.x)[m * x_stride + j];
                sum = add_rn(sum, mul_rn(xj, w[size_t(j)]));
            }
            total = add_rn(total, mul_rn(linear_scale_at(a, n, g), sum));
        }
        a.y[m * a.n + n] = total;
    }
}

#if defined(FPQ_AVX2_FMA)

// The group scales as the AVX2 kernels read them: fp32 as stored, or (kBytes: E8M0, NVFP4) a table of the values of
// the 256 scale bytes (SPEC 3.2, 3.4: linear_scale_of_byte), looked up per group.
template <bool kBytes>
struct GroupScales {
    const void* scales;
    int64_t block_rows, scale_cols;
    alignas(64) float table[kBytes ? 256 : 1];

    explicit GroupScales(const LinearArgs& a) : scales(a.scales), block_rows(a.block_rows), scale_cols(a.scale_cols)
    {
        if constexpr (kBytes) {
            for (uint32_t b = 0; b < 256; ++b) { table[b] = linear_scale_of_byte(a, b); }
        }
    }
    // the first scale of weight row n's scale row
    inline int64_t base(int64_t n) const { return (n / block_rows) * scale_cols; }
    inline float at(int64_t index) const
    {
        if constexpr (kBytes) {
            return table[static_cast<const uint8_t*>(scales)[index]];
        } else {
            return static_cast<const float*>(scales)[index];
        }
    }
    inline const float* address(int64_t index) const
    {
        if constexpr (kBytes) {
            return table + static_cast<const uint8_t*>(scales)[index];
        } else {
            return static_cast<const float*>(scales) + index;
        }
    }
};

// Calls fn(std::bool_constant<byte scales>{}).
template <class Fn>
decltype(auto) dispatch_scales(const LinearArgs& a, Fn&& fn)
{
    if (a.scale_kind == LinearScale::kFp32) { return fn(std::false_type{}); }
    return fn(std::true_type{});
}

// x[m, k] of the binding's padded rows (bf16 or fp32) as fp32, exactly.
inline float x_at(const LinearArgs& a, bool x_bf16, int64_t stride, int64_t m, int64_t k)
{
    return x_bf16 ? load_f32(static_cast<const Bf16*>(a.x)[m * stride + k]) : static_cast<const float*>(a.x)[m * stride + k];
}

// The largest |x| over the finite elements of x (m rows of k), for x_placed_ok.
inline float finite_amax(const LinearArgs& a, bool x_bf16, int64_t stride)
{
    float amax = 0.0f;
    for (int64_t m = 0; m < a.m; ++m) {
        for (int64_t k = 0; k < a.k; ++k) { amax = std::max(amax, finite_abs(x_at(a, x_bf16, stride, m, k))); }
    }
    return amax;
}

// x * 2^e is exact for every element of x when the finite ones stay below 2^(128 - e) (NaN and Inf stay what they
// are); then x * 2^e times a placed weight w * 2^-e is the product x * w itself.
inline bool x_placed_ok(float amax, int e) { return amax < pow2f(127 - e) * 2.0f; }

// ---------------------------------------------------------------------------------------------
// 8-bit codes, placed: 16 codes -> 16 fp32 values decode(q) * 2^-kXExponent in two registers
// ---------------------------------------------------------------------------------------------
// Each code byte c goes to the top of a 16-bit word (c << 8), an arithmetic shift by m + 1 puts its magnitude at
// the bf16 exponent / mantissa fields (sign copies above it), the mask keeps the sign bit and the magnitude: the
// top half of the placed fp32. The odd words of the two 128-bit lanes (codes 1, 3, .., 15) are fp32 values once
// the even words are masked off; the even words (codes 0, 2, .., 14) shifted up by 16 bits are the others.
template <class F>
struct Placed8 {
    static_assert(F::kBits == 8, "Placed8 decodes 8-bit codes");
    using Traits = F;
    static constexpr int kBits = 8, kCodes = 16, kVectors = 2;
    static constexpr bool kHasSpecials = true;
    static constexpr int kShift = F::kMbits + 1;
    static constexpr int kWordMask = 0x8000 | (0x7f << (7 - F::kMbits));
    static constexpr int kXExponent = kF32Bias - F::kBias;  // placed = decode(q) * 2^-kXExponent
    // the magnitudes without a finite value: e4m3 0x7f (NaN), e5m2 0x7c .. 0x7f (Inf, NaN)
    static constexpr int kSpecialMagnitude = F::kHasInf ? int(F::kInfCode) : int(F::kNanCode);
    static_assert(F::kHasNan, "the 8-bit formats have NaN codes");

    // vector v (0: odd codes, 1: even codes), lane j -> code of the 16
    static constexpr int code_of(int v, int j) { return 2 * j + (v == 0 ? 1 : 0); }

    static inline __m256i words(__m256i both)  // both 128-bit lanes hold the 16 codes
    {
        const __m256i spread = _mm256_setr_epi8(-1, 0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7,  //
                                                -1, 8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15);
        const __m256i w = _mm256_srai_epi16(_mm256_shuffle_epi8(both, spread), kShift);
        return _mm256_and_si256(w, _mm256_set1_epi16(short(kWordMask)));
    }

    static inline void decode(const uint8_t* p, __m256 (&out)[kVectors])
    {
        const __m256i w = words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
        out[0] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
        out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }

    // A running test for codes without a finite value: signed and unsigned byte maxima of the codes seen.
    struct Specials {
        __m128i smax = _mm_set1_epi8(-128), umax = _mm_setzero_si128();
        inline void add(const uint8_t* p)
        {
            const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
            smax = _mm_max_epi8(smax, c);
            umax = _mm_max_epu8(umax, c);
        }
        // whether a code of magnitude >= kSpecialMagnitude was seen (positive: signed max; negative: unsigned)
        inline bool any() const
        {
            alignas(16) int8_t s[16];
            alignas(16) uint8_t u[16];
            _mm_store_si128(reinterpret_cast<__m128i*>(s), smax);
            _mm_store_si128(reinterpret_cast<__m128i*>(u), umax);
            const int8_t smax1 = *std::max_element(s, s + 16);
            const uint8_t umax1 = *std::max_element(u, u + 16);
            return smax1 >= kSpecialMagnitude || umax1 >= (0x80 | kSpecialMagnitude);
        }
    };

    // GEMM panel: 16 codes of 16 weight rows at one k (tb) -> 16 fp32 at out[0 .. 16): lanes 0-3 rows 0-3, 4-7 rows
    // 8-11, 8-11 rows 4-7, 12-15 rows 12-15 (row_of_lane); times 2^kXExponent (the exact value) unless kPlaced.
    static constexpr int row_of_lane(int l) { return (l & 3) | ((l & 4) << 1) | ((l & 8) >> 1); }
    template <bool kPlaced>
    static inline void panel(const uint8_t* tb, float* out)
    {
        const __m256i w = words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb))));
        __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
        __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
        if constexpr (!kPlaced) {
            const __m256 up = _mm256_set1_ps(pow2f(kXExponent));
            lo = _mm256_mul_ps(lo, up);
            hi = _mm256_mul_ps(hi, up);
        }
        _mm256_store_ps(out, lo);
        _mm256_store_ps(out + 8, hi);
    }
    // per weight row (byte lane of tb): bit 7 set where the code has no finite value
    static inline __m128i panel_specials(const uint8_t* tb)
    {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tb));
        return _mm_add_epi8(_mm_and_si128(c, _mm_set1_epi8(0x7f)), _mm_set1_epi8(char(0x80 - kSpecialMagnitude)));
    }
};

// ---------------------------------------------------------------------------------------------
// 4-bit codes, tables: 32 codes (16 bytes) -> 32 fp32 values decode(q) in four registers
// ---------------------------------------------------------------------------------------------
// The 16 bytes go to both 128-bit lanes; lane 0 keeps the low nibbles (even codes), lane 1 the high nibbles (odd
// codes); two vpshufb look up the bf16 high and low bytes of decode(q), unpacking interleaves them into bf16 words,
// and the words are widened as in Placed8 (odd words masked, even words shifted up).
template <class F>
struct Table4 {
    static_assert(F::kBits == 4, "Table4 decodes 4-bit codes");
    using Traits = F;
    static constexpr int kBits = 4, kCodes = 32, kVectors = 4;
    static constexpr int kXExponent = 0;
    static constexpr bool kHasSpecials = false;  // e2m1 has no NaN or Inf
    struct Specials {
        inline void add(const uint8_t*) {}
        inline bool any() const { return false; }
    };

    // vector v, lane j (128-bit lane s = j / 4, t = j % 4) -> code of the 32; vectors 0, 1 hold codes 0 .. 15
    static constexpr int code_of(int v, int j) { return 16 * (v / 2) + 4 * (j % 4) + (v % 2 == 0 ? 2 : 0) + j / 4; }
    static constexpr int block_of(int v) { return v / 2; }  // which 16 codes of the 32

    __m256i hi, lo;
    bool exact = true;  // every value is a bf16 (checked once, from the codec)

    Table4()
    {
        alignas(32) uint8_t h[32], l[32];
        for (int c = 0; c < 16; ++c) {
            const uint32_t bits = f32_bits(fpq::decode<F>(uint32_t(c)));
            exact = exact && (bits & 0xffffu) == 0;
            h[c] = h[c + 16] = uint8_t(bits >> 24);
            l[c] = l[c + 16] = uint8_t(bits >> 16);
        }
        hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(h));
        lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(l));
    }

    // the bf16 words of 32 codes: w[0] = codes (lane 0) 0, 2, .., 14 | (lane 1) 1, 3, .., 15; w[1] the same of 16 .. 31
    inline void words(__m256i both, __m256i (&w)[2]) const
    {
        const __m256i idx = _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xf0),
                                             _mm256_set1_epi8(0x0f));
        const __m256i h = _mm256_shuffle_epi8(hi, idx), l = _mm256_shuffle_epi8(lo, idx);
        w[0] = _mm256_unpacklo_epi8(l, h);
        w[1] = _mm256_unpackhi_epi8(l, h);
    }

    inline void decode(const uint8_t* p, __m256 (&out)[kVectors]) const
    {
        __m256i w[2];
        words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), w);
        const __m256i top = _mm256_set1_epi32(int(0xffff0000u));
        out[0] = _mm256_castsi256_ps(_mm256_and_si256(w[0], top));
        out[1] = _mm256_castsi256_ps(_mm256_slli_epi32(w[0], 16));
        out[2] = _mm256_castsi256_ps(_mm256_and_si256(w[1], top));
        out[3] = _mm256_castsi256_ps(_mm256_slli_epi32(w[1], 16));
    }

    // GEMM panel: 16 bytes of 16 weight rows at one pair of columns (low nibble: column 2j, high: 2j+1) -> 16 fp32
    // at out_even[0 .. 16) and 16 at out_odd[0 .. 16), lane l = row l.
    inline void panel(const uint8_t* tb, float* out_even, float* out_odd) const
    {
        __m256i w[2];
        words(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb))), w);
        // w[0]: rows 0-7 (lane 0: column 2j, lane 1: column 2j+1); w[1]: rows 8-15
        const __m256i zero = _mm256_setzero_si256();
        const __m256 r0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w[0]));  // rows 0-3 | rows 0-3
        const __m256 r4 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w[0]));  // rows 4-7
        const __m256 r8 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w[1]));
        const __m256 r12 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w[1]));
        // 128-bit halves stored apart (a lane-crossing permute costs more on 128-bit-wide FP units)
        _mm_store_ps(out_even, _mm256_castps256_ps128(r0));
        _mm_store_ps(out_odd, _mm256_extractf128_ps(r0, 1));
        _mm_store_ps(out_even + 4, _mm256_castps256_ps128(r4));
        _mm_store_ps(out_odd + 4, _mm256_extractf128_ps(r4, 1));
        _mm_store_ps(out_even + 8, _mm256_castps256_ps128(r8));
        _mm_store_ps(out_odd + 8, _mm256_extractf128_ps(r8, 1));
        _mm_store_ps(out_even + 12, _mm256_castps256_ps128(r12));
        _mm_store_ps(out_odd + 12, _mm256_extractf128_ps(r12, 1));
    }
};

// ---------------------------------------------------------------------------------------------
// 16 x 32 byte transpose: rows r0 .. r15 of 32 bytes (columns c .. c+31) -> out[j] (j < 32) the 16 rows' bytes of
// column c + j, in row order. Four rounds of unpacks pairing register i with i + 8; loading row bitrev4(i) into
// register i makes the output rows come in order (the network reverses the bits of the row index).
// ---------------------------------------------------------------------------------------------
constexpr int kBitrev4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline void transpose_16x32(const uint8_t* const (&rows)[16], int64_t offset, uint8_t* out)
{
    __m256i r[16], t[16];
    for (int i = 0; i < 16; ++i) {
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[kBitrev4[i]] + offset));
    }
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm256_unpacklo_epi8(r[i], r[i + 8]);
        t[2 * i + 1] = _mm256_unpackhi_epi8(r[i], r[i + 8]);
    }
    for (int i = 0; i < 8; ++i) {
        r[2 * i] = _mm256_unpacklo_epi16(t[i], t[i + 8]);
        r[2 * i + 1] = _mm256_unpackhi_epi16(t[i], t[i + 8]);
    }
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[i], r[i + 8]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 8]);
    }
    for (int i = 0; i < 8; ++i) {
        r[2 * i] = _mm256_unpacklo_epi64(t[i], t[i + 8]);
        r[2 * i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 8]);
    }
    for (int i = 0; i < 16; ++i) {  // lane 0: column i, lane 1: column 16 + i
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * i), _mm256_castsi256_si128(r[i]));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * (16 + i)), _mm256_extracti128_si256(r[i], 1));
    }
}

inline float hsum(__m256 v)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#endif  // FPQ_AVX2_FMA

}  // namespace
}  // namespace cpu_kernels
}  // namespace fpq
