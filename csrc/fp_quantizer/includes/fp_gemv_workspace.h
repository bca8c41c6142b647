// The split-K arrival counters of the GEMV (fp_gemv_kernels.cuh), without a memset per call (issue 42). No CUDA or
// torch includes: the CUDA launcher (fp_quantize_cuda.cu) keeps one pool for the process with cudaMalloc'ed memory,
// the CPU emulation of the tests one with heap memory.
//
// One buffer of int counters per (device, stream), zero-filled once when it is created and kept for the life of the
// process. A launch that splits K counts its blocks' arrivals in counters[tile]; the last block of each tile resets
// its counter to 0 (gemv_epilogue: every block of a split launch reaches the epilogue, the last arrival always resets),
// so the next launch on that stream finds them all zero. Launches on one stream run in order, so two never count on
// the same buffer at once; launches on different streams use different buffers. A CUDA graph captured on a stream
// keeps that stream's buffer, which its replays leave zero as well.
//
// A buffer is replaced, never freed: by a larger one when a launch has more tiles than it holds (a captured graph or a
// queued launch may still use the old one), and by a fresh zeroed one after a launch that failed to start (`retire`),
// so no launch ever finds counters that an aborted one left behind.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

namespace fpq {

class GemvCounterPool {
public:
    // Counters a new buffer holds at least (16 KiB: one buffer serves layers up to 262144 rows).
    static constexpr int64_t kMinTiles = 4096;

    struct Info {
        int64_t created = 0;    // buffers created on the device, every stream counted
        int64_t capacity = 0;   // counters of the stream's buffer (0: none yet)
        const int* counters = nullptr;
    };

    // The stream's counters, at least `tiles` of them, all zero at the launch. `create(bytes)` returns new
    // zero-filled memory that stays valid for the life of the process (called with the pool locked).
    template <class Create>
    int* acquire(int device, const void* stream, int64_t tiles, Create&& create)
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        Slot& slot = slots_[{device, stream}];
        if (slot.counters == nullptr || slot.capacity < tiles) {
            const int64_t capacity = std::max({tiles, 2 * slot.capacity, kMinTiles});
            slot.counters = static_cast<int*>(create(capacity * int64_t(sizeof(int))));
            slot.capacity = capacity;
            ++created_[device];
        }
        return slot.counters;
    }

    // After a launch on (device, stream) that failed: the next acquire creates a fresh zeroed buffer.
    void retire(int device, const void* stream)
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        slots_.erase({device, stream});
    }

    Info info(int device, const void* stream) const
    {
        const std::lock_guard<std::mutex> lock(mutex_);
        Info out;
        const auto c = created_.find(device);
        out.created = c == created_.end() ? 0 : c->second;
        const auto s = slots_.find({device, stream});
        if (s != slots_.end()) { out.capacity = s->second.capacity, out.counters = s->second.counters; }
        return out;
    }

private:
    struct Slot {
        int* counters = nullptr;
        int64_t capacity = 0;
    };
    mutable std::mutex mutex_;
    std::map<std::pair<int, const void*>, Slot> slots_;
    std::map<int, int64_t> created_;
};

}  // namespace fpq
