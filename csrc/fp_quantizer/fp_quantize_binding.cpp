// Torch binding of ds_fpquant: argument checks, output allocation, device guard and stream,
// then the CPU kernels or (when built with FPQ_WITH_CUDA) the CUDA launchers.

#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "fp_peak_cpu.h"
#include "fp_quantize.h"

#if defined(FPQ_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

struct FormatEntry {
    const char* name;
    fpq::Format id;
};
#define FPQ_FORMAT_ENTRY(Type, name, ebits, mbits, top) {name, fpq::Format::k##Type},
constexpr FormatEntry kFormats[] = {FPQ_FORMATS(FPQ_FORMAT_ENTRY)};
#undef FPQ_FORMAT_ENTRY

fpq::Format parse_format(const std::string& name)
{
    for (const auto& entry : kFormats) {
        if (name == entry.name) { return entry.id; }
    }
    TORCH_CHECK_VALUE(false, "fmt='", name, "' is not supported; allowed: ", fpq::supported_formats());
}

fpq::DType parse_dtype(at::ScalarType t, const char* what)
{
    switch (t) {
        case at::kFloat: return fpq::DType::kFloat32;
        case at::kHalf: return fpq::DType::kFloat16;
        case at::kBFloat16: return fpq::DType::kBFloat16;
        default: break;
    }
    TORCH_CHECK_TYPE(false, what, ".dtype=", t, " is not supported; allowed: torch.float32, torch.float16, "
                     "torch.bfloat16");
}

int bits_of(fpq::Format fmt)
{
    return fpq::dispatch_format(fmt, [](auto f) { return decltype(f)::kBits; });
}

void check_device(const at::Tensor& t, const at::Tensor& ref, const char* what)
{
    TORCH_CHECK_VALUE(t.device() == ref.device(), what, " is on ", t.device(), "; expected ", ref.device());
}

// A group never spans rows: G >= k means one group of k per row (same layout), and keeps the
// group arithmetic far from int64 overflow.
int64_t effective_group_size(int64_t group_size, int64_t k) { return std::min(group_size, std::max<int64_t>(k, 1)); }

// Runs the kernel for `args` on the tensor's device: the CPU kernels, or the CUDA launcher on
// the current stream under a device guard.
template <class Args>
void launch(fpq::Format fmt, const Args& args, const at::Tensor& t)
{
    constexpr bool kQuantize = std::is_same_v<Args, fpq::QuantizeArgs>;
    if (t.is_cpu()) {
        if constexpr (kQuantize) {
            fpq::quantize_cpu(fmt, args);
        } else {
            fpq::dequantize_cpu(fmt, args);
        }
        return;
    }
#if defined(FPQ_WITH_CUDA)
    TORCH_CHECK_VALUE(t.is_cuda(), "tensors on ", t.device(), " are not supported; allowed: cpu, cuda");
    const c10::cuda::CUDAGuard guard(t.device());
    void* stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
    if constexpr (kQuantize) {
        fpq::quantize_cuda(fmt, args, stream);
    } else {
        fpq::dequantize_cuda(fmt, args, stream);
    }
#else
    TORCH_CHECK_VALUE(false, "this ds_fpquant op was built without CUDA; tensor on ", t.device());
#endif
}

