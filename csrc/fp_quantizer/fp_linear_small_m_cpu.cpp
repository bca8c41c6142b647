// The register-blocked CPU linear (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI, fp_kernels_cpu.h), SPEC 8:
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))     (fp32; bias and rounding by the caller)
// for 4-, 6- and 8-bit codes in groups of a multiple of 16 codes (row groups or 2-D blocks), any m.
//  * Each step decodes 64 codes of a weight row straight to bf16 words by table lookups (RawBf16Decoder,
//    fp_raw_decode_cpu.h): no scale, no rounding, no arithmetic per weight.
//  * bf16 x: vdpbf16ps multiplies the words by x (exact products) into fp32 accumulators. fp32 x (and
//    fp16 x, widened exactly by the binding): the words are widened to fp32 by 16-bit shifts and FMA'd.
//  * bf16 x with subnormals, or normals small enough for a product to fall below 2^-126 (vdpbf16ps reads such
//    inputs as zero and flushes such sums), takes the fp32 FMAs instead (bf16_dot_exact); so does bf16 x of more
//    than DotBf16::kStreamM rows: there the multiplies bound the kernel, and vdpbf16ps (16 products a cycle on
//    Sapphire Rapids: 246 GFLOP/s on 2 cores) is slower than fp32 FMA (two ports, 490 GFLOP/s) even with the words
//    widened (bench --linear, 2-core Sapphire Rapids, M = 16: bf16 x 4.18 / 3.93 / 4.27 / 4.24 ms per 4096 x 4096
//    layer, fp32 x 3.60 / 3.31 / 3.48 / 3.80 for e4m3 / e2m1 / mxfp4 / nvfp4).
//  * Register blocking: a tile is kM (<= 4) rows of x times kN weight rows; each step's decoded words
//    serve the tile's kM rows. The group scale multiplies the group's partial sum (Grouping): once per group
//    for groups of a multiple of 64 codes, else each step's 16-lane partial sums times the scale of each lane's
//    group (groups of 32: lanes 0-7 / 8-15; 16, 48, ...: each lane quad of 16 codes): no horizontal sums per group.
//  * Few rows of x (linear_streamed): each tile's weight rows stream once, start to end, the totals in
//    registers; 4- and 6-bit rows are prefetched kAheadTiles tiles ahead. More rows (linear_chunked): K is walked
//    in chunks of about kChunk columns (whole groups), so that the chunk of every row of x stays in L1 while the
//    weight rows of a tile stream past it; totals persist across chunks in a small per-thread buffer.
//  * OpenMP splits the weight rows (output features).
// No torch includes.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fp_raw_decode_cpu.h"
#include "ieee_denormals.h"

