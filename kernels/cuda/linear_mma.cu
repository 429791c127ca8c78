// linear_mma.cu: a linear layer for 4 to 16 rows on tensor cores (the decode step of a few sentences, or of one
// sentence's beams), bias and ReLU fused.
//
// linear_mma<NT>_<bf16|f16>: y[m, o] = act(sum_i x[m, i] * W[o, i] + b[o]) for m < M <= 8 NT, with
//   linear_rows's arguments and layout (gemv.cu). The product is taken transposed, y^T = W x^T: 16 outputs of W
//   fill the mma's 16-row side and the rows of x its 8-column side (NT tiles of 8 rows), so W is read once for
//   all rows and the arithmetic is the tensor cores', not the lanes' (the GEMV's limit past a few rows). A sum
//   over the columns does not depend on their order, so each lane loads 8 adjacent columns of its W row and of
//   its x row with one 16-byte load and feeds them to two mma steps as if they were the fragment's columns
//   2q, 2q+1, 8+2q, 9+2q: no shared-memory staging and no ldmatrix. Each warp owns 16 outputs and one of
//   `ksplit` interleaved parts of their 32-column chunks (the block's warps: 8 / ksplit groups of outputs x
//   ksplit parts). A batch is LOADS chunks of W and of every x tile, all in flight before the batch's
//   arithmetic (a chain of dependent loads is what bounds a warp here); the first batch of W is issued before
//   the programmatic-launch wait (W is constant). The parts' fp32 sums meet in shared memory, added in order
//   (one rounding). Block 8 warps; I a multiple of 8; x and W rows 16-byte aligned.
//   Not kept: a cluster of 4 blocks per outputs, each a quarter of the columns, the sums met through DSMEM
//   (docs/performance.md, "Linear layers").

#define MMA_WARPS 8
#define MMA_CHUNK 32   // columns of one output row that 4 lanes read with one 16-byte load each
// Chunks a batch (LOADS): W's and x's 16-byte loads in flight, 2 + NT a chunk. 4, or 8 where a warp's part of the
// columns is over 4 chunks and the launch is one wave of blocks (ops_linear.mma_loads): the registers of 8 leave
// one block an SM.

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // sm_90, where it is measured (ops_linear.mma_takes)
template <typename T> __device__ __forceinline__ uint4 load16_or_zero(const T* p, bool ok) {
  return ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0u, 0u, 0u, 0u);
}

// Where a warp's batches of chunks are: part `part` of `parts` takes chunks part, part + parts, ...
template <int LOADS> struct MmaChunks {
  int part, parts, chunks;
  __device__ __forceinline__ int chunk(int j, int u) const { return part + parts * (j * LOADS + u); }
};

// Batch j of W: this warp's rows o0 + g and o0 + g + 8, lane q's 8 columns of each chunk; zeros past O and I.
template <typename T, int LOADS>
__device__ __forceinline__ void load_w_batch(const T* __restrict__ W, i64 ldw, int I, int O, int o0,
                                             MmaChunks<LOADS> at, int j, int g, int q, uint4 (&w)[LOADS][2]) {
#pragma unroll
  for (int u = 0; u < LOADS; ++u) {
    const int c = at.chunk(j, u) * MMA_CHUNK + 8 * q;
    w[u][0] = load16_or_zero(W + (i64)(o0 + g) * ldw + c, o0 + g < O && c < I);
    w[u][1] = load16_or_zero(W + (i64)(o0 + g + 8) * ldw + c, o0 + g + 8 < O && c < I);
  }
}

// Batch j of x: row 8 n + g of each tile n, lane q's 8 columns of each chunk; zeros past M and I.
template <typename T, int NT, int LOADS>
__device__ __forceinline__ void load_x_batch(const T* __restrict__ x, i64 ldx, int M, int I, MmaChunks<LOADS> at,
                                             int j, int g, int q, uint4 (&xv)[LOADS][NT]) {
#pragma unroll
  for (int u = 0; u < LOADS; ++u) {
    const int c = at.chunk(j, u) * MMA_CHUNK + 8 * q;
#pragma unroll
    for (int n = 0; n < NT; ++n) xv[u][n] = load16_or_zero(x + (i64)(8 * n + g) * ldx + c, 8 * n + g < M && c < I);
  }
}

