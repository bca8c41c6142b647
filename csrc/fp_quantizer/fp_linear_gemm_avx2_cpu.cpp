// The AVX2 GEMM (FPQ_AVX2_FMA, fp_kernels_cpu.h), SPEC 8.1 for any m, every format and scale layout:
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))     (fp32; bias and rounding by the caller)
//  * Work: tiles of kTileN = 16 weight rows (N in the 16 fp32 lanes of two registers); threads split the tiles, and
//    the rows of x where there are fewer tiles than threads.
//  * Decode once: each kChunk columns of a tile's codes are decoded exactly, once, into a panel P[k][16] (16 KiB of
//    fp32, L1) that serves every row of x. 8-bit and 4-bit rows that are one bit stream: the code bytes of the 16 rows
//    transposed 16 x 32 (unpacks), then decoded 16 rows at a time (fp_avx2_decode_cpu.h: placed values times
//    2^(127 - bias), or the placed values with x scaled instead where that is exact; e2m1 byte tables); every other
//    format / layout (FP6, e4m7, groups that do not fill whole bytes): the codec's row decoder, transposed.
//  * Micro-kernel: kMR (<= 6) rows of x (packed per block of rows, k-major) broadcast against the panel's two
//    registers per k: 2 * kMR fp32 accumulators hold the group's partial sums; at the group's end they are
//    multiplied by the group's 16 scales (one register pair, a panel of the tile's scales) into the tile's totals, so
//    each partial sum is scaled once. A group that runs past the chunk carries its partial sums to the next chunk.
//  * Rows with an e4m3 NaN or e5m2 Inf / NaN code are marked while their panels are decoded and recomputed by the
//    codec (exact_row_outputs).
// No torch includes.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp_avx2_decode_cpu.h"
#include "ieee_denormals.h"

#if defined(FPQ_AVX2_FMA)
#include <omp.h>

namespace fpq {
namespace cpu_kernels {
namespace {

constexpr int64_t kTileN = 16;   // weight rows per tile: two registers of fp32 lanes
constexpr int64_t kMaxMR = 6;    // rows of x per micro-kernel call: 12 accumulators
constexpr int64_t kChunk = 256;  // columns per panel: 256 x 16 fp32 = 16 KiB

// 32-byte aligned float storage
struct AlignedFloats {
    std::vector<float> storage;
    float* data;
    explicit AlignedFloats(int64_t count) : storage(size_t(count + 8))
    {
        const auto address = reinterpret_cast<uintptr_t>(storage.data());
        data = storage.data() + (ceil_div(int64_t(address), 32) * 32 - int64_t(address)) / int64_t(sizeof(float));
    }
};

// x packed per block of rows: block b (rows m0 .. m0+mr-1, mr = min(kMaxMR, m - m0)) at data + m0 * k, element
// (k, i) at [k * mr + i] = x[m0 + i, k] * scale (scale = 2^kXExponent for placed panels: exact, x_placed_ok).
struct PackedX {
    AlignedFloats buffer;
    PackedX(const LinearArgs& a, bool x_bf16, int64_t in_stride, float scale) : buffer(a.m * a.k)
    {
        const int64_t blocks = ceil_div(a.m, kMaxMR);
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t m0 = b * kMaxMR, mr = std::min(kMaxMR, a.m - m0);
            float* out = buffer.data + m0 * a.k;
            for (int64_t k = 0; k < a.k; ++k) {
                for (int64_t i = 0; i < mr; ++i) { out[k * mr + i] = mul_rn(x_at(a, x_bf16, in_stride, m0 + i, k), scale); }
            }
        }
    }
    const float* block(int64_t m0, int64_t k) const { return buffer.data + m0 * k; }
};

// The panel decoders: build(rows, c0, c1, panel) writes columns c0 .. c1-1 (c1 - c0 <= kChunk) of the tile's 16
// rows as P[(c - c0) * 16 + lane], exact (or placed); lane l holds tile row row_of_lane(l). specials(): per tile
// row (bit r), codes without a finite value seen so far.
template <class F, bool kPlaced>
struct BytePanels {  // 8-bit codes (Placed8)
    using D = Placed8<F>;
    static constexpr int row_of_lane(int l) { return D::row_of_lane(l); }
    alignas(32) uint8_t tb[32 * 16];
    alignas(32) uint8_t padded[16][32];
    __m128i flags = _mm_setzero_si128();

