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
// Block tile: 128 features (one storage n-tile) x BT tokens (BT = 16, 32, 64, 128 or 256), two warpgroups:
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
// descriptor (wgmma.cuh), written so by the tensor copy (TMA) of the host-built tensor map of x,
// which also reads rows past M and in-features past K as zeros.
//
// Warp roles (384 threads): warps 0..7 are the two consumer warpgroups above; warps 8..11 are the
// producer warpgroup, one thread of which issues every copy (setmaxnreg moves the producer's
// registers to the consumers):
//
//   producer, per stage:   wait empty[s] -> expect_tx(full[s], stage bytes) -> per k-tile of the
//                          stage: TMA x tile, bulk copies of the tile's plane words and scale
//                          codes -> full[s]
//   consumers, per stage:  wait full[s] -> per k-tile: decode + wgmma (compute_stage); after the
//                          first, release the previous stage (its wgmmas are retired by then):
//                          every consumer thread arrives on empty[s'] after its own reads of it
//
// A stage holds KPS k-tiles (2 at BT <= 64, else 1): at the small token tiles a k-tile's MMAs are
// short, and the per-stage work (barrier wait and release, ring position, addresses) is paid once
// per two k-tiles. A segment's last stage may hold fewer (both sides count the same).
//
// STAGES stage buffers in a ring; the j-th use of stage s waits for phase parity j & 1 of
// full[s] (consumers) and for the release of use j - 1 on empty[s] (producer). No block-wide
// barrier in the main loop: the warpgroups and the copies run as far ahead of each other as the
// ring allows. Within a k-tile a warpgroup decodes 32-block kb into one of two A register sets,
// issues its two wgmmas as one commit group and then waits until at most one group is in flight:
// the decode of the next block overlaps the MMAs of this one.
//
// Epilogue: acc * tensor_scale (+ bias) stored straight from the accumulators (each store is 8
// consecutive features of one token per 8 lanes). A tile split over several blocks is summed in
// one of two ways:
//   - launched as clusters (an aligned split, P = 2, 4 or 8 equal k-ranges per tile, one cluster
//     per tile): the partials meet in the blocks' shared memory (reduce_in_cluster), each block
//     summing and storing 1/P of the tile; no global memory, no counters;
//   - otherwise (stream-K ranges): the fp32 partials summed in the workspace exactly as in
//     gemm.cu (the consumers synchronize among themselves with a named barrier).
//
// Grouped form (kbit_gemm_sm90_grouped, mixture-of-experts layers): several experts' weights,
// each times its own rows of x, in one persistent launch. The work list is every (group, n-tile,
// m-tile) of the groups the device holds (group q = rows [row0, row0 + rows) of x through expert
// e, as kbit_decode_gemm_grouped reads them); block b takes items b, b + gridDim.x, ... in order,
// m-tiles of one n-tile next to each other (they read the same weight tile from L2). Every item
// covers its whole K (no split, no workspace). A tile's TMA box may reach into the next group's
// rows: those accumulators are computed and dropped (the store keeps the group's rows only).
// The producer and the consumers walk the same list (GroupWalk), so the pipeline below is the
// dense kernel's, fed a different sequence of (weight tile, x rows, k range). With the fused
// SwiGLU of a gate_up projection (rows: I gate rows, then I up rows, I a multiple of 128) an item
// is an n-tile j < I / 128 of the gate and then tile j + I / 128 of the up half: the first store
// writes silu(gate) into out [rows, I], the second multiplies it by up in place (same thread,
// same elements).
//
// Shared memory (base aligned up to 1024 bytes at run time):
//   STAGES x KPS x [x tile BT*128 | plane words 128*2*BITS*4 | scale codes 256] (each 1024-aligned)
//   | pair table | scale table | full[STAGES], empty[STAGES] barriers | flag
#include "dequant.cuh"  // load_block, dequant_block, build_dequant_tables
#include "wgmma.cuh"    // wgmma_rs, fences, sw128_kmajor_desc
#include "async_copy.cuh"  // mbarriers, TMA, bulk copies, named barriers
#include "cluster.cuh"     // cluster_sync, stores into another block's shared memory

