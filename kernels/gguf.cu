// GGUF block formats kept quantized (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): dequantize, and a small-M
// GEMM that reads the blocks directly. The reference is kbit_linear/gguf_format.py.
//
// A weight [N out-features, K in-features] is stored as one array per block field (32 weights
// per block along K, nb = K / 32 blocks per row, every array row-major):
//
//   qs     u8  [N][nb][16]  4/5-bit: byte j holds weight j (low nibble) and j + 16 (high nibble)
//          s8  [N][nb][32]  Q8_0: weight j
//   qh     u32 [N][nb]      5-bit types: bit j = bit 4 of weight j
//   scale  f16 [N][nb]      d
//   mins   f16 [N][nb]      _1 types: m
//
//   weight j = d * (q_j - offset)   (Q4_0 offset 8, Q5_0 16, Q8_0 0)
//            = d * q_j + m          (Q4_1, Q5_1)
//
// The type is the template argument QT (QT_Q4_0 .. QT_Q8_0, the `code` of gguf_format.py).
//
// kbit_gguf_dequantize: four threads per (row, block); float32 arithmetic in the reference's order
// (product, then sum, never fused), rounded once to the output type: bit for bit the reference.
//
// kbit_gguf_gemv (M <= 8 * N8 rows of x, N8 <= 8): one CTA per 16 output rows, its WARPS warps
// splitting the blocks of K. A warp's step covers 4 consecutive blocks (UNROLL steps' loads in
// flight); lane (g = lane / 4, t = lane % 4) owns block b + t of rows g and g + 8 and loads its
// qs with 16-byte loads (a row's 4 blocks are one 64-byte run across the quad). A block is eight
// mma.m16n8k16 steps j with the weights as the A operand, in which the lane's k slots
// 2t, 2t+1, 2t+8, 2t+9 hold four weights of its own block:
//
//   4/5-bit: step j = nibbles (low for even j, high for odd) of qs word j / 2 = weights
//            16 (j & 1) + 4 (j / 2) .. + 3;          Q8_0: qs word j = weights 4j .. 4j + 3.
//
// A dot product does not care which k is which as long as B uses the same order, so lane (g, t)
// supplies x[token g][32 (b + t) + those weights] as its B registers (from four 16-byte loads of
// the block's x). The scale is applied to the weights (A), so one mma may mix blocks.
//
//   The weights are made in the activation type: fp16 from (0x6400 | q) = 1024 + q (exact),
//   minus 1024 + offset, times d (one rounding: the reference's value), or fma(q, d, m) for the
//   _1 types (one rounding where the reference rounds the sum to fp32 first, then to fp16: one
//   fp16 step apart in about 1 case in 800 over all d, q, m); bf16 in fp32 (the (0x4B000000 | q)
//   trick, the reference's product and sum) rounded once to bf16, the reference's value.
//
//   The fp32 accumulators of all warps are summed through shared memory at the end; bias added
//   there; rows >= N and tokens >= M are never stored.
#include "common.cuh"

namespace kbit_gguf {

#define QT_Q4_0 0
#define QT_Q4_1 1
#define QT_Q5_0 2
#define QT_Q5_1 3
#define QT_Q8_0 4

constexpr int kBlock = 32;

template <int QT> struct Traits {
    static constexpr bool kMin = (QT == QT_Q4_1 || QT == QT_Q5_1);
    static constexpr bool kHigh = (QT == QT_Q5_0 || QT == QT_Q5_1);
    static constexpr bool kEight = (QT == QT_Q8_0);
    // q - offset is what d multiplies; Q8_0's bytes are made unsigned (q + 128) first.
    static constexpr int kOffset = QT == QT_Q4_0 ? 8 : QT == QT_Q5_0 ? 16 : QT == QT_Q8_0 ? 128 : 0;
    static constexpr int kQsBytes = kEight ? 32 : 16;  // qs bytes per block
};


// Bits 0..3 of x to bit 4 of bytes 0..3 (x * 0x00204081 puts bit j at bit 8j, no carries).
KBIT_DEVICE u32 spread4(u32 x) {
    return ((x * 0x00204081u) & 0x01010101u) << 4;
}

KBIT_DEVICE float f16_to_f32(u16 h) {
    return bits_to_f32<KBIT_F16>(h);
}

// Four weights (levels in the bytes of v) as two packed pairs of the activation type DT.
template <int QT, int DT> KBIT_DEVICE void weights4(u32 v, u32 d2, u32 m2, float d, float m, u32 (&out)[2]) {
    if constexpr (DT == KBIT_F16) {
        constexpr u32 bias = 0x64006400u;  // 1024 + level, exact
        constexpr u32 sub = Traits<QT>::kMin ? 0x64006400u : (u32)(0x6400 + Traits<QT>::kOffset) * 0x10001u;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const u32 h = prmt(v, bias, p == 0 ? 0x7170u : 0x7372u) ;
            u32 q;  // level - offset, exact: h - (1024 + offset)
            asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(q) : "r"(h), "r"(sub));
            if constexpr (Traits<QT>::kMin) {
                asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(out[p]) : "r"(q), "r"(d2), "r"(m2));
            } else {
                out[p] = mul2<KBIT_F16>(q, d2);
            }
        }
    } else {
        constexpr float magic = 8388608.0f + (float)Traits<QT>::kOffset;  // 2^23 + offset
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float q = __uint_as_float(prmt(v, 0x4B000000u, 0x7440u | (u32)j)) - magic;
            f[j] = Traits<QT>::kMin ? __fadd_rn(__fmul_rn(d, q), m) : __fmul_rn(d, q);
        }
        out[0] = pack2<DT>(f[0], f[1]);
        out[1] = pack2<DT>(f[2], f[3]);
    }
}

