// Fused kbit dequantize + tensor-core GEMM:  out[M, N] = x[M, K] @ W[N, K]^T (+ bias)
//
// W is stored in the tiled kbit format (docs/format.md, section 7):
//
//   packed[kt][nt][c][kb][b]  int32   bit-plane b of block (n = 128*nt + c, k = 64*kt + 32*kb .. +31)
//   absmax[kt][nt][c][kb]     uint8   E4M4 scale code of the same block
//
//   one storage tile (kt, nt) = 128 output columns x 64 in-features:
//
//        k ->  0 ........ 31 | 32 ....... 63
//   c=0   [ kb=0: BITS words | kb=1: BITS words ]   <- bit i of word b = bit b of the index of k = 32*kb + i
//   c=1   [ ...                                 ]
//   ...
//   c=127 [ ...                                 ]
//   = 128 * 2 * BITS words (BITS KiB) + 256 scale bytes, contiguous
//
// Work split
// ----------
// A thread block (256 threads, 8 warps) owns an output tile of BM = 16*MB rows x BN = 128 columns
// and walks the 64-wide k-tiles of its range with a STAGES-deep cp.async pipeline:
//
//              BN = 128 columns (one storage n-tile)
//          +-----+-----+-----+-----+-----+-----+-----+-----+
//   MB<=4  | w0  | w1  | w2  | w3  | w4  | w5  | w6  | w7  |   8 warps side by side, 16 columns each,
//          +-----+-----+-----+-----+-----+-----+-----+-----+   all BM rows (FM = MB m16 fragments)
//
//          +-----------+-----------+-----------+-----------+
//   MB=8   |    w0     |    w1     |    w2     |    w3     |   2 x 4 warps, 32 columns each,
//          +-----------+-----------+-----------+-----------+   BM/2 rows each
//          |    w4     |    w5     |    w6     |    w7     |
//          +-----------+-----------+-----------+-----------+
//
// Each warp dequantizes the weights of its own columns, so warps stacked along M decode the same
// weights twice. Up to MB = 4 (M <= 64, where the weight decode is most of the work) the warps
// therefore all sit along N and read more of the activation tile instead; MB = 8 keeps 2 x 4 to
// hold the accumulators at 64 per thread.
//
// The grid is a flat list of k-iterations, (tile, k-tile) with k fastest, cut into equal
// contiguous ranges of L iterations, one range per block ("stream-K"). A range covering a
// tile's whole K writes the output directly. A tile shared by several blocks is split-K: each
// contributor stores its fp32 partial to its own workspace slot, the last one to arrive (tile
// counter) sums the slots in a fixed order and writes the output, then resets the counter to
// zero for the next launch. The sum order never depends on timing, so results are
// deterministic for a given launch configuration.
//
// Dequantization (per thread, per n8 fragment column and 32-row block)
// -------------------------------------------------------------------
// mma.m16n8k16 gives lane l the B rows {2i, 2i+1, 2i+8, 2i+9} (i = l % 4) of column l / 4, so
// over a 32-row block a lane needs the index pairs at bit positions 2i + 8j, j = 0..3, of each
// plane word. Rotating plane b right by 2i - 2b and masking with 0x03030303 << 2b drops both
// bits of each pair into byte j at bits 2b, 2b+1; OR-ing the BITS planes leaves one "pair index"
// (lo/hi bits interleaved) per byte. With 4-bit pair codes (PAIRS, docs/format.md, section 7a)
// that word is stored as such: the lane loads word i of the block and skips the gather; 5-bit
// pair codes store the lane's eight indices as 5-bit fields of (byte 16 + i : word i).
// BITS <= 4: a shared-memory table maps a pair index straight
// to the two codebook values (one 32-bit load per two weights; 32 copies of the table, one per
// bank, so lanes never conflict). BITS = 5: each lane keeps one codebook entry in a register and
// lanes fetch entries with shfl (the codebook in registers).
// The block scale (E4M4, <= 31) multiplies the pair in fp16/bf16 (a 256-entry shared table maps
// the code to the packed pair of scales); the per-tensor power of two multiplies the fp32
// accumulators in the epilogue.
//
// Shared memory: STAGES x [A tile | plane words | scale codes] | pair table | scale table | flag
#include "dequant.cuh"  // load_block, dequant_block, build_dequant_tables (includes common.cuh)