namespace kbit {
namespace sm90 {

constexpr int kConsumers = 256;            // two warpgroups
constexpr int kThreads = kConsumers + 128;  // + the producer warpgroup (one thread of it copies)
constexpr int kConsumerBarrier = 1;       // named barrier of the consumer threads
constexpr int kTileN = 128;    // features per block tile = one storage n-tile
constexpr int kTileK = 64;     // in-features per k-tile = one storage k-tile (two 32-blocks)

template <int BITS, int BT>
struct Shape {
    static_assert(BT == 16 || BT == 32 || BT == 64 || BT == 128 || BT == 256, "token tile");
    static constexpr int KPS = BT <= 64 ? 2 : 1;                // k-tiles per stage
    static constexpr int STAGES = BT == 256 ? 5 : 6 / KPS;
    static constexpr int X_BYTES = BT * kTileK * 2;        // activation tile
    static constexpr int P_BYTES = kTileN * 2 * BITS * 4;  // one storage tile of plane words
    static constexpr int S_BYTES = kTileN * 2;             // its scale codes
    static constexpr int SUB_BYTES = (X_BYTES + P_BYTES + S_BYTES + 1023) / 1024 * 1024;  // one k-tile's buffers
    static constexpr int STAGE_BYTES = KPS * SUB_BYTES;
    static constexpr int LUT_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int SCALE_OFFSET = LUT_OFFSET + pair_table_bytes<BITS>();
    static constexpr int BARRIER_OFFSET = SCALE_OFFSET + 256 * 4;  // full[STAGES], then empty[STAGES]
    static constexpr int FLAG_OFFSET = BARRIER_OFFSET + 2 * STAGES * 8;
    static constexpr int SMEM_BYTES = FLAG_OFFSET + 16 + 1024;  // + the run-time alignment of the base
    static constexpr u32 SUB_TX = X_BYTES + P_BYTES + S_BYTES;  // bytes the copies of one k-tile bring
    static constexpr int NACC = BT / 2;                         // fp32 accumulators per thread
    static constexpr int MIN_BLOCKS = BT <= 64 ? 2 : 1;  // blocks per SM the registers are sized for
    // Registers per thread at launch: the cap __launch_bounds__ sets (ptxas allocates exactly
    // it; the planner checks the driver's count, hopper.py).
    static constexpr int LAUNCH_REGS = 65536 / (MIN_BLOCKS * kThreads) / 8 * 8;
    // setmaxnreg moves registers from the producer warpgroup to the consumers within the block's
    // own allocation (kThreads x LAUNCH_REGS): an increase that the decrease does not cover
    // would wait forever.
    static constexpr int PRODUCER_REGS = MIN_BLOCKS == 1 ? 40 : 24;
    static constexpr int CONSUMER_REGS = (kThreads * LAUNCH_REGS - 128 * PRODUCER_REGS) / kConsumers / 8 * 8;
    static_assert(128 * PRODUCER_REGS + kConsumers * CONSUMER_REGS <= kThreads * LAUNCH_REGS, "register budget");
    static_assert(X_BYTES % 1024 == 0, "swizzle atoms");
    // k-tiles in the stage that starts at k-tile kt of a segment ending at kb1 (the last stage of
    // a segment may hold fewer than KPS): the producer's copies and the consumers' reads agree.
    __device__ __forceinline__ static int tiles_in_stage(int kt, int kb1) { return kb1 - kt < KPS ? kb1 - kt : KPS; }
};

// The per-thread constants of the k-loop, computed once before it (see consumer_lane).
struct ConsumerLane {
    int col0;   // this lane's first feature in the tile
    u32 quad;   // lane % 4: which pairs of a block the lane decodes
    u32 lane4;  // 4 * lane: its bank-private copy in the pair table
};

// One k-tile of one warpgroup: two 32-blocks, each dequantized into an A register set and
// multiplied by two wgmmas (one commit group). a[kb] is the register set of block kb; on entry
// the group of the previous k-tile's block 1 (a[1]) may still be in flight. The shared-memory
// words of both blocks (planes and scales) are loaded first, so block 1's loads are in flight
// while block 0 is decoded and issued.
template <int BITS, int BT, int DT, bool PAIRS>
__device__ __forceinline__ void compute_stage(const u8* stage, const u8* lut, const u32* scale_tab, u32 cb_reg,
                                              const ConsumerLane& cl, float (&acc)[Shape<BITS, BT>::NACC],
                                              u32 (&a)[2][2][4]) {
    using S = Shape<BITS, BT>;
    const int col0 = cl.col0;
    const u32* ps = reinterpret_cast<const u32*>(stage + S::X_BYTES);
    const u8* ss = stage + S::X_BYTES + S::P_BYTES;
    const u64 desc = sw128_kmajor_desc(smem_addr(stage));
    u32 w[2][2][BITS], s2[2][2];  // [block][row]: plane words, scale pair
#pragma unroll
    for (int kb = 0; kb < 2; ++kb)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int col = col0 + 8 * r;
            load_block<BITS, PAIRS>(w[kb][r], ps + (col * 2 + kb) * BITS, cl.quad);
            s2[kb][r] = scale_tab[ss[col * 2 + kb]];
        }
#pragma unroll
    for (int kb = 0; kb < 2; ++kb) {
        u32 q[2][4];  // q[r]: feature col0 + 8r, the block's four pairs
#pragma unroll
        for (int r = 0; r < 2; ++r) dequant_block<BITS, DT, PAIRS>(w[kb][r], cl.quad, s2[kb][r], lut, cl.lane4, cb_reg, q[r]);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            a[kb][sub][0] = q[0][2 * sub];
            a[kb][sub][1] = q[1][2 * sub];
            a[kb][sub][2] = q[0][2 * sub + 1];
            a[kb][sub][3] = q[1][2 * sub + 1];
        }
        // Pin the operands before the fence, so no write to them is scheduled between it and the MMAs.
        hold_registers(a[kb][0]);
        hold_registers(a[kb][1]);
        hold_registers(acc);
        wgmma_fence();
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) wgmma_rs<BT, DT>(acc, a[kb][sub], desc + 2 * (2 * kb + sub));
        wgmma_commit();
        hold_registers(acc);
        wgmma_wait<1>();  // the other block's group is retired: its registers may be rewritten
        hold_registers(a[kb ^ 1][0]);
        hold_registers(a[kb ^ 1][1]);
    }
}

