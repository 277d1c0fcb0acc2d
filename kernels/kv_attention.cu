// Decode attention over the mixed-precision KV cache (kbit_linear/kv_format.py is the spec):
// every cached token of a batch row sits in one of four buckets (2, 3, 4 or 8 bits), and one
// pass reads each bucket's packed codes and scales where they lie, with an online softmax.
//
// Kernels, one stream:
//   kbit_kv_offsets  per (row, key block of `bs` positions) where each bucket's entries of that
//                    block start, relative to the row's start in the bucket, over the key blocks
//                    that have ranges (later positions are all 8-bit). Only when widths change:
//                    the cache keeps the result between decode steps.
//   kbit_kv_decode   grid (split, kv head x row chunk or kv head pair, batch row): a block takes
//                    one kv head's rows, or (PAIR, where a head has at most 4 query rows) two
//                    heads' side by side, so that one tile's copy and softmax serve both; it takes the key blocks
//                    [split * kbps - shift, (split + 1) * kbps - shift) of its row, clamped to
//                    [0, nblk) (the first split `shift` short: its key block 0 holds the sinks'
//                    extra 8-bit tile, so the block that has it gets fewer others); a key block's entries are
//                    taken per bucket a tile at a time (16 entries; kMaxTile = 32 gives tiles
//                    of up to 32 below 8 bits); its 4 warps take every 4th key
//                    block whole or, for short splits, every 4th tile of each key block (Cursor),
//                    streamed through a per-warp ring of cp.async stages. It writes the split's
//                    unnormalized output, max and sum (flash-decoding) and, for the mass, the
//                    logits (fp16).
//   kbit_kv_combine  merges the splits into the output; for short grids its launch also takes
//                    the mass (blocks past the query rows', each forming its rows' max and sum).
//   kbit_kv_mass     each position's attention mass (the allocator's signal) from the logits,
//                    for larger grids.
//
// In-place mode (a replayable cache: the launches of a decode step are the same every step, so a
// CUDA graph can replay them): the live length comes from the device (`live_len`, read after the
// dependency wait) instead of the arguments, the key blocks past it are empty splits, rows of the
// tier, logits and bias are `ld` apart (buffers with room for the epoch), the 8-bit entries are
// a store's (row b's from b * capacity: rs8 = b * capacity), and the step records the mass only
// when the device call counter says so ((calls - 1) % interval == 0: the counter is advanced
// before the attention). The mass kernel then adds the step's mass and the query heads that saw
// each position into the running sums in place. With live_len == nullptr every launch is as
// before (ld = S, the mass written, not added).
//
// Query rows: a kv head serves G query heads and Q queries, rows r = j * Q + i (head h*G + j,
// query i), 8 rows per block (one n8 fragment; row chunks for G*Q > 8; PAIR: rows 0-3 head h, 4-7 h + 1). Tokens are the M side of
// both tensor-core products (fp16 operands, fp32 accumulators; lane = 4g + t), 16 tokens a
// fragment, one or two fragments a tile; the products below are per fragment:
//
//   logits^T [16 tokens x 8 rows] += K [16 tokens x 16 ch] * Q'^T [16 ch x 8 rows]   (D/16 steps)
//        A: key codes, lane (g, t) decodes tokens g and g+8, its quarter of the channels (chunk t)
//        B: Q' = q * key range of the key block (lower widths) or q (8-bit keys), in registers
//   out^T    [16 ch x 8 rows]    += V^T [16 ch x 16 tokens] * P'^T [16 tokens x 8 rows]
//        A: value codes, lane (g, t) decodes tokens 2t, 2t+1, 2t+8, 2t+9 at channels 8g.. of a
//            64-channel group; one product per (group, pair of channels)
//        B: the probabilities times each token's value scale: the logits' C fragments, packed to
//            fp16 and transposed in registers (movmatrix: an 8 x 8 fp16 transpose across the warp)
//
// Keys below 8 bits decode as min + code * range / levels with one (min, range) per (row, key
// block, head, channel): q . k = (Q' . code) / levels + q . min, so the product runs on the raw
// codes and Q' (and q . min) is formed once per key block. Values: zero + code * scale per
// (token, group): sum_t p v = sum_t (p * scale) code + sum_t p * zero. 8-bit keys and values are
// int8 times a per-(token, group) scale. Codes below 8 bits enter the products as their own bits,
// i.e. the fp16 subnormals code * 2^-24 (exact; the fp32 accumulators are rescaled once).
//
// Channel order inside a product is free as long as A and B agree: lane t's chunk of a key is
// channels [t*D/4, (t+1)*D/4), taken 8 at a time (k16 step j: values s, s+4 and s+1, s+5 of the
// chunk's group j/2, s = 2 (j % 2)): the pairs every width unpacks with a shift and a mask.
// Logits are in log2 units (the scale includes log2 e).
#include "common.cuh"

namespace kbit {
namespace kv {

constexpr int kTiers = 4;    // widths 2, 3, 4, 8 in this order
constexpr int kFrag = 16;    // tokens per m16 fragment
// Bucket entries per tile at most, 16 or 32. With 32, tiles below 8 bits take up to two fragments
// (the softmax, transpose, copy issue and walk step then run once per 32 tokens): 1.04-1.10x at
// 4 bits with batch 8 from 32k tokens or at 128k, 0.85-0.92x otherwise (H200,
// bench/results/kv-attention-kernel.md), and it spills registers at head_dim 128, so 16.
constexpr int kMaxTile = 16;
static_assert(kMaxTile == 16 || kMaxTile == 32, "tiles of one or two fragments");
constexpr int kWarps = 4;    // warps per decode block
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 8;     // query rows per block (one n8 fragment)
constexpr int kGroup = 64;   // channels per value scale group (and 8-bit key scale group)
// tiles in flight per warp (its ring of copy stages): two for every head_dim (more would not fit
// head_dim 256 in an sm_80 block's shared memory)
__host__ __device__ constexpr int stages_for(int) { return 2; }
constexpr int kMaxSplitBlocks = 128;  // key blocks per split at most (the host splits finer)
constexpr u32 kMagic = 0x64006400u;  // fp16 1024 in both halves: 0x6400 | c == 1024 + c

__host__ __device__ constexpr int tier_bits(int tier) { return tier == 3 ? 8 : tier + 2; }
// Entries of a tile at most: 8-bit rows are twice a 4-bit row, so at head_dim 128 and 256 a
// 16-entry 8-bit tile and a 32-entry tile below 8 bits take about the same stage bytes.
__host__ __device__ constexpr int tile_entries(int tier) { return tier == 3 ? kFrag : kMaxTile; }
__host__ __device__ constexpr int round16(int n) { return (n + 15) / 16 * 16; }
__host__ __device__ constexpr int max4(int a, int b, int c, int d) { return (a > b ? a : b) > (c > d ? c : d) ? (a > b ? a : b) : (c > d ? c : d); }

// Heads of a decode block: one, or (PAIR: a kv head's rows fit half the n8 fragment, G * Q <= 4)
// two adjacent kv heads, whose rows take the fragment's halves: rows 0-3 head h, 4-7 head h + 1.
// The two heads' rows of an entry lie side by side in every array ([n, H, ...]), so a tile copies
// them as one row, and one tile's softmax, walk and copy issue serve both heads.
__host__ __device__ constexpr int block_heads(bool pair) { return pair ? 2 : 1; }
constexpr int kHeadRows = kRows / 2;  // rows per head of a PAIR block
// Heads a tile of bucket `tier` holds: 8-bit tiles one (their rows are twice a 4-bit row; the
// walk gives each head of a PAIR block its own 8-bit tile), lower widths the block's heads.
__host__ __device__ constexpr int tile_heads(bool pair, int tier) { return pair && tier != 3 ? 2 : 1; }

// One stage of a warp's copy ring: a tile of one bucket's entries (key rows, value rows, value
// scales, zeros or 8-bit key scales, positions), and for the first tile of a key block that has
// lower widths, that block's key range and minimum (every head of the block). A row holds the
// tile's heads side by side (HT = tile_heads). Row strides per width:
//   key rows    HT * D * bits / 8 bytes, + 16 where a lane's chunk is 32 bytes or more (spreads
//               the k16 reads of two tokens' chunks over the banks: conflict-free at head_dim 128);
//   value rows  HT * D * bits / 8 rounded up to 64, + 16: the four token slots 2t (+1, +8, +9)
//               that a value read takes start 8 banks apart.
//
//   | K [entries][krow] | V [entries][vrow] | ... to KV | VSCALE | VZERO or KSCALE | POS | RANGE | MIN |
template <int D, bool PAIR>
struct Stage {
    static constexpr int GROUPS = D / kGroup;
    static constexpr int HEADS = block_heads(PAIR);
    __host__ __device__ static constexpr int krow(int tier) {
        return tile_heads(PAIR, tier) * D * tier_bits(tier) / 8 + (D * tier_bits(tier) / 32 >= 32 ? 16 : 0);
    }
    __host__ __device__ static constexpr int vrow(int tier) { return (tile_heads(PAIR, tier) * D * tier_bits(tier) / 8 + 63) / 64 * 64 + 16; }
    __host__ __device__ static constexpr int v_at(int tier) { return round16(tile_entries(tier) * krow(tier)); }  // V's offset
    __host__ __device__ static constexpr int kv_end(int tier) { return v_at(tier) + tile_entries(tier) * vrow(tier); }
    static constexpr int K = 0;                                              // u8 [entries][krow]
    static constexpr int KV = round16(max4(kv_end(0), kv_end(1), kv_end(2), kv_end(3)));
    static constexpr int VSCALE = KV;                                        // u16 [kMaxTile][HEADS][GROUPS]
    static constexpr int VZERO = VSCALE + kMaxTile * HEADS * GROUPS * 2;     // u16 [kMaxTile][HEADS][GROUPS] (below 8 bits)
    static constexpr int KSCALE = VZERO;                                     // u16 [kFrag][GROUPS] (8-bit keys, in VZERO's place)
    static constexpr int POS = VZERO + kMaxTile * HEADS * GROUPS * 2;        // int [kMaxTile]
    static constexpr int RANGE = round16(POS + kMaxTile * 4);                // u16 [HEADS][D]
    static constexpr int MIN = RANGE + HEADS * D * 2;                        // u16 [HEADS][D]
    static constexpr int BYTES = round16(MIN + HEADS * D * 2);
};

// Shared memory of the decode block: query rows (fp32), the B fragments of q (shared by the
// warps), the warps' row maxima/sums, the bucket
// offsets of the split's key blocks, and each warp's ring of stages_for(D) copy stages (reused for the
// warps' partial outputs once every tile is done). At head_dim 128, 4 blocks fit in an SM's 228 KiB.
template <int D, bool PAIR>
struct Smem {
    static constexpr int KSTEPS = D / 16;
    static constexpr int Q_ROWS = 0;                                  // float [kRows][D]
    static constexpr int Q_FRAG = Q_ROWS + kRows * D * 4;             // uint2 [KSTEPS][32]
    static constexpr int ML = Q_FRAG + KSTEPS * 32 * 8;               // float [kWarps][kRows][2]
    static constexpr int OFFS = ML + kWarps * kRows * 2 * 4;          // int4 [kMaxSplitBlocks + 1]
    static constexpr int RING = OFFS + (kMaxSplitBlocks + 1) * 16;    // kWarps x stages_for(D) stages
    static constexpr int OUT = RING;                                  // float [kWarps][kRows][D], after the ring's last use
    static constexpr int RING_BYTES = kWarps * stages_for(D) * Stage<D, PAIR>::BYTES;
    static constexpr int OUT_BYTES = kWarps * kRows * D * 4;
    static constexpr int BYTES = RING + (RING_BYTES > OUT_BYTES ? RING_BYTES : OUT_BYTES);
};

KBIT_DEVICE u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
KBIT_DEVICE u32 f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
// The transpose of an 8 x 8 fp16 matrix held as the m8n8 fragment (lane 4 r + c/2: row r,
// columns c, c+1), in the same fragment layout.
KBIT_DEVICE u32 transpose8x8(u32 a) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}
KBIT_DEVICE float half_lo(u32 h) { return bits_to_f32<KBIT_F16>((u16)(h & 0xffffu)); }
// 2^x in one instruction (ex2.approx: 2 ulp; -inf -> 0; results below 2^-126 flush to 0, which
// the probabilities can afford: they are rounded to fp16 next).
KBIT_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// In place, whether this decode step records the mass: the device call counter, advanced before
// the attention, says so every `interval` calls; without a counter (a plain call) always.
KBIT_DEVICE bool recording_call(const int* calls, int interval) { return calls == nullptr || (*calls - 1) % interval == 0; }


// `n` bytes at p (n a multiple of 2 or 3-byte pieces are read bytewise), zero-extended into
// words; `ok` false gives zeros. p's alignment is the largest power of two dividing `align`.
template <int N, int ALIGN>
KBIT_DEVICE void load_bytes(u32 (&w)[(N + 3) / 4], const u8* p, bool ok) {
#pragma unroll
    for (int i = 0; i < (N + 3) / 4; ++i) w[i] = 0;
    if (!ok) return;
    if constexpr (ALIGN % 16 == 0 && N % 16 == 0) {
#pragma unroll
        for (int i = 0; i < N / 16; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    } else if constexpr (ALIGN % 8 == 0 && N % 8 == 0) {
#pragma unroll
        for (int i = 0; i < N / 8; ++i) {
            const uint2 v = reinterpret_cast<const uint2*>(p)[i];
            w[2 * i] = v.x; w[2 * i + 1] = v.y;
        }
    } else if constexpr (ALIGN % 4 == 0 && N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) w[i] = reinterpret_cast<const u32*>(p)[i];
    } else if constexpr (ALIGN % 2 == 0 && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) w[i / 2] |= (u32)reinterpret_cast<const u16*>(p)[i] << (16 * (i % 2));
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i / 4] |= (u32)p[i] << (8 * (i % 4));
    }
}

