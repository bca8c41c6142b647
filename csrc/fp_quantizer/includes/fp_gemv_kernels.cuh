// The CUDA fused GEMV of ds_fpquant (SPEC 8.1: y = sum_g s_g * (sum_{j in g} x_j * decode(q_j)) + b, fp32, one
// rounding; up to kGemvMaxRows rows of x) and its launch shape, without any launch syntax, like the quantize
// kernels (fp_quantize_kernels.cuh, whose byte loads and launch constants it uses): fp_quantize_cuda.cu launches
// it with `<<<>>>`, the CPU emulation (tests/unit/ops/fp_quantizer/emulation/) runs it as plain C++. The includer
// provides the CUDA names first (nvcc's headers, or the emulation's).
//
// Work split. One warp per weight row n (8 rows per block of 256 threads). A row's codes are cut into chunks of
// ChunkDecode<F>::kCodes codes (16-byte loads for 8- and 4-bit codes); a chunk never spans two groups (a short
// last chunk of a group is masked), so each chunk has one scale. Lane l takes chunks l, l + 32, ... in order, so
// a warp reads consecutive code bytes.
//
// Per chunk: the codes are decoded straight to exact f16 pairs (no multiply, no rounding: every code of every
// format is an f16 value), each f16 widened to fp32 and multiplied by x in fp32 (one FFMA per weight and row of
// x) into the chunk's partial sum per row, and the partial sum times the group's scale is added to the lane's
// total (one FFMA per chunk and row). The lanes' totals are added by a shuffle tree and lane m writes
// y[m, n] = round(total + bias).
//
// x is staged once per block in shared memory, as fp32, for kRows rows (rows >= m are zeros), a tile of chunks at
// a time, each chunk's values in the order its decoder produces weights (ChunkDecode<F>::order), padded by 16
// bytes per chunk (no bank conflicts of the lanes' 16-byte reads); with it the group scales of the block's rows
// for the tile, decoded to fp32 (SPEC 3), so the steady-state loop reads one scale per chunk from shared memory.
//
// kFull (chosen per launch by gemv_full): G is a multiple of the chunk, G / chunk a power of two, and the code
// rows are aligned for the vector loads: the steady-state loop has no division and no masks. Otherwise (ragged
// groups, misaligned codes) the same loop masks each chunk (32-bit division for its group).
#pragma once

#include <cstdint>
#include <cstring>

#include "fp_quantize_kernels.cuh"

#ifndef FPQ_DYNAMIC_SHARED  // the emulation brings its own
#define FPQ_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace fpq {
namespace cuda_kernels {

constexpr int kGemvWarps = kThreads / 32;     // weight rows per block
constexpr int kGemvSharedBytes = 48 << 10;    // shared memory of one tile (the default limit of a launch)

// ---- f16 pairs ---------------------------------------------------------------------------------

__device__ __forceinline__ float f16_lo_to_f32(uint32_t h)
{
    __half2 v;
    memcpy(&v, &h, 4);
    return __low2float(v);
}

__device__ __forceinline__ float f16_hi_to_f32(uint32_t h)
{
    __half2 v;
    memcpy(&v, &h, 4);
    return __high2float(v);
}

// a * b per f16 half, RN (HMUL2): exact when b holds powers of two and the products are f16 values.
__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, uint32_t b)
{
    __half2 x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    const __half2 r = __hmul2(x, y);
    uint32_t out;
    memcpy(&out, &r, 4);
    return out;
}

// prmt.b32 (default mode) with a selector whose nibbles have bit 3 clear (no sign replication): CUDA's
// __byte_perm masks a selector that is not a constant with 0x7777 first (one LOP3 more); the emulation's
// __byte_perm reports a nibble with bit 3 set.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector)
{
#if defined(__CUDA_ARCH__) && !defined(FPQ_CUDA_EMULATION)
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
#else
    return __byte_perm(a, b, selector);
#endif
}

