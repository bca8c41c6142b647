// Fused dequantize-matmul on the CPU: y = x @ dequant(W)^T for a row-grouped quantized W (SPEC 2, 5),
// and the CPU dequantize (decode_rows_cpu writes whole rows).
//
// The weight is decoded from its packed codes on the fly through the shared codec (fp_codec.h) and
// never exists whole in full precision:
//  * linear_cpu (small M, token-by-token decode), OpenMP over output features:
//    - bf16 x, groups of a multiple of 16 (AVX-512 BF16 + VBMI): the register path. Each step turns 32
//      codes into 32 bf16 weights in a register and vdpbf16ps multiplies them into fp32 accumulators.
//    - otherwise blocks of kRowBlock rows are decoded (whole rows up to kMaxChunk columns) into a buffer
//      in L2, which an FMA (fp32) or vdpbf16ps (bf16) micro-kernel multiplies by every row of x.
//    Either way the codes stream from memory once per call whatever M is; fp32 accumulation.
//  * decode_rows_cpu (large M, prefill; dequantize): rows in the weight dtype.
// Each decoded weight is fl(decode(q) * s) rounded to the weight dtype (SPEC 5), the value that
// dequantize() gives in that dtype; only the order of the fp32 sums differs from F.linear. AVX-512 code
// paths where the compiler targets them (-march=native), portable loops otherwise. No torch includes.

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fp_quantize.h"
#include "ieee_denormals.h"

namespace fpq {
namespace {

constexpr int64_t kLanes = 16;      // fp32 lanes of one AVX-512 vector; chunks are multiples of it
constexpr int64_t kMaxChunk = 8192;  // columns decoded at a time: whole rows up to this (each row's codes
                                     // then stream in order, which the hardware prefetchers follow)
constexpr int64_t kRowBlock = 8;    // output features per work item
constexpr int64_t kTileM = 4;       // micro-kernel tile: kTileM rows of x ...
constexpr int64_t kTileN = 4;       // ... times kTileN rows of W
constexpr int64_t kPad = 32;        // x rows and decoded chunks are zero-padded to a multiple of this

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FPQ_BF16_DOT 1
constexpr bool kStagesBf16 = true;
#else
constexpr bool kStagesBf16 = false;
#endif

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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FPQ_FAST_DECODE 1

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

#if defined(__AVX512BF16__)
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

// acc[mi][ri][lane] += x[m0+mi][k0 + c] * w[r0+ri][c] over the chunk's columns c, lanes c % 16.
// x rows have stride x_stride (zero-padded to a multiple of 32 columns), w rows stride w_stride.
template <int64_t kM, int64_t kN>
inline void tile_fma(const float* __restrict x, int64_t x_stride, const float* __restrict w, int64_t w_stride,
                     int64_t columns, float* __restrict acc)
{
#if defined(__AVX512F__)
    __m512 sum[kM][kN];
    for (int64_t i = 0; i < kM; ++i) {
        for (int64_t j = 0; j < kN; ++j) { sum[i][j] = _mm512_loadu_ps(acc + (i * kRowBlock + j) * kLanes); }
    }
    for (int64_t c = 0; c < columns; c += kLanes) {
        __m512 wv[kN];
        for (int64_t j = 0; j < kN; ++j) { wv[j] = _mm512_loadu_ps(w + j * w_stride + c); }
        for (int64_t i = 0; i < kM; ++i) {
            const __m512 xv = _mm512_loadu_ps(x + i * x_stride + c);
            for (int64_t j = 0; j < kN; ++j) { sum[i][j] = _mm512_fmadd_ps(xv, wv[j], sum[i][j]); }
        }
    }
    for (int64_t i = 0; i < kM; ++i) {
        for (int64_t j = 0; j < kN; ++j) { _mm512_storeu_ps(acc + (i * kRowBlock + j) * kLanes, sum[i][j]); }
    }
#else
    for (int64_t c = 0; c < columns; c += kLanes) {
        for (int64_t i = 0; i < kM; ++i) {
            for (int64_t j = 0; j < kN; ++j) {
                float* lane = acc + (i * kRowBlock + j) * kLanes;
                for (int64_t l = 0; l < kLanes; ++l) {  // one lane per element (vectorizes)
                    lane[l] += x[i * x_stride + c + l] * w[j * w_stride + c + l];
                }
            }
        }
    }
#endif
}

#if defined(FPQ_BF16_DOT)
// The same tile with bf16 x and w: vdpbf16ps multiplies 32 bf16 pairs exactly and adds them to fp32
// lanes (the CPU's bf16 dot product, as torch's own bf16 matmuls here; it reads bf16 subnormals as 0).
template <int64_t kM, int64_t kN>
inline void tile_fma(const Bf16* __restrict x, int64_t x_stride, const Bf16* __restrict w, int64_t w_stride,
                     int64_t columns, float* __restrict acc)
{
    __m512 sum[kM][kN];
    for (int64_t i = 0; i < kM; ++i) {
        for (int64_t j = 0; j < kN; ++j) { sum[i][j] = _mm512_loadu_ps(acc + (i * kRowBlock + j) * kLanes); }
    }
    for (int64_t c = 0; c < columns; c += 2 * kLanes) {
        __m512bh wv[kN];
        for (int64_t j = 0; j < kN; ++j) { wv[j] = (__m512bh)_mm512_loadu_si512(w + j * w_stride + c); }
        for (int64_t i = 0; i < kM; ++i) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * x_stride + c);
            for (int64_t j = 0; j < kN; ++j) { sum[i][j] = _mm512_dpbf16_ps(sum[i][j], xv, wv[j]); }
        }
    }
    for (int64_t i = 0; i < kM; ++i) {
        for (int64_t j = 0; j < kN; ++j) { _mm512_storeu_ps(acc + (i * kRowBlock + j) * kLanes, sum[i][j]); }
    }
}
#endif