// ---------------------------------------------------------------------------------------
// dequantize: out [N][K] in DT (fp16, bf16 or fp32); four threads per (row, block), thread
// j = 0..3 of a block makes weights 8j .. 8j + 7, so a warp's stores are one contiguous run.
// ---------------------------------------------------------------------------------------
template <int QT, int DT>
__global__ void __launch_bounds__(256)
kbit_gguf_dequantize(const u8* __restrict__ qs, const u32* __restrict__ qh, const u16* __restrict__ scale,
                     const u16* __restrict__ mins, void* __restrict__ out, int N, int nb) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 blk = i >> 2;  // (row, block) index
    const int part = (int)(i & 3);
    if (blk >= (i64)N * nb) return;
    // Levels of weights 8 part .. 8 part + 7. 4/5-bit: qs bytes 8 (part & 1) .. + 7, low
    // nibbles for parts 0, 1 and high for 2, 3; Q8_0: qs bytes 8 part .. + 7.
    const int byte0 = Traits<QT>::kEight ? 8 * part : 8 * (part & 1);
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(qs + blk * Traits<QT>::kQsBytes + byte0));
    const float d = f16_to_f32(__ldg(scale + blk));
    const float m = Traits<QT>::kMin ? f16_to_f32(__ldg(mins + blk)) : 0.0f;
    const u32 h = Traits<QT>::kHigh ? (__ldg(qh + blk) >> (8 * part)) : 0u;
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const u32 byte = ((j < 4 ? raw.x : raw.y) >> (8 * (j & 3))) & 0xFFu;
        float q;
        if constexpr (Traits<QT>::kEight) {
            q = (float)(int)(signed char)byte;
        } else {
            u32 v = (part >= 2 ? byte >> 4 : byte) & 0xFu;
            if constexpr (Traits<QT>::kHigh) v |= ((h >> j) & 1u) << 4;
            q = (float)((int)v - (Traits<QT>::kMin ? 0 : Traits<QT>::kOffset));
        }
        f[j] = Traits<QT>::kMin ? __fadd_rn(__fmul_rn(d, q), m) : __fmul_rn(d, q);
    }
    if constexpr (DT == KBIT_F32) {
        float4* dst = reinterpret_cast<float4*>(out) + i * 2;
        dst[0] = make_float4(f[0], f[1], f[2], f[3]);
        dst[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
        reinterpret_cast<uint4*>(out)[i] = pack8<DT>(f);
    }
}

// ---------------------------------------------------------------------------------------
// small-M GEMM: out [M][N] = x [M][K] @ W^T (+ bias), M <= 8 * N8
// ---------------------------------------------------------------------------------------
// The end of both small-M kernels: sum the WARPS warps' fp32 accumulators of one 16-row tile
// through shared memory (lane's c[i] is row g + 8 for i >= 2, token 8n + 2t + (i & 1)), add the
// bias and store rows < N, tokens < M in DT.
template <int DT, int N8, int WARPS>
KBIT_DEVICE void store_row_tile(float (&partial)[WARPS][N8 * 128], const float (&acc)[N8][4], int row0, const u16* __restrict__ bias,
                                u16* __restrict__ out, int M, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int n = 0; n < N8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][n * 128 + lane * 4 + i] = acc[n][i];
    __syncthreads();
    for (int o = threadIdx.x; o < N8 * 128; o += WARPS * 32) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += partial[w][o];
        const int n = o / 128, l = (o / 4) % 32, i = o % 4;
        const int row = row0 + (l >> 2) + (i >= 2 ? 8 : 0);
        const int token = n * 8 + 2 * (l & 3) + (i & 1);
        if (row < N && token < M) {
            if (bias != nullptr) sum += bits_to_f32<DT>(bias[row]);
            out[(i64)token * N + row] = f32_to_bits<DT>(sum);
        }
    }
}

