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
// the kernel
// ---------------------------------------------------------------------------------------

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
        const int n0 = lrg0 * 16 + g;
        const int kt = 2 * ch + (t >> 1);
        khi = kt < k_tiles;
        const long long tile = (long long)min(kt, k_tiles - 1) * n_tiles + (n0 >> 7);
        pw = packed + tile * (256 * BITS) + ((n0 & 127) * 2 + (t & 1)) * BITS;
        pa = absmax + tile * 256 + (n0 & 127) * 2 + (t & 1);
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
    using L = Lut<BITS>;
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
    const u32 win = (u32)__cvta_generic_to_shared(smem);
    const u32 lut_win = (win + (u32)(L::kAlign - 1)) & ~(u32)(L::kAlign - 1);
    const u32 stab_win = lut_win + (u32)L::kBytes;
    const u32 lanebase = lut_win + (u32)lane * L::kEntryBytes;
    using Slot = RedSlot<KS, R, MT>;
    const u32 slots_win = stab_win + 1024u;                              // Slot [2][NWR]
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