#if defined(FPQ_DIRECT_BF16)
namespace fpq {
namespace cpu_kernels {
namespace {

constexpr int64_t kMaxTileM = 4;  // rows of x per tile
constexpr int64_t kChunk = 1024;  // columns of x per pass over a tile's weight rows (bf16: 2 KiB per row)

// bf16 x: two 32-word registers per step, two vdpbf16ps per row of x and weight row.
struct DotBf16 {
    using X = Bf16;
    struct Regs {
        __m512i v[2];
    };
    // rows of x streamed (the totals in registers: linear_streamed) up to kStreamM, chunked beyond; weight rows per
    // tile: kRowsFew up to 2 rows of x, else kRows (what the registers hold)
    static constexpr int64_t kStreamM = 4, kRowsFew = 4, kRows = 2;
    static inline Regs widen(__m512i first, __m512i second) { return {{first, second}}; }
    static inline Regs load(const Bf16* x)
    {
        return {{_mm512_load_si512(x), _mm512_load_si512(x + 32)}};
    }
    static inline __m512 dot(__m512 acc, const Regs& x, const Regs& w)
    {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)x.v[0], (__m512bh)w.v[0]);
        return _mm512_dpbf16_ps(acc, (__m512bh)x.v[1], (__m512bh)w.v[1]);
    }
    template <class Dec>
    static constexpr int64_t column(int64_t i) { return Dec::code_at_word(i); }
};

// fp32 x: the words widened to four fp32 registers (a bf16 is the top half of its fp32), four FMAs.
struct DotF32 {
    using X = float;
    struct Regs {
        __m512 v[4];
    };
    static constexpr int64_t kStreamM = 1, kRowsFew = 4, kRows = 2;
    static inline Regs widen(__m512i first, __m512i second)
    {
        const __m512i top = _mm512_set1_epi32(int(0xffff0000u));
        return {{_mm512_castsi512_ps(_mm512_slli_epi32(first, 16)), _mm512_castsi512_ps(_mm512_and_si512(first, top)),
                 _mm512_castsi512_ps(_mm512_slli_epi32(second, 16)),
                 _mm512_castsi512_ps(_mm512_and_si512(second, top))}};
    }
    static inline Regs load(const float* x)
    {
        return {{_mm512_load_ps(x), _mm512_load_ps(x + 16), _mm512_load_ps(x + 32), _mm512_load_ps(x + 48)}};
    }
    static inline __m512 dot(__m512 acc, const Regs& x, const Regs& w)
    {
        for (int v = 0; v < 4; ++v) { acc = _mm512_fmadd_ps(x.v[v], w.v[v], acc); }
        return acc;
    }
    template <class Dec>
    static constexpr int64_t column(int64_t i) { return Dec::code_at_f32_lane(i); }
};

// How a step's partial sums meet their group scales (SPEC 8.1: the scale multiplies the group's fp32 partial sum):
//  kWide:  groups of a multiple of 64 codes: a group's steps accumulate, then one FMA by its scale;
//  kPairs: groups of 32 codes (MX): each step's partial sums times its two group scales (lanes 0-7, 8-15);
//  kQuads: groups of 16, 48, 80, ... codes: each step's partial sums times the scale of each lane quad's 16 codes.
enum class Grouping { kWide, kPairs, kQuads };

inline Grouping grouping_of(int64_t group_size)
{
    return group_size % kStep == 0 ? Grouping::kWide : group_size == 32 ? Grouping::kPairs : Grouping::kQuads;
}

// Per-thread scratch of a tile's scales: the decoded group scales of each weight row (E8M0, NVFP4, and for kPairs /
// kQuads fp32 too: zero-padded past the row's groups), and for kQuads groups above 16 codes the scale of each quad.
struct TileScratch {
    int64_t row_floats, quad_floats;
    std::vector<float> rows, quads;
    TileScratch(const LinearArgs& a, int64_t tile_rows)
        : row_floats(a.scale_cols + 4),
          quad_floats(ceil_div(a.k, kStep) * 4 + 4),
          rows(size_t(tile_rows * row_floats)),
          quads(size_t(tile_rows * quad_floats))
    {
    }
};

// The scale of every 16-code quad of a row (groups of a multiple of 16 codes), zero past the row's end
// (those quads multiply zero partial sums): quads[j] = scales[j * 16 / G].
inline void fill_quad_scales(const float* scales, int64_t group_size, int64_t k, int64_t padded, float* quads)
{
    const int64_t count = ceil_div(k, 16), per_group = group_size / 16;
    for (int64_t j = 0; j < count; ++j) { quads[j] = scales[j / per_group]; }
    std::fill(quads + count, quads + padded, 0.0f);
}

// What one tile reads: kN weight rows (codes, and per row its scales as the grouping reads them), x rows of
// stride x_stride staged in unpack order.
template <class Dot, int64_t kN>
struct TileArgs {
    const uint8_t* rows[kN];
    const float* scales[kN];
    const typename Dot::X* x;
    int64_t x_stride;
    int64_t k;
    int64_t group_size;