namespace kbit {

constexpr int kThreads = 256;
constexpr int kTileN = 128;  // columns per block tile = one storage n-tile
constexpr int kTileK = 64;   // in-features per k-tile = one storage k-tile (two 32-blocks)

template <int BITS, int MB>
struct GemmShape {
    static constexpr int BM = 16 * MB;               // rows per block tile
    static constexpr int WM = MB >= 8 ? 2 : 1;       // warps along M
    static constexpr int WN = 8 / WM;                // warps along N
    static constexpr int FM = MB / WM;               // m16 fragments per warp
    static constexpr int FN = kTileN / (8 * WN);     // n8 fragments per warp
    static constexpr int STAGES = 4;                 // cp.async pipeline depth
    static constexpr int A_BYTES = BM * kTileK * 2;  // activation tile (fp16/bf16), swizzled rows
    static constexpr int B_BYTES = kTileN * 2 * BITS * 4;  // one storage tile of planes
    static constexpr int S_BYTES = kTileN * 2;              // its scale bytes
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_BYTES;
    static constexpr int LUT_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int LUT_BYTES = pair_table_bytes<BITS>();  // 32 bank-private copies
    static constexpr int SCALE_OFFSET = LUT_OFFSET + LUT_BYTES;  // 256 packed scale pairs
    static constexpr int FLAG_OFFSET = SCALE_OFFSET + 256 * 4;
    static constexpr int SMEM_BYTES = FLAG_OFFSET + 16;
    static constexpr int NACC = FM * FN * 4;  // fp32 accumulators per thread
    static constexpr int A_CHUNKS = BM * 8;   // 16-byte copies per stage
    static constexpr int B_CHUNKS = kTileN * 2 * BITS / 4;
    static constexpr int A_ITERS = (A_CHUNKS + kThreads - 1) / kThreads;
    static constexpr int B_ITERS = (B_CHUNKS + kThreads - 1) / kThreads;
    static_assert(WM * WN == 8, "8 warps");
    static_assert(FN * 8 * WN == kTileN, "warps cover the n-tile");
    static_assert(STAGE_BYTES % 16 == 0 && LUT_OFFSET % 128 == 0, "aligned stages and table");
};

// Per-thread copy plan for one range of k-tiles of one output tile: source pointers advance by
// one k-tile per issued stage, so the steady state costs a few adds per copy. Activation rows
// past M and columns past K are zero-filled (the padded weights are zero blocks, but 0 * garbage
// could still be NaN).
template <int BITS, int MB>
struct StageLoader {
    using S = GemmShape<BITS, MB>;
    const u16* a_src[S::A_ITERS];
    int a_col[S::A_ITERS];  // first in-feature of the chunk; -1: row past M or no chunk
    u32 a_dst[S::A_ITERS];
    const u32* b_src;
    const u8* s_src;
    const u16* x;
    i64 b_step;  // plane words between consecutive k-tiles of one n-tile
    i64 s_step;  // scale bytes between consecutive k-tiles of one n-tile
    int K;

    __device__ __forceinline__ StageLoader(const u16* x_, const u32* packed, const u8* absmax, int M, int K_, int n_tiles,
                                           int m0, int nt, int kt0)
        : x(x_), K(K_) {
        const int tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < S::A_ITERS; ++i) {
            const int c = tid + i * kThreads;
            const int r = c >> 3, ch = c & 7;
            const bool ok = c < S::A_CHUNKS && m0 + r < M;
            a_src[i] = x_ + (ok ? (i64)(m0 + r) * K_ + (i64)kt0 * kTileK + ch * 8 : 0);
            a_col[i] = ok ? kt0 * kTileK + ch * 8 : (c < S::A_CHUNKS ? -2 : -1);
            a_dst[i] = r * 128 + ((ch ^ (r & 7)) << 4);
        }
        const i64 tile = (i64)kt0 * n_tiles + nt;
        b_src = packed + tile * (kTileN * 2 * BITS) + tid * 4;
        s_src = absmax + tile * S::S_BYTES + tid * 16;
        b_step = (i64)n_tiles * (kTileN * 2 * BITS);
        s_step = (i64)n_tiles * S::S_BYTES;
    }

