// gemv.cu: a linear layer for a few rows (the decode step of one sentence, or its beams), bias and ReLU fused.
//
// linear_rows<MR>_<dt>: y[m, o] = act(sum_i x[m, i] * W[o, i] + b[o]) for m < M <= MR, W row-major [O, I] with rows
//   ldw apart (a torch Linear weight, or the first columns of a wider one: engine/lora.py), act = ReLU when
//   relu != 0. The layer is then a read of W, made once for all rows. Each warp owns GEMV_OUT_PER_WARP outputs
//   and one of `ksplit` interleaved parts of their columns; its lanes read W with 16-byte loads, GEMV_LOADS per
//   lane in flight before any arithmetic, x (shared by every warp) through L1, and the parts' fp32 sums meet in
//   shared memory (one rounding). The first batch of W loads is issued before the
//   programmatic-launch wait, so it overlaps the kernel before (common.cuh, pdl_enter). Block 8 warps; I a
//   multiple of 8.
//   Timed in a CUDA graph on the H200 (python3 -m bench.kernels), one row:
//   2.7 / 3.0 / 3.2 us for 1024->3072 / 1024->4096 / 4096->1024 (ksplit 1, 1, 4) against cuBLAS's 4.3 / 4.4 / 6.7.
//   Four rows: 5.0 / 5.3 / 5.5 against cuBLAS's 4.2 / 4.3 / 7.0 alone (the FMA work grows with the rows while
//   the W read does not), but inside a beam step cuBLAS took 7.1 us a 1024 -> 1024 at 4 rows, so ops.linear
//   sends up to 4 rows here.

#define GEMV_OUT_PER_WARP 1
#define GEMV_LOADS 4
#define GEMV_WARPS 8
#define GEMV_SLOT 256  // columns a warp covers with one 16-byte load per lane

// W[o0 + k, slot columns] of this warp's load batch j: GEMV_LOADS 16-byte loads per output row, all in flight
// before any arithmetic. Slot s of the row is read by the warp of part s % ksplit.
template <typename T>
__device__ __forceinline__ void load_w_batch(const T* __restrict__ W, i64 ldw, int I, int O, int o0, int part,
                                             int ksplit, int j, int lane,
                                             float (&w)[GEMV_OUT_PER_WARP][GEMV_LOADS][8]) {
#pragma unroll
  for (int k = 0; k < GEMV_OUT_PER_WARP; ++k)
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
      const int c = (part + ksplit * (j * GEMV_LOADS + u)) * GEMV_SLOT + lane * 8;
      if (o0 + k < O && c < I) load8(W + (o0 + k) * ldw + c, w[k][u]);
    }
}

// M <= MR rows of x (row stride ldx): W is read once for all of them. The block's 8 warps are
// GEMV_WARPS / ksplit groups of GEMV_OUT_PER_WARP outputs x ksplit parts of their columns; the parts' sums
// meet in shared memory.
template <typename T, int MR>
__device__ __forceinline__ void linear_rows_impl(const T* __restrict__ x, i64 ldx, const T* __restrict__ W,
                                                 i64 ldw, const T* __restrict__ b, T* __restrict__ y, int M, int I,
                                                 int O, int relu, int ksplit) {
  __shared__ float partial[GEMV_WARPS][MR][GEMV_OUT_PER_WARP];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = warp % ksplit;
  const int o0 = (blockIdx.x * (GEMV_WARPS / ksplit) + warp / ksplit) * GEMV_OUT_PER_WARP;
  const int batches = (I + GEMV_SLOT * GEMV_LOADS * ksplit - 1) / (GEMV_SLOT * GEMV_LOADS * ksplit);
  float acc[MR][GEMV_OUT_PER_WARP];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) acc[m][k] = 0.f;
  float w[GEMV_OUT_PER_WARP][GEMV_LOADS][8];
  load_w_batch(W, ldw, I, O, o0, part, ksplit, 0, lane, w);  // before the wait: W is constant (overlaps the kernel
                                                            // before)
  pdl_enter();
  for (int j = 0; j < batches; ++j) {
    if (j > 0) load_w_batch(W, ldw, I, O, o0, part, ksplit, j, lane, w);
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
      const int c = (part + ksplit * (j * GEMV_LOADS + u)) * GEMV_SLOT + lane * 8;
      if (c >= I) continue;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m >= M) break;
        float v[8];
        load8(x + m * ldx + c, v);
#pragma unroll
        for (int k = 0; k < GEMV_OUT_PER_WARP; ++k)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][k] = fmaf(w[k][u][e], v[e], acc[m][k]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) {
      const float s = warp_sum(acc[m][k]);
      if (lane == 0) partial[warp][m][k] = s;
    }
  __syncthreads();
  // one thread per (row, output) of the block sums the parts in order
  const int outs = (GEMV_WARPS / ksplit) * GEMV_OUT_PER_WARP;
  for (int t = threadIdx.x; t < M * outs; t += blockDim.x) {
    const int m = t / outs, group = (t % outs) / GEMV_OUT_PER_WARP, k = t % GEMV_OUT_PER_WARP;
    const int o = blockIdx.x * outs + t % outs;
    if (o >= O) continue;
    float s = 0.f;
    for (int q = 0; q < ksplit; ++q) s += partial[group * ksplit + q][m][k];
    store_linear_out(y, m, o, O, s, b, relu);
  }
}

#define GEMV_KERNEL(S, T, MR)                                                                                \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) linear_rows##MR##_##S(                       \
      const T* x, i64 ldx, const T* W, i64 ldw, const T* b, T* y, int M, int I, int O, int relu,            \
      int ksplit) {                                                                                          \
    linear_rows_impl<T, MR>(x, ldx, W, ldw, b, y, M, I, O, relu, ksplit);                                   \
  }
#define GEMV_KERNELS(S, T) GEMV_KERNEL(S, T, 1) GEMV_KERNEL(S, T, 2) GEMV_KERNEL(S, T, 4)
FOR_EACH_DTYPE(GEMV_KERNELS)
