// The CPU dequantize: rows of W decoded in the weight dtype, fl(decode(q) * s) rounded to it (SPEC 5),
// OpenMP over rows. decode_rows_cpu writes rows n0 .. n1-1 of a LinearArgs weight (the panels of the
// large-m linear; any scale layout of SPEC 3), dequantize_cpu the (rows, k) layout with fp32 scales.
// Each row goes through the row decoder (fp_row_decode_cpu.h), or for bf16 rows with groups of a
// multiple of 32 codes the register path's 32-wide steps (fp_bf16_weights_cpu.h), stored. No torch
// includes.

#include <algorithm>
#include <type_traits>
#include <vector>

#include "fp_bf16_weights_cpu.h"
#include "fp_row_decode_cpu.h"
#include "ieee_denormals.h"

namespace fpq {
namespace {

using cpu_kernels::decode_row_span;
using cpu_kernels::Decoder;
#if defined(FPQ_DIRECT_BF16)
using cpu_kernels::DirectWeights;
#endif

template <class F, class W>
void decode_rows(const LinearArgs& a, int64_t n0, int64_t n1, void* out)
{
    W* dst = static_cast<W*>(out);
    const Decoder<F> fast;
#pragma omp parallel
    {
        const ScopedIeeeDenormals ieee;
        std::vector<uint32_t> codes(size_t(std::min(a.k, std::max<int64_t>(a.group_size, 1)) + 8));
#if defined(FPQ_DIRECT_BF16)
        // bf16 rows with groups of a multiple of 32 codes: the register path's 32-wide steps, stored
        DirectWeights<F> weights{a, fast};
        constexpr bool kDirect = std::is_same_v<W, Bf16> && (F::kBits == 4 || F::kBits == 8);
        const bool direct = kDirect && a.group_size % 32 == 0;
#endif
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; ++n) {
            W* row = dst + (n - n0) * a.k;
#if defined(FPQ_DIRECT_BF16)
            if constexpr (kDirect) {
                if (direct) {
                    const int64_t full = a.k / 32 * 32;
                    weights.start_row(n);
                    for (int64_t start = 0; start < full; start += a.group_size) {
                        weights.enter_group(start / a.group_size);
                        const int64_t end = std::min(full, start + a.group_size);
                        for (int64_t c = start; c < end; c += 32) {
                            _mm512_storeu_si512(row + c, weights.uniform32(c));
                        }
                    }
                    if (full < a.k) { decode_row_span<F, W, W>(a, fast, n, full, a.k, row + full, codes.data()); }
                    continue;
                }
            }
#endif
            decode_row_span<F, W, W>(a, fast, n, 0, a.k, row, codes.data());
        }
    }
}

}  // namespace

void decode_rows_cpu(Format fmt, const LinearArgs& args, int64_t n0, int64_t n1, void* out)
{
    dispatch_format(fmt, [&](auto f) {
        dispatch_dtype(args.weight_dtype, [&](auto w) { decode_rows<decltype(f), decltype(w)>(args, n0, n1, out); });
    });
}

// Dequantize is the fused linear's decoder writing whole rows: the same fl(decode(q) * s) rounded to
// the output dtype (SPEC 5), with its AVX-512 paths.
void dequantize_cpu(Format fmt, const DequantizeArgs& args)
{
    LinearArgs rows;
    rows.codes = args.codes;
    rows.scales = args.scales;
    rows.scale_kind = LinearScale::kFp32;
    rows.scale_cols = ceil_div(args.k, args.group_size);
    rows.weight_dtype = args.dtype;
    rows.n = args.rows;
    rows.k = args.k;
    rows.group_size = args.group_size;
    rows.row_bytes = row_bytes(args.k, args.group_size, dispatch_format(fmt, [](auto f) { return decltype(f)::kBits; }));
    decode_rows_cpu(fmt, rows, 0, args.rows, args.out);
}

}  // namespace fpq