// acc * ts (+ bias) -> out for tokens m0.. and features n, n + 8 (n: this lane's first feature in
// the output); tokens >= M and features >= N are skipped, and so are the token groups of 8
// outside [j0, j1) (a block of a cluster stores only its share of the tile).
template <int BITS, int BT, int DT>
__device__ __forceinline__ void store_tile(const float (&acc)[Shape<BITS, BT>::NACC], u16* __restrict__ out,
                                           const u16* __restrict__ bias, float ts, int M, int N, int m0, int n, int j0 = 0,
                                           int j1 = BT / 8) {
    const int t = threadIdx.x & 3;
    float b[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (bias != nullptr && n + 8 * r < N) b[r] = bits_to_f32<DT>(bias[n + 8 * r]);
#pragma unroll
    for (int j = 0; j < BT / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (j < j0 || j >= j1) continue;
            const int m = m0 + 8 * j + 2 * t + h;
            if (m >= M) continue;
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (n + 8 * r < N) out[(i64)m * N + n + 8 * r] = f32_to_bits<DT>(acc[4 * j + 2 * r + h] * ts + b[r]);
        }
}

// The fused SwiGLU's stores in the grouped kernel, as store_tile without bias: MODE 1 (a gate
// tile) writes silu(acc * ts); MODE 2 (its up tile) multiplies what mode 1 wrote there by
// acc * ts. Both touch the same elements from the same thread, so the second reads the first's
// stores with no barrier.
template <int BITS, int BT, int DT, int MODE>
__device__ __forceinline__ void store_swiglu(float (&acc)[Shape<BITS, BT>::NACC], u16* __restrict__ out, float ts, int M, int N,
                                             int m0, int n) {
    static_assert(MODE == 1 || MODE == 2, "gate or up tile");
    constexpr int CHUNK = BT / 8 < 4 ? BT / 8 : 4;  // token groups of 8 per chunk: mode 2 loads a chunk's gate values, then stores it
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j0 = 0; j0 < BT / 8; j0 += CHUNK) {
        if (MODE == 2) {  // loads first, so that they overlap (a store in between could alias them)
#pragma unroll
            for (int j = j0; j < j0 + CHUNK; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int m = m0 + 8 * j + 2 * t + h;
                        if (m < M && n + 8 * r < N) acc[4 * j + 2 * r + h] *= bits_to_f32<DT>(out[(i64)m * N + n + 8 * r]);
                    }
        }
#pragma unroll
        for (int j = j0; j < j0 + CHUNK; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + 8 * j + 2 * t + h;
                if (m >= M) continue;
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    if (n + 8 * r >= N) continue;
                    float v = acc[4 * j + 2 * r + h] * ts;
                    if (MODE == 1) v = v / (1.0f + __expf(-v));
                    out[(i64)m * N + n + 8 * r] = f32_to_bits<DT>(v);
                }
            }
    }
}