// x: (rows, k) contiguous fp32/fp16/bf16. Returns (codes uint8 (rows, row_bytes), scales fp32
// (rows, ceil(k/G))). `given_scales`, if set, are used as the scales (SPEC 4). `stochastic`
// selects SPEC 4 stochastic rounding with Philox key `seed` and counter offset `offset`.
std::vector<at::Tensor> quantize(const at::Tensor& x, const std::string& fmt_name, int64_t group_size,
                                 const c10::optional<at::Tensor>& given_scales, bool stochastic, uint64_t seed,
                                 uint64_t offset, const std::string& e8m0)
{
    const fpq::Format fmt = parse_format(fmt_name);
    TORCH_CHECK_VALUE(x.dim() == 2, "x must be 2-D (rows, k), got ", x.dim(), "-D");
    TORCH_CHECK_VALUE(x.is_contiguous() && !x.is_neg(), "x must be contiguous, without a lazy negation");
    TORCH_CHECK_VALUE(group_size >= 1, "group_size=", group_size, " is not allowed; it must be an int >= 1");
    const int64_t rows = x.size(0), k = x.size(1);
    group_size = effective_group_size(group_size, k);
    const int64_t n_groups = fpq::ceil_div(k, group_size);
    const int bits = bits_of(fmt);
    fpq::QuantizeArgs args;
    args.dtype = parse_dtype(x.scalar_type(), "x");
    TORCH_CHECK_VALUE(e8m0.empty() || e8m0 == "ceil" || e8m0 == "floor", "e8m0='", e8m0,
                      "' is not supported; allowed: '' (fp32 scales), 'ceil', 'floor'");
    args.scale_mode = e8m0.empty() ? fpq::ScaleMode::kFp32
                                   : (e8m0 == "ceil" ? fpq::ScaleMode::kE8m0Ceil : fpq::ScaleMode::kE8m0Floor);
    TORCH_CHECK_VALUE(!(given_scales.has_value() && !e8m0.empty()), "scales= takes fp32 scales only");
    if (given_scales.has_value()) {
        const at::Tensor& s = *given_scales;
        TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, "scales.dtype=", s.scalar_type(),
                         " is not supported; allowed: torch.float32");
        TORCH_CHECK_VALUE(s.dim() == 2 && s.size(0) == rows && s.size(1) == n_groups && s.is_contiguous(),
                          "scales must be contiguous with shape (", rows, ", ", n_groups, "), got ", s.sizes(), " with strides ", s.strides());
        check_device(s, x, "scales");
        args.given_scales = s.data_ptr<float>();
    }
    auto codes = at::empty({rows, fpq::row_bytes(k, group_size, bits)}, x.options().dtype(at::kByte));
    auto scales = at::empty({rows, n_groups}, x.options().dtype(e8m0.empty() ? at::kFloat : at::kByte));
    args.x = x.data_ptr();
    args.rows = rows;
    args.k = k;
    args.group_size = group_size;
    args.stochastic = stochastic;
    args.seed = seed;
    args.offset = offset;
    args.codes = codes.data_ptr<uint8_t>();
    if (e8m0.empty()) {
        args.scales = scales.data_ptr<float>();
    } else {
        args.scale_bytes = scales.data_ptr<uint8_t>();
    }
    if (rows * k > 0) {
        launch(fmt, args, x);
    }
    return {codes, scales};
}

// codes (rows, row_bytes) uint8, scales (rows, ceil(k/G)) fp32 -> (rows, k) of `out_dtype`.
at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t k, const std::string& fmt_name,
                      int64_t group_size, at::ScalarType out_dtype)
{
    const fpq::Format fmt = parse_format(fmt_name);
    TORCH_CHECK_VALUE(group_size >= 1, "group_size=", group_size, " is not allowed; it must be an int >= 1");
    TORCH_CHECK_VALUE(k >= 0, "k=", k, " must be >= 0");
    group_size = effective_group_size(group_size, k);
    TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "codes.dtype=", codes.scalar_type(),
                     " is not supported; allowed: torch.uint8");
    TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "scales.dtype=", scales.scalar_type(),
                     " is not supported; allowed: torch.float32");
    const int64_t rows = codes.dim() == 2 ? codes.size(0) : -1;
    const int64_t rb = fpq::row_bytes(k, group_size, bits_of(fmt));
    const int64_t n_groups = fpq::ceil_div(k, group_size);
    TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(1) == rb && codes.is_contiguous(),
                      "codes must be contiguous with shape (rows, ", rb, "), got ", codes.sizes(), " with strides ", codes.strides());
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == rows && scales.size(1) == n_groups &&
                          scales.is_contiguous(),
                      "scales must be contiguous with shape (", rows, ", ", n_groups, "), got ", scales.sizes(), " with strides ", scales.strides());
    check_device(scales, codes, "scales");
    fpq::DequantizeArgs args;
    args.dtype = parse_dtype(out_dtype, "out");
    auto out = at::empty({rows, k}, codes.options().dtype(out_dtype));
    args.codes = codes.data_ptr<uint8_t>();
    args.scales = scales.data_ptr<float>();
    args.out = out.data_ptr();
    args.rows = rows;
    args.k = k;
    args.group_size = group_size;
    if (rows * k > 0) {
        launch(fmt, args, codes);
    }
    return out;
}

