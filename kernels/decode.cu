// Small-M ("decode") kbit GEMM:  out[M, N] = x[M, K] @ W[N, K]^T,  M = 1..16.
// Grouped form (mixture-of-experts layers, kbit_decode_gemm_grouped): several experts' weights,
// each times its own rows of x, in one launch; see "Grouped launches" below (struct Groups).
//
// At decode sizes the product only streams the packed weight, so the kernel is built to turn
// bytes from HBM into tensor-core operands with as few instructions per weight as possible.
//
// Storage (docs/format.md, section 7; fixed, read as it is)
// --------------------------------------------------------
//   packed[kt][nt][c][kb][b]  u32  bit-plane b of block (n = 128*nt + c, k = 64*kt + 32*kb .. +31):
//                                  bit i of the word = bit b of the index of k = 64*kt + 32*kb + i
//   absmax[kt][nt][c][kb]     u8   E4M4 code of the same block (bias 11, code 0 = zero block)
//   One storage tile (kt, nt) is a contiguous run of 128*2*BITS words (BITS KiB); tiles are
//   ordered kt-major. Output rows n = 16 consecutive columns c form a "row group"; a row group
//   of one k-tile is 16*2*BITS contiguous words.
//
// Work split
// ----------
//   k is cut into chunks of 128 (two storage k-tiles). A warp owns R row groups (16*R rows) and
//   walks k chunk by chunk; the NW warps of a block own NW*R*16 consecutive rows (a "row tile")
//   and walk the same chunks, so they read the same slice of x (L1 hits).
//
//         chunk 0      chunk 1      chunk 2            (128 in-features each)
//       +------------+------------+------------+--
//   w0  | R row grps | R row grps | ...        |        row tile rt (NW*R*16 rows)
//   w1  |            |            |            |
//   ..  |            |            |            |
//       +------------+------------+------------+--
//
//   The (row tile, chunk) items are listed row-tile-major and cut into one contiguous range per
//   block of a persistent grid ("stream-K": the ranges differ by at most one item). A range that
//   covers a row tile's whole K stores the output directly. Otherwise each warp adds its fp32
//   partial sums into a workspace with atomics, bumps a per-(row tile, warp) counter, and the
//   warp that completes the count converts the sums to the output, then zeroes its workspace
//   rows and the counter, so the next launch finds them zero (no memset, graph capturable).
//   A block takes the partial row tile at the end of its range first, so that where its range
//   holds whole row tiles it ends on one (a plain store, no finalisation on the critical path).
//
// Tensor cores: C^T = W . x^T with mma.m16n8k16 (fp32 accumulate). The weights are the 16-row A
// operand (16 output rows x 16 in-features), x is the n8 side (M <= 8 per fragment, MT
// fragments). The k order inside an mma is free as long as A and B agree, so each lane takes
// in-features from ONE block: lane (g = lane/4, t = lane%4) holds rows g and g+8 of the row
// group and the 32 in-features of block t of the chunk (t = 0,1: k-tile 2c, t = 2,3: k-tile
// 2c+1). mma step s (0..7) gives lane t the in-features 32t + 4s + {0,1} (A regs a0/a1) and
// 32t + 4s + {2,3} (a2/a3); B takes x at the same in-features, so B for a chunk is 64
// contiguous bytes of one x row per lane, loaded once and reused for all R row groups.
//
// Decode (per lane, per row, per 32-weight block; BITS plane words p0..p(BITS-1) in registers)
// ------------------------------------------------------------------------------------------
//   1. Gather: a few shifts and lop3 merges turn the planes into "index bytes": one byte per two
//      adjacent weights (BITS = 3, 4, 5: bits 2b and 2b+1 = plane b of weights e and e+1;
//      BITS = 5 keeps plane 4 in a second word) or per four weights (BITS = 2: bits j and 4+j
//      = planes 0 and 1 of weight e+j). About 12 ALU ops per 32 weights at BITS = 4, none with
//      4-bit pair codes (docs/format.md, section 7a), which are these index bytes as stored;
//      5-bit pair codes hold each pair as a 10-bit field (first | second << 5), one shift away.
//   2. Lookup: one prmt moves an index byte into the address of a shared-memory table entry
//      that holds the decoded pair (half2) or quad (two half2). The table has one copy per lane
//      (the lane picks the bank), so lookups never conflict. For BITS <= 4 the rows are 256 B
//      apart and the table starts on a 64 KiB boundary of the shared window, so the address is
//      the lane's base with byte 1 replaced by the index: the prmt alone.
//          BITS 2: 256 quads x 32 lanes x 8 B, row stride 256 B   (64 KiB)
//          BITS 3:  64 pairs x 32 lanes x 4 B, row stride 256 B   (16 KiB)
//          BITS 4: 256 pairs x 32 lanes x 4 B, row stride 256 B   (64 KiB)
//          BITS 5: 1024 pairs x 32 lanes x 4 B, row stride 128 B (128 KiB; prmt + one IMAD)
//      The tables are built once per block from the codebook (persistent grid); under a
//      programmatic launch while the previous kernel finishes (the codebook is read again
//      after the wait).
//   3. Scale: one half2 multiply by the block scale, read from a 256-entry table of the E4M4
//      codes as half2 (built exactly, subnormal codes included). The per-tensor power of two
//      multiplies the fp32 result.
//   Per weight the loop body is ~1.6 (BITS 2) to ~3.5 (BITS 5) instructions, of them ~0.5 to
//   ~1.3 ALU; bench/results/decode.md has the SASS counts.
//
// Loads: the plane words go straight to registers (predicated 16-byte / 8-byte ld.global.nc
// for BITS 4 / 2, word loads for 3 and 5), D items (D*R row groups) ahead of use; a slot is
// refilled as soon as its planes are turned into index bytes.
//
// Half-precision values travel as raw bits; no system headers (NVRTC and nvcc both build it).