// ---- chunk decoders: codes -> exact f16 pairs ----------------------------------------------------
//
// ChunkDecode<F>: kCodes codes per chunk (kWords 32-bit words of the little-endian code stream, SPEC 6),
// decode(words, h) writes kCodes / 2 f16 pairs, pair p holding the codes order(2p) (low half) and order(2p + 1)
// (high half) of the chunk.

// The generic decoder: each code's sign and magnitude bits placed in an f16 (value decode(q) * 2^(bias - 15),
// subnormals included: f16's exponent is wider than the format's), then one HMUL2 by 2^(15 - bias) per pair,
// exact. For FP6 (e3m2, e2m3) and e4m7 (all finite codes).
template <class F>
struct PlacedDecode {
    static constexpr int kBits = F::kBits;
    static constexpr int kMag = kBits - 1;
    static constexpr int kBias = F::kBias;
    static constexpr uint32_t kScale = uint32_t(15 - kBias + 15) << 10;  // f16 2^(15 - bias)
    __device__ __forceinline__ static uint32_t f16_bits(uint32_t code)
    {
        return (code >> kMag) << 15 | (code & ((1u << kMag) - 1)) << (10 - F::kMbits);
    }
};

template <class F, class Enable = void>
struct ChunkDecode {
    static_assert(!F::kHasNan && !F::kHasInf, "the placed decoder has no NaN / Inf codes");
    static constexpr int kCodes = 16;
    static constexpr int kWords = kCodes * F::kBits / 32;
    __device__ __forceinline__ static constexpr int order(int slot) { return slot; }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kCodes / 2])
    {
        using P = PlacedDecode<F>;
#pragma unroll
        for (int p = 0; p < kCodes / 2; ++p) {
            uint32_t code[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int bit = (2 * p + i) * F::kBits, word = bit / 32, shift = bit % 32;
                uint64_t pair = w[word];
                if (word + 1 < kWords) { pair |= uint64_t(w[word + 1]) << 32; }
                code[i] = uint32_t(pair >> shift) & ((1u << F::kBits) - 1);
            }
            h[p] = f16x2_mul(P::f16_bits(code[0]) | P::f16_bits(code[1]) << 16, P::kScale | P::kScale << 16);
        }
    }
};

// e5m2 is the upper byte of an f16 (Inf and NaN included): one byte permute per pair.
template <>
struct ChunkDecode<E5M2> {
    static constexpr int kCodes = 16;
    static constexpr int kWords = 4;
    __device__ __forceinline__ static constexpr int order(int slot) { return slot; }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kCodes / 2])
    {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
            h[2 * i] = __byte_perm(w[i], 0u, 0x1404);      // bytes [0, code 4i, 0, code 4i+1]
            h[2 * i + 1] = __byte_perm(w[i], 0u, 0x3424);  // bytes [0, code 4i+2, 0, code 4i+3]
        }
    }
};

// e4m3: the sm_89+ conversion cvt.rn.f16x2.e4m3x2 (exact, NaN to NaN), two codes per instruction; without it
// (the emulation's software build) the codec's decode, exactly representable in f16.
template <>
struct ChunkDecode<E4M3> {
    static constexpr int kCodes = 16;
    static constexpr int kWords = 4;
    __device__ __forceinline__ static constexpr int order(int slot) { return slot; }
    __device__ __forceinline__ static uint32_t pair(uint32_t two_codes)
    {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_codes), __NV_E4M3);
        return uint32_t(r.x) | uint32_t(r.y) << 16;
#else
        return uint32_t(f32_to_fp16_bits(fpq::decode<E4M3>(two_codes & 0xffu))) |
               uint32_t(f32_to_fp16_bits(fpq::decode<E4M3>(two_codes >> 8))) << 16;
#endif
    }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kCodes / 2])
    {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
            h[2 * i] = pair(w[i] & 0xffffu);
            h[2 * i + 1] = pair(w[i] >> 16);
        }
    }
};

