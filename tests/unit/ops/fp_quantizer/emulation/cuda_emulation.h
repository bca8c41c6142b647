// A CPU emulation of the CUDA launch model, enough to execute this project's kernels as plain C++
// (g++, no CUDA runtime): include this first, then the kernel headers (csrc/fp_quantizer/includes/
// fp_quantize_kernels.cuh, fp_gemv_kernels.cuh), and run a launch with fpq_emu::launch(grid, block, body).
//
// - Every CUDA thread is a fiber with its own stack (a 20-instruction context switch on x86-64, ucontext
//   elsewhere; annotated for AddressSanitizer either way); a block's fibers run on one host
//   thread, each until it reaches a barrier. Warps are real groups of 32 lanes (linear thread index
//   / 32). Blocks run one after another, in an order the caller picks (forward or reverse).
// - __shfl_*_sync: every lane named in the mask deposits its value and waits until all of them have
//   arrived at the same shuffle (same call site, kind, mask and width); then each reads its source
//   lane. A mask that does not name the calling lane, a named lane that has exited or waits at a
//   different barrier, or a source lane outside the mask is reported (undefined on a GPU).
// - __syncthreads waits for every thread of the block that has not exited; a barrier nobody can
//   pass (a deadlock) is reported with where each thread waits.
// - __CUDA_ARCH__ is whatever the build defines (-D__CUDA_ARCH__=900, 890, or unset for the
//   software paths). The fp8 conversion intrinsic of sm_89+ is written from the PTX ISA's definition
//   of cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32, independently of the project's codec: round to nearest
//   even, |x| above the largest finite value (Inf included) gives the sign-preserved largest finite
//   value, NaN gives the NaN code 0x7F; input a (the float2's .y) goes to the upper byte.
// - Vector types carry CUDA's alignment (uint4/float4: 16 bytes, uint2: 8), so a vector access through a
//   misaligned pointer is reported by -fsanitize=alignment, as it faults on a GPU.
// - The GEMV's intrinsics, each from its PTX ISA definition: __byte_perm (prmt.b32, default mode: result byte n is
//   byte s[4n+2:4n] of {y, x}; a selector nibble with bit 3 set, where prmt and the CUDA documentation of
//   __byte_perm disagree, is reported), cvt.rn.f16x2.e4m3x2 (__nv_cvt_fp8x2_to_halfraw2: exact, NaN to NaN, the
//   upper byte to the upper half), mul.rn.f16x2 (__hmul2: IEEE binary16 product rounded to nearest even,
//   subnormals kept, NaN canonical 0x7FFF), cvt.f32.f16 (__low2float / __high2float: exact).
// - Dynamic shared memory (FPQ_DYNAMIC_SHARED, the kernels' `extern __shared__`): one heap buffer of exactly the
//   launch's bytes per block (ASan reports any access past it), filled with 0xFF (fp32 NaN) before each block
//   runs, so a read before the writes a __syncthreads should have waited for shows up as NaN.
// - The tensor-core GEMV's intrinsics, each from the PTX ISA: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} (a
//   warp collective: every lane's A, B and C fragments placed by the ISA's "Matrix Fragments for mma.m16n8k16 with
//   floating point type", every output computed with the worst case SPEC 8.2 allows: exact products, added to the
//   accumulator in blocks of 8, the terms aligned to the largest exponent and truncated to 24 bits, the sum truncated
//   to fp32), cp.async.cg.shared.global 16 with src-size zero fill and commit_group / wait_group (a copy poisons its
//   destination with 0xFF when issued and lands only at the wait_group that covers its group: a read before the wait,
//   or a stage refilled while another warp still reads it, sees the poison; copies still pending when a thread exits
//   are reported), mul.rn.bf16x2 (__hmul2 of __nv_bfloat162: RNE, bf16 subnormals kept), cvt.rn.bf16x2.f32
//   (__floats2bfloat162_rn), atomicAdd on int, __threadfence, ld.global.cg (__ldcg), mul.hi.u32 (__umulhi).
// Every reported fault prints "cuda-emulation: ..." on stderr and aborts the process.
#pragma once

#define FPQ_CUDA_EMULATION 1

#include <ucontext.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FPQ_EMU_ASAN 1
#endif

// ---- qualifiers ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

// ---- vector types (CUDA's sizes and alignments) -------------------------------------------------
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ---- math: IEEE round-to-nearest fp32 operations (build with -ffp-contract=off) -----------------
// A NaN result is the canonical NaN 0x7FFFFFFF, as on NVIDIA GPUs (the CUDA C++ Programming Guide,
// floating-point standard appendix: NaN payloads are not propagated); the host would keep the payload.
inline float fpq_emu_canonical(float r)
{
    const float nan = __builtin_bit_cast(float, 0x7fffffffu);
    return r != r ? nan : r;
}
inline float __fmul_rn(float a, float b) { return fpq_emu_canonical(a * b); }
inline float __fadd_rn(float a, float b) { return fpq_emu_canonical(a + b); }
inline float __fsub_rn(float a, float b) { return fpq_emu_canonical(a - b); }
inline float __fdiv_rn(float a, float b) { return fpq_emu_canonical(a / b); }
inline float __fmaf_rn(float a, float b, float c) { return fpq_emu_canonical(std::fmaf(a, b, c)); }
inline unsigned __float_as_uint(float f)
{
    unsigned u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}
