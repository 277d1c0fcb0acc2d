// Dequantization of the tiled kbit weight straight into mma fragments, shared by the
// tensor-core GEMMs (gemm.cu: the B operand of mma.sync; gemm_sm90.cu: the register A operand of
// wgmma). Both fragments give a lane the same weights of a (column, 32-block): the index pairs at
// block positions 2i + 8j, 2i + 8j + 1 (i = lane % 4, j = 0..3), i.e. rows {2i, 2i+1, 2i+8, 2i+9}
// of each of the block's two k16 steps.
//
// Tables in shared memory (built once per block by build_dequant_tables):
//   pair table (BITS <= 4): 4^BITS entries x 32 bank-private copies of u32: entry e (lo index bits
//     at even positions, hi at odd) = (codebook[lo], codebook[hi]) as a packed pair, copy l in
//     bank l so the 32 lanes of a warp never conflict;
//   scale table: 256 u32, E4M4 code -> its value as a packed pair (exact in fp16 and bf16).
// BITS = 5 uses no pair table: each lane keeps codebook[lane] in a register (cb_reg) and lanes
// fetch entries with shfl.
//
// Weight words of a block: BITS bit-planes, or with PAIRS its pair codes (docs/format.md, section
// 7a), which need no gather:
//   BITS = 4: word i is exactly the `pairs` word that lane i would gather from the planes;
//   BITS = 5: lane quad i's eight indices are the 40-bit group (byte 16 + i : word i), index k
//             at bits 5k (k = 2j: row 2i + 8j, k = 2j + 1: row 2i + 8j + 1), so each is one
//             shift away from the shuffle's source-lane operand (which reads the low 5 bits).
#pragma once
#include "common.cuh"