// e2m1: a byte-permute table in registers. A word holds 8 codes (code j in bits 4j..4j+3). The table is the f16
// high bytes of the 8 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6); a selector word with two magnitudes at nibbles 1
// and 3 and zeros at nibbles 0 and 2 (table byte 0 is 0x00) gives an f16 pair of magnitudes in one PRMT. The
// pairs are codes 4 apart, (1, 5), (3, 7), (0, 4), (2, 6): their sign bits are 16 apart in the word, so one shift
// (none for (3, 7)) puts both at bits 15 and 31, or'ed in by one LOP3. Odd codes' magnitudes are the high
// nibbles of w & 0x70707070, even codes' those of (w << 4) & 0x70707070; one PRMT picks two of them.
template <>
struct ChunkDecode<E2M1> {
    static constexpr int kCodes = 32;
    static constexpr int kWords = 4;
    static constexpr uint32_t kTableLo = 0x3e3c3800u;  // f16 high bytes of 1.5, 1, 0.5, 0
    static constexpr uint32_t kTableHi = 0x46444240u;  // 6, 4, 3, 2
    static constexpr uint32_t kSigns = 0x80008000u;
    // per word: pairs (1, 5), (3, 7), (0, 4), (2, 6)
    __device__ __forceinline__ static constexpr int order(int slot)
    {
        return (slot & ~7) + ((slot & 7) < 4 ? 1 : 0) + 4 * (slot & 1) + 2 * ((slot >> 1) & 1);
    }
    __device__ __forceinline__ static uint32_t pair(uint32_t selector, uint32_t signs)
    {
        return prmt(kTableLo, kTableHi, selector) | (signs & kSigns);
    }
    __device__ __forceinline__ static void decode(const uint32_t (&w)[kWords], uint32_t (&h)[kCodes / 2])
    {
#pragma unroll
        for (int i = 0; i < kWords; ++i) {
            const uint32_t odd = w[i] & 0x70707070u, shifted = w[i] << 4, even = shifted & 0x70707070u;
            h[4 * i] = pair(__byte_perm(odd, 0u, 0x4420), w[i] << 8);       // codes 1, 5 (bytes 0 and 2)
            h[4 * i + 1] = pair(__byte_perm(odd, 0u, 0x4431), w[i]);        // codes 3, 7 (bytes 1 and 3)
            h[4 * i + 2] = pair(__byte_perm(even, 0u, 0x4420), w[i] << 12);  // codes 0, 4
            h[4 * i + 3] = pair(__byte_perm(even, 0u, 0x4431), shifted);     // codes 2, 6
        }
    }
};

// ---- chunk loads ---------------------------------------------------------------------------------

// The chunk's code words: vector loads (kFull: whole chunks at their natural alignment), else bytes (zeros past
// the group's bytes) with the codes past n_valid cleared.
template <class F, bool kFull>
__device__ __forceinline__ void load_chunk_words(const uint8_t* src, int n_bytes, int n_valid,
                                                 uint32_t (&w)[ChunkDecode<F>::kWords])
{
    constexpr int kWords = ChunkDecode<F>::kWords;
    if constexpr (kFull) {
        if constexpr (kWords % 4 == 0) {
#pragma unroll
            for (int v = 0; v < kWords / 4; ++v) {
                const uint4 q = reinterpret_cast<const uint4*>(src)[v];
                w[4 * v] = q.x, w[4 * v + 1] = q.y, w[4 * v + 2] = q.z, w[4 * v + 3] = q.w;
            }
        } else if constexpr (kWords % 2 == 0) {
#pragma unroll
            for (int v = 0; v < kWords / 2; ++v) {
                const uint2 q = reinterpret_cast<const uint2*>(src)[v];
                w[2 * v] = q.x, w[2 * v + 1] = q.y;
            }
        } else {
#pragma unroll
            for (int v = 0; v < kWords; ++v) { w[v] = reinterpret_cast<const uint32_t*>(src)[v]; }
        }
        (void)n_bytes, (void)n_valid;
    } else {
#pragma unroll
        for (int v = 0; v < kWords; ++v) {
            uint32_t word = 0;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int i = 4 * v + b;
                word |= (i < n_bytes ? uint32_t(src[i]) : 0u) << (8 * b);
            }
            w[v] = word;
        }
        // clear the bits of codes at n_valid and beyond
#pragma unroll
        for (int v = 0; v < kWords; ++v) {
            const int bit0 = 32 * v, valid_bits = n_valid * F::kBits;
            const uint32_t keep = valid_bits >= bit0 + 32 ? 0xffffffffu
                                  : valid_bits <= bit0 ? 0u
                                                       : (1u << (valid_bits - bit0)) - 1u;
            w[v] &= keep;
        }
    }
}