inline float __uint_as_float(unsigned u)
{
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}

// CUDA's overloaded min/max of the device math API.
#define FPQ_EMU_MINMAX(T)                                \
    inline T min(T a, T b) { return b < a ? b : a; }     \
    inline T max(T a, T b) { return a < b ? b : a; }
FPQ_EMU_MINMAX(int)
FPQ_EMU_MINMAX(unsigned)
FPQ_EMU_MINMAX(long)
FPQ_EMU_MINMAX(unsigned long)
FPQ_EMU_MINMAX(long long)
FPQ_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fpq_emu_canonical(std::fmin(a, b)); }
inline float max(float a, float b) { return fpq_emu_canonical(std::fmax(a, b)); }
#undef FPQ_EMU_MINMAX

// ---- fp8 conversion of sm_89+ (cuda_fp8.h names) ------------------------------------------------
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_saturation_t { __NV_NOSAT = 0, __NV_SATFINITE = 1 };
enum __nv_fp8_interpretation_t { __NV_E4M3 = 0, __NV_E5M2 = 1 };

namespace fpq_emu {

[[noreturn]] inline void fail(const char* fmt, ...)
{
    std::fprintf(stderr, "cuda-emulation: ");
    va_list args;
    va_start(args, fmt);
    std::vfprintf(stderr, fmt, args);
    va_end(args);
    std::fprintf(stderr, "\n");
    std::fflush(stderr);
    std::abort();
}

// cvt.rn.satfinite.{e4m3,e5m2}.f32 of one value (PTX ISA, "cvt"): the finite code nearest to x,
// ties to the even code; |x| > MAX_NORM (Inf too) gives the sign-preserved MAX_NORM; NaN gives 0x7F.
// Found by searching the format's finite values, computed exactly in double.
// How many values went through the emulated hardware conversion (the tests check the sm_89+ branch ran).
inline uint64_t& fp8_conversions()
{
    static uint64_t count = 0;
    return count;
}

inline uint8_t cvt_rn_satfinite_fp8(float x, __nv_fp8_interpretation_t interp)
{
    ++fp8_conversions();
    const bool e4m3 = interp == __NV_E4M3;
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const unsigned max_code = e4m3 ? 0x7e : 0x7b;  // 448 and 57344
    if (std::isnan(x)) { return 0x7f; }
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    auto value = [&](unsigned c) {
        const unsigned e = c >> mbits, m = c & ((1u << mbits) - 1);
        return e == 0 ? std::ldexp(double(m), 1 - bias - mbits) : std::ldexp(1.0 + std::ldexp(double(m), -mbits), int(e) - bias);
    };
    const double a = std::fabs(double(x));
    if (a >= value(max_code)) { return uint8_t(sign | max_code); }
    unsigned lo = 0;
    while (value(lo + 1) <= a) { ++lo; }  // value(lo) <= a < value(lo + 1)
    const double below = a - value(lo), above = value(lo + 1) - a;
    const unsigned code = below < above ? lo : (above < below ? lo + 1 : ((lo & 1u) ? lo + 1 : lo));
    return uint8_t(sign | code);
}

}  // namespace fpq_emu

inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t saturate,
                                                    __nv_fp8_interpretation_t interp)
{
    if (saturate != __NV_SATFINITE) { fpq_emu::fail("__nv_cvt_float2_to_fp8x2 is emulated for __NV_SATFINITE only"); }
    return __nv_fp8x2_storage_t(fpq_emu::cvt_rn_satfinite_fp8(x.y, interp) << 8 |
                                fpq_emu::cvt_rn_satfinite_fp8(x.x, interp));
}

// ---- f16 pairs, byte permute, fp8 -> f16 (the GEMV's intrinsics) --------------------------------
struct alignas(4) __half2 {
    unsigned short x, y;  // bits of the low and the high half
};
struct __half2_raw {
    unsigned short x, y;
};

namespace fpq_emu {

// The value of binary16 bits, exactly (every f16 is a double).
inline double f16_value(unsigned short h)
{
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0x1f) { return m ? std::nan("") : sign * INFINITY; }
    return sign * (e == 0 ? std::ldexp(double(m), -24) : std::ldexp(1024.0 + m, e - 25));
}

// binary16 bits of v rounded to nearest, ties to even (IEEE 754; overflow to Inf; NaN canonical 0x7FFF).
inline unsigned short f16_round(double v)
{
    if (std::isnan(v)) { return 0x7fff; }
    const unsigned short sign = std::signbit(v) ? 0x8000 : 0;
    const double a = std::fabs(v);
    if (a >= 65520.0) { return sign | 0x7c00; }  // 65504 + half an ulp (32) ties to even: Inf
    if (a == 0.0) { return sign; }
    int e;
    std::frexp(a, &e);                       // a = f 2^e, f in [0.5, 1): the leading bit is 2^(e-1)
    const int quantum = std::max(e - 11, -24);  // 10 fraction bits; the subnormal step 2^-24
    const double r = std::nearbyint(std::ldexp(a, -quantum)) * std::ldexp(1.0, quantum);  // default mode: RNE
    if (r == 0.0) { return sign; }
    std::frexp(r, &e);
    if (e - 1 < -14) { return sign | (unsigned short)std::ldexp(r, 24); }
    return sign | (unsigned short)((e - 1 + 15) << 10) | (unsigned short)(std::ldexp(r, 11 - e) - 1024.0);
}

