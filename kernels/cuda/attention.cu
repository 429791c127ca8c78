// attention.cu: one-query-per-row attention over a per-row key range, split-K (flash-decoding).
//
// attn_<dt>: for each item (n, h): out[n, h, :] = softmax_t(q[n, h] . K[t] * scale) @ V[t] over the keys
//   t in [0, len(n)), where K[t] = k[base(n) * kv_rs + h * kv_hs + t * kv_ts + :D] (V alike) and
//     - cu == null: base(n) = index[n], len(n) = lengths[n]
//         decode_attention: index = cache rows, kv_rs = H*T*D, kv_hs = T*D, kv_ts = D; with a history
//           table (beam cache indirection) key t of row n lives in row history[index[n] * hist_rs + t]
//           instead of row index[n]: beams share their parents' keys without copies.
//           attn_append_<dt> (attn_'s plan, four warps an item) also takes new_k and new_v (the same
//           strides), the step's own keys and values: item (n, h) writes them to position len(n) - 1 of
//           row index[n] (kv_append's write, by split 0) and reads that position from them, so the append
//           needs no launch of its own. Nothing else in the launch reads that position: a row writes only
//           its own current position, and history[index[n], len(n) - 1] = index[n].
//         cross_attention:  index = source-pool starts, kv_rs = kv_ts = H*D, kv_hs = D
//     - cu != null (encoder_attention over packed sequences): n's sequence b is found by binary search
//       in cu[0..nseq]; base(n) = cu[b], len(n) = cu[b+1] - cu[b]; kv_rs = kv_ts = the token stride.
//   Layout of the work: D/8 lanes hold one key's D elements (8 each, 16-byte loads), so a warp scores
//   256/D keys at once (ATTN_UNROLL such batches in flight per iteration); `wpi` warps (1 or 4) share one item;
//   attn_many_<dt> is the same with ATTN_MANY_UNROLL batches, for wpi 1. attn64_, attn128_, attn_append64_, ...,
//   attn_many128_<dt>: the same kernels for D = 64 and 128 with the key layout fixed at compile time (the
//   group's shuffles unrolled, no divisions), the same bits: for attn_many at D = 64, ~234 instructions a
//   two-batch iteration where the run-time layout takes ~336 (~420 while each key's offset was rebuilt);
//   grid.y = `splits` chunks of `chunk` keys each. Online softmax in the log2 domain in fp32.
//   splits == 1: the normalised result goes straight to out; else unnormalised partials (acc, m, l)
//   go to part_o [splits, N*H, D] and part_ml [splits, N*H, 2], and attn_combine_<dt> finishes.
//   NaN in q or in a key/value inside the range propagates to that row's output (as in the reference).
// attn_combine_<dt>: out[item] = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M). Grid N*H, block D.
// attn_group<D>q<Q>_<dt>: cross_attention where every Q consecutive rows read one source range (a beam segment's
//   rows): one warp takes the Q rows of one head, each key and value loaded once for the Q queries, where
//   attn_many's warps each load them for their own row. Every query's arithmetic is attn_many's, in its order
//   (one split, no history), so the outputs are attn_many's bits. Grid ceil(N / Q * H / 4), block 128.

// Key batches a warp has in flight. K and V stay raw 16-byte pieces until used (Raw8), so 4 batches fit the
// registers 2 converted ones took (78 a thread, 6 blocks an SM): attention at 1024 rows went 395 -> 305 us.
// attn_<dt> keeps ATTN_UNROLL batches in flight, what a few items (four warps each) need to cover the memory
// latency; attn_many_<dt>, for one warp an item over many items, keeps ATTN_MANY_UNROLL: there the SM's other
// warps cover it, and the fewer registers let more of them in (graph time, 16 heads of 64, 32 keys: 256 rows
// 11.7 -> 9.9 us, 1024 rows 42.1 -> 40.9 us; cross-attention over 32 source tokens alike).
#define ATTN_UNROLL 4
#define ATTN_MANY_UNROLL 2

