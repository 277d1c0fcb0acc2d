// One token through a mixture-of-experts layer's kbit experts in two launches. A decode step of
// batch 1 is bound by launches, not bytes: the grouped path takes six (routing, gate_up, SwiGLU,
// the down projection's zero fill, down, combine); this takes two and needs no routing, since
// one token's top_k slots name distinct experts.
//
//   kbit_token_gate_up   slot s (expert e = ids[s]), intermediate row i < I:
//                          g = round(W_gu[e][i] . x * ts_gu[e]),  u = round(W_gu[e][I + i] . x * ts_gu[e])
//                          h[s][i] = round(silu(g) * u)                      (fp32, rounded once)
//   kbit_token_down      hidden row n < H:
//                          out[n] = round(sum_s round(w[s]) * round(W_d[e][n] . h[s] * ts_d[e]))
//                        (fp32, slots in order: the roundings of the grouped path's grouped_swiglu,
//                         grouped_gemm and combine_experts)
//   round() is to the activations' type DT. A slot whose id is outside 0..E-1 (transformers'
//   "no expert" is E) adds nothing: its loads are off and the sum skips it.
//
// Work split. A unit is one row group (16 rows); a persistent grid of NW-warp blocks takes
// units blockIdx.x, blockIdx.x + gridDim.x, ...; the warps of a block split a unit's items:
//
//   gate_up unit (s, j): gate rows 16j..16j+15 and up rows I+16j..I+16j+15 (I a multiple of 16)
//        items: the kc chunks of k (128 in-features each); warp w takes chunks w, w + NW, ...
//   down unit j: hidden rows 16j..16j+15
//        items: (slot, chunk) pairs, slot-major; warp w takes items w, w + NW, ...; x = h[slot]
//
//        chunk 0    chunk 1    chunk 2    ...
//       +----------+----------+----------+--
//   w0  | items    |          |          |        a warp: one row group (two for gate_up) of
//   w1  |          | items    |          |        the chunk, x's chunk as the mma's n8 side
//   ..  +----------+----------+----------+--      (decode_core.cuh: lane layout, decode)
//
// Each warp writes its fp32 sums to its own slice of shared memory (for down: one slice per
// slot, zero where it had no item); after a block barrier the slices of each row are added in
// warp order (deterministic): gate_up: lane (q, r) of warp 0 adds row r of the gate (q = 0) or
// up (q = 1) slices, and lane r finishes the row; down: thread (s, r) adds row r of slot s and
// scales it, and after a second barrier thread r sums its row over the slots in order. What the
// finishing threads read from global memory (scales, routing weights) is prefetched into L1
// before the barrier. Two slice buffers alternate between units, so the barriers of a unit also
// order the previous unit's reads before the next writes.
//
// Loads: each warp keeps D items of plane words in flight (a ring of decode_core.cuh's Sub),
// refilled as soon as an item's planes are turned into index bytes.
//
// Launched as programmatic dependents (sm_90+): the tables are built before
// grid_dependency_wait(), every other memory access after it.

#include "common.cuh"
#include "decode_core.cuh"

namespace kbit_token {

using kbit_decode::BlockAt;
using kbit_decode::build_tables;
using kbit_decode::ldg_cg_word;
using kbit_decode::lds32;
using kbit_decode::Prepped;
using kbit_decode::Sub;
using kbit_decode::sts32;
using kbit_decode::TableWindows;

constexpr int kRowsPerUnit = 16;

// The expert slot s names, or -1 for an id outside 0..experts-1 (no expert).
KBIT_DEVICE long long expert_or_none(const long long* __restrict__ ids, int s, int experts) {
    const long long e = __ldg(ids + s);
    return e < 0 || e >= experts ? -1ll : e;
}

// How many of `units` this block takes (units blockIdx.x, blockIdx.x + gridDim.x, ...).
KBIT_DEVICE int block_units(int units) {
    return units > (int)blockIdx.x ? (units - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
}

// Bring the line at p into this SM's L1 without holding a register: the finishing threads
// prefetch what they read after a block barrier, so that the latency passes at the barrier.
KBIT_DEVICE void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

template <int BITS> KBIT_DEVICE void zero_sub(Sub<BITS>& d) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
#pragma unroll
        for (int b = 0; b < BITS; ++b) d.p[rho][b] = 0u;
        d.a[rho] = 0u;
    }
}

