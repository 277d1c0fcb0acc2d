// Format kernels: quantize (weights -> flat bit-planes + E4M4 codes), repack (flat -> the
// GEMM's tiled layout) and dequantize (tiled -> dense weights).
//
// quantize and repack reproduce kbit_linear/format.py bit for bit; dequantize computes
// codebook[idx] * (e4m4(code) * tensor_scale) in fp32 exactly as the reference and rounds once
// to the output type. CuPy compiles with -ftz=true, so the float arithmetic that must match the
// reference on subnormals is written as explicit (non-ftz) PTX below.
//
// Layouts (docs/format.md):
//   packed_flat int32 [N, nblk, BITS]    absmax_flat uint8 [N, nblk]        nblk = ceil(K / 32)
//   packed      int32 [KT, NT, 128, 2, BITS]   absmax uint8 [KT, NT, 128, 2]   KT = K_pad/64, NT = N_pad/128
//               (dequantize also reads pair codes, uint8 [KT, NT, 128, 2, 16 or 20]: section 7a)
#include "common.cuh"

namespace kbit {

KBIT_DEVICE float div_rn(float a, float b) {
    float d;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
KBIT_DEVICE float mul_rn(float a, float b) {
    float d;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
KBIT_DEVICE float add_rn(float a, float b) {
    float d;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
KBIT_DEVICE bool lt(float a, float b) {
    u32 p;
    asm("{\n .reg .pred q;\n setp.lt.f32 q, %1, %2;\n selp.u32 %0, 1, 0, q;\n}" : "=r"(p) : "f"(a), "f"(b));
    return p != 0;
}

// One input element as fp32 (exact; fp16 subnormals kept).
template <int DT> KBIT_DEVICE float load_f32(const void* p, i64 i);
template <> KBIT_DEVICE float load_f32<KBIT_F16>(const void* p, i64 i) {
    return bits_to_f32<KBIT_F16>(static_cast<const u16*>(p)[i]);
}
template <> KBIT_DEVICE float load_f32<KBIT_BF16>(const void* p, i64 i) {
    return bits_to_f32<KBIT_BF16>(static_cast<const u16*>(p)[i]);
}
template <> KBIT_DEVICE float load_f32<KBIT_F32>(const void* p, i64 i) {
    return static_cast<const float*>(p)[i];
}

// Smallest E4M4 code whose value is >= v (v >= 0), clamped to 255: the reference's
// searchsorted(table, v, right=False).clamp(max=255). Non-negative floats order like their bits.
KBIT_DEVICE u32 e4m4_encode_up(float v) {
    const u32 vb = __float_as_uint(v);
    u32 lo = 0, hi = 256;
#pragma unroll
    for (int step = 0; step < 9; ++step) {
        if (lo < hi) {
            const u32 mid = (lo + hi) >> 1;
            if (__float_as_uint(e4m4_decode(mid)) >= vb) hi = mid; else lo = mid + 1;
        }
    }
    return lo > 255 ? 255 : lo;
}

}  // namespace kbit

// One warp per block of 32 weights: lane i holds W[n, 32j + i].
//   w [N, K] (DT: fp16, bf16 or fp32), codebook float32 [2^BITS], tensor_scale float32 [1]
//   -> packed_flat int32 [N, nblk, BITS], absmax_flat uint8 [N, nblk]
// Launch: 256 threads per block, ceil(N * nblk / 8) blocks.
template <int BITS, int DT>
__global__ void __launch_bounds__(256) kbit_quantize(const void* __restrict__ w, const float* __restrict__ codebook,
                                                     const float* __restrict__ tensor_scale, u32* __restrict__ packed_flat,
                                                     u8* __restrict__ absmax_flat, int N, int K, int nblk) {
    using namespace kbit;
    const int lane = threadIdx.x & 31;
    const i64 blk = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (blk >= (i64)N * nblk) return;  // whole warps leave together
    const i64 n = blk / nblk;
    const int j = (int)(blk - n * nblk);
    const int k = j * 32 + lane;
    const float v = k < K ? load_f32<DT>(w, n * K + k) : 0.f;

    // Block absmax: max of |w| as bits (exact for non-negative floats).
    const u32 amax_bits = __reduce_max_sync(0xffffffffu, __float_as_uint(v) & 0x7fffffffu);
    const float ts = *tensor_scale;
    const u32 code = e4m4_encode_up(div_rn(__uint_as_float(amax_bits), ts));
    const float scale = mul_rn(e4m4_decode(code), ts);
    const float xq = __float_as_uint(scale) != 0 ? div_rn(v, scale) : 0.f;

    // idx = #{i : (cb[i] + cb[i+1]) * 0.5 < x}: nearest entry, ties to the lower index.
    u32 idx = 0;
    float c0 = codebook[0];
#pragma unroll
    for (int i = 0; i < (1 << BITS) - 1; ++i) {
        const float c1 = codebook[i + 1];
        idx += lt(mul_rn(add_rn(c0, c1), 0.5f), xq) ? 1u : 0u;
        c0 = c1;
    }

    u32 mine = 0;
#pragma unroll
    for (int b = 0; b < BITS; ++b) {
        const u32 plane = __ballot_sync(0xffffffffu, (idx >> b) & 1u);
        if (lane == b) mine = plane;
    }
    if (lane < BITS) packed_flat[blk * BITS + lane] = mine;
    if (lane == 0) absmax_flat[blk] = (u8)code;
}

// One thread per tiled (kt, nt, c, kb) block: copies its BITS words and scale byte from the
// flat layout, or writes a zero block where (n, j) lies outside [N, nblk).
// Launch: ceil(KT * NT * 256 / 256) blocks of 256 threads.
template <int BITS>
__global__ void __launch_bounds__(256) kbit_repack(const u32* __restrict__ packed_flat, const u8* __restrict__ absmax_flat,
                                                   u32* __restrict__ packed, u8* __restrict__ absmax, int N, int nblk,
                                                   int n_tiles, int k_tiles) {
    const i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (i64)k_tiles * n_tiles * 256) return;
    const int kb = (int)(g & 1), c = (int)((g >> 1) & 127);
    const i64 rest = g >> 8;
    const int nt = (int)(rest % n_tiles), kt = (int)(rest / n_tiles);
    const int n = nt * 128 + c, j = kt * 2 + kb;
    const bool ok = n < N && j < nblk;
    const i64 src = (i64)n * nblk + j;
#pragma unroll
    for (int b = 0; b < BITS; ++b) packed[g * BITS + b] = ok ? packed_flat[src * BITS + b] : 0u;
    absmax[g] = ok ? absmax_flat[src] : (u8)0;
}

// One warp per (row n, span of 4 k-tiles) item: lane l writes the 8 weights k = 64 * (4 * span)
// + 8 * l .. + 7 of row n, so a warp stores 256 consecutive weights (512 bytes in fp16) at once.
// The four lanes of one 32-block read the same BITS plane words; each extracts the indices of its
// own byte of the block and fetches codebook entries with shfl (lane l holds codebook[l]).
//   out [N, K] in DT (fp16, bf16 or fp32), row-major; values are codebook[idx] * (e4m4 * ts)
//   in fp32 (as the reference), rounded once to DT.
// PAIRS: packed holds pair codes (docs/format.md, section 7a): the lane's pairs (8q + 2w,
// 8q + 2w + 1) are byte q of word w (4 bits), or the 10 bits at 10q of lane group w, i.e. of
// (byte 16 + w : word w) (5 bits: first index in the low 5 bits, second in the next 5).
// A warp takes kDequantItems consecutive items (the next spans of a row) and issues the loads of
// all of them before it decodes the first: one load round trip per warp would leave the copy
// engine short of reads in flight (the kernel is a stream: ~4 bytes written per byte read).
// Launch: 256 threads per block, ceil(N * ceil(KT / 4) / (8 * kDequantItems)) blocks.
constexpr int kDequantItems = 4;

// The words and scale of one lane's block of an item (what dequantize_store decodes).
template <int BITS>
struct DequantLoad {
    u32 w[BITS];
    u32 code;  // E4M4 scale code
    int n, k;  // the lane's row and first in-feature; k < 0: nothing to store
};

template <int BITS>
__device__ __forceinline__ void dequantize_load(DequantLoad<BITS>& d, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                                                i64 item, i64 items, int spans, int n_tiles, int k_tiles, int K, int lane) {
    using namespace kbit;
    const bool ok = item < items;
    const i64 it = ok ? item : items - 1;  // lanes of items past the end shadow the last (no stores)
    const int n = (int)(it / spans), span = (int)(it - (i64)n * spans);
    const int kt_raw = span * 4 + (lane >> 3);
    const bool kt_ok = kt_raw < k_tiles;
    const int kt = kt_ok ? kt_raw : k_tiles - 1;  // lanes past the last k-tile shadow it (no stores)
    const int kb = (lane >> 2) & 1;
    const i64 blk = (((i64)kt * n_tiles + (n >> 7)) * 128 + (n & 127)) * 2 + kb;
    const u32* src = packed + blk * BITS;
    if constexpr (BITS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(src);
        d.w[0] = v.x; d.w[1] = v.y; d.w[2] = v.z; d.w[3] = v.w;
    } else if constexpr (BITS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(src);
        d.w[0] = v.x; d.w[1] = v.y;
    } else {
#pragma unroll
        for (int b = 0; b < BITS; ++b) d.w[b] = src[b];
    }
    d.code = absmax[blk];
    d.n = n;
    const int k = kt * 64 + kb * 32 + (lane & 3) * 8;
    d.k = ok && kt_ok && k < K ? k : -1;
}

template <int BITS, int DT, bool PAIRS>
__device__ __forceinline__ void dequantize_store(const DequantLoad<BITS>& d, u32 cb, float ts, void* __restrict__ out, int K, int q) {
    using namespace kbit;
    const u32 (&w)[BITS] = d.w;
    const float scale = mul_rn(e4m4_decode(d.code), ts);

    // idx[t]: the index of element 8q + t (bits past the low 5 are ignored by the shuffle).
    u32 idx[8];
    if constexpr (PAIRS && BITS == 5) {
        // pair t = 10 bits at 10q of (byte 16 + t : word t); the shuffle reads the low 5 bits
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            idx[2 * t] = funnel_r(w[t], w[4] >> (8 * t), 10 * q);
            idx[2 * t + 1] = idx[2 * t] >> 5;
        }
    } else if constexpr (PAIRS) {
        static_assert(BITS == 4, "pair codes are 4- and 5-bit");
        // byte t of p: the pair code of elements 8q + 2t, 8q + 2t + 1 (byte q of word t); its even
        // bits compacted are the first index, its odd bits the second (all four bytes at once)
        const u32 sel = (u32)q | ((4u + q) << 4);
        const u32 p = prmt(prmt(w[0], w[1], sel), prmt(w[2], w[3], sel), 0x5410u);
        const auto compact = [](u32 x) {
            x &= 0x55555555u;
            x = (x | (x >> 1)) & 0x33333333u;
            return (x | (x >> 2)) & 0x0F0F0F0Fu;
        };
        const u32 first = compact(p), second = compact(p >> 1);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            idx[2 * t] = first >> (8 * t);
            idx[2 * t + 1] = second >> (8 * t);
        }
    } else {
        // Byte t of lo (hi) = index of element 8q + t (8q + 4 + t): a nibble of plane b times
        // 0x00204081 << b puts its bit t at bit 8t + b (the four shifted copies never overlap).
        u32 lo = 0, hi = 0;
#pragma unroll
        for (int b = 0; b < BITS; ++b) {
            const u32 v = w[b] >> (8 * q);
            lo |= ((v & 15u) * (0x00204081u << b)) & (0x01010101u << b);
            hi |= (((v >> 4) & 15u) * (0x00204081u << b)) & (0x01010101u << b);
        }
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            idx[t] = lo >> (8 * t);
            idx[t + 4] = hi >> (8 * t);
        }
    }
    float vals[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) vals[t] = mul_rn(__uint_as_float(shfl_idx(cb, idx[t])), scale);

    const int k = d.k;
    if (k < 0) return;
    const i64 o = (i64)d.n * K + k;
    const bool vec = (K & 7) == 0;
    if constexpr (DT == KBIT_F32) {
        float* dst = static_cast<float*>(out) + o;
        if (vec) {
            reinterpret_cast<float4*>(dst)[0] = make_float4(vals[0], vals[1], vals[2], vals[3]);
            reinterpret_cast<float4*>(dst)[1] = make_float4(vals[4], vals[5], vals[6], vals[7]);
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (k + t < K) dst[t] = vals[t];
        }
    } else {
        u16* dst = static_cast<u16*>(out) + o;
        if (vec) {
            *reinterpret_cast<uint4*>(dst) = pack8<DT>(vals);
        } else {
#pragma unroll
            for (int t = 0; t < 8; ++t)
                if (k + t < K) dst[t] = f32_to_bits<DT>(vals[t]);
        }
    }
}