// The online softmax's arithmetic is spelled out (fmaf, __fmul_rn) so that the compiler's contraction of a * b + c
// cannot differ between the kernels that share it: attn_group's outputs are attn_many's bits.
__device__ __forceinline__ void attn_merge(float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
  const float M = fmaxf(m, m2);
  const float c1 = (m == M) ? 1.f : exp2f(m - M);
  const float c2 = (m2 == M) ? 1.f : exp2f(m2 - M);
  l = fmaf(l, c1, __fmul_rn(l2, c2));
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = fmaf(acc[i], c1, __fmul_rn(acc2[i], c2));
  m = M;
}

// One key of score s (log2 domain; -inf past the range) and value vv taken into a query's running state. A key
// past the range gives p = 0 and corr = 1, leaving l and acc as they are (its V is zeros), with no branch. Exps
// below 2^-126 flush to 0: beside the running max's own term (1) they add nothing. A NaN s keeps m (m is never
// NaN) and reaches l and acc through p.
__device__ __forceinline__ void attn_update(float& m, float& l, float* acc, float s, const float* vv) {
  const float mn = s > m ? s : m;
  const float corr = (m == mn) ? 1.f : exp2_ftz(m - mn);
  const float p = (s == NEG_INF) ? 0.f : exp2_ftz(s - mn);
  l = fmaf(l, corr, p);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = fmaf(p, vv[i], __fmul_rn(acc[i], corr));
  m = mn;
}

