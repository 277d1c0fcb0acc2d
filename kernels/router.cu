// The router of a mixture-of-experts layer in one launch: its logits, softmax, top-k and the
// renormalisation of the chosen probabilities (kbit_linear/_router_ops.py,
// router_top_k_reference, is the spec).
//
//   x       [T][H]   fp16 / bf16 / fp32 (DT), rows contiguous
//   w       [E][H]   the router's weight, same dtype
//   logits  [T][E]   DT: round_DT(sum_h x[t][h] * w[e][h]), summed in fp32
//   scores  [T][k]   fp32 (SCORES_F32) or DT: softmax(logits[t]) (fp32, from the rounded logits)
//                    of the k largest logits, descending (NaN first, as torch.sort), ties to the
//                    lower expert; divided by their sum when `normalize`
//   index   [T][k]   int64: their experts (top_k <= 32: one chosen expert per lane)
//   counter [1]      int32, zero before and after the launch (blocks done)
//
// Grid: E blocks of 4 warps, block e computing expert e's logit for every token, kTokens tokens
// per pass over its weight row. The warps split the row into 256-element chunks (warp w takes
// chunks w, w + 4, ...; lane l reads its 8 consecutive elements, 16-byte loads: the host checks
// H % 8 == 0 and 16-byte aligned rows), so that a row's loads are in flight at once:
//
//   w row e   | warp 0: chunk 0 (lane l: h 8l..8l+7) | warp 1: chunk 1 | warp 2 | warp 3 | warp 0: chunk 4 | ...
//   x row t   | the same elements, read for each of the pass's tokens
//
// Each warp's partial sums meet in shared memory; warp 0 adds them and writes the logits.
// The block that finishes last (each block adds one to `counter` after its logits are visible)
// reads every logit back from L2 and picks the top k, one warp per token: lane l holds experts
// l, l + 32, ... (P of them, E <= 32 P). Experts are ordered by logit (order_key: NaN first and
// -0 = +0), then by lower expert. Two ways to pick the k first, chosen on the host (`by_rank`):
//
//   by rank    each lane counts, for each of its experts, the experts ahead of it (a scan of the
//              token's keys in shared memory, E independent compares per expert); an expert of
//              rank r < k goes to slot r. Few dependent steps, but E * P compares per lane: the
//              faster way for one token or up to ROUTER_RANK_MAX_EXPERTS experts.
//   by arg-max k rounds of a warp arg-max take the winners out, one per round: k chains of
//              shuffles, but only P compares per lane and round.
//
// Both fill the same slots, and lane i then reads slot i, so the scores are added in the same
// order either way. The last block leaves `counter` at zero, so the same counter serves every
// launch on a stream (and a CUDA graph's replays).
#include "common.cuh"

namespace kbit {
namespace router {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTokens = 8;       // tokens per pass over a weight row (accumulators per lane)

// 8 consecutive elements from element i of p (16-byte aligned) as floats.
template <int DT>
KBIT_DEVICE void load8(const void* p, size_t i, float (&v)[8]) {
    if constexpr (DT == KBIT_F32) {
        const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
        const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
        const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const u16*>(p) + i);
        const u32 words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = bits_to_f32<DT>((u16)(words[k] & 0xffffu));
            v[2 * k + 1] = bits_to_f32<DT>((u16)(words[k] >> 16));
        }
    }
}

// One logit written by another block of this launch: read from L2 (this SM's L1 may not see it).
template <int DT>
KBIT_DEVICE float load_from_l2(const void* p, size_t i) {
    if constexpr (DT == KBIT_F32) return __ldcg(static_cast<const float*>(p) + i);
    else return bits_to_f32<DT>(__ldcg(static_cast<const unsigned short*>(p) + i));
}

