// grid_barrier.cu (bench/kernels.py, pdl section): what a link of a dependent chain costs when the blocks of one
// persistent kernel meet at a grid-wide barrier, against a kernel launch a link (programmatic or not). Compiled
// after kernels/cuda/common.cuh (pdl_enter, FULL_MASK).
//
// A round: every block reads the G values the round before wrote (from L2), sums them, and writes its own as
// sum / G + 1, so after r rounds from zeros every value is r: a block that read before the others had written
// would leave a smaller one.
// barrier_rounds: `rounds` rounds in one launch (G blocks, all resident), a grid barrier after each: count is
//   raised by every block (after a fence that publishes its write), the last of a round releases `flag`, the
//   others spin on it. count and flag start at 0. work 0: the barriers alone.
// barrier_link: one round a launch, buffers swapped by the caller.

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void barrier_round(const float* in, float* out, int G) {
  __shared__ float part[32];
  float v = 0.f;
  for (int i = threadIdx.x; i < G; i += blockDim.x) v += __ldcg(in + i);  // L2: another SM wrote it
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) sum += part[w];
    out[blockIdx.x] = sum / G + 1.f;
  }
}

extern "C" __global__ void barrier_rounds(float* buf, unsigned* count, unsigned* flag, int rounds, int work) {
  const int G = gridDim.x;
  pdl_enter();
  for (int r = 0; r < rounds; ++r) {
    if (work) barrier_round(buf + (r & 1) * G, buf + ((r + 1) & 1) * G, G);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      const unsigned round_end = (unsigned)G * (unsigned)(r + 1);
      if (atomicAdd(count, 1u) + 1u == round_end) {
        atomicExch(flag, (unsigned)(r + 1));
      } else {
        while (ld_acquire_gpu(flag) < (unsigned)(r + 1)) {
        }
      }
    }
    __syncthreads();
  }
}

extern "C" __global__ void barrier_link(const float* in, float* out, int work) {
  pdl_enter();
  if (work) barrier_round(in, out, gridDim.x);
}