#include "common.cuh"  // u32/u16/u8, KBIT_F16/KBIT_BF16, conversions, mul2, mma_16816, e4m4_decode
#include "mbarrier.cuh"  // the in-block reduction's slot barriers
#include "decode_core.cuh"  // one row group's loads, tables, gather, lookups and mma (shared with experts_token.cu)

namespace kbit_decode {

// Grouped launches (mixture-of-experts: one launch over the experts that tokens were routed
// to): group q multiplies rows [row0[q], row0[q] + rows[q]) of x by expert expert[q]'s weight
// (expert e's planes start e * expert_words words into `packed`, its scales e * expert_scales
// bytes into `absmax`, its tensor scale at tensor_scale[e]) into the same rows of out. The row
// tiles of the groups are stacked: group q owns row tiles [q * rt_per_group, (q + 1) *
// rt_per_group) of one tall problem, which is scheduled, split and reduced like a single
// weight (workspace and counters sized for the tall problem). A group with no rows loads
// nothing and stores nothing. Ungrouped launches are the case count = 1 read from the kernel
// arguments (no loads from `info`).
struct Groups {
    const int* info;  // int32 [3][count]: expert, row0, rows (device memory)
    int count, rt_per_group;
    int expert_words, expert_scales;
    int stream_k_slack;  // see grouped_align (-1: keep the plan's align)
    int x_ld;            // elements between two rows of x: K, or 0 (grouped: every row is row 0)
};

// Where one work item's loads come from, advanced without divisions inside a row tile.
// Item (rt, ch): row tile rt, 128-wide chunk ch. pw/pa: this lane's plane words and scale byte
// of row group 0 of the warp (rows rg0*16 + g and + 8, block t of the chunk). NWR warps of a
// block sit side by side in a row tile (row slot `wr`), each owning R row groups.
// rg0 counts row groups of the whole (for grouped launches: stacked) problem, what the
// workspace is indexed by; lrg0 the row group inside the weight, vrg how many of the warp's row
// groups hold real rows (<= 0: none), and xrow0/xrows/expert the item's group.
template <int BITS, int NWR, int R, bool GROUPED> struct Cursor {
    int item, rt, ch, rg0, lrg0, vrg;
    int xrow0, xrows, expert;
    const u32* pw;
    const u8* pa;
    bool khi;  // k-tile 2*ch + t/2 exists (false for t >= 2 in a last, half chunk)

    KBIT_DEVICE void seek(int it, int kc, int wr, int t, int g, int k_tiles, int n_tiles, const u32* packed, const u8* absmax,
                          int rg_valid, int M, const Groups& grp) {
        item = it;
        rt = it / kc;
        ch = it - rt * kc;
        rg0 = (rt * NWR + wr) * R;
        int lrt = rt;
        if constexpr (GROUPED) {
            const int q = rt / grp.rt_per_group;
            lrt = rt - q * grp.rt_per_group;
            expert = __ldg(grp.info + q);
            xrow0 = __ldg(grp.info + grp.count + q);
            xrows = __ldg(grp.info + 2 * grp.count + q);
            packed += (long long)expert * grp.expert_words;
            absmax += (long long)expert * grp.expert_scales;
        } else {
            expert = 0;
            xrow0 = 0;
            xrows = M;
        }
        lrg0 = (lrt * NWR + wr) * R;
        vrg = (!GROUPED || xrows > 0) ? rg_valid - lrg0 : 0;
        const BlockAt<BITS> at(packed, absmax, lrg0, ch, t, g, k_tiles, n_tiles);
        pw = at.pw;
        pa = at.pa;
        khi = at.on;
    }
    // Move to item `it` (> item): a pointer bump when it is in the same row tile, else seek().
    KBIT_DEVICE void step(int it, int kc, int wr, int t, int g, int k_tiles, int n_tiles, const u32* packed, const u8* absmax,
                          int rg_valid, int M, const Groups& grp) {
        const int dc = it - item;
        if (dc > 0 && ch + dc < kc) {
            item = it;
            ch += dc;
            pw += (long long)dc * 2 * n_tiles * (256 * BITS);
            pa += (long long)dc * 2 * n_tiles * 256;
            khi = 2 * ch + (t >> 1) < k_tiles;
        } else {
            seek(it, kc, wr, t, g, k_tiles, n_tiles, packed, absmax, rg_valid, M, grp);
        }
    }
    KBIT_DEVICE void load(Sub<BITS> (&dst)[R], bool live) const {
#pragma unroll
        for (int r = 0; r < R; ++r) load_sub<BITS>(dst[r], pw + r * 32 * BITS, pa + r * 32, live && khi && r < vrg);
    }
};

// 1 + the last group with rows (0 if none), found by every warp on its own: one load per lane per
// 32 groups and a ballot.
KBIT_DEVICE int used_groups(const Groups& grp) {
    const int lane = threadIdx.x & 31;
    int used = 0;
    for (int q0 = 0; q0 < grp.count; q0 += 32) {
        const int q = q0 + lane;
        const u32 hit = __ballot_sync(0xffffffffu, q < grp.count && __ldg(grp.info + 2 * grp.count + q) > 0);
        if (hit) used = q0 + 32 - __clz(hit);
    }
    return used;
}

template <int R, int MT> KBIT_DEVICE void zero_acc(float (&acc)[R][MT][4]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.0f;
}

// The block's sums for R row groups of row tile rt over `nch` of its `kc` chunks are in acc
// (one warp). acc[r][j][c] belongs to row (rg0 + r) * 16 + g + 8 * (c / 2) and column
// 8j + 2t + c % 2. The whole K: store. Part of K: add to the workspace and count; the warp that
// completes the count (`cnt`, one per row tile and row slot) stores and leaves zeros.
// rg0: the row group in the workspace, org0: the same rows' row group in `out` (they differ
// only in grouped launches).
template <int DT, int MT, int R>
KBIT_DEVICE void flush(const float (&acc)[R][MT][4], u16* __restrict__ out, float* __restrict__ ws, int* cnt,
                     int rg0, int org0, int nch, int kc, int M, int N, float tscale, int lane) {
    const int g = lane >> 2, t = lane & 3;
    constexpr int kMP = 8 * MT;  // workspace row pitch (floats)
    if (nch == kc) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int n = (org0 + r) * 16 + g + 8 * (c >> 1);
                    const int m = 8 * j + 2 * t + (c & 1);
                    if (n < N && m < M) out[(size_t)m * N + n] = f32_to_bits<DT>(acc[r][j][c] * tscale);
                }
        return;
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int d = (rg0 - org0) * 16;  // workspace row - output row
                const int n = (org0 + r) * 16 + g + 8 * (c >> 1);
                const int m = 8 * j + 2 * t + (c & 1);
                if (n < N && m < M) atomicAdd(ws + (size_t)(n + d) * kMP + m, acc[r][j][c]);
            }
    fence_acq_rel_gpu();  // the partial sums are visible before the count
    __syncwarp();
    int old = 0;
    if (lane == 0) old = atomicAdd(cnt, nch);
    old = __shfl_sync(0xffffffffu, old, 0);
    if (old + nch != kc) return;
    // Last contributor: every partial sum is in the workspace. Convert, then leave zeros.
    fence_acq_rel_gpu();
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int n = (org0 + r) * 16 + g + 8 * (c >> 1);
                const int m = 8 * j + 2 * t + (c & 1);
                if (n < N && m < M) {
                    float* p = ws + (size_t)(n + (rg0 - org0) * 16) * kMP + m;
                    out[(size_t)m * N + n] = f32_to_bits<DT>(__ldcg(p) * tscale);
                    __stcg(p, 0.0f);
                }
            }
    if (lane == 0) atomicExch(cnt, 0);
}

