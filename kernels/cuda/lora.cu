// lora.cu: LoRA for any mix of adapters and base rows, one launch per projection site.
//
// lora_apply_<dt>: for token n with adapter slot s = idx[n] and part p of a fused projection,
//   y[n, p*O + o] += sum_{r < ranks[s]} Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i].
//   Rows of slot 0 (the base model) or of rank 0 at this site are left alone.
//
// Work split: `order` lists the rows sorted by slot, so consecutive rows mostly share an adapter. Block
// (tile, p) takes LORA_TILE consecutive rows of that order: an adapter's A and Bt values are loaded once
// per run of equal slots in the tile and applied to every row of the run (the tile's x rows are staged in
// shared memory as fp32, LORA_CHUNK columns at a time). Shrink: each warp owns whole ranks, lanes read A
// with 8-element vector loads. Expand: each thread owns outputs o (coalesced over Bt's rows). h and the
// sums stay fp32; y is rounded once. Dynamic shared memory: LORA_TILE * (LORA_CHUNK + R) floats.
//
// Nothing is read on the host: which adapters a step holds is data on the device, so one captured CUDA
// graph serves every mix, adapters loaded after the capture included.

#define LORA_TILE 8
#define LORA_CHUNK 1024

template <typename T>
__device__ __forceinline__ void lora_apply_impl(T* __restrict__ y, const T* __restrict__ x,
                                                const T* __restrict__ A, const T* __restrict__ Bt,
                                                const i64* __restrict__ idx, const int* __restrict__ ranks,
                                                const i64* __restrict__ order, int N, int I, int O, int R, int P) {
  extern __shared__ float smem[];
  float* xs = smem;                              // [LORA_TILE][LORA_CHUNK]
  float* h = smem + LORA_TILE * LORA_CHUNK;      // [LORA_TILE][R]
  __shared__ i64 row_of[LORA_TILE], slot_of[LORA_TILE];  // slot 0: nothing to do for this tile row
  __shared__ int rank_of[LORA_TILE], tile_rank;
  const int p = blockIdx.y, tid = threadIdx.x;
  if (tid < LORA_TILE) {
    const i64 j = (i64)blockIdx.x * LORA_TILE + tid;
    i64 row = 0, s = 0;
    int rank = 0;
    if (j < N) {
      row = order[j];
      s = idx[row];
      rank = s > 0 ? ranks[s] : 0;
    }
    row_of[tid] = row;
    slot_of[tid] = rank > 0 ? s : 0;
    rank_of[tid] = rank > 0 ? min(rank, R) : 0;
  }
  __syncthreads();
  if (tid == 0) {
    int m = 0;
    for (int t = 0; t < LORA_TILE; ++t) m = max(m, rank_of[t]);
    tile_rank = m;
  }
  for (int k = tid; k < LORA_TILE * R; k += blockDim.x) h[k] = 0.f;
  __syncthreads();
  const int rank_max = tile_rank;
  if (rank_max == 0) return;  // block-uniform: every row of the tile is a base row here
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;

  // 1. shrink: h[t][r] = A[s_t, p, r, :] . x[row_t, :], chunk by chunk over I
  for (int c0 = 0; c0 < I; c0 += LORA_CHUNK) {
    const int len = min(LORA_CHUNK, I - c0);
    for (int v = tid; v < LORA_TILE * (len / 8); v += blockDim.x) {
      const int t = v / (len / 8), i = (v % (len / 8)) * 8;
      float vals[8];
      if (slot_of[t] != 0) load8(x + row_of[t] * I + c0 + i, vals);
#pragma unroll
      for (int k = 0; k < 8; ++k) xs[t * LORA_CHUNK + i + k] = slot_of[t] != 0 ? vals[k] : 0.f;
    }
    __syncthreads();
    for (int r = warp; r < rank_max; r += nwarps) {
      float acc[LORA_TILE];
#pragma unroll
      for (int t = 0; t < LORA_TILE; ++t) acc[t] = 0.f;
      for (int i = lane * 8; i < len; i += 32 * 8) {
        float a[8];
        i64 loaded = 0;
#pragma unroll
        for (int t = 0; t < LORA_TILE; ++t) {
          const i64 s = slot_of[t];
          if (s == 0 || r >= rank_of[t]) continue;  // warp-uniform
          if (s != loaded) {
            load8(A + ((s * P + p) * R + r) * (i64)I + c0 + i, a);
            loaded = s;
          }
          const float4 x0 = reinterpret_cast<const float4*>(xs + t * LORA_CHUNK + i)[0];
          const float4 x1 = reinterpret_cast<const float4*>(xs + t * LORA_CHUNK + i)[1];
          acc[t] += a[0] * x0.x + a[1] * x0.y + a[2] * x0.z + a[3] * x0.w + a[4] * x1.x + a[5] * x1.y +
                    a[6] * x1.z + a[7] * x1.w;
        }
      }
#pragma unroll
      for (int t = 0; t < LORA_TILE; ++t) {
        const float sum = warp_sum(acc[t]);
        if (lane == 0) h[t * R + r] += sum;  // one warp per r: no other writer
      }
    }
    __syncthreads();  // xs is rewritten by the next chunk; h is read below
  }

  // 2. expand: y[row_t, p*O + o] += sum_r h[t][r] * Bt[s_t, p, r, o]
  for (int o = tid; o < O; o += blockDim.x) {
    float acc[LORA_TILE];
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) acc[t] = 0.f;
    for (int r = 0; r < rank_max; ++r) {
      float b = 0.f;
      i64 loaded = 0;
#pragma unroll
      for (int t = 0; t < LORA_TILE; ++t) {
        const i64 s = slot_of[t];
        if (s == 0 || r >= rank_of[t]) continue;
        if (s != loaded) {
          b = to_f(Bt[((s * P + p) * R + r) * (i64)O + o]);
          loaded = s;
        }
        acc[t] += h[t * R + r] * b;
      }
    }
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) {
      if (slot_of[t] == 0) continue;
      T* out = y + (row_of[t] * P + p) * (i64)O + o;
      *out = from_f<T>(to_f(*out) + acc[t]);
    }
  }
}

#define LORA_KERNELS(S, T)                                                                                   \
  extern "C" __global__ void lora_apply_##S(T* y, const T* x, const T* A, const T* Bt, const i64* idx,       \
                                            const int* ranks, const i64* order, int N, int I, int O, int R,  \
                                            int P) {                                                         \
    lora_apply_impl<T>(y, x, A, Bt, idx, ranks, order, N, I, O, R, P);                                       \
  }
FOR_EACH_DTYPE(LORA_KERNELS)