// ---- kernel ------------------------------------------------------------------------------------

// Shared memory of one tile: x for kRows rows, each chunk's kCodes values padded by one 16-byte quad (the
// lanes' 16-byte reads of consecutive chunks then fall in distinct banks), and the block's rows' group scales
// of the tile (fp32, one per chunk slot). kTile chunks (a multiple of 32: whole warp steps) fit in
// kGemvSharedBytes.
template <class F, int kRows>
struct GemvTile {
    static constexpr int kCodes = ChunkDecode<F>::kCodes;
    static constexpr int kStride = kCodes + 4;  // floats per chunk of one row of x
    static constexpr int kChunks = kGemvSharedBytes / (4 * (kRows * kStride + kGemvWarps)) / 32 * 32;
    static constexpr int kXFloats = kRows * kChunks * kStride;
    static constexpr int kBytes = 4 * (kXFloats + kGemvWarps * kChunks);
    static_assert(kChunks >= 32, "a tile holds at least one warp step");
};

// The shared-memory slot of chunk-local code `pos`: its place in the decoder's order.
template <class F>
__device__ __forceinline__ int gemv_slot(int pos)
{
    using D = ChunkDecode<F>;
    int s = 0;
#pragma unroll
    for (int i = 0; i < D::kCodes; ++i) { s = D::order(i) == pos ? i : s; }
    return s;
}