    void build(const LinearArgs& a, const uint8_t* const (&rows)[16], int64_t c0, int64_t c1, float* panel)
    {
        for (int64_t c = c0; c < c1; c += 32) {
            const int64_t width = std::min<int64_t>(32, c1 - c);
            if (width == 32) {
                transpose_16x32(rows, c, tb);
            } else {  // the row's last columns, zero-padded (code 0 is +0)
                const uint8_t* tail[16];
                for (int r = 0; r < 16; ++r) {
                    std::memset(padded[r], 0, 32);
                    std::memcpy(padded[r], rows[r] + c, size_t(width));
                    tail[r] = padded[r];
                }
                transpose_16x32(tail, 0, tb);
            }
            for (int64_t j = 0; j < width; ++j) {
                flags = _mm_or_si128(flags, D::panel_specials(tb + 16 * j));
                D::template panel<kPlaced>(tb + 16 * j, panel + (c - c0 + j) * 16);
            }
        }
        (void)a;
    }
    uint32_t specials() const { return uint32_t(_mm_movemask_epi8(flags)); }
};

template <class F>
struct NibblePanels {  // 4-bit codes (Table4)
    static constexpr int row_of_lane(int l) { return l; }
    const Table4<F> dec;
    alignas(32) uint8_t tb[32 * 16];
    alignas(32) uint8_t padded[16][32];

    void build(const LinearArgs& a, const uint8_t* const (&rows)[16], int64_t c0, int64_t c1, float* panel)
    {
        // c0 is even (chunks are multiples of 64 columns): byte c / 2 holds columns c (low nibble) and c + 1
        for (int64_t c = c0; c < c1; c += 64) {
            const int64_t width = std::min<int64_t>(64, c1 - c), bytes = group_bytes(width, 4);
            if (width == 64) {
                transpose_16x32(rows, c / 2, tb);
            } else {
                const uint8_t* tail[16];
                for (int r = 0; r < 16; ++r) {
                    std::memset(padded[r], 0, 32);
                    std::memcpy(padded[r], rows[r] + c / 2, size_t(bytes));
                    tail[r] = padded[r];
                }
                transpose_16x32(tail, 0, tb);
            }
            alignas(32) float odd_spill[16];
            for (int64_t j = 0; j < bytes; ++j) {
                float* even = panel + (c - c0 + 2 * j) * 16;
                const bool has_odd = c + 2 * j + 1 < c1;
                dec.panel(tb + 16 * j, even, has_odd ? even + 16 : odd_spill);
            }
        }
        (void)a;
    }
    uint32_t specials() const { return 0; }
};

template <class F>
struct GenericPanels {  // any format and grouping: the codec's row decoder (decode(q) * 1, exact), transposed
    static constexpr int row_of_lane(int l) { return l; }
    std::vector<float> rows_f32 = std::vector<float>(size_t(16 * kChunk));
    std::vector<uint32_t> codes;
    explicit GenericPanels(const LinearArgs& a) : codes(size_t(a.group_size + 8)) {}