// A warp's step covers 4 consecutive blocks; lane (g, t) owns block b + t of rows g and g + 8.
template <int QT> struct StepLoad {
    uint4 w[2][Traits<QT>::kQsBytes / 16];  // [row][16-byte chunk] of the block's qs
    u32 qh[2];
    u16 d[2], m[2];
};

// qs word and nibble half of mma step j (0..7) of a block, and the first weight it covers.
template <int QT> KBIT_DEVICE u32 step_word(const uint4 (&w)[Traits<QT>::kQsBytes / 16], int j) {
    const int word = Traits<QT>::kEight ? j : (j >> 1);
    const uint4 c = w[word >> 2];
    const int i = word & 3;
    return i == 0 ? c.x : i == 1 ? c.y : i == 2 ? c.z : c.w;
}
template <int QT> KBIT_DEVICE constexpr int step_first(int j) {
    return Traits<QT>::kEight ? 4 * j : 16 * (j & 1) + 4 * (j >> 1);
}

template <int QT> KBIT_DEVICE u32 step_levels(u32 word, u32 qh, int j) {
    if constexpr (Traits<QT>::kEight) {
        return word ^ 0x80808080u;
    } else {
        u32 v = ((j & 1) ? (word >> 4) : word) & 0x0F0F0F0Fu;
        if constexpr (Traits<QT>::kHigh) v |= spread4((qh >> step_first<QT>(j)) & 0xFu);
        return v;
    }
}

template <int QT, int DT, int N8, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32)
kbit_gguf_gemv(const u16* __restrict__ x, const u8* __restrict__ qs, const u32* __restrict__ qh, const u16* __restrict__ scale,
               const u16* __restrict__ mins, const u16* __restrict__ bias, u16* __restrict__ out, int M, int N, int K) {
    constexpr int kChunks = Traits<QT>::kQsBytes / 16;
    static_assert(WARPS * N8 * 128 * 4 <= 48 * 1024, "static shared memory of one block is at most 48 KB");
    __shared__ float partial[WARPS][N8 * 128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nb = K / kBlock;
    const int row0 = blockIdx.x * 16;
    // Rows past N read row N - 1 (never stored).
    const i64 rows[2] = {(i64)min(row0 + g, N - 1), (i64)min(row0 + g + 8, N - 1)};

    float acc[N8][4];
#pragma unroll
    for (int n = 0; n < N8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;

    for (int b0 = 4 * warp * UNROLL; b0 < nb; b0 += 4 * WARPS * UNROLL) {
        StepLoad<QT> ld[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + 4 * u + t;  // this lane's block
            const bool live = b < nb;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const i64 blk = rows[r] * nb + (live ? b : 0);
                const uint4* src = reinterpret_cast<const uint4*>(qs + blk * Traits<QT>::kQsBytes);
#pragma unroll
                for (int c = 0; c < kChunks; ++c) ld[u].w[r][c] = live ? __ldg(src + c) : make_uint4(0u, 0u, 0u, 0u);
                ld[u].qh[r] = Traits<QT>::kHigh && live ? __ldg(qh + blk) : 0u;
                ld[u].d[r] = live ? __ldg(scale + blk) : (u16)0;  // d = 0: a missing block adds nothing
                ld[u].m[r] = Traits<QT>::kMin && live ? __ldg(mins + blk) : (u16)0;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (b0 + 4 * u >= nb) break;  // warp-uniform
            const int b = b0 + 4 * u + t;
            const bool live = b < nb;
            u32 a[8][4];  // [mma step][A register]
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 d2 = (u32)ld[u].d[r] * 0x10001u, m2 = (u32)ld[u].m[r] * 0x10001u;
                const float d = f16_to_f32(ld[u].d[r]), m = Traits<QT>::kMin ? f16_to_f32(ld[u].m[r]) : 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    u32 pair[2];
                    weights4<QT, DT>(step_levels<QT>(step_word<QT>(ld[u].w[r], j), ld[u].qh[r], j), d2, m2, d, m, pair);
                    a[j][r] = pair[0];      // k slots 2t, 2t+1 of row g (r = 0) / g + 8 (r = 1)
                    a[j][2 + r] = pair[1];  // k slots 2t+8, 2t+9
                }
            }
            // x[token][32 b .. 32 b + 31] of token fragment n as four 16-byte pieces (zeros past
            // M or nb); fragment n + 1's loads are issued before fragment n's MMAs.
            uint4 xv[2][4];
            auto load_x = [&](int n, uint4 (&dst)[4]) {
                const int token = n * 8 + g;
                const uint4* xs = reinterpret_cast<const uint4*>(x + (i64)token * K + (i64)b * kBlock);
#pragma unroll
                for (int q = 0; q < 4; ++q) dst[q] = token < M && live ? __ldg(xs + q) : make_uint4(0u, 0u, 0u, 0u);
            };
            load_x(0, xv[0]);
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                if (n + 1 < N8) load_x(n + 1, xv[(n + 1) & 1]);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int e = step_first<QT>(j);  // weights e .. e + 3 of the block
                    const uint4 v = xv[n & 1][e >> 3];
                    const u32 b0r = (e & 4) ? v.z : v.x, b1r = (e & 4) ? v.w : v.y;
                    mma_16816<DT>(acc[n], a[j], b0r, b1r);
                }
            }
        }
    }

    store_row_tile<DT, N8, WARPS>(partial, acc, row0, bias, out, M, N);
}

