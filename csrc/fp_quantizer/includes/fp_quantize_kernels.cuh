// The CUDA quantize and dequantize kernels of ds_fpquant and their launch geometry, without any launch
// syntax: the .cu file includes this for nvcc and adds the `<<<>>>` launch (fp_quantize_cuda.cu); the
// CPU emulation of the CUDA launch model (tests/unit/ops/fp_quantizer/emulation/) includes it as plain
// C++ and runs every block with one fiber per CUDA thread. The includer provides the CUDA names (nvcc's
// runtime headers, or the emulation header, which defines FPQ_CUDA_EMULATION) before including this.
// The fused GEMV (fp_gemv_kernels.cuh) builds on its chunk loads, code unpacking and launch constants.
//
// The element codec is the shared fp_codec.h; on sm_89+ e4m3/e5m2 encodes use the hardware fp8
// conversion (F2FP ... E4M3/E5M2) with the SPEC 3.3 specials handled around it. Scale and
// multiplier math use the IEEE round-to-nearest intrinsics, so --use_fast_math cannot change any
// result.
//
// Work split: a *team* of 1..32 lanes (a power of two, inside one warp) owns one group. Each lane
// handles chunks of 8 consecutive elements: 16-byte vector loads when the chunk is whole and
// aligned, scalar loads otherwise; 8 codes always pack into exactly `bits` bytes. The team's
// amax is a shuffle reduction; every lane then derives the same scale and multiplier.
#pragma once

#if !defined(__CUDACC__) && !defined(FPQ_CUDA_EMULATION)
#error "fp_quantize_kernels.cuh needs nvcc or the CUDA emulation header included first"
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "fp_quantize.h"

namespace fpq {
namespace cuda_kernels {


constexpr int kChunk = 8;             // elements per lane step; 8 codes = `bits` whole bytes
constexpr int kThreads = 256;         // threads per block
constexpr int64_t kMaxBlocks = 1 << 20;
constexpr unsigned kFullMask = 0xffffffffu;

template <class F>
constexpr bool kHardwareFp8 = std::is_same<F, E4M3>::value || std::is_same<F, E5M2>::value;

__device__ __forceinline__ bool aligned_to(const void* p, uintptr_t bytes)
{
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// ---- loads and stores of one chunk -------------------------------------------------------------
//
// kAligned (chosen once per launch by chunks_aligned, as TransformerEngine does): every chunk of kChunk
// elements starts on 16 bytes, so full chunks take one or two 16-byte vector accesses; otherwise every
// chunk goes element by element.

// Whether every chunk the kernels access at a group's start plus a multiple of kChunk elements is
// 16-byte aligned: the base pointer is, and row (k) and group (group_size) strides keep it so.
inline bool chunks_aligned(const void* base, int64_t k, int64_t group_size, int64_t elem_bytes)
{
    return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (k * elem_bytes) % 16 == 0 &&
           (group_size * elem_bytes) % 16 == 0 && (kChunk * elem_bytes) % 16 == 0;
}

template <bool kAligned, class T>
__device__ __forceinline__ void load_chunk(const T* p, int64_t n_valid, float (&v)[kChunk])
{
    if (kAligned && n_valid >= kChunk) {
        if constexpr (sizeof(T) == 2) {
            const uint4 raw = *reinterpret_cast<const uint4*>(p);
            const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) { v[j] = load_f32(T{h[j]}); }
        } else {
            const float4 lo = reinterpret_cast<const float4*>(p)[0];
            const float4 hi = reinterpret_cast<const float4*>(p)[1];
            v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
            v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) { v[j] = j < n_valid ? load_f32(p[j]) : 0.0f; }
}

template <bool kAligned, class T>
__device__ __forceinline__ void store_chunk(T* p, int64_t n_valid, const float (&v)[kChunk])
{
    if (kAligned && n_valid >= kChunk) {
        if constexpr (sizeof(T) == 2) {
            uint4 raw;
            uint16_t* h = reinterpret_cast<uint16_t*>(&raw);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) { h[j] = store_from_f32<T>(v[j]).bits; }
            *reinterpret_cast<uint4*>(p) = raw;
        } else {
            reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
        if (j < n_valid) { p[j] = store_from_f32<T>(v[j]); }
    }
}

// `kBytes` bytes of one chunk's codes: whole words when aligned, else byte by byte.
template <int kBytes>
__device__ __forceinline__ void store_bytes(uint8_t* dst, const uint8_t (&b)[kBytes], int n_valid)
{
    if (n_valid == kBytes && kBytes % 4 == 0 && aligned_to(dst, 4)) {
#pragma unroll
        for (int w = 0; w < kBytes / 4; ++w) {
            reinterpret_cast<uint32_t*>(dst)[w] = uint32_t(b[4 * w]) | uint32_t(b[4 * w + 1]) << 8 |
                                                  uint32_t(b[4 * w + 2]) << 16 | uint32_t(b[4 * w + 3]) << 24;
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < kBytes; ++i) {
        if (i < n_valid) { dst[i] = b[i]; }
    }
}

template <int kBytes>
__device__ __forceinline__ void load_bytes(const uint8_t* src, uint8_t (&b)[kBytes], int n_valid)
{
    if (n_valid == kBytes && kBytes % 16 == 0 && aligned_to(src, 16)) {
#pragma unroll
        for (int v = 0; v < kBytes / 16; ++v) {
            const uint4 q = reinterpret_cast<const uint4*>(src)[v];
            const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int i = 0; i < 16; ++i) { b[16 * v + i] = uint8_t(words[i / 4] >> (8 * (i % 4))); }
        }
        return;
    }
    if (n_valid == kBytes && kBytes % 4 == 0 && aligned_to(src, 4)) {
#pragma unroll
        for (int w = 0; w < kBytes / 4; ++w) {
            const uint32_t word = reinterpret_cast<const uint32_t*>(src)[w];
#pragma unroll
            for (int i = 0; i < 4; ++i) { b[4 * w + i] = uint8_t(word >> (8 * i)); }
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < kBytes; ++i) { b[i] = i < n_valid ? src[i] : uint8_t(0); }
}

// Bytes of chunk c that belong to a group of `nbytes` code bytes (the last chunk may be short).
template <int kBytes>
__device__ __forceinline__ int bytes_in_chunk(int64_t nbytes, int64_t c)
{
    const int64_t left = nbytes - c * kBytes;
    return left < kBytes ? int(left) : kBytes;
}

// ---- codec on a chunk --------------------------------------------------------------------------

// Codes of 8 elements. Padding elements (beyond the group) must be passed as 0 and give code 0.
template <class F>
__device__ __forceinline__ void encode_chunk(const float (&x)[kChunk], float r, uint32_t (&codes)[kChunk])
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if constexpr (kHardwareFp8<F>) {
        constexpr __nv_fp8_interpretation_t kInterp = std::is_same<F, E4M3>::value ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
        for (int j = 0; j < kChunk; j += 2) {
            const float2 v = make_float2(__fmul_rn(x[j], r), __fmul_rn(x[j + 1], r));
            const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, kInterp);
            codes[j] = pair & 0xffu;
            codes[j + 1] = pair >> 8;
        }
        // SPEC 3.3 around the hardware path: NaN -> S.NaN code, Inf -> Inf code (e5m2) or NaN.
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (!f32_is_finite(f32_bits(x[j]))) { codes[j] = encode_rne<F>(x[j], r); }
        }
    } else
#endif
    {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) { codes[j] = encode_rne<F>(x[j], r); }
    }
}