// cvt.rn.f16x2.e4m3x2 / .e5m2x2 of one byte: the fp8 value (exact in f16), NaN to the canonical f16 NaN.
inline unsigned short fp8_to_f16(unsigned byte, bool e4m3)
{
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const unsigned e = (byte >> mbits) & (e4m3 ? 0xfu : 0x1fu), m = byte & ((1u << mbits) - 1);
    const double sign = (byte & 0x80) ? -1.0 : 1.0;
    if (e4m3 ? (byte & 0x7f) == 0x7f : e == 0x1f) {
        return (e4m3 || m) ? (unsigned short)0x7fff : (unsigned short)((byte & 0x80) << 8 | 0x7c00);
    }
    const double mag = e == 0 ? std::ldexp(double(m), 1 - bias - mbits)
                              : std::ldexp(1.0 + std::ldexp(double(m), -mbits), int(e) - bias);
    return f16_round(sign * mag);
}

}  // namespace fpq_emu

inline float __low2float(__half2 h) { return float(fpq_emu::f16_value(h.x)); }
inline float __high2float(__half2 h) { return float(fpq_emu::f16_value(h.y)); }
inline __half2 __hmul2(__half2 a, __half2 b)
{
    // the exact product of two binary16 values (11-bit significands) is a double; one rounding to binary16
    return {fpq_emu::f16_round(fpq_emu::f16_value(a.x) * fpq_emu::f16_value(b.x)),
            fpq_emu::f16_round(fpq_emu::f16_value(a.y) * fpq_emu::f16_value(b.y))};
}

inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t interp)
{
    const bool e4m3 = interp == __NV_E4M3;
    return {fpq_emu::fp8_to_f16(x & 0xffu, e4m3), fpq_emu::fp8_to_f16(unsigned(x) >> 8, e4m3)};
}

// bf16 pairs (cuda_bf16.h names): bits of the low and the high half.
struct alignas(4) __nv_bfloat162 {
    unsigned short x, y;
};

namespace fpq_emu {

inline double bf16_value(unsigned short h)
{
    const uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return double(f);  // every bf16 is a float
}

// bfloat16 bits of v rounded to nearest, ties to even (8 exponent bits, 7 fraction bits, subnormals down to 2^-133,
// overflow to Inf; NaN canonical 0x7FFF).
inline unsigned short bf16_round(double v)
{
    if (std::isnan(v)) { return 0x7fff; }
    const unsigned short sign = std::signbit(v) ? 0x8000 : 0;
    const double a = std::fabs(v);
    if (a >= std::ldexp(2.0 - std::ldexp(1.0, -8), 127)) { return sign | 0x7f80; }  // max + half an ulp: ties to Inf
    if (a == 0.0) { return sign; }
    int e;
    std::frexp(a, &e);                          // leading bit 2^(e-1)
    const int quantum = std::max(e - 8, -133);  // 7 fraction bits; the subnormal step 2^-133
    const double r = std::nearbyint(std::ldexp(a, -quantum)) * std::ldexp(1.0, quantum);
    if (r == 0.0) { return sign; }
    std::frexp(r, &e);
    if (e - 1 < -126) { return sign | (unsigned short)std::ldexp(r, 133); }
    return sign | (unsigned short)((e - 1 + 127) << 7) | (unsigned short)(std::ldexp(r, 8 - e) - 128.0);
}

}  // namespace fpq_emu

// mul.rn.bf16x2: each half the exact product (a double) rounded once to bf16, subnormals kept.
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b)
{
    return {fpq_emu::bf16_round(fpq_emu::bf16_value(a.x) * fpq_emu::bf16_value(b.x)),
            fpq_emu::bf16_round(fpq_emu::bf16_value(a.y) * fpq_emu::bf16_value(b.y))};
}

// cvt.rn.bf16x2.f32: lo to the low half, hi to the high half, each rounded to nearest even.
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi)
{
    return {fpq_emu::bf16_round(double(lo)), fpq_emu::bf16_round(double(hi))};
}

inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }

inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s)
{
    const uint64_t bytes = uint64_t(y) << 32 | x;  // byte 0..3 of x, 4..7 of y
    unsigned out = 0;
    for (int n = 0; n < 4; ++n) {
        const unsigned sel = (s >> (4 * n)) & 0xfu;
        if (sel & 8u) {
            fpq_emu::fail("__byte_perm selector 0x%04x: nibble %d has bit 3 set (prmt's sign-replicate mode; "
                          "__byte_perm is documented to use the low 3 bits only)", s & 0xffffu, n);
        }
        out |= unsigned((bytes >> (8 * sel)) & 0xffu) << (8 * n);
    }
    return out;
}