// ---------------------------------------------------------------------------------------
// Unpacking. A "group" is 8 consecutive codes of one token; unpack_group gives the four pairs
// (s, s+4), s = 0..3, as fp16x2 codes (8 bits: signed, the int8 value).
// ---------------------------------------------------------------------------------------

// The 8 codes of group `i` of a token's words as a nibble word (code s in bits 4s..4s+3) for
// BITS < 8, or two words of biased bytes (code + 128) for 8 bits.
template <int BITS>
KBIT_DEVICE void group_words(const u32* w, int i, u32& lo, u32& hi) {
    if constexpr (BITS == 4) {
        lo = w[i];
    } else if constexpr (BITS == 2) {
        // 16 codes per word, code s of group i at bit 2s + 16 (i % 2): spread to bytes 0 and 2
        const u32 half = w[i / 2] >> (16 * (i % 2));  // codes 0..3 in byte 0, 4..7 in byte 1
        lo = prmt(half, 0, 0x7170u);                    // byte 0 -> 0, byte 1 -> 2 (codes at 2s, 16 + 2s)
    } else if constexpr (BITS == 3) {
        // 24 bits per group: bit offset 24 i in the word stream
        const int bit = 24 * i;
        const u32 a = w[bit / 32], b = (bit % 32) > 8 ? w[bit / 32 + 1] : 0u;
        u32 x;
        asm("shf.r.clamp.b32 %0, %1, %2, %3;" : "=r"(x) : "r"(a), "r"(b), "r"(bit % 32));
        // codes 0..3 at 3s, codes 4..7 at 12 + 3s -> 16 + 3s
        lo = (x & 0xfffu) | ((x << 4) & 0x0fff0000u);
    } else {
        lo = w[2 * i] ^ 0x80808080u;
        hi = w[2 * i + 1] ^ 0x80808080u;
    }
}

// Pair (s, s+4) of a group as fp16x2 values, exact: below 8 bits the codes' bits themselves,
// which as fp16 are the subnormals code * 2^-24 (no conversion instruction at all; products and
// sums stay exact in the fp32 accumulators, which are scaled by 2^24 once), the odd pairs at bits
// 4.. (code * 2^-20: Q' of the odd pairs is divided by 16 to match, kOddPairScale), so that 4 bits
// take pairs 0 and 1 in place and 2 and 3 after one shift; 8 bits: the signed codes as normal values.
template <int BITS>
KBIT_DEVICE u32 group_pair(u32 lo, u32 hi, int s) {
    if constexpr (BITS == 4) {
        return (s < 2 ? lo : lo >> 8) & (0x000f000fu << (4 * (s % 2)));
    } else if constexpr (BITS == 2) {
        return (s % 2 ? ((2 * s) > 4 ? lo >> (2 * s - 4) : lo << (4 - 2 * s)) : lo >> (2 * s)) & (0x00030003u << (4 * (s % 2)));
    } else if constexpr (BITS == 3) {
        return (s % 2 ? ((3 * s) > 4 ? lo >> (3 * s - 4) : lo << (4 - 3 * s)) : lo >> (3 * s)) & (0x00070007u << (4 * (s % 2)));
    } else {
        // byte s of lo and byte s of hi, each 128 + code
        const u32 x = prmt(lo, hi, (u32)s | ((u32)(s + 4) << 8));  // byte 0 <- lo.s, byte 2 <- hi.s
        return hsub2(and_or(x, 0x00ff00ffu, kMagic), 0x64806480u);  // - 1152
    }
}

constexpr float kTinyScale = 16777216.f;  // 2^24: subnormal fp16 codes -> codes

// fp16 2^e in both halves, -24 <= e <= 15 (exact powers of two; subnormal below -14).
__host__ __device__ constexpr u32 pow2_pair(int e) {
    const u32 h = e >= -14 ? (u32)(e + 15) << 10 : 1u << (e + 24);
    return h | (h << 16);
}

// ---------------------------------------------------------------------------------------
// kbit_kv_offsets: grid (B), 1024 threads. Where each bucket's entries of the first C key blocks
// start, relative to the row's start in that bucket:
//   rel[b][kb][t] (kb = 0..C) = #{p < kb * bs : tier[b][p] == bits(t)}.
// Positions from C * bs on are all 8-bit (lower widths exist only in key blocks with a range),
// so the decode kernel extends rel past C without it; rel only changes when widths do, and the
// cache keeps it between steps.
// Pass 1: a warp per key block counts its positions 32 at a time (one ballot per width) and
// stores the counts at rel[b][kb + 1]; pass 2: the block scans them in place, 1024 key blocks at
// a time, carrying the running totals.
// ---------------------------------------------------------------------------------------
constexpr int kOffsetThreads = 1024;

}  // namespace kv
}  // namespace kbit

using namespace kbit;
using namespace kbit::kv;

extern "C" __global__ void __launch_bounds__(kOffsetThreads)
kbit_kv_offsets(const signed char* __restrict__ tier, int* __restrict__ rel, int S, int C, int bs, int ld) {
    __shared__ int warp_sums[kOffsetThreads / 32][kTiers];
    __shared__ int carry[kTiers];
    const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const signed char* row = tier + (size_t)b * ld;  // rows ld >= S apart
    int* out = rel + (size_t)b * (C + 1) * kTiers;
    grid_dependency_wait();
    for (int kb = warp; kb < C; kb += kOffsetThreads / 32) {
        const int p0 = kb * bs, p1 = min(p0 + bs, S);
        int c[kTiers] = {0, 0, 0, 0};
        for (int p = p0; p < p1; p += 32) {
            const int v = p + lane < p1 ? row[p + lane] : 0;
#pragma unroll
            for (int t = 0; t < kTiers; ++t) c[t] += __popc(__ballot_sync(0xffffffffu, v == tier_bits(t)));
        }
        if (lane < kTiers) out[(kb + 1) * kTiers + lane] = c[lane == 0 ? 0 : lane == 1 ? 1 : lane == 2 ? 2 : 3];
    }
    if (tid < kTiers) {
        carry[tid] = 0;
        out[tid] = 0;
    }
    __syncthreads();
    // pass 2: rel[kb] = sum of the counts of key blocks < kb (inclusive scan of the counts stored
    // at kb + 1), 1024 at a time
    for (int k0 = 1; k0 <= C; k0 += kOffsetThreads) {
        const int kb = k0 + tid;
        int incl[kTiers];
#pragma unroll
        for (int t = 0; t < kTiers; ++t) {
            incl[t] = warp_inclusive_sum(kb <= C ? out[kb * kTiers + t] : 0, lane);
            if (lane == 31) warp_sums[warp][t] = incl[t];
        }
        __syncthreads();
        if (warp == 0) {  // scan of the warp totals
#pragma unroll
            for (int t = 0; t < kTiers; ++t) {
                warp_sums[lane][t] = warp_inclusive_sum(warp_sums[lane][t], lane);  // inclusive
            }
        }
        __syncthreads();
        if (kb <= C) {
#pragma unroll
            for (int t = 0; t < kTiers; ++t) out[kb * kTiers + t] = carry[t] + (warp ? warp_sums[warp - 1][t] : 0) + incl[t];
        }
        __syncthreads();  // every thread has read carry and the warp totals
        if (tid < kTiers) carry[tid] += warp_sums[kOffsetThreads / 32 - 1][tid];
        __syncthreads();
    }
}

