// The AVX-512 BF16 / AMX GEMM (FPQ_DIRECT_BF16; FPQ_AMX for the tile path, fp_kernels_cpu.h), SPEC 8.1 for m above
// the small-m kernels, every format whose codes are bf16 values (all but none today: e4m3, e5m2, e3m2, e2m3, e2m1 and
// e4m7's 7 mantissa bits fit bf16's), groups of an even number of codes, every scale layout:
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))     (fp32; bias and rounding by the caller)
//  * Work: tiles of kTileN = 64 weight rows; threads split the tiles, and the rows of x where there are fewer tiles
//    than threads.
//  * Decode once: each kChunk = 256 columns of a tile's 64 rows are decoded exactly, once, to bf16 words in row order
//    (the byte-table decoder of fp_raw_decode_cpu.h where the row is one bit stream of 4-, 6- or 8-bit codes, else the
//    codec's row decoder): a 32 KiB panel P[n][k] that serves every row of x. It is AMX's A operand as it stands (16
//    rows of 32 words per tile), and the vdpbf16ps kernel broadcasts its word pairs.
//  * x is packed once per call as the B operand: blocks of 16 rows, per pair of columns kp a 64-byte row of 16 dwords
//    (x[m, 2kp], x[m, 2kp+1]) (VNNI pairs; AMX's B tile layout; one zmm of the vdpbf16ps kernel). fp32 x (and fp16 x,
//    widened by the binding) is split exactly into three bf16 rows, x = hi + mid + lo (truncations, each part a bf16),
//    each its own row of the GEMM with its own group partial sums; the three results are added at the end.
//  * vdpbf16ps kernel: 4 weight rows x 4 zmm of rows of x (64 rows, M in the lanes): 16 accumulators hold the group's
//    partial sums; at the group's end each is multiplied by its weight row's group scale into the totals T[n][m]
//    (memory, L1), once per group. AMX (groups of a multiple of 32, tdpbf16ps: K = 32 per tile): 2 x 2 C tiles (32
//    weight rows x 32 rows of x) hold the group's partial sums, stored at the group's end and multiplied by the scale
//    into the same totals. A group cut by the chunk's end carries its partial sums to the next chunk.
//  * Exactness: vdpbf16ps and tdpbf16ps read bf16 subnormals as zero and flush subnormal fp32 results. Every product
//    x * decode(q) is exact in fp32 (8 x 8 significant bits) and a multiple of 2^(e_x - 7) * q_min (q_min: the format's
//    smallest subnormal); where that is at least 2^-126 for every nonzero element of a row of x, every partial sum is a
//    multiple of 2^-126 and none is subnormal: the instructions compute what IEEE fp32 does. Rows of x with a smaller
//    nonzero element (or, for fp32 x, a non-finite one or a part that is not exact) are recomputed by the AVX2 GEMM
//    (IEEE subnormals); weight rows with an e4m3 NaN or e5m2 Inf / NaN code by the codec (exact_row_outputs).
// No torch includes.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp_avx2_decode_cpu.h"
#include "fp_peak_cpu.h"
#include "fp_raw_decode_cpu.h"
#include "ieee_denormals.h"

#if defined(FPQ_DIRECT_BF16)
#include <omp.h>