template <int64_t kM, class Stage>
inline void tile_fma_rows(int64_t rows, const Stage* x, int64_t x_stride, const Stage* w, int64_t w_stride,
                          int64_t columns, float* acc)
{
    switch (rows) {
        case 4: tile_fma<kM, 4>(x, x_stride, w, w_stride, columns, acc); break;
        case 3: tile_fma<kM, 3>(x, x_stride, w, w_stride, columns, acc); break;
        case 2: tile_fma<kM, 2>(x, x_stride, w, w_stride, columns, acc); break;
        default: tile_fma<kM, 1>(x, x_stride, w, w_stride, columns, acc); break;
    }
}

#if defined(FPQ_FAST_DECODE)
template <class F>
using Decoder = FastDecoder<F>;
#else
template <class F>
struct Decoder {};
#endif

#if defined(FPQ_BF16_DOT) && defined(__AVX512VBMI__)
#define FPQ_DIRECT_BF16 1
constexpr int64_t kDirectMaxM = 8;

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

template <class F, int64_t kM>
void linear_rows_direct(const LinearArgs& a)
{
    const FastDecoder<F> fast;
    const int64_t k_padded = ceil_div(a.k, kPad) * kPad;
    const int64_t full = a.k / 32 * 32;
    const Bf16* xs = static_cast<const Bf16*>(a.x);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        alignas(64) Bf16 tail[32];
        std::vector<uint32_t> codes(64);
        DirectWeights<F> weights{a, fast};
#pragma omp for schedule(static)
        for (int64_t n = 0; n < a.n; ++n) {
            weights.start_row(n);
            __m512 acc[kM][2];
            for (int64_t m = 0; m < kM; ++m) { acc[m][0] = acc[m][1] = _mm512_setzero_ps(); }
            // acc[m][chain] += x[m][c .. c+31] . w (32 bf16 pairs)
            const auto accumulate = [&](int64_t c, int chain, __m512i w) {
                for (int64_t m = 0; m < kM; ++m) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs + m * k_padded + c);
                    acc[m][chain] = _mm512_dpbf16_ps(acc[m][chain], xv, (__m512bh)w);
                }
            };
            int64_t c = 0;
            if (a.group_size % 32 == 0) {  // each step of 32 codes inside one group
                for (int64_t start = 0; start < full; start += a.group_size) {
                    weights.enter_group(start / a.group_size);
                    const int64_t end = std::min(full, start + a.group_size);
                    for (c = start; c + 64 <= end; c += 64) {  // two independent accumulator chains
                        const __m512i w0 = weights.uniform32(c), w1 = weights.uniform32(c + 32);
                        accumulate(c, 0, w0);
                        accumulate(c + 32, 1, w1);
                    }
                    for (; c < end; c += 32) { accumulate(c, 0, weights.uniform32(c)); }
                }
                c = full;
            }
            for (; c + 64 <= full; c += 64) {
                const __m512i w0 = weights.weights32(c), w1 = weights.weights32(c + 32);
                accumulate(c, 0, w0);
                accumulate(c + 32, 1, w1);
            }
            for (; c < full; c += 32) { accumulate(c, 0, weights.weights32(c)); }
            if (full < a.k) {  // the last < 32 columns through the buffered decoder
                std::fill(tail, tail + 32, Bf16{});
                decode_row_span<F, Bf16, Bf16>(a, fast, n, full, a.k, tail, codes.data());
                accumulate(full, 1, _mm512_load_si512(tail));
            }
            for (int64_t m = 0; m < kM; ++m) {
                alignas(64) float lane[kLanes];
                _mm512_store_ps(lane, _mm512_add_ps(acc[m][0], acc[m][1]));
                float sum = 0.0f;
                for (int64_t l = 0; l < kLanes; ++l) { sum += lane[l]; }
                a.y[m * a.n + n] = sum;
            }
        }
    }
}

