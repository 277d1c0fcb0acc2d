// Hopper (sm_90a) fused kbit dequantize + warpgroup-MMA GEMM:  out[M, N] = x[M, K] @ W[N, K]^T (+ bias)
//
// Same tiled weight format and the same stream-K work split as gemm.cu (read its header first).
// What differs is how the product is formed: this kernel computes the transpose, out^T = W x^T,
// so that the dequantized weights are the *register* A operand of wgmma and the activations its
// shared-memory B operand:
//
//      wgmma.m64n{BT}k16:   D[64 features x BT tokens] += A[64 features x 16 k] (registers)
//                                                        * B[16 k x BT tokens] (shared memory)
//
// Block tile: 128 features (one storage n-tile) x BT tokens (BT = 64, 128 or 256), two warpgroups:
//
//                 BT tokens ->
//           +------------------------------------+
//   wg 0    | features   0.. 63   (warps 0..3)   |   warp w of a group: features 16w .. 16w+15;
//           +------------------------------------+   lane (g = lane / 4, t = lane % 4) dequantizes
//   wg 1    | features  64..127   (warps 4..7)   |   features 16w+g and 16w+g+8 and accumulates
//           +------------------------------------+   tokens 8j + 2t, 8j + 2t + 1 (j < BT / 8)
//
// A fragment of one k16 step (per warp the mma.m16n8k16 A layout): a0 = (feature g, k 2t, 2t+1),
// a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..). dequant_block (dequant.cuh) gives a
// lane exactly these pairs of one (feature, 32-block): out[0], out[1] for the block's first k16
// step, out[2], out[3] for its second.
//
// B operand: a stage's activation tile is BT rows (tokens) x 64 in-features (128 bytes), 16-byte
// chunk c of row r stored at chunk c ^ (r % 8): the 128-byte swizzle of wgmma's K-major
// descriptor (wgmma.cuh). Rows past M and in-features past K are zero-filled by cp.async.
//
// Pipeline (every thread copies, both warpgroups compute): STAGES stage buffers, filled by
// cp.async STAGES - 2 k-tiles ahead. Per k-tile a warpgroup dequantizes 32-block kb into one of
// two A register sets, issues its two wgmmas as one commit group and then waits until at most one
// group is in flight: the decode of the next block overlaps the MMAs of this one. A stage is
// refilled two iterations after its last wgmma was issued: by then every thread has retired that
// wgmma (wait_group 1 one block later) and passed the iteration's barrier.
//
// Epilogue: acc * tensor_scale (+ bias) stored straight from the accumulators (each store is 8
// consecutive features of one token per 8 lanes), or, for a tile split over several blocks, the
// fp32 partials summed in the workspace exactly as in gemm.cu.
//
// Shared memory (base aligned up to 1024 bytes at run time):
//   STAGES x [x tile BT*128 | plane words 128*2*BITS*4 | scale codes 256] (each 1024-aligned)
//   | pair table | scale table | flag
#include "dequant.cuh"  // load_planes, dequant_block, build_dequant_tables
#include "wgmma.cuh"    // wgmma_rs, fences, sw128_kmajor_desc

namespace kbit {
namespace sm90 {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kTileN = 128;    // features per block tile = one storage n-tile
constexpr int kTileK = 64;     // in-features per k-tile = one storage k-tile (two 32-blocks)

template <int BITS, int BT>
struct Shape {
    static_assert(BT == 64 || BT == 128 || BT == 256, "token tile");
    static constexpr int STAGES = BT == 256 ? 5 : 6;
    static constexpr int X_BYTES = BT * kTileK * 2;        // activation tile
    static constexpr int P_BYTES = kTileN * 2 * BITS * 4;  // one storage tile of plane words
    static constexpr int S_BYTES = kTileN * 2;             // its scale codes
    static constexpr int STAGE_BYTES = (X_BYTES + P_BYTES + S_BYTES + 1023) / 1024 * 1024;
    static constexpr int LUT_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int SCALE_OFFSET = LUT_OFFSET + pair_table_bytes<BITS>();
    static constexpr int FLAG_OFFSET = SCALE_OFFSET + 256 * 4;
    static constexpr int SMEM_BYTES = FLAG_OFFSET + 16 + 1024;  // + the run-time alignment of the base
    static constexpr int NACC = BT / 2;                         // fp32 accumulators per thread
    static constexpr int X_ITERS = BT * 8 / kThreads;           // 16-byte chunks of the x tile per thread
    static constexpr int P_CHUNKS = P_BYTES / 16;
    static constexpr int P_ITERS = (P_CHUNKS + kThreads - 1) / kThreads;
    static constexpr int MIN_BLOCKS = BT == 64 ? 2 : 1;  // blocks per SM the registers are sized for
    static_assert(X_ITERS * kThreads == BT * 8, "whole rows per pass");
    static_assert(X_BYTES % 1024 == 0, "swizzle atoms");
};

// Per-thread copy plan for one range of k-tiles of one block tile. Thread tid copies chunk
// tid % 8 of tile rows tid / 8 + 32 i (i < X_ITERS): one source pointer and one swizzled
// destination serve all of them (rows 32 apart share the swizzle phase).
template <int BITS, int BT>
struct StageLoader {
    using S = Shape<BITS, BT>;
    const u16* x;      // any valid address (source of the zero-filling copies)
    const u16* x_src;  // row m0 + tid / 8, in-feature x_col
    i64 x_row_step;    // 32 rows
    int x_col;
    int x_rows;  // copies i < x_rows are real rows (< M)
    u32 x_dst;
    const u32* p_src;
    const u8* s_src;
    i64 p_step, s_step;  // between consecutive k-tiles of one n-tile
    int K;