// ---------------------------------------------------------------------------------------
// 8-bit activations (seed 001's W4A8 / W5A8 / W8A8)
// ---------------------------------------------------------------------------------------
// kbit_gguf_quantize_q8_1: x [M][K] (DT) -> Q8_1 blocks, one thread per (row, block):
//   xq [M][K] s8 = round(x / da) (halves away from zero), xd [M][K/32] f16 = max|x| / 127,
//   xs [M][K/32] f16 = sum of the block's x (float32, in order).
template <int DT>
__global__ void __launch_bounds__(256)
kbit_gguf_quantize_q8_1(const u16* __restrict__ x, signed char* __restrict__ xq, u16* __restrict__ xd, u16* __restrict__ xs,
                        int M, int nb) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;  // (row, block)
    if (i >= (i64)M * nb) return;
    const uint4* src = reinterpret_cast<const uint4*>(x + i * kBlock);
    float v[kBlock];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const uint4 p = __ldg(src + c);
        const u32 w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[8 * c + 2 * j] = bits_to_f32<DT>((u16)(w[j] & 0xFFFFu));
            v[8 * c + 2 * j + 1] = bits_to_f32<DT>((u16)(w[j] >> 16));
        }
    }
    float amax = 0.0f, sum = 0.0f;
    bool nan = false;  // fmaxf drops NaN; the reference's max keeps it, so a NaN block gets d = NaN
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
        amax = fmaxf(amax, fabsf(v[j]));
        nan |= v[j] != v[j];
        sum = __fadd_rn(sum, v[j]);
    }
    const float d = nan ? __int_as_float(0x7fc00000) : amax / 127.0f;
    u32 packed[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) packed[j] = 0u;
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
        const int q = d == 0.0f || nan ? 0 : (int)roundf(v[j] / d);
        packed[j >> 2] |= ((u32)q & 0xFFu) << (8 * (j & 3));
    }
    uint4* dst = reinterpret_cast<uint4*>(xq + i * kBlock);
    dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    xd[i] = f32_to_bits<KBIT_F16>(d);
    xs[i] = f32_to_bits<KBIT_F16>(sum);
}