// In-block reduction of one segment (the block's chunks of one row tile) for one row slot.
// The KS warps of a row slot share K: each stores its partial sums in its own slice of a
// shared-memory slot (plain stores: shared fp32 atomics are CAS loops on sm_80/90 and collide
// when 16 warps finish together) and counts its chunks; the warp that completes the segment's
// count (the "finisher") adds the other contributors' slices to its own sums and flushes them.
// Nobody waits for a slower warp: the last one to finish does the work. Two slots alternate
// between consecutive segments. No block barrier: warps without chunks in a segment never take
// part.
//
// Order, per slot (slot seg & 1 serves segments seg, seg + 2, ...: its use u = seg >> 1):
//   gen    the segment that may use the slot next; the finisher of segment seg sets seg + 2
//          after its reads and its flush (read and written with atomics: a waiting warp
//          polls it). Exact (no wrap), so a warp two segments ahead waits here.
//   free   mbarrier, 32 arrivals: the finisher's lanes after reading (phase u = use u read).
//   full   mbarrier, 32 * KS arrivals: every lane of every contributor after storing its slice,
//          then the finisher tops the count up for the KS - min(seg_len, KS) warps that had no
//          chunk (phase u = use u's slices stored).
//   count  chunks of the current use, added by each contributor's lane 0 with an atomic; the add
//          that reaches seg_len names the finisher, which resets it before releasing the slot.
// A contributor waits for `gen == seg`, then for phase u - 1 of `free` (already complete then:
// the wait is what tells each lane, and racecheck, that the earlier reads are done), stores,
// arrives on `full`. The finisher waits for phase u of `full` (complete by then: every other
// contributor arrived before its count add) before reading. A segment with one contributor
// (seg_len == 1) stores and reads nothing but still completes a phase of both barriers, so use
// numbers and phases stay equal. The barriers' phases are what order the slices' stores, reads
// and reuse; compute-sanitizer's racecheck follows them (scripts/sanitize_gemm.py: 0 hazards).
// The gen word keeps a warp that skipped segments from mistaking an old phase of the same parity
// for the one it waits for. tests/test_decode_cuda.py::test_in_block_reduction_stress runs random
// shapes, M, launch shapes and schedules on two streams at once against the reference.
// (Replacing the finisher with a fixed owner that waits for all contributors, at a named barrier
// or an mbarrier, cost 5-20 % on the largest shapes on an H100: bench/results/decode.md.)
template <int KS, int R, int MT> struct RedSlot {
    float part[KS][R * MT * 4][32];
};
// A slot's control words ("RedCtl", addressed by offset; the host sizes shared memory with the
// same 24 bytes): gen (s32), count (s32), then the full and free mbarriers (8-byte aligned).
constexpr u32 kGenOffset = 0, kCountOffset = 4, kFullOffset = 8, kFreeOffset = 16, kCtlBytes = 24;

