// ScopedIeeeDenormals: IEEE subnormals on the calling CPU thread while in scope (SPEC 3.1: no
// backend flushes subnormals), shared by the CPU kernels. No torch includes.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace fpq {

// Clears flush-to-zero / denormals-are-zero for the calling thread while in scope (SPEC 3.1:
// no backend flushes subnormals), e.g. after torch.set_flush_denormal(True); restores on exit.
class ScopedIeeeDenormals {
public:
    ScopedIeeeDenormals()
    {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
        saved_ = _mm_getcsr();
        _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
#elif defined(__aarch64__)
        __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
        const uint64_t cleared = saved_ & ~kFpcrFz;
        __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
#endif
    }
    ~ScopedIeeeDenormals()
    {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
        _mm_setcsr(saved_);
#elif defined(__aarch64__)
        __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
    }
    ScopedIeeeDenormals(const ScopedIeeeDenormals&) = delete;
    ScopedIeeeDenormals& operator=(const ScopedIeeeDenormals&) = delete;

private:
#if defined(__aarch64__)
    static constexpr uint64_t kFpcrFz = uint64_t(1) << 24;
    uint64_t saved_ = 0;
#else
    static constexpr unsigned kFlushToZero = 0x8000u;      // MXCSR bit 15
    static constexpr unsigned kDenormalsAreZero = 0x0040u;  // MXCSR bit 6
    unsigned saved_ = 0;
#endif
};

}  // namespace fpq