// The k-tiles a block works through, in order: its stream-K range [it, it_end) of the flat
// (tile, k-tile) list cut into one segment per tile. Producer and consumers walk the same list.
// Every walk gives, per segment: k-tiles [kb0, kb1), the n-tile nt, the first x row of the
// token tile (x_row) and the weight's tiles (packed, absmax).
template <int BT>
struct RangeWalk {
    i64 it, it_end;
    int k_tiles, m_tiles;
    int tile, kb0, kb1, mt, nt, x_row;
    const u32* packed;
    const u8* absmax;

    __device__ __forceinline__ RangeWalk(int iters, int total_tiles, int k_tiles_, int m_tiles_, const u32* packed_, const u8* absmax_)
        : k_tiles(k_tiles_), m_tiles(m_tiles_), packed(packed_), absmax(absmax_) {
        const i64 total = (i64)total_tiles * k_tiles_;
        it = (i64)blockIdx.x * iters;
        it_end = it + iters < total ? it + iters : total;
    }
    // Loads the next segment; false when the range is done.
    __device__ __forceinline__ bool next() {
        if (it >= it_end) return false;
        tile = (int)(it / k_tiles);
        kb0 = (int)(it - (i64)tile * k_tiles);
        const i64 left = it_end - (i64)tile * k_tiles;
        kb1 = (int)((i64)k_tiles < left ? k_tiles : left);
        mt = tile % m_tiles;
        nt = tile / m_tiles;
        x_row = mt * BT;
        it += kb1 - kb0;
        return true;
    }
};

// A tile split over the blocks of one cluster (the host launches an aligned split that way:
// rank r of P blocks holds k-tiles [r, r + 1) * k_tiles / P of the tile): block r owns token
// groups [r, r + 1) * V / P of the tile (V = BT / 8, a thread's float4 columns of accumulators).
// Each block pushes the float4s of the others' shares into their owners' shared memory (the
// stage ring, idle once every block of the cluster is past its k-loop), then each owner adds
// what arrived to its own partial in rank order (the same order at every launch) and stores its
// share. Inbox of a block: [P][V / P][256 consumer threads] float4, from each rank.
template <int BITS, int BT, int DT>
__device__ __forceinline__ void reduce_in_cluster(float (&acc)[Shape<BITS, BT>::NACC], u8* smem, u16* __restrict__ out,
                                                  const u16* __restrict__ bias, float ts, int M, int N, int m0, int n) {
    using S = Shape<BITS, BT>;
    constexpr int V = S::NACC / 4;
    static_assert(V * 16 * kConsumers <= S::LUT_OFFSET, "the inbox fits in the stage ring");
    const int rank = (int)cluster_rank(), parts = (int)cluster_blocks();
    const int per = V / parts, shift = 31 - __clz(per);  // P is 2, 4 or 8 and divides V
    const int tid = threadIdx.x;
    const u32 inbox = smem_addr(smem);
    const float4* mine = reinterpret_cast<const float4*>(smem);
    cluster_sync();  // every block of the cluster is done with its stage ring
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int owner = v >> shift;
        if (owner == rank) continue;
        const u32 at = inbox + (u32)(((rank * per + (v & (per - 1))) * kConsumers + tid) * 16);
        st_cluster(cluster_address(at, (u32)owner), make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]));
    }
    cluster_sync();  // every push has landed
    for (int r = 0; r < parts; ++r) {
        if (r == rank) continue;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            if ((v >> shift) != rank) continue;
            const float4 p = mine[(r * per + (v & (per - 1))) * kConsumers + tid];
            acc[4 * v] += p.x;
            acc[4 * v + 1] += p.y;
            acc[4 * v + 2] += p.z;
            acc[4 * v + 3] += p.w;
        }
    }
    store_tile<BITS, BT, DT>(acc, out, bias, ts, M, N, m0, n, rank * per, (rank + 1) * per);
}

// The grouped kernel's items: (group, n-tile, m-tile), whole K each, item i of the list going to
// block i % gridDim.x. The list is walked group by group with a cursor that only moves forward,
// so a block reads each group's entry once. A group with rows <= 0, an expert outside
// [0, experts) or rows outside x has no items. Thread-local: the producer's one thread and every
// consumer thread walk it alike.
template <int BT>
struct GroupWalk {
    const int* groups;  // int32 [3][count]: expert, row0, rows
    int count, experts, x_rows, n_tiles, k_tiles;
    int expert_words, expert_scales;  // one expert's plane words and scale codes
    int swiglu;                        // nonzero: each item is a gate n-tile, then its up n-tile
    const u32* packed0;
    const u8* absmax0;
    int rel, q, q_mtiles, q_row0, q_rows, q_expert;  // cursor: the current item is item rel of group q
    int kb0, kb1, nt, x_row, rows, expert, phase;    // the current segment (phase 1: the up half)
    const u32* packed;
    const u8* absmax;

