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
// l, l + 32, ... (P of them, E <= 32 P); k rounds of a warp arg-max (larger logit by order_key,
// NaN first and -0 = +0, then lower expert) take the winners out, lane i keeping the i-th. It
// leaves `counter` at zero, so the same counter serves every launch on a stream (and a CUDA
// graph's replays).
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
template <int DT, bool SCORES_F32, int P>
KBIT_DEVICE void top_k_of_token(const void* logits, void* scores, long long* index, int t, int E, int top_k, bool normalize,
                                int lane) {
    constexpr int kNone = (int)0x80000000;  // below every order_key: no expert, or one chosen already
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

    // Round r: the warp's best open expert goes to lane r. top_k <= E, so an open expert is
    // always left, and its key is above kNone.
    float mine_l = 0.f;
    int mine_e = E;
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
        // The winner is its own lane's best: that lane closes it and hands its logit to lane r.
        const bool won_here = (best_e & 31) == lane;
#pragma unroll
        for (int i = 0; i < P; ++i) {
            if (won_here && i == best_i) key[i] = kNone;
        }
        const float won = __shfl_sync(0xffffffffu, best_l, best_e & 31);
        if (lane == r) mine_l = won, mine_e = best_e;
    }
    const float mine = lane < top_k ? __fdiv_rn(expf(mine_l - m), s) : 0.f;
    const float chosen = warp_sum(mine);
    if (lane < top_k) {
        const float v = normalize ? __fdiv_rn(mine, chosen) : mine;
        const size_t at = (size_t)t * top_k + lane;
        if constexpr (SCORES_F32) static_cast<float*>(scores)[at] = v;
        else store_elem<DT>(scores, at, v);
        index[at] = mine_e;
    }
}

}  // namespace router
}  // namespace kbit

// ---------------------------------------------------------------------------------------
// kbit_router_top_k<DT, SCORES_F32, P>: grid E, 128 threads; P experts per lane in the top-k
// phase (a power of two, E <= 32 P <= 512).
// ---------------------------------------------------------------------------------------
template <int DT, bool SCORES_F32, int P>
__global__ void __launch_bounds__(kbit::router::kThreads)
kbit_router_top_k(const void* __restrict__ x, const void* __restrict__ w, void* __restrict__ logits, void* __restrict__ scores,
                  long long* __restrict__ index, int* __restrict__ counter, int T, int H, int E, int top_k, int normalize) {
    using namespace kbit::router;
    __shared__ float partial[kWarps][kTokens];
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
    for (int t = warp; t < T; t += kWarps) top_k_of_token<DT, SCORES_F32, P>(logits, scores, index, t, E, top_k, normalize != 0, lane);
    if (threadIdx.x == 0) *counter = 0;
}