// The block's tables, built before the dependency wait (rebuilt if the codebook changed by the
// wait), and their shared-memory windows; the partial-sum slices start at `rest`. Returns after
// a block barrier, past the wait.
template <int BITS, int DT, int NW, bool PAIRS>
KBIT_DEVICE TableWindows<BITS> tables_after_wait(const void* smem, const float* __restrict__ codebook) {
    const TableWindows<BITS> win(smem);
    const float* cb_entry = codebook + (threadIdx.x & ((1 << BITS) - 1));
    const u32 cb_early = ldg_cg_word(cb_entry);
    build_tables<BITS, DT, NW * 32, PAIRS>(win.lut, win.stab, __uint_as_float(cb_early), threadIdx.x);
    grid_dependency_wait();
    const bool cb_changed = ldg_cg_word(cb_entry) != cb_early;
    if (__syncthreads_or(cb_changed)) {
        build_tables<BITS, DT, NW * 32, PAIRS>(win.lut, win.stab, __ldcg(cb_entry), threadIdx.x);
        __syncthreads();
    }
    return win;
}

// Kernel parameters (both): packed / absmax hold every expert, expert_words u32 words /
// expert_scales bytes apart (tiled, k_tiles x n_tiles storage tiles each; planes, or pair codes
// when PAIRS); codebook f32 [2^BITS] shared by the experts; tensor_scale f32 [E]; ids int64
// [slots]; K: x's length (a multiple of 8, 16-byte aligned), at most 64 * k_tiles.
//
// A warp walks its items of all the block's units as one sequence (unit m of the block =
// blockIdx.x + m * gridDim.x, `per` items in each), so the ring's loads run ahead into the next
// unit while this one is reduced. A warp with no items still meets each unit's barrier.
//
// gate_up: x [K]; h [slots, inter] out (inter a multiple of 16; 2 * inter <= 128 * n_tiles).
// Shared memory: Lut<BITS>::kSmem + 2 buffers x NW warps x 2 (gate, up) x 16 floats.
template <int BITS, int DT, int NW, int D, bool PAIRS = false>
__global__ void __launch_bounds__(NW * 32, 1)
kbit_token_gate_up(const u16* __restrict__ x, const long long* __restrict__ ids, const u32* __restrict__ packed,
                   const u8* __restrict__ absmax, const float* __restrict__ codebook, const float* __restrict__ tensor_scale,
                   u16* __restrict__ h, int slots, int experts, int expert_words, int expert_scales, int inter, int K,
                   int k_tiles, int n_tiles) {
    extern __shared__ __align__(16) u8 smem[];
    allow_dependent_launch();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const TableWindows<BITS> win = tables_after_wait<BITS, DT, NW, PAIRS>(smem, codebook);

    const int kc = (k_tiles + 1) >> 1;
    const int groups = inter / kRowsPerUnit;
    const int units = slots * groups;
    const int mine = block_units(units);
    const int per = w < kc ? (kc - w + NW - 1) / NW : 0;  // this warp's chunks of a unit
    constexpr u32 kBuffer = NW * 2 * kRowsPerUnit * 4;  // bytes of one buffer
    using At = BlockAt<BITS>;
    const typename At::LaneChunks lanes(t, g, n_tiles);
    // The next unit of the block is gridDim.x units on: ds slots and dj row groups further.
    const int ds = (int)gridDim.x / groups, dj = (int)gridDim.x - ds * groups;

    // Where the warp is in its sequence of items: unit m of the block (slot s, row group j), the
    // unit's item k (chunk c). Stepped without divisions.
    struct Pos {
        int m, s, j, k, c;
    };
    Pos start;
    start.m = 0;
    start.s = (int)blockIdx.x / groups;
    start.j = (int)blockIdx.x - start.s * groups;
    start.k = 0;
    start.c = w;
    auto next = [&](Pos& p) {
        if (++p.k < per) {
            p.c += NW;
        } else {
            p.k = 0;
            p.c = w;
            ++p.m;
            p.s += ds;
            p.j += dj;
            if (p.j >= groups) {
                p.j -= groups;
                ++p.s;
            }
        }
    };
    // Loads of the item at p: gate and up row groups of its chunk.
    auto load_item = [&](Sub<BITS> (&d)[2], const Pos& p) {
        const long long e = expert_or_none(ids, p.s, experts);
        u32 cw, ca;
        const bool kon = lanes.at(p.c, k_tiles, cw, ca);
        const long long eo = e < 0 ? 0 : e;
        const u32* ew = packed + eo * expert_words;
        const u8* ea = absmax + eo * expert_scales;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int rg = q * groups + p.j;
            kbit_decode::load_sub<BITS>(d[q], ew + At::rows_words(rg) + cw, ea + At::rows_bytes(rg) + ca, e >= 0 && kon);
        }
    };
    // End of the unit at p: this warp's sums are in its slice; one barrier; then warp 0 finishes
    // the unit: lane (q, r) adds row r of the gate (q = 0) or up (q = 1) slices in warp order, and
    // lane r takes up's sum from lane 16 + r and writes h. Lane 0 prefetches the expert's scale
    // before the barrier, so that its latency passes while the other warps arrive.
    auto finish = [&](const Pos& p, const float (&acc)[2][1][4]) {
        const u32 buf = win.rest + (u32)(p.m & 1) * kBuffer;
        if (t == 0 && per > 0) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const u32 slice = buf + (u32)((w * 2 + q) * kRowsPerUnit) * 4u;
                sts32(slice + 4u * g, __float_as_uint(acc[q][0][0]));  // column 0 (x's row): rows g, g + 8
                sts32(slice + 4u * (g + 8), __float_as_uint(acc[q][0][2]));
            }
        }
        const long long e = expert_or_none(ids, p.s, experts);  // ids: in L1 already, read by load_item
        if (threadIdx.x == 0 && e >= 0) prefetch_l1(tensor_scale + e);
        block_barrier();
        if (w == 0) {
            const float ts = e >= 0 ? __ldg(tensor_scale + e) : 0.0f;
            const int q = lane / kRowsPerUnit, r = lane % kRowsPerUnit;
            float sum = 0.0f;
            for (int v = 0; v < min(NW, kc); ++v)  // warps past kc had no chunk
                sum += __uint_as_float(lds32(buf + (u32)((v * 2 + q) * kRowsPerUnit + r) * 4u));
            const float us = __shfl_down_sync(0xffffffffu, sum, kRowsPerUnit);
            if (q == 0 && e >= 0) {
                const float gv = bits_to_f32<DT>(f32_to_bits<DT>(sum * ts));
                const float uv = bits_to_f32<DT>(f32_to_bits<DT>(us * ts));
                h[(long long)p.s * inter + p.j * kRowsPerUnit + r] = f32_to_bits<DT>(gv / (1.0f + expf(-gv)) * uv);
            }
        }
    };

    float acc[2][1][4] = {};
    if (per == 0) {  // no chunks: meet every unit's barrier
        for (Pos p = start; p.m < mine; next(p)) finish(p, acc);
        return;
    }
    const int n_items = mine * per;
    Sub<BITS> ring[D][2];
    Pos lp = start;  // the next item to load
