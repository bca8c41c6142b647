// The CPU linear: y = x @ dequant(W)^T for a row-grouped quantized W (SPEC 2, 5), the dispatch and the
// buffered path.
//
// The weight is decoded from its packed codes on the fly through the shared codec (fp_codec.h) and
// never exists whole in full precision:
//  * linear_cpu (small M, token-by-token decode), OpenMP over output features:
//    - bf16 x, groups of a multiple of 16 (AVX-512 BF16 + VBMI): the register path
//      (fp_linear_bf16_cpu.cpp). Each step turns 32 codes into 32 bf16 weights in a register and
//      vdpbf16ps multiplies them into fp32 accumulators.
//    - otherwise (here) blocks of kRowBlock rows are decoded (whole rows up to kMaxChunk columns) by the
//      row decoder (fp_row_decode_cpu.h) into a buffer in L2, which an FMA (fp32) or vdpbf16ps (bf16)
//      micro-kernel multiplies by every row of x.
//    Either way the codes stream from memory once per call whatever M is; fp32 accumulation.
//  * large M (prefill) is not here: ds_fpquant.linear.weight_only multiplies panels of rows that decode_rows_cpu
//    (fp_dequantize_cpu.cpp) decodes in the weight dtype, the one panel loop of every device.
// Each decoded weight is fl(decode(q) * s) rounded to the weight dtype (SPEC 5), the value that
// dequantize() gives in that dtype; only the order of the fp32 sums differs from F.linear. AVX-512 code
// paths where the compiler targets them (-march=native), portable loops otherwise. No torch includes.

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "fp_kernels_cpu.h"
#include "fp_row_decode_cpu.h"
#include "ieee_denormals.h"

namespace fpq {
namespace {

using namespace cpu_kernels;

constexpr int64_t kMaxChunk = 8192;  // columns decoded at a time: whole rows up to this (each row's codes
                                     // then stream in order, which the hardware prefetchers follow)
constexpr int64_t kRowBlock = 8;    // output features per work item
constexpr int64_t kTileM = 4;       // micro-kernel tile: kTileM rows of x ...
constexpr int64_t kTileN = 4;       // ... times kTileN rows of W

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

template <class F, class W>
void linear_rows(const LinearArgs& a)
{
    // Stage: the type of the decoded weights and of x in the micro-kernel (bf16 pairs with vdpbf16ps
    // when x is bf16 and the CPU has it, else fp32 with FMA)
    using Stage = std::conditional_t<kStagesBf16 && std::is_same_v<W, Bf16>, Bf16, float>;
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

}  // namespace

bool linear_cpu_stages_bf16() { return cpu_kernels::kStagesBf16; }

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
#if defined(FPQ_DIRECT_BF16)
    // bf16 x (multiplied in bf16 pairs): the register path where it applies
    if (args.weight_dtype == DType::kBFloat16 && cpu_kernels::linear_bf16_direct(fmt, args)) { return; }
#endif
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.weight_dtype, [&](auto w) { linear_rows<decltype(f), decltype(w)>(args); });
    });
}

}  // namespace fpq