    // rows n0 .. n0+kN-1 (past the last row: the last row again, its results unused) and their scales: kWide the
    // row's group scales (fp32 as stored, else decoded into `scratch`), kPairs the same zero-padded, kQuads (groups
    // of 16: the row's group scales, zero-padded) the scale of every quad
    void set_rows(const LinearArgs& a, int64_t n0, Grouping grouping, TileScratch& scratch)
    {
        for (int64_t r = 0; r < kN; ++r) {
            const int64_t n = std::min(a.n - 1, n0 + r);
            rows[r] = a.codes + n * a.row_bytes;
            const float* s = static_cast<const float*>(a.scales) + (n / a.block_rows) * a.scale_cols;
            if (a.scale_kind != LinearScale::kFp32 || grouping != Grouping::kWide) {
                float* decoded = scratch.rows.data() + r * scratch.row_floats;
                decode_row_scales(a, n, decoded);
                std::fill(decoded + a.scale_cols, decoded + scratch.row_floats, 0.0f);
                s = decoded;
            }
            if (grouping == Grouping::kQuads && a.group_size != 16) {
                float* q = scratch.quads.data() + r * scratch.quad_floats;
                fill_quad_scales(s, a.group_size, a.k, scratch.quad_floats, q);
                s = q;
            }
            scales[r] = s;
        }
    }
};

// The 16-lane scale vector of the step at column c (a multiple of 64) of a row whose per-group (kPairs) or per-quad
// (kQuads) scales are at s, zero-padded past the row's end.
template <Grouping kG>
inline __m512 step_scales(const float* s, int64_t c)
{
    if constexpr (kG == Grouping::kPairs) {
        const __m512i pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + c / 32)));
        return _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(two));
    } else {
        const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        return _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(s + c / 16)));
    }
}

// acc[m][r] += the step of 64 codes at column c (`valid` of them inside the row) of rows m < kM of x times weight
// rows r < kN; the words of each weight row decoded once for every row of x.
template <class F, class Dot, int64_t kM, int64_t kN>
inline void dot_step(const RawBf16Decoder<F>& dec, const TileArgs<Dot, kN>& t, int64_t c, int64_t valid,
                     __m512 (&acc)[kM][kN])
{
    typename Dot::Regs w[kN];
    for (int64_t r = 0; r < kN; ++r) {
        __m512i first, second;
        dec.words(t.rows[r], c, valid, first, second);
        w[r] = Dot::widen(first, second);
    }
    for (int64_t m = 0; m < kM; ++m) {
        const typename Dot::Regs x = Dot::load(t.x + m * t.x_stride + c);
        for (int64_t r = 0; r < kN; ++r) { acc[m][r] = Dot::dot(acc[m][r], x, w[r]); }
    }
}

template <int64_t kM, int64_t kN>
inline void set_zero(__m512 (&v)[kM][kN])
{
    for (int64_t m = 0; m < kM; ++m) {
        for (int64_t r = 0; r < kN; ++r) { v[m][r] = _mm512_setzero_ps(); }
    }
}

// Every step of columns c0 .. c1-1 (whole groups; c1 <= k or the end of the row) of rows m < kM of x times weight
// rows r < kN, each group's partial sums times the group's scale added into `into(m, r, acc * s)`: kWide once per
// group, else once per step. `each_step(c)` runs before the step at column c (the prefetch of a streamed tile).
template <class F, class Dot, int64_t kM, int64_t kN, Grouping kG, class Into, class EachStep>
inline void tile_steps(const RawBf16Decoder<F>& dec, const TileArgs<Dot, kN>& t, int64_t c0, int64_t c1,
                       const Into& into, const EachStep& each_step)
{
    if constexpr (kG == Grouping::kWide) {
        int64_t g = c0 / t.group_size;
        for (int64_t start = c0; start < c1; start += t.group_size, ++g) {
            __m512 acc[kM][kN];
            set_zero(acc);
            const int64_t end = std::min(c1, std::min(t.k, start + t.group_size));
            int64_t c = start;
            for (; c + kStep <= end; c += kStep) {
                each_step(c);
                dot_step(dec, t, c, kStep, acc);
            }
            if (c < end) {
                each_step(c);
                dot_step(dec, t, c, end - c, acc);
            }
            for (int64_t r = 0; r < kN; ++r) {
                const __m512 s = _mm512_set1_ps(t.scales[r][g]);
                for (int64_t m = 0; m < kM; ++m) { into(m, r, acc[m][r], s); }
            }
        }
    } else {
        const int64_t end = std::min(c1, t.k);
        for (int64_t c = c0; c < end; c += kStep) {
            __m512 acc[kM][kN];
            set_zero(acc);
            each_step(c);
            dot_step(dec, t, c, std::min(kStep, end - c), acc);
            for (int64_t r = 0; r < kN; ++r) {
                const __m512 s = step_scales<kG>(t.scales[r], c);
                for (int64_t m = 0; m < kM; ++m) { into(m, r, acc[m][r], s); }
            }
        }
    }
}