namespace kbit {

// Bytes of the pair table for BITS (0 for BITS = 5).
template <int BITS>
constexpr int pair_table_bytes() {
    return BITS <= 4 ? (1 << (2 * BITS)) * 32 * 4 : 0;
}

// Fills the pair table (BITS <= 4) and the scale table; returns this lane's codebook register
// for BITS = 5 (0 otherwise). Every thread of the block calls it (the shuffles need whole warps),
// THREADS of them; the caller synchronizes before the tables are read.
template <int BITS, int DT, int THREADS>
__device__ __forceinline__ u32 build_dequant_tables(u8* lut_bytes, u32* scale_tab, const float* codebook) {
    static_assert(THREADS % 32 == 0, "whole warps");
    const int tid = threadIdx.x, lane = tid & 31;
    // Each lane holds codebook[lane] (entries past 2^BITS are never selected).
    const float cb_f32 = lane < (1 << BITS) ? codebook[lane] : 0.f;
    u32 cb_reg = 0;
    if constexpr (BITS <= 4) {
        // Each thread forms one entry (index bits, two shuffles) and stores its share of the
        // entry's 8 16-byte pieces (4 copies each): kPer threads per entry
        // (table_threads_per_entry). The pieces are rotated by the entry index so that a warp's
        // stores cover every bank.
        constexpr int ENTRIES = 1 << (2 * BITS);
        constexpr int kPer = table_threads_per_entry(THREADS, ENTRIES, 8);
        constexpr int kPieces = 8 / kPer;  // per thread
        constexpr int SLOTS = ENTRIES * kPer;
        u32* lut = reinterpret_cast<u32*>(lut_bytes);
#pragma unroll
        for (int r = 0; r < (SLOTS + THREADS - 1) / THREADS; ++r) {
            const int slot = r * THREADS + tid;
            const int e = (slot < SLOTS ? slot : SLOTS - 1) / kPer;
            const int share = slot % kPer;
            int lo = 0, hi = 0;
#pragma unroll
            for (int b = 0; b < BITS; ++b) {
                lo |= ((e >> (2 * b)) & 1) << b;
                hi |= ((e >> (2 * b + 1)) & 1) << b;
            }
            // all lanes shuffle (convergent), only in-range slots store
            const float vlo = __uint_as_float(shfl_idx(__float_as_uint(cb_f32), lo));
            const float vhi = __uint_as_float(shfl_idx(__float_as_uint(cb_f32), hi));
            const u32 v = pack2<DT>(vlo, vhi);
            if (slot < SLOTS) {
#pragma unroll
                for (int i = 0; i < kPieces; ++i) {
                    const int piece = (share * kPieces + i + e) & 7;
                    *reinterpret_cast<uint4*>(lut + e * 32 + piece * 4) = make_uint4(v, v, v, v);
                }
            }
        }
    } else {
        cb_reg = f32_to_bits<DT>(cb_f32);
    }
    for (int code = tid; code < 256; code += THREADS) {
        const u32 h = f32_to_bits<DT>(e4m4_decode(code));
        scale_tab[code] = h | (h << 16);
    }
    return cb_reg;
}

// The words of one (column, 32-block) from shared memory that lane quad i decodes: the BITS
// planes, as wide as alignment allows, or (PAIRS) its pair-code word i in w[0] (and at BITS = 5
// its byte 16 + i in w[1]).
template <int BITS, bool PAIRS>
__device__ __forceinline__ void load_block(u32 (&w)[BITS], const u32* p, u32 i) {
    static_assert(!PAIRS || BITS >= 4, "pair codes are 4- and 5-bit");
    if constexpr (PAIRS) {
        w[0] = p[i];
        if constexpr (BITS == 5) w[1] = reinterpret_cast<const u8*>(p)[16 + i];
    } else if constexpr (BITS == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (BITS == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
#pragma unroll
        for (int b = 0; b < BITS; ++b) w[b] = p[b];
    }
}

// Dequantizes the 8 weights of one lane in one (column, 32-block) into four fragment
// registers: out[j] holds rows (2i + 8j, 2i + 8j + 1) as a packed pair, already times the block
// scale `s2` (both halves). j = 0, 1 are b0, b1 of the first k16 step; j = 2, 3 of the second.
// lut: the pair table (BITS <= 4); lane4 = 4 * lane selects this lane's bank-private copy;
// w: what load_block<BITS, PAIRS> loaded for this lane.
template <int BITS, int DT, bool PAIRS>
__device__ __forceinline__ void dequant_block(const u32 (&w)[BITS], u32 i, u32 s2, const u8* lut, u32 lane4, u32 cb_reg,
                                              u32 (&out)[4]) {
    if constexpr (BITS <= 4) {
        u32 pairs = 0;
        if constexpr (PAIRS) {
            pairs = w[0];
        } else {
#pragma unroll
            for (int b = 0; b < BITS; ++b) pairs |= rotr(w[b], 2 * i - 2 * b) & (0x03030303u << (2 * b));  // rotr: mod 32
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // byte j of `pairs` times 128 (32 copies x 4 bytes), plus this lane's copy
            const u32 off = and_or(j == 0 ? pairs << 7 : pairs >> (8 * j - 7), 0x7f80u, lane4);
            out[j] = mul2<DT>(*reinterpret_cast<const u32*>(lut + off), s2);
        }
    } else if constexpr (PAIRS) {
        // index k of the lane's group at bits 5k of (w[1]:w[0]); the shuffle ignores the bits above
        u32 idx[8];
#pragma unroll
        for (int k = 0; k < 6; ++k) idx[k] = w[0] >> (5 * k);
        idx[6] = funnel_r(w[0], w[1], 30);
        idx[7] = w[1] >> 3;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 lo = shfl_idx(cb_reg, idx[2 * j]);
            const u32 hi = shfl_idx(cb_reg, idx[2 * j + 1]);
            out[j] = mul2<DT>(prmt(lo, hi, 0x5410u), s2);
        }
    } else {
        u32 even = 0, odd = 0;
#pragma unroll
        for (int b = 0; b < BITS; ++b) {
            even |= rotr(w[b], 2 * i - b) & (0x01010101u << b);  // rotr: mod 32
            odd |= rotr(w[b], 2 * i + 1 - b) & (0x01010101u << b);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 lo = shfl_idx(cb_reg, even >> (8 * j));
            const u32 hi = shfl_idx(cb_reg, odd >> (8 * j));
            out[j] = mul2<DT>((lo & 0xffffu) | (hi << 16), s2);
        }
    }
}

}  // namespace kbit