#pragma unroll
    for (int d = 0; d < D; ++d) {
        zero_sub<BITS>(ring[d][0]);
        zero_sub<BITS>(ring[d][1]);
        if (d < n_items) {
            load_item(ring[d], lp);
            next(lp);
        }
    }
    Pos cp = start;  // the item to compute
    for (int ib = 0; ib < n_items; ib += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int i = ib + d;
            if (i >= n_items) break;
            u32 bx[1][16];
            kbit_decode::load_x<1>(bx, x, 1, K, 0, cp.c * 128 + 32 * t, g);
            Prepped<BITS> o[2];
            kbit_decode::prep<BITS, PAIRS>(ring[d][0], o[0], win.stab);
            kbit_decode::prep<BITS, PAIRS>(ring[d][1], o[1], win.stab);
            if (i + D < n_items) {  // the planes are consumed: refill
                load_item(ring[d], lp);
                next(lp);
            }
            kbit_decode::lookup_mma<BITS, DT, 1, PAIRS>(o[0], bx, acc[0], win.lanebase, win.lut);
            kbit_decode::lookup_mma<BITS, DT, 1, PAIRS>(o[1], bx, acc[1], win.lanebase, win.lut);
            if (cp.k == per - 1) {
                finish(cp, acc);
#pragma unroll
                for (int q = 0; q < 2; ++q)
#pragma unroll
                    for (int v = 0; v < 4; ++v) acc[q][0][v] = 0.0f;
            }
            next(cp);
        }
    }
}

