// Shared-memory barriers (mbarrier, sm_80+).
//
//   An mbarrier is a 64-bit shared-memory object counting the arrivals of one phase; when the
//   count set at init is reached the phase completes and the barrier starts the next. Waiters name
//   the phase by its parity (0, 1, 0, ...: the j-th use of a barrier is parity j & 1); a fresh
//   barrier reads as if the phase before phase 0 (parity 1) had completed.
//   An arrival releases the arriving thread's earlier shared-memory writes (cta scope); a
//   completed wait acquires them. compute-sanitizer's racecheck follows this order thread by
//   thread, so a thread whose writes another thread reads arrives itself.
#pragma once
#include "common.cuh"

namespace kbit {

// Each operation takes the barrier's shared-memory address (a 32-bit shared-window offset:
// cheaper to keep in a register than a generic pointer) or a pointer to it.
KBIT_DEVICE void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
KBIT_DEVICE void mbar_init(u64* bar, u32 count) { mbar_init(smem_addr(bar), count); }
// Makes initialized barriers visible to the copy engine (and, after a block barrier, to every thread).
KBIT_DEVICE void fence_mbar_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
KBIT_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
KBIT_DEVICE void mbar_arrive(u64* bar) { mbar_arrive(smem_addr(bar)); }
// `count` (>= 1) arrivals at once, the last of which may complete the phase: all but one as
// .noComplete (sm_80 has no arrival count on a completing arrive), then one plain arrival.
KBIT_DEVICE void mbar_arrive_many(u32 bar, u32 count) {
    if (count > 1) asm volatile("mbarrier.arrive.noComplete.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count - 1) : "memory");
    mbar_arrive(bar);
}
// Waits until the phase of parity `parity` has completed (try_wait suspends the thread for a
// while on sm_90; sm_80 has only the polling test_wait).
KBIT_DEVICE void mbar_wait(u32 bar, u32 parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#else
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
#endif
}
KBIT_DEVICE void mbar_wait(u64* bar, u32 parity) { mbar_wait(smem_addr(bar), parity); }

}  // namespace kbit