    __device__ __forceinline__ GroupWalk(const int* groups_, int count_, int experts_, int x_rows_, int n_tiles_, int k_tiles_,
                                         int expert_words_, int expert_scales_, int swiglu_, const u32* packed_, const u8* absmax_)
        : groups(groups_), count(count_), experts(experts_), x_rows(x_rows_), n_tiles(n_tiles_), k_tiles(k_tiles_),
          expert_words(expert_words_), expert_scales(expert_scales_), swiglu(swiglu_), packed0(packed_), absmax0(absmax_),
          rel((int)blockIdx.x - (int)gridDim.x), q(-1), q_mtiles(0), q_row0(0), q_rows(0), q_expert(0), phase(1) {}

    // Moves to the next segment; false when the list is done.
    __device__ __forceinline__ bool next() {
        const int item_tiles = swiglu ? n_tiles / 2 : n_tiles;  // n-tiles an item's index runs over
        if (swiglu && phase == 0) {  // the same item's up half: n_tiles / 2 tiles further
            phase = 1;
            nt += item_tiles;
            return true;
        }
        rel += gridDim.x;
        while (rel >= q_mtiles * item_tiles) {
            rel -= q_mtiles * item_tiles;
            if (++q >= count) return false;
            q_expert = __ldg(groups + q);
            q_row0 = __ldg(groups + count + q);
            q_rows = __ldg(groups + 2 * count + q);
            const bool valid = q_rows > 0 && q_expert >= 0 && q_expert < experts && q_row0 >= 0 && q_row0 <= x_rows - q_rows;
            q_mtiles = valid ? (q_rows + BT - 1) / BT : 0;
        }
        const int mt = rel % q_mtiles;
        nt = rel / q_mtiles;
        phase = 0;
        kb0 = 0;
        kb1 = k_tiles;
        x_row = q_row0 + mt * BT;
        rows = q_rows - mt * BT < BT ? q_rows - mt * BT : BT;
        expert = q_expert;
        packed = packed0 + (i64)expert * expert_words;
        absmax = absmax0 + (i64)expert * expert_scales;
        return true;
    }
};

// A position in the stage ring, carried across stages and segments: the next stage, the parity
// of its use and whether the ring has wrapped at least once (the modulo and the division by
// STAGES, kept incrementally).
struct RingPos {
    int stage = 0;
    u32 parity = 0;
    bool wrapped = false;
    template <int STAGES> __device__ __forceinline__ void advance() {
        if (++stage == STAGES) {
            stage = 0;
            parity ^= 1u;
            wrapped = true;
        }
    }
};

// The producer: one thread issues the copies of every k-tile the walk lists, into the stage ring.
template <int BITS, int BT, class Walk>
__device__ __forceinline__ void produce(Walk& walk, const TensorMap* x_map, u8* smem, u64* full, u64* empty, int n_tiles) {
    using S = Shape<BITS, BT>;
    RingPos pos;  // of the next stage to fill
    while (walk.next()) {
        for (int kt = walk.kb0; kt < walk.kb1; kt += S::KPS, pos.advance<S::STAGES>()) {
            const int s = pos.stage;
            const int n = S::tiles_in_stage(kt, walk.kb1);
            if (pos.wrapped) mbar_wait(empty + s, pos.parity ^ 1u);  // the consumers' release of its previous use
            mbar_arrive_expect_tx(full + s, (u32)n * S::SUB_TX);
#pragma unroll
            for (int sub = 0; sub < S::KPS; ++sub) {
                if (sub >= n) break;
                u8* buf = smem + s * S::STAGE_BYTES + sub * S::SUB_BYTES;
                tma_load_2d(buf, x_map, full + s, (kt + sub) * kTileK, walk.x_row);
                const i64 wt = (i64)(kt + sub) * n_tiles + walk.nt;
                bulk_load(buf + S::X_BYTES, walk.packed + wt * (kTileN * 2 * BITS), S::P_BYTES, full + s);
                bulk_load(buf + S::X_BYTES + S::P_BYTES, walk.absmax + wt * S::S_BYTES, S::S_BYTES, full + s);
            }
        }
    }
}

