// The register-blocked CPU linear (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI, fp_kernels_cpu.h), SPEC 8:
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))     (fp32; bias and rounding by the caller)
// for 4-, 6- and 8-bit codes in groups of a multiple of 16 codes (row groups or 2-D blocks), any m.
//  * Each step decodes 64 codes of a weight row straight to bf16 words by table lookups (RawBf16Decoder,
//    fp_raw_decode_cpu.h): no scale, no rounding, no arithmetic per weight.
//  * bf16 x: vdpbf16ps multiplies the words by x (exact products) into fp32 accumulators. fp32 x (and
//    fp16 x, widened exactly by the binding): the words are widened to fp32 by 16-bit shifts and FMA'd.
//  * Register blocking: a tile is kM (<= 4) rows of x times kN weight rows; each step's decoded words
//    serve the tile's kM rows. The group scale multiplies the group's partial sum: once per group for
//    groups of a multiple of 64 codes, per lane quad (16 codes, one group) for groups of 16, 32, 48, ...
//  * K is walked in chunks of about kChunk columns (whole groups), so that the chunk of every row of x
//    stays in L1 while the weight rows of a tile stream past it; totals persist across chunks in a
//    small per-thread buffer. OpenMP splits the weight rows (output features).
// No torch includes.

#include <algorithm>
#include <cstdint>
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
    // weight rows per tile: kRowsFew up to kFewM rows of x, else kRows (what the registers hold)
    static constexpr int64_t kFewM = 2, kRowsFew = 4, kRows = 2;
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
    static constexpr int64_t kFewM = 1, kRowsFew = 4, kRows = 2;
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

// What one tile reads: kN weight rows (codes, and per row the group scales, or for groups below 64 codes
// the scale of every 16-code quad), x rows of stride x_stride staged in unpack order.
template <class Dot, int64_t kN>
struct TileArgs {
    const uint8_t* rows[kN];
    const float* scales[kN];
    const typename Dot::X* x;
    int64_t x_stride;
    int64_t k;
    int64_t group_size;
};

// totals[m][r] (16 fp32 lanes each, in `totals`) += the columns c0 .. c1-1 (whole groups; c1 <= k or the
// end of the row) of rows m < kM of x times weight rows r < kN.
template <class F, class Dot, int64_t kM, int64_t kN, bool kWide>
inline void tile(const RawBf16Decoder<F>& dec, const TileArgs<Dot, kN>& t, int64_t c0, int64_t c1, float* totals)
{
    // acc[m][r] += step of 64 codes at column c (`valid` of them inside the row)
    const auto step = [&](int64_t c, int64_t valid, __m512(&acc)[kM][kN]) {
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
    };
    // totals[m][r] += acc[m][r] * s[r] (per lane): the totals live in memory (L1), touched once per group,
    // so that the registers hold the accumulators, the decoded words and x
    const auto scale_into_totals = [&](const __m512(&acc)[kM][kN], const __m512(&s)[kN]) {
        for (int64_t m = 0; m < kM; ++m) {
            for (int64_t r = 0; r < kN; ++r) {
                float* p = totals + (m * kN + r) * 16;
                _mm512_storeu_ps(p, _mm512_fmadd_ps(acc[m][r], s[r], _mm512_loadu_ps(p)));
            }
        }
    };
    if constexpr (kWide) {  // groups of a multiple of 64 codes: one scale multiply per group
        int64_t g = c0 / t.group_size;
        for (int64_t start = c0; start < c1; start += t.group_size, ++g) {
            __m512 acc[kM][kN];
            for (int64_t m = 0; m < kM; ++m) {
                for (int64_t r = 0; r < kN; ++r) { acc[m][r] = _mm512_setzero_ps(); }
            }
            const int64_t end = std::min(c1, std::min(t.k, start + t.group_size));
            int64_t c = start;
            for (; c + kStep <= end; c += kStep) { step(c, kStep, acc); }
            if (c < end) { step(c, end - c, acc); }
            __m512 s[kN];
            for (int64_t r = 0; r < kN; ++r) { s[r] = _mm512_set1_ps(t.scales[r][g]); }
            scale_into_totals(acc, s);
        }
    } else {  // groups of 16, 32, 48, ... codes: each lane quad of a step is one group's
        const __m512i quad = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        const int64_t end = std::min(c1, t.k);
        for (int64_t c = c0; c < end; c += kStep) {
            __m512 acc[kM][kN];
            for (int64_t m = 0; m < kM; ++m) {
                for (int64_t r = 0; r < kN; ++r) { acc[m][r] = _mm512_setzero_ps(); }
            }
            step(c, std::min(kStep, end - c), acc);
            __m512 s[kN];
            for (int64_t r = 0; r < kN; ++r) {
                s[r] = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(t.scales[r] + c / 16)));
            }
            scale_into_totals(acc, s);
        }
    }
}

// The scale of every 16-code quad of a row (groups of a multiple of 16 codes), zero past the row's end
// (those quads multiply zero partial sums): quads[j] = scales[j * 16 / G].
inline void fill_quad_scales(const float* scales, int64_t group_size, int64_t k, int64_t padded, float* quads)
{
    const int64_t count = ceil_div(k, 16);
    if (group_size == 16) {
        std::copy(scales, scales + count, quads);
    } else if (group_size == 32) {  // mxfp4 / mxfp8: two quads per group
        for (int64_t j = 0; j < count; ++j) { quads[j] = scales[j >> 1]; }
    } else {
        const int64_t per_group = group_size / 16;
        for (int64_t j = 0; j < count; ++j) { quads[j] = scales[j / per_group]; }
    }
    std::fill(quads + count, quads + padded, 0.0f);
}