// ---- fiber contexts ------------------------------------------------------------------------------
namespace fpq_emu {

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the stack
// pointer in *from, and resumes the context whose stack pointer is `to` (System V x86-64). No system call
// and no sanitizer interceptor, unlike swapcontext: a block of 256 fibers switches millions of times.
extern "C" void fpq_emu_switch(void** from, void* to);
asm(R"(
    .text
    .globl fpq_emu_switch
    .type fpq_emu_switch, @function
fpq_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size fpq_emu_switch, .-fpq_emu_switch
)");

struct Context {
    void* sp = nullptr;
};

inline void context_switch(Context& from, Context& to) { fpq_emu_switch(&from.sp, to.sp); }

// A context that starts `entry` (which must never return) on [stack, stack + size).
inline void context_init(Context& c, void* stack, size_t size, void (*entry)())
{
    auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15));
    uint64_t* sp = top - 9;  // the frame fpq_emu_switch pops: control words, 6 registers, return address
    uint32_t mxcsr;
    uint16_t fpcw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpcw));
    sp[0] = uint64_t(mxcsr) | uint64_t(fpcw) << 32;
    for (int i = 1; i <= 6; ++i) { sp[i] = 0; }
    sp[7] = reinterpret_cast<uint64_t>(entry);  // `ret` enters it with rsp = top - 8, as after a call
    sp[8] = 0;
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};

inline void context_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void context_init(Context& c, void* stack, size_t size, void (*entry)())
{
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

}  // namespace fpq_emu