// Chunked tiles (more rows of x): K is walked in chunks of about kChunk columns so that the chunk of every row of x
// stays in L1 while the tile's weight rows stream past it; totals[m][r] (16 fp32 lanes each, in `totals`, L1)
// persist across chunks and rows of x, touched once per group (kWide) or step, so that the registers hold the
// accumulators, the decoded words and x.
template <class F, class Dot, int64_t kN, Grouping kG>
void linear_chunked(const LinearArgs& a, const typename Dot::X* xs, int64_t x_stride)
{
    const RawBf16Decoder<F> dec;
    const int64_t g_size = a.group_size;
    const int64_t chunk = kG == Grouping::kWide ? std::max<int64_t>(1, kChunk / g_size) * g_size : kChunk;
    const int64_t tiles = ceil_div(a.n, kN);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        TileScratch scratch(a, kN);
        std::vector<float> totals(static_cast<size_t>(a.m * kN * 16));
#pragma omp for schedule(static)
        for (int64_t tile_index = 0; tile_index < tiles; ++tile_index) {
            TileArgs<Dot, kN> t{{}, {}, xs, x_stride, a.k, g_size};
            const int64_t n0 = tile_index * kN;
            t.set_rows(a, n0, kG, scratch);
            std::fill(totals.begin(), totals.end(), 0.0f);
            for (int64_t c0 = 0; c0 < a.k; c0 += chunk) {
                const int64_t c1 = std::min(a.k, c0 + chunk);
                for (int64_t m0 = 0; m0 < a.m; m0 += kMaxTileM) {
                    t.x = xs + m0 * x_stride;
                    float* tot = totals.data() + m0 * kN * 16;
                    const auto into = [tot](int64_t m, int64_t r, __m512 acc, __m512 s) {
                        float* p = tot + (m * kN + r) * 16;
                        _mm512_storeu_ps(p, _mm512_fmadd_ps(acc, s, _mm512_loadu_ps(p)));
                    };
                    const auto none = [](int64_t) {};
                    switch (std::min(kMaxTileM, a.m - m0)) {
                        case 4: tile_steps<F, Dot, 4, kN, kG>(dec, t, c0, c1, into, none); break;
                        case 3: tile_steps<F, Dot, 3, kN, kG>(dec, t, c0, c1, into, none); break;
                        case 2: tile_steps<F, Dot, 2, kN, kG>(dec, t, c0, c1, into, none); break;
                        default: tile_steps<F, Dot, 1, kN, kG>(dec, t, c0, c1, into, none); break;
                    }
                }
            }
            for (int64_t m = 0; m < a.m; ++m) {  // totals of row m of x: at (m * kN + r) * 16 in every tile
                for (int64_t r = 0; r < kN && n0 + r < a.n; ++r) {
                    a.y[m * a.n + n0 + r] = _mm512_reduce_add_ps(_mm512_loadu_ps(totals.data() + (m * kN + r) * 16));
                }
            }
        }
    }
}

// Streamed tiles (kM = m rows of x, all of them in L1 for every column): each tile's weight rows are read once from
// start to end with the totals in registers. 4- and 6-bit rows (two or more rows per 4 KiB page, which the hardware
// prefetcher follows poorly) also prefetch (into L1) the bytes kAheadTiles tiles on, a step's share per step: the
// threads' tiles are consecutive weight rows, so the prefetch runs a fixed distance ahead of the decode. Measured on
// a 2-core Sapphire Rapids (M = 1, 4096 x 4096, bf16 x, share of a float32 sum's read bandwidth): e2m1 G=128 47% ->
// 65%, mxfp4 41% -> 63% with 2 tiles (16 KiB) ahead (1 tile: 61%, 55%; 4: 63%, 63%; prefetcht1 / t2 / nta: no gain);
// e4m3 loses with it (88% -> 68% at 1 tile ahead; 86-95% at 4-12 KiB, no gain over the hardware's 88%).
constexpr int64_t kAheadTiles = 2;