// seg_pos0: the segment's first position in the block's sequence (warp wk holds positions
// p = wk mod KS), so its contributors are the warps (seg_pos0 + q) % KS, q < min(seg_len, KS).
// slot_s, ctl_s: shared-memory addresses of the slot (RedSlot) and its control words.
template <int DT, int MT, int R, int KS>
KBIT_DEVICE void reduce_flush(float (&acc)[R][MT][4], u32 slot_s, u32 ctl_s, u16* __restrict__ out, float* __restrict__ ws,
                            int* cnt, int seg, int seg_len, int seg_pos0, int nmine, int wk, int rg0, int org0, int kc, int M,
                            int N, float tscale, int lane) {
    if constexpr (KS > 1) {
        constexpr u32 kSlice = R * MT * 4 * 32 * 4;  // bytes of one warp's slice
        const u32 parity = ((u32)seg >> 1) & 1;      // of this slot's use u = seg >> 1
        if (lane == 0) {
            while (atoms_add(ctl_s + kGenOffset, 0) != seg) {
            }
        }
        __syncwarp();
        kbit::mbar_wait(ctl_s + kFreeOffset, parity ^ 1);  // use u - 1 read (a fresh barrier passes parity 1)
        const bool alone = nmine == seg_len;
        if (!alone) {
            const u32 mine = slot_s + (u32)wk * kSlice + (u32)lane * 4;
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) sts32(mine + ((r * MT + j) * 4 + c) * 128, __float_as_uint(acc[r][j][c]));
        }
        kbit::mbar_arrive(ctl_s + kFullOffset);
        if (!alone) {
            __syncwarp();  // every lane has arrived before the count names a finisher
            int old = 0;
            if (lane == 0) old = atoms_add(ctl_s + kCountOffset, nmine);
            old = __shfl_sync(0xffffffffu, old, 0);
            if (old + nmine != seg_len) return;
        }
        // The finisher: complete the phase for the warps that had no chunk, then read.
        const int nc = min(seg_len, KS);
        if (lane == 0) {
            if (nc < KS) kbit::mbar_arrive_many(ctl_s + kFullOffset, 32u * (u32)(KS - nc));
            atoms_exch(ctl_s + kCountOffset, 0);
        }
        kbit::mbar_wait(ctl_s + kFullOffset, parity);
        for (int q = 0; q < nc; ++q) {
            const int w = (seg_pos0 + q) % KS;
            if (w == wk) continue;
            const u32 src = slot_s + (u32)w * kSlice + (u32)lane * 4;
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[r][j][c] += __uint_as_float(lds32(src + ((r * MT + j) * 4 + c) * 128));
        }
        kbit::mbar_arrive(ctl_s + kFreeOffset);
    }
    flush<DT, MT, R>(acc, out, ws, cnt, rg0, org0, seg_len, kc, M, N, tscale, lane);
    if constexpr (KS > 1) {
        __syncwarp();
        if (lane == 0) atoms_exch(ctl_s + kGenOffset, seg + 2);  // the segment two ahead may take the slot
    }
}

