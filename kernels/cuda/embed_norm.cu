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
//                      is added to its first d columns, rounded, before the residual add (Bt null: none);
//                      with A (the next projection's stacks [S, 1, R, d]), normed's row continues with S*R
//                      columns for that projection's GEMM (engine/lora.py): the row's slot's h = A[s] .
//                      normed (the stored, rounded values; fp32 sums; ranks past the slot's `a_ranks` 0), every
//                      other slot's columns 0 (lora_shrink_row).
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
// the kernel makes one trip to memory (a row kept in shared memory, with weight and bias read after the
// statistics one element a load, took 4.1 us a one-row launch inside the decode graph; this takes 1.9).
#define LN_CHUNKS 2  // pieces of 8 a thread: d up to 8 x 2 x 256 = 4096 (ops.LN_MAX_D; NLLB-3.3B has 2048)
#define LN_MAX_WARPS 8     // threads a block: ops.add_layer_norm's, at most 256
#define LORA_MAX_RANK_LN 64  // kernels/ops_lora.py LORA_MAX_RANK

// One halving step of a warp's reduce-scatter: lanes with bit m set keep the upper N of their 2N sums, the others
// the lower N, each adding its partner's (lane ^ m) copy of the half it keeps.
template <int N>
__device__ __forceinline__ void scatter_half(float* p, int lane, int m) {
  const bool upper = lane & m;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float send = upper ? p[i] : p[i + N], keep = upper ? p[i + N] : p[i];
    p[i] = keep + __shfl_xor_sync(FULL_MASK, send, m);
  }
}
// The warp's sum of each of 16 values in 16 shuffles (not 16 x 5): lanes 2j and 2j + 1 end with value
// scatter16_index(lane)'s sum in p[0].
__device__ __forceinline__ void warp_scatter16(float* p, int lane) {
  scatter_half<8>(p, lane, 16);
  scatter_half<4>(p, lane, 8);
  scatter_half<2>(p, lane, 4);
  scatter_half<1>(p, lane, 2);
  p[0] += __shfl_xor_sync(FULL_MASK, p[0], 1);
}
__device__ __forceinline__ int scatter16_index(int lane) {
  return (lane >> 4 & 1) * 8 + (lane >> 3 & 1) * 4 + (lane >> 2 & 1) * 2 + (lane >> 1 & 1);
}

// The LoRA shrink of the projection that reads this row (add_layer_norm_lora with A): out [S*R] after the
// normed row = the row's slot's h (A[s, 0, r] . xr, r < slot.rank), 0 for every other slot and rank. xr: this
// thread's pieces of the stored normed row; fetched: A's first 16 ranks at the first piece, read before the wait.
template <typename T>
__device__ __forceinline__ void lora_shrink_row(T* __restrict__ out, const float (*xr)[8], const LoraSlot& slot,
                                                const Raw8<T>* fetched, const T* __restrict__ A, int S, int R,
                                                int d) {
  __shared__ float part[LN_MAX_WARPS][16];
  __shared__ float h[LORA_MAX_RANK_LN];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 1
  for (int r0 = 0; r0 < slot.rank; r0 += 16) {  // block-uniform
    float p[16] = {};
#pragma unroll
    for (int k = 0; k < LN_CHUNKS; ++k) {
      const int c = (threadIdx.x + k * blockDim.x) * 8;
      if (c >= d) continue;
      Raw8<T> a[16];
      if (k == 0 && r0 == 0) {
#pragma unroll
        for (int j = 0; j < 16; ++j) a[j] = fetched[j];
      } else {
        lora_bt16(a, lora_bt_at(A, slot, 0, c, R, d, 1), r0, d);
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float av[8];
        unpack8(a[j], av);
#pragma unroll
        for (int e = 0; e < 8; ++e) p[j] = fmaf(av[e], xr[k][e], p[j]);
      }
    }
    warp_scatter16(p, lane);
    if ((lane & 1) == 0) part[warp][scatter16_index(lane)] = p[0];
    __syncthreads();
    if (threadIdx.x < 16) {
      float sum = 0.f;
      for (int w = 0; w < (int)(blockDim.x >> 5); ++w) sum += part[w][threadIdx.x];
      h[r0 + threadIdx.x] = sum;
    }
    __syncthreads();
  }
  for (int c = threadIdx.x * 8; c < S * R; c += blockDim.x * 8) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int r = (c + e) % R;
      v[e] = (c + e) / R == slot.s && r < slot.rank ? h[r] : 0.f;
    }
    store8(out + c, v);
  }
}

