// The decode kernel's building blocks for one 16-row group of a kbit weight: predicated loads of
// the plane words (or pair codes) and block scales, the per-lane pair/quad lookup tables, the
// gather of planes into index bytes, and the lookups + scale + mma.m16n8k16 into fp32
// accumulators. decode.cu (the small-M GEMM, dense and grouped) and experts_token.cu (one token
// through a mixture-of-experts layer) are built from them.
//
// Storage and lane layout (decode.cu's header draws them in full):
//   packed[kt][nt][c][kb][b]  u32  bit-plane b of block (n = 128*nt + c, k = 64*kt + 32*kb .. +31)
//   absmax[kt][nt][c][kb]     u8   E4M4 code of that block
//   A warp takes one row group (16 consecutive rows) and one 128-wide chunk of k at a time:
//   lane (g = lane/4, t = lane%4) holds rows g and g+8 and the 32 in-features of block t of the
//   chunk (t = 0,1: k-tile 2c, t = 2,3: k-tile 2c+1); x is the n8 side of the mma (rows of x as
//   its columns), 64 contiguous bytes of one x row per lane and chunk.
//
// Half-precision values travel as raw bits; no system headers (NVRTC and nvcc both build it).
#pragma once

#include "common.cuh"  // u32/u16/u8, KBIT_F16/KBIT_BF16, conversions, mul2, mma_16816, e4m4_decode

namespace kbit_decode {

// ---------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------

// Predicated loads (one instruction each; no branch). The weight loads keep the registers'
// old contents when off: whatever bits they hold are valid indices, and the scale byte of an
// absent block is set to 0, so it adds exact zeros.
// Streaming loads of the weight planes: read once, keep them out of L1.
KBIT_DEVICE void ldg_stream(u32 (&v)[4], const u32* p, bool on) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n"
                 " @q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "+r"(v[0]), "+r"(v[1]), "+r"(v[2]), "+r"(v[3])
                 : "l"(p), "r"((int)on));
}
KBIT_DEVICE void ldg_stream(u32 (&v)[2], const u32* p, bool on) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %3, 0;\n @q ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n}"
                 : "+r"(v[0]), "+r"(v[1])
                 : "l"(p), "r"((int)on));
}
// Word loads that do allocate in L1: the BITS = 3 / 5 planes of one block are not 16-byte
// aligned, so a lane reads them word by word and neighbouring words come from L1.
KBIT_DEVICE void ldg_word(u32& v, const u32* p, bool on) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n @q ld.global.nc.u32 %0, [%1];\n}" : "+r"(v) : "l"(p), "r"((int)on));
}
KBIT_DEVICE u32 ldg_byte_or0(const u8* p, bool on) {
    u32 v;
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %2, 0;\n mov.u32 %0, 0;\n @q ld.global.nc.u8 %0, [%1];\n}"
                 : "=r"(v)
                 : "l"(p), "r"((int)on));
    return v;
}
// 16 bytes of x, or zeros when off.
KBIT_DEVICE void ldg_x16_or0(u32 (&v)[4], const u16* p, bool on) {
    asm volatile("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.u32 %0, 0;\n mov.u32 %1, 0;\n mov.u32 %2, 0;\n"
                 " mov.u32 %3, 0;\n @q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                 : "l"(p), "r"((int)on));
}

// A word from L2, never from this SM's L1 (which may hold a copy older than the last kernel's
// stores when read before grid_dependency_wait()).
KBIT_DEVICE u32 ldg_cg_word(const void* p) {
    u32 v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

// Orders this thread's earlier memory operations before its later ones for the whole GPU
// (lighter than __threadfence's sequentially consistent fence, and all the split-K protocol needs).
KBIT_DEVICE void fence_acq_rel_gpu() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}


// (a & mask) | (b & ~mask) in one lop3 (the compiler splits the C++ form into two).
KBIT_DEVICE u32 bsel(u32 a, u32 b, u32 mask) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
    return d;
}

