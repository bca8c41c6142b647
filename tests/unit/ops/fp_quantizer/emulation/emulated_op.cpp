// The emulation-side binding: a process that runs the CUDA kernels of csrc/ (fp_quantize_kernels.cuh and
// fp_gemv_kernels.cuh, the same launch_over_groups and launch_gemv as fp_quantize_cuda.cu) in the CPU
// emulation of cuda_emulation.h, built with AddressSanitizer and UndefinedBehaviorSanitizer.
// cuda_emulation.py drives it over stdin/stdout:
//
//   request:  Request, then the input buffers (quantize: x, given scales if any; dequantize: codes,
//             scales; linear: x, codes, scales, bias if any), each exactly the size the geometry gives
//   response: Response, then the output buffers (quantize: codes, scales; dequantize: out; linear: y)
//
// Every buffer is its own heap allocation that ends exactly where the data ends (ASan's redzone
// follows) and starts `misalign` bytes into the allocation, those bytes poisoned: any read or write
// outside a buffer aborts with ASan's report. Each request runs the launch twice, blocks forward with
// outputs pre-filled with 0x00, then blocks (and threads) in reverse with 0xFF: the two results must
// be identical, so every output byte is written, and written independently of the block order; the
// input buffers must be unchanged afterwards. A request that runs longer than kTimeoutSeconds (a
// kernel loop that never ends) aborts the process, as does the death of the parent.

#include "cuda_emulation.h"
#include "fp_gemv_kernels.cuh"
#include "fp_gemv_workspace.h"
#include "fp_quantize_kernels.cuh"

#include <sanitizer/asan_interface.h>
#include <signal.h>
#include <sys/prctl.h>

#include <cstdio>
#include <memory>
#include <string>

namespace {

constexpr uint64_t kMagic = 0x31554d4551504655ull;  // "UFPQEMU1"
constexpr unsigned kTimeoutSeconds = 300;

struct Request {
    uint64_t magic;
    int32_t op;  // 0 quantize, 1 dequantize
    int32_t ebits, mbits;
    int32_t dtype;       // fpq::DType
    int32_t scale_mode;  // fpq::ScaleMode (quantize)
    int32_t stochastic;
    int32_t has_given_scales;
    int32_t pad;
    int64_t rows, k, group_size, max_blocks;
    uint64_t seed, offset;
    int64_t misalign[6];  // quantize: x, given scales, codes, scales; dequantize: codes, scales, out;
                          // linear: x, codes, scales, bias, y
    // linear only (rows = n weight rows, k, group_size as above)
    int64_t m, block_rows, scale_cols;
    int32_t scale_kind;  // fpq::LinearScale
    int32_t has_bias;
    float tensor_scale;
    int32_t num_sms;  // linear: the SM count the GEMV's plan fills
    int32_t stream;   // linear: the stream the launch is on (the split-K counters are per device and stream)
    int32_t pad2;
};

struct Response {
    uint64_t magic;
    int64_t launched;  // 0 when the geometry has no groups
    int64_t grid_x, block_x, team_log2, total_groups;
    uint64_t threads, switches;
    uint64_t fp8_conversions;  // values through the emulated sm_89+ fp8 conversion, both runs
    int64_t grid_y, shared_bytes;  // linear: the splits of K and the dynamic shared memory per block
    // linear: the split-K counters' workspace after the call (GemvCounterPool::Info of device 0 and the stream)
    int64_t workspace_created, workspace_capacity;
    uint64_t workspace_counters;
};

// The split-K counters as fp_quantize_cuda.cu keeps them (one pool for the process, buffers never freed), on the heap:
// each buffer its own allocation (ASan's redzones), zero-filled once.
fpq::GemvCounterPool& counter_pool()
{
    static fpq::GemvCounterPool pool;
    return pool;
}

void* zeroed_heap_memory(int64_t bytes)
{
    static std::vector<std::unique_ptr<uint8_t[]>> kept;
    kept.push_back(std::make_unique<uint8_t[]>(size_t(bytes)));  // value-initialized: zero
    return kept.back().get();
}

// One buffer: a heap allocation of misalign + size bytes, the first misalign bytes poisoned.
struct Buffer {
    uint8_t* base = nullptr;
    uint8_t* data = nullptr;
    size_t size = 0, misalign = 0;

