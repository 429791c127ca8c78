// lora.cu: LoRA for any mix of adapters and base rows, one launch per projection site.
//
// lora_apply_<dt>: for token n with adapter slot s = idx[n] and part p of a fused projection,
//   y[n, p*O + o] += sum_{r < ranks[s]} Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i].
//   Rows of slot 0 (the base model) or of rank 0 at this site are left alone.
//
// Work split: `order` lists the rows sorted by slot, so consecutive rows mostly share an adapter. Block
// (tile, p, z) takes LORA_TILE consecutive rows of that order and the outputs [z*1024, z*1024 + 1024) of
// part p (4 per thread). For each run of equal slots in the tile, an adapter's A and Bt values are loaded
// once and applied to every row of the run. Shrink: each warp owns whole ranks; lanes read A and the
// rows' x with 8-element vector loads (x comes from L1 after the first warp). Expand: each thread reads
// Bt 8 ranks at a time for its 4 outputs (coalesced over o), all loads issued before the FMAs. h and the
// sums stay fp32; y is rounded once. Block 256 threads; dynamic shared memory LORA_TILE * R floats.
// Earlier versions, timed in the decode graph (600M, 256 rows; bench/NOTES.md): one block per row re-read
// the adapter for every row (~18 us a site); x staged in shared memory with one block per tile left most
// SMs idle (~85 us; ~21 us with the outputs split over blocks).
//
// Nothing is read on the host: which adapters a step holds is data on the device, so one captured CUDA
// graph serves every mix, adapters loaded after the capture included.

#define LORA_TILE 8
#define LORA_OUT_PER_THREAD 4

// Tile row t0 starts the run of its slot when the slot is live and no earlier row of the tile has it
// (rows sorted by slot make every run contiguous; any other order stays correct, only slower).
__device__ __forceinline__ bool run_start(const i64* slot_of /* shared */, int t0) {
  if (slot_of[t0] == 0) return false;
  for (int t = 0; t < t0; ++t)
    if (slot_of[t] == slot_of[t0]) return false;
  return true;
}

// h[t][r] = A[s_t, p, r, :] . x[row_t, :] for the tile's live rows.
template <typename T>
__device__ __forceinline__ void lora_shrink(float* h, const T* __restrict__ x, const T* __restrict__ A,
                                            const i64* row_of, const i64* slot_of, const int* rank_of,
                                            int rank_max, int I, int R, int P, int p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int r = warp; r < rank_max; r += nwarps) {
    float acc[LORA_TILE];
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) acc[t] = 0.f;
    for (int t0 = 0; t0 < LORA_TILE; ++t0) {
      if (!run_start(slot_of, t0) || r >= rank_of[t0]) continue;  // warp-uniform
      const i64 s = slot_of[t0];
      const T* arow = A + ((s * P + p) * R + r) * (i64)I;
      for (int i = lane * 8; i < I; i += 32 * 8) {
        float a[8];
        load8(arow + i, a);
#pragma unroll
        for (int t = 0; t < LORA_TILE; ++t) {
          if (slot_of[t] != s) continue;
          float v[8];
          load8(x + row_of[t] * I + i, v);
          acc[t] += a[0] * v[0] + a[1] * v[1] + a[2] * v[2] + a[3] * v[3] + a[4] * v[4] + a[5] * v[5] +
                    a[6] * v[6] + a[7] * v[7];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) {
      const float sum = warp_sum(acc[t]);
      if (lane == 0) h[t * R + r] = sum;  // one warp per r: no other writer
    }
  }
}

template <typename T>
__device__ __forceinline__ void lora_apply_impl(T* __restrict__ y, const T* __restrict__ x,
                                                const T* __restrict__ A, const T* __restrict__ Bt,
                                                const i64* __restrict__ idx, const int* __restrict__ ranks,
                                                const i64* __restrict__ order, int N, int I, int O, int R, int P) {
  extern __shared__ float h[];  // [LORA_TILE][R]
  __shared__ i64 row_of[LORA_TILE], slot_of[LORA_TILE];  // slot 0: nothing to do for this tile row
  __shared__ int rank_of[LORA_TILE];
  const int p = blockIdx.y, tid = threadIdx.x;
  if (tid < LORA_TILE) {
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

  lora_shrink(h, x, A, row_of, slot_of, rank_of, rank_max, I, R, P, p);
  __syncthreads();

  // expand: y[row_t, p*O + o] += sum_r h[t][r] * Bt[s_t, p, r, o] for this thread's outputs o
  const int o0 = blockIdx.z * blockDim.x * LORA_OUT_PER_THREAD + tid;
  float acc[LORA_OUT_PER_THREAD][LORA_TILE];
#pragma unroll
  for (int k = 0; k < LORA_OUT_PER_THREAD; ++k)
#pragma unroll
    for (int t = 0; t < LORA_TILE; ++t) acc[k][t] = 0.f;
  for (int t0 = 0; t0 < LORA_TILE; ++t0) {
    if (!run_start(slot_of, t0)) continue;
    const i64 s = slot_of[t0];
    const int rank = rank_of[t0];
    const T* bt = Bt + (s * P + p) * R * (i64)O;
    for (int r0 = 0; r0 < rank; r0 += 8) {
      float b[LORA_OUT_PER_THREAD][8];
#pragma unroll
      for (int k = 0; k < LORA_OUT_PER_THREAD; ++k) {
        const int o = o0 + k * blockDim.x;
#pragma unroll
        for (int j = 0; j < 8; ++j) b[k][j] = (o < O && r0 + j < rank) ? to_f(bt[(i64)(r0 + j) * O + o]) : 0.f;
      }
#pragma unroll
      for (int t = 0; t < LORA_TILE; ++t) {
        if (sl[t] != s) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
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
      const int o = o0 + k * blockDim.x;
      if (o >= O) continue;
      T* out = y + (row_of[t] * P + p) * (i64)O + o;
      *out = from_f<T>(to_f(*out) + acc[k][t]);
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