// The weight arguments of linear / decode_rows, checked, as the kernels' LinearArgs (x, y and m unset): W (n, k)
// row-grouped packed codes, contiguous (n, row_bytes) uint8, with its scales: fp32 or uint8 (scale_kind "fp32",
// "e8m0" or "e4m3" for NVFP4 with tensor_scale), contiguous (ceil(n / block_rows), ceil(k / G)); block_rows = Br
// for 2-D blocks, 1 for row groups; decoded in weight_dtype (SPEC 5).
fpq::LinearArgs weight_args(const at::Tensor& codes, const at::Tensor& scales, const std::string& scale_kind,
                            int64_t block_rows, double tensor_scale, fpq::Format fmt, int64_t group_size, int64_t k,
                            at::ScalarType weight_dtype)
{
    check_device(scales, codes, "scales");
    TORCH_CHECK_VALUE(group_size >= 1 && block_rows >= 1, "group_size and block_rows must be >= 1");
    const int64_t g = effective_group_size(group_size, k);
    TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "codes.dtype=", codes.scalar_type(), "; expected torch.uint8");
    const int64_t rb = fpq::row_bytes(k, g, bits_of(fmt));
    TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(1) == rb && codes.is_contiguous(),
                      "codes must be contiguous with shape (n, ", rb, "), got ", codes.sizes(), " with strides ", codes.strides());
    const int64_t n = codes.size(0);
    fpq::LinearArgs args;
    if (scale_kind == "fp32") {
        args.scale_kind = fpq::LinearScale::kFp32;
    } else if (scale_kind == "e8m0") {
        args.scale_kind = fpq::LinearScale::kE8m0;
    } else {
        TORCH_CHECK_VALUE(scale_kind == "e4m3", "scale_kind='", scale_kind, "'; allowed: fp32, e8m0, e4m3");
        args.scale_kind = fpq::LinearScale::kE4m3;
    }
    TORCH_CHECK_TYPE(scales.scalar_type() == (args.scale_kind == fpq::LinearScale::kFp32 ? at::kFloat : at::kByte),
                     "scales.dtype=", scales.scalar_type(), " does not match scale_kind='", scale_kind, "'");
    const int64_t scale_rows = fpq::ceil_div(n, block_rows), scale_cols = fpq::ceil_div(k, g);
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == scale_rows && scales.size(1) == scale_cols &&
                          scales.is_contiguous(),
                      "scales must be contiguous with shape (", scale_rows, ", ", scale_cols, "), got ", scales.sizes(), " with strides ", scales.strides());
    args.scales = scales.data_ptr();
    args.block_rows = block_rows;
    args.scale_cols = scale_cols;
    args.tensor_scale = static_cast<float>(tensor_scale);
    args.weight_dtype = parse_dtype(weight_dtype, "x");
    args.codes = codes.data_ptr<uint8_t>();
    args.n = n;
    args.k = k;
    args.group_size = g;
    args.row_bytes = rb;
    return args;
}