// Dynamic shared memory of one instance, what the host sizes the launch with (the worst-case
// alignment padding of the table included): the tables, then two reduction slots and their
// control words per row slot. tests/test_kernels_compile.py checks the host's copy of this
// against every instance.
template <int BITS, int MT, int NW, int KS, int R> struct DecodeSmem {
    static constexpr int kBytes = Lut<BITS>::kSmem + 2 * (NW / KS) * (int)(sizeof(RedSlot<KS, R, MT>) + kCtlBytes);
};

// The align a grouped launch runs with. The host plans for every group entry, but only the
// groups up to the last one with rows have work (used_rt row tiles). A whole-tile plan (align
// = kc) shares those tiles out in whole tiles, so when they do not divide evenly over the grid
// the busiest block carries up to a tile more than its fair share; stream-K (align 1) splits
// the tiles' chunks evenly at the price of the split-K finalisation. The launch switches to
// stream-K when the whole-tile rounding costs more than `slack` chunks of the busiest block
// (slack: the finalisation's cost in chunks, from the host; -1 never switches). The grid stays
// the plan's (at most one block per SM slot, possibly fewer than the SMs).
KBIT_DEVICE int grouped_align(int align, int kc, int used_rt, int slack) {
    if (align != kc || slack < 0) return align;
    const int g = gridDim.x;
    const int tiles_most = (used_rt + g - 1) / g * kc;                     // whole tiles, in chunks
    const int chunks_most = (used_rt * kc + g - 1) / g;                    // stream-K
    return tiles_most - chunks_most > slack ? 1 : align;
}

// This block's share [i0, i1) of the grid's `units` x `align` items: even shares, cut at multiples
// of `align`. False when the share is empty (more blocks than units).
KBIT_DEVICE bool block_range(int units, int align, int& i0, int& i1) {
    i0 = align * (int)(((long long)blockIdx.x * units) / gridDim.x);
    i1 = align * (int)(((long long)(blockIdx.x + 1) * units) / gridDim.x);
    return i0 < i1;
}