template <int BITS, int DT, bool PAIRS = false>
__global__ void __launch_bounds__(256) kbit_dequantize(const u32* __restrict__ packed, const u8* __restrict__ absmax,
                                                       const float* __restrict__ codebook,
                                                       const float* __restrict__ tensor_scale, void* __restrict__ out, int N,
                                                       int K, int n_tiles, int k_tiles) {
    using namespace kbit;
    const int lane = threadIdx.x & 31;
    const int spans = (k_tiles + 3) >> 2;
    const i64 items = (i64)N * spans;
    const i64 first = ((i64)blockIdx.x * 8 + (threadIdx.x >> 5)) * kDequantItems;
    if (first >= items) return;  // whole warps leave together
    DequantLoad<BITS> d[kDequantItems];
#pragma unroll
    for (int i = 0; i < kDequantItems; ++i) dequantize_load<BITS>(d[i], packed, absmax, first + i, items, spans, n_tiles, k_tiles, K, lane);
    const u32 cb = lane < (1 << BITS) ? __float_as_uint(codebook[lane]) : 0u;
    const float ts = *tensor_scale;
#pragma unroll
    for (int i = 0; i < kDequantItems; ++i) dequantize_store<BITS, DT, PAIRS>(d[i], cb, ts, out, K, lane & 3);
}
