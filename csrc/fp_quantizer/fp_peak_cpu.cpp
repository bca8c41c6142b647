// Peak dot-product rates of this CPU (includes/fp_peak_cpu.h), the compute side of the bench's roofline.
//
// Each loop repeats one multiply-add instruction on independent accumulator registers, with both operands in
// registers: nothing is loaded or stored in the timed loop, so its rate is that of the execution units. The
// accumulators cover the instruction's latency: a loop needs at least (pipes x latency cycles) chains in
// flight to issue one instruction per pipe and cycle, and has
//   fp32_fma_ymm (vfmadd231ps ymm): 12 (2 FMA pipes x 5 cycles on Zen 2/3, x 4 on Intel and Zen 4),
//   fp32_fma_zmm (vfmadd231ps zmm): 24 (2 x 4 on Intel; Zen 4 runs a zmm FMA as two ymm halves),
//   bf16_dot_zmm (vdpbf16ps zmm):   24 (2 x 6 at most on Cooper Lake, Sapphire Rapids and Zen 4),
//   amx_bf16 (tdpbf16ps):            6 tiles (one tdpbf16ps per 16 cycles; oneDNN's 2x2 blocking keeps 4).
// The chains stay finite and normal: fp32 FMA computes acc * 0.5 + 0.5 (it converges to 1, no chain the
// compiler may fold without fast-math); the bf16 dot products add the pairs (1, -1) . (1, 1) = 0 exactly.
//
// Which loops exist: fp32_fma_ymm on every x86-64 build (compiled for AVX2 + FMA with a target attribute and
// run where cpuid says the CPU has both); the AVX-512 and AMX loops only where the build's target has their
// instruction set (-march=native on such a CPU, or DS_FPQUANT_CPU_ARCH's target), as the CPU kernels they
// stand for are; each also checks at run time that the CPU and the OS enable it (a build for another CPU, a
// kernel without AMX support). AMX tiles need Linux's per-process permission for the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, Linux 5.16+), asked for once; without it tdpbf16ps
// faults, so the loop is then unavailable and says why. The AVX-512 and AMX loops have not run on the
// development machine (AVX2 only): they are compiled and their instructions checked by the tests there.

#include "fp_peak_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#define FPQ_PEAK_X86 1
#if defined(__AVX512F__)
#define FPQ_PEAK_ZMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define FPQ_PEAK_BF16_DOT 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define FPQ_PEAK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace fpq {
namespace {

// One loop: `steps` rounds of one instruction on each accumulator; returns a value that depends on every
// accumulator (so that nothing is dropped).
using Loop = float (*)(int64_t steps);

#if defined(FPQ_PEAK_X86)

constexpr int kYmmAccumulators = 12;  // of 16 ymm registers: the chains and the two operands
constexpr int kZmmAccumulators = 24;  // of 32 zmm registers
constexpr int kAmxAccumulators = 6;   // of 8 tiles: the accumulators and the two source tiles

__attribute__((target("avx2,fma"))) float fma_ymm_loop(int64_t steps)
{
    const __m256 a = _mm256_set1_ps(0.5f);
    const __m256 b = _mm256_set1_ps(0.5f);
    __m256 acc[kYmmAccumulators];
#pragma GCC unroll 32
    for (int i = 0; i < kYmmAccumulators; ++i) { acc[i] = _mm256_set1_ps(float(i)); }
    for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 32
        for (int i = 0; i < kYmmAccumulators; ++i) { acc[i] = _mm256_fmadd_ps(acc[i], a, b); }
    }
    __m256 sum = acc[0];
#pragma GCC unroll 32
    for (int i = 1; i < kYmmAccumulators; ++i) { sum = _mm256_add_ps(sum, acc[i]); }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    return lanes[0];
}

#if defined(FPQ_PEAK_ZMM)
// kZmmAccumulators chains of `step` (acc -> acc'), `steps` rounds, on zmm registers.
template <class Step>
float zmm_chains(int64_t steps, Step step)
{
    __m512 acc[kZmmAccumulators];
#pragma GCC unroll 32
    for (int i = 0; i < kZmmAccumulators; ++i) { acc[i] = _mm512_set1_ps(float(i)); }
    for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 32
        for (int i = 0; i < kZmmAccumulators; ++i) { acc[i] = step(acc[i]); }
    }
    __m512 sum = acc[0];
#pragma GCC unroll 32
    for (int i = 1; i < kZmmAccumulators; ++i) { sum = _mm512_add_ps(sum, acc[i]); }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, sum);
    return lanes[0];
}

float fma_zmm_loop(int64_t steps)
{
    const __m512 half = _mm512_set1_ps(0.5f);
    return zmm_chains(steps, [half](__m512 acc) { return _mm512_fmadd_ps(acc, half, half); });
}
#endif

