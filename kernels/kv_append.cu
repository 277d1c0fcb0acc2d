// New tokens into the 8-bit bucket of the mixed-precision KV cache, in one launch
// (kbit_linear/kv_format.py append_tokens8 is the spec: _sym8 codes and scales, then the rows'
// entries followed by their new ones).
//
//   old bucket (n entries, sorted by row, then position)      new tokens k, v [B][H][q][D], any strides
//     k, v     [n][H][D]     int8                              (the model's fp16 / bf16 / fp32)
//     k_scale, v_scale [n][H][D/g] fp16
//     pos      [n] int32,  row_start [B + 1] int32
//
//   out bucket (n + B q entries): row r = its old entries, then its q new ones (positions pos0 ..
//   pos0 + q - 1); out row_start[r] = row_start[r] + r q.
//
// Grid: one block per out entry; an old entry is copied, a new one quantized: one warp per
// (k or v, head, group of g = 32 or 64 channels), lane c holding channels c and c + 32:
//   scale = fp16(min(max |x| * (1/127), 65504)),  code = scale > 0 ? clamp(rint(x / scale), +-127) : 0
// (the multiply by 1/127 and the IEEE division are what the reference computes, bit for bit).
#include "common.cuh"

namespace kbit {
namespace kv_append {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr float kInv127 = 1.0f / 127.0f;  // fp32(1/127), as the reference multiplies by it
constexpr float kFp16Max = 65504.0f;

// The new token's group of one tensor: quantize g channels (lane c: channels c, c + 32 if g = 64).
template <int DT>
KBIT_DEVICE void quantize_group(const void* src, size_t base, int g, signed char* codes, u16* scale, int lane) {
    const bool two = g == 64;
    const float x0 = load_elem<DT>(src, base + lane);
    const float x1 = two ? load_elem<DT>(src, base + lane + 32) : 0.f;
    float m = fmaxf(fabsf(x0), fabsf(x1));
#pragma unroll
    for (int d = 16; d; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
    const u16 s16 = f32_to_bits<KBIT_F16>(fminf(m * kInv127, kFp16Max));
    const float s = bits_to_f32<KBIT_F16>(s16);
    auto code = [s](float x) -> signed char {
        return s > 0.f ? (signed char)fminf(fmaxf(rintf(__fdiv_rn(x, s)), -127.f), 127.f) : (signed char)0;
    };
    codes[lane] = code(x0);
    if (two) codes[lane + 32] = code(x1);
    if (lane == 0) *scale = s16;
}

}  // namespace kv_append
}  // namespace kbit

// ---------------------------------------------------------------------------------------
// kbit_kv_append8<DT>: grid (n + B q), 128 threads. Strides of k_new / v_new in elements.
// ---------------------------------------------------------------------------------------
template <int DT>
__global__ void __launch_bounds__(kbit::kv_append::kThreads)
kbit_kv_append8(const signed char* __restrict__ k_old, const signed char* __restrict__ v_old, const u16* __restrict__ ks_old,
                const u16* __restrict__ vs_old, const int* __restrict__ pos_old, const int* __restrict__ rs_old,
                const void* __restrict__ k_new, const void* __restrict__ v_new, int ksb, int ksh, int ksq, int vsb, int vsh,
                int vsq, signed char* __restrict__ k_out, signed char* __restrict__ v_out, u16* __restrict__ ks_out,
                u16* __restrict__ vs_out, int* __restrict__ pos_out, int* __restrict__ rs_out, int B, int H, int q, int D,
                int g, int pos0) {
    using namespace kbit::kv_append;
    const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (e == 0)
        for (int r = tid; r <= B; r += kThreads) rs_out[r] = rs_old[r] + r * q;
    // this entry's row: the first r whose out entries end after e
    int r = 0;
    while (r + 1 < B && e >= rs_old[r + 1] + (r + 1) * q) ++r;
    const int j = e - (rs_old[r] + r * q);        // place in the row's out entries
    const int old_count = rs_old[r + 1] - rs_old[r];
    const int row_bytes = H * D, groups = H * (D / g);
    if (j < old_count) {  // an old entry: copied (rows of H D bytes, a multiple of 32)
        const size_t src = (size_t)(rs_old[r] + j);
        const uint4* ks = reinterpret_cast<const uint4*>(k_old + src * row_bytes);
        const uint4* vs = reinterpret_cast<const uint4*>(v_old + src * row_bytes);
        uint4* kd = reinterpret_cast<uint4*>(k_out + (size_t)e * row_bytes);
        uint4* vd = reinterpret_cast<uint4*>(v_out + (size_t)e * row_bytes);
        for (int i = tid; i < row_bytes / 16; i += kThreads) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
        for (int i = tid; i < groups; i += kThreads) {
            ks_out[(size_t)e * groups + i] = ks_old[src * groups + i];
            vs_out[(size_t)e * groups + i] = vs_old[src * groups + i];
        }
        if (tid == 0) pos_out[e] = pos_old[src];
        return;
    }
    const int i = j - old_count;  // the row's new token i
    if (tid == 0) pos_out[e] = pos0 + i;
    const int per = D / g;
    for (int u = warp; u < 2 * groups; u += kWarps) {  // u = (tensor, head, group)
        const bool is_v = u >= groups;
        const int hg = is_v ? u - groups : u, h = hg / per, c0 = (hg - h * per) * g;
        const size_t src = is_v ? (size_t)r * vsb + (size_t)h * vsh + (size_t)i * vsq + c0
                                : (size_t)r * ksb + (size_t)h * ksh + (size_t)i * ksq + c0;
        signed char* codes = (is_v ? v_out : k_out) + (size_t)e * row_bytes + h * D + c0;
        u16* scale = (is_v ? vs_out : ks_out) + (size_t)e * groups + hg;
        quantize_group<DT>(is_v ? v_new : k_new, src, g, codes, scale, lane);
    }
}
