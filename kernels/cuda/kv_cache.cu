// kv_cache.cu: writes into the decoder self-attention cache [R, H, T, D]. (Beams never move keys:
// attention reads them through the slot table's history, see attention.cu.)
//
// kv_append_<dt>:  k_cache[rows[n], h, positions[n] + offset, :] = k[n, h, :] (same for v; offset -1 takes the
//                  attention's lengths as positions: decode_attention's new_kv). k, v are [N, H, D]
//                  with any row/head strides (the q/k/v split of one fused projection) and unit stride
//                  over D. Grid (N), each thread moves 8 elements (16-byte vectors for bf16).

template <typename T>
__device__ __forceinline__ void kv_append_impl(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                               const i64* __restrict__ rows, const i64* __restrict__ positions,
                                               const T* __restrict__ k, const T* __restrict__ v,
                                               i64 k_sn, i64 k_sh, i64 v_sn, i64 v_sh, int offset, int H,
                                               int T_cap, int D) {
  const int n = blockIdx.x;
  const int vecs = H * D / 8;
  const i64 r = rows[n], t = positions[n] + offset;
  for (int c = threadIdx.x; c < vecs; c += blockDim.x) {
    const int h = (c * 8) / D, dd = (c * 8) % D;
    const i64 dst = ((r * H + h) * T_cap + t) * D + dd;
    float buf[8];
    load8(k + n * k_sn + h * k_sh + dd, buf);
    store8(k_cache + dst, buf);
    load8(v + n * v_sn + h * v_sh + dd, buf);
    store8(v_cache + dst, buf);
  }
}

#define KV_CACHE_KERNELS(S, T)                                                                             \
  extern "C" __global__ void kv_append_##S(T* k_cache, T* v_cache, const i64* rows, const i64* positions,  \
                                           const T* k, const T* v, i64 k_sn, i64 k_sh, i64 v_sn,            \
                                           i64 v_sh, int offset, int H, int T_cap, int D) {                 \
    pdl_enter();                                                                                            \
    kv_append_impl<T>(k_cache, v_cache, rows, positions, k, v, k_sn, k_sh, v_sn, v_sh, offset, H, T_cap, D);\
  }
FOR_EACH_DTYPE(KV_CACHE_KERNELS)

// kv_append_lora_<dt>: the decoder step's q|k|v with each row's LoRA delta (lora_expand8) added, rounded, in
// place (the attention reads q there), then k and v appended to the cache as kv_append does. qkv [N, 3*H*D +
// 3*S*R] (row stride ld): the projection over its weight stacked on every slot's A. Grid (N, 3), H*D/8 threads:
// block (n, p) takes part p of row n, 8 columns a thread.
template <typename T>
__device__ __forceinline__ void kv_append_lora_impl(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                                    const i64* __restrict__ rows, const i64* __restrict__ positions,
                                                    T* __restrict__ qkv, i64 ld, const T* __restrict__ Bt,
                                                    const i64* __restrict__ idx, const int* __restrict__ ranks,
                                                    int R, int H, int T_cap, int D) {
  const int n = blockIdx.x, HD = H * D, p = blockIdx.y, c = threadIdx.x * 8;
  const LoraSlot slot = lora_slot(idx[n], ranks, R);
  pdl_enter();
  T* row = qkv + n * ld;
  float v[8], delta[8];
  load8(row + p * HD + c, v);
  lora_expand8<T>(delta, row + 3 * HD, slot, nullptr, Bt, p, c, R, HD, 3);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = round_to<T>(v[e] + delta[e]);
  if (slot.s > 0) store8(row + p * HD + c, v);
  if (p == 0) return;
  const int h = c / D, dd = c % D;
  store8((p == 1 ? k_cache : v_cache) + ((rows[n] * H + h) * T_cap + positions[n]) * D + dd, v);
}

#define KV_APPEND_LORA_KERNELS(S, T)                                                                       \
  extern "C" __global__ void kv_append_lora_##S(T* k_cache, T* v_cache, const i64* rows,                  \
                                                const i64* positions, T* qkv, i64 ld, const T* Bt,        \
                                                const i64* idx, const int* ranks, int R, int H,           \
                                                int T_cap, int D) {                                       \
    kv_append_lora_impl<T>(k_cache, v_cache, rows, positions, qkv, ld, Bt, idx, ranks, R, H, T_cap, D);   \
  }
FOR_EACH_DTYPE(KV_APPEND_LORA_KERNELS)
