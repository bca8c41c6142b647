// The CPU row decoders: weights of a span of one row of W (SPEC 2, 6), fl(decode(q) * s) rounded to the
// weight dtype (SPEC 5) through the shared codec (fp_codec.h), written into a buffer. decode_row_span is
// the one entry: the portable loops (unpack_range, decode_codes), and where the compiler targets AVX-512
// (FPQ_FAST_DECODE, fp_kernels_cpu.h) FastDecoder's 16 codes a step, with round_to / store_exact for the
// rounding and the stores. Used by the CPU dequantize (fp_dequantize_cpu.cpp), the buffered linear
// (fp_linear_cpu.cpp, with the scale 1: the linear multiplies exact codes) and the small-m linear's
// scales (decode_row_scales). No torch includes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "fp_kernels_cpu.h"

namespace fpq {
namespace cpu_kernels {
namespace {  // internal linkage, see fp_kernels_cpu.h

// Codes j0 .. j1-1 of one group of `glen` codes starting at `group` (SPEC 6 bit stream) into out[0..).
template <class F>
inline void unpack_range(const uint8_t* group, int64_t glen, int64_t j0, int64_t j1, uint32_t* out)
{
    if constexpr (F::kBits == 8) {
        for (int64_t j = j0; j < j1; ++j) { out[j - j0] = group[j]; }
    } else {
        using Unit = PackUnit<F::kBits>;
        const int64_t nbytes = group_bytes(glen, F::kBits);
        for (int64_t u = j0 / Unit::kCodes; u * Unit::kCodes < j1; ++u) {
            uint32_t word = 0;
            for (int b = 0; b < Unit::kBytes && u * Unit::kBytes + b < nbytes; ++b) {
                word |= uint32_t(group[u * Unit::kBytes + b]) << (8 * b);
            }
            for (int c = 0; c < Unit::kCodes; ++c) {
                const int64_t j = u * Unit::kCodes + c;
                if (j >= j0 && j < j1) { out[j - j0] = unpack_code<F::kBits>(word, c); }
            }
        }
    }
}

// Element conversions of the decoded weight: rounded to the weight dtype W (SPEC 5), stored as Out
// (Out = float keeps the W-rounded value in fp32 for the fused kernel; Out = W for a panel).
template <class W, class Out>
inline Out weight_value(float v)
{
    if constexpr (std::is_same_v<Out, float>) {
        return load_f32(store_from_f32<W>(v));
    } else {
        return store_from_f32<Out>(v);
    }
}

// Codes j0 .. j1-1 of one group: decode(q) * s rounded to W, into out[0 .. j1-j0).
template <class F, class W, class Out>
inline void decode_codes(const uint8_t* group, int64_t glen, int64_t j0, int64_t j1, float s, Out* __restrict out,
                         uint32_t* __restrict codes)
{
    unpack_range<F>(group, glen, j0, j1, codes);
    const int64_t len = j1 - j0;
    for (int64_t i = 0; i < len; ++i) {  // vectorized: decode, scale, round
        out[i] = weight_value<W, Out>(mul_rn(decode<F>(codes[i]), s));
    }
}

#if defined(FPQ_FAST_DECODE)
// 16 codes at a time with AVX-512: the codes' bytes are spread to 32-bit lanes in logical order
// (SPEC 6 bit stream), each lane's code indexes a table of decode<F>() values built from the codec
// itself (so the table cannot disagree with it), then one fp32 multiply by the scale (SPEC 5).
// b = 4: 16-entry table (vpermps); b = 6: 64 entries (two 32-entry vpermi2ps, a blend on bit 5). The 8-bit formats go through the
// exact IEEE fp16 -> fp32 conversion instead. Other widths (e4m7) use the portable loop.
template <class F>
struct FastDecoder {
    static constexpr bool kSupported = F::kBits == 4 || F::kBits == 6 || F::kBits == 8;
    __m512 table[4];

    FastDecoder()
    {
        alignas(64) float values[64];
        const int entries = F::kBits == 8 ? 0 : (1 << F::kBits);
        for (int c = 0; c < 64; ++c) { values[c] = c < entries ? decode<F>(uint32_t(c)) : 0.0f; }
        for (int t = 0; t < 4; ++t) { table[t] = _mm512_load_ps(values + 16 * t); }
    }