// Shared-memory accesses by 32-bit shared-window address (no generic-address arithmetic). The
// kernel reaches all its shared memory this way (compute-sanitizer's racecheck mis-attributed
// addresses when the table was written through generic pointers and the reduction slots by
// window address).
KBIT_DEVICE u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
KBIT_DEVICE uint2 lds64(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}
KBIT_DEVICE void sts32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
KBIT_DEVICE void sts128(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// The reduction's control words, all through atomics: a warp polls `gen` while another
// writes it (plain or volatile accesses there are a race to compute-sanitizer's racecheck).
KBIT_DEVICE int atoms_add(u32 addr, int v) {
    int old;
    asm volatile("atom.shared.add.s32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
    return old;
}
KBIT_DEVICE void atoms_exch(u32 addr, int v) {
    int old;
    asm volatile("atom.shared.exch.b32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
}

// ---------------------------------------------------------------------------------------
// per-BITS decode tables
// ---------------------------------------------------------------------------------------
// Lookup table geometry: entry `idx`, copy of lane l at byte idx * kStride + l * kEntryBytes.
// BITS 2..4: the row stride is 256 and the table starts on a 64 KiB boundary of the shared
// window, so the address is the lane base with its byte 1 replaced by the index: one prmt.
// BITS 5 (a 10-bit index): stride 128 and one integer multiply-add (from planes), or one lop3
// and an add (from pair codes, whose 10-bit pair is the index itself).
template <int BITS> struct Lut {
    static constexpr int kIdxBits = BITS == 2 ? 8 : (BITS == 3 ? 6 : (BITS == 4 ? 8 : 10));
    static constexpr int kEntryBytes = BITS == 2 ? 8 : 4;  // a quad (two half2) or a pair (half2)
    static constexpr int kStride = BITS == 5 ? 128 : 256;
    static constexpr int kBytes = (1 << kIdxBits) * kStride;
    static constexpr int kAlign = BITS == 5 ? 128 : 65536;
    // dynamic shared memory: worst-case alignment padding + table + 256-entry scale table
    static constexpr int kSmem = (kAlign > 128 ? kAlign : 0) + kBytes + 1024;
};

// Codebook indices encoded by a table index (see the gather functions for the bit layout; with
// 5-bit pair codes, PAIRS, the index is the pair code itself: first | second << 5).
template <int BITS, bool PAIRS> KBIT_DEVICE void lut_indices(u32 idx, u32 (&e)[4]) {
    if constexpr (BITS == 5 && PAIRS) {
        e[0] = idx & 31u;
        e[1] = idx >> 5;
        e[2] = e[3] = 0;
    } else if constexpr (BITS == 2) {
        // bit j = plane 0 of weight j, bit 4+j = plane 1 of weight j (j = 0..3)
#pragma unroll
        for (int j = 0; j < 4; ++j) e[j] = ((idx >> j) & 1u) | (((idx >> (4 + j)) & 1u) << 1);
    } else {
        // bit 2b = plane b of the first weight, bit 2b+1 = plane b of the second (b < 4);
        // BITS = 5: bits 8 and 9 = plane 4 of the first and second weight.
        u32 lo = 0, hi = 0;
#pragma unroll
        for (int b = 0; b < (BITS < 4 ? BITS : 4); ++b) {
            lo |= ((idx >> (2 * b)) & 1u) << b;
            hi |= ((idx >> (2 * b + 1)) & 1u) << b;
        }
        if constexpr (BITS == 5) {
            lo |= ((idx >> 8) & 1u) << 4;
            hi |= ((idx >> 9) & 1u) << 4;
        }
        e[0] = lo;
        e[1] = hi;
        e[2] = e[3] = 0;
    }
}

// Fill the pair/quad table (at shared address `lut`) and the scale table (at `stab`: E4M4 code
// -> half2 of the block scale); NTHREADS threads, thread tid passes codebook entry
// tid % 2^BITS as `cb`. Each thread forms one entry's value (codebook entries gathered with
// shuffles, so all lanes of a warp run every round) and stores it into its share of the entry's
// 32 lane copies: kPer threads per entry (more entries than threads: one thread per entry and
// several rounds). A thread's 16-byte stores are rotated by the entry index, so the lanes of a
// warp spread over every bank.
template <int BITS, int DT, int NTHREADS, bool PAIRS>
KBIT_DEVICE void build_tables(u32 lut, u32 stab, float cb, int tid) {
    using L = Lut<BITS>;
    const u32 cbh = pack2<DT>(cb, 0.0f);
    constexpr int kEntries = 1 << L::kIdxBits;
    constexpr int kVecPerRow = 32 * L::kEntryBytes / 16;  // 16-byte stores per table row
    constexpr int kPer = table_threads_per_entry(NTHREADS, kEntries, kVecPerRow);
    static_assert(NTHREADS % 32 == 0 && kVecPerRow % kPer == 0, "whole warps; threads share a row evenly");
    constexpr int kVecsEach = kVecPerRow / kPer;
    constexpr int kSlots = kEntries * kPer;  // (entry, share) pairs
#pragma unroll
    for (int s0 = 0; s0 < kSlots; s0 += NTHREADS) {
        const int s = s0 + tid;
        const u32 idx = (u32)min(s, kSlots - 1) / kPer;
        const u32 share = (u32)s % kPer;
        u32 e[4];
        lut_indices<BITS, PAIRS>(idx, e);
        const u32 w0 = __shfl_sync(0xffffffffu, cbh, (int)e[0]) | (__shfl_sync(0xffffffffu, cbh, (int)e[1]) << 16);
        u32 w1 = w0;
        if constexpr (BITS == 2) w1 = __shfl_sync(0xffffffffu, cbh, (int)e[2]) | (__shfl_sync(0xffffffffu, cbh, (int)e[3]) << 16);
        // two lanes' copies of a quad, or four lanes' copies of a pair
        const uint4 val = make_uint4(w0, w1, w0, w1);
        if (s < kSlots) {
#pragma unroll
            for (int i = 0; i < kVecsEach; ++i) {
                const u32 vec = (share * kVecsEach + (u32)i + idx) % kVecPerRow;
                sts128(lut + idx * L::kStride + vec * 16, val);
            }
        }
    }
    for (int c = tid; c < 256; c += NTHREADS) {
        const float sc = e4m4_decode((u32)c);
        sts32(stab + 4 * c, pack2<DT>(sc, sc));
    }
}

// Gather: plane words of one 32-weight block -> index bytes. q[j] byte m = the pair of weights
// (8m + 2j, 8m + 2j + 1) for BITS = 3, 4, 5 (r[j] byte m: their plane-4 bits, BITS = 5), or
// the quad (8m + 4j .. 8m + 4j + 3) for BITS = 2 (j = 0, 1).
template <int BITS> KBIT_DEVICE void gather(const u32 (&p)[BITS], u32 (&q)[4], u32 (&r)[4]) {
    if constexpr (BITS == 2) {
        q[0] = bsel(p[0], p[1] << 4, 0x0F0F0F0Fu);
        q[1] = bsel(p[0] >> 4, p[1], 0x0F0F0F0Fu);
    } else {
        // nibble i of A: planes 0, 1 of weights (4i, 4i+1); of A2: of weights (4i+2, 4i+3)
        const u32 A = bsel(p[0], p[1] << 2, 0x33333333u);
        const u32 A2 = bsel(p[0] >> 2, p[1], 0x33333333u);
        if constexpr (BITS == 3) {
            // plane 2 of the pair goes to bits 4, 5 of the byte; bits 6, 7 stay zero (64 entries)
            q[0] = (A & 0x0F0F0F0Fu) | ((p[2] << 4) & 0x30303030u);
            q[1] = (A2 & 0x0F0F0F0Fu) | ((p[2] << 2) & 0x30303030u);
            q[2] = ((A >> 4) & 0x0F0F0F0Fu) | (p[2] & 0x30303030u);
            q[3] = ((A2 >> 4) & 0x0F0F0F0Fu) | ((p[2] >> 2) & 0x30303030u);
        } else {
            // the same for planes 2, 3 in the high nibble of each byte
            const u32 B = bsel(p[2], p[3] << 2, 0x33333333u);
            const u32 B2 = bsel(p[2] >> 2, p[3], 0x33333333u);
            q[0] = bsel(A, B << 4, 0x0F0F0F0Fu);
            q[1] = bsel(A2, B2 << 4, 0x0F0F0F0Fu);
            q[2] = bsel(A >> 4, B, 0x0F0F0F0Fu);
            q[3] = bsel(A2 >> 4, B2, 0x0F0F0F0Fu);
            if constexpr (BITS == 5) {
#pragma unroll
                for (int j = 0; j < 4; ++j) r[j] = (p[4] >> (2 * j)) & 0x03030303u;
            }
        }
    }
}

// Shared-memory address of the table entry for mma step s (0..7), half h (0: a0/a1, 1: a2/a3;
// BITS = 2 returns both halves from one quad, h unused). `lanebase` = table base + lane * entry
// bytes (table base 64 KiB aligned for BITS <= 4), `tbase` = the table base (the same in every
// thread).
template <int BITS, bool PAIRS>
KBIT_DEVICE u32 lut_addr(const u32 (&q)[4], const u32 (&r)[4], int s, int h, u32 lanebase, u32 tbase) {
    const u32 m = (u32)(s >> 1);  // index byte within the word
    if constexpr (BITS == 5 && PAIRS) {
        // the pair (8m + 2j, 8m + 2j + 1) is the 10-bit code at 10m of lane group j = (r[j] : q[j]);
        // shifted to bit 7 (the row stride), masked and merged with the lane's copy in one lop3,
        // plus the table base (a uniform register, which the shared load can add itself)
        static_assert(Lut<BITS>::kStride == 128, "row stride 2^7");
        const int j = 2 * (s & 1) + h;
        const u32 x = m == 0 ? q[j] << 7 : funnel_r(q[j], r[j], 10u * m - 7u);
        return and_or(x, 0x3ffu << 7, lanebase - tbase) + tbase;
    } else if constexpr (BITS == 5) {
        const int j = 2 * (s & 1) + h;
        // [q byte m, r byte m, 0, 0] (sign-replicating r byte m < 0x80 gives zero bytes)
        const u32 idx = prmt(q[j], r[j], m | ((4u + m) << 4) | ((12u + m) << 8) | ((12u + m) << 12));
        return idx * (u32)Lut<BITS>::kStride + lanebase;
    } else {
        const u32 word = BITS == 2 ? q[s & 1] : q[2 * (s & 1) + h];
        // [lanebase byte 0, word byte m, lanebase byte 2, lanebase byte 3]
        return prmt(word, lanebase, 0x7604u | (m << 4));
    }
}

// ---------------------------------------------------------------------------------------
// one row group: loads, decode, mma
// ---------------------------------------------------------------------------------------

// Shared-memory windows of a block's tables: the pair/quad table on its alignment boundary, the
// 256-entry scale table after it, then what the kernel keeps beside them (`rest`, 4-byte
// aligned); `lanebase` is this lane's copy in the pair/quad table. Kernels size their dynamic
// shared memory as Lut<BITS>::kSmem plus their own part.
template <int BITS> struct TableWindows {
    u32 lut, stab, rest, lanebase;
    KBIT_DEVICE explicit TableWindows(const void* smem) {
        using L = Lut<BITS>;
        const u32 win = (u32)__cvta_generic_to_shared(smem);
        lut = (win + (u32)(L::kAlign - 1)) & ~(u32)(L::kAlign - 1);
        stab = lut + (u32)L::kBytes;
        rest = stab + 1024u;
        lanebase = lut + (u32)(threadIdx.x & 31) * L::kEntryBytes;
    }
};

// Where this lane's block of row group `rg` (rows 16 rg + g and + 8, block t) in chunk c of a
// weight sits: its plane words and scale byte, and whether it exists (k-tile 2c + t/2 <
// k_tiles; a missing one points into the last k-tile, so the address stays inside the weight).
// The address is a sum of parts (words of the planes, bytes of the scales) that kernels walking
// many blocks keep apart: the row group's (rows_words / rows_bytes: tile column rg / 8, rows
// 16 (rg % 8) on) and the chunk's and lane's together (BlockAt::LaneChunks).
template <int BITS> struct BlockAt {
    static constexpr u32 kTileWords = 256 * BITS, kTileBytes = 256;
    KBIT_DEVICE static u32 rows_words(int rg) { return (u32)(rg >> 3) * kTileWords + (u32)(rg & 7) * (32 * BITS); }
    KBIT_DEVICE static u32 rows_bytes(int rg) { return (u32)(rg >> 3) * kTileBytes + (u32)(rg & 7) * 32u; }

    // This lane's part (k-tile t / 2 of the chunk, row g, block t % 2) and a chunk's (two k-tiles),
    // computed once per kernel.
    struct LaneChunks {
        u32 lane_w, lane_a, chunk_w, chunk_a;
        int t;
        KBIT_DEVICE LaneChunks(int t_, int g, int n_tiles)
            : lane_w((u32)(t_ >> 1) * (u32)n_tiles * kTileWords + (u32)(2 * g + (t_ & 1)) * BITS),
              lane_a((u32)(t_ >> 1) * (u32)n_tiles * kTileBytes + (u32)(2 * g + (t_ & 1))),
              chunk_w(2u * (u32)n_tiles * kTileWords), chunk_a(2u * (u32)n_tiles * kTileBytes), t(t_) {}
        // Chunk c's and this lane's part of the address in w / a, and whether the block exists
        // (false only for t >= 2 in a last, half chunk: then 0, an address inside the weight).
        KBIT_DEVICE bool at(int c, int k_tiles, u32& w, u32& a) const {
            const bool on = 2 * c + (t >> 1) < k_tiles;
            w = on ? (u32)c * chunk_w + lane_w : 0u;
            a = on ? (u32)c * chunk_a + lane_a : 0u;
            return on;
        }
    };

    const u32* pw;
    const u8* pa;
    bool on;
    KBIT_DEVICE BlockAt(const u32* packed, const u8* absmax, int rg, int c, int t, int g, int k_tiles, int n_tiles) {
        // = rows + chunk + lane parts (the kt clamp aside), in the form the decode kernel's code was tuned with
        const int n0 = rg * 16 + g;
        const int kt = 2 * c + (t >> 1);
        on = kt < k_tiles;
        const long long tile = (long long)min(kt, k_tiles - 1) * n_tiles + (n0 >> 7);
        pw = packed + tile * kTileWords + ((n0 & 127) * 2 + (t & 1)) * BITS;
        pa = absmax + tile * kTileBytes + (n0 & 127) * 2 + (t & 1);
    }
};

// Plane words and scale codes of one row group (this lane's two rows, one block) in flight.
template <int BITS> struct Sub {
    u32 p[2][BITS];
    u32 a[2];
};

template <int BITS> KBIT_DEVICE void load_sub(Sub<BITS>& d, const u32* __restrict__ pw, const u8* __restrict__ pa, bool ok) {
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
        const u32* src = pw + rho * 16 * BITS;  // row c + 8: 8 columns x 2 blocks x BITS words further
        if constexpr (BITS == 4 || BITS == 2) {
            ldg_stream(d.p[rho], src, ok);
        } else {
#pragma unroll
            for (int b = 0; b < BITS; ++b) ldg_word(d.p[rho][b], src + b, ok);
        }
        d.a[rho] = ldg_byte_or0(pa + rho * 16, ok);
    }
}

// B fragments of one chunk for this lane: x row (8j + g), in-features k0 .. k0+31; rows ld
// elements apart (K, or 0 where every row is one token's x). K is a multiple of 8 and x 16-byte
// aligned (the host pads), so each 16-byte piece is all in or all out; pieces past K are zero.
// Rows past M are zero too (only their own output columns would see them, and those are not
// stored).
template <int MT>
KBIT_DEVICE void load_x(u32 (&bx)[MT][16], const u16* __restrict__ x, int M, int K, int ld, int k0, int g) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        const int m = 8 * j + g;
        const u16* src = x + (size_t)max(min(m, M - 1), 0) * ld + k0;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            u32 t4[4];
            ldg_x16_or0(t4, src + 8 * v, m < M && k0 + 8 * v < K);
#pragma unroll
            for (int e = 0; e < 4; ++e) bx[j][4 * v + e] = t4[e];
        }
    }
}