// y = x @ W^T (+ bias) by the fused kernels, W as for weight_args: on the CPU SPEC 8's formula (fp_linear_cpu.cpp:
// exact codes, group partial sums times the group scale, fp32; bias added in fp32; one rounding to x's dtype),
// any m; on CUDA tensors the tensor-core GEMV (m <= kGemvMaxRows; the same formula: exact codes, group partial sums
// (mma chains) times the group scale, fp32, one rounding of sum + bias; SPEC 8.2's tensor-core bound). x: (m, k) fp32 / fp16 / bf16, contiguous. The caller may instead multiply panels of
// rows decoded by decode_rows (ds_fpquant.linear.weight_only).
at::Tensor linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const std::string& scale_kind,
                  int64_t block_rows, double tensor_scale, const c10::optional<at::Tensor>& bias,
                  const std::string& fmt_name, int64_t group_size)
{
    const fpq::Format fmt = parse_format(fmt_name);
    check_device(codes, x, "codes");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && !x.is_neg(), "x must be a contiguous 2-D (m, k) tensor");
    const int64_t m = x.size(0), k = x.size(1);
    fpq::LinearArgs args = weight_args(codes, scales, scale_kind, block_rows, tensor_scale, fmt, group_size, k,
                                       x.scalar_type());
    const int64_t n = args.n;
    args.m = m;
    if (bias.has_value()) {
        TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias must have shape (", n, "), got ",
                          bias->sizes());
        check_device(*bias, x, "bias");
    }
    if (m == 0 || n == 0) { return at::zeros({m, n}, x.options()); }
    if (k == 0) {
        auto y = at::zeros({m, n}, x.options());
        return bias.has_value() ? y.add_(bias->to(x.scalar_type())) : y;
    }
#if defined(FPQ_WITH_CUDA)
    if (x.is_cuda()) {  // the GEMV kernel; the caller decodes panels for more rows
        TORCH_CHECK_VALUE(m <= fpq::kGemvMaxRows, "linear on CUDA tensors takes m <= ", fpq::kGemvMaxRows,
                          " rows of x; got m=", m);
        const c10::cuda::CUDAGuard guard(x.device());
        auto y = at::empty({m, n}, x.options());
        const at::Tensor b = bias.has_value() ? bias->to(x.scalar_type()).contiguous() : at::Tensor();
        fpq::GemvArgs gemv;
        gemv.w = args;
        gemv.x = x.data_ptr();
        gemv.bias = b.defined() ? b.data_ptr() : nullptr;
        gemv.y = y.data_ptr();
        // split-K partial sums from torch's caching allocator on this stream (no fill: no extra kernel), freed when
        // linear returns, reused only by work queued after the kernel on the same stream; the split-K counters are
        // the launcher's, created once per device and stream (gemv_workspace)
        at::Tensor partials;
        auto alloc = [&](int64_t bytes) -> void* {
            partials = at::empty({bytes}, x.options().dtype(at::kByte));
            return partials.data_ptr();
        };
        fpq::linear_cuda(fmt, gemv, static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
                         alloc);
        return y;
    }
#endif
    TORCH_CHECK_VALUE(x.is_cpu(), "linear: tensors on ", x.device(), " are not supported by this build");
    // the fused kernel on x zero-padded to its row layout
    const int64_t k_padded = fpq::ceil_div(k, fpq::kLinearPad) * fpq::kLinearPad;
    const bool bf16 = x.scalar_type() == at::kBFloat16;  // fp16 x widens exactly to fp32
    auto xs = at::zeros({m, k_padded}, x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
    xs.narrow(1, 0, k).copy_(x);
    auto y32 = at::empty({m, n}, x.options().dtype(at::kFloat));
    args.x = xs.data_ptr();
    args.y = y32.data_ptr<float>();
    fpq::linear_cpu(fmt, args, bf16);
    if (bias.has_value()) { y32.add_(bias->to(at::kFloat)); }
    return y32.to(x.scalar_type());
}

// Which CPU kernel linear() runs for x (m, k) and the weight W (as for weight_args) in this build: "avx512_register",
// "avx2_gemv", "avx2_gemm" or "portable" (fp_linear_cpu.cpp), "none" where m, n or k is 0 (no kernel runs).
std::string linear_kernel(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::string& scale_kind, int64_t block_rows, double tensor_scale,
                          const std::string& fmt_name, int64_t group_size)
{
    const fpq::Format fmt = parse_format(fmt_name);
    TORCH_CHECK_VALUE(x.dim() == 2, "x must be a 2-D (m, k) tensor");
    TORCH_CHECK_VALUE(x.is_cpu() && codes.is_cpu(), "linear_kernel: CPU tensors only");
    fpq::LinearArgs args = weight_args(codes, scales, scale_kind, block_rows, tensor_scale, fmt, group_size, x.size(1),
                                       x.scalar_type());
    args.m = x.size(0);
    if (args.m == 0 || args.n == 0 || args.k == 0) { return "none"; }
    return fpq::linear_cpu_kernel_name(fpq::linear_cpu_kernel(fmt, args));
}

