// The bf16 dequantize's register path (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI, fp_kernels_cpu.h): DirectWeights
// turns 32 codes of a row into 32 bf16 weights in one register, round_to<Bf16>(decode(q) * s) as the row
// decoders (fp_row_decode_cpu.h) give (SPEC 5), for groups of a multiple of 32 codes; the bf16 CPU
// dequantize stores them (fp_dequantize_cpu.cpp). No torch includes.
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

// Each step of 32 codes of a row in groups of a multiple of 32 becomes 32 bf16 weights in a register,
// round_to<Bf16>(decode(q) * s), as the row decoders give them.
template <class F>
struct DirectWeights {
    const LinearArgs& a;
    const FastDecoder<F>& fast;
    const uint8_t* row = nullptr;
    const float safe = bits_f32(kScaleFloorBits) / bits_f32(F::kSubnormalStepBits);

    // the fp32 scales of the current row's groups (decode_row_scales: SPEC 3.1, 3.2, 3.4)
    std::vector<float> scales = std::vector<float>(size_t(a.scale_cols));

    void start_row(int64_t n)
    {
        row = a.codes + n * a.row_bytes;
        decode_row_scales(a, n, scales.data());
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
            if (!uniform_fast) {  // products that may be subnormal: round each half exactly
                const __m512 v_lo = _mm512_mul_ps(fast.decode16(row, c), uniform_scale);
                const __m512 v_hi = _mm512_mul_ps(fast.decode16(row, c + 16), uniform_scale);
                return _mm512_inserti64x4(_mm512_castsi256_si512(bf16_words(v_lo)), bf16_words(v_hi), 1);
            }
            __mmask32 nan;
            const __m512i half = half32_8bit(row, c, nan);
            const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(half)), uniform_scale);
            const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1)), uniform_scale);
            return _mm512_mask_mov_epi16(bf16_pair(lo, hi), nan, _mm512_set1_epi16(0x7fc0));
        }
    }
};

}  // namespace
}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_DIRECT_BF16