namespace kbit {
namespace kv {

// What the copies of a decode block need to find its tiles.
struct Problem {
    const u8* k[kTiers];
    const u8* v[kTiers];
    const u16* k_scale8;      // 8-bit keys' scales [n, H, D/64]
    const u16* v_scale[kTiers];
    const u16* v_zero[kTiers];
    const int* pos[kTiers];
    const u16* k_min;         // [B, NB, H, D]
    const u16* k_range;
    int H, NB, b, h;
    bool need_pos;  // positions are read (a bias, several queries or the mass); else every entry is visible
};

// Per lane, the softmax state of its two query rows 2t, 2t+1 (the same in the 8 lanes of t) and
// its output accumulators: acc[grp][i][c] is channel 64 grp + 8g + 2i (c = 0, 1) or + 1 (c = 2,
// 3), rows 2t (c even) and 2t+1 (c odd), in units of 2^(4 (ch % 2) - 24) for channel ch (the value
// codes enter as fp16 subnormals).
template <int D>
struct WarpState {
    static constexpr int GROUPS = D / kGroup;
    float m[2], l[2];
    float zs[2][GROUPS];  // sum of p * zero per row and group (this lane's tokens g, g+8)
    float acc[GROUPS][4][4];
    int pexp[GROUPS];     // P' of group grp is p * scale * 2^pexp (and acc with it), see scale_exponent
};

// The running max of a row (the reference of p = 2^(logit - m)) moves only when a tile's max
// exceeds it by more than kLazyBits (log2 units): most tiles then skip rescaling the sums, and
// p <= 2^kLazyBits.
constexpr int kLazyBits = 8;

// The power of two that keeps a tile's P' = p * scale (p <= 2^kLazyBits) in fp16's range: the
// largest scale of the tile times 2^e stays below 2^(15 - kLazyBits). Without it a small p times
// a small scale (say 1e-5 * 1e-3) would underflow fp16 and drop out of the sum.
KBIT_DEVICE int scale_exponent(float max_scale) {
    return 14 - kLazyBits - ((__float_as_int(max_scale) >> 23) - 127);  // max_scale * 2^e in [2^(14-L), 2^(15-L))
}
// The bits of the smallest scale that needs an exponent below e (non-negative floats order as
// their bits): a tile whose largest scale is below it keeps e.
KBIT_DEVICE u32 scale_limit_bits(int e) { return (u32)(127 + 15 - kLazyBits - e) << 23; }
KBIT_DEVICE float pow2f(int e) { return __int_as_float((127 + e) << 23); }  // -126 <= e <= 127

// Where this lane's two rows go: valid, query index, causal limit, logits row.
struct RowInfo {
    bool ok[2];
    int qi[2], limit[2];
    u16* logits[2];  // fp16 logits (log2 units) of the row, for the mass
    const float* bias[2];
    bool has_bias;  // bias given (the same for the whole grid)
    bool need_pos;  // the positions are read (else pos = 0: one query and no bias see every entry)
};

// Lane (g, t)'s value codes of fragment f: channels 8g..8g+7 of each group, token slots 2t, 2t+1,
// 2t+8, 2t+9 of the fragment.
template <int D, int BITS, int VROW>
KBIT_DEVICE void load_values(u32 (&vw)[4][D / kGroup][(BITS + 3) / 4], const u8* vbase, int f) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int slot = kFrag * f + 8 * (u / 2) + 2 * t + (u % 2);
#pragma unroll
        for (int grp = 0; grp < D / kGroup; ++grp)
            load_bytes<BITS, BITS>(vw[u][grp], vbase + slot * VROW + grp * (kGroup * BITS / 8) + g * BITS, true);
    }
}

// A tile holds NF 16-token fragments f (slots 16 f ..) of bucket TIER, entries [e0, e0 + 16 NF)
// (valid below e_end), in its stage; per fragment
//   logits^T [16 tokens x 8 rows] = K [16 tokens x 16 ch] * Q'^T [16 ch x 8 rows]   (per k16 step)
//   out^T    [16 ch x 8 rows]    += V^T [16 ch x 16 tokens] * P'^T [16 tokens x 8 rows]
// in three steps: tile_logits<TIER, NF> (the key codes' product), tile_softmax (every width:
// the online softmax, once per tile, and the probabilities' transpose in registers,
// times each token's value scale) and tile_values<TIER, NF> (the value codes' product). Only the
// two products are compiled per width and fragment count, the softmax once (the loop's code is
// smaller; measured as fast as one whole function per width, not faster).
constexpr int kMaxFrags = kMaxTile / kFrag;

// Per-tile softmax inputs: x[f][token g / g+8][row 2t / 2t+1] in log2 units (-inf where
// excluded), and each token's position.
struct TileLogits {
    float x[kMaxFrags][2][2];
    int pos[kMaxFrags][2];
};

// PAIR: a tile of lower widths holds both heads; its product runs over both heads' channels with
// each head's B columns (rows g of head g / 4) zero in the other head's steps, so one C fragment
// holds the logits of both heads' rows. An 8-bit tile holds head hh8 only: the other head's rows
// are excluded (-inf).
template <int D, int TIER, int NF, bool PAIR>
KBIT_DEVICE void tile_logits(const RowInfo& ri, const u8* stage, const uint2 (&bq)[D / 16], float qmin0, float qmin1, int e0, int e_end,
                             TileLogits& tl, int hh8) {
    using ST = Stage<D, PAIR>;
    constexpr int BITS = tier_bits(TIER);
    static_assert(NF >= 1 && NF * kFrag <= tile_entries(TIER), "fragments of a tile");
    constexpr int KSTEPS = D / 16;
    constexpr int GROUPS = D / kGroup;
    constexpr int HT = tile_heads(PAIR, TIER);
    constexpr int HEAD_BYTES = D * BITS / 8;  // one head's part of a key row
    constexpr int CHUNK = D * BITS / 32;  // lane t's quarter of a head's key row
    constexpr int CHUNK_WORDS = (CHUNK + 3) / 4;
    constexpr int KROW = ST::krow(TIER);
    constexpr int KALIGN = (KROW % 16 == 0 && CHUNK % 16 == 0 && HEAD_BYTES % 16 == 0) ? 16 : CHUNK;
    constexpr float kInvLevels = BITS == 8 ? 1.f : kTinyScale / (float)((1 << BITS) - 1);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool has_bias = ri.has_bias;
    float (&x)[kMaxFrags][2][2] = tl.x;
    int (&pos)[kMaxFrags][2] = tl.pos;
    bool valid[NF][2];
    const int b_head = g / kHeadRows, c_head = 2 * t / kHeadRows;  // PAIR: the head of B column g, of C rows 2t, 2t+1
    const bool rows_here = !PAIR || HT == 2 || c_head == hh8;       // this lane's rows have keys in the tile
#pragma unroll
    for (int f = 0; f < NF; ++f) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int slot = kFrag * f + g + 8 * hf;
            pos[f][hf] = ri.need_pos ? reinterpret_cast<const int*>(stage + ST::POS)[slot] : 0;
            valid[f][hf] = e0 + slot < e_end;
        }
        // even and odd k16 steps accumulate apart (two independent chains of products)
        float c2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int hh = 0; hh < HT; ++hh) {
            // B columns of the other head are zero in this head's steps (PAIR)
            const u32 keep = !PAIR || b_head == (HT == 2 ? hh : hh8) ? ~0u : 0u;
            // keys: chunk t of head hh's part of tokens g and g+8 of the fragment
            u32 kw[2][CHUNK_WORDS], kscale[2] = {0u, 0u};
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int slot = kFrag * f + g + 8 * hf;
                load_bytes<CHUNK, KALIGN>(kw[hf], stage + ST::K + slot * KROW + hh * HEAD_BYTES + t * CHUNK, true);
                if constexpr (BITS == 8) {
                    const u16 sc = reinterpret_cast<const u16*>(stage + ST::KSCALE)[slot * GROUPS + (t * D / 4) / kGroup];
                    kscale[hf] = (u32)sc | ((u32)sc << 16);
                }
            }
#pragma unroll
            for (int j = 0; j < KSTEPS; ++j) {
                u32 a[4];
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    u32 lo = 0, hi = 0;
                    group_words<BITS>(kw[hf], j / 2, lo, hi);
                    u32 p0 = group_pair<BITS>(lo, hi, 2 * (j % 2));
                    u32 p1 = group_pair<BITS>(lo, hi, 2 * (j % 2) + 1);
                    if constexpr (BITS == 8) {
                        p0 = mul2<KBIT_F16>(p0, kscale[hf]);
                        p1 = mul2<KBIT_F16>(p1, kscale[hf]);
                    }
                    a[hf] = p0;      // a0 / a1: tokens g / g+8, k 2t, 2t+1
                    a[2 + hf] = p1;  // a2 / a3: k 2t+8, 2t+9
                }
                mma_16816<KBIT_F16>(c2[j % 2], a, bq[j].x & keep, bq[j].y & keep);
            }
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf)
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const float c = c2[0][2 * hf + rr] + c2[1][2 * hf + rr];
                const float v = BITS == 8 ? c : c * kInvLevels + (rr ? qmin1 : qmin0);
                // past the bucket, another head's tile, or (no mask given) after the query's position: excluded
                x[f][hf][rr] = valid[f][hf] && rows_here && (has_bias || pos[f][hf] <= ri.limit[rr]) ? v : KBIT_NEG_INF;
            }
    }
#pragma unroll
    for (int f = NF; f < kMaxFrags; ++f)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            x[f][hf][0] = x[f][hf][1] = KBIT_NEG_INF;
            pos[f][hf] = 0;
        }
}