// ---- the launch model ---------------------------------------------------------------------------
namespace fpq_emu {

constexpr int kWarpSize = 32;
constexpr size_t kStackBytes = size_t(64) << 10;

enum class State { kRunnable, kShuffle, kSync, kExited };
enum class ShflKind { kIdx, kUp, kDown, kXor, kSyncWarp, kMma };
inline const char* kind_name(ShflKind k)
{
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__syncwarp", "mma.sync.aligned.m16n8k16"};
    return names[int(k)];
}

// One cp.async: its destination in shared memory and the bytes it will write there (src-size bytes of the source,
// read when issued (inputs are read-only), then zeros).
struct AsyncCopy {
    unsigned char* dst;
    unsigned char bytes[16];
    int size;
};

struct Thread {
    Context context;
    void* stack = nullptr;  // usable stack (above a PROT_NONE guard page)
    uint3 thread_idx{};
    State state = State::kRunnable;
    // the shuffle this thread waits in
    ShflKind kind = ShflKind::kXor;
    unsigned mask = 0;
    int arg = 0, width = kWarpSize, line = 0;
    const char* file = "";
    uint64_t value = 0, result = 0;
    // the fragments of the mma.sync this thread waits in (A: 4 registers, B: 2, C and D: 4 floats)
    uint32_t mma_a[4] = {}, mma_b[2] = {};
    float mma_c[4] = {}, mma_d[4] = {};
    // cp.async: the copies issued since the last commit_group, and the committed groups not yet waited for (oldest
    // first)
    std::vector<AsyncCopy> cp_open;
    std::vector<std::vector<AsyncCopy>> cp_groups;
#if defined(FPQ_EMU_ASAN)
    void* fake_stack = nullptr;
#endif
};

struct Launch {
    dim3 grid, block;
    uint3 block_idx{};
    std::vector<Thread> threads;
    Thread* current = nullptr;
    Context scheduler;
    Context finished;  // where an exiting thread's last context is saved (never resumed)
    const std::function<void()>* body = nullptr;
    std::vector<unsigned char>* shared = nullptr;  // the block's dynamic shared memory (exact size)
#if defined(FPQ_EMU_ASAN)
    const void* scheduler_stack = nullptr;
    size_t scheduler_stack_size = 0;
#endif
    uint64_t switches = 0;
};

inline Launch*& active()
{
    static Launch* launch = nullptr;
    return launch;
}

inline Thread& self()
{
    Launch* l = active();
    if (l == nullptr || l->current == nullptr) { fail("a device builtin was used outside a kernel launch"); }
    return *l->current;
}

inline const uint3& thread_idx() { return self().thread_idx; }
inline const uint3& block_idx() { return active()->block_idx; }
inline const dim3& block_dim() { return active()->block; }
inline const dim3& grid_dim() { return active()->grid; }

inline int linear_tid(const Thread& t)
{
    const dim3& b = active()->block;
    return int(t.thread_idx.x + b.x * (t.thread_idx.y + b.y * t.thread_idx.z));
}

// Fiber -> scheduler; returns when the scheduler resumes this thread.
inline void yield_to_scheduler()
{
    Launch* l = active();
    Thread& t = *l->current;
#if defined(FPQ_EMU_ASAN)
    __sanitizer_start_switch_fiber(&t.fake_stack, l->scheduler_stack, l->scheduler_stack_size);
#endif
    context_switch(t.context, l->scheduler);
#if defined(FPQ_EMU_ASAN)
    __sanitizer_finish_switch_fiber(t.fake_stack, &l->scheduler_stack, &l->scheduler_stack_size);
#endif
}

inline void describe(const Thread& t, char* buf, size_t n)
{
    const char* what = t.state == State::kRunnable ? "runnable"
                       : t.state == State::kExited ? "exited"
                       : t.state == State::kSync   ? "__syncthreads"
                                                   : kind_name(t.kind);
    std::snprintf(buf, n, "thread %d (warp %d lane %d): %s", linear_tid(t), linear_tid(t) / kWarpSize,
                  linear_tid(t) % kWarpSize, what);
    if (t.state == State::kShuffle) {
        const size_t used = std::strlen(buf);
        std::snprintf(buf + used, n - used, " mask 0x%08x at %s:%d", t.mask, t.file, t.line);
    }
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 ------------------------------------------------
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), groupID = lane >> 2,
// threadID_in_group = lane % 4; a register's lower 16 bits hold the element of lower index:
//   A (16 x 16, row): a_i (i = 0..7, registers a[i / 2]) at row groupID for i in {0, 1, 4, 5}, groupID + 8 otherwise,
//     column threadID_in_group * 2 + (i & 1), + 8 for i >= 4;
//   B (16 x 8, col): b_i (i = 0..3, registers b[i / 2]) at row threadID_in_group * 2 + (i & 1), + 8 for i >= 2,
//     column groupID;
//   C, D (16 x 8): c_i (i = 0..3) at row groupID, + 8 for i >= 2, column threadID_in_group * 2 + (i & 1).
// Arithmetic: PTX leaves the accumulation's order, rounding and subnormal handling unspecified ("at least single
// precision"); this executes the worst case SPEC 8.2 allows: each product exact (a double), the products added to
// the accumulator in blocks of kMmaBlock, each block's terms (the accumulator and its products) aligned to the largest
// exponent among them and truncated toward zero to 24 bits below that exponent's leading bit (no extra alignment bits),
// summed exactly, and the sum truncated toward zero to fp32 (subnormal results kept: multiples of 2^-149). A NaN
// operand or product, or Inf with -Inf, gives NaN (canonical); Inf otherwise stays.
constexpr int kMmaBlock = 8;

inline float fp32_toward_zero(double v)  // v exact in double
{
    if (v == 0.0) { return 0.0f; }
    const double a = std::fabs(v);
    int e;
    std::frexp(a, &e);  // leading bit 2^(e-1)
    if (e - 1 > 127) { return std::signbit(v) ? -INFINITY : INFINITY; }
    const int quantum = std::max(e - 24, -149);
    const double t = std::floor(std::ldexp(a, -quantum)) * std::ldexp(1.0, quantum);
    return float(std::signbit(v) ? -t : t);
}

inline float mma_output(float c, const double (&products)[16])
{
    bool nan = std::isnan(c), pos_inf = c == INFINITY, neg_inf = c == -INFINITY;
    for (double q : products) { nan |= std::isnan(q), pos_inf |= q == INFINITY, neg_inf |= q == -INFINITY; }
    if (nan || (pos_inf && neg_inf)) { return __builtin_bit_cast(float, 0x7fffffffu); }
    if (pos_inf || neg_inf) { return pos_inf ? INFINITY : -INFINITY; }
    float acc = c;
    for (int b0 = 0; b0 < 16; b0 += kMmaBlock) {
        double terms[kMmaBlock + 1];
        terms[0] = double(acc);
        for (int i = 0; i < kMmaBlock; ++i) { terms[1 + i] = products[b0 + i]; }
        int top = INT32_MIN;
        for (double t : terms) {
            if (t != 0.0) {
                int e;
                std::frexp(std::fabs(t), &e);
                top = std::max(top, e - 1);
            }
        }
        if (top == INT32_MIN) { continue; }  // nothing to add
        const double unit = std::ldexp(1.0, top - 23);
        double sum = 0.0;  // exact: at most 9 multiples of unit below 2^(top + 1)
        for (double t : terms) { sum += std::trunc(t / unit) * unit; }
        acc = fp32_toward_zero(sum);
    }
    return acc;
}

inline double mma_element(uint32_t reg, int half, bool bf16)
{
    const unsigned short bits = (unsigned short)(half ? reg >> 16 : reg & 0xffffu);
    return bf16 ? bf16_value(bits) : f16_value(bits);
}

inline void complete_mma(Thread* const (&lanes)[kWarpSize], bool bf16)
{
    double a[16][16], b[16][8];
    float c[16][8];
    for (int lane = 0; lane < kWarpSize; ++lane) {
        const Thread& t = *lanes[lane];
        const int group = lane >> 2, tig = lane & 3;
        for (int i = 0; i < 8; ++i) {
            const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8, col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
            a[row][col] = mma_element(t.mma_a[i / 2], i & 1, bf16);
        }
        for (int i = 0; i < 4; ++i) {
            b[tig * 2 + (i & 1) + (i >= 2 ? 8 : 0)][group] = mma_element(t.mma_b[i / 2], i & 1, bf16);
            c[group + (i >= 2 ? 8 : 0)][tig * 2 + (i & 1)] = t.mma_c[i];
        }
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
        Thread& t = *lanes[lane];
        const int group = lane >> 2, tig = lane & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = group + (i >= 2 ? 8 : 0), col = tig * 2 + (i & 1);
            double products[16];
            for (int k = 0; k < 16; ++k) { products[k] = a[row][k] * b[k][col]; }  // exact: 8- or 11-bit significands
            t.mma_d[i] = mma_output(c[row][col], products);
        }
    }
}