template <typename T, bool kLora>
__device__ __forceinline__ void add_layer_norm_impl(const T* __restrict__ residual, const T* __restrict__ x,
                                                    i64 x_ld, const T* __restrict__ Bt, const i64* __restrict__ idx,
                                                    const int* __restrict__ ranks, int S, int R,
                                                    const T* __restrict__ A, const int* __restrict__ a_ranks,
                                                    const T* __restrict__ weight, const T* __restrict__ bias,
                                                    float eps, T* __restrict__ h_out, T* __restrict__ normed,
                                                    i64 normed_ld, int d) {
  __shared__ float scratch[33];
  const i64 off = (i64)blockIdx.x * d, x_off = (i64)blockIdx.x * x_ld, n_off = (i64)blockIdx.x * normed_ld;
  LoraSlot slot = {0, 0}, a_slot = {0, 0};  // Bt, A: [S, 1, R, d]; idx: each row's slot; ranks, a_ranks: [S]
  Raw8<T> fetched[16], a_fetched[16];       // the first piece's first-pass Bt and A rows
  if (kLora) {
    const i64 s = idx[blockIdx.x];
    if (Bt != nullptr) slot = lora_slot(s, ranks, R);
    if (A != nullptr) a_slot = lora_slot(s, a_ranks, R);
    if (threadIdx.x * 8 < d) {
      lora_fetch8(fetched, Bt, slot, 0, threadIdx.x * 8, R, d, 1);
      lora_fetch8(a_fetched, A, a_slot, 0, threadIdx.x * 8, R, d, 1);
    }
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
        lora_expand8<T>(delta, x + x_off + d, slot, k == 0 ? fetched : nullptr, Bt, 0, c, R, d, 1);
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
  float out[LN_CHUNKS][8];
#pragma unroll
  for (int k = 0; k < LN_CHUNKS; ++k) {
    const int c = (threadIdx.x + k * blockDim.x) * 8;
    if (c >= d) continue;
#pragma unroll
    for (int e = 0; e < 8; ++e) out[k][e] = round_to<T>((v[k][e] - mean) * rstd * w[k][e] + b[k][e]);
    store8(normed + n_off + c, out[k]);
  }
  if (kLora && A != nullptr) lora_shrink_row<T>(normed + n_off + d, out, a_slot, a_fetched, A, S, R, d);
}

#define EMBED_NORM_KERNELS(S, T)                                                                          \
  extern "C" __global__ void embed_##S(const i64* ids, const i64* positions, const T* table,             \
                                       const T* pos_table, float scale, T* out, int d) {                   \
    pdl_enter();                                                                                           \
    embed_impl<T>(ids, positions, table, pos_table, scale, out, d);                                       \
  }                                                                                                       \
  extern "C" __global__ void add_layer_norm_##S(const T* residual, const T* x, i64 x_ld, const T* weight,  \
                                                const T* bias, float eps, T* h_out, T* normed, int d) {   \
    add_layer_norm_impl<T, false>(residual, x, x_ld, nullptr, nullptr, nullptr, 0, 0, nullptr, nullptr,   \
                                  weight, bias, eps, h_out, normed, d, d);                                \
  }                                                                                                       \
  extern "C" __global__ void add_layer_norm_lora_##S(const T* residual, const T* x, i64 x_ld, const T* Bt, \
                                                     const i64* idx, const int* ranks, int slots, int R,  \
                                                     const T* A, const int* a_ranks, const T* weight,     \
                                                     const T* bias, float eps, T* h_out, T* normed,       \
                                                     i64 normed_ld, int d) {                              \
    add_layer_norm_impl<T, true>(residual, x, x_ld, Bt, idx, ranks, slots, R, A, a_ranks, weight, bias,   \
                                 eps, h_out, normed, normed_ld, d);                                       \
  }
FOR_EACH_DTYPE(EMBED_NORM_KERNELS)
