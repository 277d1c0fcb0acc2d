// Thread block clusters (sm_90): blocks launched as a group that run at the same time, on SMs of
// one GPC, and can read and write each other's shared memory.
//
//   cluster_rank() / cluster_blocks()   this block's rank in its cluster, and the cluster's size
//                                       (1 for a launch without clusters)
//   cluster_sync()                      every thread of every block of the cluster arrives and
//                                       waits; its shared-memory writes (local and remote)
//                                       before it are visible to all of them after it
//   cluster_address(a, rank)            the address of shared-memory location `a` (a 32-bit
//                                       shared-window offset) in block `rank` of the cluster
//   st_cluster(address, v)              a store to such an address
//
// cluster_sync is ".aligned": every thread of a warp executes it at the same point. Threads that
// have exited count as arrived (PTX ISA, `exit`).
#pragma once
#include "common.cuh"

namespace kbit {

KBIT_DEVICE u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
KBIT_DEVICE u32 cluster_blocks() {
    u32 n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
    return n;
}
KBIT_DEVICE void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
KBIT_DEVICE u32 cluster_address(u32 local, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}
KBIT_DEVICE void st_cluster(u32 address, float4 v) {
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}

}  // namespace kbit