// Kernel parameters:
//   x [M, K] (fp16/bf16 bits), packed/absmax tiled (k_tiles x n_tiles storage tiles),
//   codebook f32 [2^BITS], tensor_scale f32 [1], out [M, N] (x's type);
//   ws f32 [row tiles * NWR*R*16, 8*MT] and counters i32 [row tiles * NWR]: zero on entry and
//   left zero (only touched when a row tile is split over blocks; may be null otherwise);
//   M, N; K: x's row length, a multiple of 8 (x 16-byte aligned), at most 64 * k_tiles;
//   align: the block ranges of items are cut on multiples of `align` (1: stream-K, balanced to
//   one item; kc: whole row tiles per block, never split, except in a grouped launch with
//   stream_k_slack >= 0, see grouped_align).
// Template: BITS 2..5, DT (KBIT_F16 / KBIT_BF16), MT = ceil(M / 8) n8 fragments, NW warps per
// block, of them KS side by side along K (so NW/KS row slots of R row groups: a row tile is
// NW/KS*R*16 rows), D items of loads in flight per warp, MINB blocks per SM (register budget:
// 65536 / (MINB * NW * 32) per thread), PAIRS: packed holds pair codes (4 or 5 bits; no gather).
// The body of both kernels below; GROUPED: grp describes the groups (else M rows of one weight).
template <int BITS, int DT, int MT, int NW, int KS, int R, int D, bool GROUPED, bool PAIRS>
KBIT_DEVICE void decode_gemm_body(const u16* __restrict__ x, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                                  const float* __restrict__ codebook, const float* __restrict__ tensor_scale, u16* __restrict__ out,
                                  float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int k_tiles, int n_tiles,
                                  int align, Groups grp) {
    static_assert(R == 1 || R == 2 || R == 4 || R == 8, "a warp's rows must stay inside one 128-row storage tile");
    static_assert(NW % KS == 0, "KS must divide NW");
    constexpr int NWR = NW / KS;
    extern __shared__ __align__(16) u8 smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wr = warp % NWR, wk = warp / NWR;  // row slot, position along K
    const int kc = (k_tiles + 1) >> 1;          // 128-wide chunks
    constexpr int kRows = NWR * R * 16;         // rows per row tile
    grp.rt_per_group = (N + kRows - 1) / kRows;
    // The next programmatic launch may start (and run up to its own wait) once every block has
    // passed here: its launch and prologue overlap this grid's work instead of following it.
    // (Triggering only as blocks exit gains nearly nothing: measured in bench/results/decode.md.)
    allow_dependent_launch();
    // A grouped launch's items are known only after the wait (the groups come from the previous
    // kernel), so its blocks find their ranges below; a single weight's are known now.
    int units = 0, i0 = 0, i1 = 0;
    if constexpr (!GROUPED) {
        units = grp.rt_per_group * (kc / align);  // the grid's items, in multiples of `align`
        if (!block_range(units, align, i0, i1)) return;  // whole block, before any barrier
    }
    const int rg_valid = (N + 15) >> 4;  // row groups holding real rows

    // Tables: the pair/quad table on a kAlign boundary of the shared window, then the scales,
    // then the reduction slots.
    const TableWindows<BITS> tw(smem);
    const u32 lut_win = tw.lut, stab_win = tw.stab, lanebase = tw.lanebase;
    using Slot = RedSlot<KS, R, MT>;
    const u32 slots_win = tw.rest;                                       // Slot [2][NWR]
    const u32 ctls_win = slots_win + 2u * NWR * (u32)sizeof(Slot);       // RedCtl [2][NWR]

    // Under a programmatic launch the previous kernel may still be running until
    // grid_dependency_wait(). Before it: build the tables from the codebook as it reads now
    // (checked again after the wait) and set up the reduction slots. After it: every load and
    // store that counts (the weights too: nothing says that kernel did not write them).
    // (Pulling the first weights into L2 before the wait was tried: no gain at K = 2, 4, 5,
    // 0.6-1.4 us lost at K = 3.)
    const float* cb_entry = codebook + (threadIdx.x & ((1 << BITS) - 1));
    const u32 cb_early = ldg_cg_word(cb_entry);
    build_tables<BITS, DT, NW * 32, PAIRS>(lut_win, stab_win, __uint_as_float(cb_early), threadIdx.x);
    if (KS > 1 && threadIdx.x < 2 * NWR) {
        const u32 ctl_s = ctls_win + threadIdx.x * kCtlBytes;
        sts32(ctl_s + kGenOffset, threadIdx.x / NWR);  // slot 0 starts with segment 0, slot 1 with 1
        sts32(ctl_s + kCountOffset, 0);
        kbit::mbar_init(ctl_s + kFullOffset, 32 * KS);
        kbit::mbar_init(ctl_s + kFreeOffset, 32);
    }
    grid_dependency_wait();
    if constexpr (GROUPED) {
        // The items run over the groups up to the last one with rows: the routing lists the hit
        // experts first and leaves the rest empty, so the grid's blocks share only the hit ones'
        // items (empty groups in between still take items, which load and store nothing).
        const int used_rt = used_groups(grp) * grp.rt_per_group;
        const int run_align = grouped_align(align, kc, used_rt, grp.stream_k_slack);
        units = used_rt * (kc / run_align);
        if (!block_range(units, run_align, i0, i1)) return;  // whole block, before any barrier
    }
    // The codebook as it reads now: if the previous kernel changed it, the tables are rebuilt
    // below (no lookup has happened yet).
    const bool cb_changed = ldg_cg_word(cb_entry) != cb_early;

    // Order of this block's items: when its range ends inside a row tile that it does not also
    // start in, that partial tile goes first; then the range from its start. A range holding a
    // whole row tile thus ends on one, stored directly, and the split-K finalisation of partial
    // tiles happens early instead of on the kernel's critical path. Segment = the block's items
    // of one row tile; warp (wr, wk) takes positions wk, wk + KS, ... of the sequence.
    const int n_items = i1 - i0;
    const int last_rt_start = ((i1 - 1) / kc) * kc;
    const int n_tail = (i1 % kc != 0 && last_rt_start > i0) ? i1 - last_rt_start : 0;
    const int body_end = n_tail ? last_rt_start : i1;
    auto item_at = [&](int p) { return p < n_tail ? last_rt_start + p : i0 + (p - n_tail); };
    const int n_mine = wk < n_items ? (n_items - wk + KS - 1) / KS : 0;

    // Ring of in-flight plane loads: ring[d] holds the R row groups of this warp's unit (j + d).
    Sub<BITS> ring[D][R];
#pragma unroll
    for (int d = 0; d < D; ++d)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int rho = 0; rho < 2; ++rho)