namespace fpq {
namespace cpu_kernels {
namespace {

constexpr int64_t kTileN = 64;    // weight rows per tile (panel rows)
constexpr int64_t kChunk = 256;   // columns per panel: 64 x 256 bf16 = 32 KiB
constexpr int64_t kBlockM = 16;   // rows of x per packed block: one zmm of lanes, one AMX B tile's columns
constexpr int64_t kDotRows = 4;   // weight rows of the vdpbf16ps kernel
constexpr int64_t kDotVecs = 4;   // zmm of rows of x of the vdpbf16ps kernel (64 rows)
constexpr int64_t kAmxK = 32;     // columns per tdpbf16ps

// Test-only builds (-DFPQ_TEST_MUTANTS, tests/unit/linear/test_cpu_gemm_avx512.py) break one thing on purpose, chosen
// per call by $FPQ_GEMM_MUTANT: 1 the group scale dropped, 2 the next group's scale, 3 a stale panel (decoded for the
// first chunk only), 4 x's VNNI pairs swapped, 5 rows of x with subnormal parts not recomputed. The tests must catch
// each.
#if defined(FPQ_TEST_MUTANTS)
int g_mutant = 0;
#define FPQ_MUTANT(n) (g_mutant == (n))
#else
#define FPQ_MUTANT(n) false
#endif

// Whether every code's value is a bf16 value (NaN aside), from the codec; computed once per format.
template <class F>
bool codes_exact_in_bf16()
{
    static const bool exact = [] {
        for (uint32_t c = 0; c < (1u << F::kBits); ++c) {
            const uint32_t bits = f32_bits(decode<F>(c));
            if ((bits & 0x7fffffffu) <= 0x7f800000u && (bits & 0xffffu) != 0) { return false; }
        }
        return true;
    }();
    return exact;
}

// The smallest bf16 exponent field a nonzero part of x may have: 2^(e - 127 - 7) * q_min >= 2^-126.
template <class F>
constexpr uint32_t min_x_exponent_field()
{
    const int log2_q_min = int(F::kSubnormalStepBits >> 23) - 127;
    return uint32_t(127 - 119 - log2_q_min);
}

// The kernel of this file for these arguments, kPortable where none applies: bf16 x, codes that are bf16 values,
// groups of an even size: AMX for groups of a multiple of 32 where the CPU and Linux allow it, else vdpbf16ps; fp32 x
// (three bf16 parts) the AMX kernel only (vdpbf16ps on three parts is no faster than the fp32 FMA of the AVX2 GEMM).
template <class F>
CpuLinearKernel gemm_kernel(const LinearArgs& a, bool x_bf16, bool amx)
{
    if constexpr (F::kBits > 16) {
        return CpuLinearKernel::kPortable;
    } else {
        if (a.group_size % 2 != 0 || !codes_exact_in_bf16<F>()) { return CpuLinearKernel::kPortable; }
        if (amx && a.group_size % 16 == 0) { return CpuLinearKernel::kAmxGemm; }
        return x_bf16 ? CpuLinearKernel::kAvx512Gemm : CpuLinearKernel::kPortable;
    }
}

// 64-byte aligned storage of T
template <class T>
struct Aligned {
    std::vector<T> storage;
    T* data;
    explicit Aligned(int64_t count) : storage(size_t(count) + 64 / sizeof(T))
    {
        const auto address = reinterpret_cast<uintptr_t>(storage.data());
        data = storage.data() + (ceil_div(int64_t(address), 64) * 64 - int64_t(address)) / int64_t(sizeof(T));
    }
    Aligned(const Aligned&) = delete;  // data points into storage: moves keep it, copies would not
    Aligned(Aligned&&) = default;
};

// 16 x 16 dwords: rows r[i] become columns (out[j] lane i = in[i] lane j).
inline void transpose_16x16(__m512i (&r)[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4q + j]: in each 128-bit lane L, rows 4q .. 4q+3 of column 4L + j; then the lanes are gathered
    for (int j = 0; j < 4; ++j) {
        t[j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);  // lanes 0, 2 of each
        t[4 + j] = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xdd);  // lanes 1, 3
        t[8 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
        r[12 + j] = _mm512_shuffle_i32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

// x as the B operand (see the file comment). Virtual row v = m * parts + p (p: the bf16 part of row m of x); block b
// holds rows 16b .. 16b+15, its pair kp at data[(b * pairs + kp) * 16 + lane]. Rows past the last are zero.
// recompute[m]: row m of x goes to the IEEE path (a nonzero part below min_x_exponent_field, or fp32 x not split
// exactly); its packed values are whatever they are (the lanes of other rows never see them).
struct PackedX {
    int64_t parts, rows, blocks, pairs;
    Aligned<uint32_t> buffer;
    std::vector<uint8_t> recompute;

    template <class F>
    static PackedX make(const LinearArgs& a, bool x_bf16, int64_t blocks_multiple)
    {
        const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
        const int64_t parts = x_bf16 ? 1 : 3;
        PackedX xs(parts, a.m, in_stride, blocks_multiple);
        const uint32_t min_field = min_x_exponent_field<F>();
        const int64_t row_blocks = xs.blocks;
#pragma omp parallel
        {
            Aligned<uint16_t> words(kBlockM * in_stride);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < row_blocks; ++b) {
                // the block's 16 virtual rows as bf16 words, then 16 x 16 dword transposes into place
                for (int64_t i = 0; i < kBlockM; ++i) {
                    const int64_t v = b * kBlockM + i, m = v / parts, p = v % parts;
                    uint16_t* out = words.data + i * in_stride;
                    if (v >= xs.rows) {
                        std::memset(out, 0, size_t(in_stride) * 2);
                    } else if (x_bf16) {
                        const uint16_t* x = static_cast<const uint16_t*>(a.x) + m * in_stride;
                        std::memcpy(out, x, size_t(in_stride) * 2);
                        xs.recompute[size_t(m)] = bf16_row_too_small(out, in_stride, min_field);
                    } else {
                        const float* x = static_cast<const float*>(a.x) + m * in_stride;
                        const bool bad = split_row(x, in_stride, p, min_field, out);
                        if (bad) { xs.recompute[size_t(m)] = 1; }
                    }
                }
                for (int64_t kp0 = 0; kp0 < xs.pairs; kp0 += 16) {
                    __m512i r[16];
                    for (int i = 0; i < 16; ++i) { r[i] = _mm512_loadu_si512(words.data + i * in_stride + 2 * kp0); }
                    transpose_16x16(r);
                    for (int j = 0; j < 16; ++j) {
                        if (FPQ_MUTANT(4)) { r[j] = _mm512_rol_epi32(r[j], 16); }
                        _mm512_store_si512(xs.buffer.data + (b * xs.pairs + kp0 + j) * 16, r[j]);
                    }
                }
            }
        }
        return xs;
    }

    // whether a row of bf16 words has a nonzero element whose exponent field is below min_field
    static uint8_t bf16_row_too_small(const uint16_t* w, int64_t len, uint32_t min_field)
    {
        __mmask32 any = 0;
        const __m512i mag_mask = _mm512_set1_epi16(0x7fff), one = _mm512_set1_epi16(1);
        const __m512i limit = _mm512_set1_epi16(short((min_field << 7) - 1));
        for (int64_t c = 0; c < len; c += 32) {
            const __m512i mag = _mm512_and_si512(_mm512_loadu_si512(w + c), mag_mask);
            any |= _mm512_cmplt_epu16_mask(_mm512_sub_epi16(mag, one), limit);  // 0 < mag < limit + 1
        }
        return any != 0;
    }

    // Part p of fp32 row x: hi = x truncated to bf16, mid = (x - hi) truncated, lo = x - hi - mid (exact
    // subtractions); true where the row cannot be split exactly into parts the instructions keep.
    static bool split_row(const float* x, int64_t len, int64_t p, uint32_t min_field, uint16_t* out)
    {
        const __m512i top = _mm512_set1_epi32(int(0xffff0000u)), mag_mask = _mm512_set1_epi32(0x7fffffff);
        const __m512i limit = _mm512_set1_epi32(int((min_field << 23) - 1)), one = _mm512_set1_epi32(1);
        const __m512i inf = _mm512_set1_epi32(0x7f800000);
        __mmask16 bad = 0;
        for (int64_t c = 0; c < len; c += 16) {
            const __m512 v = _mm512_loadu_ps(x + c);
            const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
            const __m512 r = _mm512_sub_ps(v, hi);
            const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), top));
            const __m512 lo = _mm512_sub_ps(r, mid);
            const __m512i parts[3] = {_mm512_castps_si512(hi), _mm512_castps_si512(mid), _mm512_castps_si512(lo)};
            bad |= _mm512_cmpge_epu32_mask(_mm512_and_si512(parts[0], mag_mask), inf);  // Inf, NaN
            bad |= _mm512_test_epi32_mask(parts[2], _mm512_set1_epi32(0xffff));     // lo not a bf16
            for (int q = 0; q < 3; ++q) {
                const __m512i mag = _mm512_and_si512(parts[q], mag_mask);
                bad |= _mm512_cmplt_epu32_mask(_mm512_sub_epi32(mag, one), limit);
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(parts[p], 16)));
        }
        return bad != 0;
    }

