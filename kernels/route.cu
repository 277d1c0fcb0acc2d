// Routing of a mixture-of-experts layer's slots to its experts, in one block (decode sizes).
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
// One block of THREADS threads: S <= kMaxSlots slots and E <= kMaxExperts experts (the host
// checks); shared memory holds the ids and the counts. O(S) work per slot for its rank and O(E)
// per expert for its offset: nothing at decode sizes (S = tokens * top_k <= a few hundred).
#include "common.cuh"

namespace kbit_route {

constexpr int kMaxSlots = 2048;
constexpr int kMaxExperts = 1024;

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
kbit_route_experts(const i64* __restrict__ index, i64* __restrict__ perm, i64* __restrict__ tokens, i64* __restrict__ position,
                   int* __restrict__ groups, int S, int top_k, int E, int G) {
    __shared__ int ids[kMaxSlots];
    __shared__ int counts[kMaxExperts + 1];
    __shared__ int offsets[kMaxExperts + 1];
    const int tid = threadIdx.x;
    for (int e = tid; e <= E; e += THREADS) counts[e] = 0;
    __syncthreads();
    for (int s = tid; s < S; s += THREADS) {
        const i64 v = index[s];
        const int id = (v >= 0 && v < E) ? (int)v : E;  // out of range: no expert
        ids[s] = id;
        atomicAdd(&counts[id], 1);
    }
    __syncthreads();
    // offsets (exclusive, over E + 1 ids) and each expert's group number (hit experts below it)
    for (int e = tid; e <= E; e += THREADS) {
        int off = 0, hits = 0;
        for (int f = 0; f < e; ++f) {
            off += counts[f];
            hits += counts[f] > 0;
        }
        offsets[e] = off;
        if (e < E && counts[e] > 0 && hits < G) {
            groups[hits] = e;
            groups[G + hits] = off;
            groups[2 * G + hits] = counts[e];
        }
    }
    // the unused groups: after the last hit expert (each thread counts the hits itself)
    int total_hits = 0;
    for (int f = 0; f < E; ++f) total_hits += counts[f] > 0;
    for (int q = total_hits + tid; q < G; q += THREADS) {
        groups[q] = 0;
        groups[G + q] = 0;
        groups[2 * G + q] = 0;
    }
    __syncthreads();
    for (int s = tid; s < S; s += THREADS) {
        const int id = ids[s];
        int rank = 0;
        for (int r = 0; r < s; ++r) rank += ids[r] == id;
        const int p = offsets[id] + rank;
        perm[p] = s;
        tokens[p] = s / top_k;
        position[s] = p;
    }
}

}  // namespace kbit_route

using kbit_route::kbit_route_experts;