#pragma unroll
                for (int b = 0; b < BITS; ++b) ring[d][r].p[rho][b] = 0u;
    Cursor<BITS, NWR, R, GROUPED> cur, pre;
    cur.seek(item_at(min(wk, n_items - 1)), kc, wr, t, g, k_tiles, n_tiles, packed, absmax, rg_valid, M, grp);
    pre = cur;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        pre.load(ring[d], d < n_mine);
        if (d + 1 < n_mine) pre.step(item_at(wk + (d + 1) * KS), kc, wr, t, g, k_tiles, n_tiles, packed, absmax, rg_valid, M, grp);
    }
    // x of the first item while the first loads are on their way.
    u32 bx[MT][16];
    load_x<MT>(bx, GROUPED ? x + (size_t)cur.xrow0 * grp.x_ld : x, GROUPED ? cur.xrows : M, K, grp.x_ld, cur.ch * 128 + 32 * t, g);
    if (__syncthreads_or(cb_changed)) {
        build_tables<BITS, DT, NW * 32, PAIRS>(lut_win, stab_win, __ldcg(cb_entry), threadIdx.x);
        __syncthreads();
    }
    if (n_mine == 0) return;
    const float tscale = GROUPED ? 0.0f : __ldg(tensor_scale);  // grouped: per expert, at the flush

    float acc[R][MT][4];
    zero_acc<R, MT>(acc);
    int j_first = 0;  // first unit of the current segment
    for (int jb = 0; jb < n_mine; jb += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int j = jb + d;
            if (j >= n_mine) break;
            if (j > 0)
                load_x<MT>(bx, GROUPED ? x + (size_t)cur.xrow0 * grp.x_ld : x, GROUPED ? cur.xrows : M, K, grp.x_ld, cur.ch * 128 + 32 * t, g);
            const bool refill = j + D < n_mine;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                Prepped<BITS> o;
                prep<BITS, PAIRS>(ring[d][r], o, stab_win);
                // The planes are consumed: reload the slot with row group r of unit j + D.
                load_sub<BITS>(ring[d][r], pre.pw + r * 32 * BITS, pre.pa + r * 32,
                               refill && pre.khi && r < pre.vrg);
                // (row groups past N decode zero planes with zero scales: no branch here)
                lookup_mma<BITS, DT, MT, PAIRS>(o, bx, acc[r], lanebase, lut_win);
            }
            if (j + D + 1 < n_mine)
                pre.step(item_at(wk + (j + D + 1) * KS), kc, wr, t, g, k_tiles, n_tiles, packed, absmax, rg_valid, M, grp);

            const int rt = cur.rt, rg0 = cur.rg0;
            // the item's group (grouped launches; the single weight's constants otherwise)
            const int lrg0 = GROUPED ? cur.lrg0 : rg0, xrow0 = GROUPED ? cur.xrow0 : 0, xrows = GROUPED ? cur.xrows : M;
            const int expert = GROUPED ? cur.expert : 0;
            const int pos = wk + j * KS;
            bool seg_ends = j + 1 >= n_mine;
            if (!seg_ends) {
                cur.step(item_at(pos + KS), kc, wr, t, g, k_tiles, n_tiles, packed, absmax, rg_valid, M, grp);
                seg_ends = cur.rt != rt;
            }
            if (!seg_ends) continue;
            int seg, seg_len, seg_pos0;
            if (pos < n_tail) {
                seg = 0;
                seg_len = n_tail;
                seg_pos0 = 0;
            } else {
                const int lo = max(i0, rt * kc);
                seg = (n_tail > 0 ? 1 : 0) + rt - i0 / kc;
                seg_len = min(body_end, (rt + 1) * kc) - lo;
                seg_pos0 = n_tail + lo - i0;
            }
            const int s2 = (seg & 1) * NWR + wr;
            reduce_flush<DT, MT, R, KS>(acc, slots_win + s2 * (u32)sizeof(Slot), ctls_win + s2 * kCtlBytes, out + (size_t)xrow0 * N, ws,
                                        counters + rt * NWR + wr, seg, seg_len, seg_pos0, j - j_first + 1, wk, rg0, lrg0, kc,
                                        xrows, N, GROUPED ? __ldg(tensor_scale + expert) : tscale, lane);
            zero_acc<R, MT>(acc);
            j_first = j + 1;
        }
    }
}