// Random words (SPEC 4) of the 8 elements whose flat indices start at `first`: they span at most
// three Philox blocks; the selection is unrolled so everything stays in registers.
__device__ __forceinline__ void chunk_random_words(uint64_t seed, uint64_t offset, int64_t first,
                                                   uint32_t (&u)[kChunk])
{
    const uint64_t block = uint64_t(first) >> 2;
    const int skip = int(first & 3);
    const PhiloxOut b0 = random_block(seed, offset, block);
    const PhiloxOut b1 = random_block(seed, offset, block + 1);
    const PhiloxOut b2 = skip ? random_block(seed, offset, block + 2) : b0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
        uint32_t word = 0;
#pragma unroll
        for (int t = 0; t < 12; ++t) {
            const uint32_t candidate = t < 4 ? b0.v[t] : (t < 8 ? b1.v[t - 4] : b2.v[t - 8]);
            word = (t == skip + j) ? candidate : word;
        }
        u[j] = word;
    }
}

template <class F>
__device__ __forceinline__ void encode_chunk_stochastic(const float (&x)[kChunk], float r,
                                                        const uint32_t (&u)[kChunk], uint32_t (&codes)[kChunk])
{
#pragma unroll
    for (int j = 0; j < kChunk; ++j) { codes[j] = encode_stochastic<F>(x[j], r, u[j]); }
}

// 8 codes -> `bits` bytes of the little-endian bit stream (SPEC 6).
template <class F>
__device__ __forceinline__ void pack_chunk(const uint32_t (&codes)[kChunk], uint8_t (&bytes)[F::kBits])
{
    using Unit = PackUnit<F::kBits>;
#pragma unroll
    for (int u = 0; u < kChunk / Unit::kCodes; ++u) {
        const uint32_t word = pack_unit<F::kBits>(codes + u * Unit::kCodes);
#pragma unroll
        for (int b = 0; b < Unit::kBytes; ++b) { bytes[u * Unit::kBytes + b] = uint8_t(word >> (8 * b)); }
    }
}