// Rows n0 .. n1-1 of dequant(W) (W as for weight_args) written into out ((n1 - n0, k), contiguous, of out's
// dtype fp32 / fp16 / bf16): the panels of the large-m linear. CPU tensors.
void decode_rows(const at::Tensor& codes, const at::Tensor& scales, const std::string& scale_kind, int64_t block_rows,
                 double tensor_scale, const std::string& fmt_name, int64_t group_size, int64_t n0, int64_t n1,
                 at::Tensor& out)
{
    const fpq::Format fmt = parse_format(fmt_name);
    TORCH_CHECK_VALUE(codes.is_cpu(), "decode_rows: CPU tensors only, got codes on ", codes.device());
    check_device(out, codes, "out");
    TORCH_CHECK_VALUE(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous 2-D (rows, k) tensor");
    const fpq::LinearArgs args = weight_args(codes, scales, scale_kind, block_rows, tensor_scale, fmt, group_size,
                                             out.size(1), out.scalar_type());
    TORCH_CHECK_VALUE(0 <= n0 && n0 <= n1 && n1 <= args.n && out.size(0) == n1 - n0, "rows ", n0, " .. ", n1,
                      " of ", args.n, " do not fit out of shape ", out.sizes());
    if (n1 > n0 && args.k > 0) { fpq::decode_rows_cpu(fmt, args, n0, n1, out.data_ptr()); }
}

// Philox4x32-10 on one counter and key (the known-answer test calls it).
std::vector<uint32_t> philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1)
{
    const fpq::PhiloxOut out = fpq::philox4x32_10(c0, c1, c2, c3, k0, k1);
    return {out.v[0], out.v[1], out.v[2], out.v[3]};
}

// The C++ format table (traits of fp_codec.h), for the test that compares it with formats.py.
py::dict format_table()
{
    py::dict table;
    for (const auto& entry : kFormats) {
        table[entry.name] = fpq::dispatch_format(entry.id, [](auto f) {
            using F = decltype(f);
            py::dict d;
            d["ebits"] = F::kEbits;
            d["mbits"] = F::kMbits;
            d["bits"] = F::kBits;
            d["bias"] = F::kBias;
            d["emax"] = F::kEmax;
            d["fmax"] = fpq::bits_f32(F::kFmaxBits);
            d["min_normal"] = fpq::bits_f32(F::kMinNormalBits);
            d["min_subnormal"] = fpq::bits_f32(F::kSubnormalStepBits);
            d["has_inf"] = F::kHasInf;
            d["has_nan"] = F::kHasNan;
            d["max_code"] = F::kMaxCode;
            d["nan_code"] = F::kNanCode;
            d["inf_code"] = F::kInfCode;
            return d;
        });
    }
    return table;
}

// The peak loops of fp_peak_cpu.cpp: one dict per loop (name, instruction, flops_per_instruction, accumulators,
// unavailable: "" where it runs here, else why not).
py::list dot_peak_kinds()
{
    py::list kinds;
    for (const auto& kind : fpq::peak_kinds()) {
        py::dict d;
        d["name"] = kind.name;
        d["instruction"] = kind.instruction;
        d["flops_per_instruction"] = kind.flops_per_instruction;
        d["accumulators"] = kind.accumulators;
        d["unavailable"] = kind.unavailable;
        kinds.append(d);
    }
    return kinds;
}

double dot_peak_gflops(const std::string& kind, int64_t threads, double min_seconds, int64_t trials)
{
    TORCH_CHECK_VALUE(threads >= 1 && threads <= 4096, "threads=", threads, ": must be in 1 .. 4096");
    TORCH_CHECK_VALUE(trials >= 1 && trials <= 100, "trials=", trials, ": must be in 1 .. 100");
    py::gil_scoped_release no_gil;  // a second of register-only loops; nothing of Python's is touched
    return fpq::peak_gflops(kind, int(threads), min_seconds, int(trials));  // std::invalid_argument: ValueError
}

