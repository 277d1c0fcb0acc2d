// The two element-wise steps of a mixture-of-experts layer around its grouped GEMMs, one launch
// each (a decode step is bound by launches, not bytes: each replaces two to four torch kernels).
//
//   kbit_swiglu              gate_up [R, 2I] (gate columns 0..I-1, up columns I..2I-1)
//                            -> out [R, I] = silu(gate) * up, in fp32, rounded once
//
//   kbit_combine_experts     y        [S, H]   rows in sorted-slot order (the down GEMM's output)
//                            position [S]      int64: position[s] = the row of y holding slot s
//                                              (s = token * top_k + k; route.cu's `position`)
//                            weights  [T, top_k] the routing weight of each slot (fp32/fp16/bf16)
//                            -> out [T, H] = sum_k round_DT(weights[t, k]) * y[position[t*top_k+k]],
//                               products and sums in fp32 (k ascending), rounded once
//
// Both: DT = KBIT_F16 / KBIT_BF16 for the activations; VEC = 8 (16-byte loads and stores: the
// host checks that the row length is a multiple of 8 and the pointers 16-byte aligned) or 1.
// One thread per VEC consecutive outputs of a row, a grid-stride loop. A position outside
// 0..S-1 contributes nothing (so a bad table cannot read outside y).
// Launched as programmatic dependents (sm_90+): nothing is read before grid_dependency_wait().
#include "common.cuh"

namespace kbit_experts {

constexpr int kThreads = 256;

// VEC values of a row as floats (raw bits in, one 16-byte load when VEC = 8).
template <int DT, int VEC> KBIT_DEVICE void load_vec(float (&v)[VEC], const u16* __restrict__ p) {
    if constexpr (VEC == 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = bits_to_f32<DT>((u16)(words[i] & 0xffffu));
            v[2 * i + 1] = bits_to_f32<DT>((u16)(words[i] >> 16));
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = bits_to_f32<DT>(p[i]);
    }
}

template <int DT, int VEC> KBIT_DEVICE void store_vec(u16* __restrict__ p, const float (&v)[VEC]) {
    if constexpr (VEC == 8) {
        *reinterpret_cast<uint4*>(p) = pack8<DT>(v);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = f32_to_bits<DT>(v[i]);
    }
}

template <int DT, int VEC>
__global__ void __launch_bounds__(kThreads)
kbit_swiglu(const u16* __restrict__ gate_up, u16* __restrict__ out, int rows, int inter) {
    grid_dependency_wait();
    allow_dependent_launch();
    const int per_row = inter / VEC;
    const long long total = (long long)rows * per_row;
    for (long long v = (long long)blockIdx.x * kThreads + threadIdx.x; v < total; v += (long long)gridDim.x * kThreads) {
        const long long r = v / per_row;
        const int c = (int)(v - r * per_row) * VEC;
        const u16* src = gate_up + r * 2 * inter + c;
        float g[VEC], u[VEC];
        load_vec<DT, VEC>(g, src);
        load_vec<DT, VEC>(u, src + inter);
#pragma unroll
        for (int i = 0; i < VEC; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        store_vec<DT, VEC>(out + r * inter + c, g);
    }
}

template <int DT, int WT, int VEC>
__global__ void __launch_bounds__(kThreads)
kbit_combine_experts(const u16* __restrict__ y, const i64* __restrict__ position, const void* __restrict__ weights,
                     u16* __restrict__ out, int tokens, int top_k, int H) {
    grid_dependency_wait();
    allow_dependent_launch();
    const long long slots = (long long)tokens * top_k;
    const int per_row = H / VEC;
    const long long total = (long long)tokens * per_row;
    for (long long v = (long long)blockIdx.x * kThreads + threadIdx.x; v < total; v += (long long)gridDim.x * kThreads) {
        const long long t = v / per_row;
        const int c = (int)(v - t * per_row) * VEC;
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            const long long s = t * top_k + k;
            const i64 p = position[s];
            if ((unsigned long long)p >= (unsigned long long)slots) continue;
            const float w = load_routing_weight<DT, WT>(weights, s);
            float yv[VEC];
            load_vec<DT, VEC>(yv, y + p * H + c);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w, yv[i], acc[i]);
        }
        store_vec<DT, VEC>(out + t * H + c, acc);
    }
}

}  // namespace kbit_experts

using kbit_experts::kbit_combine_experts;
using kbit_experts::kbit_swiglu;