template <class F>
__device__ __forceinline__ void unpack_chunk(const uint8_t* bytes, uint32_t (&codes)[kChunk])
{
    using Unit = PackUnit<F::kBits>;
#pragma unroll
    for (int u = 0; u < kChunk / Unit::kCodes; ++u) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < Unit::kBytes; ++b) { word |= uint32_t(bytes[u * Unit::kBytes + b]) << (8 * b); }
#pragma unroll
        for (int j = 0; j < Unit::kCodes; ++j) { codes[u * Unit::kCodes + j] = unpack_code<F::kBits>(word, j); }
    }
}

// ---- group geometry ----------------------------------------------------------------------------

struct Geometry {
    int64_t k, group_size, n_groups, total, row_bytes, group_bytes;
};

template <int kBits>
inline Geometry make_geometry(int64_t rows, int64_t k, int64_t group_size)
{
    const int64_t n_groups = ceil_div(k, group_size);
    return {k, group_size, n_groups, rows * n_groups, row_bytes(k, group_size, kBits), group_bytes(group_size, kBits)};
}

// The warp-uniform loop over groups: each team of `1 << team_log2` lanes takes one group per step.
// Lanes of teams past the end stay in the loop (with no work) so the shuffles see the full warp.
struct TeamIndex {
    int lane, team_log2;
    int64_t first, stride;
};

__device__ __forceinline__ TeamIndex team_index(int team_log2)
{
    const int64_t thread = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t threads = int64_t(gridDim.x) * blockDim.x;
    return {int(threadIdx.x & ((1 << team_log2) - 1)), team_log2, thread >> team_log2, threads >> team_log2};
}

__device__ __forceinline__ uint32_t team_max(uint32_t v, int team_log2)
{
    for (int offset = (1 << team_log2) >> 1; offset > 0; offset >>= 1) {
        v = max(v, __shfl_xor_sync(kFullMask, v, offset));
    }
    return v;
}

// ---- kernels -----------------------------------------------------------------------------------

template <class F, class T, bool kStochastic, bool kAligned>
__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantizeArgs a, Geometry g, int team_log2)
{
    const TeamIndex t = team_index(team_log2);
    const T* x = static_cast<const T*>(a.x);
    // The warp's first team index decides the loop, so every lane of a warp runs the same trips.
    const int64_t warp_offset = (threadIdx.x & 31) >> team_log2;
    for (int64_t base = t.first - warp_offset; base < g.total; base += t.stride) {
        const int64_t index = base + warp_offset;
        const bool active = index < g.total;
        const int64_t row = active ? index / g.n_groups : 0;
        const int64_t start = active ? (index % g.n_groups) * g.group_size : 0;
        const int64_t len = active ? min(g.group_size, g.k - start) : 0;
        const T* xs = x + row * g.k + start;
        const int64_t n_chunks = ceil_div(len, kChunk);

        // 1. amax over the finite elements (fp32 bits of non-negative values order like values)
        uint32_t amax_bits = 0, nonfinite = 0;
        for (int64_t c = t.lane; c < n_chunks; c += (1 << team_log2)) {
            float v[kChunk];
            load_chunk<kAligned>(xs + c * kChunk, len - c * kChunk, v);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                const uint32_t ab = f32_bits(v[j]) & kF32AbsMask;
                const bool finite = ab < kF32InfBits;
                amax_bits = max(amax_bits, finite ? ab : 0u);
                nonfinite |= finite ? 0u : 1u;
            }
        }
        amax_bits = team_max(amax_bits, team_log2);
        nonfinite = team_max(nonfinite, team_log2);
        if (!active) { continue; }

        // 2. scale (SPEC 3.1 fp32, or 3.2 E8M0) and the multiplier from the stored scale; a format
        //    without a NaN code carries a NaN/Inf in the stored scale (SPEC 3.3)
        const GroupScale scale = group_scale<F>(amax_bits, nonfinite != 0u, a.scale_mode,
                                                a.given_scales ? a.given_scales + index : nullptr);
        const float r = scale.multiplier;
        if (t.lane == 0 && a.scale_mode != ScaleMode::kFp32) { a.scale_bytes[index] = scale.stored_byte; }
        if (t.lane == 0 && a.scale_mode == ScaleMode::kFp32) { a.scales[index] = scale.stored; }

        // 3. encode and pack; 8 codes take exactly `bits` bytes
        uint8_t* dst = a.codes + row * g.row_bytes + (index % g.n_groups) * g.group_bytes;
        const int64_t nbytes = group_bytes(len, F::kBits);
        for (int64_t c = t.lane; c < n_chunks; c += (1 << team_log2)) {
            float v[kChunk];
            load_chunk<kAligned>(xs + c * kChunk, len - c * kChunk, v);
            uint32_t codes[kChunk];
            if constexpr (kStochastic) {
                uint32_t u[kChunk];
                chunk_random_words(a.seed, a.offset, row * g.k + start + c * kChunk, u);
                encode_chunk_stochastic<F>(v, r, u, codes);
            } else {
                encode_chunk<F>(v, r, codes);
            }
            uint8_t bytes[F::kBits];
            pack_chunk<F>(codes, bytes);
            store_bytes<F::kBits>(dst + c * F::kBits, bytes, bytes_in_chunk<F::kBits>(nbytes, c));
        }
    }
}