    Buffer(size_t size_, int64_t misalign_) : size(size_), misalign(size_t(misalign_))
    {
        if (misalign_ < 0 || misalign_ > 64) { fpq_emu::fail("misalign %lld is outside [0, 64]", (long long)misalign_); }
        void* p = nullptr;
        if (posix_memalign(&p, 256, misalign + size + (misalign + size == 0)) != 0) { fpq_emu::fail("out of memory"); }
        base = static_cast<uint8_t*>(p);
        data = base + misalign;
        ASAN_POISON_MEMORY_REGION(base, misalign);
    }
    ~Buffer()
    {
        ASAN_UNPOISON_MEMORY_REGION(base, misalign);
        std::free(base);
    }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
};

void read_exact(void* dst, size_t n)
{
    if (n > 0 && std::fread(dst, 1, n, stdin) != n) { fpq_emu::fail("short read on stdin (%zu bytes wanted)", n); }
}

void write_exact(const void* src, size_t n)
{
    if (n > 0 && std::fwrite(src, 1, n, stdout) != n) { fpq_emu::fail("short write on stdout"); }
}

// The Format whose traits have (ebits, mbits): the ids are tried until dispatch_format refuses one.
fpq::Format format_of(int ebits, int mbits)
{
    for (int id = 0;; ++id) {
        bool match = false;
        try {
            match = fpq::dispatch_format(fpq::Format(id), [&](auto f) {
                return decltype(f)::kEbits == ebits && decltype(f)::kMbits == mbits;
            });
        } catch (const std::invalid_argument&) {
            fpq_emu::fail("no kernel format has ebits=%d mbits=%d", ebits, mbits);
        }
        if (match) { return fpq::Format(id); }
    }
}

size_t element_size(fpq::DType dtype)
{
    return fpq::dispatch_dtype(dtype, [](auto tag) { return sizeof(tag); });
}

// Runs the launch of `args` (forward or reverse) and records its shape in `resp`.
template <class Args>
void run(fpq::Format fmt, const Args& args, int64_t max_blocks, bool reverse, Response& resp)
{
    fpq::cuda_kernels::launch_over_groups(
        fmt, args, max_blocks,
        [&](auto kernel, dim3 grid, dim3 block, const fpq::cuda_kernels::Geometry& g, int team_log2) {
            const auto stats = fpq_emu::launch(grid, block, [&] { kernel(args, g, team_log2); }, reverse);
            resp.launched = 1;
            resp.grid_x = grid.x, resp.block_x = block.x, resp.team_log2 = team_log2, resp.total_groups = g.total;
            resp.threads = stats.threads, resp.switches += stats.switches;
        });
}

// A copy of an input buffer's bytes, to show the kernels left it unchanged.
std::vector<uint8_t> snapshot(const Buffer& b) { return std::vector<uint8_t>(b.data, b.data + b.size); }

void check_unchanged(const Buffer& b, const std::vector<uint8_t>& before, const char* what)
{
    for (size_t i = 0; i < b.size; ++i) {
        if (b.data[i] != before[i]) { fpq_emu::fail("input %s byte %zu was written by the kernel", what, i); }
    }
}

void compare_runs(const Buffer& a, const Buffer& b, const char* what)
{
    for (size_t i = 0; i < a.size; ++i) {
        if (a.data[i] != b.data[i]) {
            fpq_emu::fail("%s byte %zu differs between the runs pre-filled with 0x00 (0x%02x, blocks forward) and "
                          "0xFF (0x%02x, blocks reversed): not written, or written depending on the block order",
                          what, i, a.data[i], b.data[i]);
        }
    }
}

void serve(const Request& req)
{
    const fpq::Format fmt = format_of(req.ebits, req.mbits);
    const auto dtype = fpq::DType(req.dtype);
    const size_t esize = element_size(dtype);
    const int bits = 1 + req.ebits + req.mbits;
    const int64_t rows = req.rows, k = req.k, g = req.group_size;
    if (rows < 0 || k < 0 || g < 1) { fpq_emu::fail("bad geometry rows=%lld k=%lld G=%lld", (long long)rows, (long long)k, (long long)g); }
    const size_t n_scales = size_t(rows * (k == 0 ? 0 : fpq::ceil_div(k, g)));
    const size_t code_bytes = size_t(rows * fpq::row_bytes(k, g, bits));
    Response resp{kMagic, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    fpq_emu::fp8_conversions() = 0;
    alarm(kTimeoutSeconds);

    if (req.op == 0) {
        const bool e8m0 = req.scale_mode != int(fpq::ScaleMode::kFp32);
        Buffer x(size_t(rows * k) * esize, req.misalign[0]);
        Buffer given(req.has_given_scales ? n_scales * 4 : 0, req.misalign[1]);
        read_exact(x.data, x.size);
        read_exact(given.data, given.size);
        const auto x_before = snapshot(x), given_before = snapshot(given);
        std::unique_ptr<Buffer> outs[2][2];
        for (int pass = 0; pass < 2; ++pass) {
            outs[pass][0] = std::make_unique<Buffer>(code_bytes, req.misalign[2]);
            outs[pass][1] = std::make_unique<Buffer>(n_scales * (e8m0 ? 1 : 4), req.misalign[3]);
            for (auto& b : outs[pass]) { std::memset(b->data, pass ? 0xff : 0x00, b->size); }
            fpq::QuantizeArgs a;
            a.x = x.data, a.dtype = dtype, a.rows = rows, a.k = k, a.group_size = g;
            a.given_scales = req.has_given_scales ? reinterpret_cast<const float*>(given.data) : nullptr;
            a.codes = outs[pass][0]->data;
            a.scales = e8m0 ? nullptr : reinterpret_cast<float*>(outs[pass][1]->data);
            a.scale_bytes = e8m0 ? outs[pass][1]->data : nullptr;
            a.scale_mode = fpq::ScaleMode(req.scale_mode);
            a.stochastic = req.stochastic != 0, a.seed = req.seed, a.offset = req.offset;
            run(fmt, a, req.max_blocks, pass == 1, resp);
        }
        compare_runs(*outs[0][0], *outs[1][0], "codes");
        compare_runs(*outs[0][1], *outs[1][1], "scales");
        check_unchanged(x, x_before, "x");
        check_unchanged(given, given_before, "given scales");
        resp.fp8_conversions = fpq_emu::fp8_conversions();
        write_exact(&resp, sizeof resp);
        write_exact(outs[0][0]->data, outs[0][0]->size);
        write_exact(outs[0][1]->data, outs[0][1]->size);
    } else if (req.op == 1) {
        Buffer codes(code_bytes, req.misalign[0]);
        Buffer scales(n_scales * 4, req.misalign[1]);
        read_exact(codes.data, codes.size);
        read_exact(scales.data, scales.size);
        const auto codes_before = snapshot(codes), scales_before = snapshot(scales);
        std::unique_ptr<Buffer> outs[2];
        for (int pass = 0; pass < 2; ++pass) {
            outs[pass] = std::make_unique<Buffer>(size_t(rows * k) * esize, req.misalign[2]);
            std::memset(outs[pass]->data, pass ? 0xff : 0x00, outs[pass]->size);
            fpq::DequantizeArgs a;
            a.codes = codes.data, a.scales = reinterpret_cast<const float*>(scales.data);
            a.out = outs[pass]->data, a.dtype = dtype, a.rows = rows, a.k = k, a.group_size = g;
            run(fmt, a, req.max_blocks, pass == 1, resp);
        }
        compare_runs(*outs[0], *outs[1], "out");
        check_unchanged(codes, codes_before, "codes");
        check_unchanged(scales, scales_before, "scales");
        write_exact(&resp, sizeof resp);
        write_exact(outs[0]->data, outs[0]->size);
    } else if (req.op == 2) {
        const int64_t n = rows, m = req.m;
        if (m < 0 || m > fpq::kGemvMaxRows || req.block_rows < 1) { fpq_emu::fail("bad linear geometry"); }
        const auto kind = fpq::LinearScale(req.scale_kind);
        const size_t scale_bytes = kind == fpq::LinearScale::kFp32 ? 4 : 1;
        const size_t n_scales = size_t(fpq::ceil_div(n, req.block_rows) * req.scale_cols);
        Buffer x(size_t(m * k) * esize, req.misalign[0]);
        Buffer codes(code_bytes, req.misalign[1]);
        Buffer scales(n_scales * scale_bytes, req.misalign[2]);
        Buffer bias(req.has_bias ? size_t(n) * esize : 0, req.misalign[3]);
        for (Buffer* b : {&x, &codes, &scales, &bias}) { read_exact(b->data, b->size); }
        const auto x_before = snapshot(x), codes_before = snapshot(codes), scales_before = snapshot(scales),
                   bias_before = snapshot(bias);
        std::unique_ptr<Buffer> outs[2];
        for (int pass = 0; pass < 2; ++pass) {
            outs[pass] = std::make_unique<Buffer>(size_t(m * n) * esize, req.misalign[4]);
            std::memset(outs[pass]->data, pass ? 0xff : 0x00, outs[pass]->size);
            fpq::GemvArgs a;
            a.w.codes = codes.data, a.w.scales = scales.data, a.w.scale_kind = kind;
            a.w.block_rows = req.block_rows, a.w.scale_cols = req.scale_cols, a.w.tensor_scale = req.tensor_scale;
            a.w.weight_dtype = dtype, a.w.m = m, a.w.n = n, a.w.k = k, a.w.group_size = g;
            a.w.row_bytes = fpq::row_bytes(k, g, bits);
            a.x = x.data, a.bias = req.has_bias ? bias.data : nullptr, a.y = outs[pass]->data;
            // the split-K partial sums: their own allocation, fresh per run, pre-filled with 0xFF (NaN) so that a
            // read of a partial no block wrote shows; the counters: the pool's buffer of this stream, created once
            // and reused by every later launch on it (this request's second run included)
            std::unique_ptr<Buffer> partials;
            auto alloc = [&](int64_t bytes) -> void* {
                partials = std::make_unique<Buffer>(size_t(bytes), 0);
                std::memset(partials->data, 0xff, size_t(bytes));
                return partials->data;
            };
            const void* stream = reinterpret_cast<const void*>(uintptr_t(req.stream));
            auto counters = [&](int64_t tiles) {
                return counter_pool().acquire(0, stream, tiles, zeroed_heap_memory);
            };
            fpq::cuda_kernels::launch_gemv(fmt, a, req.num_sms, alloc, counters,
                                           [&](auto kernel, dim3 grid, dim3 block, int shared_bytes,
                                               const fpq::GemvArgs& args, const fpq::cuda_kernels::GemvPlan& plan) {
                const auto stats = fpq_emu::launch(grid, block, [&] { kernel(args, plan); }, pass == 1,
                                                   size_t(shared_bytes));
                resp.launched = 1, resp.grid_x = grid.x, resp.block_x = block.x, resp.threads = stats.threads;
                resp.grid_y = grid.y, resp.shared_bytes = shared_bytes;
                resp.switches += stats.switches;
                if (args.counters) {
                    for (unsigned t = 0; t < grid.x; ++t) {
                        if (args.counters[t] != 0) { fpq_emu::fail("split-K counter of tile %u left at %d", t, args.counters[t]); }
                    }
                }
            });
        }
        const auto info = counter_pool().info(0, reinterpret_cast<const void*>(uintptr_t(req.stream)));
        resp.workspace_created = info.created, resp.workspace_capacity = info.capacity;
        resp.workspace_counters = uint64_t(reinterpret_cast<uintptr_t>(info.counters));
        compare_runs(*outs[0], *outs[1], "y");
        check_unchanged(x, x_before, "x");
        check_unchanged(codes, codes_before, "codes");
        check_unchanged(scales, scales_before, "scales");
        check_unchanged(bias, bias_before, "bias");
        write_exact(&resp, sizeof resp);
        write_exact(outs[0]->data, outs[0]->size);
    } else {
        fpq_emu::fail("unknown op %d", req.op);
    }
    std::fflush(stdout);
    alarm(0);
}

void on_timeout(int)
{
    static const char msg[] = "cuda-emulation: a request ran past the timeout (a kernel loop that never ends?)\n";
    (void)!write(2, msg, sizeof msg - 1);
    std::abort();
}

}  // namespace

int main()
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test process
    signal(SIGALRM, on_timeout);
    Request req;
    while (std::fread(&req, sizeof req, 1, stdin) == 1) {
        if (req.magic != kMagic) { fpq_emu::fail("bad request magic"); }
        serve(req);
    }
    return 0;
}