    // Issues the copies of the next k-tile into `stage` and advances.
    __device__ __forceinline__ void issue(u8* stage) {
#pragma unroll
        for (int i = 0; i < S::A_ITERS; ++i) {
            if (a_col[i] != -1) {  // -2: a row past M, copied as zeros
                const bool ok = a_col[i] >= 0 && a_col[i] < K;
                cp_async16(stage + a_dst[i], ok ? a_src[i] : x, ok ? 16u : 0u);
                if (a_col[i] >= 0) {
                    a_src[i] += kTileK;
                    a_col[i] += kTileK;
                }
            }
        }
        const int tid = threadIdx.x;
#pragma unroll
        for (int i = 0; i < S::B_ITERS; ++i)
            if (i * kThreads + tid < S::B_CHUNKS) cp_async16(stage + S::A_BYTES + (i * kThreads + tid) * 16, b_src + i * kThreads * 4);
        if (tid < S::S_BYTES / 16) cp_async16(stage + S::A_BYTES + S::B_BYTES + tid * 16, s_src);
        b_src += b_step;
        s_src += s_step;
    }
};

// One k-tile of MMAs from pipeline stage `stage`. a_off[fm]: this lane's ldmatrix row offset
// with its swizzle bits, XOR-ed with the k16 chunk below.
template <int BITS, int MB, int DT, bool PAIRS>
__device__ __forceinline__ void compute_stage(const u8* stage, const u8* smem, u32 cb_reg, int warp_n,
                                              const u32 (&a_off)[GemmShape<BITS, MB>::FM],
                                              float (&acc)[GemmShape<BITS, MB>::FM][GemmShape<BITS, MB>::FN][4]) {
    using S = GemmShape<BITS, MB>;
    const int lane = threadIdx.x & 31;
    const u32* bs = reinterpret_cast<const u32*>(stage + S::A_BYTES);
    const u8* ss = stage + S::A_BYTES + S::B_BYTES;
    const u32* scale_tab = reinterpret_cast<const u32*>(smem + S::SCALE_OFFSET);
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
        u32 bfrag[S::FN][4];
#pragma unroll
        for (int f = 0; f < S::FN; ++f) {
            const int col = (warp_n * S::FN + f) * 8 + (lane >> 2);
            const u32 s2 = scale_tab[ss[col * 2 + kb]];
            u32 w[BITS];
            load_block<BITS, PAIRS>(w, bs + (col * 2 + kb) * BITS, lane & 3);
            dequant_block<BITS, DT, PAIRS>(w, lane & 3, s2, smem + S::LUT_OFFSET, lane * 4, cb_reg, bfrag[f]);
        }
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            const int k16 = kb * 2 + sub;
            u32 afrag[S::FM][4];
#pragma unroll
            for (int fm = 0; fm < S::FM; ++fm) ldmatrix_x4(afrag[fm], stage + (a_off[fm] ^ (k16 << 5)));
#pragma unroll
            for (int fm = 0; fm < S::FM; ++fm)
#pragma unroll
                for (int f = 0; f < S::FN; ++f) mma_16816<DT>(acc[fm][f], afrag[fm], bfrag[f][sub * 2], bfrag[f][sub * 2 + 1]);
        }
    }
}

