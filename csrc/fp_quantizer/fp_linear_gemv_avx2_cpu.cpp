// The AVX2 GEMV (FPQ_AVX2_FMA, fp_kernels_cpu.h), SPEC 8.1 for m <= kGemvMaxM rows of x:
//   y[m, n] = sum_g s[n, g] * (sum_{j in g} x[m, j] * decode(q[n, j]))     (fp32; bias and rounding by the caller)
// for e4m3 / e5m2 codes in groups of a multiple of 16 and e2m1 codes in groups of 16 or a multiple of 32 (row
// groups or 2-D blocks; the row one bit stream).
//  * Threads split the weight rows; each streams its rows once, in memory order.
//  * A unit of 16 bytes (16 8-bit or 32 4-bit codes) is decoded exactly into fp32 lanes (fp_avx2_decode_cpu.h:
//    placed 8-bit values, the caller's x times 2^(127 - bias) where that is exact, else the placed values times
//    2^(127 - bias); e2m1 by byte tables), and each decoded register is FMA'd with every row of x (staged once per
//    call in the decoder's lane order).
//  * The group's partial sums stay in fp32 registers (several chains, for the FMA latency), are added and
//    multiplied by the group's scale once per group into per-row totals; the lanes are added at the end.
//  * Rows holding an e4m3 NaN or e5m2 Inf / NaN code are found as they stream (byte maxima) and recomputed by the
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

// x staged for decoder D: for each row m, unit u of D::kCodes columns, vector v and lane j: the column
// u * kCodes + D::code_of(v, j) of x, times `scale` (1, or 2^kXExponent for placed codes), 0 past k. Rows 32-byte
// aligned, the stride one unit longer than needed (a multiple of 4 KiB would put every row in the same L1 sets).
template <class D>
struct StagedGemvX {
    int64_t stride;
    std::vector<float> storage;
    float* data;

    StagedGemvX(const LinearArgs& a, bool x_bf16, int64_t in_stride, float scale)
        : stride((ceil_div(a.k, D::kCodes) + 1) * D::kCodes), storage(size_t(a.m * stride + 8))
    {
        const auto address = reinterpret_cast<uintptr_t>(storage.data());
        data = storage.data() + (ceil_div(int64_t(address), 32) * 32 - int64_t(address)) / int64_t(sizeof(float));
        for (int64_t m = 0; m < a.m; ++m) {
            float* row = data + m * stride;
            for (int64_t u = 0; u * D::kCodes < stride; ++u) {
                for (int v = 0; v < D::kVectors; ++v) {
                    for (int j = 0; j < 8; ++j) {
                        const int64_t k = u * D::kCodes + D::code_of(v, j);
                        row[u * D::kCodes + 8 * v + j] = k < a.k ? mul_rn(x_at(a, x_bf16, in_stride, m, k), scale) : 0.0f;
                    }
                }
            }
        }
    }
};

// One pass over weight rows n0 .. n1-1 for kM rows of x. kUp: the decoded values are placed and are multiplied by
// 2^kXExponent here (x too large to be scaled instead). kBytes: E8M0 / NVFP4 scale bytes (GroupScales).
template <class D, int kM, bool kUp, bool kBytes>
struct GemvRows {
    // accumulator chains per row of x: enough independent FMAs in flight for one row, two for more
    static constexpr int kChains = kM == 1 ? 4 : 2;

    const LinearArgs& a;
    const D& dec;
    const GroupScales<kBytes>& scales;
    const float* xs;
    int64_t x_stride;

    // acc[m][c0 + v] += decoded vector v of the unit at p times x of unit u
    template <int kC0>
    inline void step(const uint8_t* p, int64_t u, __m256 (&acc)[kM][kChains]) const
    {
        __m256 w[D::kVectors];
        dec.decode(p, w);
        if constexpr (kUp) {
            const __m256 up = _mm256_set1_ps(pow2f(D::kXExponent));
            for (int v = 0; v < D::kVectors; ++v) { w[v] = _mm256_mul_ps(w[v], up); }
        }
        const float* x = xs + u * D::kCodes;
        for (int m = 0; m < kM; ++m) {
            for (int v = 0; v < D::kVectors; ++v) {
                __m256& c = acc[m][(kC0 + v) % kChains];
                c = _mm256_fmadd_ps(w[v], _mm256_load_ps(x + m * x_stride + 8 * v), c);
            }
        }
    }

