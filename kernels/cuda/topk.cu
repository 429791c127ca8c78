// topk.cu: the top k keys of each row of logits (beam search); the batches, their scan and the log-sum-exp are
// logits.cu's, which the loader puts first.
//
// topk_partial_<dt>: greedy_partial's pass keeping the top k keys (k <= 128): every warp keeps a sorted list of
//   k keys in shared memory; a candidate is inserted only when it beats the warp's current k-th key
//   (a ballot per 32 logits, taken only for batches where some lane's could; after the first few hundred
//   logits almost none can), then
//   warp 0 merges the 8 lists. One split per row: values[n, i] = logit - logsumexp (= log_softmax),
//   indices[n, i], best first; otherwise partial lists, and topk_merge finishes. Rows with ban[n] != 0 never
//   take token ban_id, which still counts in their log-sum-exp (HF bans </s> after the log-softmax).
//   NaN in a row makes that row's log-sum-exp, hence its values, NaN (as log_softmax does).
//   topk_partial_reg_<dt> / topk_merge_reg: the same for k <= 32, each warp's list in registers (RegList).

#define TOPK_MAX 128

// The warp's candidates `key` (one per lane; 0 = none) that beat its k-th key thr, in lane order: place(c) puts
// c in the list and raises thr (warp-uniform, so a candidate that thr has passed since the ballot is skipped).
template <typename Place>
__device__ __forceinline__ void for_each_candidate(u64 key, const u64& thr, Place place) {
  unsigned int mask = __ballot_sync(FULL_MASK, key > thr);
  while (mask) {
    const int src = __ffs(mask) - 1;
    mask &= mask - 1;
    const u64 c = __shfl_sync(FULL_MASK, key, src);
    if (c > thr) place(c);
  }
}

// A warp's list of its k best keys for the top-k kernels, kept in shared memory (any k <= TOPK_MAX): L is the
// warp's k slots, sorted (descending), thr its k-th key (warp-uniform). insert() takes every lane's candidate
// `key` (0 = none); store() leaves the list at `to` (the slots it is kept in).
struct SmemList {
  u64* L;
  int k;
  u64 thr = 0ull;
  __device__ __forceinline__ SmemList(u64* slots, int k_) : L(slots), k(k_) {
    for (int i = threadIdx.x & 31; i < k; i += 32) L[i] = 0ull;
    __syncwarp();
  }
  __device__ __forceinline__ void insert(u64 key) {
    const int lane = threadIdx.x & 31;
    for_each_candidate(key, thr, [&](u64 c) {
      int pos = 0;
#pragma unroll
      for (int r = 0; r < TOPK_MAX / 32; ++r) {
        const int i = r * 32 + lane;
        pos += __popc(__ballot_sync(FULL_MASK, i < k && L[i] > c));
      }
      u64 old[TOPK_MAX / 32];
#pragma unroll
      for (int r = 0; r < TOPK_MAX / 32; ++r) {
        const int i = r * 32 + lane;
        old[r] = (i >= pos && i < k - 1) ? L[i] : 0ull;
      }
      __syncwarp();
#pragma unroll
      for (int r = 0; r < TOPK_MAX / 32; ++r) {
        const int i = r * 32 + lane;
        if (i >= pos && i < k - 1) L[i + 1] = old[r];
      }
      if (lane == 0) L[pos] = c;
      __syncwarp();
      thr = L[k - 1];
    });
  }
  __device__ __forceinline__ void store(u64*) const {}
};

// The same list for k <= 32 in registers, lane i holding the i-th best key (0 past k): an insert is a ballot,
// two shuffles and a select, where the shared-memory list's rounds over TOPK_MAX slots and its warp barriers
// made the inserts most of a top-8 pass over a row (1,024 rows of V = 256,206 bf16: 332 us, 134 without them).
struct RegList {
  u64 mine = 0ull, thr = 0ull;
  int k;
  __device__ __forceinline__ RegList(u64*, int k_) : k(k_) {}
  __device__ __forceinline__ void insert(u64 key) {
    const int lane = threadIdx.x & 31;
    for_each_candidate(key, thr, [&](u64 c) {
      const int pos = __popc(__ballot_sync(FULL_MASK, lane < k && mine > c));
      const u64 above = __shfl_up_sync(FULL_MASK, mine, 1);
      if (lane < k && lane >= pos) mine = lane == pos ? c : above;
      thr = __shfl_sync(FULL_MASK, mine, k - 1);
    });
  }
  __device__ __forceinline__ void store(u64* to) const {
    const int lane = threadIdx.x & 31;
    if (lane < k) to[lane] = mine;
    __syncwarp();
  }
};

// Warp 0 folds the lists of warps 1..7 (stored at lists + w * k, after a __syncthreads by the caller) into its
// own, and leaves the result at lists[0, k).
template <typename List>
__device__ __forceinline__ void merge_warp_lists(List& list, u64* lists, int k) {
  const int lane = threadIdx.x & 31;
  for (int w = 1; w < SEL_WARPS; ++w)
    for (int r = 0; r < k; r += 32) {
      const int i = r + lane;
      list.insert(i < k ? lists[w * k + i] : 0ull);
    }
  list.store(lists);
}

__device__ __forceinline__ void write_topk(const u64* L, int k, float lse, int n, float* __restrict__ values,
                                           i64* __restrict__ indices) {
  for (int i = threadIdx.x & 31; i < k; i += 32) {
    values[(i64)n * k + i] = key_value(L[i]) - lse;
    indices[(i64)n * k + i] = key_index(L[i]);
  }
}