  private:
    PackedX(int64_t parts_, int64_t m, int64_t in_stride, int64_t blocks_multiple)
        : parts(parts_), rows(m * parts_),
          blocks(ceil_div(ceil_div(m * parts_, kBlockM), blocks_multiple) * blocks_multiple),
          pairs(in_stride / 2), buffer(blocks * pairs * kBlockM), recompute(size_t(m), 0)
    {
    }
};

// A tile's panel: rows n0 .. n0+63 (rows past n repeat the last), columns c0 .. c1-1 decoded to bf16 words at
// words[r * kChunk + (c - c0)], zero from c1 - c0 to the next multiple of kAmxK. special: per tile row (bit r), a
// word without a finite value seen (e4m3 NaN, e5m2 Inf / NaN codes).
template <class F>
struct Panel {
    static constexpr bool kRaw = RawBf16Decoder<F>::kSupported;
    const RawBf16Decoder<F> dec{};
    bool raw;
    Aligned<uint16_t> words = Aligned<uint16_t>(kTileN * kChunk);
    std::vector<uint32_t> codes;
    uint64_t special = 0;

    explicit Panel(const LinearArgs& a) : raw(kRaw && row_is_one_stream(a, F::kBits)), codes(size_t(a.group_size + 8)) {}

    void build(const LinearArgs& a, int64_t n0, int64_t c0, int64_t c1)
    {
        const int64_t rows_here = std::min(kTileN, a.n - n0);
        // the next chunk's code bytes of each row (64 short streams: more than the hardware prefetchers follow)
        const int64_t next0 = c1 * F::kBits / 8, next1 = std::min(a.row_bytes, std::min(a.k, c1 + kChunk) * F::kBits / 8);
        for (int64_t r = 0; r < kTileN; ++r) {
            const uint8_t* row = a.codes + (n0 + std::min(r, rows_here - 1)) * a.row_bytes;
            for (int64_t byte = next0; byte < next1; byte += 64) { _mm_prefetch(reinterpret_cast<const char*>(row + byte), _MM_HINT_T0); }
            uint16_t* out = words.data + r * kChunk;
            if (decode_row(a, row, c0, c1, out) && r < rows_here) { special |= uint64_t(1) << r; }
        }
    }

