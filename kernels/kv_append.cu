// New tokens into the 8-bit tokens of the mixed-precision KV cache, in one launch: appended to
// the 8-bit bucket (kbit_kv_append8, a new bucket), or written in place into a replayable
// cache's store (kbit_kv_append8_in_place). kbit_linear/kv_format.py is the spec:
// append_tokens8 and append_tokens8_in_place (_sym8 codes and scales).
//
//   old bucket (n entries, sorted by row, then position)      new tokens k, v [B][H][q][D], any strides
//     k, v     [n][H][D]     int8                              (the model's fp16 / bf16 / fp32)
//     k_scale, v_scale [n][H][D/g] fp16
//     pos      [n] int32,  row_start [B + 1] int32
//
//   out bucket (n + B q entries): row r = its old entries, then its q new ones (positions pos0 ..
//   pos0 + q - 1); out row_start[r] = row_start[r] + r q.
//
//   store (B rows of cap = capacity slots, a slot an entry as above: k, v [H][D], scales, pos)
//     slot   0              cap            2 cap       ...           B cap
//            | row 0        | row 1        | ...       | row B-1     |
//            |count[0]|free |count[1]|free |
//     count [B] int32 (row r: slots r cap .. r cap + count[r] - 1, by position), length [1] int32
//     (cached positions: the first new one), overflow [1] int32 (0, or 1 once a step did not fit)
//
//   in place: row r's new token i -> slot r cap + count[r] + i at position length + i; then
//   count[r] += q for every row and length += q. If any row lacks room (count[r] + q > cap, as
//   always with cap = 0) nothing is written, neither counter moves and overflow becomes 1.
//
// Grid: one block per out entry (bucket) or per new token (store); an old entry is copied, a new
// one quantized: one warp per (k or v, head, group of g = 32 or 64 channels), lane c holding
// channels c and c + 32:
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

// New token i of batch row r (k_new / v_new at strides ks*, vs*, in elements) quantized into one
// entry: codes k_dst, v_dst [H][D] and scales ks_dst, vs_dst [H][D/g]; one warp per (tensor,
// head, group).
template <int DT>
KBIT_DEVICE void quantize_entry(const void* k_new, const void* v_new, int ksb, int ksh, int ksq, int vsb, int vsh, int vsq,
                                int r, int i, signed char* k_dst, signed char* v_dst, u16* ks_dst, u16* vs_dst, int H, int D,
                                int g, int warp, int lane) {
    const int per = D / g, groups = H * per;
    for (int u = warp; u < 2 * groups; u += kWarps) {  // u = (tensor, head, group)
        const bool is_v = u >= groups;
        const int hg = is_v ? u - groups : u, h = hg / per, c0 = (hg - h * per) * g;
        const size_t src = is_v ? (size_t)r * vsb + (size_t)h * vsh + (size_t)i * vsq + c0
                                : (size_t)r * ksb + (size_t)h * ksh + (size_t)i * ksq + c0;
        quantize_group<DT>(is_v ? v_new : k_new, src, g, (is_v ? v_dst : k_dst) + h * D + c0, (is_v ? vs_dst : ks_dst) + hg, lane);
    }
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
    quantize_entry<DT>(k_new, v_new, ksb, ksh, ksq, vsb, vsh, vsq, r, i, k_out + (size_t)e * row_bytes, v_out + (size_t)e * row_bytes,
                       ks_out + (size_t)e * groups, vs_out + (size_t)e * groups, H, D, g, warp, lane);
}

// ---------------------------------------------------------------------------------------
// kbit_kv_append8_in_place<DT>: grid (B q), 128 threads; block e = r q + i writes row r's new
// token i into the store. ticket: an int32 that is zero at launch and is left zero (a per-stream
// counter from the backend's zeroed scratch). Launched without programmatic dependent launch;
// it waits all the same before its first read, so a programmatic launch would stay correct.
// ---------------------------------------------------------------------------------------
template <int DT>
__global__ void __launch_bounds__(kbit::kv_append::kThreads)
kbit_kv_append8_in_place(const void* __restrict__ k_new, const void* __restrict__ v_new, int ksb, int ksh, int ksq, int vsb,
                         int vsh, int vsq, signed char* __restrict__ k, signed char* __restrict__ v, u16* __restrict__ k_scale,
                         u16* __restrict__ v_scale, int* __restrict__ pos, int* __restrict__ count, int* __restrict__ length,
                         int* __restrict__ overflow, int* __restrict__ ticket, int B, int H, int q, int D, int g, int capacity) {
    using namespace kbit::kv_append;
    __shared__ int is_last;
    const int e = blockIdx.x, r = e / q, i = e - r * q, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    grid_dependency_wait();
    // Every block reads every row's count, so all of them take the same decision (no room in one
    // row: no block writes). Only the last block moves the counters, once every block has read them.
    bool no_room = false;
    for (int row = tid; row < B; row += kThreads) no_room |= count[row] > capacity - q;
    const bool over = __syncthreads_or(no_room);
    if (!over) {
        const size_t slot = (size_t)r * capacity + count[r] + i;
        const int groups = H * (D / g);
        if (tid == 0) pos[slot] = *length + i;
        quantize_entry<DT>(k_new, v_new, ksb, ksh, ksq, vsb, vsh, vsq, r, i, k + slot * H * D, v + slot * H * D,
                           k_scale + slot * groups, v_scale + slot * groups, H, D, g, warp, lane);
    }
    // The last-block ticket (as kernels/router.cu): this block's reads of count and length are
    // done before its thread 0 fences and counts; the last block fences again before it writes.
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        is_last = atomicAdd(ticket, 1) == (int)gridDim.x - 1;
        if (is_last) __threadfence();
    }
    __syncthreads();
    if (!is_last) return;
    if (over) {
        if (tid == 0) *overflow = 1;
    } else {
        for (int row = tid; row < B; row += kThreads) count[row] += q;
        if (tid == 0) *length += q;
    }
    if (tid == 0) *ticket = 0;
}
