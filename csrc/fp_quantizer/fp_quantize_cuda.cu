// CUDA launchers of ds_fpquant (no torch includes): the kernels and their launch geometry are in
// fp_quantize_kernels.cuh (quantize, dequantize) and fp_gemv_kernels.cuh (the tensor-core GEMV), shared with
// the CPU emulation that runs them in the tests; this file adds only the <<<>>> launch on the caller's
// stream, the device's SM count for the GEMV's plan, its shared-memory opt-in, the split-K counters' workspace
// (fp_gemv_workspace.h: created once per device and stream, no memset per call), and the launch error check.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "fp_gemv_kernels.cuh"
#include "fp_gemv_workspace.h"
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

void check_cuda(cudaError_t err, const char* what)
{
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string("ds_fpquant: ") + what + " failed: " + cudaGetErrorString(err));
    }
}

// The current device's SM count (the GEMV's plan fills the GPU with tiles x splits blocks).
int current_sm_count()
{
    int device = 0, sms = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    return sms;
}

// Raises a kernel's dynamic shared-memory limit to `bytes` once per kernel and device (above the default 48 KiB).
void allow_shared(const void* kernel, int bytes)
{
    static std::mutex mutex;
    static std::unordered_map<const void*, int> allowed[64];
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    const std::lock_guard<std::mutex> lock(mutex);
    int& current = allowed[device % 64][kernel];
    if (bytes > current) {
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                   "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
        current = bytes;
    }
}

// `bytes` of new zero-filled device memory, never freed (the split-K counters' buffers). This may run while the
// caller's stream captures a CUDA graph: the relaxed capture mode lets this thread cudaMalloc (as torch's caching
// allocator does), and the zeroing runs on a stream of its own, synchronously, so that it is done now and is no node
// of the graph.
void* zeroed_device_memory(int64_t bytes)
{
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    check_cuda(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
    void* p = nullptr;
    cudaStream_t zeroing = nullptr;
    cudaError_t err = cudaMalloc(&p, size_t(bytes));
    if (err == cudaSuccess) { err = cudaStreamCreateWithFlags(&zeroing, cudaStreamNonBlocking); }
    if (err == cudaSuccess) { err = cudaMemsetAsync(p, 0, size_t(bytes), zeroing); }
    if (err == cudaSuccess) { err = cudaStreamSynchronize(zeroing); }
    if (zeroing != nullptr) { cudaStreamDestroy(zeroing); }
    cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode back
    check_cuda(err, "allocating the GEMV's split-K counters");
    return p;
}

GemvCounterPool& counter_pool()
{
    static GemvCounterPool pool;
    return pool;
}

}  // namespace

void quantize_cuda(Format fmt, const QuantizeArgs& args, void* stream) { launch_on_stream(fmt, args, stream, "quantize"); }

void dequantize_cuda(Format fmt, const DequantizeArgs& args, void* stream)
{
    launch_on_stream(fmt, args, stream, "dequantize");
}

void linear_cuda(Format fmt, const GemvArgs& args, void* stream, const GemvPartials& partials)
{
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    auto counters = [&](int64_t tiles) { return counter_pool().acquire(device, stream, tiles, zeroed_device_memory); };
    try {
        cuda_kernels::launch_gemv(fmt, args, current_sm_count(), partials, counters,
                                  [&](auto kernel, dim3 grid, dim3 block, int shared_bytes, const GemvArgs& a,
                                      const cuda_kernels::GemvPlan& plan) {
                                      allow_shared(reinterpret_cast<const void*>(kernel), shared_bytes);
                                      kernel<<<grid, block, shared_bytes, static_cast<cudaStream_t>(stream)>>>(a, plan);
                                      check_launch("linear");
                                  });
    } catch (const std::runtime_error&) {  // a launch that did not start: its counters are not trusted again
        counter_pool().retire(device, stream);
        throw;
    }
}

GemvWorkspaceInfo gemv_workspace_info(int device, void* stream)
{
    const GemvCounterPool::Info info = counter_pool().info(device, stream);
    return {info.created, info.capacity, reinterpret_cast<uintptr_t>(info.counters)};
}

}  // namespace fpq