// acc * tensor_scale (+ bias) -> out, rounding once to the output type; rows >= M and
// columns >= N are skipped.
template <int BITS, int MB, int DT>
__device__ __forceinline__ void store_tile(const float (&acc)[GemmShape<BITS, MB>::FM][GemmShape<BITS, MB>::FN][4],
                                           u16* __restrict__ out, const u16* __restrict__ bias, float ts, int M, int N,
                                           int m0, int n0, int warp_m, int warp_n) {
    using S = GemmShape<BITS, MB>;
    const int lane = threadIdx.x & 31;
    const bool pairs_aligned = (N & 1) == 0;
#pragma unroll
    for (int fm = 0; fm < S::FM; ++fm)
#pragma unroll
        for (int f = 0; f < S::FN; ++f) {
            const int col = n0 + (warp_n * S::FN + f) * 8 + (lane & 3) * 2;
            float b0 = 0.f, b1 = 0.f;
            if (bias != nullptr) {
                if (col < N) b0 = bits_to_f32<DT>(bias[col]);
                if (col + 1 < N) b1 = bits_to_f32<DT>(bias[col + 1]);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + (warp_m * S::FM + fm) * 16 + (lane >> 2) + h * 8;
                if (row >= M) continue;
                const float v0 = acc[fm][f][2 * h] * ts + b0;
                const float v1 = acc[fm][f][2 * h + 1] * ts + b1;
                u16* o = out + (i64)row * N + col;
                if (pairs_aligned && col + 1 < N) {
                    *reinterpret_cast<u32*>(o) = pack2<DT>(v0, v1);
                } else {
                    if (col < N) o[0] = f32_to_bits<DT>(v0);
                    if (col + 1 < N) o[1] = f32_to_bits<DT>(v1);
                }
            }
        }
}

}  // namespace kbit