    // true where a decoded word has no finite value
    bool decode_row(const LinearArgs& a, const uint8_t* row, int64_t c0, int64_t c1, uint16_t* out)
    {
        const int64_t padded = ceil_div(c1 - c0, kAmxK) * kAmxK;
        __mmask32 nonfinite = 0;
        if constexpr (kRaw) {
            if (raw) {
                const __m512i lo_idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
                const __m512i hi_idx = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
                for (int64_t c = c0; c < c1; c += kStep) {  // every chunk starts at a multiple of 64
                    __m512i first, second;
                    dec.words(row, c, std::min(kStep, c1 - c), first, second);
                    if constexpr (F::kBits == 4) {  // even / odd codes -> runs of 8 as the 8-bit decode gives them
                        const __m512i even = first;
                        first = _mm512_unpacklo_epi16(even, second);
                        second = _mm512_unpackhi_epi16(even, second);
                    }
                    // lane L of first: codes 16L .. 16L+7; of second: 16L+8 .. 16L+15
                    const __m512i w0 = _mm512_permutex2var_epi64(first, lo_idx, second);
                    const __m512i w1 = _mm512_permutex2var_epi64(first, hi_idx, second);
                    _mm512_store_si512(out + (c - c0), w0);
                    _mm512_store_si512(out + (c - c0) + 32, w1);
                    if constexpr (F::kHasNan) {
                        const __m512i e = _mm512_set1_epi16(0x7f80);
                        nonfinite |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(w0, e), e) |
                                     _mm512_cmpeq_epi16_mask(_mm512_and_si512(w1, e), e);
                    }
                }
                return nonfinite != 0;
            }
        }
        const int64_t g_size = a.group_size, full_group_bytes = group_bytes(g_size, F::kBits);
        for (int64_t g = c0 / g_size; g * g_size < c1; ++g) {
            const int64_t start = g * g_size, glen = std::min(g_size, a.k - start);
            const int64_t j0 = std::max(c0, start) - start, j1 = std::min(c1, start + glen) - start;
            decode_codes<F, Bf16, Bf16>(row + g * full_group_bytes, glen, j0, j1, 1.0f,
                                        reinterpret_cast<Bf16*>(out + (start + j0 - c0)), codes.data());
        }
        std::fill(out + (c1 - c0), out + padded, uint16_t(0));
        bool any = false;
        for (int64_t c = 0; c < c1 - c0; ++c) { any |= (out[c] & 0x7f80) == 0x7f80; }
        return any;
    }
};