// Releases the shuffle of `warp` when every lane of `me`'s mask waits in it; reports a mismatch.
inline void try_complete_shuffle(int warp, const Thread& me)
{
    Launch* l = active();
    Thread* lanes[kWarpSize] = {};  // threads are stored in linear thread index order
    for (int lane = 0; lane < kWarpSize && size_t(warp * kWarpSize + lane) < l->threads.size(); ++lane) {
        lanes[lane] = &l->threads[size_t(warp * kWarpSize + lane)];
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
        if (!(me.mask >> lane & 1u)) { continue; }
        Thread* t = lanes[lane];
        char buf[256];
        if (t == nullptr) { fail("%s at %s:%d: mask 0x%08x names lane %d, which does not exist in this block",
                                 kind_name(me.kind), me.file, me.line, me.mask, lane); }
        if (t->state == State::kExited || t->state == State::kSync) {
            describe(*t, buf, sizeof buf);
            fail("%s at %s:%d with mask 0x%08x in block (%u,%u,%u): %s", kind_name(me.kind), me.file, me.line,
                 me.mask, l->block_idx.x, l->block_idx.y, l->block_idx.z, buf);
        }
        if (t->state == State::kRunnable) { return; }  // not there yet
        if (t->kind != me.kind || t->mask != me.mask || t->width != me.width || t->line != me.line ||
            (t->file != me.file && std::strcmp(t->file, me.file) != 0)) {
            char mine[256];
            describe(*t, buf, sizeof buf);
            describe(me, mine, sizeof mine);
            fail("divergent warp-synchronous call in block (%u,%u,%u): %s; but %s", l->block_idx.x,
                 l->block_idx.y, l->block_idx.z, mine, buf);
        }
    }
    if (me.kind == ShflKind::kMma) {  // everyone is here: the warp's matrix multiply-accumulate
        complete_mma(lanes, me.arg != 0);
        for (int lane = 0; lane < kWarpSize; ++lane) { lanes[lane]->state = State::kRunnable; }
        return;
    }
    // everyone is here: each lane reads its source (CUDA's rules for width segments)
    for (int lane = 0; lane < kWarpSize; ++lane) {
        if (!(me.mask >> lane & 1u)) { continue; }
        Thread& t = *lanes[lane];
        // PTX shfl.sync: c = ((32 - width) << 8) | 31 gives maxLane = base | (width - 1); up/down/bfly
        // use the low 5 bits of the delta or lane mask; a source past maxLane (or below base for up)
        // reads the lane's own value; idx reads lane base + (srcLane mod width)
        const int w = t.width, base = lane & ~(w - 1), max_lane = base | (w - 1), b = t.arg & 31;
        int src = lane;
        switch (t.kind) {
            case ShflKind::kIdx: src = base + ((t.arg % w + w) % w); break;
            case ShflKind::kUp: src = lane - b >= base ? lane - b : lane; break;
            case ShflKind::kDown: src = lane + b <= max_lane ? lane + b : lane; break;
            case ShflKind::kXor: src = (lane ^ b) <= max_lane ? lane ^ b : lane; break;
            case ShflKind::kSyncWarp:
            case ShflKind::kMma: break;
        }
        if (!(me.mask >> src & 1u)) {
            fail("%s at %s:%d: lane %d reads lane %d, which mask 0x%08x does not name (undefined on a GPU)",
                 kind_name(t.kind), t.file, t.line, lane, src, t.mask);
        }
        t.result = lanes[src]->value;
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
        if (me.mask >> lane & 1u) { lanes[lane]->state = State::kRunnable; }
    }
}

template <class T>
T warp_exchange(ShflKind kind, unsigned mask, T var, int arg, int width, const char* file, int line)
{
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    Thread& me = self();
    const int lane = linear_tid(me) % kWarpSize;
    if (!(mask >> lane & 1u)) {
        fail("%s at %s:%d: lane %d calls it with mask 0x%08x, which does not name it", kind_name(kind), file, line,
             lane, mask);
    }
    if (width < 1 || width > kWarpSize || (width & (width - 1)) != 0) {
        fail("%s at %s:%d: width %d is not a power of two in [1, 32]", kind_name(kind), file, line, width);
    }
    me.kind = kind, me.mask = mask, me.arg = arg, me.width = width, me.file = file, me.line = line;
    me.value = 0;
    std::memcpy(&me.value, &var, sizeof(T));
    me.state = State::kShuffle;
    try_complete_shuffle(linear_tid(me) / kWarpSize, me);
    while (me.state != State::kRunnable) { yield_to_scheduler(); }
    T out;
    std::memcpy(&out, &me.result, sizeof(T));
    return out;
}

// The warp's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: every lane must take part (.aligned, full warp).
inline void mma_m16n8k16_f32(bool bf16, float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                             const float (&c)[4], const char* file = __builtin_FILE(), int line = __builtin_LINE())
{
    Thread& me = self();
    for (int i = 0; i < 4; ++i) { me.mma_a[i] = a[i], me.mma_c[i] = c[i]; }
    me.mma_b[0] = b0, me.mma_b[1] = b1;
    me.kind = ShflKind::kMma, me.mask = 0xffffffffu, me.arg = bf16 ? 1 : 0, me.width = kWarpSize;
    me.file = file, me.line = line;
    me.state = State::kShuffle;
    try_complete_shuffle(linear_tid(me) / kWarpSize, me);
    while (me.state != State::kRunnable) { yield_to_scheduler(); }
    for (int i = 0; i < 4; ++i) { d[i] = me.mma_d[i]; }
}