// Every width's middle step of a tile of `nf` fragments holding `count` entries of the bucket:
// the bias, the logits for the mass, the online softmax (rows 2t, 2t+1; the tile's tokens are
// spread over g), and P'^T per group as the value product's B fragments pb[f][grp] (row g, tokens
// 2t, 2t+1 / 2t+8, 2t+9 of fragment f) = p * value scale * 2^pexp;
// `zeros`: the values have zero points (below 8 bits), whose probability-weighted sums go to st.zs.
// A token's value scales (and zeros) for this lane's rows are at (slot * sc_stride + sc_off) + group
// (a PAIR tile of both heads: the rows' head's; else the tile's one head). `rows_here`: the tile
// holds keys of this lane's rows (not another head's 8-bit tile, whose logits of these rows are
// not this tile's to write).
template <int D, bool PAIR>
KBIT_DEVICE void tile_softmax(const RowInfo& ri, WarpState<D>& st, const u8* stage, uint2 (&pb)[kMaxFrags][D / kGroup], TileLogits& tl, int nf, int count, bool zeros,
                              int sc_stride, int sc_off, bool rows_here) {
    using ST = Stage<D, PAIR>;
    constexpr int GROUPS = D / kGroup;
    constexpr int NF = kMaxFrags;  // loops run over every fragment; those past nf are excluded
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool has_bias = ri.has_bias;
    float (&x)[kMaxFrags][2][2] = tl.x;
    const int (&pos)[kMaxFrags][2] = tl.pos;
    bool valid[NF][2];
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) valid[f][hf] = kFrag * f + g + 8 * hf < count;
    if (has_bias) {
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf)
#pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    if (valid[f][hf]) x[f][hf][rr] += ri.bias[rr][pos[f][hf]] * 1.4426950408889634f;
    }
    float tmax[2] = {KBIT_NEG_INF, KBIT_NEG_INF};
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            tmax[rr] = fmaxf(tmax[rr], fmaxf(x[f][0][rr], x[f][1][rr]));
            if (ri.logits[rr] != nullptr && rows_here) {
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    if (valid[f][hf]) ri.logits[rr][pos[f][hf]] = f32_to_bits<KBIT_F16>(x[f][hf][rr]);
            }
        }
    }
    // ---- online softmax (rows 2t, 2t+1; the tile's tokens are spread over g) ----
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float mx = tmax[rr];
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const bool move = mx > st.m[rr] + (float)kLazyBits;  // -inf + L = -inf: the first finite max moves
        const float m_new = move ? mx : st.m[rr];
        const float safe = m_new == KBIT_NEG_INF ? 0.f : m_new;
        alpha[rr] = move ? fast_exp2(st.m[rr] - safe) : 1.f;
        float sum = 0.f;
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                x[f][hf][rr] = fast_exp2(x[f][hf][rr] - safe);
                sum += x[f][hf][rr];
            }
        st.l[rr] = st.l[rr] * alpha[rr] + sum;
        st.m[rr] = m_new;
    }
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the running max moved
#pragma unroll
        for (int grp = 0; grp < GROUPS; ++grp) {
            st.zs[0][grp] *= alpha[0];
            st.zs[1][grp] *= alpha[1];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                st.acc[grp][i][0] *= alpha[0];
                st.acc[grp][i][1] *= alpha[1];
                st.acc[grp][i][2] *= alpha[0];
                st.acc[grp][i][3] *= alpha[1];
            }
        }
    }
    // ---- P'^T per group, transposed in registers: pb[f][grp] = B fragment (row g, tokens 2t.. / 2t+8..) ----
    const u16* vsc = reinterpret_cast<const u16*>(stage + ST::VSCALE);
    const u16* vze = reinterpret_cast<const u16*>(stage + ST::VZERO);
#pragma unroll
    for (int grp = 0; grp < GROUPS; ++grp) {
        float sc[NF][2];  // zero past the bucket (scales are >= 0)
        u32 mx = 0u;
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                sc[f][hf] = f < nf ? half_lo(vsc[(kFrag * f + g + 8 * hf) * sc_stride + sc_off + grp]) : 0.f;
                mx = max(mx, __float_as_uint(sc[f][hf]) & 0x7fffffffu);
            }
        mx = __reduce_max_sync(0xffffffffu, mx);  // non-negative floats order as their bits
        if (mx >= scale_limit_bits(st.pexp[grp])) {  // a larger scale than before: bring the sums down to a lower exponent
            const int e = scale_exponent(__uint_as_float(mx));  // < st.pexp[grp]
            const float fdown = pow2f(e - st.pexp[grp]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) st.acc[grp][i][c] *= fdown;
            st.pexp[grp] = e;
        }
        const float up = pow2f(st.pexp[grp]);
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            if (f >= nf) break;
            u32 m8[2];  // [token g (+8) of the fragment][rows 2t, 2t+1]
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int slot = kFrag * f + g + 8 * hf;
                const float s = sc[f][hf] * up;
                m8[hf] = f16x2(x[f][hf][0] * s, x[f][hf][1] * s);
                if (zeros) {
                    const float z = half_lo(vze[slot * sc_stride + sc_off + grp]);
                    st.zs[0][grp] += x[f][hf][0] * z;
                    st.zs[1][grp] += x[f][hf][1] * z;
                }
            }
            pb[f][grp] = make_uint2(transpose8x8(m8[0]), transpose8x8(m8[1]));
        }
    }
}

// PAIR, a tile of both heads: one product per head, each with B's columns of the other head's
// rows zero, into the same accumulators (a lane's rows 2t, 2t+1 are one head's; its channels are
// that head's). An 8-bit tile of one head needs no mask: the other head's probabilities are 0.
template <int D, int TIER, int NF, bool PAIR>
KBIT_DEVICE void tile_values(WarpState<D>& st, const u8* stage, const uint2 (&pb)[kMaxFrags][D / kGroup]) {
    using ST = Stage<D, PAIR>;
    constexpr int BITS = tier_bits(TIER);
    constexpr int GROUPS = D / kGroup;
    constexpr int VROW = ST::vrow(TIER);
    constexpr int HT = tile_heads(PAIR, TIER);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u8* vbase = stage + ST::v_at(TIER);
    // ---- out^T += V^T P'^T, per fragment, head and group ----
#pragma unroll
    for (int f = 0; f < NF; ++f)
#pragma unroll
    for (int hh = 0; hh < HT; ++hh) {
        const u32 keep = HT == 1 || g / kHeadRows == hh ? ~0u : 0u;
        u32 vw[4][GROUPS][(BITS + 3) / 4];
        load_values<D, BITS, VROW>(vw, vbase + hh * (D * BITS / 8), f);
#pragma unroll
        for (int grp = 0; grp < GROUPS; ++grp) {
            const u32 b0 = pb[f][grp].x & keep, b1 = pb[f][grp].y & keep;  // row g, tokens 2t, 2t+1 / 2t+8, 2t+9
            // codes of the 4 token slots as nibble words (BITS < 8) or biased bytes (8)
            u32 lo[4], hi[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                hi[u] = 0;
                group_words<BITS>(vw[u][grp], 0, lo[u], hi[u]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // m16 fragment i: channels 8g + 2i (rows g) and 8g + 2i + 1 (rows g+8)
                u32 a[4];
#pragma unroll
                for (int k = 0; k < 2; ++k) {      // token pair: slots (0, 1) -> a0/a1, (2, 3) -> a2/a3
#pragma unroll
                    for (int cc = 0; cc < 2; ++cc) {  // channel 2i + cc
                        const int ch = 2 * i + cc;
                        const u32 xa = lo[2 * k], ya = lo[2 * k + 1];
                        u32 r;
                        // value channel ch enters as code * 2^(4 (ch % 2) - 24) for every width (exact:
                        // fp16 subnormals): 4 bits keep nibble 1 of a half in place (no shift), nibbles
                        // 2, 3 shift by 8; the other widths are scaled to match; the epilogue divides
                        if constexpr (BITS == 8) {
                            const u32 xs = ch < 4 ? xa : hi[2 * k], ys = ch < 4 ? ya : hi[2 * k + 1];
                            const u32 sel = (u32)(ch % 4) | ((u32)(4 + ch % 4) << 8);
                            r = mul2<KBIT_F16>(hsub2(and_or(prmt(xs, ys, sel), 0x00ff00ffu, kMagic), 0x64806480u), pow2_pair(4 * (ch % 2) - 24));
                        } else if constexpr (BITS == 4) {
                            const u32 sel = (u32)(2 * (ch / 4)) | ((u32)(2 * (ch / 4) + 1) << 4) | ((u32)(4 + 2 * (ch / 4)) << 8) |
                                            ((u32)(5 + 2 * (ch / 4)) << 12);
                            const u32 z = prmt(xa, ya, sel);
                            r = ((ch % 4) < 2 ? z : z >> 8) & (0x000f000fu << (4 * (ch % 2)));
                        } else {
                            constexpr int SH = BITS == 2 ? 2 : 3;
                            const u32 sel = BITS == 2 ? (u32)(2 * (ch / 4)) | ((u32)(4 + 2 * (ch / 4)) << 8)
                                                      : (u32)(2 * (ch / 4)) | ((u32)(2 * (ch / 4) + 1) << 4) | ((u32)(4 + 2 * (ch / 4)) << 8) |
                                                            ((u32)(5 + 2 * (ch / 4)) << 12);
                            r = (prmt(xa, ya, sel) >> (SH * (ch % 4))) & (BITS == 2 ? 0x00030003u : 0x00070007u);
                            if (ch % 2) r = mul2<KBIT_F16>(r, pow2_pair(4));
                        }
                        a[2 * k + cc] = r;  // a0 (ch 2i, tokens 2t..), a1 (ch 2i+1), a2/a3 tokens 2t+8..
                    }
                }
                mma_16816<KBIT_F16>(st.acc[grp][i], a, b0, b1);
            }
        }
    }
}

}  // namespace kv
}  // namespace kbit