// The tile's per-thread state for one work item (virtual rows v_base .. v_base + rows of x): group scales S[r][g] of its
// 64 rows, totals T[r][v - v_base] and carried partial sums C[r][v - v_base]. The row stride vs is the item's rows
// plus 16 floats: a stride of a multiple of 4 KiB would put the 64 rows in the same L1 sets.
struct TileState {
    int64_t vs, v_base = 0;
    Aligned<float> scales, totals, carry;
    TileState(const LinearArgs& a, int64_t item_rows)
        : vs(item_rows + 16), scales(kTileN * a.scale_cols), totals(kTileN * vs), carry(kTileN * vs)
    {
    }
    void start(const LinearArgs& a, int64_t n0, int64_t v0, int64_t v1)
    {
        v_base = v0;
        for (int64_t r = 0; r < kTileN; ++r) {
            decode_row_scales(a, std::min(a.n - 1, n0 + r), scales.data + r * a.scale_cols);
            std::fill(totals.data + r * vs, totals.data + r * vs + (v1 - v0), 0.0f);
        }
    }
    float* total(int64_t r, int64_t v) { return totals.data + r * vs + (v - v_base); }
    float scale(const LinearArgs& a, int64_t r, int64_t g) const
    {
        if (FPQ_MUTANT(1)) { return 1.0f; }
        if (FPQ_MUTANT(2)) { g = std::min(g + 1, a.scale_cols - 1); }
        return scales.data[r * a.scale_cols + g];
    }
    float* carried(int64_t r, int64_t v) { return carry.data + r * vs + (v - v_base); }
};

// --- the vdpbf16ps kernel ----------------------------------------------------------------------------------

// Rows r0 .. r0+3 of the panel (words at P, columns from the segment's start) against kMV blocks of packed x (X: the
// first block at the segment's first pair), `pairs` pairs; acc[r][v] += the pairs' products.
template <int kMV>
inline void dot_rows(const uint32_t* P, const uint32_t* X, int64_t block_stride, int64_t pairs, __m512 (&acc)[kDotRows][kMV])
{
    for (int64_t kp = 0; kp < pairs; ++kp) {
        __m512i xv[kMV];
        for (int v = 0; v < kMV; ++v) { xv[v] = _mm512_load_si512(X + v * block_stride + kp * 16); }
        for (int r = 0; r < kDotRows; ++r) {
            const __m512i w = _mm512_set1_epi32(int(P[r * (kChunk / 2) + kp]));
            for (int v = 0; v < kMV; ++v) { acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)w, (__m512bh)xv[v]); }
        }
    }
}

// Columns c0 .. c1-1 of the tile (its panel built) for packed blocks b0 .. b0+kMV-1 of x.
template <int kMV>
void dot_chunk(const LinearArgs& a, const uint32_t* panel, const PackedX& xs, TileState& st, int64_t b0, int64_t c0,
               int64_t c1)
{
    const int64_t g_size = a.group_size, stride = xs.pairs * 16;
    const uint32_t* X = xs.buffer.data + b0 * stride;
    const int64_t v0 = b0 * kBlockM;
    for (int64_t r0 = 0; r0 < kTileN; r0 += kDotRows) {
        for (int64_t g = c0 / g_size; g * g_size < c1; ++g) {
            const int64_t start = std::max(c0, g * g_size), group_end = std::min(a.k, (g + 1) * g_size);
            const int64_t end = std::min(c1, group_end);
            const bool carried = start > g * g_size;
            __m512 acc[kDotRows][kMV];
            for (int r = 0; r < kDotRows; ++r) {
                for (int v = 0; v < kMV; ++v) {
                    acc[r][v] = carried ? _mm512_load_ps(st.carried(r0 + r, v0 + 16 * v))
                                        : _mm512_setzero_ps();
                }
            }
            // start is even (groups of an even size, chunks of 256); a ragged end's odd column pairs with a zero
            dot_rows<kMV>(panel + r0 * (kChunk / 2) + (start - c0) / 2, X + start / 2 * 16, stride,
                          ceil_div(end - start, 2), acc);
            for (int r = 0; r < kDotRows; ++r) {
                const int64_t row = r0 + r;
                if (end == group_end) {  // the group's partial sum times its scale, once
                    const __m512 s = _mm512_set1_ps(st.scale(a, row, g));
                    for (int v = 0; v < kMV; ++v) {
                        float* t = st.total(row, v0 + 16 * v);
                        _mm512_store_ps(t, _mm512_fmadd_ps(acc[r][v], s, _mm512_load_ps(t)));
                    }
                } else {
                    for (int v = 0; v < kMV; ++v) { _mm512_store_ps(st.carried(row, v0 + 16 * v), acc[r][v]); }
                }
            }
        }
    }
}

