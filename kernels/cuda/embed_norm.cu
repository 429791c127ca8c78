// embed_norm.cu: token embedding and the fused residual add + LayerNorm.
//
// embed_<dt>:          out[n, :] = round(table[ids[n], :] * scale) + pos_table[positions[n], :]
//                      (the product rounded to the storage type first, exactly as the PyTorch reference
//                      computes it on bf16 tensors). One block per token.
// add_layer_norm_<dt>: h = residual + x (x may be null: h = residual, not rewritten), rounded to the
//                      storage type; normed = (h - mean) / sqrt(var + eps) * weight + bias, statistics in
//                      fp32 over the rounded h (two passes over the row held in registers). x's rows are
//                      x_ld apart. add_layer_norm_lora_<dt>: x is the output of a projection over its weight
//                      stacked on every slot's LoRA A (d outputs, then h), and the row's delta (lora_expand8)
//                      is added to its first d columns, rounded, before the residual add.
//                      One block per row, d a multiple of 8 on 16-byte boundaries.

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

// The row stays in registers, LN_CHUNKS pieces of 8 a thread, and weight and bias are loaded with it, so
// the kernel makes one trip to memory (v1 kept the row in shared memory, read weight and bias after the
// statistics, one element a load: 4.1 us a one-row launch inside the decode graph, bench/NOTES.md).
#define LN_CHUNKS 2  // pieces of 8 a thread: d up to 8 x 2 x 256 = 4096 (ops.LN_MAX_D; NLLB-3.3B has 2048)

template <typename T, bool kLora>
__device__ __forceinline__ void add_layer_norm_impl(const T* __restrict__ residual, const T* __restrict__ x,
                                                    i64 x_ld, const T* __restrict__ Bt, const i64* __restrict__ idx,
                                                    const int* __restrict__ ranks, int S, int R,
                                                    const T* __restrict__ weight, const T* __restrict__ bias,
                                                    float eps, T* __restrict__ h_out, T* __restrict__ normed, int d) {
  __shared__ float scratch[33];
  const i64 off = (i64)blockIdx.x * d, x_off = (i64)blockIdx.x * x_ld;
  LoraSlot slot = {0, 0};  // Bt: [S, 1, R, d]; idx: each row's slot; ranks: [S]
  Raw8<T> fetched[16];     // the first piece's first-pass Bt rows
  if (kLora) {
    slot = lora_slot(idx[blockIdx.x], ranks, R);
    if (threadIdx.x * 8 < d) lora_fetch8(fetched, Bt, slot, 0, threadIdx.x * 8, R, d, 1);
  }
  pdl_enter();
  float v[LN_CHUNKS][8], w[LN_CHUNKS][8], b[LN_CHUNKS][8];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    const int c = (threadIdx.x + k * blockDim.x) * 8;
    if (c >= d) continue;
    load8(residual + off + c, v[k]);
    load8(weight + c, w[k]);
    load8(bias + c, b[k]);
    if (x != nullptr) {
      float xv[8];
      load8(x + x_off + c, xv);
      if (kLora && slot.s > 0) {
        float delta[8];
        lora_expand8<T>(delta, x + x_off + d, slot, k == 0 ? fetched : nullptr, Bt, 0, c, S, R, d, 1);
#pragma unroll
        for (int e = 0; e < 8; ++e) xv[e] = round_to<T>(xv[e] + delta[e]);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] = round_to<T>(v[k][e] + xv[e]);
      store8(h_out + off + c, v[k]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += v[k][e];
  }
  const float mean = block_sum(sum, scratch) / d;
  float sq = 0.f;
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    if ((threadIdx.x + k * blockDim.x) * 8 >= d) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) sq += (v[k][e] - mean) * (v[k][e] - mean);
  }
  const float rstd = rsqrtf(block_sum(sq, scratch) / d + eps);
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    const int c = (threadIdx.x + k * blockDim.x) * 8;
    if (c >= d) continue;
    float out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = (v[k][e] - mean) * rstd * w[k][e] + b[k][e];
    store8(normed + off + c, out);
  }
}

#define EMBED_NORM_KERNELS(S, T)                                                                          \
  extern "C" __global__ void embed_##S(const i64* ids, const i64* positions, const T* table,             \
                                       const T* pos_table, float scale, T* out, int d) {                   \
    pdl_enter();                                                                                           \
    embed_impl<T>(ids, positions, table, pos_table, scale, out, d);                                       \
  }                                                                                                       \
  extern "C" __global__ void add_layer_norm_##S(const T* residual, const T* x, i64 x_ld, const T* weight,  \
                                                const T* bias, float eps, T* h_out, T* normed, int d) {   \
    add_layer_norm_impl<T, false>(residual, x, x_ld, nullptr, nullptr, nullptr, 0, 0, weight, bias, eps,  \
                                  h_out, normed, d);                                                      \
  }                                                                                                       \
  extern "C" __global__ void add_layer_norm_lora_##S(const T* residual, const T* x, i64 x_ld, const T* Bt, \
                                                     const i64* idx, const int* ranks, int slots, int R,  \
                                                     const T* weight, const T* bias, float eps, T* h_out, \
                                                     T* normed, int d) {                                  \
    add_layer_norm_impl<T, true>(residual, x, x_ld, Bt, idx, ranks, slots, R, weight, bias, eps, h_out,   \
                                 normed, d);                                                              \
  }
FOR_EACH_DTYPE(EMBED_NORM_KERNELS)
