// Kernel interface of ds_fpquant: argument structs, the format/dtype dispatch point, and the
// CPU and CUDA entry points. No torch includes (the torch binding is fp_quantize_binding.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fp_codec.h"
#include "fp_io.h"

namespace fpq {

// Row layout of SPEC 2 and 6: `rows` rows of `k` elements, cut into groups of `group_size`
// (the last group of a row may be shorter); codes packed per row, `row_bytes(k, G, bits)` bytes.
struct QuantizeArgs {
    const void* x = nullptr;              // (rows, k) elements of `dtype`, contiguous
    DType dtype = DType::kFloat32;
    int64_t rows = 0;
    int64_t k = 0;
    int64_t group_size = 1;
    const float* given_scales = nullptr;  // optional (rows, ceil(k/G)) caller-given scales
    uint8_t* codes = nullptr;             // (rows, row_bytes) output
    float* scales = nullptr;              // (rows, ceil(k/G)) output, ScaleMode::kFp32
    uint8_t* scale_bytes = nullptr;       // (rows, ceil(k/G)) E8M0 output, the E8M0 modes
    ScaleMode scale_mode = ScaleMode::kFp32;
    bool stochastic = false;              // SPEC 4 stochastic rounding instead of RNE
    uint64_t seed = 0;                    // Philox key
    uint64_t offset = 0;                  // Philox counter words 0-1; element index in words 2-3
};

struct DequantizeArgs {
    const uint8_t* codes = nullptr;  // (rows, row_bytes)
    const float* scales = nullptr;   // (rows, ceil(k/G))
    void* out = nullptr;             // (rows, k) elements of `dtype`
    DType dtype = DType::kFloat32;
    int64_t rows = 0;
    int64_t k = 0;
    int64_t group_size = 1;
};

// How LinearArgs::scales holds the group scales (SPEC 3): fp32 values, E8M0 bytes (3.2), or NVFP4's
// e4m3 codes times LinearArgs::tensor_scale (3.4).
enum class LinearScale : int { kFp32 = 0, kE8m0 = 1, kE4m3 = 2 };

// Rows of x for linear_cpu are zero-padded to a multiple of this many columns (a decode step's codes).
constexpr int64_t kLinearPad = 64;

// W (n, k) in the row layout (groups of group_size along k) for the linear and the row decoders. The
// scale of group g of row r is scales[(r / block_rows) * scale_cols + g]: block_rows = 1 for row groups,
// Br for 2-D blocks (Bc = group_size). weight_dtype: the dtype decode_rows_cpu writes (SPEC 5), and for
// the GEMV the weights' rounding; linear_cpu multiplies exact codes (SPEC 8).
struct LinearArgs {
    const void* x = nullptr;         // linear_cpu: (m, k) rows zero-padded to a multiple of kLinearPad
                                     // columns, bf16 (x_bf16) or fp32
    const uint8_t* codes = nullptr;  // (n, row_bytes)
    const void* scales = nullptr;    // see LinearScale
    LinearScale scale_kind = LinearScale::kFp32;
    int64_t block_rows = 1;
    int64_t scale_cols = 0;
    float tensor_scale = 1.0f;
    float* y = nullptr;              // (m, n) fp32 output
    DType weight_dtype = DType::kFloat32;
    int64_t m = 0;
    int64_t n = 0;
    int64_t k = 0;
    int64_t group_size = 1;
    int64_t row_bytes = 0;
};

// The fp32 scale at `index` of LinearArgs::scales (SPEC 3.1; 3.2: 2^(b - 127), byte 255 is NaN; 3.4 NVFP4:
// fl(decode_e4m3(c) * t), the NaN code gives NaN).
// The fp32 scale a scale byte stands for (LinearScale::kE8m0 or kE4m3).
FPQ_HD float linear_scale_of_byte(const LinearArgs& a, uint32_t byte)
{
    if (a.scale_kind == LinearScale::kE8m0) {
        return byte == kE8m0Nan ? bits_f32(kF32QuietNan) : pow2f(int(byte) - kE8m0Bias);
    }
    return mul_rn(decode<E4M3>(byte), a.tensor_scale);
}

FPQ_HD float linear_scale_of(const LinearArgs& a, int64_t index)
{
    if (a.scale_kind == LinearScale::kFp32) { return static_cast<const float*>(a.scales)[index]; }
    return linear_scale_of_byte(a, static_cast<const uint8_t*>(a.scales)[index]);
}

// The scale of group g of weight row n; 2-D blocks have one scale row per block_rows rows.
FPQ_HD float linear_scale_at(const LinearArgs& a, int64_t n, int64_t g)
{
    return linear_scale_of(a, (n / a.block_rows) * a.scale_cols + g);
}

// "e4m3, e5m2, ...": the formats of FPQ_FORMATS, for error messages.
inline std::string supported_formats()
{
    std::string out;
    for (int i = 0; i < kNumFormats; ++i) { out += std::string(i ? ", " : "") + kFormatNames[i]; }
    return out;
}

// The one dispatch point: calls fn(Traits{}) for the format, raises on anything else.
template <class Fn>
decltype(auto) dispatch_format(Format fmt, Fn&& fn)
{
#define FPQ_DISPATCH_CASE(Type, name, ebits, mbits, top) \
    case Format::k##Type: return fn(Type{});
    switch (fmt) {
        FPQ_FORMATS(FPQ_DISPATCH_CASE)
    }
#undef FPQ_DISPATCH_CASE
    throw std::invalid_argument("ds_fpquant: unknown format id " + std::to_string(int(fmt)) +
                                "; supported formats: " + supported_formats());
}

template <class Fn>
decltype(auto) dispatch_dtype(DType dtype, Fn&& fn)
{
    switch (dtype) {
        case DType::kFloat32: return fn(float{});
        case DType::kFloat16: return fn(Fp16{});
        case DType::kBFloat16: return fn(Bf16{});
    }
    throw std::invalid_argument("ds_fpquant: unknown dtype id " + std::to_string(int(dtype)) +
                                "; supported dtypes: float32, float16, bfloat16");
}

// CPU quantize (fp_quantize_cpu.cpp), OpenMP over groups; CPU dequantize (fp_dequantize_cpu.cpp).
void quantize_cpu(Format fmt, const QuantizeArgs& args);
void dequantize_cpu(Format fmt, const DequantizeArgs& args);
// The rows n0 .. n1-1 of W decoded into `out` ((n1 - n0, k) of weight_dtype; fp_dequantize_cpu.cpp).
void decode_rows_cpu(Format fmt, const LinearArgs& args, int64_t n0, int64_t n1, void* out);

// The fused linear (SPEC 8; fp_linear_cpu.cpp, its register-blocked kernel fp_linear_small_m_cpu.cpp):
// y (m, n) fp32 = sum_g s_g * (sum_{j in g} x_j * decode(q_j)), no bias; x bf16 when x_bf16, else fp32.
void linear_cpu(Format fmt, const LinearArgs& args, bool x_bf16);
// Which CPU kernel linear_cpu runs for these arguments (m, format, grouping) in this build (fp_linear_cpu.cpp), and
// its name for the binding: "avx512_register", "avx2_gemv", "avx2_gemm", "portable", "avx512_gemm", "amx_gemm".
enum class CpuLinearKernel : int {
    kAvx512Register = 0,
    kAvx2Gemv = 1,
    kAvx2Gemm = 2,
    kPortable = 3,
    kAvx512Gemm = 4,
    kAmxGemm = 5
};
CpuLinearKernel linear_cpu_kernel(Format fmt, const LinearArgs& args);
const char* linear_cpu_kernel_name(CpuLinearKernel kernel);
// The vector paths compiled into the CPU kernels (fp_kernels_cpu.h): fast_decode (AVX-512 F/BW/VL), bf16_dot
// (+ BF16), direct_bf16 (+ VBMI), avx2_fma (AVX2 + FMA: the AVX2 GEMV and GEMM); a DS_FPQUANT_CPU_ARCH=x86-64-v3
// build has avx2_fma only, a non-x86 build none.
std::vector<std::string> linear_cpu_paths();
// y = x @ W^T + bias for few rows of x on the GPU (the tensor-core GEMV of fp_gemv_kernels.cuh), SPEC 8.1's formula:
// exact codes, group partial sums (mma chains) times the group scale, fp32, bias added in fp32, one rounding to x's
// dtype; SPEC 8.2's tensor-core bound. `w` holds the weight as for linear_cpu (codes, scales and their layout, n, k,
// group_size, row_bytes), m <= kGemvMaxRows and weight_dtype = x's dtype; its x and y are not used.
constexpr int kGemvMaxRows = 16;
struct GemvArgs {
    LinearArgs w;
    const void* x = nullptr;     // (m, k) of w.weight_dtype, contiguous
    const void* bias = nullptr;  // optional (n,) of w.weight_dtype
    void* y = nullptr;           // (m, n) of w.weight_dtype
    float* workspace = nullptr;  // split-K partial sums (splits, m, n), set by the launcher from GemvPartials
    int* counters = nullptr;     // split-K arrival counters, one per 64-row tile, zero at the launch (the launcher's
                                 // per-(device, stream) workspace, fp_gemv_workspace.h)
};
// The GEMV's allocator of split-K partial sums (the caller's, e.g. torch's caching allocator on the launch stream):
// `bytes` of device memory, any content, valid until the launch has run (stream order).
using GemvPartials = std::function<void*(int64_t bytes)>;
// The split-K counters' workspace of (device, stream) as the launcher holds it: buffers created on the device so far
// (every stream), the counters of the stream's buffer (0: none yet) and its address.
struct GemvWorkspaceInfo {
    int64_t created = 0;
    int64_t capacity = 0;
    uintptr_t counters = 0;
};

// CUDA launchers (fp_quantize_cuda.cu); `stream` is a cudaStream_t.
void quantize_cuda(Format fmt, const QuantizeArgs& args, void* stream);
void dequantize_cuda(Format fmt, const DequantizeArgs& args, void* stream);
void linear_cuda(Format fmt, const GemvArgs& args, void* stream, const GemvPartials& partials);
GemvWorkspaceInfo gemv_workspace_info(int device, void* stream);

}  // namespace fpq