#if defined(FPQ_PEAK_BF16_DOT)
float bf16_dot_zmm_loop(int64_t steps)
{
    // 32-bit lanes of bf16 pairs, low half first: (1.0, -1.0) = 0xBF80'3F80 and (1.0, 1.0) = 0x3F80'3F80.
    const __m512bh x = (__m512bh)_mm512_set1_epi32(int32_t(0xBF803F80u));
    const __m512bh y = (__m512bh)_mm512_set1_epi32(int32_t(0x3F803F80u));
    return zmm_chains(steps, [x, y](__m512 acc) { return _mm512_dpbf16_ps(acc, x, y); });
}
#endif

#if defined(FPQ_PEAK_AMX)
// The tile configuration of ldtilecfg (palette 1): every tile 16 rows of 64 bytes. tdpbf16ps then multiplies
// A (16 x 32 bf16) by B (16 rows of 16 bf16 pairs) into C (16 x 16 fp32): 16 * 16 * 32 multiply-adds.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

constexpr int kTileRows = 16;
constexpr int kTileBytesPerRow = 64;

// The instructions are written as asm with memory operands the compiler sees (GCC 12's _tile_loadconfig and
// _tile_loadd name fewer bytes than they read, so stores into the buffers could be moved past them).
float amx_bf16_loop(int64_t steps)
{
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = kTileBytesPerRow;
        cfg.rows[t] = kTileRows;
    }
    alignas(64) uint16_t a[kTileRows * kTileBytesPerRow / 2];
    alignas(64) uint16_t b[kTileRows * kTileBytesPerRow / 2];
    alignas(64) float c[kTileRows * kTileBytesPerRow / 4];
    for (int i = 0; i < kTileRows * kTileBytesPerRow / 2; ++i) {
        a[i] = 0x3F80;                         // 1.0
        b[i] = (i % 2 == 0) ? 0x3F80 : 0xBF80;  // pairs (1.0, -1.0): each pair's products add to 0
    }
    const long stride = kTileBytesPerRow;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm6" : : "r"(a), "r"(stride), "m"(a));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm7" : : "r"(b), "r"(stride), "m"(b));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\t"
                     "tilezero %%tmm3\n\ttilezero %%tmm4\n\ttilezero %%tmm5" ::);
    for (int64_t s = 0; s < steps; ++s) {
        // AT&T order: B, A, C (Intel: tdpbf16ps C, A, B).
        __asm__ volatile("tdpbf16ps %%tmm7, %%tmm6, %%tmm0\n\t"
                         "tdpbf16ps %%tmm7, %%tmm6, %%tmm1\n\t"
                         "tdpbf16ps %%tmm7, %%tmm6, %%tmm2\n\t"
                         "tdpbf16ps %%tmm7, %%tmm6, %%tmm3\n\t"
                         "tdpbf16ps %%tmm7, %%tmm6, %%tmm4\n\t"
                         "tdpbf16ps %%tmm7, %%tmm6, %%tmm5" ::);
    }
    float sum = 0.0f;
#define FPQ_AMX_STORE(tile)                                                                                     \
    __asm__ volatile("tilestored %%tmm" #tile ", (%1,%2,1)" : "=m"(c) : "r"(c), "r"(stride));                   \
    sum += c[0];
    FPQ_AMX_STORE(0) FPQ_AMX_STORE(1) FPQ_AMX_STORE(2) FPQ_AMX_STORE(3) FPQ_AMX_STORE(4) FPQ_AMX_STORE(5)
#undef FPQ_AMX_STORE
    __asm__ volatile("tilerelease" ::);
    return sum;
}

}  // namespace

// Linux's per-process permission for the AMX tile data (fp_peak_cpu.h).
std::string amx_permission()
{
    constexpr long kArchGetXcompSupp = 0x1021;  // arch_prctl codes of asm/prctl.h (Linux 5.16+)
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    static std::once_flag once;
    static std::string why;
    std::call_once(once, [] {
        uint64_t supported = 0;
        if (syscall(SYS_arch_prctl, kArchGetXcompSupp, &supported) != 0) {
            why = std::string("arch_prctl(ARCH_GET_XCOMP_SUPP) failed: ") + std::strerror(errno) +
                  " (a Linux kernel before 5.16 has no AMX support)";
        } else if (!(supported & (uint64_t(1) << kXfeatureXtiledata))) {
            why = "the kernel does not enable the AMX tile data (XFEATURE_XTILEDATA)";
        } else if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
            why = std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) refused: ") + std::strerror(errno);
        }
    });
    return why;
}

