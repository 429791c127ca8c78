// lora.cu: LoRA for any mix of adapters and base rows, one launch per projection site.
//
// lora_apply_<dt>: for token n with adapter slot s = idx[n] and part p of a fused projection,
//   y[n, p*O + o] += sum_{r < ranks[s]} Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i].
//   Rows of slot 0 (the base model) or of rank 0 at this site are left alone.
//
// Work split: `order` lists the rows sorted by slot, so consecutive rows mostly share an adapter. Block
// (tile, p, z) takes LORA_TILE consecutive rows of that order and the outputs [z*1024, z*1024 + 1024) of
// part p. For each run of equal slots in the tile, an adapter's A and Bt values are loaded once and applied
// to every row of the run. At decode sizes the kernel is bound by memory latency (each dependent round
// trip to L2 or HBM costs about a microsecond), so every phase issues its loads in batches, all in flight
// together, and the chain of round trips is kept short:
//   1. order[j], then idx[row], then ranks[slot] (per tile row; threads 0..LORA_TILE-1);
//   2. stage the rows' x in shared memory as fp32, LORA_XCHUNK columns per pass (one batch);
//   3. shrink: warp w owns ranks w, w + 16, ...; each lane loads LORA_LOADS 8-element pieces of A's row
//      at once, then dots them with the staged x; a warp sum gives h[t][r];
//   4. expand: each thread owns 2 outputs; y and Bt (16 ranks at a time) are loaded in one batch.
// h and the sums stay fp32; y is rounded once. Block 512 threads; dynamic shared memory
// LORA_TILE * (LORA_XCHUNK + R) floats.
// Earlier versions, timed in the decode graph (600M, 256 rows; bench/NOTES.md): one block per row (v1,
// ~18 us a site); tiles whose warps walked A one load at a time (v2-v4, 14-46 us a site).
//
// Nothing is read on the host: which adapters a step holds is data on the device, so one captured CUDA
// graph serves every mix, adapters loaded after the capture included.

#define LORA_TILE 4
#define LORA_THREADS 512
#define LORA_OUT_PER_THREAD 2
#define LORA_XCHUNK 2048
#define LORA_LOADS 4

// Tile row t0 starts the run of its slot when the slot is live and no earlier row of the tile has it
// (rows sorted by slot make every run contiguous; any other order stays correct, only slower).
__device__ __forceinline__ bool run_start(const i64* slot_of /* shared */, int t0) {
  if (slot_of[t0] == 0) return false;
  for (int t = 0; t < t0; ++t)
    if (slot_of[t] == slot_of[t0]) return false;
  return true;
}

