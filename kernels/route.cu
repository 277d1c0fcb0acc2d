// Routing of a mixture-of-experts layer's slots to its experts, in one block.
//
// A slot is one (token, k) pair of the router's top-k choice, numbered s = token * top_k + k;
// index[s] is its expert id, E (or anything outside 0..E-1) meaning "no expert". The kernel
// sorts the slots by expert id, stably, and lists the experts that received slots as the
// groups of the grouped GEMM (kernels/decode.cu, kbit_decode_gemm_grouped):
//
//   index   [S]      int64     expert id of slot s
//   perm    [S]      int64     perm[p] = the slot at sorted position p (experts ascending, slots
//                              ascending within one; "no expert" slots last)
//   tokens  [S]      int64     tokens[p] = perm[p] / top_k (the row of x that position p reads)
//   position [S]     int64     position[s] = the sorted position of slot s (perm's inverse)
//   groups  [3][G]   int32     group q < hits: (expert, first sorted position, slots) of the q-th
//                              expert with slots, ascending; groups q >= hits: (0, 0, 0)
//
//   counts[e] = #slots of e; offset[e] = sum of counts below e; a slot's position is
//   offset[its id] + #earlier slots with the same id.
//
// One block of THREADS threads, any S, E <= 1024 (routing.MAX_EXPERTS: the host checks). The slots are cut
// into one contiguous segment per warp; the rank of a slot among earlier slots of its expert is
// then (slots of that expert in earlier warps' segments) + (in earlier 32-slot steps of its own
// segment) + (in earlier lanes of its step: __match_any_sync). So the kernel walks the segments
// twice:
//
//   pass 1   warp w counts its segment's slots per expert      -> seen[w][e]
//   scan     per expert: seen[w][e] := slots of e in segments < w (exclusive over warps),
//            counts[e] = the total; offsets[e] and the group number of each hit expert
//            (exclusive scans over experts: each thread sums its run of experts, then a
//            shuffle scan over the threads)
//   pass 2   warp w walks its segment again: position = offsets[e] + seen[w][e] + lanes before
//            it with the same id; seen[w][e] advances by the step's slots of e
//
// O(S / warps) steps per warp and O(E) per thread for the scans: a few microseconds at decode
// sizes, tens at a prefill's tens of thousands of slots. Two block sizes: 256 threads for few
// slots, 1024 for many (the passes are latency-bound chains per warp, so more warps walk them
// faster).
//
// Shared memory: dynamic, (W + 2) * (E + 1) ints: seen [W][E + 1] | offsets [E + 1] |
// hit_before [E + 1] (route_smem_bytes on the host: routing.py).
#include "common.cuh"

namespace kbit_route {

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
kbit_route_experts(const i64* __restrict__ index, i64* __restrict__ perm, i64* __restrict__ tokens, i64* __restrict__ position,
                   int* __restrict__ groups, int S, int top_k, int E, int G) {
    constexpr int W = THREADS / 32;
    static_assert(THREADS % 32 == 0 && W <= 32, "one warp scans the warps' totals");
    const int E1 = E + 1;  // the ids 0..E-1 and "no expert"
    extern __shared__ int route_smem[];
    int* seen = route_smem;              // [W][E1]: per warp and id, a count, then a running rank
    int* offsets = seen + W * E1;        // [E1]
    int* hit_before = offsets + E1;      // [E1]
    __shared__ int part[2][W];  // per warp: totals, then the exclusive prefix over the warps
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seg = (S + W - 1) / W, s0 = warp * seg, s1 = min(S, s0 + seg);
    for (int e = lane; e <= E; e += 32) seen[warp * E1 + e] = 0;
    __syncwarp();

    // pass 1: per-warp counts
    for (int base = s0; base < s1; base += 32) {
        const int s = base + lane;
        const unsigned active = __ballot_sync(0xffffffffu, s < s1);
        if (s < s1) {
            const i64 v = index[s];
            const int id = (v >= 0 && v < E) ? (int)v : E;  // out of range: no expert
            const unsigned same = __match_any_sync(active, id);
            if (lane == __ffs(same) - 1) seen[warp * E1 + id] += __popc(same);
        }
        __syncwarp();
    }
    __syncthreads();

    // per expert: exclusive sums over the warps; this thread's ids e0 .. e0 + per - 1 (as few
    // per thread as E allows: the loop over the warps is serial)
    const int per = (E + 1 + THREADS - 1) / THREADS, e0 = tid * per;
    int count_sum = 0, hit_sum = 0;
    for (int e = e0; e < e0 + per && e <= E; ++e) {
        int total = 0;
        for (int w = 0; w < W; ++w) {
            const int c = seen[w * E1 + e];
            seen[w * E1 + e] = total;
            total += c;
        }
        offsets[e] = total;  // the count for now; the offset below
        count_sum += total;
        hit_sum += e < E && total > 0;
    }
    // exclusive scan of the threads' partial sums: within each warp by shuffles, then over the
    // warps' totals by warp 0 (a serial loop over THREADS sums took microseconds)
    const int count_incl = warp_inclusive_sum(count_sum, lane), hit_incl = warp_inclusive_sum(hit_sum, lane);
    if (lane == 31) {
        part[0][warp] = count_incl;
        part[1][warp] = hit_incl;
    }
    __syncthreads();
    if (warp == 0) {
        const int c = lane < W ? part[0][lane] : 0, h = lane < W ? part[1][lane] : 0;
        const int c_incl = warp_inclusive_sum(c, lane), h_incl = warp_inclusive_sum(h, lane);
        __syncwarp();
        if (lane < W) {
            part[0][lane] = c_incl - c;  // warps before this one
            part[1][lane] = h_incl - h;
        }
    }
    __syncthreads();
    int off = part[0][warp] + count_incl - count_sum, hits = part[1][warp] + hit_incl - hit_sum;
    for (int e = e0; e < e0 + per && e <= E; ++e) {
        const int count = offsets[e];
        offsets[e] = off;
        hit_before[e] = hits;
        if (e < E && count > 0) {
            if (hits < G) {
                groups[hits] = e;
                groups[G + hits] = off;
                groups[2 * G + hits] = count;
            }
            ++hits;
        }
        off += count;
    }
    __syncthreads();
    // the unused groups: after the last hit expert
    const int total_hits = hit_before[E];
    for (int q = total_hits + tid; q < G; q += THREADS) {
        groups[q] = 0;
        groups[G + q] = 0;
        groups[2 * G + q] = 0;
    }

    // pass 2: positions
    for (int base = s0; base < s1; base += 32) {
        const int s = base + lane;
        const unsigned active = __ballot_sync(0xffffffffu, s < s1);
        if (s < s1) {
            const i64 v = index[s];
            const int id = (v >= 0 && v < E) ? (int)v : E;
            const unsigned same = __match_any_sync(active, id);
            const int p = offsets[id] + seen[warp * E1 + id] + __popc(same & ((1u << lane) - 1u));
            perm[p] = s;
            tokens[p] = s / top_k;
            position[s] = p;
            __syncwarp(active);
            if (lane == __ffs(same) - 1) seen[warp * E1 + id] += __popc(same);
        }
        __syncwarp();
    }
}

}  // namespace kbit_route

using kbit_route::kbit_route_experts;