namespace {
#endif

#endif  // FPQ_PEAK_X86

struct LoopEntry {
    PeakKind kind;
    Loop loop;
};

std::vector<LoopEntry> loops()
{
    std::vector<LoopEntry> out;
#if defined(FPQ_PEAK_X86)
    __builtin_cpu_init();
    const char* no_cpu = "this CPU lacks ";
    out.push_back({{"fp32_fma_ymm", "vfmadd231ps ymm", 8 * 2.0, kYmmAccumulators,
                    (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
                        ? "" : std::string(no_cpu) + "AVX2 + FMA"},
                   fma_ymm_loop});
#if defined(FPQ_PEAK_ZMM)
    // __builtin_cpu_supports reports AVX-512 only where the OS also enables the zmm state (xgetbv).
    out.push_back({{"fp32_fma_zmm", "vfmadd231ps zmm", 16 * 2.0, kZmmAccumulators,
                    __builtin_cpu_supports("avx512f") ? "" : std::string(no_cpu) + "AVX-512F (or the OS disables it)"},
                   fma_zmm_loop});
#endif
#if defined(FPQ_PEAK_BF16_DOT)
    out.push_back({{"bf16_dot_zmm", "vdpbf16ps zmm", 16 * 2 * 2.0, kZmmAccumulators,
                    (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"))
                        ? "" : std::string(no_cpu) + "AVX-512 BF16 (or the OS disables it)"},
                   bf16_dot_zmm_loop});
#endif
#if defined(FPQ_PEAK_AMX)
    {
        std::string why;
        if (!(__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16"))) {
            why = std::string(no_cpu) + "AMX-TILE + AMX-BF16";
        } else {
            why = amx_permission();
        }
        out.push_back({{"amx_bf16", "tdpbf16ps", kTileRows * 16 * 32 * 2.0, kAmxAccumulators, why}, amx_bf16_loop});
    }
#endif
#endif
    return out;
}

volatile float g_sink = 0.0f;  // where the loops' results go, so that none is dropped

double now_seconds()
{
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// (GFLOP/s, seconds) of one run: every thread starts after a barrier and times its own loop; the rate is the
// flops of all threads over the slowest thread's time.
std::pair<double, double> timed_run(Loop loop, double flops_per_step, int threads, int64_t steps)
{
    std::vector<double> seconds(threads, 0.0);
    std::vector<float> results(threads, 0.0f);
    int ran = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        ran = omp_get_num_threads();
        // (the implicit barrier at the end of `single`: every thread starts its loop here)
        const double t0 = now_seconds();
        const float r = loop(steps);
        seconds[omp_get_thread_num()] = now_seconds() - t0;
        results[omp_get_thread_num()] = r;
    }
    float sum = 0.0f;
    for (float r : results) { sum += r; }
    g_sink = sum;
    const double slowest = *std::max_element(seconds.begin(), seconds.begin() + ran);
    return {ran * double(steps) * flops_per_step / std::max(slowest, 1e-9) / 1e9, slowest};
}

}  // namespace

std::vector<PeakKind> peak_kinds()
{
    std::vector<PeakKind> out;
    for (const auto& entry : loops()) { out.push_back(entry.kind); }
    return out;
}

double peak_gflops(const std::string& kind, int threads, double min_seconds, int trials)
{
    if (threads < 1) { throw std::invalid_argument("threads=" + std::to_string(threads) + ": must be >= 1"); }
    if (trials < 1) { throw std::invalid_argument("trials=" + std::to_string(trials) + ": must be >= 1"); }
    if (!(min_seconds > 0.0 && min_seconds <= 10.0)) {
        throw std::invalid_argument("min_seconds=" + std::to_string(min_seconds) + ": must be in (0, 10]");
    }
    std::string names;
    for (const auto& entry : loops()) {
        names += (names.empty() ? "" : ", ") + entry.kind.name;
        if (entry.kind.name != kind) { continue; }
        if (!entry.kind.unavailable.empty()) {
            throw std::invalid_argument("kind='" + kind + "' cannot run here: " + entry.kind.unavailable);
        }
        const double flops_per_step = entry.kind.flops_per_instruction * entry.kind.accumulators;
        // size the loop: grow the steps until one run takes a tenth of min_seconds (the warm-up: it also wakes
        // the wide units and their clocks), then scale them to min_seconds
        int64_t steps = 256;
        double seconds = timed_run(entry.loop, flops_per_step, threads, steps).second;
        while (seconds < 0.1 * min_seconds) {
            steps = seconds > 1e-4 ? int64_t(double(steps) * 0.12 * min_seconds / seconds) + 1 : steps * 8;
            seconds = timed_run(entry.loop, flops_per_step, threads, steps).second;
        }
        steps = int64_t(double(steps) * min_seconds / seconds) + 1;
        double best = 0.0;
        for (int t = 0; t < trials; ++t) {
            best = std::max(best, timed_run(entry.loop, flops_per_step, threads, steps).first);
        }
        return best;
    }
    throw std::invalid_argument("kind='" + kind + "' is not a peak loop of this build; allowed: " +
                                (names.empty() ? std::string("none (not an x86-64 build)") : names));
}

}  // namespace fpq