// D = A * B + D, m16n8k32, int8 in, int32 accumulators. A: 4 regs (row-major 16x32), B: 2 regs.
KBIT_DEVICE void mma_16832_s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// kbit_gguf_gemv_a8: out [M][N] = Q8_1(x) . W (+ bias), M <= 8 * N8. One CTA per 16 output rows,
// its WARPS warps splitting the blocks; a warp takes UNROLL consecutive blocks per step, one
// mma.m16n8k32 (s8) per block and token fragment, so each block's integer sum gets its own
// rescale (fresh int32 accumulators). In the natural fragment order lane (g, t) holds, of rows g
// and g + 8, weights 4t .. 4t+3 (a0/a1) and 16 + 4t .. (a2/a3): the low and high nibbles of qs
// word t (Q8_0: words t and 4 + t), unsigned levels whose offset the formula applies through
// the block sum (see gguf_format.py); B is x's int8 at the same k of token g; the int32 result
// c[i] is row g (+8 for i >= 2), token 2t + (i & 1).
template <int QT, int DT, int N8, int WARPS, int UNROLL>
__global__ void __launch_bounds__(WARPS * 32)
kbit_gguf_gemv_a8(const signed char* __restrict__ xq, const u16* __restrict__ xd, const u16* __restrict__ xs,
                  const u8* __restrict__ qs, const u32* __restrict__ qh, const u16* __restrict__ scale,
                  const u16* __restrict__ mins, const u16* __restrict__ bias, u16* __restrict__ out, int M, int N, int K) {
    static_assert(WARPS * N8 * 128 * 4 <= 48 * 1024, "static shared memory of one block is at most 48 KB");
    __shared__ float partial[WARPS][N8 * 128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nb = K / kBlock;
    const int row0 = blockIdx.x * 16;
    const i64 rows[2] = {(i64)min(row0 + g, N - 1), (i64)min(row0 + g + 8, N - 1)};

    float acc[N8][4];
#pragma unroll
    for (int n = 0; n < N8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0f;

    for (int b0 = warp * UNROLL; b0 < nb; b0 += WARPS * UNROLL) {
        u32 w[UNROLL][2][2], h[UNROLL][2];
        float dw[UNROLL][2], mw[UNROLL][2];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = min(b0 + u, nb - 1);  // past nb: a real block, its result skipped below
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const i64 blk = rows[r] * nb + b;
                const u32* q32 = reinterpret_cast<const u32*>(qs + blk * Traits<QT>::kQsBytes);
                w[u][r][0] = __ldg(q32 + t);
                w[u][r][1] = Traits<QT>::kEight ? __ldg(q32 + 4 + t) : 0u;
                h[u][r] = Traits<QT>::kHigh ? __ldg(qh + blk) : 0u;
                dw[u][r] = f16_to_f32(__ldg(scale + blk));
                mw[u][r] = Traits<QT>::kMin ? f16_to_f32(__ldg(mins + blk)) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int b = b0 + u;
            if (b >= nb) break;  // warp-uniform
            u32 a[4];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                if constexpr (Traits<QT>::kEight) {
                    a[r] = w[u][r][0];
                    a[2 + r] = w[u][r][1];
                } else {
                    u32 lo = w[u][r][0] & 0x0F0F0F0Fu, hi = (w[u][r][0] >> 4) & 0x0F0F0F0Fu;
                    if constexpr (Traits<QT>::kHigh) {
                        lo |= spread4((h[u][r] >> (4 * t)) & 0xFu);
                        hi |= spread4((h[u][r] >> (16 + 4 * t)) & 0xFu);
                    }
                    a[r] = lo;
                    a[2 + r] = hi;
                }
            }
#pragma unroll
            for (int n = 0; n < N8; ++n) {
                const int token = n * 8 + g;
                const u32* xrow = reinterpret_cast<const u32*>(xq + (i64)token * K + (i64)b * kBlock);
                const u32 b0r = token < M ? __ldg(xrow + t) : 0u, b1r = token < M ? __ldg(xrow + 4 + t) : 0u;
                int c[4] = {0, 0, 0, 0};
                mma_16832_s8(c, a, b0r, b1r);
#pragma unroll
                for (int p = 0; p < 2; ++p) {  // tokens 2t, 2t + 1 of the fragment
                    const int tk = n * 8 + 2 * t + p;
                    const float da = tk < M ? f16_to_f32(__ldg(xd + (i64)tk * nb + b)) : 0.0f;
                    const float sa = tk < M ? f16_to_f32(__ldg(xs + (i64)tk * nb + b)) : 0.0f;
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const float sumi = (float)c[2 * r + p];
                        float v;
                        if constexpr (Traits<QT>::kMin) {
                            v = dw[u][r] * da * sumi + mw[u][r] * sa;
                        } else if constexpr (Traits<QT>::kEight) {
                            v = dw[u][r] * da * sumi;
                        } else {
                            v = dw[u][r] * (da * sumi - (float)Traits<QT>::kOffset * sa);
                        }
                        acc[n][2 * r + p] += v;
                    }
                }
            }
        }
    }

    store_row_tile<DT, N8, WARPS>(partial, acc, row0, bias, out, M, N);
}

}  // namespace kbit_gguf

using kbit_gguf::kbit_gguf_dequantize;
using kbit_gguf::kbit_gguf_gemv;
using kbit_gguf::kbit_gguf_gemv_a8;
using kbit_gguf::kbit_gguf_quantize_q8_1;