    __device__ __forceinline__ StageLoader(const u16* x_, const u32* packed, const u8* absmax, int M, int K_, int n_tiles,
                                           int m0, int nt, int kt0)
        : x(x_), K(K_) {
        const int tid = threadIdx.x;
        const int r = tid >> 3, ch = tid & 7;
        const int left = M - m0 - r;  // real rows from this thread's first one, 32 apart
        x_rows = left <= 0 ? 0 : (left + 31) / 32;
        x_col = kt0 * kTileK + ch * 8;
        x_src = x_ + (x_rows > 0 ? (i64)(m0 + r) * K_ + x_col : 0);
        x_row_step = (i64)32 * K_;
        x_dst = r * 128 + ((ch ^ (r & 7)) << 4);
        const i64 tile = (i64)kt0 * n_tiles + nt;
        p_src = packed + tile * (kTileN * 2 * BITS) + tid * 4;
        s_src = absmax + tile * S::S_BYTES + tid * 16;
        p_step = (i64)n_tiles * (kTileN * 2 * BITS);
        s_step = (i64)n_tiles * S::S_BYTES;
    }

    // Issues the copies of the next k-tile into `stage` and advances.
    __device__ __forceinline__ void issue(u8* stage) {
        const bool col_ok = x_col < K;
#pragma unroll
        for (int i = 0; i < S::X_ITERS; ++i) {
            const bool ok = col_ok && i < x_rows;
            cp_async16(stage + x_dst + i * 32 * 128, ok ? x_src + i * x_row_step : x, ok ? 16u : 0u);
        }
        x_src += kTileK;
        x_col += kTileK;
        const int tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < S::P_ITERS; ++i)
            if (i * kThreads + tid < S::P_CHUNKS) cp_async16(stage + S::X_BYTES + (i * kThreads + tid) * 16, p_src + i * kThreads * 4);
        if (tid < S::S_BYTES / 16) cp_async16(stage + S::X_BYTES + S::P_BYTES + tid * 16, s_src);
        p_src += p_step;
        s_src += s_step;
    }
};

// One k-tile of one warpgroup: two 32-blocks, each dequantized into an A register set and
// multiplied by two wgmmas (one commit group). a[kb] is the register set of block kb; on entry
// the group of the previous k-tile's block 1 (a[1]) may still be in flight. The shared-memory
// words of both blocks (planes and scales) are loaded first, so block 1's loads are in flight
// while block 0 is decoded and issued.
template <int BITS, int BT, int DT>
__device__ __forceinline__ void compute_stage(const u8* stage, const u8* lut, const u32* scale_tab, u32 cb_reg, int col0,
                                              float (&acc)[Shape<BITS, BT>::NACC], u32 (&a)[2][2][4]) {
    using S = Shape<BITS, BT>;
    const int lane = threadIdx.x & 31;
    const u32* ps = reinterpret_cast<const u32*>(stage + S::X_BYTES);
    const u8* ss = stage + S::X_BYTES + S::P_BYTES;
    const u64 desc = sw128_kmajor_desc(smem_addr(stage));
    u32 w[2][2][BITS], s2[2][2];  // [block][row]: plane words, scale pair
#pragma unroll
    for (int kb = 0; kb < 2; ++kb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int col = col0 + 8 * r;
            load_planes<BITS>(w[kb][r], ps + (col * 2 + kb) * BITS);
            s2[kb][r] = scale_tab[ss[col * 2 + kb]];
        }
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
        u32 q[2][4];  // q[r]: feature col0 + 8r, the block's four pairs
#pragma unroll
        for (int r = 0; r < 2; ++r) dequant_block<BITS, DT>(w[kb][r], lane & 3, s2[kb][r], lut, lane * 4, cb_reg, q[r]);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            a[kb][sub][0] = q[0][2 * sub];
            a[kb][sub][1] = q[1][2 * sub];
            a[kb][sub][2] = q[0][2 * sub + 1];
            a[kb][sub][3] = q[1][2 * sub + 1];
        }
        wgmma_fence();
        hold_registers(acc);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) wgmma_rs<BT, DT>(acc, a[kb][sub], desc + 2 * (2 * kb + sub));
        wgmma_commit();
        hold_registers(acc);
        wgmma_wait<1>();  // the other block's group is retired: its registers may be rewritten
        hold_registers(a[kb ^ 1][0]);
        hold_registers(a[kb ^ 1][1]);
    }
}

