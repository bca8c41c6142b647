// CUDA launchers of ds_fpquant (no torch includes): the kernels and their launch geometry are in
// fp_quantize_kernels.cuh (quantize, dequantize) and fp_gemv_kernels.cuh (the fused GEMV), shared with
// the CPU emulation that runs them in the tests; this file adds only the <<<>>> launch on the caller's
// stream and the launch error check.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "fp_gemv_kernels.cuh"
#include "fp_quantize_kernels.cuh"

namespace fpq {
namespace {

void check_launch(const char* what)
{
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string("ds_fpquant: ") + what + " launch failed: " + cudaGetErrorString(err));
    }
}

template <class Args>
void launch_on_stream(Format fmt, const Args& args, void* stream, const char* what)
{
    cuda_kernels::launch_over_groups(
        fmt, args, cuda_kernels::kMaxBlocks,
        [&](auto kernel, dim3 grid, dim3 block, const cuda_kernels::Geometry& g, int team_log2) {
            kernel<<<grid, block, 0, static_cast<cudaStream_t>(stream)>>>(args, g, team_log2);
            check_launch(what);
        });
}

}  // namespace

void quantize_cuda(Format fmt, const QuantizeArgs& args, void* stream) { launch_on_stream(fmt, args, stream, "quantize"); }

void dequantize_cuda(Format fmt, const DequantizeArgs& args, void* stream)
{
    launch_on_stream(fmt, args, stream, "dequantize");
}

void linear_cuda(Format fmt, const GemvArgs& args, void* stream)
{
    cuda_kernels::launch_gemv(fmt, args, [&](auto kernel, dim3 grid, dim3 block, int shared_bytes) {
        kernel<<<grid, block, shared_bytes, static_cast<cudaStream_t>(stream)>>>(args);
        check_launch("linear");
    });
}

}  // namespace fpq