    // 4-bit codes j .. j+15 of a group (j a multiple of 16) as 32-bit lanes, in order.
    static inline __m512i codes16(const uint8_t* group, int64_t j)
    {
        const __m128i bytes = _mm_maskz_loadu_epi8(0xff, group + j / 2);
        const __m512i lanes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));  // b0 b0 b1 b1 ...
        const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
        return _mm512_and_si512(_mm512_srlv_epi32(lanes, shift), _mm512_set1_epi32(0xf));
    }

    // Codes j .. j+15 of a group (j a multiple of 16, all 16 inside the group's nbytes bytes).
    inline __m512 decode16(const uint8_t* group, int64_t j) const
    {
        if constexpr (F::kBits == 4) {
            return _mm512_permutexvar_ps(codes16(group, j), table[0]);
        } else if constexpr (F::kBits == 6) {
            // 4 codes in 3 bytes: 128-bit lane L of the vector holds unit L (codes 4L .. 4L+3)
            const __m128i bytes = _mm_maskz_loadu_epi8(0x0fff, group + j / 4 * 3);
            const __m512i all = _mm512_broadcast_i32x4(bytes);
            // bytes 3L, 3L+1, 3L+2 of the unit into each dword of lane L; 0x80 zeroes the top byte
            const int u0 = int(0x80020100u), u1 = int(0x80050403u), u2 = int(0x80080706u), u3 = int(0x800b0a09u);
            const __m512i pick = _mm512_set_epi32(u3, u3, u3, u3, u2, u2, u2, u2, u1, u1, u1, u1, u0, u0, u0, u0);
            const __m512i words = _mm512_shuffle_epi8(all, pick);
            const __m512i shift = _mm512_set_epi32(18, 12, 6, 0, 18, 12, 6, 0, 18, 12, 6, 0, 18, 12, 6, 0);
            const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(words, shift), _mm512_set1_epi32(0x3f));
            const __m512 low = _mm512_permutex2var_ps(table[0], code, table[1]);   // codes 0 .. 31
            const __m512 high = _mm512_permutex2var_ps(table[2], code, table[3]);  // codes 32 .. 63
            return _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, _mm512_set1_epi32(0x20)), low, high);
        } else if constexpr (F::kEbits == 5 && F::kMbits == 2) {
            // e5m2 is the top byte of an IEEE fp16: code << 8, then the exact fp16 -> fp32 conversion; NaN
            // codes become the codec's one quiet NaN
            const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + j)));
            const __m512 value = _mm512_cvtph_ps(_mm256_slli_epi16(code, 8));
            return _mm512_mask_mov_ps(value, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                                      _mm512_castsi512_ps(_mm512_set1_epi32(int(kF32QuietNan))));
        } else {
            static_assert(F::kEbits == 4 && F::kMbits == 3, "8-bit fast decode covers e4m3 and e5m2");
            // e4m3 as an fp16 with the same exponent and mantissa fields is its value * 2^-8 (subnormals
            // included); the one NaN magnitude 0x7f would read as a finite fp16, so it is put back.
            const __m256i code = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + j)));
            const __m256i magnitude = _mm256_and_si256(code, _mm256_set1_epi16(0x7f));
            const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(code, _mm256_set1_epi16(0x80)), 8);
            const __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7), sign);
            const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));  // exact
            const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7f));
            return _mm512_mask_mov_ps(value, nan, _mm512_castsi512_ps(_mm512_set1_epi32(int(kF32QuietNan))));
        }
    }
};

// v rounded to W (SPEC 5: RNE, subnormals kept, NaN -> the codec's quiet NaN), as fp32 lanes.
template <class W>
inline __m512 round_to(__m512 v)
{
    if constexpr (std::is_same_v<W, float>) {
        return v;
    } else if constexpr (std::is_same_v<W, Bf16>) {
        // as f32_to_bf16_bits: add 0x7fff plus the lowest kept bit, keep the top 16 bits
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_and_si512(sum, _mm512_set1_epi32(int(0xffff0000u))),
                                                         nan, _mm512_set1_epi32(int(kF32QuietNan))));
    } else {  // Fp16: the IEEE conversion instruction, round to nearest even, and back (exact)
        return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

#if defined(FPQ_BF16_DOT)
// 32 bf16 words of lo (first 16) and hi by vcvtne2ps2bf16 (RNE; its inputs must not be subnormal),
// every NaN as the codec's one quiet NaN 0x7fc0 (the instruction keeps the sign and payload).
inline __m512i bf16_pair(__m512 lo, __m512 hi)
{
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    const __mmask32 nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(w, _mm512_set1_epi16(0x7fff)),
                                                  _mm512_set1_epi16(0x7f80));
    return _mm512_mask_mov_epi16(w, nan, _mm512_set1_epi16(0x7fc0));
}
#endif