// Template parameters:
//   BITS  index width, 2..5
//   MB    m16 row blocks per block tile (1, 2, 4, 8): BM = 16 * MB rows
//   DT    activation/output type: KBIT_F16 or KBIT_BF16
//   PAIRS packed holds pair codes (4 or 5 bits) instead of planes (docs/format.md, section 7a)
// Arguments:
//   x [M, K] (row-major, K % 8 == 0, 16-byte aligned), packed/absmax: the tiled weight,
//   codebook float32 [2^BITS], tensor_scale float32 [1], bias [N] in DT or null, out [M, N],
//   workspace: fp32, gridDim.x * 2 * 256 * NACC floats (only touched for split tiles),
//   counters: int32 [m_tiles * n_tiles], all zero on entry and left zero on exit,
//   M, N, K: true sizes; n_tiles = N_pad / 128; k_tiles = K_pad / 64;
//   iters: k-iterations per block (the stream-K range length L).
// Launch: 256 threads, GemmShape::SMEM_BYTES of dynamic shared memory, ceil(total / iters) blocks
// where total = ceil(M / BM) * n_tiles * k_tiles.
template <int BITS, int MB, int DT, bool PAIRS = false>
__global__ void __launch_bounds__(kbit::kThreads, MB == 1 ? 3 : (MB <= 4 ? 2 : 1))
    kbit_gemm(const u16* __restrict__ x, const u32* __restrict__ packed, const u8* __restrict__ absmax,
              const float* __restrict__ codebook, const float* __restrict__ tensor_scale, const u16* __restrict__ bias,
              u16* __restrict__ out, float* __restrict__ workspace, int* __restrict__ counters, int M, int N, int K,
              int n_tiles, int k_tiles, int iters) {
    using namespace kbit;
    using S = GemmShape<BITS, MB>;
    extern __shared__ __align__(128) u8 smem[];
    int* flag = reinterpret_cast<int*>(smem + S::FLAG_OFFSET);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp / S::WN, warp_n = warp % S::WN;

    // Under a programmatic launch this grid may start while the previous kernel on the stream
    // finishes: let the next one do the same, and wait for the previous one before touching
    // memory (so only the launch and the block setup overlap).
    allow_dependent_launch();
    grid_dependency_wait();

    const u32 cb_reg = build_dequant_tables<BITS, DT, kThreads>(smem + S::LUT_OFFSET, reinterpret_cast<u32*>(smem + S::SCALE_OFFSET),
                                                               codebook);
    // ldmatrix row offsets: lane l gives row (l & 7) of 8x8 matrix l / 8; matrices 0..3 are
    // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    u32 a_off[S::FM];
#pragma unroll
    for (int fm = 0; fm < S::FM; ++fm) {
        const int q = lane >> 3;
        const int r = (warp_m * S::FM + fm) * 16 + (q & 1) * 8 + (lane & 7);
        a_off[fm] = r * 128 + ((((q >> 1)) ^ (r & 7)) << 4);
    }
    const float ts = *tensor_scale;
    __syncthreads();

    const int m_tiles = (M + S::BM - 1) / S::BM;
    const i64 total = (i64)m_tiles * n_tiles * k_tiles;
    i64 it = (i64)blockIdx.x * iters;
    const i64 it_end = it + iters < total ? it + iters : total;

    while (it < it_end) {
        const int tile = (int)(it / k_tiles);
        const int kb0 = (int)(it - (i64)tile * k_tiles);
        const int kb1 = (int)((i64)k_tiles < (it_end - (i64)tile * k_tiles) ? k_tiles : it_end - (i64)tile * k_tiles);
        const int nk = kb1 - kb0;
        const int mt = tile % m_tiles, nt = tile / m_tiles;
        const int m0 = mt * S::BM;

        float acc[S::FM][S::FN][4];
#pragma unroll
        for (int a = 0; a < S::FM; ++a)
#pragma unroll
            for (int b = 0; b < S::FN; ++b)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

        // Pipeline: STAGES-1 k-tiles in flight ahead of the one being multiplied.
        StageLoader<BITS, MB> loader(x, packed, absmax, M, K, n_tiles, m0, nt, kb0);
#pragma unroll
        for (int s = 0; s < S::STAGES - 1; ++s) {
            if (s < nk) loader.issue(smem + s * S::STAGE_BYTES);
            cp_async_commit();
        }
        for (int i = 0; i < nk; ++i) {
            cp_async_wait<S::STAGES - 2>();
            __syncthreads();  // stage i landed for everyone; stage i-1 is free again
            if (i + S::STAGES - 1 < nk) loader.issue(smem + ((i + S::STAGES - 1) % S::STAGES) * S::STAGE_BYTES);
            cp_async_commit();
            compute_stage<BITS, MB, DT, PAIRS>(smem + (i % S::STAGES) * S::STAGE_BYTES, smem, cb_reg, warp_n, a_off, acc);
        }
        cp_async_wait<0>();
        __syncthreads();  // all reads of the stages done before the next range refills them

        if (kb0 == 0 && kb1 == k_tiles) {
            store_tile<BITS, MB, DT>(acc, out, bias, ts, M, N, m0, nt * kTileN, warp_m, warp_n);
        } else {
            // Split tile: contributors are the blocks whose ranges meet [tile*k_tiles, (tile+1)*k_tiles).
            const i64 t0 = (i64)tile * k_tiles;
            const int first = (int)(t0 / iters), last = (int)((t0 + k_tiles - 1) / iters);
            const int side = tile == (int)(((i64)blockIdx.x * iters) / k_tiles) ? 0 : 1;
            float4* slot = reinterpret_cast<float4*>(workspace) + ((i64)blockIdx.x * 2 + side) * (S::NACC / 4) * kThreads;
#pragma unroll
            for (int a = 0; a < S::FM; ++a)
#pragma unroll
                for (int b = 0; b < S::FN; ++b)
                    slot[(a * S::FN + b) * kThreads + tid] = make_float4(acc[a][b][0], acc[a][b][1], acc[a][b][2], acc[a][b][3]);
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
                for (int a = 0; a < S::FM; ++a)
#pragma unroll
                    for (int b = 0; b < S::FN; ++b)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
                for (int cta = first; cta <= last; ++cta) {
                    const int cside = tile == (int)(((i64)cta * iters) / k_tiles) ? 0 : 1;
                    const float4* cs = reinterpret_cast<const float4*>(workspace) + ((i64)cta * 2 + cside) * (S::NACC / 4) * kThreads;
#pragma unroll
                    for (int a = 0; a < S::FM; ++a)
#pragma unroll
                        for (int b = 0; b < S::FN; ++b) {
                            const float4 v = ld_cg(cs + (a * S::FN + b) * kThreads + tid);
                            acc[a][b][0] += v.x;
                            acc[a][b][1] += v.y;
                            acc[a][b][2] += v.z;
                            acc[a][b][3] += v.w;
                        }
                }
                store_tile<BITS, MB, DT>(acc, out, bias, ts, M, N, m0, nt * kTileN, warp_m, warp_n);
            }
        }
        it += nk;
    }
}