template <class F, class T, bool kAligned>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(DequantizeArgs a, Geometry g, int team_log2)
{
    const TeamIndex t = team_index(team_log2);
    T* out = static_cast<T*>(a.out);
    for (int64_t index = t.first; index < g.total; index += t.stride) {
        const int64_t row = index / g.n_groups;
        const int64_t start = (index % g.n_groups) * g.group_size;
        const int64_t len = min(g.group_size, g.k - start);
        const uint8_t* src = a.codes + row * g.row_bytes + (index % g.n_groups) * g.group_bytes;
        T* dst = out + row * g.k + start;
        const float s = a.scales[index];
        const int64_t nbytes = group_bytes(len, F::kBits);
        for (int64_t c = t.lane; c < ceil_div(len, kChunk); c += (1 << team_log2)) {
            uint8_t bytes[F::kBits];
            load_bytes<F::kBits>(src + c * F::kBits, bytes, bytes_in_chunk<F::kBits>(nbytes, c));
            uint32_t codes[kChunk];
            unpack_chunk<F>(bytes, codes);
            float v[kChunk];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) { v[j] = __fmul_rn(decode<F>(codes[j]), s); }
            store_chunk<kAligned>(dst + c * kChunk, len - c * kChunk, v);
        }
    }
}

// ---- launch geometry ---------------------------------------------------------------------------

// Lanes per group: enough for one 8-element chunk each, a power of two, at most a warp.
inline int team_log2_for(int64_t group_size)
{
    int log2 = 0;
    while (log2 < 5 && (int64_t(kChunk) << log2) < group_size) { ++log2; }
    return log2;
}

// Blocks of kThreads threads to give every group a team, capped at max_blocks: beyond the cap the
// kernels' grid-stride loops take more groups per team (the emulation tests lower the cap).
inline dim3 grid_for(int64_t total_groups, int team_log2, int64_t max_blocks = kMaxBlocks)
{
    const int64_t threads = total_groups << team_log2;
    return dim3(unsigned(std::min<int64_t>(ceil_div(threads, kThreads), max_blocks)));
}

// The kernel instantiation for the format F, the element type T and the arguments.
template <class F, class T>
auto kernel_for(const QuantizeArgs& a)
{
    if (chunks_aligned(a.x, a.k, a.group_size, sizeof(T))) {
        return a.stochastic ? quantize_kernel<F, T, true, true> : quantize_kernel<F, T, false, true>;
    }
    return a.stochastic ? quantize_kernel<F, T, true, false> : quantize_kernel<F, T, false, false>;
}

template <class F, class T>
auto kernel_for(const DequantizeArgs& a)
{
    return chunks_aligned(a.out, a.k, a.group_size, sizeof(T)) ? dequantize_kernel<F, T, true>
                                                                 : dequantize_kernel<F, T, false>;
}

// The one place that picks a kernel and its launch shape: dispatches on (format, dtype) and calls
// launch(kernel, grid, block, geometry, team_log2) once, or not at all when there are no groups.
// fp_quantize_cuda.cu launches with <<<grid, block>>>; the emulation runs the same call on the CPU.
template <class Args, class Launch>
void launch_over_groups(Format fmt, const Args& args, int64_t max_blocks, Launch&& launch)
{
    dispatch_format(fmt, [&](auto f) {
        using F = decltype(f);
        dispatch_dtype(args.dtype, [&](auto tag) {
            const Geometry g = make_geometry<F::kBits>(args.rows, args.k, args.group_size);
            if (g.total == 0) { return; }
            const int team_log2 = team_log2_for(args.group_size);
            launch(kernel_for<F, decltype(tag)>(args), grid_for(g.total, team_log2, max_blocks), dim3(kThreads), g,
                   team_log2);
        });
    });
}

}  // namespace cuda_kernels
}  // namespace fpq
