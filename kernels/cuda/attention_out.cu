// attention_out.cu: a few rows' attention and its output projection in one launch (ops.decode_attention and
// ops.cross_attention with out_proj, up to ops_attention_out.ATTN_OUT_MAX_ROWS rows: one sentence, its beams).
//
// attn_out<D>_<dt>, attn_append_out<D>_<dt>: part[h, n, :] = W[:, h*D : (h+1)*D] . a[n, h] in fp32, each head's
//   share of the projection y[n, :] = round(sum_h part[h, n, :] + b), which add_layer_norm_parts reads (adding
//   the shares in head order and the bias). a[n, h] is what attn<D>_<dt> / attn_append<D>_<dt> (four warps an
//   item, no split) give item (n, h), rounded to the storage type as a stored output is.
//   Grid (N*H, d / ATTN_OUT_FEATURES), block 128:
//   1. block (item, c) loads its head's columns of W for the outputs f in chunk c (ATTN_OUT_FEATURES rows) before
//      the programmatic wait: W is constant, so its read overlaps the kernel before (1.5 us a launch in a chain
//      of one-row layers, against the loads after it);
//   2. every block of an item computes that item's attention (the append's cache write from chunk 0 alone);
//   3. its share of chunk c.
//   So no launch of the projection follows the attention: a link less in one sentence's chain of dependent
//   launches, twice a decoder layer. The heads' shares meet in the LayerNorm that reads them: added here by the
//   block that completed a chunk last (a counter a chunk, threadFenceReduction's fences), they cost the chain
//   more than the GEMV's launch they replace (12 one-row layers: 255 against 242 us, 225 without the sum).
//   W is read once per row (rows <= ATTN_OUT_MAX_ROWS). Legend: N rows, H heads, D head size, d = H*D.

#define ATTN_OUT_FEATURES 128  // outputs a block projects (one chunk): a warp takes 32

template <typename T, bool kAppend, int kD>
__device__ __forceinline__ void attn_out_impl(const T* __restrict__ q, i64 q_sn, i64 q_sh,
                                              const T* __restrict__ k, const T* __restrict__ v,
                                              i64 kv_rs, i64 kv_hs, i64 kv_ts,
                                              const i64* __restrict__ index, const i64* __restrict__ lengths,
                                              const int* __restrict__ history, i64 hist_rs,
                                              const T* __restrict__ new_k, const T* __restrict__ new_v,
                                              i64 new_sn, i64 new_sh, int N, int H, float scale_log2,
                                              const T* __restrict__ W, i64 ldw,
                                              float* __restrict__ part) {
  constexpr int LPR = kD / 8;          // lanes over one output's D columns, 8 elements each
  constexpr int RPL = 32 / LPR;        // outputs a warp's load covers
  constexpr int LOADS = 32 / RPL;      // loads a lane makes for its warp's 32 outputs
  __shared__ float sm_out[kD];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int item = blockIdx.x, c = blockIdx.y;
  const int n = item / H, h = item % H, d = H * kD;
  const int f0 = c * ATTN_OUT_FEATURES + warp * 32 + lane / LPR;  // this lane's outputs: f0 + i * RPL
  const int col = lane % LPR * 8;  // its 8 columns of the head's D
  Raw8<T> w[LOADS];  // 1. before the wait (inside attn_impl)
#pragma unroll
  for (int i = 0; i < LOADS; ++i) w[i] = load_raw8(W + (i64)(f0 + i * RPL) * ldw + h * kD + col);
  // 2.
  attn_impl<T, ATTN_UNROLL, kAppend, kD / 8, true>(
      q, q_sn, q_sh, k, v, kv_rs, kv_hs, kv_ts, index, lengths, nullptr, 0, history, hist_rs, new_k, new_v, new_sn,
      new_sh, N, H, kD, scale_log2, 1 << 30, 4, nullptr, 0, 0, nullptr, nullptr, sm_out);
  __syncthreads();
  // 3.
  float a[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) a[e] = sm_out[col + e];
  float* share = part + ((i64)h * N + n) * d;
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    float wf[8], s = 0.f;
    unpack8(w[i], wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) s = fmaf(wf[e], a[e], s);
#pragma unroll
    for (int o = LPR >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
    if (lane % LPR == 0) share[f0 + i * RPL] = s;
  }
}

#define ATTN_OUT_KERNEL(NAME, S, T, APPEND, D)                                                               \
  extern "C" __global__ void __launch_bounds__(128) NAME##_##S(                                              \
      const T* q, i64 q_sn, i64 q_sh, const T* k, const T* v, i64 kv_rs, i64 kv_hs, i64 kv_ts,               \
      const i64* index, const i64* lengths, const int* history, i64 hist_rs, const T* new_k, const T* new_v, \
      i64 new_sn, i64 new_sh, int N, int H, float scale_log2, const T* W, i64 ldw, float* part) {            \
    attn_out_impl<T, APPEND, D>(q, q_sn, q_sh, k, v, kv_rs, kv_hs, kv_ts, index, lengths, history, hist_rs,  \
                                new_k, new_v, new_sn, new_sh, N, H, scale_log2, W, ldw, part);             \
  }
#define ATTN_OUT_KERNELS(S, T)                                                                               \
  ATTN_OUT_KERNEL(attn_out64, S, T, false, 64)                                                               \
  ATTN_OUT_KERNEL(attn_out128, S, T, false, 128)                                                             \
  ATTN_OUT_KERNEL(attn_append_out64, S, T, true, 64)                                                         \
  ATTN_OUT_KERNEL(attn_append_out128, S, T, true, 128)
FOR_EACH_DTYPE(ATTN_OUT_KERNELS)