template <class F, class Dot, int64_t kM, int64_t kN, Grouping kG>
void linear_streamed(const LinearArgs& a, const typename Dot::X* xs, int64_t x_stride)
{
    constexpr int64_t kAheadPerStep = kN * kStep * F::kBits / 8;
    const RawBf16Decoder<F> dec;
    const int64_t tiles = ceil_div(a.n, kN);
    const int64_t ahead_bytes = kAheadTiles * kN * a.row_bytes;
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        TileScratch scratch(a, kN);
#pragma omp for schedule(static)
        for (int64_t tile_index = 0; tile_index < tiles; ++tile_index) {
            TileArgs<Dot, kN> t{{}, {}, xs, x_stride, a.k, a.group_size};
            const int64_t n0 = tile_index * kN;
            t.set_rows(a, n0, kG, scratch);
            __m512 tot[kM][kN];
            set_zero(tot);
            const uint8_t* ahead = a.codes + n0 * a.row_bytes + ahead_bytes;
            const auto into = [&tot](int64_t m, int64_t r, __m512 acc, __m512 s) {
                tot[m][r] = _mm512_fmadd_ps(acc, s, tot[m][r]);
            };
            const auto prefetch = [ahead](int64_t c) {
                if constexpr (F::kBits == 8) { return; }
                const uint8_t* p = ahead + (c / kStep) * kAheadPerStep;
                for (int64_t o = 0; o < kAheadPerStep; o += 64) {
                    _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
                }
            };
            tile_steps<F, Dot, kM, kN, kG>(dec, t, 0, a.k, into, prefetch);
            for (int64_t m = 0; m < kM; ++m) {
                for (int64_t r = 0; r < kN && n0 + r < a.n; ++r) { a.y[m * a.n + n0 + r] = _mm512_reduce_add_ps(tot[m][r]); }
            }
        }
    }
}

// x (m, k) rows of the binding's layout (zero-padded to kLinearPad columns; bf16 or fp32, `In`) staged in the
// decoder's order as Dot::X (bf16 words as they are; fp32, or bf16 widened exactly), each row 64-byte aligned (the
// steps' full-vector loads). The row stride is one step longer than the row: with a stride of a multiple of 4 KiB
// (K = 4096 bf16 is 8 KiB) every row's step would sit in the same L1 sets as the others' and as the weight rows'
// (whose stride is K bytes for 8-bit codes), and evict them.
template <class F, class Dot>
struct StagedX {
    using X = typename Dot::X;
    int64_t stride;
    std::vector<X> storage;
    X* data;

    template <class In>
    StagedX(const LinearArgs& a, const In* x)
        : stride(ceil_div(a.k, kStep) * kStep + kStep), storage(size_t(a.m * stride + 64))
    {
        const auto address = reinterpret_cast<uintptr_t>(storage.data());
        data = storage.data() + (ceil_div(int64_t(address), 64) * 64 - int64_t(address)) / int64_t(sizeof(X));
        const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
        for (int64_t m = 0; m < a.m; ++m) {
            for (int64_t c0 = 0; c0 < stride - kStep; c0 += kStep) {
                for (int64_t i = 0; i < kStep; ++i) {
                    const In v = x[m * in_stride + c0 + Dot::template column<RawBf16Decoder<F>>(i)];
                    if constexpr (std::is_same_v<In, X>) {
                        data[m * stride + c0 + i] = v;
                    } else {
                        data[m * stride + c0 + i] = load_f32(v);
                    }
                }
            }
        }
    }
};

