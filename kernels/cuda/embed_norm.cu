// embed_norm.cu: token embedding and the fused residual add + LayerNorm.
//
// embed_<dt>:          out[n, :] = round(table[ids[n], :] * scale) + pos_table[positions[n], :]
//                      (the product rounded to the storage type first, exactly as the PyTorch reference
//                      computes it on bf16 tensors). One block per token.
// add_layer_norm_<dt>: h = residual + x (x may be null: h = residual, not rewritten), rounded to the
//                      storage type; normed = (h - mean) / sqrt(var + eps) * weight + bias, statistics in
//                      fp32 over the rounded h (two passes over a shared-memory copy of the row).
//                      One block per row; dynamic shared memory d floats.

template <typename T>
__device__ __forceinline__ void embed_impl(const i64* __restrict__ ids, const i64* __restrict__ positions,
                                           const T* __restrict__ table, const T* __restrict__ pos_table,
                                           float scale, T* __restrict__ out, int d) {
  const int n = blockIdx.x;
  const T* e = table + ids[n] * (i64)d;
  const T* p = pos_table + positions[n] * (i64)d;
  T* o = out + (i64)n * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = from_f<T>(round_to<T>(to_f(e[i]) * scale) + to_f(p[i]));
}

template <typename T>
__device__ __forceinline__ void add_layer_norm_impl(const T* __restrict__ residual, const T* __restrict__ x,
                                                    const T* __restrict__ weight, const T* __restrict__ bias,
                                                    float eps, T* __restrict__ h_out, T* __restrict__ normed,
                                                    int d) {
  extern __shared__ float row[];
  __shared__ float scratch[33];
  const i64 off = (i64)blockIdx.x * d;
  float sum = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float h = to_f(residual[off + i]);
    if (x != nullptr) {
      h = round_to<T>(h + to_f(x[off + i]));
      h_out[off + i] = from_f<T>(h);
    }
    row[i] = h;
    sum += h;
  }
  const float mean = block_sum(sum, scratch) / d;
  float sq = 0.f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) { float c = row[i] - mean; sq += c * c; }
  const float rstd = rsqrtf(block_sum(sq, scratch) / d + eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    normed[off + i] = from_f<T>((row[i] - mean) * rstd * to_f(weight[i]) + to_f(bias[i]));
}

#define EMBED_NORM_KERNELS(S, T)                                                                          \
  extern "C" __global__ void embed_##S(const i64* ids, const i64* positions, const T* table,             \
                                       const T* pos_table, float scale, T* out, int d) {                   \
    embed_impl<T>(ids, positions, table, pos_table, scale, out, d);                                       \
  }                                                                                                       \
  extern "C" __global__ void add_layer_norm_##S(const T* residual, const T* x, const T* weight,          \
                                                const T* bias, float eps, T* h_out, T* normed, int d) {   \
    add_layer_norm_impl<T>(residual, x, weight, bias, eps, h_out, normed, d);                             \
  }
FOR_EACH_DTYPE(EMBED_NORM_KERNELS)
