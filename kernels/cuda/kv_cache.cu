// kv_cache.cu: writes into and moves within the decoder self-attention cache [R, H, T, D].
//
// kv_append_<dt>:  k_cache[rows[n], h, positions[n], :] = k[n, h, :] (same for v). k, v are [N, H, D]
//                  with any row/head strides (the q/k/v split of one fused projection) and unit stride
//                  over D. Grid (N), each thread moves 8 elements (16-byte vectors for bf16).
// rows_gather_<dt> / rows_scatter_<dt>: the two phases of the beam reorder copy_rows. Phase 1 copies
//                  the first `length` positions of every layer's source rows (K and V) into a temporary
//                  [2, Lc, M, H, length, D]; phase 2 writes them to the destination rows. Reading every
//                  source before any destination is written makes overlapping src/dst sets safe
//                  (a permutation among one segment's beams). Grid (vector chunks, M, 2 * Lc).

template <typename T>
__device__ __forceinline__ void kv_append_impl(T* __restrict__ k_cache, T* __restrict__ v_cache,
                                               const i64* __restrict__ rows, const i64* __restrict__ positions,
                                               const T* __restrict__ k, const T* __restrict__ v,
                                               i64 k_sn, i64 k_sh, i64 v_sn, i64 v_sh, int H, int T_cap, int D) {
  const int n = blockIdx.x;
  const int vecs = H * D / 8;
  const i64 r = rows[n], t = positions[n];
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

// Cache [L, R, H, T, D]; tmp [2, Lc, M, H, length, D]; layers l0 .. l0 + Lc - 1 of this launch.
template <typename T, bool GATHER>
__device__ __forceinline__ void rows_move_impl(T* __restrict__ k_cache, T* __restrict__ v_cache, T* __restrict__ tmp,
                                               const i64* __restrict__ rows, int M, int R, int H, int T_cap, int D,
                                               int length, int l0, int Lc) {
  const int m = blockIdx.y;
  const int z = blockIdx.z;  // 0 .. 2*Lc-1: K layers then V layers
  const int which = z / Lc, lz = z % Lc;
  T* cache = which == 0 ? k_cache : v_cache;
  const i64 per_head = (i64)length * D / 8;  // vectors per head
  const i64 vecs = per_head * H;
  const i64 row = rows[m];
  const i64 layer = l0 + lz;
  for (i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x; c < vecs; c += (i64)gridDim.x * blockDim.x) {
    const i64 h = c / per_head, within = (c % per_head) * 8;  // element offset inside [length, D]
    const i64 cache_off = (((layer * R + row) * H + h) * T_cap) * D + within;
    const i64 tmp_off = ((((i64)which * Lc + lz) * M + m) * H + h) * ((i64)length * D) + within;
    if (GATHER) *reinterpret_cast<uint4*>(tmp + tmp_off) = *reinterpret_cast<const uint4*>(cache + cache_off);
    else *reinterpret_cast<uint4*>(cache + cache_off) = *reinterpret_cast<const uint4*>(tmp + tmp_off);
    if (sizeof(T) == 4) {  // 8 fp32 = two 16-byte vectors
      if (GATHER) *reinterpret_cast<uint4*>(tmp + tmp_off + 4) = *reinterpret_cast<const uint4*>(cache + cache_off + 4);
      else *reinterpret_cast<uint4*>(cache + cache_off + 4) = *reinterpret_cast<const uint4*>(tmp + tmp_off + 4);
    }
  }
}

#define KV_CACHE_KERNELS(S, T)                                                                             \
  extern "C" __global__ void kv_append_##S(T* k_cache, T* v_cache, const i64* rows, const i64* positions,  \
                                           const T* k, const T* v, i64 k_sn, i64 k_sh, i64 v_sn,            \
                                           i64 v_sh, int H, int T_cap, int D) {                             \
    kv_append_impl<T>(k_cache, v_cache, rows, positions, k, v, k_sn, k_sh, v_sn, v_sh, H, T_cap, D);       \
  }                                                                                                        \
  extern "C" __global__ void rows_gather_##S(T* k_cache, T* v_cache, T* tmp, const i64* src, int M, int R, \
                                             int H, int T_cap, int D, int length, int l0, int Lc) {        \
    rows_move_impl<T, true>(k_cache, v_cache, tmp, src, M, R, H, T_cap, D, length, l0, Lc);                \
  }                                                                                                        \
  extern "C" __global__ void rows_scatter_##S(T* k_cache, T* v_cache, T* tmp, const i64* dst, int M,       \
                                              int R, int H, int T_cap, int D, int length, int l0, int Lc) { \
    rows_move_impl<T, false>(k_cache, v_cache, tmp, dst, M, R, H, T_cap, D, length, l0, Lc);               \
  }
FOR_EACH_DTYPE(KV_CACHE_KERNELS)