namespace kbit {
namespace kv {

// ---------------------------------------------------------------------------------------
// The copy ring. A warp walks its tiles (Cursor: whole key blocks kb0 + warp, + kWarps,
// ..., or its share of every key block's tiles; within a key block the entries of bucket 2, 3,
// 4 then 8, tile_entries at a time) once: the cursor runs one tile ahead of the computation,
// putting each tile's bytes into the other stage with cp.async (entries past the bucket are
// zero-filled), one commit group per tile; the computation takes the cursor's previous position
// (a copy of it, not a second walk), waits for its tile's group, and the warp meets at __syncwarp
// before a stage is refilled.
// ---------------------------------------------------------------------------------------

// `N` bytes global -> shared, asynchronously (N = 16, 8, 4) or, for N = 2 (the scales of
// head_dim 64), through a register; `ok` false writes zeros (src must still be mapped).
template <int N>
KBIT_DEVICE void copy_piece(void* dst, const void* src, bool ok) {
    if constexpr (N == 16) {
        cp_async16(dst, src, ok ? 16u : 0u);
    } else if constexpr (N == 8 || N == 4) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_addr(dst)), "l"(src), "n"(N), "r"(ok ? N : 0));
    } else {
        static_assert(N == 2, "piece size");
        *reinterpret_cast<u16*>(dst) = ok ? *reinterpret_cast<const u16*>(src) : (u16)0;
    }
}

__host__ __device__ constexpr int piece_bytes(int n) { return n % 16 == 0 ? 16 : n % 8 == 0 ? 8 : n % 4 == 0 ? 4 : 2; }

// The rows of heads h .. h + HT - 1 (side by side in the source, `ROW_BYTES` each: entry e's
// head h at base + (e * H + h) * ROW_BYTES) of the tile's NT entries [e0, e0 + NT) (valid below
// e_end) into dst rows of `DST_STRIDE` bytes, split over the warp.
template <int NT, int ROW_BYTES, int HT, int DST_STRIDE>
KBIT_DEVICE void copy_rows(u8* dst, const u8* base, int H, int h, int e0, int e_end, int lane) {
    constexpr int P = piece_bytes(HT * ROW_BYTES), PER_ROW = HT * ROW_BYTES / P;
    const u8* src0 = base + ((size_t)e0 * H + h) * ROW_BYTES;  // entry e0's row; entry e0 + r is r * H rows on
    const int src_stride = H * ROW_BYTES;
#pragma unroll
    for (int i = lane; i < NT * PER_ROW; i += 32) {
        const int r = i / PER_ROW, off = (i % PER_ROW) * P;
        const bool ok = e0 + r < e_end;
        copy_piece<P>(dst + r * DST_STRIDE + off, src0 + (ok ? r * src_stride : 0) + off, ok);
    }
}

// The copy of one tile of NF fragments of bucket TIER into `stage` (and, for the first
// lower-width tile of a key block, the block's key range and minimum): the tile's heads (PAIR:
// both below 8 bits, head hh8 of the two at 8 bits).
template <int D, int TIER, int NF, bool PAIR>
KBIT_DEVICE void copy_tile(const Problem& pr, u8* stage, int e0, int e_end, int kb, bool with_range, int lane, int hh8) {
    using ST = Stage<D, PAIR>;
    constexpr int BITS = tier_bits(TIER), GROUPS = D / kGroup, NT = NF * kFrag, HT = tile_heads(PAIR, TIER);
    const int h = pr.h + (PAIR && HT == 1 ? hh8 : 0);
    copy_rows<NT, D * BITS / 8, HT, ST::krow(TIER)>(stage + ST::K, pr.k[TIER], pr.H, h, e0, e_end, lane);
    copy_rows<NT, D * BITS / 8, HT, ST::vrow(TIER)>(stage + ST::v_at(TIER), pr.v[TIER], pr.H, h, e0, e_end, lane);
    copy_rows<NT, GROUPS * 2, HT, HT * GROUPS * 2>(stage + ST::VSCALE, reinterpret_cast<const u8*>(pr.v_scale[TIER]), pr.H, h, e0, e_end, lane);
    if constexpr (BITS < 8) {
        copy_rows<NT, GROUPS * 2, HT, HT * GROUPS * 2>(stage + ST::VZERO, reinterpret_cast<const u8*>(pr.v_zero[TIER]), pr.H, h, e0, e_end, lane);
    } else {
        copy_rows<NT, GROUPS * 2, HT, HT * GROUPS * 2>(stage + ST::KSCALE, reinterpret_cast<const u8*>(pr.k_scale8), pr.H, h, e0, e_end, lane);
    }
    if (pr.need_pos && lane < NT) {
        const bool ok = e0 + lane < e_end;
        copy_piece<4>(stage + ST::POS + 4 * lane, pr.pos[TIER] + (ok ? e0 + lane : e0), ok);
    }
    if (with_range && kb < pr.NB) {  // D * 2 bytes a head each, 16 at a time (lower widths only exist below NB)
        constexpr int PIECES = ST::HEADS * D / 8;
        const size_t blk = (((size_t)pr.b * pr.NB + kb) * pr.H + pr.h) * D;
        for (int i = lane; i < PIECES; i += 32) cp_async16(stage + ST::RANGE + 16 * i, pr.k_range + blk + 8 * i, 16u);
        for (int i = lane; i < PIECES; i += 32) cp_async16(stage + ST::MIN + 16 * i, pr.k_min + blk + 8 * i, 16u);
    }
}

// A walk over a warp's tiles. `offs` holds the split's bucket offsets per key block (int4 of
// the four buckets' first entries; the next key block's are its ends). A key block's tiles are
// numbered across its buckets in width order (2, 3, 4, 8 bits; tile_entries(tier) entries each,
// the last of a bucket partial). The two ways to share a split among the warps:
//   SPLIT_TILES false  warp w takes key blocks w, w + 4, ... and every tile of each;
//   SPLIT_TILES true   every warp takes every key block and its tiles k = w - kb, + 4, ... (mod 4:
//                      a key block of 5 tiles gives its fifth to a different warp than the
//                      next block does), for short contexts, where whole key blocks would
//                      leave SMs idle (the host's plan).
// PAIR: every 8-bit tile is two, one per head (hh8), the first head's first.
template <bool SPLIT_TILES, bool PAIR>
struct Cursor {
    static constexpr int kKbStep = SPLIT_TILES ? 1 : kWarps;
    static constexpr int k8Heads = block_heads(PAIR);  // tiles per 16 entries of the 8-bit bucket
    int kb, kb_end, k, tier, e, end;  // key block, its tile k: bucket `tier`, entries [e, min(e + tile_entries(tier), end))
    int hh8;        // the head of an 8-bit tile (PAIR), else 0
    bool low_seen;  // a lower-width tile of this key block was already produced
    bool first;     // the current tile is this walk's first lower-width one in the key block
    bool done;

    KBIT_DEVICE static int beg_of(const int4* offs, int i, int t) {
        return reinterpret_cast<const int*>(offs)[4 * i + t];
    }
    // Places tile k of key block kb; false when the block has no tile k.
    KBIT_DEVICE bool locate(const int4* offs, int kb0) {
        int rest = k;
        for (tier = 0; tier < kTiers; ++tier) {
            e = beg_of(offs, kb - kb0, tier);
            end = beg_of(offs, kb - kb0 + 1, tier);
            const int per = tier == 3 ? k8Heads : 1;  // tiles per tile_entries entries
            const int n = (end - e + tile_entries(tier) - 1) / tile_entries(tier) * per;
            if (rest < n) {
                e += rest / per * tile_entries(tier);
                hh8 = rest % per;
                return true;
            }
            rest -= n;
        }
        return false;
    }
    // The first tile of key block kb that warp `warp` takes (whole key blocks: all of them).
    KBIT_DEVICE static int first_tile(int warp, int kb) { return SPLIT_TILES ? (warp - kb) & (kWarps - 1) : 0; }
    // Moves to the next key block of the walk (done past the split's last).
    KBIT_DEVICE void next_block(int warp) {
        kb += kKbStep;
        k = first_tile(warp, kb);
        tier = 0;
        hh8 = 0;
        low_seen = false;
        done = kb >= kb_end;
    }
    // From the current position on, the first tile that exists. Whole key blocks step through
    // the buckets one tile at a time; split tiles place tile k directly.
    KBIT_DEVICE void settle(const int4* offs, int kb0, int warp) {
        if constexpr (SPLIT_TILES) {
            while (!done && !locate(offs, kb0)) next_block(warp);
        } else {
            while (!done && e >= end) {
                if (++tier == kTiers) {
                    next_block(warp);
                    if (done) break;
                }
                e = beg_of(offs, kb - kb0, tier);
                end = beg_of(offs, kb - kb0 + 1, tier);
            }
        }
        first = !done && tier < 3 && !low_seen;
        if (first) low_seen = true;
    }
    // The current tile's instance, 2 tier + fragments - 1: two fragments where the tile has more
    // than 16 entries (below 8 bits), else one (a tile is never longer than the bucket's rest).
    KBIT_DEVICE int kind() const { return 2 * tier + (tile_entries(tier) > kFrag && end - e > kFrag ? 1 : 0); }
    KBIT_DEVICE void start(const int4* offs, int kb0, int kb_last, int warp) {
        kb = kb0 + (SPLIT_TILES ? 0 : warp);
        kb_end = kb_last;
        k = first_tile(warp, kb);
        tier = 0;
        hh8 = 0;
        low_seen = false;
        done = kb >= kb_end;
        e = end = 0;
        if (!done && !SPLIT_TILES) {
            e = beg_of(offs, kb - kb0, 0);
            end = beg_of(offs, kb - kb0 + 1, 0);
        }
        settle(offs, kb0, warp);
    }
    KBIT_DEVICE void next(const int4* offs, int kb0, int warp) {
        if constexpr (SPLIT_TILES) {
            k += kWarps;
        } else if (PAIR && tier == 3 && hh8 == 0) {
            hh8 = 1;  // the same entries, the second head
        } else {
            e += tile_entries(tier);
            hh8 = 0;
        }
        settle(offs, kb0, warp);
    }
};

template <int D, bool SPLIT_TILES, bool PAIR>
KBIT_DEVICE void copy_at(const Problem& pr, const Cursor<SPLIT_TILES, PAIR>& c, u8* stage, int lane) {
    if (c.done) return;
    switch (c.kind()) {
        case 0: copy_tile<D, 0, 1, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        case 1: copy_tile<D, 0, kMaxFrags, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        case 2: copy_tile<D, 1, 1, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        case 3: copy_tile<D, 1, kMaxFrags, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        case 4: copy_tile<D, 2, 1, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        case 5: copy_tile<D, 2, kMaxFrags, PAIR>(pr, stage, c.e, c.end, c.kb, c.first, lane, 0); break;
        default: copy_tile<D, 3, 1, PAIR>(pr, stage, c.e, c.end, c.kb, false, lane, c.hh8); break;
    }
}

