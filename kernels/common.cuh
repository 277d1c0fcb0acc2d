// Shared device helpers for the kbit kernels: scalar types, E4M4 decode, fp16/bf16
// conversions, and thin wrappers over the PTX instructions the GEMM uses (cp.async,
// ldmatrix, mma.sync, shfl). No system headers: the sources compile the same under NVRTC
// (at run time, through CuPy) and nvcc (the CI compile check).
//
// Half-precision values travel as raw bits (unsigned short / two packed in an unsigned int),
// so nothing here depends on cuda_fp16.h / cuda_bf16.h being on the include path.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

// Activation / output element type codes used as template arguments (kept as ints so NVRTC
// name expressions stay simple: "kbit_gemm<4, 1, 0>").
#define KBIT_F16 0
#define KBIT_BF16 1
#define KBIT_F32 2

#define KBIT_DEVICE __device__ __forceinline__
#define KBIT_NEG_INF __int_as_float(0xff800000u)  // -inf without math headers (NVRTC has none)

// ---------------------------------------------------------------------------------------
// E4M4 block scales (bias 11): e = code >> 4, m = code & 15.
//   e > 0: 2^(e-11) * (1 + m/16)      e = 0: 2^-10 * m/16 (code 0 = 0.0)
// Built from IEEE bits; exact, no float arithmetic (so -ftz does not touch it).
// ---------------------------------------------------------------------------------------
KBIT_DEVICE float e4m4_decode(u32 code) {
    const u32 e = code >> 4, m = code & 15u;
    // Normal: exponent field e - 11 + 127, mantissa m in the top 4 bits.
    const u32 normal = ((e + 116u) << 23) | (m << 19);
    // Subnormal codes are m * 2^-14: a normal float with exponent -14 - (position of m's top bit)...
    // simplest exact form: m (an exact small integer) times 2^-14 (exact power of two).
    const float sub = (float)m * 6.103515625e-05f;  // 2^-14
    return e ? __uint_as_float(normal) : sub;
}

