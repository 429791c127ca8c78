// gemv.cu: a linear layer for one row (the decode step of one sentence), bias and ReLU fused.
//
// linear_row_<dt>: y[o] = act(sum_i x[i] * W[o, i] + b[o]), W row-major [O, I] (a torch Linear weight), act = ReLU
//   when relu != 0. At one row the layer is a read of W. Each warp owns GEMV_OUT_PER_WARP outputs; its lanes read
//   the W rows with 16-byte loads, GEMV_LOADS per lane in flight before any arithmetic, and x (shared by every
//   warp) through L1. fp32 sums, one rounding. Block 256 threads (8 warps); I a multiple of 8.
//   Timed in a CUDA graph on the H200 (tests/kernels test_timings): 3.9 / 4.1 / 7.5 us for 1024->3072 /
//   1024->4096 / 4096->1024 against cuBLAS's 4.6 / 4.7 / 6.9; inside the decode step cuBLAS's small-M kernels
//   (split-K with a separate reduce) cost more, and the step went from 0.94 to 0.74 ms of GPU time. A version for
//   up to 8 rows lost to cuBLAS from 2 rows on (10.9 us against 4.5 at 8 rows), so only one row comes here.

#define GEMV_OUT_PER_WARP 2
#define GEMV_LOADS 4

#define GEMV_CHUNK (32 * 8 * GEMV_LOADS)  // W columns a warp reads per iteration

// One iteration's W: GEMV_LOADS 16-byte loads per output row, all in flight before any arithmetic.
template <typename T>
__device__ __forceinline__ void load_w_chunk(const T* __restrict__ W, int I, int O, int o0, int c0,
                                             float (&w)[GEMV_OUT_PER_WARP][GEMV_LOADS][8]) {
#pragma unroll
  for (int k = 0; k < GEMV_OUT_PER_WARP; ++k)
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
      const int c = c0 + u * 32 * 8;
      if (o0 + k < O && c < I) load8(W + (i64)(o0 + k) * I + c, w[k][u]);
    }
}

// M <= MR rows of x (row stride ldx), MR a compile-time bound: the weights are read once for all rows.
template <typename T, int MR>
__device__ __forceinline__ void linear_rows_impl(const T* __restrict__ x, i64 ldx, const T* __restrict__ W,
                                                 const T* __restrict__ b, T* __restrict__ y, int M, int I, int O,
                                                 int relu) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_OUT_PER_WARP;
  if (o0 >= O) return;
  float acc[MR][GEMV_OUT_PER_WARP];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) acc[m][k] = 0.f;
  float w[GEMV_OUT_PER_WARP][GEMV_LOADS][8];
  load_w_chunk(W, I, O, o0, lane * 8, w);  // before the wait: W is constant, this read overlaps the kernel before
  pdl_enter();
  for (int c0 = lane * 8; c0 < I; c0 += GEMV_CHUNK) {
    if (c0 != lane * 8) load_w_chunk(W, I, O, o0, c0, w);
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
      const int c = c0 + u * 32 * 8;
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
  for (int m = 0; m < MR; ++m) {
    if (m >= M) break;
#pragma unroll
    for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) {
      const int o = o0 + k;
      float s = warp_sum(acc[m][k]);
      if (lane == 0 && o < O) {
        s += b != nullptr ? to_f(b[o]) : 0.f;
        y[(i64)m * O + o] = from_f<T>(relu && s < 0.f ? 0.f : s);
      }
    }
  }
}

#define GEMV_KERNEL(S, T, MR)                                                                                \
  extern "C" __global__ void __launch_bounds__(256) linear_rows##MR##_##S(                                   \
      const T* x, i64 ldx, const T* W, const T* b, T* y, int M, int I, int O, int relu) {                   \
    linear_rows_impl<T, MR>(x, ldx, W, b, y, M, I, O, relu);                                                \
  }
#define GEMV_KERNELS(S, T) GEMV_KERNEL(S, T, 1) GEMV_KERNEL(S, T, 2) GEMV_KERNEL(S, T, 4) GEMV_KERNEL(S, T, 8)
FOR_EACH_DTYPE(GEMV_KERNELS)