// Lane (g, t)'s B fragment of k16 step j for row g of `qrows` (fp32 [kRows][D]): b0 channels
// cb, cb+4, b1 cb+1, cb+5 with cb = t*D/4 + 8(j/2) + 2(j%2), the pairs group_pair unpacks.
template <int D>
KBIT_DEVICE uint2 b_fragment(const float* qrows, int lane, int j) {
    const int g = lane >> 2, t = lane & 3;
    const int cb = t * (D / 4) + 8 * (j / 2) + 2 * (j % 2);
    const float* q0 = qrows + g * D + cb;
    return make_uint2(f16x2(q0[0], q0[4]), f16x2(q0[1], q0[5]));
}

// A key block's operands for lane (g, t), in one pass over its k16 steps j:
//   bq[j]         Q' = q * range as the B fragment of step j (q's pairs times the range's pairs
//                 (cb, cb+4) and (cb+1, cb+5) in fp16; the odd pairs, which group_pair gives 16
//                 times their codes, divided by 16);
//   qmin0, qmin1  q . min for rows 2t and 2t+1, from one tensor-core product with the minimum
//                 in every token row of A (each row of C is then q . min) and q as B.
// PAIR: range and kmin hold both heads ([2][D]); row g's range is its head's (g / 4), and q . min
// takes one product per head, each lane keeping its rows' head's.
template <int D, bool PAIR>
KBIT_DEVICE void key_block_operands(const uint2* qfrag, const u16* range, const u16* kmin, int lane, uint2 (&bq)[D / 16],
                                    float& qmin0, float& qmin1) {
    constexpr int HEADS = block_heads(PAIR);
    const int g = lane >> 2, t = lane & 3;
    const u16* my_range = range + (PAIR ? g / kHeadRows * D : 0);
    float c[HEADS][2][4];  // per head, even and odd steps: two chains of products
#pragma unroll
    for (int hh = 0; hh < HEADS; ++hh)
#pragma unroll
        for (int i = 0; i < 8; ++i) c[hh][i / 4][i % 4] = 0.f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
        const uint2 qf = qfrag[j * 32 + lane];
        const int cb = t * (D / 4) + 8 * (j / 2) + 2 * (j % 2);
        const u32 rlo = *reinterpret_cast<const u32*>(my_range + cb), rhi = *reinterpret_cast<const u32*>(my_range + cb + 4);
        bq[j] = make_uint2(mul2<KBIT_F16>(qf.x, prmt(rlo, rhi, 0x5410u)),
                           mul2<KBIT_F16>(mul2<KBIT_F16>(qf.y, prmt(rlo, rhi, 0x7632u)), pow2_pair(-4)));
#pragma unroll
        for (int hh = 0; hh < HEADS; ++hh) {
            const u32 mlo = *reinterpret_cast<const u32*>(kmin + hh * D + cb), mhi = *reinterpret_cast<const u32*>(kmin + hh * D + cb + 4);
            const u32 m_even = prmt(mlo, mhi, 0x5410u), m_odd = prmt(mlo, mhi, 0x7632u);  // k 2t, 2t+1 / 2t+8, 2t+9
            const u32 a[4] = {m_even, m_even, m_odd, m_odd};
            mma_16816<KBIT_F16>(c[hh][j % 2], a, qf.x, qf.y);
        }
    }
    qmin0 = c[0][0][0] + c[0][1][0];
    qmin1 = c[0][0][1] + c[0][1][1];
    if constexpr (PAIR) {
        if (2 * t / kHeadRows == 1) {  // rows 2t, 2t+1 are the second head's
            qmin0 = c[1][0][0] + c[1][1][0];
            qmin1 = c[1][0][1] + c[1][1][1];
        }
    }
}

// Where the decode block's row r (0 .. kRows - 1) comes from. A kv head's `rows` = G * Q query
// rows are contiguous in q ([B][Hq][Q][D]; row j * Q + i is head h*G + j, query i), in the
// outputs and in the logits, from R0 (head h's first row, + row0 for a chunk):
//   one head  row r is global row R0 + r (rows past the chunk's `nrows` unused);
//   PAIR      row r is row r % 4 of head h + r / 4: global row R0 + (r / 4) * rows + r % 4 (rows
//             with r % 4 >= rows unused).
template <bool PAIR>
struct BlockRows {
    size_t R0;
    int rows, row0, nrows;
    KBIT_DEVICE bool ok(int r) const { return PAIR ? r % kHeadRows < rows : r < nrows; }
    KBIT_DEVICE size_t global(int r) const { return PAIR ? R0 + (size_t)(r / kHeadRows) * rows + r % kHeadRows : R0 + r; }
    // the row's index among its head's rows (j * Q + i)
    KBIT_DEVICE int in_head(int r) const { return PAIR ? r % kHeadRows : row0 + r; }
};

}  // namespace kv
}  // namespace kbit