    void build(const LinearArgs& a, const uint8_t* const (&rows)[16], int64_t c0, int64_t c1, float* panel)
    {
        const int64_t g_size = a.group_size, full_group_bytes = group_bytes(g_size, F::kBits);
        for (int r = 0; r < 16; ++r) {
            float* out = rows_f32.data() + r * kChunk;
            for (int64_t g = c0 / g_size; g * g_size < c1; ++g) {
                const int64_t start = g * g_size, glen = std::min(g_size, a.k - start);
                const int64_t j0 = std::max(c0, start) - start, j1 = std::min(c1, start + glen) - start;
                decode_codes<F, float, float>(rows[r] + g * full_group_bytes, glen, j0, j1, 1.0f,
                                              out + (start + j0 - c0), codes.data());
            }
        }
        for (int64_t c = 0; c < c1 - c0; ++c) {
            for (int r = 0; r < 16; ++r) { panel[c * 16 + r] = rows_f32[size_t(r * kChunk + c)]; }
        }
    }
    uint32_t specials() const { return 0; }  // the codec decodes NaN and Inf codes as they are
};

// acc[i][m][h] += P[k][8h .. 8h+8) * x[m, k] over k in [0, len): kI interleaved sets of accumulators for few rows
// of x (enough independent FMAs for the FMA latency).
template <int kMR, int kI>
inline void micro(const float* __restrict P, const float* __restrict X, int64_t len, __m256 (&acc)[kI][kMR][2])
{
    int64_t k = 0;
    for (; k + kI <= len; k += kI) {
        for (int i = 0; i < kI; ++i) {
            const __m256 p0 = _mm256_load_ps(P + (k + i) * 16), p1 = _mm256_load_ps(P + (k + i) * 16 + 8);
            for (int m = 0; m < kMR; ++m) {
                const __m256 xb = _mm256_broadcast_ss(X + (k + i) * kMR + m);
                acc[i][m][0] = _mm256_fmadd_ps(p0, xb, acc[i][m][0]);
                acc[i][m][1] = _mm256_fmadd_ps(p1, xb, acc[i][m][1]);
            }
        }
    }
    for (; k < len; ++k) {
        const __m256 p0 = _mm256_load_ps(P + k * 16), p1 = _mm256_load_ps(P + k * 16 + 8);
        for (int m = 0; m < kMR; ++m) {
            const __m256 xb = _mm256_broadcast_ss(X + k * kMR + m);
            acc[0][m][0] = _mm256_fmadd_ps(p0, xb, acc[0][m][0]);
            acc[0][m][1] = _mm256_fmadd_ps(p1, xb, acc[0][m][1]);
        }
    }
}

// The tile's per-thread state: panel, scale panel S[g][16], totals T[m][16] and the carried partial sums C[m][16].
struct TileBuffers {
    AlignedFloats panel, scales, totals, carry;
    TileBuffers(const LinearArgs& a) : panel(kChunk * 16), scales(a.scale_cols * 16), totals(a.m * 16), carry(a.m * 16) {}
};

// Columns [c0, c1) of the chunk for rows m0 .. m0+kMR-1 of x: per group segment, the partial sums (from zero at the
// group's start, else carried), then at the group's end T += acc * S[g]; a segment cut by the chunk's end carries.
template <int kMR>
void chunk_rows(const LinearArgs& a, const float* panel, const float* xblock, int64_t c0, int64_t c1, const float* S,
                float* T, float* C)
{
    constexpr int kI = kMR <= 2 ? 2 : 1;
    const int64_t g_size = a.group_size;
    for (int64_t g = c0 / g_size; g * g_size < c1; ++g) {
        const int64_t start = std::max(c0, g * g_size), group_end = std::min(a.k, (g + 1) * g_size);
        const int64_t end = std::min(c1, group_end);
        __m256 acc[kI][kMR][2];
        for (int i = 0; i < kI; ++i) {
            for (int m = 0; m < kMR; ++m) {
                const bool carried = i == 0 && start > g * g_size;
                acc[i][m][0] = carried ? _mm256_load_ps(C + m * 16) : _mm256_setzero_ps();
                acc[i][m][1] = carried ? _mm256_load_ps(C + m * 16 + 8) : _mm256_setzero_ps();
            }
        }
        micro<kMR, kI>(panel + (start - c0) * 16, xblock + start * kMR, end - start, acc);
        for (int m = 0; m < kMR; ++m) {
            for (int h = 0; h < 2; ++h) {
                __m256 sum = acc[0][m][h];
                for (int i = 1; i < kI; ++i) { sum = _mm256_add_ps(sum, acc[i][m][h]); }
                if (end == group_end) {  // the group's partial sum times its scale, once
                    float* t = T + m * 16 + 8 * h;
                    _mm256_store_ps(t, _mm256_fmadd_ps(sum, _mm256_load_ps(S + g * 16 + 8 * h), _mm256_load_ps(t)));
                } else {
                    _mm256_store_ps(C + m * 16 + 8 * h, sum);
                }
            }
        }
    }
}

inline void chunk_block(const LinearArgs& a, const float* panel, const float* xblock, int64_t mr, int64_t c0, int64_t c1,
                        const float* S, float* T, float* C)
{
    switch (mr) {
        case 6: chunk_rows<6>(a, panel, xblock, c0, c1, S, T, C); break;
        case 5: chunk_rows<5>(a, panel, xblock, c0, c1, S, T, C); break;
        case 4: chunk_rows<4>(a, panel, xblock, c0, c1, S, T, C); break;
        case 3: chunk_rows<3>(a, panel, xblock, c0, c1, S, T, C); break;
        case 2: chunk_rows<2>(a, panel, xblock, c0, c1, S, T, C); break;
        default: chunk_rows<1>(a, panel, xblock, c0, c1, S, T, C); break;
    }
}

// One tile (weight rows n0 .. n0+15, those < n) for rows m_begin .. m_end-1 of x (m_begin a multiple of kMaxMR).
template <class F, class Panels, bool kBytes>
void gemm_tile(const LinearArgs& a, bool x_bf16, int64_t in_stride, const PackedX& xs, const GroupScales<kBytes>& gs,
               Panels& panels, TileBuffers& buf, int64_t n0, int64_t m_begin, int64_t m_end)
{
    const int64_t rows_here = std::min(kTileN, a.n - n0);
    const uint8_t* rows[16];
    for (int r = 0; r < 16; ++r) { rows[r] = a.codes + (n0 + std::min<int64_t>(r, rows_here - 1)) * a.row_bytes; }
    float* S = buf.scales.data;
    for (int l = 0; l < 16; ++l) {
        const int64_t n = n0 + std::min<int64_t>(Panels::row_of_lane(l), rows_here - 1);
        const int64_t base = gs.base(n);
        for (int64_t g = 0; g < a.scale_cols; ++g) { S[g * 16 + l] = gs.at(base + g); }
    }
    float* T = buf.totals.data;
    std::fill(T + m_begin * 16, T + m_end * 16, 0.0f);
    for (int64_t c0 = 0; c0 < a.k; c0 += kChunk) {
        const int64_t c1 = std::min(a.k, c0 + kChunk);
        panels.build(a, rows, c0, c1, buf.panel.data);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxMR) {
            const int64_t mr = std::min(kMaxMR, a.m - m0);
            chunk_block(a, buf.panel.data, xs.block(m0, a.k), mr, c0, c1, S, T + m0 * 16, buf.carry.data + m0 * 16);
        }
    }
    for (int64_t m = m_begin; m < m_end; ++m) {
        for (int l = 0; l < 16; ++l) {
            const int r = Panels::row_of_lane(l);
            if (r < rows_here) { a.y[m * a.n + n0 + r] = T[m * 16 + l]; }
        }
    }
    const uint32_t special = panels.specials();
    for (int r = 0; r < rows_here; ++r) {  // rows with codes without a finite value: the codec's formula
        if (special >> r & 1) { exact_row_outputs<F>(a, x_bf16, in_stride, n0 + r, m_begin, m_end); }
    }
}

template <class F, class MakePanels>
void gemm_as(const LinearArgs& a, bool x_bf16, int64_t in_stride, float x_scale, MakePanels make_panels)
{
    const PackedX xs(a, x_bf16, in_stride, x_scale);
    const int64_t tiles = ceil_div(a.n, kTileN);
    const int64_t blocks = ceil_div(a.m, kMaxMR);
    dispatch_scales(a, [&](auto bytes) {
        constexpr bool kBytes = decltype(bytes)::value;
        const GroupScales<kBytes> gs(a);
#pragma omp parallel
        {
            const ScopedIeeeDenormals ieee;
            const int64_t threads = omp_get_num_threads();
            // fewer tiles than threads: each tile's rows of x split into parts
            const int64_t parts = std::min(blocks, tiles >= threads ? int64_t(1) : ceil_div(threads, tiles));
            auto panels = make_panels();
            TileBuffers buf(a);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < tiles * parts; ++item) {
                const int64_t tile = item / parts, part = item % parts;
                const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
                if (b0 < b1) {
                    gemm_tile<F>(a, x_bf16, in_stride, xs, gs, panels, buf, tile * kTileN, b0 * kMaxMR,
                                 std::min(a.m, b1 * kMaxMR));
                }
            }
        }
    });
}

template <class F>
void gemm(const LinearArgs& a, bool x_bf16)
{
    const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
    const bool stream = row_is_one_stream(a, F::kBits);
    if constexpr (F::kBits == 8) {
        if (stream) {
            constexpr int kE = Placed8<F>::kXExponent;
            if (x_placed_ok(finite_amax(a, x_bf16, in_stride), kE)) {
                gemm_as<F>(a, x_bf16, in_stride, pow2f(kE), [] { return BytePanels<F, true>{}; });
            } else {
                gemm_as<F>(a, x_bf16, in_stride, 1.0f, [] { return BytePanels<F, false>{}; });
            }
            return;
        }
    } else if constexpr (F::kBits == 4) {
        if (stream && Table4<F>().exact) {
            gemm_as<F>(a, x_bf16, in_stride, 1.0f, [] { return NibblePanels<F>{}; });
            return;
        }
    }
    gemm_as<F>(a, x_bf16, in_stride, 1.0f, [&] { return GenericPanels<F>(a); });
}

}  // namespace

void linear_gemm_avx2(Format fmt, const LinearArgs& args, bool x_bf16)
{
    dispatch_format(fmt, [&](auto f) { gemm<decltype(f)>(args, x_bf16); });
}

}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_AVX2_FMA