// acc * ts (+ bias) -> out for tokens m0.. and features n0 + col0, n0 + col0 + 8; tokens >= M and
// features >= N are skipped.
template <int BITS, int BT, int DT>
__device__ __forceinline__ void store_tile(const float (&acc)[Shape<BITS, BT>::NACC], u16* __restrict__ out,
                                           const u16* __restrict__ bias, float ts, int M, int N, int m0, int n) {
    const int t = threadIdx.x & 3;
    float b[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (bias != nullptr && n + 8 * r < N) b[r] = bits_to_f32<DT>(bias[n + 8 * r]);
#pragma unroll
    for (int j = 0; j < BT / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m0 + 8 * j + 2 * t + h;
            if (m >= M) continue;
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (n + 8 * r < N) out[(i64)m * N + n + 8 * r] = f32_to_bits<DT>(acc[4 * j + 2 * r + h] * ts + b[r]);
        }
}

}  // namespace sm90
}  // namespace kbit

// Template parameters:
//   BITS  index width, 2..5
//   BT    tokens per block tile (wgmma's N): 64, 128 or 256
//   DT    activation/output type: KBIT_F16 or KBIT_BF16
// Arguments: as kbit_gemm in gemm.cu (x [M, K] row-major with K % 8 == 0 and 16-byte aligned rows;
//   the tiled weight; codebook, tensor_scale, bias or null, out [M, N]; workspace of
//   gridDim.x * 2 * 256 * BT / 2 floats, touched only for split tiles; counters [m_tiles * n_tiles],
//   zero on entry and left zero; M, N, K true sizes; n_tiles, k_tiles of the padded weight; iters:
//   k-iterations per block), with m_tiles = ceil(M / BT).
// Launch: 256 threads, Shape::SMEM_BYTES of dynamic shared memory, ceil(total / iters) blocks
// where total = m_tiles * n_tiles * k_tiles.
template <int BITS, int BT, int DT>
__global__ void __launch_bounds__(kbit::sm90::kThreads, kbit::sm90::Shape<BITS, BT>::MIN_BLOCKS)
    kbit_gemm_sm90(const u16* __restrict__ x, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                   const float* __restrict__ codebook, const float* __restrict__ tensor_scale, const u16* __restrict__ bias,
                   u16* __restrict__ out, float* __restrict__ workspace, int* __restrict__ counters, int M, int N, int K,
                   int n_tiles, int k_tiles, int iters) {
    using namespace kbit;
    using namespace kbit::sm90;
    using S = Shape<BITS, BT>;
    extern __shared__ __align__(1024) u8 smem_raw[];
    u8* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    int* flag = reinterpret_cast<int*>(smem + S::FLAG_OFFSET);
    const u8* lut = smem + S::LUT_OFFSET;
    const u32* scale_tab = reinterpret_cast<const u32*>(smem + S::SCALE_OFFSET);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int col0 = (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2);  // this lane's first feature in the tile

    // Programmatic dependent launch, as in gemm.cu.
    allow_dependent_launch();
    grid_dependency_wait();

    const u32 cb_reg = build_dequant_tables<BITS, DT, kThreads>(smem + S::LUT_OFFSET, reinterpret_cast<u32*>(smem + S::SCALE_OFFSET),
                                                               codebook);
    const float ts = *tensor_scale;
    __syncthreads();

    const int m_tiles = (M + BT - 1) / BT;
    const i64 total = (i64)m_tiles * n_tiles * k_tiles;
    i64 it = (i64)blockIdx.x * iters;
    const i64 it_end = it + iters < total ? it + iters : total;

    u32 a[2][2][4] = {};  // A registers: [32-block of the k-tile][k16 step][fragment]
    while (it < it_end) {
        const int tile = (int)(it / k_tiles);
        const int kb0 = (int)(it - (i64)tile * k_tiles);
        const int kb1 = (int)((i64)k_tiles < (it_end - (i64)tile * k_tiles) ? k_tiles : it_end - (i64)tile * k_tiles);
        const int nk = kb1 - kb0;
        const int mt = tile % m_tiles, nt = tile / m_tiles;
        const int m0 = mt * BT;

        float acc[S::NACC];
#pragma unroll
        for (int i = 0; i < S::NACC; ++i) acc[i] = 0.f;

        StageLoader<BITS, BT> loader(x, packed, absmax, M, K, n_tiles, m0, nt, kb0);
#pragma unroll
        for (int s = 0; s < S::STAGES - 2; ++s) {
            if (s < nk) loader.issue(smem + s * S::STAGE_BYTES);
            cp_async_commit();
        }
        for (int i = 0; i < nk; ++i) {
            cp_async_wait<S::STAGES - 3>();
            fence_proxy_async_shared();  // this thread's copies of stage i, before wgmma reads them
            __syncthreads();             // stage i landed for everyone; stage i - 2 is retired by everyone
            if (i + S::STAGES - 2 < nk) loader.issue(smem + ((i + S::STAGES - 2) % S::STAGES) * S::STAGE_BYTES);
            cp_async_commit();
            compute_stage<BITS, BT, DT>(smem + (i % S::STAGES) * S::STAGE_BYTES, lut, scale_tab, cb_reg, col0, acc, a);
        }
        wgmma_wait<0>();
        hold_registers(acc);
        cp_async_wait<0>();
        __syncthreads();  // all reads of the stages done before the next range refills them

        const int n = nt * kTileN + col0;
        if (kb0 == 0 && kb1 == k_tiles) {
            store_tile<BITS, BT, DT>(acc, out, bias, ts, M, N, m0, n);
        } else {
            // Split tile: contributors are the blocks whose ranges meet [tile*k_tiles, (tile+1)*k_tiles).
            const i64 t0 = (i64)tile * k_tiles;
            const int first = (int)(t0 / iters), last = (int)((t0 + k_tiles - 1) / iters);
            const int side = tile == (int)(((i64)blockIdx.x * iters) / k_tiles) ? 0 : 1;
            float4* slot = reinterpret_cast<float4*>(workspace) + ((i64)blockIdx.x * 2 + side) * (S::NACC / 4) * kThreads;
#pragma unroll
            for (int v = 0; v < S::NACC / 4; ++v)
                slot[v * kThreads + tid] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
            __threadfence();
            __syncthreads();
            if (tid == 0) {
                const int arrived = atomicAdd(counters + tile, 1);
                const int is_last = arrived == last - first;
                if (is_last) counters[tile] = 0;  // every contributor has counted: reset for the next launch
                *flag = is_last;
            }
            __syncthreads();
            if (*flag) {
                __threadfence();
#pragma unroll
                for (int i = 0; i < S::NACC; ++i) acc[i] = 0.f;
                for (int cta = first; cta <= last; ++cta) {
                    const int cside = tile == (int)(((i64)cta * iters) / k_tiles) ? 0 : 1;
                    const float4* cs = reinterpret_cast<const float4*>(workspace) + ((i64)cta * 2 + cside) * (S::NACC / 4) * kThreads;
#pragma unroll
                    for (int v = 0; v < S::NACC / 4; ++v) {
                        const float4 p = ld_cg(cs + v * kThreads + tid);
                        acc[4 * v] += p.x;
                        acc[4 * v + 1] += p.y;
                        acc[4 * v + 2] += p.z;
                        acc[4 * v + 3] += p.w;
                    }
                }
                store_tile<BITS, BT, DT>(acc, out, bias, ts, M, N, m0, n);
            }
        }
        it += nk;
    }
}