// ---------------------------------------------------------------------------------------
// kbit_kv_decode<D, DT, SPLIT_TILES, PAIR>: grid (splits, H * row chunks or (PAIR) H / 2, B),
// kThreads threads, Smem<D, PAIR>::BYTES; SPLIT_TILES: how the warps share the split (Cursor);
// PAIR: the block takes kv heads 2y and 2y + 1 (G * Q <= 4, BlockRows). Split s takes the key
// blocks [max(s * kbps - shift, 0), min((s + 1) * kbps - shift, nblk)), 0 <= shift < kbps.
// part_acc [R][splits][D] (R = (b * Hq + hq) * Q + i) holds the split's output times its sum,
// relative to its max; part_ml [R][splits][2] the max and sum (log2 units).
// In-place mode (live_len != nullptr): S and nblk come from *live_len; logits and bias rows are
// ld apart; logits are written only on a recording call (calls, interval).
// ---------------------------------------------------------------------------------------
template <int D, int DT, bool SPLIT_TILES, bool PAIR>
__global__ void __launch_bounds__(kThreads, D <= 128 ? 4 : 1)
kbit_kv_decode(const void* __restrict__ q, const u8* k2, const u8* v2, const u16* vs2, const u16* vz2, const int* p2,
               const u8* k3, const u8* v3, const u16* vs3, const u16* vz3, const int* p3, const u8* k4, const u8* v4,
               const u16* vs4, const u16* vz4, const int* p4, const u8* k8, const u8* v8, const u16* ks8, const u16* vs8,
               const int* p8, const u16* k_min, const u16* k_range, const int* __restrict__ rel, const int* rs2, const int* rs3, const int* rs4,
               const int* rs8, int C, int bs, const float* bias,
               u16* logits, float* __restrict__ part_acc, float* __restrict__ part_ml, int H, int G, int Q, int S, int NB,
               int nblk, int kbps, int shift, int splits, float scale_log2, const int* live_len, int ld, const int* calls, int interval) {
    using SM = Smem<D, PAIR>;
    using ST = Stage<D, PAIR>;
    constexpr int KSTEPS = D / 16;
    constexpr int GROUPS = D / kGroup;
    extern __shared__ uint4 smem_u4[];
    u8* smem = reinterpret_cast<u8*>(smem_u4);
    float* qrows = reinterpret_cast<float*>(smem + SM::Q_ROWS);
    uint2* qfrag = reinterpret_cast<uint2*>(smem + SM::Q_FRAG);
    float* ml = reinterpret_cast<float*>(smem + SM::ML);
    float* outs = reinterpret_cast<float*>(smem + SM::OUT);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int rows = G * Q, chunks = PAIR ? 1 : (rows + kRows - 1) / kRows;
    const int split = blockIdx.x, h = PAIR ? 2 * blockIdx.y : blockIdx.y / chunks, b = blockIdx.z;
    const int row0 = (blockIdx.y % chunks) * kRows;

    Problem pr;
    pr.k[0] = k2; pr.k[1] = k3; pr.k[2] = k4; pr.k[3] = k8;
    pr.v[0] = v2; pr.v[1] = v3; pr.v[2] = v4; pr.v[3] = v8;
    pr.v_scale[0] = vs2; pr.v_scale[1] = vs3; pr.v_scale[2] = vs4; pr.v_scale[3] = vs8;
    pr.v_zero[0] = vz2; pr.v_zero[1] = vz3; pr.v_zero[2] = vz4; pr.v_zero[3] = nullptr;
    pr.pos[0] = p2; pr.pos[1] = p3; pr.pos[2] = p4; pr.pos[3] = p8;
    pr.k_scale8 = ks8; pr.k_min = k_min; pr.k_range = k_range;
    pr.H = H; pr.NB = NB; pr.b = b; pr.h = h;

    grid_dependency_wait();
    if (live_len != nullptr) {  // in place: the length the append left on the device
        S = *live_len;
        nblk = (S + bs - 1) / bs;
        if (!recording_call(calls, interval)) logits = nullptr;
    }
    const int kb0 = max(split * kbps - shift, 0), kb_end = min(nblk, (split + 1) * kbps - shift);
    const int Hq = H * G;
    BlockRows<PAIR> br;
    br.R0 = ((size_t)b * Hq + (size_t)h * G) * Q + row0;
    br.rows = rows;
    br.row0 = row0;
    br.nrows = min(kRows, rows - row0);
    // q's loads and the offsets' loads are all issued before the first store
    constexpr int PER = kRows * D / kThreads;  // query elements per thread
    float x[PER];
    // (every load is issued unconditionally, unused rows' at element 0, so that none waits for
    // another: conditional loads of PAIR's row mapping were compiled one round trip each)
    bool used[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int i = tid + k * kThreads, r = i / D;
        used[k] = br.ok(r);
        x[k] = load_elem<DT>(q, used[k] ? br.global(r) * D + i % D : 0);
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) x[k] = used[k] ? x[k] : 0.f;
    // the split's bucket offsets (key blocks kb0 .. kb_end, ends included): row start + rel
    int4* offs = reinterpret_cast<int4*>(smem + SM::OFFS);
    for (int i = tid; kb0 + i <= kb_end; i += kThreads) {
        const int kb = kb0 + i;
        const int4* r = reinterpret_cast<const int4*>(rel) + (size_t)b * (C + 1);
        int4 o = r[min(kb, C)];
        if (kb > C) o.w += min(kb * bs, S) - C * bs;  // past C every position is 8-bit
        offs[i] = make_int4(rs2[b] + o.x, rs3[b] + o.y, rs4[b] + o.z, rs8[b] + o.w);
    }
    // the block's query rows, times scale * log2(e) (unused rows are zero)
#pragma unroll
    for (int k = 0; k < PER; ++k) qrows[tid + k * kThreads] = x[k] * scale_log2;
    __syncthreads();

    WarpState<D> st;
    st.m[0] = st.m[1] = KBIT_NEG_INF;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int grp = 0; grp < GROUPS; ++grp) {
        st.zs[0][grp] = st.zs[1][grp] = 0.f;
        st.pexp[grp] = 100;  // lowered by the first tile with a nonzero scale
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) st.acc[grp][i][c] = 0.f;
    }
    // this lane's rows 2t, 2t+1 of the block's chunk
    RowInfo ri;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int r = 2 * t + rr;
        ri.ok[rr] = br.ok(r);
        ri.qi[rr] = Q == 1 ? 0 : br.in_head(r) % Q;  // (a division otherwise)
        ri.limit[rr] = S - Q + ri.qi[rr];
        ri.logits[rr] = logits != nullptr && ri.ok[rr] ? logits + br.global(r) * ld : nullptr;
        ri.bias[rr] = bias != nullptr ? bias + ((size_t)b * Q + ri.qi[rr]) * ld : nullptr;
    }
    ri.has_bias = bias != nullptr;
    ri.need_pos = pr.need_pos = bias != nullptr || Q > 1 || logits != nullptr;

    // ---- each warp's tiles through its copy ring ----
    u8* ring = smem + SM::RING + warp * stages_for(D) * ST::BYTES;
    // Two stages: the tile computed in an iteration is the one the copy cursor stood on at its
    // start (comp), while the copy cursor moves on and fetches the next tile into the other stage.
    static_assert(stages_for(D) == 2, "the computed tile is the copy cursor's previous one");
    Cursor<SPLIT_TILES, PAIR> copy, comp;
    copy.start(offs, kb0, kb_end, warp);
    float qmin0 = 0.f, qmin1 = 0.f;
    uint2 bq[KSTEPS];  // the B fragments of the current tile: Q' of its key block, or q (8-bit keys)
    bool bq_is_q = false;
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) bq[j] = make_uint2(0u, 0u);
    // one call site for the copies (the first iteration only copies, then makes q's B fragments
    // while that copy is in flight): the copy's instances are compiled once. Iteration i computes
    // the tile in stage i % 2 (comp) while the next one is fetched into the other stage.
    for (int i = -1;; ++i) {
        copy_at<D>(pr, copy, ring + ((i + 1) & 1) * ST::BYTES, lane);
        cp_async_commit();
        if (i < 0) {  // every thread of the block runs this iteration
            for (int k = tid; k < KSTEPS * 32; k += kThreads) qfrag[k] = b_fragment<D>(qrows, k % 32, k / 32);
            __syncthreads();
        } else {
        cp_async_wait<1>();
        __syncwarp();
        const u8* stage = ring + (i & 1) * ST::BYTES;
        if (comp.first) {  // Q' of the key block (lower widths only exist in blocks with a range)
            const u16* range = reinterpret_cast<const u16*>(stage + ST::RANGE);
            key_block_operands<D, PAIR>(qfrag, range, reinterpret_cast<const u16*>(stage + ST::MIN), lane, bq, qmin0, qmin1);
            bq_is_q = false;
        } else if (comp.tier == 3 && !bq_is_q) {  // 8-bit keys multiply q itself
#pragma unroll
            for (int j = 0; j < KSTEPS; ++j) bq[j] = qfrag[j * 32 + lane];
            bq_is_q = true;
        }
        const int kind = comp.kind();
        TileLogits tl;
        switch (kind) {
            case 0: tile_logits<D, 0, 1, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            case 1: tile_logits<D, 0, kMaxFrags, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            case 2: tile_logits<D, 1, 1, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            case 3: tile_logits<D, 1, kMaxFrags, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            case 4: tile_logits<D, 2, 1, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            case 5: tile_logits<D, 2, kMaxFrags, PAIR>(ri, stage, bq, qmin0, qmin1, comp.e, comp.end, tl, comp.hh8); break;
            default: tile_logits<D, 3, 1, PAIR>(ri, stage, bq, 0.f, 0.f, comp.e, comp.end, tl, comp.hh8); break;
        }
        const int nf = 1 + (kind & 1);
        uint2 pb[kMaxFrags][GROUPS];
        // a token's value scales: both heads' side by side below 8 bits (PAIR), one head's at 8
        const bool both = PAIR && kind < 6;
        tile_softmax<D, PAIR>(ri, st, stage, pb, tl, nf, min(comp.end - comp.e, nf * kFrag), kind < 6, both ? 2 * GROUPS : GROUPS,
                              both ? 2 * t / kHeadRows * GROUPS : 0, !PAIR || both || 2 * t / kHeadRows == comp.hh8);
        switch (kind) {
            case 0: tile_values<D, 0, 1, PAIR>(st, stage, pb); break;
            case 1: tile_values<D, 0, kMaxFrags, PAIR>(st, stage, pb); break;
            case 2: tile_values<D, 1, 1, PAIR>(st, stage, pb); break;
            case 3: tile_values<D, 1, kMaxFrags, PAIR>(st, stage, pb); break;
            case 4: tile_values<D, 2, 1, PAIR>(st, stage, pb); break;
            case 5: tile_values<D, 2, kMaxFrags, PAIR>(st, stage, pb); break;
            default: tile_values<D, 3, 1, PAIR>(st, stage, pb); break;
        }
        __syncwarp();  // every lane is done with the stage before it is refilled
        }
        if (copy.done) break;
        comp = copy;
        copy.next(offs, kb0, warp);
    }
    cp_async_wait<0>();
    allow_dependent_launch();

    // ---- the block's four warps -> one partial per row ----
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) {
            st.l[rr] += __shfl_xor_sync(0xffffffffu, st.l[rr], d);
#pragma unroll
            for (int grp = 0; grp < GROUPS; ++grp) st.zs[rr][grp] += __shfl_xor_sync(0xffffffffu, st.zs[rr][grp], d);
        }
        if (g == 0) {
            ml[(warp * kRows + 2 * t + rr) * 2] = st.m[rr];
            ml[(warp * kRows + 2 * t + rr) * 2 + 1] = st.l[rr];
        }
    }
    __syncthreads();  // every warp is past its ring: the partial outputs may take its place
    // each warp's output, scaled to the block's max, into its own slice (plain stores: shared
    // float atomics are compare-and-swap loops), then summed over the warps
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int row = 2 * t + rr;
        float mx = KBIT_NEG_INF;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ml[(w * kRows + row) * 2]);
        const float f = exp2f(st.m[rr] - (mx == KBIT_NEG_INF ? 0.f : mx));  // 0 for a warp without tokens
        float* mine = outs + (warp * kRows + row) * D;
#pragma unroll
        for (int grp = 0; grp < GROUPS; ++grp)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int ch = grp * kGroup + 8 * g + 2 * i;
                // value channel ch accumulated times 2^(4 (ch % 2) - 24) and 2^pexp
                const float unscale = kTinyScale * pow2f(-st.pexp[grp]);
                const float2 v = make_float2((st.acc[grp][i][rr] * unscale + st.zs[rr][grp]) * f,
                                             (st.acc[grp][i][2 + rr] * (unscale / 16.f) + st.zs[rr][grp]) * f);
                *reinterpret_cast<float2*>(mine + ch) = v;
            }
    }
    __syncthreads();
    for (int i = tid; i < (PAIR ? kRows : br.nrows) * D; i += kThreads) {
        if (PAIR && !br.ok(i / D)) continue;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += outs[w * kRows * D + i];
        part_acc[(br.global(i / D) * splits + split) * D + i % D] = sum;
    }
    if (tid < kRows && br.ok(tid)) {
        float mx = KBIT_NEG_INF, sum = 0.f;
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ml[(w * kRows + tid) * 2]);
        const float safe = mx == KBIT_NEG_INF ? 0.f : mx;
        for (int w = 0; w < kWarps; ++w) sum += ml[(w * kRows + tid) * 2 + 1] * exp2f(ml[(w * kRows + tid) * 2] - safe);
        part_ml[(br.global(tid) * splits + split) * 2] = mx;
        part_ml[(br.global(tid) * splits + split) * 2 + 1] = sum;
    }
}

// ---------------------------------------------------------------------------------------
// The splits' max M and sum L of NR query rows R0, R0 + step, ... (the first `valid` of them;
// the others get -inf and 0): lanes take the splits lane, lane + 32, ..., then a butterfly over
// the warp, every lane ends with both. `factor` (NR == 1 only; may be null) takes each split's
// 2^(m_s - M). The combine and the mass blocks both call it, so they get M and L to the bit
// (a row's arithmetic is the same whatever NR: rows are interleaved, never mixed).
// ---------------------------------------------------------------------------------------
template <int NR>
KBIT_DEVICE void splits_max_sum(const float* __restrict__ part_ml, size_t R0, int step, int valid, int splits, int lane,
                                float* factor, float (&mx)[NR], float (&sum)[NR]) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
        mx[i] = KBIT_NEG_INF;
        sum[i] = 0.f;
    }
    for (int s = lane; s < splits; s += 32)
#pragma unroll
        for (int i = 0; i < NR; ++i)
            if (i < valid) mx[i] = fmaxf(mx[i], part_ml[((R0 + (size_t)i * step) * splits + s) * 2]);
#pragma unroll
    for (int d = 16; d; d >>= 1)
#pragma unroll
        for (int i = 0; i < NR; ++i) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], d));
    for (int s = lane; s < splits; s += 32)
#pragma unroll
        for (int i = 0; i < NR; ++i) {
            if (i >= valid) continue;
            const size_t at = ((R0 + (size_t)i * step) * splits + s) * 2;
            const float f = exp2f(part_ml[at] - (mx[i] == KBIT_NEG_INF ? 0.f : mx[i]));
            if (NR == 1 && factor != nullptr) factor[s] = f;
            sum[i] += f * part_ml[at + 1];
        }
#pragma unroll
    for (int d = 16; d; d >>= 1)
#pragma unroll
        for (int i = 0; i < NR; ++i) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], d);
}