template <int BITS, int DT, int MT, int NW, int KS, int R, int D, int MINB, bool PAIRS = false>
__global__ void __launch_bounds__(NW * 32, MINB)
kbit_decode_gemm(const u16* __restrict__ x, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                 const float* __restrict__ codebook, const float* __restrict__ tensor_scale, u16* __restrict__ out,
                 float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int k_tiles, int n_tiles, int align) {
    decode_gemm_body<BITS, DT, MT, NW, KS, R, D, false, PAIRS>(x, packed, absmax, codebook, tensor_scale, out, ws, counters, M, N, K,
                                                        k_tiles, n_tiles, align, Groups{nullptr, 1, 0, 0, 0, -1, K});
}

// Grouped: `groups` int32 [3][count] (expert, row0, rows per group, on the device), x and out
// [total rows, K] / [total rows, N] with each group's rows contiguous (x's rows x_ld elements
// apart: K, or 0 when every row is the same token's, a decode step of one token); packed/absmax/tensor_scale
// hold every expert, expert_words / expert_scales apart (the other parameters as above, for one
// expert's weight). Workspace and counters: count times the single weight's (also for a
// whole-tile plan when stream_k_slack >= 0: it may run split, grouped_align).
template <int BITS, int DT, int MT, int NW, int KS, int R, int D, int MINB, bool PAIRS = false>
__global__ void __launch_bounds__(NW * 32, MINB)
kbit_decode_gemm_grouped(const u16* __restrict__ x, const u32* __restrict__ packed, const u8* __restrict__ absmax,
                         const float* __restrict__ codebook, const float* __restrict__ tensor_scale, u16* __restrict__ out,
                         float* __restrict__ ws, int* __restrict__ counters, const int* __restrict__ groups, int count,
                         int expert_words, int expert_scales, int N, int K, int k_tiles, int n_tiles, int align,
                         int stream_k_slack, int x_ld) {
    decode_gemm_body<BITS, DT, MT, NW, KS, R, D, true, PAIRS>(x, packed, absmax, codebook, tensor_scale, out, ws, counters, 0, N, K,
                                                       k_tiles, n_tiles, align,
                                                       Groups{groups, count, 0, expert_words, expert_scales, stream_k_slack, x_ld});
}

}  // namespace kbit_decode

using kbit_decode::kbit_decode_gemm;
using kbit_decode::kbit_decode_gemm_grouped;