// Stores values that are already W values (round_to<W>) as Out: fp32 lanes, or W's 16-bit patterns.
template <class W, class Out>
inline void store_exact(__m512 v, Out* out)
{
    if constexpr (std::is_same_v<Out, float>) {
        _mm512_storeu_ps(reinterpret_cast<float*>(out), v);
    } else if constexpr (std::is_same_v<Out, Bf16>) {
        const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(bits));
    } else {
        static_assert(std::is_same_v<Out, Fp16>, "weights are stored as fp32, bf16 or fp16");
        const __m256i half = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), half);
    }
}

template <class W, class Out>
inline void store_weights(__m512 v, Out* out)
{
    store_exact<W, Out>(round_to<W>(v), out);
}
#endif

// Weights of row n, columns k0 .. k1-1 (any alignment), into dst[0 .. k1-k0): group by group,
// decode(q) * s, rounded to W. Runs of 16 codes that start at a multiple of 16 inside their group
// take the AVX-512 decoder where there is one; the rest, and every width, the portable loop.
template <class F, class W, class Out, class Fast>
void decode_row_span(const LinearArgs& a, const Fast& fast, int64_t n, int64_t k0, int64_t k1, Out* __restrict dst,
                     uint32_t* __restrict codes)
{
    const int64_t g_size = a.group_size;
    const uint8_t* row = a.codes + n * a.row_bytes;
    const int64_t full_group_bytes = group_bytes(g_size, F::kBits);
#if defined(FPQ_FAST_DECODE)
    if constexpr (FastDecoder<F>::kSupported) {
        if (g_size % 16 == 0 && k0 % 16 == 0) {
            // Groups start at multiples of 16 codes and fill whole bytes, so the row is one bit stream:
            // code c sits at bit c * b. Full runs of 16 here, the last < 16 codes below.
            const int64_t c1 = k0 + (k1 - k0) / 16 * 16;
            int64_t g = k0 / g_size, next = (g + 1) * g_size;
            __m512 scale = _mm512_set1_ps(linear_scale_at(a, n, g));
            if constexpr (F::kBits == 4) {
                // 16 codes in all: the group's 16 weights round_to<W>(decode(c) * s) are one vector, and
                // each run of 16 is a lookup in it (the same values, computed once per group)
                __m512 weights = round_to<W>(_mm512_mul_ps(fast.table[0], scale));
                for (int64_t c = k0; c < c1; c += 16) {
                    if (c >= next) {  // runs of 16 never straddle a group: the next one starts here
                        ++g;
                        next += g_size;
                        weights = round_to<W>(_mm512_mul_ps(fast.table[0], _mm512_set1_ps(linear_scale_at(a, n, g))));
                    }
                    store_exact<W, Out>(_mm512_permutexvar_ps(fast.codes16(row, c), weights), dst + (c - k0));
                }
            } else {
                int64_t c = k0;
#if defined(FPQ_BF16_DOT)
                if constexpr (std::is_same_v<W, Bf16> && std::is_same_v<Out, Bf16>) {
                    // Two runs at a time, rounded to bf16 by one vcvtne2ps2bf16 (RNE; it reads subnormal
                    // inputs as 0, so a group whose products may be subnormal, s < kSafe, rounds exactly)
                    const float safe = bits_f32(kScaleFloorBits) / bits_f32(F::kSubnormalStepBits);
                    bool exact = !(linear_scale_at(a, n, g) >= safe);
                    for (; c + 32 <= c1; c += 32) {
                        if (c >= next) {
                            ++g;
                            next += g_size;
                            const float s = linear_scale_at(a, n, g);
                            scale = _mm512_set1_ps(s);
                            exact = !(s >= safe) && !std::isnan(s);
                        }
                        const __m512 v0 = _mm512_mul_ps(fast.decode16(row, c), scale);
                        bool exact1 = exact;
                        if (c + 16 >= next) {
                            ++g;
                            next += g_size;
                            const float s = linear_scale_at(a, n, g);
                            scale = _mm512_set1_ps(s);
                            exact = !(s >= safe) && !std::isnan(s);
                        }
                        const __m512 v1 = _mm512_mul_ps(fast.decode16(row, c + 16), scale);
                        if (exact || exact1) {
                            store_weights<W, Out>(v0, dst + (c - k0));
                            store_weights<W, Out>(v1, dst + (c + 16 - k0));
                        } else {
                            _mm512_storeu_si512(dst + (c - k0), bf16_pair(v0, v1));
                        }
                    }
                }
#endif
                for (; c < c1; c += 16) {
                    if (c >= next) {
                        ++g;
                        next += g_size;
                        scale = _mm512_set1_ps(linear_scale_at(a, n, g));
                    }
                    store_weights<W, Out>(_mm512_mul_ps(fast.decode16(row, c), scale), dst + (c - k0));
                }
            }
            if (c1 < k1) {
                const int64_t gt = c1 / g_size, start = gt * g_size;
                decode_codes<F, W, Out>(row + gt * full_group_bytes, std::min(g_size, a.k - start), c1 - start,
                                        k1 - start, linear_scale_at(a, n, gt), dst + (c1 - k0), codes);
            }
            return;
        }
    }
#endif
    for (int64_t g = k0 / g_size; g * g_size < k1; ++g) {
        const int64_t start = g * g_size;
        const int64_t glen = std::min(g_size, a.k - start);
        const int64_t j0 = std::max(k0, start) - start, j1 = std::min(k1, start + glen) - start;
        const uint8_t* group = row + g * full_group_bytes;
        const float s = linear_scale_at(a, n, g);
        Out* out = dst + (start - k0);  // out[j] is code j of the group
#if defined(FPQ_FAST_DECODE)
        if constexpr (FastDecoder<F>::kSupported) {
            const int64_t a0 = std::min(j1, ceil_div(j0, 16) * 16);
            const int64_t a1 = a0 + (j1 - a0) / 16 * 16;
            decode_codes<F, W, Out>(group, glen, j0, a0, s, out + j0, codes);
            const __m512 scale = _mm512_set1_ps(s);
            for (int64_t j = a0; j < a1; j += 16) {
                store_weights<W, Out>(_mm512_mul_ps(fast.decode16(group, j), scale), out + j);
            }
            decode_codes<F, W, Out>(group, glen, a1, j1, s, out + a1, codes);
            continue;
        }
#endif
        decode_codes<F, W, Out>(group, glen, j0, j1, s, out + j0, codes);
    }
}