// Row r's (M, L) as position_mass reads them: (M, or 0 for a row without tokens; 1 / L, or 0).
KBIT_DEVICE void put_row_ml(float* row_ml, int r, float mx, float sum) {
    row_ml[2 * r] = mx == KBIT_NEG_INF ? 0.f : mx;
    row_ml[2 * r + 1] = sum > 0.f ? 1.f / sum : 0.f;
}

// ---------------------------------------------------------------------------------------
// The mass of position p of batch row b (kbit_kv_mass's and the combine's mass blocks' work):
// sum over the row's `rows` query rows of 2^(logit - M) / L, from row_ml[r] = (M or 0 for -inf,
// 1 / L or 0 for L = 0) in shared memory. logits rows are ld apart.
// mass[b][p] = that sum (live_len == nullptr; rows of mass S apart). In place, on a recording call
// only (the caller checks): mass[b][p] += that sum and seen[b][p] += heads * (the Q causal queries
// that see p) for p < S = *live_len, rows of mass and seen ld apart: the same float adds as
// adding the step's mass into the running sums afterwards.
// ---------------------------------------------------------------------------------------
KBIT_DEVICE void position_mass(const u16* __restrict__ logits, const float* row_ml, float* __restrict__ mass, float* __restrict__ seen,
                               bool in_place, int b, int p, int rows, int S, int ld, int heads, int Q) {
    float acc = 0.f;
    // every valid row wrote every position's logit; a row without mass (inv = 0) is skipped by
    // the select, not by a branch, so that the unrolled loads are all in flight at once
#pragma unroll 16
    for (int r = 0; r < rows; ++r) {
        const float inv = row_ml[2 * r + 1];
        const float x = bits_to_f32<KBIT_F16>(logits[((size_t)b * rows + r) * ld + p]);
        acc += inv > 0.f ? fast_exp2(x - row_ml[2 * r]) * inv : 0.f;
    }
    if (!in_place) {
        mass[(size_t)b * S + p] = acc;
        return;
    }
    const int late = max(p - (S - Q), 0);  // the queries before position p's own cannot see it
    mass[(size_t)b * ld + p] += acc;
    seen[(size_t)b * ld + p] += (float)(heads * max(Q - late, 0));
}

// ---------------------------------------------------------------------------------------
// kbit_kv_combine<DT>: grid (R + B * mass_chunks), 128 threads; shared memory: the larger of
// splits * 4 bytes rounded up to 16 (the compiler may read the factors four at a time) and,
// with mass blocks, rows * 8 bytes.
// Blocks 0 .. R-1, one per query row: out[b][i][hq][c] (transformers' layout) = sum_s 2^(m_s -
// M) acc_s[c] / L; ml[R] = (M, L).
// Blocks R + b * mass_chunks + k (mass_chunks > 0: the mass in the same launch, for short grids
// where a launch of its own would cost more than the work): positions k * 128 .. of batch row b,
// as kbit_kv_mass, with each row's M and L formed again from the splits (position_mass; in place
// only on a recording call).
// ---------------------------------------------------------------------------------------
constexpr int kCombineThreads = 128;
constexpr int kMassRowsAtOnce = 8;  // a mass block's warp forms M and L of this many rows at a time

// A mass block of the combine's launch: positions chunk * 128 .. of batch row b. Its rows' M and L
// are formed again from the splits into row_ml (shared, rows * 8 bytes). Out of line (noinline):
// inlined, its code made the combine's own blocks 1-2 % slower (H200, 2026-12-01).
__device__ __noinline__ void combine_mass_block(const float* __restrict__ part_ml, const u16* __restrict__ logits,
                                                float* __restrict__ mass, float* __restrict__ seen, float* row_ml, int rows,
                                                int splits, int S, int ld, const int* live_len, int heads, int Q,
                                                const int* calls, int interval, int b, int chunk, int tid) {
    const bool in_place = live_len != nullptr;
    if (in_place) {
        if (!recording_call(calls, interval)) return;  // the logits were not written
        S = *live_len;
    }
    const int lane = tid & 31, warp = tid >> 5, warps = kCombineThreads / 32;
    for (int r0 = warp; r0 < rows; r0 += warps * kMassRowsAtOnce) {
        float mx[kMassRowsAtOnce], sum[kMassRowsAtOnce];
        const int valid = (rows - r0 + warps - 1) / warps;
        splits_max_sum<kMassRowsAtOnce>(part_ml, (size_t)b * rows + r0, warps, valid, splits, lane, nullptr, mx, sum);
#pragma unroll
        for (int i = 0; i < kMassRowsAtOnce; ++i)
            if (lane == 0 && i < valid) put_row_ml(row_ml, r0 + i * warps, mx[i], sum[i]);
    }
    __syncthreads();
    const int p = chunk * kCombineThreads + tid;
    if (p < S) position_mass(logits, row_ml, mass, seen, in_place, b, p, rows, S, ld, heads, Q);
}

template <int DT>
__global__ void __launch_bounds__(kCombineThreads)
kbit_kv_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml, void* __restrict__ out,
                float* __restrict__ ml, int Hq, int Q, int D, int splits, int R_count, const u16* __restrict__ logits,
                float* __restrict__ mass, int rows, int S, int ld, const int* live_len, float* __restrict__ seen, int heads,
                const int* calls, int interval, int mass_chunks) {
    extern __shared__ float4 smem_f4[];  // the splits' factors, or a mass block's rows' (M, 1 / L)
    float* factor = reinterpret_cast<float*>(smem_f4);
    __shared__ float total[2];
    const size_t R = blockIdx.x;
    const int tid = threadIdx.x;
    grid_dependency_wait();
    if (blockIdx.x >= R_count) {  // a mass block
        combine_mass_block(part_ml, logits, mass, seen, factor, rows, splits, S, ld, live_len, heads, Q, calls, interval,
                           (blockIdx.x - R_count) / mass_chunks, (blockIdx.x - R_count) % mass_chunks, tid);
        return;
    }
    // thread (part, c4): channels 4 c4 .. 4 c4 + 3 over the splits part, part + kParts, ...; the
    // loads of a thread are independent (one latency, not one per split), the parts summed after.
    // The first kEarly splits of a thread's first channels are loaded before the splits' factors
    // are known, so that their latency overlaps that of the max and sum.
    constexpr int kParts = 4, kEarly = 8;
    __shared__ float4 partial[kParts][kCombineThreads / kParts];
    const int part = tid / (kCombineThreads / kParts), c4 = tid % (kCombineThreads / kParts);
    float4 early[kEarly];
#pragma unroll
    for (int k = 0; k < kEarly; ++k) {
        const int s = part + k * kParts;
        early[k] = s < splits && c4 < D / 4 ? reinterpret_cast<const float4*>(part_acc + (R * splits + s) * D)[c4]
                                            : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (tid < 32) {
        float mx[1], sum[1];
        splits_max_sum<1>(part_ml, R, 1, 1, splits, tid, factor, mx, sum);
        if (tid == 0) {
            total[0] = mx[0];
            total[1] = sum[0];
            ml[R * 2] = mx[0];
            ml[R * 2 + 1] = sum[0];
        }
    }
    __syncthreads();
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kEarly; ++k) {
        const int s = part + k * kParts;
        const float f = s < splits ? factor[s] : 0.f;
        acc.x += f * early[k].x; acc.y += f * early[k].y; acc.z += f * early[k].z; acc.w += f * early[k].w;
    }
    for (int c0 = 0; c0 < D / 4; c0 += kCombineThreads / kParts) {
        const int c = c0 + c4;
        if (c < D / 4) {
#pragma unroll 8
            for (int s = part + (c0 == 0 ? kEarly * kParts : 0); s < splits; s += kParts) {
                const float4 v = reinterpret_cast<const float4*>(part_acc + (R * splits + s) * D)[c];
                const float f = factor[s];
                acc.x += f * v.x; acc.y += f * v.y; acc.z += f * v.z; acc.w += f * v.w;
            }
        }
        partial[part][c4] = acc;
        __syncthreads();
        if (part == 0 && c < D / 4) {
            const float inv = total[1] > 0.f ? 1.f / total[1] : 0.f;
            const size_t b = R / ((size_t)Hq * Q), rem = R % ((size_t)Hq * Q), hq = rem / Q, qi = rem % Q;
            const size_t o = ((b * Q + qi) * Hq + hq) * D + 4 * c;
            float4 sum = partial[0][c4];
#pragma unroll
            for (int p = 1; p < kParts; ++p) {
                sum.x += partial[p][c4].x; sum.y += partial[p][c4].y; sum.z += partial[p][c4].z; sum.w += partial[p][c4].w;
            }
            store_elem<DT>(out, o, sum.x * inv);
            store_elem<DT>(out, o + 1, sum.y * inv);
            store_elem<DT>(out, o + 2, sum.z * inv);
            store_elem<DT>(out, o + 3, sum.w * inv);
        }
        __syncthreads();
        acc = make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// ---------------------------------------------------------------------------------------
// kbit_kv_mass: grid (ceil(S / 128), B) (in place: ceil(ld / 128)), 128 threads, rows * 8 bytes
// of shared memory: position_mass from the combine's ml, for grids too large for the combine's
// mass blocks (each of which forms its rows' M and L again from the splits).
// ---------------------------------------------------------------------------------------
constexpr int kMassThreads = 128;  // small blocks: short contexts still spread over many SMs

extern "C" __global__ void __launch_bounds__(kMassThreads)
kbit_kv_mass(const u16* __restrict__ logits, const float* __restrict__ ml, float* __restrict__ mass, int rows, int S, int ld,
             const int* live_len, float* __restrict__ seen, int heads, int Q, const int* calls, int interval) {
    extern __shared__ float row_ml[];  // [rows][2]: max, 1 / sum (0 when the sum is 0)
    const int b = blockIdx.y, p = blockIdx.x * kMassThreads + threadIdx.x;
    grid_dependency_wait();
    if (live_len != nullptr) {
        if (!recording_call(calls, interval)) return;  // the logits were not written
        S = *live_len;
    }
    for (int r = threadIdx.x; r < rows; r += kMassThreads)
        put_row_ml(row_ml, r, ml[((size_t)b * rows + r) * 2], ml[((size_t)b * rows + r) * 2 + 1]);
    __syncthreads();
    if (p < S) position_mass(logits, row_ml, mass, seen, live_len != nullptr, b, p, rows, S, ld, heads, Q);
}