template <class F, class Dot, int64_t kN, bool kWide>
void linear_tiles(const LinearArgs& a, const typename Dot::X* xs, int64_t x_stride)
{
    const RawBf16Decoder<F> dec;
    const int64_t g_size = a.group_size;
    const int64_t chunk = kWide ? std::max<int64_t>(1, kChunk / g_size) * g_size : kChunk;
    const int64_t quads = ceil_div(a.k, kStep) * 4 + 4;
    const int64_t tiles = ceil_div(a.n, kN);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        // per weight row of the tile: decoded scales (E8M0, NVFP4), quad scales (groups below 64 codes)
        std::vector<float> row_scales(static_cast<size_t>(kN * a.scale_cols)), quad_scales(static_cast<size_t>(kN * quads));
        std::vector<float> totals(static_cast<size_t>(a.m * kN * 16));
#pragma omp for schedule(static)
        for (int64_t tile_index = 0; tile_index < tiles; ++tile_index) {
            TileArgs<Dot, kN> t;
            t.x_stride = x_stride;
            t.k = a.k;
            t.group_size = g_size;
            const int64_t n0 = tile_index * kN;
            for (int64_t r = 0; r < kN; ++r) {
                const int64_t n = std::min(a.n - 1, n0 + r);  // past the last row: repeat it, results unused
                t.rows[r] = a.codes + n * a.row_bytes;
                const float* s = static_cast<const float*>(a.scales) + (n / a.block_rows) * a.scale_cols;
                if (a.scale_kind != LinearScale::kFp32 || !kWide) {
                    float* decoded = row_scales.data() + r * a.scale_cols;
                    decode_row_scales(a, n, decoded);
                    s = decoded;
                }
                if constexpr (!kWide) {
                    float* q = quad_scales.data() + r * quads;
                    fill_quad_scales(s, g_size, a.k, quads, q);
                    s = q;
                }
                t.scales[r] = s;
            }
            std::fill(totals.begin(), totals.end(), 0.0f);
            for (int64_t c0 = 0; c0 < a.k; c0 += chunk) {
                const int64_t c1 = std::min(a.k, c0 + chunk);
                for (int64_t m0 = 0; m0 < a.m; m0 += kMaxTileM) {
                    t.x = xs + m0 * x_stride;
                    float* tot = totals.data() + m0 * kN * 16;
                    switch (std::min(kMaxTileM, a.m - m0)) {
                        case 4: tile<F, Dot, 4, kN, kWide>(dec, t, c0, c1, tot); break;
                        case 3: tile<F, Dot, 3, kN, kWide>(dec, t, c0, c1, tot); break;
                        case 2: tile<F, Dot, 2, kN, kWide>(dec, t, c0, c1, tot); break;
                        default: tile<F, Dot, 1, kN, kWide>(dec, t, c0, c1, tot); break;
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

// x (m, k) rows of the binding's layout (zero-padded to kLinearPad columns) staged in the decoder's order, each
// row 64-byte aligned (the steps' full-vector loads). The row stride is one step longer than the row: with a
// stride of a multiple of 4 KiB (K = 4096 bf16 is 8 KiB) every row's step would sit in the same L1 sets as the
// others' and as the weight rows' (whose stride is K bytes for 8-bit codes), and evict them.
template <class F, class Dot>
struct StagedX {
    using X = typename Dot::X;
    int64_t stride;
    std::vector<X> storage;
    X* data;

    StagedX(const LinearArgs& a) : stride(ceil_div(a.k, kStep) * kStep + kStep), storage(size_t(a.m * stride + 64))
    {
        const auto address = reinterpret_cast<uintptr_t>(storage.data());
        data = storage.data() + (ceil_div(int64_t(address), 64) * 64 - int64_t(address)) / int64_t(sizeof(X));
        const X* x = static_cast<const X*>(a.x);
        const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
        for (int64_t m = 0; m < a.m; ++m) {
            for (int64_t c0 = 0; c0 < stride - kStep; c0 += kStep) {
                for (int64_t i = 0; i < kStep; ++i) {
                    data[m * stride + c0 + i] = x[m * in_stride + c0 + Dot::template column<RawBf16Decoder<F>>(i)];
                }
            }
        }
    }
};

template <class F, class Dot>
void linear_small_m_as(const LinearArgs& a)
{
    const StagedX<F, Dot> xs(a);
    const bool wide = a.group_size % kStep == 0;
    if (a.m <= Dot::kFewM) {
        if (wide) {
            linear_tiles<F, Dot, Dot::kRowsFew, true>(a, xs.data, xs.stride);
        } else {
            linear_tiles<F, Dot, Dot::kRowsFew, false>(a, xs.data, xs.stride);
        }
    } else if (wide) {
        linear_tiles<F, Dot, Dot::kRows, true>(a, xs.data, xs.stride);
    } else {
        linear_tiles<F, Dot, Dot::kRows, false>(a, xs.data, xs.stride);
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
        if (x_bf16) {
            linear_small_m_as<F, DotBf16>(a);
        } else {
            linear_small_m_as<F, DotF32>(a);
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