    // tot[m][g & 1] += (the chains' sum) * s: the group's partial sum times its scale, once
    static inline void flush(const __m256 (&acc)[kM][kChains], const float* s, __m256 (&tot)[kM][2], int64_t g)
    {
        const __m256 scale = _mm256_broadcast_ss(s);
        for (int m = 0; m < kM; ++m) {
            __m256 sum = acc[m][0];
            for (int c = 1; c < kChains; ++c) { sum = _mm256_add_ps(sum, acc[m][c]); }
            tot[m][g & 1] = _mm256_fmadd_ps(sum, scale, tot[m][g & 1]);
        }
    }

    // groups of a multiple of D::kCodes codes: whole units per group
    void wide(int64_t n0, int64_t n1, bool x_bf16, int64_t in_stride) const
    {
        const int64_t full = a.k / D::kCodes, tail_codes = a.k % D::kCodes;
        const int64_t per_group = a.group_size / D::kCodes;
        alignas(32) uint8_t tail[32] = {};
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = a.codes + n * a.row_bytes;
            const int64_t sbase = scales.base(n);
            __m256 tot[kM][2];
            for (int m = 0; m < kM; ++m) { tot[m][0] = tot[m][1] = _mm256_setzero_ps(); }
            typename D::Specials specials;
            int64_t u = 0;
            for (int64_t g = 0; g < a.scale_cols; ++g) {
                __m256 acc[kM][kChains];
                for (int m = 0; m < kM; ++m) {
                    for (int c = 0; c < kChains; ++c) { acc[m][c] = _mm256_setzero_ps(); }
                }
                const int64_t end = std::min(full, (g + 1) * per_group);
                for (; u + 2 <= end; u += 2) {
                    if constexpr (D::kHasSpecials) {
                        specials.add(row + 16 * u);
                        specials.add(row + 16 * u + 16);
                    }
                    step<0>(row + 16 * u, u, acc);
                    step<D::kVectors>(row + 16 * (u + 1), u + 1, acc);
                }
                if (u < end) {
                    if constexpr (D::kHasSpecials) { specials.add(row + 16 * u); }
                    step<0>(row + 16 * u, u, acc);
                    ++u;
                }
                if (u == full && tail_codes && g == a.scale_cols - 1) {  // the row's last, partial unit, zero-padded
                    std::memcpy(tail, row + 16 * u, size_t(group_bytes(tail_codes, D::kBits)));
                    if constexpr (D::kHasSpecials) { specials.add(tail); }
                    step<0>(tail, u, acc);
                }
                flush(acc, scales.address(sbase + g), tot, g);
            }
            for (int m = 0; m < kM; ++m) { a.y[m * a.n + n] = hsum(_mm256_add_ps(tot[m][0], tot[m][1])); }
            if constexpr (D::kHasSpecials) {
                if (specials.any()) { exact_row_outputs<typename D::Traits>(a, x_bf16, in_stride, n, 0, a.m); }
            }
        }
    }

    // e2m1 in groups of 16: each unit of 32 codes holds two groups (vectors 0, 1 and 2, 3)
    void groups_of_16(int64_t n0, int64_t n1) const
    {
        static_assert(D::kCodes == 32, "two groups of 16 per unit");
        const int64_t units = ceil_div(a.k, D::kCodes);
        const int64_t tail_bytes = group_bytes(a.k % D::kCodes, D::kBits);
        alignas(32) uint8_t tail[32] = {};
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t* row = a.codes + n * a.row_bytes;
            const int64_t sbase = scales.base(n);
            __m256 tot[kM][2];
            for (int m = 0; m < kM; ++m) { tot[m][0] = tot[m][1] = _mm256_setzero_ps(); }
            for (int64_t u = 0; u < units; ++u) {
                const uint8_t* p = row + 16 * u;
                if (u == units - 1 && tail_bytes) {
                    std::memcpy(tail, p, size_t(tail_bytes));
                    p = tail;
                }
                __m256 w[D::kVectors];
                dec.decode(p, w);
                const float* x = xs + u * D::kCodes;
                const __m256 s0 = _mm256_broadcast_ss(scales.address(sbase + 2 * u));
                const bool second = 2 * u + 1 < a.scale_cols;  // a short row may end inside the first group
                const __m256 s1 = second ? _mm256_broadcast_ss(scales.address(sbase + 2 * u + 1)) : _mm256_setzero_ps();
                for (int m = 0; m < kM; ++m) {
                    const float* xm = x + m * x_stride;
                    const __m256 g0 = _mm256_fmadd_ps(w[1], _mm256_load_ps(xm + 8), _mm256_mul_ps(w[0], _mm256_load_ps(xm)));
                    const __m256 g1 =
                        _mm256_fmadd_ps(w[3], _mm256_load_ps(xm + 24), _mm256_mul_ps(w[2], _mm256_load_ps(xm + 16)));
                    tot[m][0] = _mm256_fmadd_ps(g0, s0, tot[m][0]);
                    if (second) { tot[m][1] = _mm256_fmadd_ps(g1, s1, tot[m][1]); }
                }
            }
            for (int m = 0; m < kM; ++m) { a.y[m * a.n + n] = hsum(_mm256_add_ps(tot[m][0], tot[m][1])); }
        }
    }
};