template <class F, class T, int kRows, bool kFull>
__global__ void __launch_bounds__(kThreads) gemv_kernel(GemvArgs a)
{
    using D = ChunkDecode<F>;
    using Tile = GemvTile<F, kRows>;
    constexpr int kCodes = D::kCodes;
    constexpr int kChunkBytes = kCodes * F::kBits / 8;
    constexpr int kQuads = kCodes / 4;
    constexpr int kTile = Tile::kChunks;
    static_assert(kThreads % kCodes == 0, "each thread stages one position of every chunk");
    FPQ_DYNAMIC_SHARED(float4, shared4);
    float* xs = reinterpret_cast<float*>(shared4);
    float* scales = xs + Tile::kXFloats;  // [warp][tile chunk]

    const int lane = int(threadIdx.x & 31), warp = int(threadIdx.x >> 5);
    const int64_t row0 = int64_t(blockIdx.x) * kGemvWarps;
    const int64_t row = row0 + warp;
    const bool has_row = row < a.w.n;  // warp-uniform; every thread stays for the block's barriers
    const int k = int(a.w.k), group_size = int(a.w.group_size), rows_x = int(a.w.m);
    // 32-bit index arithmetic throughout (launch_gemv: n, k < 2^31); no 64-bit division in the kernel
    const int n_groups = k / group_size + (k % group_size != 0);
    const int chunks_per_group = group_size / kCodes + (group_size % kCodes != 0);
    const int n_chunks = n_groups * chunks_per_group;
    const int64_t full_group_bytes = group_bytes(a.w.group_size, F::kBits);
    const uint8_t* codes_row = a.w.codes + (has_row ? row : 0) * a.w.row_bytes;
    const T* x = static_cast<const T*>(a.x);
    const int pos = int(threadIdx.x) % kCodes, slot = gemv_slot<F>(pos);  // this thread's staging position

    float total[kRows];
#pragma unroll
    for (int m = 0; m < kRows; ++m) { total[m] = 0.0f; }

    for (int f0 = 0; f0 < n_chunks; f0 += kTile) {
        // 1. stage x for chunks f0 .. f0 + kTile - 1 (zeros past the row, past a group, for rows >= m), and
        //    the scale of every chunk of the block's rows (SPEC 3; 32-bit division: n, k < 2^31)
#pragma unroll 1
        for (int i = int(threadIdx.x); i < kTile * kCodes; i += kThreads) {
            const int t = i / kCodes, f = f0 + t;
            int col = 0;
            bool valid = false;
            if (f < n_chunks) {
                const int g = f / chunks_per_group, c = f - g * chunks_per_group;
                valid = c * kCodes + pos < min(group_size, k - g * group_size);
                col = g * group_size + c * kCodes + pos;
            }
#pragma unroll
            for (int m = 0; m < kRows; ++m) {
                xs[(m * kTile + t) * Tile::kStride + slot] =
                    valid && m < rows_x ? load_f32(x[int64_t(m) * k + col]) : 0.0f;
            }
        }
#pragma unroll 1
        for (int i = int(threadIdx.x); i < kGemvWarps * kTile; i += kThreads) {
            const int w = i / kTile, t = i % kTile, f = f0 + t;
            const int64_t r = row0 + w;
            float s = 0.0f;
            if (f < n_chunks && r < a.w.n) {
                s = linear_scale_of(a.w, int64_t(int(r) / int(a.w.block_rows)) * a.w.scale_cols + f / chunks_per_group);
            }
            scales[i] = s;
        }
        __syncthreads();

        // 2. the warp's row over the tile: lane l takes chunks f0 + l, f0 + l + 32, ...
        if (has_row) {
            const int f_end = min(n_chunks, f0 + kTile);
            const uint8_t* src = codes_row + int64_t(f0 + lane) * kChunkBytes;  // kFull: chunks are contiguous
#pragma unroll 1
            for (int f = f0 + lane; f < f_end; f += 32) {
                const int t = f - f0;
                int n_valid = kCodes, n_bytes = kChunkBytes;
                if constexpr (!kFull) {
                    const int g = f / chunks_per_group, c = f - g * chunks_per_group;
                    const int glen = min(group_size, k - g * group_size);
                    n_valid = min(kCodes, glen - c * kCodes);
                    n_bytes = int(min(int64_t(kChunkBytes), group_bytes(glen, F::kBits) - int64_t(c) * kChunkBytes));
                    src = codes_row + g * full_group_bytes + int64_t(c) * kChunkBytes;
                }
                uint32_t words[D::kWords];
                load_chunk_words<F, kFull>(src, n_bytes, n_valid, words);
                uint32_t h[kCodes / 2];
                D::decode(words, h);

                const float* xt = xs + t * Tile::kStride;
                float part[kRows];
#pragma unroll
                for (int m = 0; m < kRows; ++m) { part[m] = 0.0f; }
#pragma unroll
                for (int q = 0; q < kQuads; ++q) {
                    const float w0 = f16_lo_to_f32(h[2 * q]), w1 = f16_hi_to_f32(h[2 * q]);
                    const float w2 = f16_lo_to_f32(h[2 * q + 1]), w3 = f16_hi_to_f32(h[2 * q + 1]);
#pragma unroll
                    for (int m = 0; m < kRows; ++m) {
                        const float4 xv = *reinterpret_cast<const float4*>(xt + m * kTile * Tile::kStride + 4 * q);
                        part[m] = __fmaf_rn(xv.x, w0, part[m]);
                        part[m] = __fmaf_rn(xv.y, w1, part[m]);
                        part[m] = __fmaf_rn(xv.z, w2, part[m]);
                        part[m] = __fmaf_rn(xv.w, w3, part[m]);
                    }
                }
                const float s = scales[warp * kTile + t];  // the chunk's group scale, times its partial sums
#pragma unroll
                for (int m = 0; m < kRows; ++m) { total[m] = __fmaf_rn(s, part[m], total[m]); }
                if constexpr (kFull) { src += 32 * kChunkBytes; }
            }
        }
        __syncthreads();  // the tile is read by every warp before the next one overwrites it
    }

    if (!has_row) { return; }
    // the row again from the block and warp indices (not kept live through the loops: no spill)
    const int out_row = int(blockIdx.x) * kGemvWarps + int(threadIdx.x >> 5);
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
        for (int offset = 16; offset > 0; offset >>= 1) {
            total[m] = __fadd_rn(total[m], __shfl_xor_sync(kFullMask, total[m], offset));
        }
        if (lane == m && m < rows_x) {
            const float bias = a.bias ? load_f32(static_cast<const T*>(a.bias)[out_row]) : 0.0f;
            static_cast<T*>(a.y)[int64_t(m) * a.w.n + out_row] = store_from_f32<T>(__fadd_rn(total[m], bias));
        }
    }
}

