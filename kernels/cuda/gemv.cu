// gemv.cu: a linear layer for a handful of rows (decode steps of one sentence or a few), bias and ReLU fused.
//
// linear_small_<dt>: y[m, o] = act(sum_i x[m, i] * W[o, i] + b[o]) for m < M <= GEMV_MAX_ROWS, W row-major [O, I]
//   (a torch Linear weight), act = ReLU when relu != 0. At M <= 8 the layer is a read of W: cuBLAS took ~7 us
//   per 1024 x 1024..4096 layer at one row on the H200 (about 1 TB/s), 72 of them a decode step. Here each warp
//   owns GEMV_OUT_PER_WARP outputs; its lanes read the W rows with 16-byte loads, GEMV_LOADS per lane in flight
//   before any arithmetic, and x (a few KB, shared by every warp) through L1. fp32 sums, one rounding.
//   Block 256 threads (8 warps); I a multiple of 8.

#define GEMV_MAX_ROWS 8
#define GEMV_OUT_PER_WARP 2
#define GEMV_LOADS 4

template <typename T>
__device__ __forceinline__ void linear_small_impl(const T* __restrict__ x, const T* __restrict__ W,
                                                  const T* __restrict__ b, T* __restrict__ y, int M, int I, int O,
                                                  int relu) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int o0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_OUT_PER_WARP;
  if (o0 >= O) return;
  float acc[GEMV_OUT_PER_WARP][GEMV_MAX_ROWS];
#pragma unroll
  for (int k = 0; k < GEMV_OUT_PER_WARP; ++k)
#pragma unroll
    for (int m = 0; m < GEMV_MAX_ROWS; ++m) acc[k][m] = 0.f;
  for (int c0 = lane * 8; c0 < I; c0 += 32 * 8 * GEMV_LOADS) {
    float w[GEMV_OUT_PER_WARP][GEMV_LOADS][8];
#pragma unroll
    for (int k = 0; k < GEMV_OUT_PER_WARP; ++k)
#pragma unroll
      for (int u = 0; u < GEMV_LOADS; ++u) {
        const int c = c0 + u * 32 * 8;
        if (o0 + k < O && c < I) load8(W + (i64)(o0 + k) * I + c, w[k][u]);
      }
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
      const int c = c0 + u * 32 * 8;
      if (c >= I) continue;
#pragma unroll
      for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
        if (m >= M) break;
        float v[8];
        load8(x + (i64)m * I + c, v);
#pragma unroll
        for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) {
          if (o0 + k >= O) continue;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[k][m] += w[k][u][e] * v[e];
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < GEMV_OUT_PER_WARP; ++k) {
    const int o = o0 + k;
#pragma unroll
    for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
      if (m >= M) break;
      float s = warp_sum(acc[k][m]);
      if (lane == 0 && o < O) {
        s += b != nullptr ? to_f(b[o]) : 0.f;
        y[(i64)m * O + o] = from_f<T>(relu && s < 0.f ? 0.f : s);
      }
    }
  }
}

#define GEMV_KERNELS(S, T)                                                                                   \
  extern "C" __global__ void __launch_bounds__(256)                                                          \
      linear_small_##S(const T* x, const T* W, const T* b, T* y, int M, int I, int O, int relu) {           \
    linear_small_impl<T>(x, W, b, y, M, I, O, relu);                                                        \
  }
FOR_EACH_DTYPE(GEMV_KERNELS)
