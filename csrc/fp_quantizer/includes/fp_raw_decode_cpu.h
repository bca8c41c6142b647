// The linear's weights before scaling (SPEC 8.1): every code of e4m3, e5m2, e3m2, e2m3 and e2m1 is a bf16
// value, so decode(q) is exact in bf16 and the group scale multiplies the group's partial sum instead of
// each weight. RawBf16Decoder (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI) turns 64 codes into 64 bf16 words in
// two registers by table lookups, with no arithmetic per weight: vpermi2b on the 7-bit magnitude of 8-bit
// codes (two 128-entry byte tables, the sign OR'd back), vpermb on 6-bit codes spread by vpmultishiftqb
// (two 64-entry tables), vpermw on 4-bit codes (one 16-entry word table). The words come in an order
// of their own (code_at_word); x is staged in the same order once per call. Used by the register-blocked
// linear (fp_linear_small_m_cpu.cpp). No torch includes.
#pragma once

#include "fp_row_decode_cpu.h"

namespace fpq {
namespace cpu_kernels {
namespace {  // internal linkage, see fp_kernels_cpu.h

#if defined(FPQ_DIRECT_BF16)

constexpr int64_t kStep = 64;  // codes per decode step

// A step's 64 codes come as two registers of 32 bf16 words, "first" and "second". 8- and 6-bit codes: the
// unpacklo / unpackhi of the looked-up low and high bytes, so 128-bit lane L of first holds codes 16L ..
// 16L+7 and of second 16L+8 .. 16L+15. 4-bit codes: first holds the even codes 0, 2, .. 62 and second the
// odd ones. Either way, fp32 lane l of a vdpbf16ps over both (words 2l, 2l+1 of each) sums codes of
// 4l .. 4l+3 only, so lanes 4L .. 4L+3 hold codes 16L .. 16L+15: a group of 16 codes is a lane quad.
// x is staged per step of 64 columns in the same order: for bf16 x, staged word p (0 .. 63; 32 .. 63: the
// second register) is the step's column code_at_word(p); for fp32 x (the words widened to fp32 by 16-bit
// shifts), staged float 16v + l of vector v (0: even words of first, 1: its odd words, 2, 3: the same of
// second) is column code_at_f32_lane(16v + l).
template <class F>
struct RawBf16Decoder {
    static constexpr bool kSupported = F::kBits == 4 || F::kBits == 6 || F::kBits == 8;

    static constexpr int64_t code_at_word(int64_t p)
    {
        if constexpr (F::kBits == 4) {
            return p < 32 ? 2 * p : 2 * (p - 32) + 1;
        } else {
            const int64_t q = p % 32;
            return (q / 8) * 16 + (p < 32 ? 0 : 8) + q % 8;
        }
    }

    static constexpr int64_t code_at_f32_lane(int64_t i)
    {
        const int64_t v = i / 16, l = i % 16;
        return code_at_word(32 * (v / 2) + 2 * l + v % 2);
    }

    // 8-bit: the bf16 low / high bytes of decode(i) by the magnitude i (0 .. 127), the sign added from the
    // code; 6-bit: by the whole code (vpermb reads 6 bits); 4-bit: lo[0] holds the 16 bf16 words twice
    // (vpermw reads 5 bits of a word index, the low one of the next code included)
    __m512i lo[2], hi[2];
    bool exact = true;  // every value is a bf16 (checked once, from the codec)

    RawBf16Decoder()
    {
        alignas(64) uint8_t l[128], h[128];
        alignas(64) uint16_t w[32];
        for (int i = 0; i < 128; ++i) {
            const uint32_t code = F::kBits == 8 ? uint32_t(i) : uint32_t(i) & ((1u << F::kBits) - 1);
            const uint32_t bits = kSupported ? f32_bits(decode<F>(code)) : 0u;
            const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
            exact = exact && (nan || (bits & 0xffffu) == 0);
            const uint32_t word = nan ? 0x7fc0u : bits >> 16;
            l[i] = uint8_t(word & 0xff);
            h[i] = uint8_t(word >> 8);
            if (i < 32) { w[i] = uint16_t(word); }
        }
        lo[0] = F::kBits == 4 ? _mm512_load_si512(w) : _mm512_load_si512(l);
        lo[1] = _mm512_load_si512(l + 64);
        hi[0] = _mm512_load_si512(h);
        hi[1] = _mm512_load_si512(h + 64);
    }

    // Codes c .. c+63 of a row (c a multiple of 64; the row one bit stream, SPEC 6) as bf16 words; `valid`
    // (1 .. 64) codes are read and the rest count as code 0 (+0).
    inline void words(const uint8_t* row, int64_t c, int64_t valid, __m512i& first, __m512i& second) const
    {
        if constexpr (F::kBits == 4) {
            const int64_t bytes = (valid + 1) / 2;
            const __mmask32 keep = bytes >= 32 ? ~__mmask32(0) : (__mmask32(1) << bytes) - 1;
            const __m512i pairs = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(keep, row + c / 2));
            first = _mm512_permutexvar_epi16(pairs, lo[0]);                          // low nibbles
            second = _mm512_permutexvar_epi16(_mm512_srli_epi16(pairs, 4), lo[0]);  // high nibbles
            return;
        }
        const __mmask64 keep = valid >= 64 ? ~__mmask64(0) : (__mmask64(1) << valid) - 1;
        __m512i l, h;
        if constexpr (F::kBits == 8) {
            const __m512i bytes = _mm512_maskz_loadu_epi8(keep, row + c);
            l = _mm512_permutex2var_epi8(lo[0], bytes, lo[1]);
            h = _mm512_permutex2var_epi8(hi[0], bytes, hi[1]);
            h = _mm512_ternarylogic_epi32(h, bytes, _mm512_set1_epi8(char(0x80)), 0xf8);  // h | (bytes & 0x80)
        } else {
            const int64_t bytes = (valid * 6 + 7) / 8;
            const __m512i raw = _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, row + c / 4 * 3);
            // qword q gets the 6 bytes of codes 8q .. 8q+7 from byte 0, and vpmultishiftqb moves code j's
            // bits to the bottom of byte j; codes past `valid` are cleared
            const __m512i spread = _mm512_set_epi64(0x2f2f2f2e2d2c2b2aLL, 0x2929292827262524LL, 0x2323232221201f1eLL,
                                                    0x1d1d1d1c1b1a1918LL, 0x1717171615141312LL, 0x111111100f0e0d0cLL,
                                                    0x0b0b0b0a09080706LL, 0x0505050403020100LL);
            const __m512i shift = _mm512_set1_epi64(0x2a241e18120c0600LL);
            const __m512i codes = _mm512_maskz_mov_epi8(
                keep, _mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(spread, raw)));
            l = _mm512_permutexvar_epi8(codes, lo[0]);
            h = _mm512_permutexvar_epi8(codes, hi[0]);
        }
        first = _mm512_unpacklo_epi8(l, h);
        second = _mm512_unpackhi_epi8(l, h);
    }
};

#endif  // FPQ_DIRECT_BF16

}  // namespace
}  // namespace cpu_kernels
}  // namespace fpq