// The consumers' k-loop over one segment [kb0, kb1): acc = the segment's partial product.
// `pos` is the stage ring position of the next stage, across segments.
template <int BITS, int BT, int DT, bool PAIRS>
__device__ __forceinline__ void consume(int kb0, int kb1, RingPos& pos, u8* smem, u64* full, u64* empty, const u8* lut,
                                        const u32* scale_tab, u32 cb_reg, const ConsumerLane& cl, float (&acc)[Shape<BITS, BT>::NACC],
                                        u32 (&a)[2][2][4]) {
    using S = Shape<BITS, BT>;
#pragma unroll
    for (int i = 0; i < S::NACC; ++i) acc[i] = 0.f;
    int prev = 0;  // the previous stage
    for (int kt = kb0; kt < kb1; kt += S::KPS) {
        const int s = pos.stage;
        const int n = S::tiles_in_stage(kt, kb1);
        mbar_wait(full + s, pos.parity);
#pragma unroll
        for (int sub = 0; sub < S::KPS; ++sub) {
            if (sub >= n) break;
            compute_stage<BITS, BT, DT, PAIRS>(smem + s * S::STAGE_BYTES + sub * S::SUB_BYTES, lut, scale_tab, cb_reg, cl, acc, a);
            // The first compute_stage retired every wgmma of the previous stage: release it.
            if (sub == 0 && kt > kb0) mbar_arrive(empty + prev);
        }
        prev = s;
        pos.advance<S::STAGES>();
    }
    wgmma_wait<0>();
    hold_registers(acc);
    mbar_arrive(empty + prev);
}

// Everything both kernels do before their main loops: the dequantization tables and the stage
// barriers in shared memory. Returns the codebook register cb_reg of dequant_block.
template <int BITS, int BT, int DT>
__device__ __forceinline__ u32 setup_block(u8* smem, const float* codebook) {
    using S = Shape<BITS, BT>;
    if (blockDim.x != kThreads) __trap();  // without the producer warpgroup the consumers would wait forever
    const u32 cb_reg = build_dequant_tables<BITS, DT, kThreads>(smem + S::LUT_OFFSET, reinterpret_cast<u32*>(smem + S::SCALE_OFFSET),
                                                               codebook);
    u64* full = reinterpret_cast<u64*>(smem + S::BARRIER_OFFSET);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S::STAGES; ++s) {
            mbar_init(full + s, 1);                     // the producer's expect_tx arrival (+ the bytes)
            mbar_init(full + S::STAGES + s, kConsumers);  // empty[s]: every consumer thread releases its own reads
        }
        fence_mbar_init();
    }
    __syncthreads();
    return cb_reg;
}

// A consumer thread's ConsumerLane. The values go through an empty asm so that the compiler
// keeps them in registers instead of recomputing them from threadIdx in every k-tile (it did:
// ~14 of the loop's 175 instructions).
__device__ __forceinline__ ConsumerLane consumer_lane(int warp, int lane) {
    ConsumerLane cl{(warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2), (u32)lane & 3u, (u32)lane * 4u};
    asm volatile("" : "+r"(cl.col0), "+r"(cl.quad), "+r"(cl.lane4));
    return cl;
}

// The block's dynamic shared memory, its base aligned up to 1024 bytes (the swizzle atoms).
__device__ __forceinline__ u8* block_smem() {
    extern __shared__ __align__(1024) u8 smem_raw[];
    return smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
}

// A block's whole life in both kernels: the programmatic-launch handshake, the tables and
// barriers, then the producer warpgroup's copies and the consumers' k-loops over `walk`. After
// each segment the consumers call epilogue(acc, col0): acc the segment's partial product, col0
// the thread's first feature in the tile.
template <int BITS, int BT, int DT, bool PAIRS, class Walk, class Epilogue>
__device__ __forceinline__ void run_block(u8* smem, Walk& walk, const TensorMap* x_map, const float* codebook, int n_tiles,
                                          Epilogue&& epilogue) {
    using S = Shape<BITS, BT>;
    u64* full = reinterpret_cast<u64*>(smem + S::BARRIER_OFFSET);
    u64* empty = full + S::STAGES;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Programmatic dependent launch, as in gemm.cu.
    allow_dependent_launch();
    grid_dependency_wait();
    const u32 cb_reg = setup_block<BITS, BT, DT>(smem, codebook);

    if (warp >= kConsumers / 32) {
        set_max_registers_dec<S::PRODUCER_REGS>();
        if (warp == kConsumers / 32 && lane == 0) produce<BITS, BT>(walk, x_map, smem, full, empty, n_tiles);
        return;  // exited threads count as arrived at the cluster barriers of reduce_in_cluster
    }
    set_max_registers_inc<S::CONSUMER_REGS>();
    const ConsumerLane cl = consumer_lane(warp, lane);
    u32 a[2][2][4] = {};  // A registers: [32-block of the k-tile][k16 step][fragment]
    RingPos pos;
    while (walk.next()) {
        float acc[S::NACC];
        consume<BITS, BT, DT, PAIRS>(walk.kb0, walk.kb1, pos, smem, full, empty, smem + S::LUT_OFFSET,
                              reinterpret_cast<const u32*>(smem + S::SCALE_OFFSET), cb_reg, cl, acc, a);
        epilogue(acc, cl.col0);
    }
}

}  // namespace sm90
}  // namespace kbit

