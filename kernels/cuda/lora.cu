// lora.cu: gathered LoRA (one launch per projection site, any mix of adapters and base rows).
//
// lora_apply_<dt>: for token n with adapter slot s = idx[n] and part p (blockIdx.y) of a fused projection,
//                  y[n, p*O + o] += sum_r Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i],
//                  for r < ranks[s] (the slot's rank at this site; the stacks are zero past it).
//                  Rows with s == 0 (the base model) or rank 0 (the adapter leaves this site alone) return
//                  at once, so a graph captured with every site costs a launch where nothing is adapted.
//                  One block per (token, part): the x row is staged in shared memory as fp32; each warp
//                  reduces whole ranks of A (8-element vector loads over I); then every thread owns
//                  outputs o (coalesced over Bt's rows). h and the sum stay fp32; y is rounded once.
//                  Dynamic shared memory: (I + R) floats. I a multiple of 8 (16-byte rows of A and x).
//
// Why gathered rather than segmented GEMMs: a decode step has at most a few thousand rows and ranks <= 64,
// so every row's A and B come from L2 after the first row of an adapter reads them; nothing on the host
// needs to know which adapters are present, which is what lets the step be captured in a CUDA graph.

template <typename T>
__device__ __forceinline__ void lora_apply_impl(T* __restrict__ y, const T* __restrict__ x,
                                                const T* __restrict__ A, const T* __restrict__ Bt,
                                                const i64* __restrict__ idx, const int* __restrict__ ranks,
                                                int I, int O, int R, int P) {
  const int n = blockIdx.x, p = blockIdx.y;
  const i64 s = idx[n];
  if (s <= 0) return;
  const int rank = ranks[s];
  if (rank <= 0) return;
  extern __shared__ float smem[];
  float* xs = smem;      // [I]
  float* h = smem + I;   // [R]
  const T* xrow = x + (i64)n * I;
  for (int i = threadIdx.x * 8; i < I; i += blockDim.x * 8) {
    float v[8];
    load8(xrow + i, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) xs[i + k] = v[k];
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const T* a = A + ((s * P + p) * (i64)R) * I;
  for (int r = warp; r < rank; r += nwarps) {
    const T* arow = a + (i64)r * I;
    float acc = 0.f;
    for (int i = lane * 8; i < I; i += 32 * 8) {
      float v[8];
      load8(arow + i, v);
      const float4 x0 = reinterpret_cast<const float4*>(xs + i)[0], x1 = reinterpret_cast<const float4*>(xs + i)[1];
      acc += v[0] * x0.x + v[1] * x0.y + v[2] * x0.z + v[3] * x0.w + v[4] * x1.x + v[5] * x1.y + v[6] * x1.z +
             v[7] * x1.w;
    }
    acc = warp_sum(acc);
    if (lane == 0) h[r] = acc;
  }
  __syncthreads();
  const T* b = Bt + ((s * P + p) * (i64)R) * O;
  T* yrow = y + ((i64)n * P + p) * O;
  for (int o = threadIdx.x; o < O; o += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < rank; ++r) acc += h[r] * to_f(b[(i64)r * O + o]);
    yrow[o] = from_f<T>(to_f(yrow[o]) + acc);
  }
}

#define LORA_KERNELS(S, T)                                                                                   \
  extern "C" __global__ void lora_apply_##S(T* y, const T* x, const T* A, const T* Bt, const i64* idx,       \
                                            const int* ranks, int I, int O, int R, int P) {                 \
    lora_apply_impl<T>(y, x, A, Bt, idx, ranks, I, O, R, P);                                                 \
  }
FOR_EACH_DTYPE(LORA_KERNELS)
