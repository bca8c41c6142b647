// The bf16 register path's weights (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI, fp_kernels_cpu.h): DirectWeights
// turns 32 codes of a row into 32 bf16 weights in one register, round_to<Bf16>(decode(q) * s) as the row
// decoders (fp_row_decode_cpu.h) give. vdpbf16ps multiplies them into the linear's accumulators
// (fp_linear_bf16_cpu.cpp); the bf16 CPU dequantize stores them (fp_dequantize_cpu.cpp). No torch includes.
#pragma once

#include <algorithm>
#include <vector>

#include "fp_row_decode_cpu.h"

#if defined(FPQ_DIRECT_BF16)
namespace fpq {
namespace cpu_kernels {
namespace {  // internal linkage, see fp_kernels_cpu.h

// 16 bf16 words round_to<Bf16>(v) (exact RNE with subnormals, the codec's NaN).
inline __m256i bf16_words(__m512 v)
{
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_to<Bf16>(v)), 16));
}

// Register path for bf16 x, few rows and groups of a multiple of 16 codes: each step of 32 codes
// becomes 32 bf16 weights in a register, multiplied into the fp32 accumulators by vdpbf16ps with no
// buffer in between. The weights are round_to<Bf16>(decode(q) * s), as everywhere else.
template <class F>
struct DirectWeights {
    const LinearArgs& a;
    const FastDecoder<F>& fast;
    const FastDecoder<E4M3> scale_codes{};
    const uint8_t* row = nullptr;
    int64_t n = 0;
    // group of the last code looked up and where the next group starts (codes go in order; no division)
    int64_t group = 0, next = 0;
    // 4-bit: the bf16 values of the 16 codes of the last group looked up
    int64_t table_group = -1;
    __m256i table_words;
    const float safe = bits_f32(kScaleFloorBits) / bits_f32(F::kSubnormalStepBits);

    inline __m256i group_table(int64_t g)  // cached while consecutive steps stay in group g
    {
        if (table_group != g) {
            table_words = bf16_words(_mm512_mul_ps(fast.table[0], _mm512_set1_ps(scales[g])));
            table_group = g;
        }
        return table_words;
    }

    // the fp32 scales of the current row's groups: the stored fp32 row, or E8M0 / NVFP4 scale bytes
    // decoded 16 at a time into `decoded` (the values scale_at() gives, SPEC 3.2 / 3.4)
    const float* scales = nullptr;
    std::vector<float> decoded = std::vector<float>(size_t(ceil_div(a.scale_cols, 16) * 16));