// ---------------------------------------------------------------------------------------
// conversions (round to nearest even), raw bits in and out
// ---------------------------------------------------------------------------------------
template <int DT> KBIT_DEVICE u16 f32_to_bits(float x);
template <> KBIT_DEVICE u16 f32_to_bits<KBIT_F16>(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
template <> KBIT_DEVICE u16 f32_to_bits<KBIT_BF16>(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

template <int DT> KBIT_DEVICE float bits_to_f32(u16 h);
template <> KBIT_DEVICE float bits_to_f32<KBIT_F16>(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
template <> KBIT_DEVICE float bits_to_f32<KBIT_BF16>(u16 h) {
    return __uint_as_float(((u32)h) << 16);  // bf16 is the top half of an fp32
}

// Element i of an fp16, bf16 or fp32 array (DT), as a float; and the store back.
template <int DT> KBIT_DEVICE float load_elem(const void* p, size_t i) {
    if constexpr (DT == KBIT_F32) return reinterpret_cast<const float*>(p)[i];
    else return bits_to_f32<DT>(reinterpret_cast<const u16*>(p)[i]);
}
template <int DT> KBIT_DEVICE void store_elem(void* p, size_t i, float v) {
    if constexpr (DT == KBIT_F32) reinterpret_cast<float*>(p)[i] = v;
    else reinterpret_cast<u16*>(p)[i] = f32_to_bits<DT>(v);
}

// Two floats -> one register of two half-precision values (lo in bits 0..15).
template <int DT> KBIT_DEVICE u32 pack2(float lo, float hi) {
    return (u32)f32_to_bits<DT>(lo) | ((u32)f32_to_bits<DT>(hi) << 16);
}

// Eight floats -> eight half-precision values in one 16-byte word, in order (one vector store).
template <int DT> KBIT_DEVICE uint4 pack8(const float (&v)[8]) {
    return make_uint4(pack2<DT>(v[0], v[1]), pack2<DT>(v[2], v[3]), pack2<DT>(v[4], v[5]), pack2<DT>(v[6], v[7]));
}

// Element-wise product of two packed pairs, rounded to nearest.
template <int DT> KBIT_DEVICE u32 mul2(u32 a, u32 b);
template <> KBIT_DEVICE u32 mul2<KBIT_F16>(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
template <> KBIT_DEVICE u32 mul2<KBIT_BF16>(u32 a, u32 b) {
    // mul.bf16x2 needs sm_90; fma with -0.0 is the same product on sm_80+.
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

// Lookup tables in shared memory (decode.cu's pair/quad table, dequant.cuh's pair table) hold
// each entry as several 16-byte pieces (lane copies). When `threads` threads fill `entries`
// entries of `pieces` pieces each, each thread forms one entry and stores its share of it: this
// many threads share an entry (a power of two, at most `pieces`; 1 when there are more entries
// than threads, which then take several rounds).
__host__ __device__ constexpr int table_threads_per_entry(int threads, int entries, int pieces) {
    int per = 1;
    while (per * 2 <= pieces && per * 2 * entries <= threads) per *= 2;
    return per;
}

// ---------------------------------------------------------------------------------------
// bit tricks
// ---------------------------------------------------------------------------------------
// Rotate right by s (mod 32): one SHF instruction.
KBIT_DEVICE u32 rotr(u32 x, u32 s) {
    u32 d;
    asm("shf.r.wrap.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(x), "r"(s));
    return d;
}

// The low 32 bits of the 64-bit (hi:lo) shifted right by s (mod 32): one SHF instruction.
KBIT_DEVICE u32 funnel_r(u32 lo, u32 hi, u32 s) {
    u32 d;
    asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(s));
    return d;
}

// (a & mask) | c in one LOP3 (the compiler otherwise splits it in two when it cannot prove the
// operands' bits disjoint).
KBIT_DEVICE u32 and_or(u32 a, u32 mask, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(c));
    return d;
}

// Byte permute in the generic mode: selector nibble = source byte 0..7, +8 = replicate that
// byte's sign bit (gives 0x00 for a byte below 0x80).
KBIT_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Value of `v` from lane `src & 31` (only the low 5 bits of src are used by the hardware with
// a clamp of 31, which lets callers pass a word whose low byte is the lane).
KBIT_DEVICE u32 shfl_idx(u32 v, u32 src) {
    u32 d;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 31, 0xffffffff;" : "=r"(d) : "r"(v), "r"(src));
    return d;
}

// Inclusive prefix sum of `v` over the lanes of a full warp (lane i gets v of lanes 0..i).
KBIT_DEVICE int warp_inclusive_sum(int v, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += u;
    }
    return v;
}

// ---------------------------------------------------------------------------------------
// asynchronous copies (sm_80+)
// ---------------------------------------------------------------------------------------
KBIT_DEVICE u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy that bypasses L1; when src_bytes is 0 it writes zeros instead
// (src must still be a valid address).
KBIT_DEVICE void cp_async16(void* dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
KBIT_DEVICE void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
KBIT_DEVICE void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
template <int N> KBIT_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------
// tensor cores
// ---------------------------------------------------------------------------------------
// Four 8x8 b16 matrices from shared memory; lane l gives the row address of matrix l/8.
KBIT_DEVICE void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// D = A * B + D, m16n8k16, fp32 accumulators. A: 4 regs (row-major 16x16), B: 2 regs (16x8).
template <int DT> KBIT_DEVICE void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> KBIT_DEVICE void mma_16816<KBIT_F16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> KBIT_DEVICE void mma_16816<KBIT_BF16>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A mixture-of-experts routing weight as a float: element i of `w` in its own dtype WT
// (KBIT_F32 / KBIT_F16 / KBIT_BF16), rounded to the activations' DT (the weight a token's
// expert output is scaled by).
template <int DT, int WT> KBIT_DEVICE float load_routing_weight(const void* __restrict__ w, long long i) {
    const float f = load_elem<WT>(w, (size_t)i);
    return WT == DT ? f : bits_to_f32<DT>(f32_to_bits<DT>(f));
}

// L2-coherent load (skips L1): for data other blocks of the same launch wrote.
KBIT_DEVICE float4 ld_cg(const float4* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+; no-ops on older GPUs and when the launch did not ask
// for it). A kernel launched with programmatic stream serialization may start while the
// previous kernel on the stream is still running: it must not read or write memory that kernel
// may touch before grid_dependency_wait(). allow_dependent_launch() lets the next such kernel
// start as soon as every block of this one has executed it or exited (the next one still waits
// for this one to finish before it touches memory), so its launch and prologue overlap this
// kernel's work.

// A block barrier that threads may reach from different places in the code (barrier.sync
// without .aligned): __syncthreads() is the .aligned form, which requires every thread to run the
// same barrier instruction, and a persistent loop unrolled over a ring reaches a unit's end from
// whichever copy of the loop body holds that warp's last item of the unit.
KBIT_DEVICE void block_barrier() { asm volatile("barrier.sync 0;" ::: "memory"); }

KBIT_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
KBIT_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");  // orders no memory access
#endif
}