// First half of a row group's decode: index bytes and block scales. After this the plane
// registers are free, so the caller refills them with the next loads right away.
template <int BITS> struct Prepped {
    u32 q[2][4], r[2][4], s2[2];
};
// PAIRS: the words are pair codes (docs/format.md, section 7a), which are the index bytes
// already: word j byte m = the pair (8m + 2j, 8m + 2j + 1) at 4 bits; at 5 bits that pair is the
// 10-bit code at 10m of lane group j, (byte 16 + j : word j), kept as q[j] and r[j].
template <int BITS, bool PAIRS> KBIT_DEVICE void prep(const Sub<BITS>& d, Prepped<BITS>& o, u32 stab) {
    static_assert(!PAIRS || BITS >= 4, "pair codes are 4- and 5-bit");
#pragma unroll
    for (int rho = 0; rho < 2; ++rho) {
        if constexpr (PAIRS && BITS == 5) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                o.q[rho][j] = d.p[rho][j];
                o.r[rho][j] = d.p[rho][4] >> (8 * j);
            }
        } else if constexpr (PAIRS) {
#pragma unroll
            for (int j = 0; j < 4; ++j) o.q[rho][j] = d.p[rho][j];
        } else {
            gather<BITS>(d.p[rho], o.q[rho], o.r[rho]);
        }
        o.s2[rho] = lds32(stab + d.a[rho] * 4u);
    }
}