template <typename T, int UNROLL, bool kAppend, int kG>
__device__ __forceinline__ void attn_impl(const T* __restrict__ q, i64 q_sn, i64 q_sh,
                                          const T* __restrict__ k, const T* __restrict__ v,
                                          i64 kv_rs, i64 kv_hs, i64 kv_ts,
                                          const i64* __restrict__ index, const i64* __restrict__ lengths,
                                          const i64* __restrict__ cu, int nseq,
                                          const int* __restrict__ history, i64 hist_rs,
                                          const T* __restrict__ new_k, const T* __restrict__ new_v,
                                          i64 new_sn, i64 new_sh,
                                          int N, int H, int D, float scale_log2, int chunk, int wpi,
                                          T* __restrict__ out, i64 o_sn, i64 o_sh,
                                          float* __restrict__ part_o, float* __restrict__ part_ml) {
  __shared__ float sm_acc[4][256];
  __shared__ float sm_ml[4][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int G = kG ? kG : D >> 3, KPW = 32 / G;  // kG: the key group's width fixed at compile time
  const int g = lane / G, j = lane % G;
  const int NH = N * H;
  const int item = blockIdx.x * (4 / wpi) + warp / wpi;
  const int wsub = warp % wpi;
  const int split = blockIdx.y, splits = gridDim.y;
  const bool valid = item < NH;
  const int n = valid ? item / H : 0, h = valid ? item % H : 0;
  pdl_enter();

  i64 base = 0;
  int len = 0;
  if (valid) {
    if (cu != nullptr) {
      int lo = 0, hi = nseq - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu[mid] <= n) lo = mid; else hi = mid - 1;
      }
      base = cu[lo];
      len = (int)(cu[lo + 1] - cu[lo]);
    } else {
      base = index[n];
      len = (int)lengths[n];
    }
  }
  const int t0 = split * chunk;
  const int t1 = min(t0 + chunk, len);

  float qv[8];
  if (valid) {
    load8(q + n * q_sn + h * q_sh + j * 8, qv);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) qv[i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) qv[i] *= scale_log2;
  const T* kb = k + base * kv_rs + h * kv_hs + j * 8;
  const T* vb = v + base * kv_rs + h * kv_hs + j * 8;
  const int* hist = history != nullptr ? history + base * hist_rs : nullptr;  // this row's table
  const T* nk = nullptr;  // this item's new key and value: position len - 1
  const T* nv = nullptr;
  if (kAppend && valid) {
    nk = new_k + n * new_sn + h * new_sh + j * 8;
    nv = new_v + n * new_sn + h * new_sh + j * 8;
    if (split == 0 && wsub == 0 && g == 0) {  // the cache is written here only, at a position no one reads here
      const i64 at = (i64)(len - 1) * kv_ts;
      store_raw8(const_cast<T*>(kb) + at, load_raw8(nk));
      store_raw8(const_cast<T*>(vb) + at, load_raw8(nv));
    }
  }

  float m = NEG_INF, l = 0.f, acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;

  const int stride = wpi * KPW;  // keys between this warp's consecutive batches
  // This lane group's keys lie at t_off (their positions' offset, moved on a batch at a time) plus, through the
  // history table, their rows'. Each iteration takes every batch's offsets first (the history loads), then every
  // batch's K and V loads, so that those are in flight together: with the offsets kept live, the compiler
  // otherwise issued the second batch's loads only after the first batch's dot product. (Rebuilding each key's
  // 64-bit offset from the base, head and position products had been most of the loop's instructions.)
  const int first = t0 + wsub * KPW + g;
  const i64 kv_step = stride * kv_ts;
  i64 t_off = first * kv_ts;
  const int* ht = hist != nullptr ? hist + first : nullptr;
  for (int tw = t0 + wsub * KPW; tw < t1; tw += UNROLL * stride) {
    Raw8<T> kr[UNROLL] = {}, vr[UNROLL] = {};  // all loads of the batch in flight, converted at use
    bool ok[UNROLL];
    i64 off[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      ok[u] = tw + u * stride + g < t1;
      off[u] = t_off + u * kv_step + (ht != nullptr && ok[u] ? ((i64)ht[u * stride] - base) * kv_rs : 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (kAppend && ok[u] && tw + u * stride + g == len - 1) {
        kr[u] = load_raw8(nk);
        vr[u] = load_raw8(nv);
      } else if (ok[u]) {
        kr[u] = load_raw8(kb + off[u]);
        vr[u] = load_raw8(vb + off[u]);
      }
    }
    t_off += UNROLL * kv_step;
    if (ht != nullptr) ht += UNROLL * stride;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kk[8], s = 0.f;
      unpack8(kr[u], kk);
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(qv[i], kk[i], s);
      for (int o = G >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
      float vv[8];
      unpack8(vr[u], vv);
      attn_update(m, l, acc, ok[u] ? s : NEG_INF, vv);
    }
  }
  // Merge the key groups of this warp (butterfly: every group ends with the warp's state).
  for (int o = G; o < 32; o <<= 1) {
    float acc2[8];
    const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
    const float l2 = __shfl_xor_sync(FULL_MASK, l, o);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(FULL_MASK, acc[i], o);
    attn_merge(m, l, acc, m2, l2, acc2);
  }
  if (wpi > 1) {  // block-uniform: merge the warps of the item
    if (g == 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sm_acc[warp][j * 8 + i] = acc[i];
      if (j == 0) { sm_ml[warp][0] = m; sm_ml[warp][1] = l; }
    }
    __syncthreads();
    if (warp == 0 && g == 0) {
      for (int w = 1; w < wpi; ++w) {
        float acc2[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc2[i] = sm_acc[w][j * 8 + i];
        attn_merge(m, l, acc, sm_ml[w][0], sm_ml[w][1], acc2);
      }
    }
  }
  if (!valid || wsub != 0 || g != 0) return;
  if (splits == 1) {
    float o[8];
    const float inv = 1.f / l;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = acc[i] * inv;
    store8(out + n * o_sn + h * o_sh + j * 8, o);
  } else {
    const i64 p = (i64)split * NH + item;
    store8(part_o + p * D + j * 8, acc);
    if (j == 0) { part_ml[2 * p] = m; part_ml[2 * p + 1] = l; }
  }
}

template <typename T, int kG, int Q>
__device__ __forceinline__ void attn_group_impl(const T* __restrict__ q, i64 q_sn, i64 q_sh,
                                                const T* __restrict__ k, const T* __restrict__ v, i64 kv_ts,
                                                i64 kv_hs, const i64* __restrict__ index,
                                                const i64* __restrict__ lengths, int N, int H, float scale_log2,
                                                T* __restrict__ out, i64 o_sn, i64 o_sh) {
  constexpr int G = kG, KPW = 32 / G, UNROLL = ATTN_MANY_UNROLL;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane / G, j = lane % G;
  const int item = blockIdx.x * 4 + warp;
  const bool valid = item < (N / Q) * H;
  const int n0 = valid ? item / H * Q : 0, h = valid ? item % H : 0;
  pdl_enter();

  const i64 base = valid ? index[n0] : 0;
  const int len = valid ? (int)lengths[n0] : 0;
  float qv[Q][8], acc[Q][8], m[Q], l[Q];
#pragma unroll
  for (int r = 0; r < Q; ++r) {
    if (valid) {
      load8(q + (n0 + r) * q_sn + h * q_sh + j * 8, qv[r]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[r][i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qv[r][i] *= scale_log2;
      acc[r][i] = 0.f;
    }
    m[r] = NEG_INF;
    l[r] = 0.f;
  }
  const T* kb = k + base * kv_ts + h * kv_hs + j * 8;
  const T* vb = v + base * kv_ts + h * kv_hs + j * 8;
  const i64 kv_step = KPW * kv_ts;
  i64 t_off = g * kv_ts;
  for (int tw = 0; tw < len; tw += UNROLL * KPW) {
    Raw8<T> kr[UNROLL] = {}, vr[UNROLL] = {};
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      ok[u] = tw + u * KPW + g < len;
      if (ok[u]) {
        kr[u] = load_raw8(kb + t_off + u * kv_step);
        vr[u] = load_raw8(vb + t_off + u * kv_step);
      }
    }
    t_off += UNROLL * kv_step;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kk[8], vv[8];
      unpack8(kr[u], kk);
      unpack8(vr[u], vv);
#pragma unroll
      for (int r = 0; r < Q; ++r) {  // attn_impl's step, query by query
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(qv[r][i], kk[i], s);
#pragma unroll
        for (int o = G >> 1; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);
        attn_update(m[r], l[r], acc[r], ok[u] ? s : NEG_INF, vv);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < Q; ++r) {
#pragma unroll
    for (int o = G; o < 32; o <<= 1) {
      float acc2[8];
      const float m2 = __shfl_xor_sync(FULL_MASK, m[r], o);
      const float l2 = __shfl_xor_sync(FULL_MASK, l[r], o);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(FULL_MASK, acc[r][i], o);
      attn_merge(m[r], l[r], acc[r], m2, l2, acc2);
    }
  }
  if (!valid || g != 0) return;
#pragma unroll
  for (int r = 0; r < Q; ++r) {
    float o[8];
    const float inv = 1.f / l[r];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = acc[r][i] * inv;
    store8(out + (n0 + r) * o_sn + h * o_sh + j * 8, o);
  }
}

template <typename T>
__device__ __forceinline__ void attn_combine_impl(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                  T* __restrict__ out, i64 o_sn, i64 o_sh, int NH, int H, int D,
                                                  int splits) {
  const int item = blockIdx.x, d = threadIdx.x;
  if (d >= D) return;
  float M = NEG_INF;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, part_ml[2 * ((i64)s * NH + item)]);
  float L = 0.f, acc = 0.f;
  for (int s = 0; s < splits; ++s) {
    const i64 p = (i64)s * NH + item;
    const float m = part_ml[2 * p];
    const float c = (m == M) ? 1.f : exp2f(m - M);
    L += part_ml[2 * p + 1] * c;
    acc += part_o[p * D + d] * c;
  }
  const int n = item / H, h = item % H;
  out[n * o_sn + h * o_sh + d] = from_f<T>(acc / L);
}

#define ATTN_KERNEL(NAME, S, T, UNROLL, APPEND, G)                                                          \
  extern "C" __global__ void __launch_bounds__(128) NAME##_##S(                                              \
      const T* q, i64 q_sn, i64 q_sh, const T* k, const T* v, i64 kv_rs, i64 kv_hs, i64 kv_ts,               \
      const i64* index, const i64* lengths, const i64* cu, int nseq, const int* history, i64 hist_rs,        \
      const T* new_k, const T* new_v, i64 new_sn, i64 new_sh, int N, int H, int D, float scale_log2,         \
      int chunk, int wpi, T* out, i64 o_sn, i64 o_sh, float* part_o, float* part_ml) {                       \
    attn_impl<T, UNROLL, APPEND, G>(q, q_sn, q_sh, k, v, kv_rs, kv_hs, kv_ts, index, lengths, cu, nseq,      \
                                    history, hist_rs, new_k, new_v, new_sn, new_sh, N, H, D, scale_log2,     \
                                    chunk, wpi, out, o_sn, o_sh, part_o, part_ml);                           \
  }
#define ATTN_GROUP_KERNEL(S, T, D, Q)                                                                       \
  extern "C" __global__ void __launch_bounds__(128) attn_group##D##q##Q##_##S(                               \
      const T* q, i64 q_sn, i64 q_sh, const T* k, const T* v, i64 kv_ts, i64 kv_hs, const i64* index,         \
      const i64* lengths, int N, int H, float scale_log2, T* out, i64 o_sn, i64 o_sh) {                      \
    attn_group_impl<T, D / 8, Q>(q, q_sn, q_sh, k, v, kv_ts, kv_hs, index, lengths, N, H, scale_log2, out,   \
                                 o_sn, o_sh);                                                                \
  }