void dot_tile_chunk(const LinearArgs& a, const uint32_t* panel, const PackedX& xs, TileState& st, int64_t b_begin,
                    int64_t b_end, int64_t c0, int64_t c1)
{
    for (int64_t b0 = b_begin; b0 < b_end; b0 += kDotVecs) {
        switch (std::min(kDotVecs, b_end - b0)) {
            case 4: dot_chunk<4>(a, panel, xs, st, b0, c0, c1); break;
            case 3: dot_chunk<3>(a, panel, xs, st, b0, c0, c1); break;
            case 2: dot_chunk<2>(a, panel, xs, st, b0, c0, c1); break;
            default: dot_chunk<1>(a, panel, xs, st, b0, c0, c1); break;
        }
    }
}

// --- the AMX kernel ----------------------------------------------------------------------------------------
#if defined(FPQ_AMX)
// The tile configuration (palette 1): every tile 16 rows of 64 bytes. tmm0..3: C (weight rows 16i .. 16i+15 of the
// pair x rows of x 16j .. 16j+15: tmm(2i + j)), tmm4, 5: A (32 panel words of 16 weight rows), tmm6, 7: B (16 pairs
// of 16 rows of x).
// Groups of an odd multiple of 16 (NVFP4's 16, 48, ...) take tiles of K = 16: A 16 rows of 32 bytes, B 8 rows.
struct alignas(64) TileConfig {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    explicit TileConfig(int64_t tile_k)
    {
        for (int t = 0; t < 8; ++t) {
            colsb[t] = t == 4 || t == 5 ? uint16_t(tile_k * 2) : 64;
            rows[t] = t >= 6 ? uint8_t(tile_k / 2) : 16;
        }
    }
};

