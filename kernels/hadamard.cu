// The randomized Hadamard rotation of a layer's input (kbit_linear/hadamard.py is the spec):
// y = (x * signs) times the orthonormal Walsh-Hadamard matrix of B, block by block along the
// last dimension (K, a multiple of B; 8 <= B <= 256, a power of two), in one pass.
//
// Layout: x and y are [rows][K] fp16/bf16, contiguous; signs int8 [K]. The flattened tensor is
// cut into chunks of 256 elements, one warp each; lane l holds elements 8l .. 8l+7 of its chunk
// (one 16-byte load), so every B-block of the chunk lies in B/8 consecutive lanes:
//
//   chunk:  | lane 0: e0..e7 | lane 1: e8..e15 | ... | lane 31: e248..e255 |
//   block:  |<------ B/8 lanes ------>|<------ B/8 lanes ------>| ...
//
// The butterfly stages (a, b) -> (a + b, a - b) at strides 1, 2, 4 run inside a lane; strides
// 8 .. B/2 pair lane l with lane l ^ (stride / 8) (shuffles). Sums in fp32, one rounding at the
// store. K is a multiple of B and B of 8, so a lane's 8 elements are all inside the tensor or
// all past its end (a chunk's last lanes then load zeros and store nothing).
#include "common.cuh"

constexpr int kHadamardWarps = 4;  // warps (chunks of 256 elements) per block

template <int DT, int LOG_B>
__global__ void __launch_bounds__(32 * kHadamardWarps)
kbit_hadamard_rotate(const u16* __restrict__ x, const signed char* __restrict__ signs, u16* __restrict__ y, int total,
                     int K) {
    constexpr int B = 1 << LOG_B;
    static_assert(B >= 8 && B <= 256, "a block spans 1 to 32 lanes");
    const float scale = 1.f / sqrtf((float)B);  // the orthonormal matrix's 1 / sqrt(B)
    const int lane = threadIdx.x & 31;
    const long long chunk = (long long)blockIdx.x * kHadamardWarps + (threadIdx.x >> 5);
    const long long first = chunk * 256 + 8 * lane;  // this lane's first element
    const bool ok = first < total;

    float v[8];
    if (ok) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + first);
        const uint2 sg = *reinterpret_cast<const uint2*>(signs + first % K);
        const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
        const u32 s[2] = {sg.x, sg.y};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float e = bits_to_f32<DT>((u16)(w[j / 2] >> (16 * (j % 2))));
            const signed char sign = (signed char)((s[j / 4] >> (8 * (j % 4))) & 0xffu);
            v[j] = sign < 0 ? -e : e;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = 0.f;
    }
    // strides 1, 2, 4: inside the lane
#pragma unroll
    for (int stride = 1; stride < 8 && stride < B; stride <<= 1) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j & stride) continue;
            const float a = v[j], b = v[j + stride];
            v[j] = a + b;
            v[j + stride] = a - b;
        }
    }
    // strides 8 .. B/2: across lanes (the partner holds the same j)
#pragma unroll
    for (int lanes = 1; lanes < B / 8; lanes <<= 1) {
        const bool upper = lane & lanes;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float other = __shfl_xor_sync(0xffffffffu, v[j], lanes);
            v[j] = upper ? other - v[j] : v[j] + other;
        }
    }
    if (ok) {
        uint4 out;
        out.x = pack2<DT>(v[0] * scale, v[1] * scale);
        out.y = pack2<DT>(v[2] * scale, v[3] * scale);
        out.z = pack2<DT>(v[4] * scale, v[5] * scale);
        out.w = pack2<DT>(v[6] * scale, v[7] * scale);
        *reinterpret_cast<uint4*>(y + first) = out;
    }
}
