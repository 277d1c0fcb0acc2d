// Hopper (sm_90) asynchronous copies that complete on shared-memory barriers.
//
//   mbarrier (mbarrier.cuh): here it also counts the bytes of the copies that complete on it.
//   tma_load_2d: a box of a 2-D tensor (the tensor map, built on the host) into shared memory,
//     elements outside the tensor read as zero; bulk_load: contiguous bytes. Both count their bytes
//     on the barrier named in the call (mbar_arrive_expect_tx announces them first).
#pragma once
#include "common.cuh"
#include "mbarrier.cuh"  // mbar_init, mbar_arrive, mbar_wait

namespace kbit {

// The host's CUtensorMap (cuTensorMapEncodeTiled), passed to the kernel by value.
struct alignas(64) TensorMap {
    u64 opaque[16];
};

// One arrival that also announces `bytes` still to come from copies completing on this barrier.
KBIT_DEVICE void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Box {c0 .. c0 + box0 - 1 (inner), c1 .. c1 + box1 - 1} of the tensor behind `map` into `dst`
// (laid out and swizzled as the map says), completing on `bar`.
KBIT_DEVICE void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
                 : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory, completing on `bar`.
KBIT_DEVICE void bulk_load(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// Per-thread register budget of the executing warpgroup from here on (sm_90a; every thread of
// the warpgroup executes it, and the kernel has a register cap from __launch_bounds__).
template <int N> KBIT_DEVICE void set_max_registers_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> KBIT_DEVICE void set_max_registers_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (whole warps).
KBIT_DEVICE void named_barrier(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace kbit