// Columns c0 .. c1-1 (whole tiles of kTileK; the groups are multiples of it) of the tile for blocks b0, b0+1 of x.
template <int64_t kTileK>
void amx_chunk(const LinearArgs& a, const uint16_t* panel, const PackedX& xs, TileState& st, int64_t b0, int64_t c0,
               int64_t c1)
{
    const int64_t g_size = a.group_size, stride = xs.pairs * 16;
    const uint32_t* X0 = xs.buffer.data + b0 * stride;
    const uint32_t* X1 = X0 + stride;
    const int64_t v0 = b0 * kBlockM;
    alignas(64) float c_tile[4][16 * 16];
    for (int64_t r0 = 0; r0 < kTileN; r0 += 32) {
        const uint16_t* A0 = panel + r0 * kChunk;
        const uint16_t* A1 = A0 + 16 * kChunk;
        for (int64_t g = c0 / g_size; g * g_size < c1; ++g) {
            const int64_t start = std::max(c0, g * g_size), group_end = std::min(a.k, (g + 1) * g_size);
            const int64_t end = std::min(c1, group_end);
            float* carry = st.carried(r0, v0);
            const int64_t carry_stride = st.vs * int64_t(sizeof(float));
            if (start > g * g_size) {
                _tile_loadd(0, carry, carry_stride);
                _tile_loadd(1, carry + 16, carry_stride);
                _tile_loadd(2, carry + 16 * st.vs, carry_stride);
                _tile_loadd(3, carry + 16 * st.vs + 16, carry_stride);
            } else {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t c = start; c < end; c += kTileK) {
                _tile_loadd(4, A0 + (c - c0), kChunk * 2);
                _tile_loadd(5, A1 + (c - c0), kChunk * 2);
                _tile_loadd(6, X0 + c / 2 * 16, 64);
                _tile_loadd(7, X1 + c / 2 * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            if (end != group_end) {  // carried to the next chunk
                _tile_stored(0, carry, carry_stride);
                _tile_stored(1, carry + 16, carry_stride);
                _tile_stored(2, carry + 16 * st.vs, carry_stride);
                _tile_stored(3, carry + 16 * st.vs + 16, carry_stride);
                continue;
            }
            _tile_stored(0, c_tile[0], 64);
            _tile_stored(1, c_tile[1], 64);
            _tile_stored(2, c_tile[2], 64);
            _tile_stored(3, c_tile[3], 64);
            for (int i = 0; i < 2; ++i) {  // the group's partial sums times the weight row's scale, once
                for (int row = 0; row < 16; ++row) {
                    const int64_t n = r0 + 16 * i + row;
                    const __m512 s = _mm512_set1_ps(st.scale(a, n, g));
                    float* t = st.total(n, v0);
                    _mm512_store_ps(t, _mm512_fmadd_ps(_mm512_load_ps(c_tile[2 * i] + row * 16), s, _mm512_load_ps(t)));
                    _mm512_store_ps(t + 16,
                                    _mm512_fmadd_ps(_mm512_load_ps(c_tile[2 * i + 1] + row * 16), s, _mm512_load_ps(t + 16)));
                }
            }
        }
    }
}
#endif

// --- the driver --------------------------------------------------------------------------------------------

// The rows of x one work item takes, in packed blocks: an x block of about kXBlockBytes stays in L2 while the item walks
// its weight tiles (the panels are decoded once per item: more rows per item, fewer decodes); a multiple of `step`
// (and of 3 for split fp32 x, so that a row's parts meet); fewer where there are fewer tiles than threads.
constexpr int64_t kXBlockBytes = int64_t(1) << 20;

int64_t blocks_per_item(const PackedX& xs, int64_t tiles, int64_t threads, int64_t step)
{
    const int64_t unit = xs.parts > 1 ? 3 * step : step;
    const int64_t block_bytes = xs.pairs * kBlockM * 4;
    int64_t per = std::max(unit, kXBlockBytes / block_bytes / unit * unit);
    const int64_t items_wanted = ceil_div(threads, tiles);
    if (items_wanted > 1) { per = std::min(per, std::max(unit, ceil_div(ceil_div(xs.blocks, items_wanted), unit) * unit)); }
    return std::min(per, ceil_div(xs.blocks, unit) * unit);
}

template <class F>
void gemm(Format fmt, const LinearArgs& a, bool x_bf16, int64_t tile_k)
{
    const bool amx = tile_k > 0;
#if defined(FPQ_TEST_MUTANTS)
    const char* mutant = std::getenv("FPQ_GEMM_MUTANT");
    g_mutant = mutant ? std::atoi(mutant) : 0;
#endif
    const PackedX xs = PackedX::make<F>(a, x_bf16, amx ? 2 : 1);
    const int64_t tiles = ceil_div(a.n, kTileN);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        const int64_t per = blocks_per_item(xs, tiles, omp_get_num_threads(), amx ? 2 : kDotVecs);
        const int64_t items = ceil_div(xs.blocks, per) * tiles;
        Panel<F> panel(a);
        TileState st(a, per * kBlockM);
#if defined(FPQ_AMX)
        const TileConfig config(tile_k);
        if (amx) { _tile_loadconfig(&config); }
#endif
        // items in row-block-major order: each thread's contiguous share keeps its x blocks while the tiles pass
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t tile = item % tiles, b0 = item / tiles * per, b1 = std::min(xs.blocks, b0 + per);
            const int64_t n0 = tile * kTileN, v0 = b0 * kBlockM, v1 = b1 * kBlockM;
            panel.special = 0;
            st.start(a, n0, v0, v1);
            for (int64_t c0 = 0; c0 < a.k; c0 += kChunk) {
                const int64_t c1 = std::min(a.k, c0 + kChunk);
                if (!FPQ_MUTANT(3) || c0 == 0) { panel.build(a, n0, c0, c1); }
#if defined(FPQ_AMX)
                if (amx) {
                    for (int64_t b = b0; b < b1; b += 2) {
                        if (tile_k == 32) {
                            amx_chunk<32>(a, panel.words.data, xs, st, b, c0, c1);
                        } else {
                            amx_chunk<16>(a, panel.words.data, xs, st, b, c0, c1);
                        }
                    }
                    continue;
                }
#endif
                dot_tile_chunk(a, reinterpret_cast<const uint32_t*>(panel.words.data), xs, st, b0, b1, c0, c1);
            }
            // y[m, n] = the sum of row m's parts' totals, in order (hi + mid) + lo
            const int64_t rows_here = std::min(kTileN, a.n - n0);
            const int64_t m0 = v0 / xs.parts, m1 = std::min(a.m, ceil_div(v1, xs.parts));
            for (int64_t m = m0; m < m1; ++m) {
                for (int64_t r = 0; r < rows_here; ++r) {
                    const float* t = st.total(r, m * xs.parts);
                    float y = t[0];
                    for (int64_t p = 1; p < xs.parts; ++p) { y = add_rn(y, t[p]); }
                    a.y[m * a.n + n0 + r] = y;
                }
            }
            const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
            for (int64_t r = 0; r < rows_here; ++r) {  // weight rows with codes without a finite value: the codec
                if (panel.special >> r & 1) { exact_row_outputs<F>(a, x_bf16, in_stride, n0 + r, m0, m1); }
            }
        }
#if defined(FPQ_AMX)
        if (amx) { _tile_release(); }
#endif
    }
    // rows of x the instructions cannot keep exact: the AVX2 GEMM (IEEE fp32 with subnormals) on those rows
    std::vector<int64_t> rows;
    for (int64_t m = 0; m < a.m; ++m) {
        if (xs.recompute[size_t(m)]) { rows.push_back(m); }
    }
    if (rows.empty() || FPQ_MUTANT(5)) { return; }
    const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad, elem = x_bf16 ? 2 : 4;
    std::vector<uint8_t> x_rows(size_t(int64_t(rows.size()) * in_stride * elem));
    std::vector<float> y_rows(rows.size() * size_t(a.n));
    for (size_t i = 0; i < rows.size(); ++i) {
        std::memcpy(x_rows.data() + int64_t(i) * in_stride * elem,
                    static_cast<const uint8_t*>(a.x) + rows[i] * in_stride * elem, size_t(in_stride * elem));
    }
    LinearArgs sub = a;
    sub.x = x_rows.data();
    sub.y = y_rows.data();
    sub.m = int64_t(rows.size());
    linear_gemm_avx2(fmt, sub, x_bf16);
    for (size_t i = 0; i < rows.size(); ++i) {
        std::copy(y_rows.begin() + int64_t(i) * a.n, y_rows.begin() + int64_t(i + 1) * a.n, a.y + rows[i] * a.n);
    }
}

}  // namespace

bool amx_usable()
{
#if defined(FPQ_AMX)
    static const bool granted = amx_permission().empty();
    const char* setting = std::getenv("DS_FPQUANT_CPU_AMX");  // "0": the vdpbf16ps kernel instead (tests, comparisons)
    return granted && !(setting && std::strcmp(setting, "0") == 0);
#else
    return false;
#endif
}

CpuLinearKernel linear_gemm_avx512_kernel(Format fmt, const LinearArgs& args)
{
    const bool x_bf16 = args.weight_dtype == DType::kBFloat16;
    return dispatch_format(fmt, [&](auto f) { return gemm_kernel<decltype(f)>(args, x_bf16, amx_usable()); });
}

void linear_gemm_avx512(Format fmt, const LinearArgs& args, bool x_bf16, CpuLinearKernel kernel)
{
    const int64_t tile_k = kernel != CpuLinearKernel::kAmxGemm ? 0 : args.group_size % 32 == 0 ? 32 : 16;
    dispatch_format(fmt, [&](auto f) { gemm<decltype(f)>(fmt, args, x_bf16, tile_k); });
}

}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_DIRECT_BF16