// Second half: table lookups, block scale, and the mma into acc.
template <int BITS, int DT, int MT, bool PAIRS>
KBIT_DEVICE void lookup_mma(const Prepped<BITS>& o, const u32 (&bx)[MT][16], float (&acc)[MT][4], u32 lanebase, u32 tbase) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        u32 w[2][2];  // [row][h]
#pragma unroll
        for (int rho = 0; rho < 2; ++rho) {
            if constexpr (BITS == 2) {
                const uint2 v = lds64(lut_addr<BITS, PAIRS>(o.q[rho], o.r[rho], s, 0, lanebase, tbase));
                w[rho][0] = mul2<DT>(v.x, o.s2[rho]);
                w[rho][1] = mul2<DT>(v.y, o.s2[rho]);
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 v = lds32(lut_addr<BITS, PAIRS>(o.q[rho], o.r[rho], s, h, lanebase, tbase));
                    w[rho][h] = mul2<DT>(v, o.s2[rho]);
                }
            }
        }
        const u32 a[4] = {w[0][0], w[1][0], w[0][1], w[1][1]};
#pragma unroll
        for (int j = 0; j < MT; ++j) mma_16816<DT>(acc[j], a, bx[j][2 * s], bx[j][2 * s + 1]);
    }
}

}  // namespace kbit_decode