// down: h [slots, K] (gate_up's output), weights [slots] (WT: KBIT_F32, or DT), out [N].
// Shared memory: Lut<BITS>::kSmem + 2 buffers x slots x NW warps x 16 floats.
template <int BITS, int DT, int WT, int NW, int D, bool PAIRS = false>
__global__ void __launch_bounds__(NW * 32, 1)
kbit_token_down(const u16* __restrict__ h, const long long* __restrict__ ids, const void* __restrict__ weights,
                const u32* __restrict__ packed, const u8* __restrict__ absmax, const float* __restrict__ codebook,
                const float* __restrict__ tensor_scale, u16* __restrict__ out, int slots, int experts, int expert_words,
                int expert_scales, int N, int K, int k_tiles, int n_tiles) {
    extern __shared__ __align__(16) u8 smem[];
    allow_dependent_launch();
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const TableWindows<BITS> win = tables_after_wait<BITS, DT, NW, PAIRS>(smem, codebook);

    const int kc = (k_tiles + 1) >> 1;
    static_assert(NW * 32 >= 16 * kRowsPerUnit, "a thread for every (slot, row) pair of up to 16 slots");
    const int units = (N + kRowsPerUnit - 1) / kRowsPerUnit;
    const int mine = block_units(units);
    const int items = slots * kc;  // of one unit: (slot, chunk), slot-major
    const int per = w < items ? (items - w + NW - 1) / NW : 0;
    const u32 buffer = (u32)(slots * NW * kRowsPerUnit) * 4u;  // bytes of one buffer
    using At = BlockAt<BITS>;
    const typename At::LaneChunks lanes(t, g, n_tiles);
    auto expert_of = [&](int s) { return expert_or_none(ids, s, experts); };
    auto slice_of = [&](u32 buf, int s, int v) { return buf + (u32)((s * NW + v) * kRowsPerUnit) * 4u; };
    // Where the warp is in its sequence of items: unit m of the block (row group blockIdx.x +
    // m * gridDim.x), the unit's item k = (slot s, chunk c), the unit's item w + k * NW. Every unit
    // has the same (s, c) sequence: NW items on is ds slots and dc chunks further.
    const int ds = NW / kc, dc = NW - ds * kc;
    struct Pos {
        int m, k, s, c;
    };
    Pos start;
    start.m = 0;
    start.k = 0;
    start.s = w / kc;
    start.c = w - start.s * kc;
    auto next = [&](Pos& p) {
        if (++p.k < per) {
            p.s += ds;
            p.c += dc;
            if (p.c >= kc) {
                p.c -= kc;
                ++p.s;
            }
        } else {
            p.k = 0;
            p.s = start.s;
            p.c = start.c;
            ++p.m;
        }
    };
    auto load_item = [&](Sub<BITS>& d, const Pos& p) {
        const int j = (int)blockIdx.x + p.m * (int)gridDim.x;
        const long long e = expert_of(p.s), eo = e < 0 ? 0 : e;
        u32 cw, ca;
        const bool kon = lanes.at(p.c, k_tiles, cw, ca);
        kbit_decode::load_sub<BITS>(d, packed + eo * expert_words + At::rows_words(j) + cw,
                                    absmax + eo * expert_scales + At::rows_bytes(j) + ca, e >= 0 && kon);
    };
    // This warp's slices of unit m's buffer start at zero: a slot with no item of the warp adds nothing.
    auto zero_slices = [&](int m) {
        const u32 buf = win.rest + (u32)(m & 1) * buffer;
        for (int q = lane; q < slots * kRowsPerUnit; q += 32) sts32(slice_of(buf, q / kRowsPerUnit, w) + 4u * (q % kRowsPerUnit), 0u);
        __syncwarp();
    };
    // Unit m's rows, in three steps around two barriers. Thread (s, 0) of every slot s prefetches
    // the slot's scale and routing weight before the first barrier, so that their latency passes
    // while the other warps arrive. After it, thread (s, r) (s < slots <= 16: every pair has a
    // thread) adds row r of slot s's slices in warp order, rounds the scaled sum, and leaves it and
    // the weight in its own elements of the slot's first two slices (nobody else reads them before
    // the second barrier). After it, thread r sums its row over the slots in order.
    auto finish = [&](int m) {
        const u32 buf = win.rest + (u32)(m & 1) * buffer;
        const int s = (int)threadIdx.x / kRowsPerUnit, r = (int)threadIdx.x % kRowsPerUnit;
        const bool pair = s < slots;
        if (pair && r == 0) {
            const long long e = expert_of(s);  // ids: in L1 already, read by load_item
            if (e >= 0) {
                prefetch_l1(tensor_scale + e);
                prefetch_l1(static_cast<const char*>(weights) + (size_t)s * (WT == KBIT_F32 ? 4 : 2));
            }
        }
        block_barrier();
        if (pair) {
            // A slot without an expert leaves y = weight = 0: adding 0 * 0 keeps the row's sum as it
            // was, bit for bit (the sum starts at +0 and round-to-nearest never makes it -0).
            float y = 0.0f, wt = 0.0f;
            const long long e = expert_of(s);
            if (e >= 0) {
                const float ts = __ldg(tensor_scale + e);
                wt = load_routing_weight<DT, WT>(weights, s);
                float ys = 0.0f;
                for (int v = 0; v < min(NW, items); ++v) ys += __uint_as_float(lds32(slice_of(buf, s, v) + 4u * r));
                y = bits_to_f32<DT>(f32_to_bits<DT>(ys * ts));
            }
            sts32(slice_of(buf, s, 0) + 4u * r, __float_as_uint(y));
            sts32(slice_of(buf, s, 1) + 4u * r, __float_as_uint(wt));
        }
        block_barrier();
        const int n = ((int)blockIdx.x + m * (int)gridDim.x) * kRowsPerUnit + (int)threadIdx.x;
        if (threadIdx.x < kRowsPerUnit) {
            float total = 0.0f;
            for (int s2 = 0; s2 < slots; ++s2)
                total = fmaf(__uint_as_float(lds32(slice_of(buf, s2, 1) + 4u * threadIdx.x)),
                             __uint_as_float(lds32(slice_of(buf, s2, 0) + 4u * threadIdx.x)), total);
            if (n < N) out[n] = f32_to_bits<DT>(total);
        }
    };

    if (per == 0) {  // no items: meet every unit's barrier
        for (int m = 0; m < mine; ++m) finish(m);
        return;
    }
    const int n_items = mine * per;
    Sub<BITS> ring[D];
    Pos lp = start;  // the next item to load
#pragma unroll
    for (int d = 0; d < D; ++d) {
        zero_sub<BITS>(ring[d]);
        if (d < n_items) {
            load_item(ring[d], lp);
            next(lp);
        }
    }
    float acc[1][4] = {};
    Pos cp = start;  // the item to compute
    for (int ib = 0; ib < n_items; ib += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int i = ib + d;
            if (i >= n_items) break;
            if (cp.k == 0) zero_slices(cp.m);
            const bool ok = expert_of(cp.s) >= 0;
            u32 bx[1][16];
            // a slot without an expert has no h row: x stays zero (M = 0 loads nothing)
            kbit_decode::load_x<1>(bx, h + (long long)cp.s * K, ok ? 1 : 0, K, 0, cp.c * 128 + 32 * t, g);
            Prepped<BITS> o;
            kbit_decode::prep<BITS, PAIRS>(ring[d], o, win.stab);
            if (i + D < n_items) {  // the planes are consumed: refill
                load_item(ring[d], lp);
                next(lp);
            }
            kbit_decode::lookup_mma<BITS, DT, 1, PAIRS>(o, bx, acc, win.lanebase, win.lut);
            const bool unit_ends = cp.k == per - 1;
            if (unit_ends || ds > 0 || cp.c + dc >= kc) {  // the warp's last item of slot s in this unit
                if (t == 0) {
                    const u32 slice = slice_of(win.rest + (u32)(cp.m & 1) * buffer, cp.s, w);
                    sts32(slice + 4u * g, __float_as_uint(acc[0][0]));  // column 0 (x's row): rows g, g + 8
                    sts32(slice + 4u * (g + 8), __float_as_uint(acc[0][2]));
                }
#pragma unroll
                for (int v = 0; v < 4; ++v) acc[0][v] = 0.0f;
            }
            if (unit_ends) finish(cp.m);
            next(cp);
        }
    }
}

}  // namespace kbit_token

using kbit_token::kbit_token_down;
using kbit_token::kbit_token_gate_up;