template <class F>
bool try_linear_direct(const LinearArgs& a)
{
    if constexpr (F::kBits == 4 || (F::kBits == 8 && FastDecoder<F>::kSupported)) {
        if (a.group_size % 16 != 0 || a.m > kDirectMaxM) { return false; }
        switch (a.m) {
            case 1: linear_rows_direct<F, 1>(a); return true;
            case 2: linear_rows_direct<F, 2>(a); return true;
            case 3: linear_rows_direct<F, 3>(a); return true;
            case 4: linear_rows_direct<F, 4>(a); return true;
            case 5: linear_rows_direct<F, 5>(a); return true;
            case 6: linear_rows_direct<F, 6>(a); return true;
            case 7: linear_rows_direct<F, 7>(a); return true;
            default: linear_rows_direct<F, 8>(a); return true;
        }
    }
    return false;
}
#endif

template <class F, class W>
void linear_rows(const LinearArgs& a)
{
    // Stage: the type of the decoded weights and of x in the micro-kernel (bf16 pairs with vdpbf16ps
    // when x is bf16 and the CPU has it, else fp32 with FMA)
    using Stage = std::conditional_t<kStagesBf16 && std::is_same_v<W, Bf16>, Bf16, float>;
#if defined(FPQ_DIRECT_BF16)
    if constexpr (std::is_same_v<Stage, Bf16>) {
        if (try_linear_direct<F>(a)) { return; }
    }
#endif
    const Decoder<F> fast;
    const int64_t blocks = ceil_div(a.n, kRowBlock);
    const int64_t k_padded = ceil_div(a.k, kPad) * kPad;
    const Stage* xs = static_cast<const Stage*>(a.x);
    const int64_t chunk = std::min(k_padded, kMaxChunk);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        std::vector<Stage> wbuf(size_t(kRowBlock * chunk), Stage{});
        std::vector<uint32_t> codes(size_t(chunk + 8));
        std::vector<float> acc(size_t(a.m * kRowBlock * kLanes));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t n0 = b * kRowBlock;
            const int64_t rows = std::min(kRowBlock, a.n - n0);
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t k0 = 0; k0 < a.k; k0 += chunk) {
                const int64_t k1 = std::min(a.k, k0 + chunk);
                const int64_t columns = ceil_div(k1 - k0, kPad) * kPad;
                for (int64_t r = 0; r < rows; ++r) {
                    Stage* w = wbuf.data() + r * chunk;
                    decode_row_span<F, W, Stage>(a, fast, n0 + r, k0, k1, w, codes.data());
                    std::fill(w + (k1 - k0), w + columns, Stage{});  // x is zero-padded there too
                }
                for (int64_t m0 = 0; m0 < a.m; m0 += kTileM) {
                    const int64_t tm = std::min(kTileM, a.m - m0);
                    for (int64_t r0 = 0; r0 < rows; r0 += kTileN) {
                        const int64_t tn = std::min(kTileN, rows - r0);
                        const Stage* x = xs + m0 * k_padded + k0;
                        const Stage* w = wbuf.data() + r0 * chunk;
                        float* t = acc.data() + (m0 * kRowBlock + r0) * kLanes;
                        switch (tm) {
                            case 4: tile_fma_rows<4>(tn, x, k_padded, w, chunk, columns, t); break;
                            case 3: tile_fma_rows<3>(tn, x, k_padded, w, chunk, columns, t); break;
                            case 2: tile_fma_rows<2>(tn, x, k_padded, w, chunk, columns, t); break;
                            default: tile_fma_rows<1>(tn, x, k_padded, w, chunk, columns, t); break;
                        }
                    }
                }
            }
            for (int64_t m = 0; m < a.m; ++m) {
                for (int64_t r = 0; r < rows; ++r) {
                    const float* lane = acc.data() + (m * kRowBlock + r) * kLanes;
                    float sum = 0.0f;
                    for (int64_t l = 0; l < kLanes; ++l) { sum += lane[l]; }
                    a.y[m * a.n + n0 + r] = sum;
                }
            }
        }
    }
}