KBIT_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int d = 16; d; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// Logits of expert e for tokens [t0, t0 + kTokens) of T: one pass over w's row e by the block.
template <int DT>
KBIT_DEVICE void logits_of_expert(const void* x, const void* w, void* logits, float (*partial)[kTokens], int t0, int T, int H,
                                  int E, int e, int warp, int lane) {
    float acc[kTokens];
#pragma unroll
    for (int i = 0; i < kTokens; ++i) acc[i] = 0.f;
#pragma unroll 4
    for (int h = 256 * warp + 8 * lane; h < H; h += 256 * kWarps) {
        float wv[8];
        load8<DT>(w, (size_t)e * H + h, wv);
#pragma unroll
        for (int i = 0; i < kTokens; ++i) {
            if (t0 + i < T) {
                float xv[8];
                load8<DT>(x, (size_t)(t0 + i) * H + h, xv);
#pragma unroll
                for (int k = 0; k < 8; ++k) acc[i] = fmaf(xv[k], wv[k], acc[i]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < kTokens; ++i) {
        const float sum = warp_sum(acc[i]);
        if (lane == i) partial[warp][i] = sum;
    }
    __syncthreads();
    if (warp == 0 && lane < kTokens && t0 + lane < T) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) sum += partial[v][lane];
        store_elem<DT>(logits, (size_t)(t0 + lane) * E + e, sum);
    }
    __syncthreads();  // partial is free for the next pass
}

// The order of torch.sort on float32: larger float -> larger int, NaN above +inf, -0 = +0. An integer
// compare is immune to flush-to-zero (CuPy builds with -ftz=true, under which float compares
// see every subnormal as zero).
KBIT_DEVICE int order_key(float f) {
    if (f != f) return 0x7fffffff;
    const int b = __float_as_int(f);
    return b >= 0 ? b : b == (int)0x80000000 ? 0 : b ^ 0x7fffffff;  // -0 ties with +0, as the floats compare
}

// The lane's best open candidate among its P experts (lane + 32 i), ties to the lower i: a tree of
// compares, log2 P deep, so that the one warp doing a round waits on few dependent steps.
template <int P>
KBIT_DEVICE void lane_best(const int (&key)[P], const float (&l)[P], int& best_key, int& best_i, float& best_l) {
    int k[P], ix[P];
    float v[P];
#pragma unroll
    for (int i = 0; i < P; ++i) k[i] = key[i], ix[i] = i, v[i] = l[i];
#pragma unroll
    for (int span = 1; span < P; span *= 2) {
#pragma unroll
        for (int i = 0; i + span < P; i += 2 * span) {
            if (k[i + span] > k[i]) k[i] = k[i + span], ix[i] = ix[i + span], v[i] = v[i + span];  // strict: lower i on a tie
        }
    }
    best_key = k[0], best_i = ix[0], best_l = v[0];
}

// Softmax and top-k of token t's logits, by one warp; lane l holds experts l, l + 32, ... (P of
// them). The experts are picked by logit (the probabilities' order, without the ties that
// underflow of the exponentials makes), their probabilities taken from the softmax (NaN for
// every expert of a row with a NaN or +inf logit, or all -inf, as in the reference; one -inf
// among finite logits is a probability of 0).
constexpr int kNone = (int)0x80000000;  // below every order_key: no expert, or one chosen already

// The token's chosen experts in slot order (slot r: the r-th largest), filled by either way.
struct Slots {
    float logit[32];
    int expert[32];
};

// By rank: the rank of each of the lane's experts (lane + 32 i) among the E keys in `keys`
// (larger key first, then lower expert); an expert of rank r < top_k fills slot r. For expert
// e = 32 i + lane, a key j ahead of it is key_j > key_e for j > e and key_j >= key_e, that is
// key_j > key_e - 1, for j < e: chunk c of 32 keys is wholly before, after or (c = i) around e.
template <int P>
KBIT_DEVICE void fill_slots_by_rank(const int* keys, const int (&key)[P], const float (&l)[P], Slots& slots, int E, int top_k,
                                    int lane) {
    int rank[P];
#pragma unroll
    for (int i = 0; i < P; ++i) rank[i] = 0;
#pragma unroll
    for (int c = 0; c < P; ++c) {
        if (32 * c >= E) break;
        const int n = min(32, E - 32 * c);
#pragma unroll 2
        for (int jj = 0; jj < n; ++jj) {
            const int kj = keys[32 * c + jj];  // the same address in every lane: a broadcast
#pragma unroll
            for (int i = 0; i < P; ++i) {
                const bool before = c < i || (c == i && jj < lane);  // key j is before expert e
                rank[i] += kj > key[i] - (int)before;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int e = lane + 32 * i;
        if (e < E && rank[i] < top_k) slots.logit[rank[i]] = l[i], slots.expert[rank[i]] = e;
    }
}

// By arg-max: round r takes the warp's best open expert out into slot r.
template <int P>
KBIT_DEVICE void fill_slots_by_arg_max(int (&key)[P], const float (&l)[P], Slots& slots, int E, int top_k, int lane) {
    // top_k <= E, so an open expert is always left, and its key is above kNone.
    for (int r = 0; r < top_k; ++r) {
        int best, best_i;
        float best_l;
        lane_best<P>(key, l, best, best_i, best_l);
        int best_e = best == kNone ? E : lane + 32 * best_i;
#pragma unroll
        for (int d = 16; d; d >>= 1) {
            const int other = __shfl_xor_sync(0xffffffffu, best, d);
            const int other_e = __shfl_xor_sync(0xffffffffu, best_e, d);
            if (other > best || (other == best && other_e < best_e)) best = other, best_e = other_e;
        }
        // The winner is its own lane's best: that lane closes it and fills the slot.
        if ((best_e & 31) == lane) {
#pragma unroll
            for (int i = 0; i < P; ++i) {
                if (i == best_i) key[i] = kNone;
            }
            slots.logit[r] = best_l, slots.expert[r] = best_e;
        }
    }
}

template <int DT, bool SCORES_F32, int P>
KBIT_DEVICE void top_k_of_token(const void* logits, void* scores, long long* index, int* keys, Slots& slots, int t, int E,
                                int top_k, bool normalize, bool by_rank, int lane) {
    float l[P];
    int key[P];
    float m = KBIT_NEG_INF;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int e = lane + 32 * i;
        l[i] = e < E ? load_from_l2<DT>(logits, (size_t)t * E + e) : KBIT_NEG_INF;
        key[i] = e < E ? order_key(l[i]) : kNone;
        m = fmaxf(m, l[i]);  // skips NaN: a NaN logit still makes the sum below NaN, so every score is NaN
    }
#pragma unroll
    for (int d = 16; d; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) s += lane + 32 * i < E ? expf(l[i] - m) : 0.f;
    s = warp_sum(s);

    if (by_rank) {
#pragma unroll
        for (int i = 0; i < P; ++i) keys[lane + 32 * i] = key[i];
        __syncwarp();
        fill_slots_by_rank<P>(keys, key, l, slots, E, top_k, lane);
    } else {
        fill_slots_by_arg_max<P>(key, l, slots, E, top_k, lane);
    }
    __syncwarp();
    const float mine_l = lane < top_k ? slots.logit[lane] : 0.f;
    const int mine_e = lane < top_k ? slots.expert[lane] : E;
    const float mine = lane < top_k ? __fdiv_rn(expf(mine_l - m), s) : 0.f;
    const float chosen = warp_sum(mine);
    if (lane < top_k) {
        const float v = normalize ? __fdiv_rn(mine, chosen) : mine;
        const size_t at = (size_t)t * top_k + lane;
        if constexpr (SCORES_F32) static_cast<float*>(scores)[at] = v;
        else store_elem<DT>(scores, at, v);
        index[at] = mine_e;
    }
    __syncwarp();  // keys and slots are free for the warp's next token
}

}  // namespace router
}  // namespace kbit

