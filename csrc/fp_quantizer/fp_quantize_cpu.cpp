// The CPU quantize of ds_fpquant: the shared codec (fp_codec.h) in OpenMP loops over groups (RNE or
// stochastic codes, fp32 or E8M0 scales). Inner loops are branch-free so the compiler vectorizes them
// (check with -fopt-info-vec). The CPU dequantize is fp_dequantize_cpu.cpp. No torch includes.

#include <algorithm>
#include <vector>

#include "fp_quantize.h"
#include "ieee_denormals.h"

namespace fpq {
namespace {

// Codes of one group never need more scratch than min(G, k) plus one pack unit.
template <class F>
inline size_t scratch_size(int64_t group_size, int64_t k)
{
    return F::kBits == 8 ? 0 : size_t(std::min(group_size, k)) + PackUnit<F::kBits>::kCodes;
}

// Group g of a (rows, k) layout: row, first element, length, first code byte.
struct GroupSpan {
    int64_t row, start, len, byte_offset, index;
};

inline GroupSpan group_span(int64_t index, int64_t k, int64_t group_size, int64_t n_groups, int64_t row_bytes_,
                            int64_t full_group_bytes)
{
    const int64_t row = index / n_groups;
    const int64_t j = index % n_groups;
    const int64_t start = j * group_size;
    return {row, start, std::min(group_size, k - start), row * row_bytes_ + j * full_group_bytes, index};
}

// Largest finite |x| of the group, as fp32 bits: for non-negative floats the bit patterns are
// ordered like the values, so an integer max reduction (which vectorizes) gives the amax. The
// first pass takes the max over all elements; only a group holding NaN/Inf needs a second pass.
template <class T>
inline uint32_t group_amax_bits(const T* x, int64_t len, bool& nonfinite)
{
    uint32_t largest = 0;
    for (int64_t i = 0; i < len; ++i) {  // vectorized: amax
        largest = std::max(largest, f32_bits(load_f32(x[i])) & kF32AbsMask);
    }
    nonfinite = largest >= kF32InfBits;
    if (!nonfinite) { return largest; }
    uint32_t amax = 0;
    for (int64_t i = 0; i < len; ++i) {
        const uint32_t a = f32_bits(load_f32(x[i])) & kF32AbsMask;
        amax = std::max(amax, a < kF32InfBits ? a : 0u);
    }
    return amax;
}

// Random words of elements first .. first+len-1 (their flat indices), SPEC 4.
inline void fill_random_words(uint64_t seed, uint64_t offset, int64_t first, int64_t len, uint32_t* out)
{
    int64_t i = 0;
    while (i < len) {
        const uint64_t index = uint64_t(first + i);
        const PhiloxOut block = random_block(seed, offset, index >> 2);
        for (int j = int(index & 3); j < 4 && i < len; ++j, ++i) { out[i] = block.v[j]; }
    }
}

// Code of element i: RNE, or stochastic with the element's random word u[i].
template <class F, bool kStochastic>
inline uint32_t encode_one(float x, float r, const uint32_t* u, int64_t i)
{
    if constexpr (kStochastic) {
        return encode_stochastic<F>(x, r, u[i]);
    } else {
        return encode_rne<F>(x, r);
    }
}

template <class F, bool kStochastic, class T>
void encode_group(const T* __restrict x, int64_t len, float r, const uint32_t* __restrict u, uint8_t* __restrict dst,
                  uint32_t* __restrict scratch)
{
    if constexpr (F::kBits == 8) {
        for (int64_t i = 0; i < len; ++i) {  // vectorized: 8-bit encode
            dst[i] = uint8_t(encode_one<F, kStochastic>(load_f32(x[i]), r, u, i));
        }
    } else {
        using Unit = PackUnit<F::kBits>;
        const int64_t units = ceil_div(len, Unit::kCodes);
        for (int64_t i = 0; i < len; ++i) {  // vectorized: sub-byte encode
            scratch[i] = encode_one<F, kStochastic>(load_f32(x[i]), r, u, i);
        }
        for (int64_t i = len; i < units * Unit::kCodes; ++i) { scratch[i] = 0; }  // padding codes are 0
        const int64_t nbytes = group_bytes(len, F::kBits);
        for (int64_t u_ = 0; u_ < units; ++u_) {
            const uint32_t word = pack_unit<F::kBits>(scratch + u_ * Unit::kCodes);
            for (int b = 0; b < Unit::kBytes && u_ * Unit::kBytes + b < nbytes; ++b) {
                dst[u_ * Unit::kBytes + b] = uint8_t(word >> (8 * b));
            }
        }
    }
}

// Runs fn(group, codes_scratch, words_scratch) for every group of a (rows, k) layout, OpenMP over
// groups, with IEEE denormals and per-thread scratch (`words` holds min(G, k) random words if asked).
template <class F, class Fn>
void parallel_over_groups(int64_t rows, int64_t k, int64_t group_size, bool words, Fn&& fn)
{
    const int64_t n_groups = ceil_div(k, group_size);
    const int64_t total = rows * n_groups;
    const int64_t rb = row_bytes(k, group_size, F::kBits);
    const int64_t gb = group_bytes(group_size, F::kBits);
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        std::vector<uint32_t> scratch(scratch_size<F>(group_size, k));
        std::vector<uint32_t> random(words ? size_t(std::min(group_size, k)) : 0);
#pragma omp for schedule(static)
        for (int64_t index = 0; index < total; ++index) {
            fn(group_span(index, k, group_size, n_groups, rb, gb), scratch.data(), random.data());
        }
    }
}

template <class F, bool kStochastic, class T>
void quantize_rows(const QuantizeArgs& a)
{
    const T* x = static_cast<const T*>(a.x);
    parallel_over_groups<F>(a.rows, a.k, a.group_size, kStochastic, [&](const GroupSpan& g, uint32_t* scratch,
                                                                         uint32_t* words) {
        const T* xs = x + g.row * a.k + g.start;
        bool nonfinite = false;
        const uint32_t amax_bits = group_amax_bits(xs, g.len, nonfinite);
        if constexpr (kStochastic) { fill_random_words(a.seed, a.offset, g.row * a.k + g.start, g.len, words); }
        const GroupScale s = group_scale<F>(amax_bits, nonfinite, a.scale_mode,
                                            a.given_scales ? a.given_scales + g.index : nullptr);
        encode_group<F, kStochastic>(xs, g.len, s.multiplier, words, a.codes + g.byte_offset, scratch);
        if (a.scale_mode == ScaleMode::kFp32) {
            a.scales[g.index] = s.stored;
        } else {
            a.scale_bytes[g.index] = s.stored_byte;
        }
    });
}

}  // namespace

void quantize_cpu(Format fmt, const QuantizeArgs& args)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.dtype, [&](auto t) {
            if (args.stochastic) {
                quantize_rows<decltype(f), true, decltype(t)>(args);
            } else {
                quantize_rows<decltype(f), false, decltype(t)>(args);
            }
        });
    });
}

}  // namespace fpq