// cp.async.cg.shared.global [dst], [src], cp_size, src_size (cp_size 16): both addresses aligned to 16, dst inside the
// launch's dynamic shared memory. The destination reads as 0xFF until the copy lands.
inline void cp_async(void* dst, const void* src, int cp_size, unsigned src_size)
{
    Thread& me = self();
    Launch* l = active();
    auto* d = static_cast<unsigned char*>(dst);
    if (cp_size != 16 || src_size > 16) { fail("cp.async with cp-size %d, src-size %u (emulated: 16, <= 16)", cp_size, src_size); }
    if (l->shared == nullptr || d < l->shared->data() || d + 16 > l->shared->data() + l->shared->size()) {
        fail("cp.async destination %p outside the block's %zu bytes of dynamic shared memory", dst,
             l->shared ? l->shared->size() : size_t(0));
    }
    if (reinterpret_cast<uintptr_t>(d) % 16 || (src_size > 0 && reinterpret_cast<uintptr_t>(src) % 16)) {
        fail("cp.async of 16 bytes with a misaligned address (dst %p, src %p)", dst, src);
    }
    AsyncCopy copy{d, {}, 16};
    if (src_size > 0) { std::memcpy(copy.bytes, src, src_size); }
    std::memset(d, 0xff, 16);
    me.cp_open.push_back(copy);
}

inline void cp_async_commit_group()
{
    Thread& me = self();
    me.cp_groups.push_back(std::move(me.cp_open));
    me.cp_open.clear();
}

// cp.async.wait_group n: every committed group of this thread but the n most recent lands.
inline void cp_async_wait_group(int n)
{
    Thread& me = self();
    while (int(me.cp_groups.size()) > n) {
        for (const AsyncCopy& copy : me.cp_groups.front()) { std::memcpy(copy.dst, copy.bytes, size_t(copy.size)); }
        me.cp_groups.erase(me.cp_groups.begin());
    }
}

inline void release_sync_if_complete()
{
    Launch* l = active();
    for (const Thread& t : l->threads) {
        if (t.state != State::kSync && t.state != State::kExited) { return; }
    }
    for (Thread& t : l->threads) {
        if (t.state == State::kSync) { t.state = State::kRunnable; }
    }
}

inline void sync_threads()
{
    Thread& me = self();
    me.state = State::kSync;
    release_sync_if_complete();
    while (me.state != State::kRunnable) { yield_to_scheduler(); }
}

inline void thread_entry()
{
    Launch* l = active();
#if defined(FPQ_EMU_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &l->scheduler_stack, &l->scheduler_stack_size);
#endif
    (*l->body)();
    Thread& me = *l->current;
    if (!me.cp_open.empty() || !me.cp_groups.empty()) {
        fail("thread %d exited with %zu cp.async copies not committed and %zu commit groups not waited for",
             linear_tid(me), me.cp_open.size(), me.cp_groups.size());
    }
    me.state = State::kExited;
    release_sync_if_complete();
    // a shuffle that waits for this thread can never complete: report it now
    for (const Thread& t : l->threads) {
        if (t.state == State::kShuffle && linear_tid(t) / kWarpSize == linear_tid(me) / kWarpSize &&
            (t.mask >> (linear_tid(me) % kWarpSize) & 1u)) {
            char mine[256], theirs[256];
            describe(me, mine, sizeof mine);
            describe(t, theirs, sizeof theirs);
            fail("in block (%u,%u,%u) %s while %s waits for it", l->block_idx.x, l->block_idx.y, l->block_idx.z,
                 mine, theirs);
        }
    }
#if defined(FPQ_EMU_ASAN)
    __sanitizer_start_switch_fiber(nullptr, l->scheduler_stack, l->scheduler_stack_size);
#endif
    context_switch(l->finished, l->scheduler);
    fail("an exited thread was resumed");
}

// Stacks of one block's threads, kept across blocks and launches.
inline std::vector<void*>& stack_pool()
{
    static std::vector<void*> pool;
    return pool;
}

inline void* stack_for(size_t i)
{
    auto& pool = stack_pool();
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    while (pool.size() <= i) {
        void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (mem == MAP_FAILED) { fail("cannot map a thread stack"); }
        mprotect(mem, page, PROT_NONE);  // guard page: a stack overflow faults
        pool.push_back(static_cast<char*>(mem) + page);
    }
    return pool[i];
}

inline void run_block(Launch& l, uint3 block_idx, bool reverse)
{
    const int n = int(l.block.x * l.block.y * l.block.z);
    l.block_idx = block_idx;
    if (l.shared) { std::memset(l.shared->data(), 0xff, l.shared->size()); }  // stale shared memory reads as NaN
    l.threads.assign(size_t(n), Thread{});
    for (int i = 0; i < n; ++i) {
        Thread& t = l.threads[size_t(i)];
        t.thread_idx = {unsigned(i) % l.block.x, unsigned(i) / l.block.x % l.block.y, unsigned(i) / (l.block.x * l.block.y)};
        t.stack = stack_for(size_t(i));
#if defined(FPQ_EMU_ASAN)
        ASAN_UNPOISON_MEMORY_REGION(t.stack, kStackBytes);  // redzones of the frames of the last thread here
#endif
        context_init(t.context, t.stack, kStackBytes, thread_entry);
    }
    for (;;) {
        bool progress = false, done = true;
        for (int j = 0; j < n; ++j) {
            Thread& t = l.threads[size_t(reverse ? n - 1 - j : j)];
            if (t.state != State::kExited) { done = false; }
            if (t.state != State::kRunnable) { continue; }
            progress = true;
            l.current = &t;
            ++l.switches;
#if defined(FPQ_EMU_ASAN)
            void* fake = nullptr;
            __sanitizer_start_switch_fiber(&fake, t.stack, kStackBytes);
#endif
            context_switch(l.scheduler, t.context);
#if defined(FPQ_EMU_ASAN)
            __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
            l.current = nullptr;
        }
        if (done) { return; }
        if (!progress) {
            std::fprintf(stderr, "cuda-emulation: deadlock in block (%u,%u,%u):\n", block_idx.x, block_idx.y,
                         block_idx.z);
            for (const Thread& t : l.threads) {
                char buf[256];
                describe(t, buf, sizeof buf);
                if (t.state != State::kExited) { std::fprintf(stderr, "  %s\n", buf); }
            }
            fail("deadlock");
        }
    }
}