template <typename T, typename List>
__device__ __forceinline__ void topk_partial_impl(const T* __restrict__ logits, i64 ld, int V, int chunk, int vec,
                                                  int k, const i64* __restrict__ ban, i64 ban_id,
                                                  u64* __restrict__ part_keys, float* __restrict__ part_ms,
                                                  float* __restrict__ values, i64* __restrict__ indices) {
  extern __shared__ u64 lists[];  // [SEL_WARPS][k]
  __shared__ float sm_m[SEL_WARPS], sm_s[SEL_WARPS];
  const int n = blockIdx.x, sp = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int v0 = sp * chunk, v1 = min(V, v0 + chunk);
  const T* row = logits + n * ld;
  const i64 banned = ban != nullptr && ban[n] != 0 ? ban_id : -1;  // never a candidate, still in the log-sum-exp
  List list(lists + warp * k, k);
  float m = NEG_INF, s = 0.f;
  // The warp takes its lanes' batches to the list logit by logit only where some lane's largest logit, keyed at
  // its batch's lowest index (a key no logit of that batch exceeds), or a NaN, beats the warp's k-th key: past
  // the first few hundred logits of a row almost no batch does, and the warp skips a ballot a logit.
  const auto may_enter = [&](float lm, float bs, int lowest) {
    return __any_sync(FULL_MASK, bs != bs || make_key(lm, (unsigned int)lowest) > list.thr);
  };
  const auto insert = [&](float x, int i) {  // every lane of the warp, i past v1 included
    list.insert(i < v1 && i != banned ? make_key(x, (unsigned int)i) : 0ull);
  };
  const auto scan = [&](auto kind) {
    using B = decltype(kind);
    scan_batches<B, true>(row, v0 + warp * 32 * B::SPAN, lane * B::SPAN, v1, [&](const float* x, int i0) {
      float bs;
      const float lm = lse_batch<B::K>(m, s, x, bs);
      if (!may_enter(lm, bs, i0)) return;
#pragma unroll
      for (int e = 0; e < B::K; ++e) insert(x[e], i0 + B::offset(e));  // the warp's 32 lanes' e-th logits at once
    });
  };
  if (vec) scan(VecBatch{}); else scan(OneBatch{});
  list.store(lists + warp * k);
  block_lse(m, s, sm_m, sm_s);  // its __syncthreads also publishes every warp's list
  if (warp != 0) return;
  merge_warp_lists(list, lists, k);
  if (gridDim.y == 1) {
    write_topk(lists, k, m + logf(s), n, values, indices);
  } else {
    const i64 p = (i64)n * gridDim.y + sp;
    for (int i = lane; i < k; i += 32) part_keys[p * k + i] = lists[i];
    if (lane == 0) { part_ms[2 * p] = m; part_ms[2 * p + 1] = s; }
  }
}

// Block per row: the 8 warps take the row's splits*k candidate keys in turn, then warp 0 merges.
template <typename List>
__device__ __forceinline__ void topk_merge_impl(const u64* __restrict__ part_keys, const float* __restrict__ part_ms,
                                                int splits, int k, float* __restrict__ values,
                                                i64* __restrict__ indices) {
  extern __shared__ u64 merge_lists[];
  __shared__ float sm_m[SEL_WARPS], sm_s[SEL_WARPS];
  const int n = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u64* lists = merge_lists;
  List list(lists + warp * k, k);
  const int total = splits * k;
  const u64* cand = part_keys + (i64)n * total;
  for (int b = warp * 32; b < total; b += SEL_THREADS) {
    const int i = b + lane;
    list.insert(i < total ? cand[i] : 0ull);
  }
  list.store(lists + warp * k);
  float m = NEG_INF, s = 0.f;
  for (int i = threadIdx.x; i < splits; i += SEL_THREADS)
    lse_merge(m, s, part_ms[2 * ((i64)n * splits + i)], part_ms[2 * ((i64)n * splits + i) + 1]);
  block_lse(m, s, sm_m, sm_s);
  if (warp != 0) return;
  merge_warp_lists(list, lists, k);
  write_topk(lists, k, m + logf(s), n, values, indices);
}

// One kernel of each list kind (SmemList any k; RegList k <= 32: ops_selection.TOPK_REG_MAX).
#define TOPK_MERGE_KERNEL(NAME, LIST)                                                                        \
  extern "C" __global__ void __launch_bounds__(SEL_THREADS) NAME(const u64* part_keys, const float* part_ms,  \
                                                                 int splits, int k, float* values,           \
                                                                 i64* indices) {                             \
    pdl_enter();                                                                                             \
    topk_merge_impl<LIST>(part_keys, part_ms, splits, k, values, indices);                                   \
  }
TOPK_MERGE_KERNEL(topk_merge, SmemList)
TOPK_MERGE_KERNEL(topk_merge_reg, RegList)
#define TOPK_PARTIAL_KERNEL(NAME, T, LIST)                                                                   \
  extern "C" __global__ void __launch_bounds__(SEL_THREADS) NAME(                                            \
      const T* logits, i64 ld, int V, int chunk, int vec, int k, const i64* ban, i64 ban_id, u64* part_keys, \
      float* part_ms, float* values, i64* indices) {                                                         \
    pdl_enter();                                                                                             \
    topk_partial_impl<T, LIST>(logits, ld, V, chunk, vec, k, ban, ban_id, part_keys, part_ms, values,       \
                               indices);                                                                     \
  }

#define TOPK_KERNELS(S, T)                                                                                   \
  TOPK_PARTIAL_KERNEL(topk_partial_##S, T, SmemList)                                                         \
  TOPK_PARTIAL_KERNEL(topk_partial_reg_##S, T, RegList)
FOR_EACH_DTYPE(TOPK_KERNELS)
