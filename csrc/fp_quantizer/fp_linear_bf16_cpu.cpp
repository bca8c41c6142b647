// The bf16 register path of the CPU linear (FPQ_DIRECT_BF16: AVX-512 BF16 + VBMI, fp_kernels_cpu.h):
// y = x @ dequant(W)^T for bf16 x, up to kDirectMaxM rows of x and groups of a multiple of 16 codes
// (4-bit and 8-bit formats). OpenMP over output features; each step turns 32 codes into 32 bf16 weights
// in a register (DirectWeights, fp_bf16_weights_cpu.h) and vdpbf16ps multiplies them into fp32
// accumulators, with no buffer in between; the last < 32 columns go through the row decoder. The
// linear dispatch (fp_linear_cpu.cpp) tries this path first for bf16 x. Compiled to nothing where the
// target lacks those instructions. No torch includes.

#include <algorithm>
#include <vector>

#include "fp_bf16_weights_cpu.h"
#include "ieee_denormals.h"

#if defined(FPQ_DIRECT_BF16)
namespace fpq {
namespace cpu_kernels {
namespace {

constexpr int64_t kDirectMaxM = 8;  // rows of x the register path takes (one accumulator pair each)

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

}  // namespace

bool linear_bf16_direct(Format fmt, const LinearArgs& args)
{
    return dispatch_format(fmt, [&](auto f) { return try_linear_direct<decltype(f)>(args); });
}

}  // namespace cpu_kernels
}  // namespace fpq
#endif  // FPQ_DIRECT_BF16