struct LaunchStats {
    uint64_t blocks = 0, threads = 0, switches = 0;
};

// Runs `body` (the kernel call) as every thread of every block of grid x block. Blocks run in order,
// or in reverse order (and each block's threads are first scheduled in reverse) when `reverse`.
inline LaunchStats launch(dim3 grid, dim3 block, const std::function<void()>& body, bool reverse = false,
                          size_t shared_bytes = 0)
{
    if (shared_bytes > (size_t(227) << 10)) { fail("launch with %zu bytes of dynamic shared memory (sm_90: <= 227 KiB)", shared_bytes); }
    if (block.x * block.y * block.z == 0 || block.x * block.y * block.z > 1024 || block.z > 64) {
        fail("launch with %u x %u x %u threads per block (allowed: 1..1024, z <= 64)", block.x, block.y, block.z);
    }
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
        fail("launch with a %u x %u x %u grid (invalid configuration on a GPU)", grid.x, grid.y, grid.z);
    }
    if (active() != nullptr) { fail("nested launch"); }
    Launch l;
    l.grid = grid, l.block = block, l.body = &body;
    std::vector<unsigned char> shared(shared_bytes);
    l.shared = shared_bytes ? &shared : nullptr;
    active() = &l;
    const uint64_t total = uint64_t(grid.x) * grid.y * grid.z;
    for (uint64_t i = 0; i < total; ++i) {
        const uint64_t b = reverse ? total - 1 - i : i;
        run_block(l, {unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / (uint64_t(grid.x) * grid.y))},
                  reverse);
    }
    active() = nullptr;
    return {total, total * block.x * block.y * block.z, l.switches};
}

}  // namespace fpq_emu

// ---- builtins --------------------------------------------------------------------------------------
#define threadIdx (::fpq_emu::thread_idx())
#define blockIdx (::fpq_emu::block_idx())
#define blockDim (::fpq_emu::block_dim())
#define gridDim (::fpq_emu::grid_dim())
#define warpSize 32

inline void __syncthreads() { fpq_emu::sync_threads(); }

// The kernel's dynamic shared memory: `type* name`, the launch's buffer (no launch gave any: reported).
namespace fpq_emu {
template <class T>
T* dynamic_shared()
{
    Launch* l = active();
    if (l == nullptr || l->shared == nullptr) { fail("dynamic shared memory used by a launch that has none"); }
    return reinterpret_cast<T*>(l->shared->data());
}
}  // namespace fpq_emu
#define FPQ_DYNAMIC_SHARED(type, name) type* name = ::fpq_emu::dynamic_shared<type>()

#define __shfl_sync(mask, var, lane, ...) \
    ::fpq_emu::warp_exchange(::fpq_emu::ShflKind::kIdx, mask, var, lane, FPQ_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, var, delta, ...) \
    ::fpq_emu::warp_exchange(::fpq_emu::ShflKind::kUp, mask, var, delta, FPQ_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, var, delta, ...) \
    ::fpq_emu::warp_exchange(::fpq_emu::ShflKind::kDown, mask, var, delta, FPQ_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, var, lane_mask, ...) \
    ::fpq_emu::warp_exchange(::fpq_emu::ShflKind::kXor, mask, var, lane_mask, FPQ_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __syncwarp(...) \
    (void)::fpq_emu::warp_exchange(::fpq_emu::ShflKind::kSyncWarp, FPQ_EMU_MASK(__VA_ARGS__), 0, 0, 32, __FILE__, __LINE__)
// the optional trailing width (default warpSize) and __syncwarp's optional mask (default all lanes)
#define FPQ_EMU_WIDTH(...) (::fpq_emu::optional_int(32, ##__VA_ARGS__))
#define FPQ_EMU_MASK(...) (unsigned(::fpq_emu::optional_int(int(0xffffffffu), ##__VA_ARGS__)))
namespace fpq_emu {
inline int optional_int(int fallback) { return fallback; }
inline int optional_int(int, int given) { return given; }
}  // namespace fpq_emu

// ---- global memory: blocks run one after another on one host thread, so atomics and fences are plain ----------------
inline int atomicAdd(int* address, int value)
{
    const int old = *address;
    *address = old + value;
    return old;
}
inline void __threadfence() {}
inline float __ldcg(const float* p) { return *p; }
