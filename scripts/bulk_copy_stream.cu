// How fast can bulk copies (cp.async.bulk, the wgmma kernel's weight path) stream a large buffer
// into shared memory, by chunk size, stages and blocks per SM? Consumers only wait and release.
// The reference points: 16-byte streaming loads (ld.global.cs) over the same 128 MiB ("ldg read") and a
// device-to-device memcpy (read + write). Used for bench/results/gemm-sm90-h100.md.
//
//   nvcc -arch=sm_90a -O3 -o bulk_copy_stream scripts/bulk_copy_stream.cu && ./bulk_copy_stream
//
// The copies and barriers are the kernels' own (kernels/async_copy.cuh, kernels/mbarrier.cuh).
//
// Layout: per block, `stages` buffers of `chunk` (+ `side`) bytes in a ring, full/empty
// mbarriers; thread 0 of warp 0 issues one bulk copy per chunk (plus a `side`-byte copy from a
// second array, as the weight tiles' scale codes), the other warps wait for full[s], read one
// word and arrive on empty[s]. Block b streams chunks b, b + grid, ...
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "../kernels/async_copy.cuh"  // the kernels' own barriers and bulk copies
using namespace kbit;
// side: a second small copy per chunk from another array (the scale codes)
__global__ void stream(const char* __restrict__ src, const char* __restrict__ side, long long n_chunks, int chunk, int stages, int side_bytes, unsigned* sink) {
  extern __shared__ __align__(1024) char smem[];
  const int stage_bytes = (chunk + side_bytes + 1023) / 1024 * 1024;
  u64* full = (u64*)(smem + (size_t)stages * stage_bytes);
  u64* empty = full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, blockDim.x - 32); }
    fence_mbar_init();
  }
  __syncthreads();
  const long long my = blockIdx.x < n_chunks ? (n_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;  // chunks b, b + grid, ...
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      long long c = blockIdx.x;
      for (long long j = 0; j < my; ++j, c += gridDim.x) {
        int s = j % stages; u32 use = j / stages;
        if (use > 0) mbar_wait(empty + s, (use - 1) & 1);
        mbar_arrive_expect_tx(full + s, chunk + side_bytes);
        bulk_load(smem + (size_t)s * stage_bytes, src + c * chunk, chunk, full + s);
        if (side_bytes) bulk_load(smem + (size_t)s * stage_bytes + chunk, side + c * side_bytes, side_bytes, full + s);
      }
    }
  } else {
    unsigned acc = 0;
    for (long long j = 0; j < my; ++j) {
      int s = j % stages; u32 use = j / stages;
      mbar_wait(full + s, use & 1);
      acc += ((const unsigned*)(smem + (size_t)s * stage_bytes))[threadIdx.x];
      mbar_arrive(empty + s);
    }
    if (acc == 0x12345678) sink[0] = acc;
  }
}
__global__ void readall(const int4* __restrict__ p, long long n, unsigned* sink) {
  unsigned acc = 0;
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
  for (; i + 7 * step < n; i += 8 * step) {
    int4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * step);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += v[u].x ^ v[u].w;
  }
  for (; i < n; i += step) acc += __ldcs(p + i).x;
  if (acc == 0x12345678) sink[0] = acc;
}
int main() {
  const long long total = 128ll << 20;
  char *src, *side; unsigned* sink;
  cudaMalloc(&src, total); cudaMalloc(&side, total / 8); cudaMalloc(&sink, 4);
  cudaMemset(src, 1, total); cudaMemset(side, 1, total / 8);
  char* flush; cudaMalloc(&flush, 256 << 20);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  for (int rep = 0; rep < 3; ++rep) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    cudaMemset(flush, rep, 256 << 20);
    cudaEventRecord(a); readall<<<sms * 4, 512>>>((const int4*)src, total / 16, sink); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); printf("ldg read: %.2f TB/s\n", total / (ms * 1e-3) / 1e12);
    cudaMemset(flush, rep + 1, 256 << 20);
    cudaEventRecord(a); cudaMemcpy(flush, src, total, cudaMemcpyDeviceToDevice); cudaEventRecord(b); cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b); printf("memcpy: %.2f TB/s read+write\n", 2.0 * total / (ms * 1e-3) / 1e12);
  }
  printf("chunk stages blocks/SM side  in-flight/SM(KB)  TB/s\n");
  int chunks[] = {4096, 8192, 16384};
  int infl[] = {24, 48, 96, 144, 192};
  for (int side_bytes : {0, 256}) for (int chunk : chunks) for (int bps : {1, 2}) for (int kb : infl) {
    int stages = kb * 1024 / bps / chunk; if (stages < 2) continue;
    int stage_bytes = (chunk + side_bytes + 1023) / 1024 * 1024;
    size_t smem = (size_t)stages * stage_bytes + 2 * stages * 8;
    if (smem * bps > 227 * 1024) continue;
    cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    long long n_chunks = total / chunk;
    float best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      cudaMemset(flush, rep, 256 << 20);
      cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      cudaEventRecord(a);
      stream<<<sms * bps, 128, smem>>>(src, side, n_chunks, chunk, stages, side_bytes, sink);
      cudaEventRecord(b); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); if (ms < best) best = ms;
    }
    cudaError_t e = cudaGetLastError(); if (e) { printf("err %s\n", cudaGetErrorString(e)); return 1; }
    double bytes = total + (side_bytes ? (double)n_chunks * side_bytes : 0);
    printf("%6d %4d %2d %4d %6d %8.2f   (%.1f us)\n", chunk, stages, bps, side_bytes, stages * chunk * bps / 1024, bytes / (best * 1e-3) / 1e12, best * 1e3);
  }
  return 0;
}