template <class D, int kM, bool kUp>
void gemv_as(const LinearArgs& a, const D& dec, bool x_bf16, int64_t in_stride, const StagedGemvX<D>& xs)
{
    dispatch_scales(a, [&](auto bytes) {
        constexpr bool kBytes = decltype(bytes)::value;
        const GroupScales<kBytes> scales(a);
        const GemvRows<D, kM, kUp, kBytes> rows{a, dec, scales, xs.data, xs.stride};
        const bool g16 = D::kCodes == 32 && a.group_size == 16;
#pragma omp parallel
        {
            const ScopedIeeeDenormals ieee;
            const int threads = omp_get_num_threads(), t = omp_get_thread_num();
            const int64_t n0 = a.n * t / threads, n1 = a.n * (t + 1) / threads;
            if constexpr (D::kCodes == 32) {
                if (g16) {
                    rows.groups_of_16(n0, n1);
                } else {
                    rows.wide(n0, n1, x_bf16, in_stride);
                }
            } else {
                rows.wide(n0, n1, x_bf16, in_stride);
            }
        }
    });
}

template <class D, bool kUp>
void gemv_m(const LinearArgs& a, const D& dec, bool x_bf16, int64_t in_stride, float x_scale)
{
    const StagedGemvX<D> xs(a, x_bf16, in_stride, x_scale);
    switch (a.m) {
        case 1: gemv_as<D, 1, kUp>(a, dec, x_bf16, in_stride, xs); break;
        case 2: gemv_as<D, 2, kUp>(a, dec, x_bf16, in_stride, xs); break;
        case 3: gemv_as<D, 3, kUp>(a, dec, x_bf16, in_stride, xs); break;
        default: gemv_as<D, 4, kUp>(a, dec, x_bf16, in_stride, xs); break;
    }
}

// 8-bit codes in groups of a multiple of 16; e2m1 in groups of 16 or a multiple of 32 (rows of whole units)
template <class F>
bool gemv_applies(const LinearArgs& a)
{
    if (a.m < 1 || a.m > kGemvMaxM) { return false; }
    if constexpr (F::kBits == 8) {
        return a.group_size % 16 == 0;
    } else if constexpr (F::kBits == 4) {
        return (a.group_size == 16 || a.group_size % 32 == 0) && Table4<F>().exact;
    }
    return false;
}

template <class F>
bool try_gemv(const LinearArgs& a, bool x_bf16)
{
    if (!gemv_applies<F>(a)) { return false; }
    const int64_t in_stride = ceil_div(a.k, kLinearPad) * kLinearPad;
    if constexpr (F::kBits == 8) {
        const Placed8<F> dec;
        if (x_placed_ok(finite_amax(a, x_bf16, in_stride), Placed8<F>::kXExponent)) {
            gemv_m<Placed8<F>, false>(a, dec, x_bf16, in_stride, pow2f(Placed8<F>::kXExponent));
        } else {
            gemv_m<Placed8<F>, true>(a, dec, x_bf16, in_stride, 1.0f);
        }
        return true;
    } else if constexpr (F::kBits == 4) {
        const Table4<F> dec;
        gemv_m<Table4<F>, false>(a, dec, x_bf16, in_stride, 1.0f);
        return true;
    }
    return false;
}

}  // namespace

bool linear_gemv_avx2_applies(Format fmt, const LinearArgs& args)
{
    return dispatch_format(fmt, [&](auto f) { return gemv_applies<decltype(f)>(args); });
}

bool linear_gemv_avx2(Format fmt, const LinearArgs& args, bool x_bf16)
{
    return dispatch_format(fmt, [&](auto f) { return try_gemv<decltype(f)>(args, x_bf16); });
}

}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_AVX2_FMA