    void start_row(int64_t row_index)
    {
        n = row_index;
        row = a.codes + n * a.row_bytes;
        group = 0;
        next = a.group_size;
        table_group = -1;
        const int64_t index = (n / a.block_rows) * a.scale_cols;
        if (a.scale_kind == LinearScale::kFp32) {
            scales = static_cast<const float*>(a.scales) + index;
            return;
        }
        const uint8_t* bytes = static_cast<const uint8_t*>(a.scales) + index;
        for (int64_t j = 0; j < a.scale_cols; j += 16) {
            const __mmask16 lanes = __mmask16((1u << std::min<int64_t>(16, a.scale_cols - j)) - 1);
            const __m128i b = _mm_maskz_loadu_epi8(lanes, bytes + j);
            __m512 v;
            if (a.scale_kind == LinearScale::kE8m0) {  // 2^(b-127): b << 23; byte 0 is 2^-127, 255 is NaN
                const __m512i e = _mm512_cvtepu8_epi32(b);
                __m512i bits = _mm512_slli_epi32(e, 23);
                bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()),
                                             _mm512_set1_epi32(0x00400000));
                bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(int(kE8m0Nan))),
                                             _mm512_set1_epi32(int(kF32QuietNan)));
                v = _mm512_castsi512_ps(bits);
            } else {  // NVFP4: fl(decode(c) * t)
                alignas(16) uint8_t padded[16];
                _mm_store_si128(reinterpret_cast<__m128i*>(padded), b);
                v = _mm512_mul_ps(scale_codes.decode16(padded, 0), _mm512_set1_ps(a.tensor_scale));
            }
            _mm512_storeu_ps(decoded.data() + j, v);
        }
        scales = decoded.data();
    }

    inline int64_t group_of(int64_t c)  // c never decreases within a row
    {
        while (c >= next) {
            ++group;
            next += a.group_size;
        }
        return group;
    }

    // -- groups of a multiple of 32 codes: one table (4-bit) or scale (8-bit) per group ---------------
    __m512i uniform_table;
    __m512 uniform_scale;
    bool uniform_fast = true;

    inline void enter_group(int64_t g)
    {
        const float s = scales[g];
        if constexpr (F::kBits == 4) {
            const __m256i words = bf16_words(_mm512_mul_ps(fast.table[0], _mm512_set1_ps(s)));
            uniform_table = _mm512_inserti64x4(_mm512_castsi256_si512(words), words, 1);
        } else {
            // decode32 gives value * 2^-8 for e4m3 (fp16 fields); fold the 2^8 into the scale when exact
            const float factor = F::kEbits == 4 ? 256.0f : 1.0f;
            const float folded = mul_rn(s, factor);
            uniform_fast = s >= safe && folded <= bits_f32(0x7f7fffffu);
            uniform_scale = _mm512_set1_ps(uniform_fast ? folded : s);
        }
    }

    // 4-bit codes c .. c+31 as 32 words, in order.
    static inline __m512i codes32_4bit(const uint8_t* row, int64_t c)
    {
        const __m512i bytes = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
        // word i holds byte i/2 twice; even words keep its low nibble, odd words its high one
        const __m512i spread = _mm512_permutexvar_epi8(
            _mm512_set_epi8(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12, 11, 11, 11, 11, 10, 10, 10,
                            10, 9, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2,
                            2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
            bytes);
        const __m512i shift = _mm512_set1_epi32(0x00040000);  // 0 for even words, 4 for odd ones
        return _mm512_and_si512(_mm512_srlv_epi16(spread, shift), _mm512_set1_epi16(0xf));
    }

    // 8-bit codes c .. c+31 as IEEE fp16 patterns (e5m2: exact; e4m3: value * 2^-8 with the NaN
    // magnitude 0x7f reported in `nan`), 32 lanes at a time.
    static inline __m512i half32_8bit(const uint8_t* row, int64_t c, __mmask32& nan)
    {
        const __m512i code = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
        if constexpr (F::kEbits == 5) {
            // the NaN magnitudes 0x7d .. 0x7f become the codec's one quiet NaN (0x7fc0) after conversion
            nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(code, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7c));
            return _mm512_slli_epi16(code, 8);
        } else {
            const __m512i magnitude = _mm512_and_si512(code, _mm512_set1_epi16(0x7f));
            nan = _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7f));
            const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(code, _mm512_set1_epi16(0x80)), 8);
            return _mm512_or_si512(_mm512_slli_epi16(magnitude, 7), sign);
        }
    }

    // Weights of codes c .. c+31 inside the group of the last enter_group().
    inline __m512i uniform32(int64_t c)
    {
        if constexpr (F::kBits == 4) {
            return _mm512_permutexvar_epi16(codes32_4bit(row, c), uniform_table);
        } else {
            if (!uniform_fast) { return weights32(c); }
            __mmask32 nan;
            const __m512i half = half32_8bit(row, c, nan);
            const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), uniform_scale);
            const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), uniform_scale);
            return _mm512_mask_mov_epi16(bf16_pair(lo, hi), nan, _mm512_set1_epi16(0x7fc0));
        }
    }

    // Weights of codes c .. c+31 (c a multiple of 32, all inside the row's full groups).
    inline __m512i weights32(int64_t c)
    {
        const int64_t g_lo = group_of(c), g_hi = group_of(c + 16);
        if constexpr (F::kBits == 4) {
            __m512i table;  // words 0-15: the lower half's group, 16-31: the upper half's
            if (g_lo != g_hi) {  // e.g. NVFP4's groups of 16: both tables in one conversion where exact
                const float s_lo = scales[g_lo], s_hi = scales[g_hi];
                const __m512 lo = _mm512_mul_ps(fast.table[0], _mm512_set1_ps(s_lo));
                const __m512 hi = _mm512_mul_ps(fast.table[0], _mm512_set1_ps(s_hi));
                table = s_lo >= safe && s_hi >= safe
                            ? bf16_pair(lo, hi)
                            : _mm512_inserti64x4(_mm512_castsi256_si512(bf16_words(lo)), bf16_words(hi), 1);
            } else {
                const __m256i words = group_table(g_lo);
                table = _mm512_inserti64x4(_mm512_castsi256_si512(words), words, 1);
            }
            const __m512i upper = _mm512_set_epi64(0x0010001000100010LL, 0x0010001000100010LL, 0x0010001000100010LL,
                                                   0x0010001000100010LL, 0, 0, 0, 0);
            return _mm512_permutexvar_epi16(_mm512_or_si512(codes32_4bit(row, c), upper), table);
        } else {
            const float s_lo = scales[g_lo], s_hi = scales[g_hi];
            const __m512 v_lo = _mm512_mul_ps(fast.decode16(row, c), _mm512_set1_ps(s_lo));
            const __m512 v_hi = _mm512_mul_ps(fast.decode16(row, c + 16), _mm512_set1_ps(s_hi));
            if (s_lo >= safe && s_hi >= safe) {  // no subnormal product: one vcvtne2ps2bf16 (RNE) for both
                return bf16_pair(v_lo, v_hi);
            }
            return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_words(v_lo)), bf16_words(v_hi), 1);
        }
    }
};

}  // namespace
}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_DIRECT_BF16