template <typename T, int NT, int LOADS>
__device__ __forceinline__ void linear_mma_impl(const T* __restrict__ x, i64 ldx, const T* __restrict__ W, i64 ldw,
                                                const T* __restrict__ b, T* __restrict__ y, int M, int I, int O,
                                                int relu, int ksplit) {
  __shared__ float partial[MMA_WARPS][16][8 * NT + 4];  // [warp][output][row]; +4 spreads the banks
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const MmaChunks<LOADS> at{warp % ksplit, ksplit, (I + MMA_CHUNK - 1) / MMA_CHUNK};
  const int o0 = (blockIdx.x * (MMA_WARPS / ksplit) + warp / ksplit) * 16;
  const int batches = (at.chunks + LOADS * at.parts - 1) / (LOADS * at.parts);

  // 1. the batches: W's and x's loads, then the mma steps (c fragments: output g, rows 2q, 2q+1 of tile n;
  //    output g + 8, the same)
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  uint4 w[LOADS][2], xv[LOADS][NT];
  load_w_batch<T, LOADS>(W, ldw, I, O, o0, at, 0, g, q, w);
  pdl_enter();
  for (int j = 0; j < batches; ++j) {
    if (j > 0) load_w_batch<T, LOADS>(W, ldw, I, O, o0, at, j, g, q, w);
    load_x_batch<T, NT, LOADS>(x, ldx, M, I, at, j, g, q, xv);
#pragma unroll
    for (int u = 0; u < LOADS; ++u) {
      if (at.chunk(j, u) >= at.chunks) break;  // the same for every lane: mma.sync needs the whole warp
      const unsigned a_lo[4] = {w[u][0].x, w[u][1].x, w[u][0].y, w[u][1].y};  // columns c .. c+3
      const unsigned a_hi[4] = {w[u][0].z, w[u][1].z, w[u][0].w, w[u][1].w};  // columns c+4 .. c+7
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (8 * n >= M) break;
        const unsigned b_lo[2] = {xv[u][n].x, xv[u][n].y}, b_hi[2] = {xv[u][n].z, xv[u][n].w};
        mma16816(acc[n], a_lo, b_lo, T());
        mma16816(acc[n], a_hi, b_hi, T());
      }
    }
  }

  // 2. every warp's sums to shared memory; one thread per (row, output) of the block adds the parts in order
  //    (consecutive threads, consecutive outputs)
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    partial[warp][g][8 * n + 2 * q] = acc[n][0];
    partial[warp][g][8 * n + 2 * q + 1] = acc[n][1];
    partial[warp][g + 8][8 * n + 2 * q] = acc[n][2];
    partial[warp][g + 8][8 * n + 2 * q + 1] = acc[n][3];
  }
  __syncthreads();
  const int outs = (MMA_WARPS / ksplit) * 16;
  for (int t = threadIdx.x; t < M * outs; t += blockDim.x) {
    const int m = t / outs, group = (t % outs) / 16, k = t % 16, o = blockIdx.x * outs + t % outs;
    if (o >= O) continue;
    float s = 0.f;
    for (int p = 0; p < ksplit; ++p) s += partial[group * ksplit + p][k][m];
    store_linear_out(y, m, o, O, s, b, relu);
  }
}

#define MMA_KERNEL(S, T, NT, LOADS)                                                                          \
  extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) linear_mma##NT##_l##LOADS##_##S(              \
      const T* x, i64 ldx, const T* W, i64 ldw, const T* b, T* y, int M, int I, int O, int relu,            \
      int ksplit) {                                                                                          \
    linear_mma_impl<T, NT, LOADS>(x, ldx, W, ldw, b, y, M, I, O, relu, ksplit);                             \
  }
#define MMA_KERNELS(S, T) MMA_KERNEL(S, T, 1, 4) MMA_KERNEL(S, T, 2, 4) MMA_KERNEL(S, T, 1, 8) MMA_KERNEL(S, T, 2, 8)
MMA_KERNELS(bf16, bf16)
MMA_KERNELS(f16, __half)
#endif