// The fp32 scale of each group of weight row n into out[0 .. a.scale_cols): the values linear_scale_at()
// gives (SPEC 3.1 fp32 as stored; 3.2 E8M0 2^(b-127), byte 255 NaN; 3.4 NVFP4 fl(decode_e4m3(c) * t)).
inline void decode_row_scales(const LinearArgs& a, int64_t n, float* out)
{
    const int64_t index = (n / a.block_rows) * a.scale_cols;
    if (a.scale_kind == LinearScale::kFp32) {
        std::memcpy(out, static_cast<const float*>(a.scales) + index, size_t(a.scale_cols) * sizeof(float));
        return;
    }
    const uint8_t* bytes = static_cast<const uint8_t*>(a.scales) + index;
#if defined(FPQ_FAST_DECODE)
    const FastDecoder<E4M3> scale_codes{};
    for (int64_t j = 0; j < a.scale_cols; j += 16) {
        const int64_t count = std::min<int64_t>(16, a.scale_cols - j);
        const __mmask16 lanes = __mmask16((1u << count) - 1);
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
        _mm512_mask_storeu_ps(out + j, lanes, v);
    }
#else
    for (int64_t g = 0; g < a.scale_cols; ++g) { out[g] = linear_scale_at(a, n, g); }
    (void)bytes;
#endif
}

// The decoder the callers construct once and pass to decode_row_span: FastDecoder where there is one,
// an empty stand-in in a portable build.
#if defined(FPQ_FAST_DECODE)
template <class F>
using Decoder = FastDecoder<F>;
#else
template <class F>
struct Decoder {};
#endif

}  // namespace
}  // namespace cpu_kernels
}  // namespace fpq
