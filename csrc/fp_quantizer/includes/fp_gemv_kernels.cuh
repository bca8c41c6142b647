// The CUDA fused dequantize-GEMV of ds_fpquant (y = x @ dequant(W)^T + bias for up to kGemvMaxRows rows of
// x) and its launch shape, without any launch syntax, like the quantize kernels (fp_quantize_kernels.cuh,
// whose chunk loads, code unpacking and launch constants it uses): fp_quantize_cuda.cu launches it with
// `<<<>>>`, the CPU emulation (tests/unit/ops/fp_quantizer/emulation/) runs it as plain C++. The includer
// provides the CUDA names first, as for fp_quantize_kernels.cuh.
//
// One warp per weight row n; the row's groups are cut into chunks of 16 codes (2 * bits bytes: one
// 16-byte load for fp8 when aligned), and lane l takes chunks l, l + 32, ... of the row in order, so a
// warp reads consecutive code bytes. A chunk never spans two groups (a short last chunk of a group is
// masked), so each chunk has one scale. Each weight is decode(q) * s rounded to x's dtype (SPEC 5);
// every row of x multiplies it in fp32 (one fma per product), the lanes' sums are added by a shuffle
// tree, and lane m writes y[m, n] = round(sum + bias).
#pragma once

#include <cstdint>

#include "fp_quantize_kernels.cuh"

namespace fpq {
namespace cuda_kernels {

// ---- kernel ------------------------------------------------------------------------------------

constexpr int kGemvChunk = 16;
constexpr int kGemvWarps = kThreads / 32;  // weight rows per block

template <class F, class T, bool kAligned>
__global__ void __launch_bounds__(kThreads) gemv_kernel(GemvArgs a)
{
    constexpr int kBytes = 2 * F::kBits;
    const int lane = int(threadIdx.x & 31);
    const int64_t row = int64_t(blockIdx.x) * kGemvWarps + int64_t(threadIdx.x >> 5);
    if (row >= a.w.n) { return; }  // the whole warp: rows are warp-uniform
    const int64_t k = a.w.k, group_size = a.w.group_size;
    const int64_t n_groups = ceil_div(k, group_size);
    const int64_t chunks_per_group = ceil_div(group_size, kGemvChunk);
    const int64_t full_group_bytes = group_bytes(group_size, F::kBits);
    const uint8_t* codes_row = a.w.codes + row * a.w.row_bytes;
    const T* x = static_cast<const T*>(a.x);
    const int rows_x = int(a.w.m);
    float acc[kGemvMaxRows];
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) { acc[m] = 0.0f; }

    for (int64_t f = lane; f < n_groups * chunks_per_group; f += 32) {
        const int64_t g = f / chunks_per_group, c = f % chunks_per_group;
        const int64_t glen = min(group_size, k - g * group_size);
        const int64_t n_valid = min(int64_t(kGemvChunk), glen - c * kGemvChunk);
        if (n_valid <= 0) { continue; }  // past the end of a short last group
        const float s = linear_scale_at(a.w, row, g);
        uint8_t bytes[kBytes];
        load_bytes<kBytes>(codes_row + g * full_group_bytes + c * kBytes, bytes,
                           bytes_in_chunk<kBytes>(group_bytes(glen, F::kBits), c));
        float w[2][kChunk];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            uint32_t codes[kChunk];
            unpack_chunk<F>(bytes + half * F::kBits, codes);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                w[half][j] = load_f32(store_from_f32<T>(__fmul_rn(decode<F>(codes[j]), s)));
            }
        }
        const int64_t k0 = g * group_size + c * kGemvChunk;
#pragma unroll
        for (int m = 0; m < kGemvMaxRows; ++m) {
            if (m >= rows_x) { break; }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float xv[kChunk];
                load_chunk<kAligned>(x + m * k + k0 + half * kChunk, n_valid - half * kChunk, xv);
#pragma unroll
                for (int j = 0; j < kChunk; ++j) {
                    if (half * kChunk + j < n_valid) { acc[m] = __fmaf_rn(w[half][j], xv[j], acc[m]); }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < kGemvMaxRows; ++m) {
        if (m >= rows_x) { break; }
        for (int offset = 16; offset > 0; offset >>= 1) {
            acc[m] = __fadd_rn(acc[m], __shfl_xor_sync(kFullMask, acc[m], offset));
        }
        if (lane == m) {
            const float bias = a.bias ? load_f32(static_cast<const T*>(a.bias)[row]) : 0.0f;
            static_cast<T*>(a.y)[m * a.w.n + row] = store_from_f32<T>(__fadd_rn(acc[m], bias));
        }
    }
}

// ---- launch geometry ---------------------------------------------------------------------------

// The GEMV's kernel and launch shape: one warp per weight row; calls launch(kernel, grid, block) once,
// or not at all without rows.
template <class Launch>
void launch_gemv(Format fmt, const GemvArgs& args, Launch&& launch)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.w.weight_dtype, [&](auto tag) {
            if (args.w.n == 0 || args.w.m == 0) { return; }
            using F = decltype(f);
            using T = decltype(tag);
            const bool aligned = chunks_aligned(args.x, args.w.k, args.w.group_size, sizeof(T));
            launch(aligned ? gemv_kernel<F, T, true> : gemv_kernel<F, T, false>,
                   dim3(unsigned(ceil_div(args.w.n, kGemvWarps))), dim3(kThreads));
        });
    });
}

}  // namespace cuda_kernels
}  // namespace fpq