// Whether vdpbf16ps keeps every product and sum of bf16 x with the codes of F exact up to fp32 rounding: it reads
// bf16 inputs below 2^-126 as zero and flushes fp32 results below 2^-126 to zero, whatever MXCSR says. A bf16 x of
// exponent E is a multiple of 2^(E - 7), a code a multiple of F's subnormal step 2^(emin - m), so where every
// nonzero x of the call has E >= -119 - (emin - m), every product is a multiple of 2^-126, and so is every sum of
// them, exact or rounded to fp32: each is 0 or at least 2^-126, and nothing is flushed. Other calls (bf16
// subnormals, tiny x) take the fp32 FMAs, which keep subnormals (ScopedIeeeDenormals).
template <class F>
bool bf16_dot_exact(const LinearArgs& a)
{
    constexpr int kMinBiased = 127 - 119 - (F::kEmin - F::kMbits);  // bf16 exponent field of 2^(-119 - (emin - m))
    static_assert(kMinBiased > 0, "the smallest exact x is a normal bf16");
    const uint16_t* x = static_cast<const uint16_t*>(a.x);
    const int64_t count = a.m * ceil_div(a.k, kLinearPad) * kLinearPad;  // padding is +0
    const __m512i magnitude = _mm512_set1_epi16(0x7fff), low = _mm512_set1_epi16(int16_t(kMinBiased << 7));
    __mmask32 tiny = 0;
    int64_t i = 0;
    for (; i + 32 <= count; i += 32) {  // 0 < |x| < 2^(kMinBiased - 127), as 15-bit magnitudes
        const __m512i v = _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude);
        tiny |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(v, v), v, low);
    }
    const __mmask32 rest = __mmask32((uint64_t(1) << (count - i)) - 1);
    const __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi16(rest, x + i), magnitude);
    tiny |= _mm512_mask_cmplt_epu16_mask(_mm512_test_epi16_mask(v, v), v, low);
    return tiny == 0;
}

// The tile shapes: up to Dot::kStreamM rows of x stream each tile's weight rows whole; more take chunks (kRows).
template <class F, class Dot, Grouping kG>
void linear_small_m_grouped(const LinearArgs& a, const StagedX<F, Dot>& xs)
{
    if (a.m > Dot::kStreamM) {
        linear_chunked<F, Dot, Dot::kRows, kG>(a, xs.data, xs.stride);
        return;
    }
    switch (a.m) {
        case 1: linear_streamed<F, Dot, 1, Dot::kRowsFew, kG>(a, xs.data, xs.stride); return;
        case 2: linear_streamed<F, Dot, 2, Dot::kRowsFew, kG>(a, xs.data, xs.stride); return;
        case 3: linear_streamed<F, Dot, 3, Dot::kRows, kG>(a, xs.data, xs.stride); return;
        default: linear_streamed<F, Dot, 4, Dot::kRows, kG>(a, xs.data, xs.stride); return;
    }
}

template <class F, class Dot, class In>
void linear_small_m_as(const LinearArgs& a, const In* x)
{
    const StagedX<F, Dot> xs(a, x);
    switch (grouping_of(a.group_size)) {
        case Grouping::kWide: linear_small_m_grouped<F, Dot, Grouping::kWide>(a, xs); return;
        case Grouping::kPairs: linear_small_m_grouped<F, Dot, Grouping::kPairs>(a, xs); return;
        case Grouping::kQuads: linear_small_m_grouped<F, Dot, Grouping::kQuads>(a, xs); return;
    }
}

template <class F>
bool small_m_applies(const LinearArgs& a)
{
    if constexpr (RawBf16Decoder<F>::kSupported) {
        return a.group_size % 16 == 0 && RawBf16Decoder<F>().exact;
    }
    return false;
}

template <class F>
bool try_linear_small_m(const LinearArgs& a, bool x_bf16)
{
    if constexpr (RawBf16Decoder<F>::kSupported) {
        if (!small_m_applies<F>(a)) { return false; }
        if (!x_bf16) {
            linear_small_m_as<F, DotF32>(a, static_cast<const float*>(a.x));
        } else if (a.m <= DotBf16::kStreamM && bf16_dot_exact<F>(a)) {
            linear_small_m_as<F, DotBf16>(a, static_cast<const Bf16*>(a.x));
        } else {  // bf16 x widened exactly, the fp32 FMAs: x that vdpbf16ps would flush, or more rows than it streams
            linear_small_m_as<F, DotF32>(a, static_cast<const Bf16*>(a.x));
        }
        return true;
    }
    return false;
}

}  // namespace

bool linear_small_m_applies(Format fmt, const LinearArgs& args)
{
    return dispatch_format(fmt, [&](auto f) { return small_m_applies<decltype(f)>(args); });
}

bool linear_small_m(Format fmt, const LinearArgs& args, bool x_bf16)
{
    return dispatch_format(fmt, [&](auto f) { return try_linear_small_m<decltype(f)>(args, x_bf16); });
}

}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_DIRECT_BF16