template <class F, class W>
void decode_rows(const LinearArgs& a, int64_t n0, int64_t n1, void* out)
{
    W* dst = static_cast<W*>(out);
    const Decoder<F> fast;
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        std::vector<uint32_t> codes(size_t(std::min(a.k, std::max<int64_t>(a.group_size, 1)) + 8));
#if defined(FPQ_DIRECT_BF16)
        // bf16 rows with groups of a multiple of 32 codes: the register path's 32-wide steps, stored
        DirectWeights<F> weights{a, fast};
        constexpr bool kDirect = std::is_same_v<W, Bf16> && (F::kBits == 4 || F::kBits == 8);
        const bool direct = kDirect && a.group_size % 32 == 0;
#endif
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; ++n) {
            W* row = dst + (n - n0) * a.k;
#if defined(FPQ_DIRECT_BF16)
            if constexpr (kDirect) {
                if (direct) {
                    const int64_t full = a.k / 32 * 32;
                    weights.start_row(n);
                    for (int64_t start = 0; start < full; start += a.group_size) {
                        weights.enter_group(start / a.group_size);
                        const int64_t end = std::min(full, start + a.group_size);
                        for (int64_t c = start; c < end; c += 32) {
                            _mm512_storeu_si512(row + c, weights.uniform32(c));
                        }
                    }
                    if (full < a.k) { decode_row_span<F, W, W>(a, fast, n, full, a.k, row + full, codes.data()); }
                    continue;
                }
            }
#endif
            decode_row_span<F, W, W>(a, fast, n, 0, a.k, row, codes.data());
        }
    }
}

}  // namespace

bool linear_cpu_stages_bf16() { return kStagesBf16; }

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
    return paths;
}

void linear_cpu(Format fmt, const LinearArgs& args)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.weight_dtype, [&](auto w) { linear_rows<decltype(f), decltype(w)>(args); });
    });
}

void decode_rows_cpu(Format fmt, const LinearArgs& args, int64_t n0, int64_t n1, void* out)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.weight_dtype, [&](auto w) { decode_rows<decltype(f), decltype(w)>(args, n0, n1, out); });
    });
}

}  // namespace fpq