// Template parameters:
//   BITS  index width, 2..5
//   BT    tokens per block tile (wgmma's N): 16, 32, 64, 128 or 256
//   DT    activation/output type: KBIT_F16 or KBIT_BF16
//   PAIRS packed holds pair codes (4 or 5 bits) instead of planes (docs/format.md, section 7a)
// Arguments: x_map: tensor map of x [M, K] (16-bit elements, row stride K * 2 bytes, box 64 x BT,
//   128-byte swizzle, zero fill; hopper.py builds it); the tiled weight; codebook, tensor_scale,
//   bias or null, out [M, N]; workspace of gridDim.x * 2 * 256 * BT / 2 floats, touched only for
//   split tiles; counters [m_tiles * n_tiles], zero on entry and left zero; M, N true sizes; K: x's
//   row length (unused here: x_map holds it; kept so both tensor-core kernels take one list);
//   n_tiles, k_tiles of the padded weight; iters: k-iterations per block; m_tiles = ceil(M / BT).
// Launch: 384 threads, Shape::SMEM_BYTES of dynamic shared memory, ceil(total / iters) blocks
// where total = m_tiles * n_tiles * k_tiles; either without clusters, or, only where iters * P
// = k_tiles with P = 2, 4 or 8 dividing BT / 8, as clusters of P blocks (reduce_in_cluster:
// workspace and counters are then not touched).
template <int BITS, int BT, int DT, bool PAIRS = false>
__global__ void __launch_bounds__(kbit::sm90::kThreads, kbit::sm90::Shape<BITS, BT>::MIN_BLOCKS)
    kbit_gemm_sm90(const __grid_constant__ kbit::TensorMap x_map, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                   const float* __restrict__ codebook, const float* __restrict__ tensor_scale, const u16* __restrict__ bias,
                   u16* __restrict__ out, float* __restrict__ workspace, int* __restrict__ counters, int M, int N, int K,
                   int n_tiles, int k_tiles, int iters) {
    using namespace kbit;
    using namespace kbit::sm90;
    using S = Shape<BITS, BT>;
    u8* smem = block_smem();
    int* flag = reinterpret_cast<int*>(smem + S::FLAG_OFFSET);
    const int tid = threadIdx.x;
    const int m_tiles = (M + BT - 1) / BT;
    RangeWalk<BT> walk(iters, m_tiles * n_tiles, k_tiles, m_tiles, packed, absmax);
    run_block<BITS, BT, DT, PAIRS>(smem, walk, &x_map, codebook, n_tiles, [&](float (&acc)[S::NACC], int col0) {
        const float ts = *tensor_scale;  // read here, after run_block's dependency wait
        const int tile = walk.tile, m0 = walk.x_row;
        const int n = walk.nt * kTileN + col0;
        if (cluster_blocks() > 1) {  // an aligned split, one cluster per tile (ops._wgmma_cluster)
            reduce_in_cluster<BITS, BT, DT>(acc, smem, out, bias, ts, M, N, m0, n);
            return;
        }
        if (walk.kb0 == 0 && walk.kb1 == k_tiles) {
            store_tile<BITS, BT, DT>(acc, out, bias, ts, M, N, m0, n);
            return;
        }
        // Split tile: contributors are the blocks whose ranges meet [tile*k_tiles, (tile+1)*k_tiles).
        const i64 t0 = (i64)tile * k_tiles;
        const int first = (int)(t0 / iters), last = (int)((t0 + k_tiles - 1) / iters);
        const int side = tile == (int)(((i64)blockIdx.x * iters) / k_tiles) ? 0 : 1;
        float4* slot = reinterpret_cast<float4*>(workspace) + ((i64)blockIdx.x * 2 + side) * (S::NACC / 4) * kConsumers;
#pragma unroll
        for (int v = 0; v < S::NACC / 4; ++v)
            slot[v * kConsumers + tid] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
        __threadfence();
        named_barrier(kConsumerBarrier, kConsumers);
        if (tid == 0) {
            const int arrived = atomicAdd(counters + tile, 1);
            const int is_last = arrived == last - first;
            if (is_last) counters[tile] = 0;  // every contributor has counted: reset for the next launch
            *flag = is_last;
        }
        named_barrier(kConsumerBarrier, kConsumers);
        if (!*flag) return;
        __threadfence();
#pragma unroll
        for (int i = 0; i < S::NACC; ++i) acc[i] = 0.f;
        for (int cta = first; cta <= last; ++cta) {
            const int cside = tile == (int)(((i64)cta * iters) / k_tiles) ? 0 : 1;
            const float4* cs = reinterpret_cast<const float4*>(workspace) + ((i64)cta * 2 + cside) * (S::NACC / 4) * kConsumers;
#pragma unroll
            for (int v = 0; v < S::NACC / 4; ++v) {
                const float4 p = ld_cg(cs + v * kConsumers + tid);
                acc[4 * v] += p.x;
                acc[4 * v + 1] += p.y;
                acc[4 * v + 2] += p.z;
                acc[4 * v + 3] += p.w;
            }
        }
        store_tile<BITS, BT, DT>(acc, out, bias, ts, M, N, m0, n);
    });
}