#if defined(FPQ_WITH_CUDA)
// The split-K counters' workspace of the CUDA linear on `device` (index) and its current stream: {"created": buffers
// created on the device so far, every stream; "capacity": counters of the stream's buffer, 0 before its first split
// launch; "counters": its address}. A layer called again reuses the buffer: "created" stays and no memset runs.
py::dict gemv_workspace(int64_t device)
{
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const auto info = fpq::gemv_workspace_info(
        static_cast<int>(device), static_cast<void*>(c10::cuda::getCurrentCUDAStream(device).stream()));
    py::dict out;
    out["created"] = info.created;
    out["capacity"] = info.capacity;
    out["counters"] = static_cast<uint64_t>(info.counters);
    return out;
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.doc() = "ds_fpquant group FP quantization kernels (docs/spec.md)";
    m.def("quantize", &quantize, "quantize (rows, k) -> (codes, scales)", py::arg("x"), py::arg("fmt"),
          py::arg("group_size"), py::arg("scales") = py::none(), py::arg("stochastic") = false,
          py::arg("seed") = 0, py::arg("offset") = 0, py::arg("e8m0") = "");
    m.def("dequantize", &dequantize, "dequantize codes + scales -> (rows, k)", py::arg("codes"), py::arg("scales"),
          py::arg("k"), py::arg("fmt"), py::arg("group_size"), py::arg("dtype"));
    m.def("linear", &linear, "y = x @ dequant(W)^T + bias, decoded on the fly (CPU; CUDA for m <= 8)", py::arg("x"),
          py::arg("codes"), py::arg("scales"), py::arg("scale_kind"), py::arg("block_rows"), py::arg("tensor_scale"),
          py::arg("bias"), py::arg("fmt"), py::arg("group_size"));
    m.def("linear_kernel", &linear_kernel, "which CPU kernel linear() runs for x and W in this build", py::arg("x"),
          py::arg("codes"), py::arg("scales"), py::arg("scale_kind"), py::arg("block_rows"), py::arg("tensor_scale"),
          py::arg("fmt"), py::arg("group_size"));
    m.def("decode_rows", &decode_rows, "rows n0 .. n1-1 of dequant(W) into out (CPU)", py::arg("codes"),
          py::arg("scales"), py::arg("scale_kind"), py::arg("block_rows"), py::arg("tensor_scale"), py::arg("fmt"),
          py::arg("group_size"), py::arg("n0"), py::arg("n1"), py::arg("out"));
    m.def("format_table", &format_table, "the C++ format traits");
    m.def("cpu_paths", &fpq::linear_cpu_paths,
          "the vector paths compiled into the CPU kernels (fast_decode, bf16_dot, direct_bf16, avx2_fma); [] when "
          "portable");
    m.def("dot_peak_kinds", &dot_peak_kinds,
          "the peak dot-product loops of this build (name, instruction, flops_per_instruction, accumulators, "
          "unavailable: '' where this CPU and OS run it, else why not)");
    m.def("dot_peak_gflops", &dot_peak_gflops,
          "GFLOP/s (a multiply-add counted as 2) of `threads` OpenMP threads running the register-only loop of "
          "`kind`: the best of `trials` runs of at least `min_seconds` each", py::arg("kind"), py::arg("threads"),
          py::arg("min_seconds") = 0.2, py::arg("trials") = 3);
    m.def("philox4x32_10", &philox, "Philox4x32-10 of one counter (c0..c3) and key (k0, k1)");
#if defined(FPQ_WITH_CUDA)
    m.def("gemv_workspace", &gemv_workspace,
          "the CUDA linear's split-K counters on a device's current stream: created (buffers so far, every stream), "
          "capacity, counters (address)", py::arg("device"));
    m.attr("WITH_CUDA") = true;
#else
    m.attr("WITH_CUDA") = false;
#endif
}