// ---- launch geometry ---------------------------------------------------------------------------

// Whether the launch can take the kFull kernel: chunks never cross a group and tile it in a power of two,
// and every chunk's code bytes are aligned for its vector load.
template <class F>
inline bool gemv_full(const GemvArgs& a)
{
    constexpr int kCodes = ChunkDecode<F>::kCodes;
    constexpr int64_t kChunkBytes = kCodes * F::kBits / 8;
    constexpr int64_t kAlign = kChunkBytes % 16 == 0 ? 16 : (kChunkBytes % 8 == 0 ? 8 : 4);
    const int64_t cpg = a.w.group_size / kCodes;
    return a.w.group_size % kCodes == 0 && (cpg & (cpg - 1)) == 0 && a.w.k % a.w.group_size == 0 &&
           reinterpret_cast<uintptr_t>(a.w.codes) % kAlign == 0 && a.w.row_bytes % kAlign == 0;
}

// Rows of x an instantiation is built for: m rounded up to 1, 2, 4 or 8 (the extra rows are zeros in shared
// memory and are not written).
inline int gemv_rows_for(int64_t m) { return m <= 1 ? 1 : m <= 2 ? 2 : m <= 4 ? 4 : 8; }

// The GEMV's kernel and launch shape: one warp per weight row, 8 rows per block, shared memory for one x tile;
// calls launch(kernel, grid, block, shared_bytes) once, or not at all without rows. Shapes the kernel's int
// indices cannot hold (k or a row's chunks >= 2^31) raise.
template <class Launch>
void launch_gemv(Format fmt, const GemvArgs& args, Launch&& launch)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.w.weight_dtype, [&](auto tag) {
            if (args.w.n == 0 || args.w.m == 0) { return; }
            if (args.w.k >= (int64_t(1) << 31) || args.w.n >= (int64_t(1) << 31) || args.w.m > kGemvMaxRows) {
                throw std::invalid_argument("ds_fpquant: the CUDA GEMV takes k, n < 2^31 and m <= " +
                                            std::to_string(kGemvMaxRows));
            }
            using F = decltype(f);
            using T = decltype(tag);
            const bool full = gemv_full<F>(args);
            const dim3 grid(unsigned(ceil_div(args.w.n, kGemvWarps))), block(kThreads);
            auto go = [&](auto rows) {
                constexpr int kRows = decltype(rows)::value;
                const int shared = GemvTile<F, kRows>::kBytes;
                if (full) {
                    launch(gemv_kernel<F, T, kRows, true>, grid, block, shared);
                } else {
                    launch(gemv_kernel<F, T, kRows, false>, grid, block, shared);
                }
            };
            switch (gemv_rows_for(args.w.m)) {
                case 1: go(std::integral_constant<int, 1>{}); break;
                case 2: go(std::integral_constant<int, 2>{}); break;
                case 4: go(std::integral_constant<int, 4>{}); break;
                default: go(std::integral_constant<int, 8>{}); break;
            }
        });
    });
}

}  // namespace cuda_kernels
}  // namespace fpq
