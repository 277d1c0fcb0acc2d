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
// reads every logit back from L2 and picks the top k, the whole block on one token at a time:
// thread i holds experts i, i + 128, ... (P of them, E <= 128 P) and ranks each against every
// key in shared memory (rank = the experts ahead of it: a larger logit by order_key, NaN first
// and -0 = +0, or the same key and a lower expert); the experts of rank < k are the choice, in
// rank order. Every thread counts at once, where k rounds of a warp arg-max would wait on k
// chains of shuffles. It leaves `counter` at zero, so the same counter serves every launch on a
// stream (and a CUDA graph's replays).
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

// What the top-k phase keeps in shared memory, for one token at a time.
template <int P>
struct TopK {
    int key[kThreads * P];  // order_key of each expert, kNone past E
    float chosen_l[32];     // the logit of the expert of rank r < top_k
    int chosen_e[32];       // and the expert
    float red[kWarps];      // the warps' partial max / sum
};

constexpr int kNone = (int)0x80000000;  // below every order_key: past the last expert

// The block's max (NaN skipped) or sum of one value per thread; every thread gets it.
template <bool MAX, int P>
KBIT_DEVICE float block_reduce(float v, TopK<P>& sm, int warp, int lane) {
#pragma unroll
    for (int d = 16; d; d >>= 1) {
        const float o = __shfl_xor_sync(0xffffffffu, v, d);
        v = MAX ? fmaxf(v, o) : v + o;
    }
    if (lane == 0) sm.red[warp] = v;
    __syncthreads();
    v = sm.red[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = MAX ? fmaxf(v, sm.red[w]) : v + sm.red[w];
    __syncthreads();  // red is free for the next reduction
    return v;
}

// Softmax and top-k of token t's logits, by the whole block. The experts are picked by logit
// (the probabilities' order, without the ties that underflow of the exponentials makes), their
// probabilities taken from the softmax (NaN for every expert of a row with a NaN or +inf logit,
// or all -inf, as in the reference; one -inf among finite logits is a probability of 0).
template <int DT, bool SCORES_F32, int P>
KBIT_DEVICE void top_k_of_token(const void* logits, void* scores, long long* index, int t, int E, int top_k, bool normalize,
                                TopK<P>& sm, int warp, int lane) {
    float l[P];
    int key[P];
    float m = KBIT_NEG_INF;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int e = threadIdx.x + kThreads * i;
        l[i] = e < E ? load_from_l2<DT>(logits, (size_t)t * E + e) : KBIT_NEG_INF;
        key[i] = e < E ? order_key(l[i]) : kNone;
        sm.key[e] = key[i];
        m = fmaxf(m, l[i]);  // skips NaN: a NaN logit still makes the sum below NaN, so every score is NaN
    }
    m = block_reduce<true>(m, sm, warp, lane);  // its barrier also publishes the keys
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) s += threadIdx.x + kThreads * i < E ? expf(l[i] - m) : 0.f;
    s = block_reduce<false>(s, sm, warp, lane);

    // Rank: the keys ahead of expert e's are the larger ones, and the equal ones of lower experts
    // (those are the keys above e's key minus one; a real key is far above the int minimum, so
    // the subtraction cannot wrap).
    const int words = (E + 3) / 4;
#pragma unroll
    for (int i = 0; i < P; ++i) {
        const int e = threadIdx.x + kThreads * i;
        if (e >= E) continue;
        int rank = 0;
        for (int w = 0; w < words; ++w) {
            const int4 k4 = reinterpret_cast<const int4*>(sm.key)[w];
            rank += k4.x > (4 * w < e ? key[i] - 1 : key[i]);
            rank += k4.y > (4 * w + 1 < e ? key[i] - 1 : key[i]);
            rank += k4.z > (4 * w + 2 < e ? key[i] - 1 : key[i]);
            rank += k4.w > (4 * w + 3 < e ? key[i] - 1 : key[i]);
        }
        if (rank < top_k) sm.chosen_l[rank] = l[i], sm.chosen_e[rank] = e;
    }
    __syncthreads();
    if (warp == 0) {
        const float mine_l = lane < top_k ? sm.chosen_l[lane] : 0.f;
        const float mine = lane < top_k ? __fdiv_rn(expf(mine_l - m), s) : 0.f;
        const float chosen = warp_sum(mine);
        if (lane < top_k) {
            const float v = normalize ? __fdiv_rn(mine, chosen) : mine;
            const size_t at = (size_t)t * top_k + lane;
            if constexpr (SCORES_F32) static_cast<float*>(scores)[at] = v;
            else store_elem<DT>(scores, at, v);
            index[at] = sm.chosen_e[lane];
        }
    }
    __syncthreads();  // the keys and choices are free for the next token
}

}  // namespace router
}  // namespace kbit

// ---------------------------------------------------------------------------------------
// kbit_router_top_k<DT, SCORES_F32, P>: grid E, 128 threads; P experts per thread in the top-k
// phase (E <= 128 P <= 512).
// ---------------------------------------------------------------------------------------
template <int DT, bool SCORES_F32, int P>
__global__ void __launch_bounds__(kbit::router::kThreads)
kbit_router_top_k(const void* __restrict__ x, const void* __restrict__ w, void* __restrict__ logits, void* __restrict__ scores,
                  long long* __restrict__ index, int* __restrict__ counter, int T, int H, int E, int top_k, int normalize) {
    using namespace kbit::router;
    __shared__ float partial[kWarps][kTokens];
    __shared__ __align__(16) TopK<P> top;
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
    for (int t = 0; t < T; ++t) top_k_of_token<DT, SCORES_F32, P>(logits, scores, index, t, E, top_k, normalize != 0, top, warp, lane);
    if (threadIdx.x == 0) *counter = 0;
}