#define ATTN_KERNELS(S, T)                                                                                  \
  ATTN_GROUP_KERNEL(S, T, 64, 2)                                                                             \
  ATTN_GROUP_KERNEL(S, T, 64, 4)                                                                             \
  ATTN_GROUP_KERNEL(S, T, 128, 2)                                                                            \
  ATTN_GROUP_KERNEL(S, T, 128, 4)                                                                            \
  ATTN_KERNEL(attn, S, T, ATTN_UNROLL, false, 0)                                                             \
  ATTN_KERNEL(attn_append, S, T, ATTN_UNROLL, true, 0)                                                       \
  ATTN_KERNEL(attn_many, S, T, ATTN_MANY_UNROLL, false, 0)                                                   \
  ATTN_KERNEL(attn_many64, S, T, ATTN_MANY_UNROLL, false, 8)                                                 \
  ATTN_KERNEL(attn_many128, S, T, ATTN_MANY_UNROLL, false, 16)                                               \
  ATTN_KERNEL(attn64, S, T, ATTN_UNROLL, false, 8)                                                           \
  ATTN_KERNEL(attn128, S, T, ATTN_UNROLL, false, 16)                                                         \
  ATTN_KERNEL(attn_append64, S, T, ATTN_UNROLL, true, 8)                                                     \
  ATTN_KERNEL(attn_append128, S, T, ATTN_UNROLL, true, 16)                                                   \
  extern "C" __global__ void attn_combine_##S(const float* part_o, const float* part_ml, T* out, i64 o_sn,   \
                                              i64 o_sh, int NH, int H, int D, int splits) {                  \
    pdl_enter();                                                                                             \
    attn_combine_impl<T>(part_o, part_ml, out, o_sn, o_sh, NH, H, D, splits);                                \
  }
FOR_EACH_DTYPE(ATTN_KERNELS)