// ---------------------------------------------------------------------------------------
// kbit_router_top_k<DT, SCORES_F32, P>: grid E, 128 threads; P experts per lane in the top-k
// phase (a power of two, E <= 32 P <= 512); by_rank picks the way the top k are found.
// ---------------------------------------------------------------------------------------
template <int DT, bool SCORES_F32, int P>
__global__ void __launch_bounds__(kbit::router::kThreads)
kbit_router_top_k(const void* __restrict__ x, const void* __restrict__ w, void* __restrict__ logits, void* __restrict__ scores,
                  long long* __restrict__ index, int* __restrict__ counter, int T, int H, int E, int top_k, int normalize,
                  int by_rank) {
    using namespace kbit::router;
    __shared__ float partial[kWarps][kTokens];
    __shared__ int keys[kWarps][32 * P];  // by rank: each warp's token's keys
    __shared__ Slots slots[kWarps];
    __shared__ int is_last;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Launched as a programmatic dependent where the grid fits on the SMs at once: x (and the
    // counter) may still be written by the previous kernel until the wait. Every block is
    // resident by the time all have passed the trigger, so the next kernel may start then.
    grid_dependency_wait();
    allow_dependent_launch();
    for (int t0 = 0; t0 < T; t0 += kTokens) logits_of_expert<DT>(x, w, logits, partial, t0, T, H, E, blockIdx.x, warp, lane);
    // Grid-wide hand-over as cooperative groups' grid sync does it: the block's writes, then one
    // thread's fence (cumulative over what the barrier ordered before it) and count; the last
    // block's counting thread fences again before the barrier that lets its warps read.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
        if (is_last) __threadfence();
    }
    __syncthreads();
    if (!is_last) return;
    for (int t = warp; t < T; t += kWarps) {
        top_k_of_token<DT, SCORES_F32, P>(logits, scores, index, keys[warp], slots[warp], t, E, top_k, normalize != 0,
                                          by_rank != 0, lane);
    }
    if (threadIdx.x == 0) *counter = 0;
}