// h[t][r] += A[s_t, p, r, c0 : c0 + len] . xs[t, :len] for every live tile row t.
template <typename T>
__device__ __forceinline__ void lora_shrink(float* h, const float* xs, const T* __restrict__ A,
                                            const i64* slot_of, const int* rank_of, int rank_max, int c0,
                                            int len, int I, int R, int P, int p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int r = warp; r < rank_max; r += nwarps) {
    float acc[LORA_TILE];
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) acc[t] = 0.f;
    for (int t0 = 0; t0 < LORA_TILE; ++t0) {
      if (!run_start(slot_of, t0) || r >= rank_of[t0]) continue;  // warp-uniform
      const i64 s = slot_of[t0];
      const T* arow = A + ((s * P + p) * R + r) * (i64)I + c0;
      for (int cb = 0; cb < len; cb += 32 * 8 * LORA_LOADS) {
        float a[LORA_LOADS][8];
#pragma unroll
        for (int u = 0; u < LORA_LOADS; ++u) {  // the batch: LORA_LOADS independent loads per lane
          const int c = cb + (u * 32 + lane) * 8;
          if (c < len) load8(arow + c, a[u]);
        }
#pragma unroll
        for (int u = 0; u < LORA_LOADS; ++u) {
          const int c = cb + (u * 32 + lane) * 8;
          if (c >= len) continue;
#pragma unroll
          for (int t = 0; t < LORA_TILE; ++t) {
            if (slot_of[t] != s) continue;
            const float4 x0 = reinterpret_cast<const float4*>(xs + t * LORA_XCHUNK + c)[0];
            const float4 x1 = reinterpret_cast<const float4*>(xs + t * LORA_XCHUNK + c)[1];
            acc[t] += a[u][0] * x0.x + a[u][1] * x0.y + a[u][2] * x0.z + a[u][3] * x0.w + a[u][4] * x1.x +
                      a[u][5] * x1.y + a[u][6] * x1.z + a[u][7] * x1.w;
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) {
      const float sum = warp_sum(acc[t]);
      if (lane == 0) h[t * R + r] += sum;  // one warp per r: no other writer
    }
  }
}

template <typename T>
__device__ __forceinline__ void lora_apply_impl(T* __restrict__ y, const T* __restrict__ x,
                                                const T* __restrict__ A, const T* __restrict__ Bt,
                                                const i64* __restrict__ idx, const int* __restrict__ ranks,
                                                const i64* __restrict__ order, int N, int I, int O, int R, int P) {
  extern __shared__ float smem[];
  float* xs = smem;                            // [LORA_TILE][LORA_XCHUNK]
  float* h = smem + LORA_TILE * LORA_XCHUNK;   // [LORA_TILE][R]
  __shared__ i64 row_of[LORA_TILE], slot_of[LORA_TILE];  // slot 0: nothing to do for this tile row
  __shared__ int rank_of[LORA_TILE];
  const int p = blockIdx.y, tid = threadIdx.x;
  if (tid < LORA_TILE) {  // 1.
    const i64 j = (i64)blockIdx.x * LORA_TILE + tid;
    i64 row = 0, s = 0;
    int rank = 0;
    if (j < N) {
      row = order[j];
      s = idx[row];
      rank = s > 0 ? min(ranks[s], R) : 0;
    }
    row_of[tid] = row;
    slot_of[tid] = rank > 0 ? s : 0;
    rank_of[tid] = max(rank, 0);
  }
  for (int k = tid; k < LORA_TILE * R; k += blockDim.x) h[k] = 0.f;
  __syncthreads();
  i64 sl[LORA_TILE];
  int rank_max = 0;
#pragma unroll
  for (int t = 0; t < LORA_TILE; ++t) {
    sl[t] = slot_of[t];
    rank_max = max(rank_max, rank_of[t]);
  }
  if (rank_max == 0) return;  // block-uniform: every row of the tile is a base row here

  for (int c0 = 0; c0 < I; c0 += LORA_XCHUNK) {
    const int len = min(LORA_XCHUNK, I - c0), vecs = len / 8;
    for (int v = tid; v < LORA_TILE * vecs; v += blockDim.x) {  // 2.
      const int t = v / vecs, c = (v % vecs) * 8;
      float vals[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (slot_of[t] != 0) load8(x + row_of[t] * I + c0 + c, vals);
      reinterpret_cast<float4*>(xs + t * LORA_XCHUNK + c)[0] = make_float4(vals[0], vals[1], vals[2], vals[3]);
      reinterpret_cast<float4*>(xs + t * LORA_XCHUNK + c)[1] = make_float4(vals[4], vals[5], vals[6], vals[7]);
    }
    __syncthreads();
    lora_shrink(h, xs, A, slot_of, rank_of, rank_max, c0, len, I, R, P, p);  // 3.
    __syncthreads();  // xs is rewritten by the next pass; h is read below
  }

  // 4. expand: y[row_t, p*O + o] += sum_r h[t][r] * Bt[s_t, p, r, o] for this thread's outputs o
  const int o0 = blockIdx.z * LORA_THREADS * LORA_OUT_PER_THREAD + tid;
  float acc[LORA_OUT_PER_THREAD][LORA_TILE];
#pragma unroll
  for (int k = 0; k < LORA_OUT_PER_THREAD; ++k) {
    const int o = o0 + k * LORA_THREADS;
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t)
      acc[k][t] = (sl[t] != 0 && o < O) ? to_f(y[(row_of[t] * P + p) * (i64)O + o]) : 0.f;
  }
  for (int t0 = 0; t0 < LORA_TILE; ++t0) {
    if (!run_start(slot_of, t0)) continue;
    const i64 s = slot_of[t0];
    const int rank = rank_of[t0];
    const T* bt = Bt + (s * P + p) * R * (i64)O;
    for (int r0 = 0; r0 < rank; r0 += 16) {
      float b[LORA_OUT_PER_THREAD][16];
#pragma unroll
      for (int k = 0; k < LORA_OUT_PER_THREAD; ++k) {
        const int o = o0 + k * LORA_THREADS;
#pragma unroll
        for (int j = 0; j < 16; ++j) b[k][j] = (o < O && r0 + j < rank) ? to_f(bt[(i64)(r0 + j) * O + o]) : 0.f;
      }
#pragma unroll
      for (int t = 0; t < LORA_TILE; ++t) {
        if (sl[t] != s) continue;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float hv = r0 + j < rank ? h[t * R + r0 + j] : 0.f;
#pragma unroll
          for (int k = 0; k < LORA_OUT_PER_THREAD; ++k) acc[k][t] += hv * b[k][j];
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < LORA_TILE; ++t) {
    if (sl[t] == 0) continue;
#pragma unroll
    for (int k = 0; k < LORA_OUT_PER_THREAD; ++k) {
      const int o = o0 + k * LORA_THREADS;
      if (o < O) y[(row_of[t] * P + p) * (i64)O + o] = from_f<T>(acc[k][t]);
    }
  }
}

#define LORA_KERNELS(S, T)                                                                                   \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS)                                                 \
      lora_apply_##S(T* y, const T* x, const T* A, const T* Bt, const i64* idx, const int* ranks,            \
                     const i64* order, int N, int I, int O, int R, int P) {                                  \
    lora_apply_impl<T>(y, x, A, Bt, idx, ranks, order, N, I, O, R, P);                                       \
  }
FOR_EACH_DTYPE(LORA_KERNELS)