// Template parameters as kbit_gemm_sm90.
// Arguments: x_map: tensor map of x [x_rows, K] as for kbit_gemm_sm90; packed / absmax: every
//   expert's tiled weight, stacked ([E, k_tiles, n_tiles, 128, 2, BITS] words, [E, k_tiles,
//   n_tiles, 128, 2] codes); codebook (shared); tensor_scale [E]; out [x_rows, N]: group q's rows
//   written, all others untouched; groups: int32 [3][count] on the device (expert, first row, rows);
//   experts: E; expert_words / expert_scales: one expert's plane words / scale codes; swiglu:
//   nonzero for the fused SwiGLU of a gate_up projection (n_tiles even, the weight's rows = gate
//   rows then up rows, N / 128 <= n_tiles / 2 of each): out [x_rows, N] gets silu(gate) * up,
//   each item computing a gate n-tile and then the up n-tile n_tiles / 2 further.
// Launch: 384 threads, Shape::SMEM_BYTES of dynamic shared memory, any grid (persistent blocks;
//   a block with no item returns at once).
template <int BITS, int BT, int DT, bool PAIRS = false>
__global__ void __launch_bounds__(kbit::sm90::kThreads, kbit::sm90::Shape<BITS, BT>::MIN_BLOCKS)
    kbit_gemm_sm90_grouped(const __grid_constant__ kbit::TensorMap x_map, const u32* __restrict__ packed,
                           const u8* __restrict__ absmax, const float* __restrict__ codebook, const float* __restrict__ tensor_scale,
                           u16* __restrict__ out, const int* __restrict__ groups, int count, int experts, int expert_words,
                           int expert_scales, int x_rows, int N, int n_tiles, int k_tiles, int swiglu) {
    using namespace kbit;
    using namespace kbit::sm90;
    using S = Shape<BITS, BT>;
    GroupWalk<BT> walk(groups, count, experts, x_rows, n_tiles, k_tiles, expert_words, expert_scales, swiglu, packed, absmax);
    run_block<BITS, BT, DT, PAIRS>(block_smem(), walk, &x_map, codebook, n_tiles, [&](float (&acc)[S::NACC], int col0) {
        const int nt = walk.phase ? walk.nt - n_tiles / 2 : walk.nt;  // the up half writes over its gate half
        const float ts = __ldg(tensor_scale + walk.expert);
        const int m_end = walk.x_row + walk.rows, n = nt * kTileN + col0;
        // one instance per mode, so that each indexes the accumulators at compile time only
        if (!swiglu) store_tile<BITS, BT, DT>(acc, out, nullptr, ts, m_end, N, walk.x_row, n);
        else if (walk.phase == 0) store_swiglu<BITS, BT, DT, 1>(acc, out, ts, m_end, N, walk.x_row, n);
        else store_swiglu<BITS, BT, DT, 2>(acc, out, ts, m_end, N, walk.x_row, n);
    });
}
