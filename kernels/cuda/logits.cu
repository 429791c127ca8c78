// logits.cu: token selection over the vocabulary, one read of the logits (fp32 or bf16 / fp16).
//
// greedy_partial_<dt>: block (n, s) reduces logits[n, s*chunk : (s+1)*chunk] to its best key (value,
//   then lowest index; NaN ranks highest, like torch.argmax) and an online log-sum-exp (m, sum).
//   With one split per row it writes the answer itself: token[n] = argmax, logprob[n] =
//   logits[n, token] - logsumexp(logits[n]) (= log_softmax at the argmax); otherwise partials, and
//   greedy_combine (one warp per row) finishes.
// topk_partial_<dt>: the same pass keeping the top k keys (k <= 128): every warp keeps a sorted list of
//   k keys in shared memory; a candidate is inserted only when it beats the warp's current k-th key
//   (a ballot per 32 logits, taken only for batches where some lane's could; after the first few hundred
//   logits almost none can), then
//   warp 0 merges the 8 lists. One split per row: values[n, i] = logit - logsumexp (= log_softmax),
//   indices[n, i], best first; otherwise partial lists, and topk_merge finishes. Rows with ban[n] != 0 never
//   take token ban_id, which still counts in their log-sum-exp (HF bans </s> after the log-softmax).
//   NaN in a row makes that row's log-sum-exp, hence its values, NaN (as log_softmax does).
//   topk_partial_reg_<dt> / topk_merge_reg: the same for k <= 32, each warp's list in registers (RegList).

// gather_rows16: out row n = src row index[n], as 16-byte pieces (cols16 of them a row; row strides src_ld16 and
//   out_ld16 in pieces). Grid (ceil(cols16 / (GATHER_THREADS * GATHER_LOADS)), N), each thread's loads in flight
//   before its stores.

#define SEL_THREADS 256
#define SEL_WARPS 8
#define SEL_LOADS 4
#define TOPK_MAX 128
#define SEL_VLOADS 2  // 16-byte loads a thread has in flight in the vector loops

// logits [i, i + 8) of a row as loaded (-inf past v1); i a multiple of 8 on a 16-byte aligned row.
template <typename T>
__device__ __forceinline__ Raw8<T> load_logits_raw8(const T* __restrict__ row, int i, int v1) {
  if (i + 8 <= v1) return load_raw8(row + i);
  float x[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = i + e < v1 ? to_f(row[i + e]) : NEG_INF;
  return pack_raw8<T>(x);  // exact: each value is a T
}

// The selection loops' batches, one kind for greedy and top-k alike: a thread reads K logits a round, the
// block's threads together SEL_THREADS * K consecutive ones, thread t's batch starting at logit t * SPAN of the
// round's. Element e of the batch that starts at logit i0 is logit i0 + offset(e), ascending in e; past v1 it
// reads -inf. load_raw() takes a batch as loaded (Raw<T>, fewer registers than its floats for 16-bit logits) and
// unpack() converts it; load() is both.
struct VecBatch {  // 8 logits a 16-byte load, SEL_VLOADS loads (rows and chunks on 8-element boundaries)
  static constexpr int SPAN = 8, K = 8 * SEL_VLOADS;
  template <typename T> struct Raw { Raw8<T> piece[SEL_VLOADS]; };
  __device__ __forceinline__ static int offset(int e) { return (e / 8) * SEL_THREADS * 8 + e % 8; }
  template <typename T>
  __device__ __forceinline__ static Raw<T> load_raw(const T* __restrict__ row, int i0, int v1) {
    Raw<T> raw;
#pragma unroll
    for (int u = 0; u < SEL_VLOADS; ++u) raw.piece[u] = load_logits_raw8(row, i0 + u * SEL_THREADS * 8, v1);
    return raw;
  }
  template <typename T> __device__ __forceinline__ static void unpack(const Raw<T>& raw, float* x) {
#pragma unroll
    for (int u = 0; u < SEL_VLOADS; ++u) unpack8(raw.piece[u], x + 8 * u);
  }
  template <typename T>
  __device__ __forceinline__ static void load(const T* __restrict__ row, int i0, int v1, float* x) {
    unpack(load_raw(row, i0, v1), x);
  }
};
struct OneBatch {  // a logit a load, SEL_LOADS loads
  static constexpr int SPAN = 1, K = SEL_LOADS;
  template <typename T> struct Raw { T logit[K]; };
  __device__ __forceinline__ static int offset(int e) { return e * SEL_THREADS; }
  template <typename T>
  __device__ __forceinline__ static Raw<T> load_raw(const T* __restrict__ row, int i0, int v1) {
    Raw<T> raw;
#pragma unroll
    for (int e = 0; e < K; ++e) {
      const int i = i0 + offset(e);
      raw.logit[e] = i < v1 ? row[i] : from_f<T>(NEG_INF);
    }
    return raw;
  }
  template <typename T> __device__ __forceinline__ static void unpack(const Raw<T>& raw, float* x) {
#pragma unroll
    for (int e = 0; e < K; ++e) x[e] = to_f(raw.logit[e]);
  }
  template <typename T>
  __device__ __forceinline__ static void load(const T* __restrict__ row, int i0, int v1, float* x) {
    unpack(load_raw(row, i0, v1), x);
  }
};

// body(x, i0) for each batch of kind B a thread takes: i0 = b + lane_offset, b from `first` below v1 in rounds of
// the block's SEL_THREADS * K logits (b bounds the loop: warp-uniform where the body takes warp-wide votes). With
// AHEAD, the next batch's loads are issued before body runs, so a thread keeps two batches in flight, the second
// as loaded (unconverted); the compiler does not move loads above the top-k's ballots by itself (top-8 over 1,024
// rows of V = 256,206 bf16: 286 -> 252 us).
template <typename B, bool AHEAD, typename T, typename Body>
__device__ __forceinline__ void scan_batches(const T* __restrict__ row, int first, int lane_offset, int v1, Body body) {
  constexpr int STEP = SEL_THREADS * B::K;
  if (!AHEAD) {
    for (int b = first; b < v1; b += STEP) {
      float x[B::K];
      B::load(row, b + lane_offset, v1, x);
      body(x, b + lane_offset);
    }
    return;
  }
  typename B::template Raw<T> next;
  if (first < v1) next = B::load_raw(row, first + lane_offset, v1);
  for (int b = first; b < v1; b += STEP) {
    float x[B::K];
    B::unpack(next, x);
    if (b + STEP < v1) next = B::load_raw(row, b + lane_offset + STEP, v1);
    body(x, b + lane_offset);
  }
}

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

// Warp-level then block-level reduction of (m, s); result valid in every thread of warp 0.
__device__ __forceinline__ void block_lse(float& m, float& s, float* sm_m, float* sm_s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
    lse_merge(m, s, m2, s2);
  }
  if (lane == 0) { sm_m[warp] = m; sm_s[warp] = s; }
  __syncthreads();
  if (warp == 0) {
    m = lane < SEL_WARPS ? sm_m[lane] : NEG_INF;
    s = lane < SEL_WARPS ? sm_s[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
      lse_merge(m, s, m2, s2);
    }
  }
}

// A thread's running argmax: the first index of the largest value, NaN above all (the first NaN wins), as a
// value and an index (a 64-bit key only once, at the end). A batch that beats the best on the common path is
// recorded by its first index alone (`batch`), its position found once at the end (`resolve_batch`): a scan of
// the batch's logits each time it beat the best made a warp diverge in most of its batches (some lane's running
// best rises in nearly every one of the first few dozen).
struct Argmax {
  float value = NEG_INF;
  int index = -1;  // -1: not known here (nothing seen, or `batch` holds the best)
  int batch = -1;  // >= 0: the first index of the batch whose largest logit is `value`
  bool nan = false;
  __device__ __forceinline__ bool empty() const { return index < 0 && batch < 0; }
  __device__ __forceinline__ u64 key() const {
    return index < 0 ? 0ull : make_key(nan ? __int_as_float(0x7fffffff) : value, (unsigned int)index);
  }
};

// exp(x) as __expf takes it (x * log2(e), then 2^), flushing denormal results to 0 (exp2_ftz).
__device__ __forceinline__ float exp_ftz(float x) { return exp2_ftz(x * 1.4426950408889634f); }

// K logits x[0..K) into a running log-sum-exp: the batch's max first, so one exp a logit and no branch.
// Returns the batch's largest logit (NaN skipped); bs gets the batch's sum, NaN where the batch holds a NaN
// (also while m is still -inf and nothing is summed, where bs is otherwise 0).
template <int K>
__device__ __forceinline__ float lse_batch(float& m, float& s, const float* x, float& bs) {
  float lm = NEG_INF;
#pragma unroll
  for (int e = 0; e < K; ++e) lm = fmaxf(lm, x[e]);
  if (lm > m) {
    s *= __expf(m - lm);  // m = -inf: s is still 0
    m = lm;
  }
  bs = 0.f;
  if (m != NEG_INF) {
#pragma unroll
    for (int e = 0; e < K; ++e) bs += exp_ftz(x[e] - m);
  } else {
#pragma unroll
    for (int e = 0; e < K; ++e) bs = x[e] != x[e] ? x[e] : bs;  // x - m would be NaN for every -inf logit
  }
  s += bs;
  return lm;
}

// The batch x of kind B (VecBatch, OneBatch) starting at logit i0 (past v1 -inf, never chosen) into a running
// argmax and log-sum-exp. A batch without NaN that beats the best is recorded whole (Argmax.batch); the argmax
// looks at the logits one by one only while nothing is summed (all -inf so far) or the batch holds a NaN
// (which fmaxf skips, but the exps' sum does not).
template <typename B>
__device__ __forceinline__ void greedy_batch(Argmax& best, float& m, float& s, const float* x, int i0, int v1) {
  constexpr int K = B::K;
  float bs;
  const float lm = lse_batch<K>(m, s, x, bs);
  const bool unsummed = m == NEG_INF;
  if (best.nan) return;
  if (!unsummed && bs == bs) {
    if (lm > best.value || best.empty()) {
      best.value = lm;
      best.index = -1;
      best.batch = i0;
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < K; ++e) {
    const int i = i0 + B::offset(e);
    if (i >= v1) break;
    if (x[e] != x[e]) {
      best.nan = true;  // lse_batch made s NaN
      best.index = i;
      return;
    }
    if (x[e] > best.value || best.empty()) {
      best.value = x[e];
      best.index = i;
      best.batch = -1;
    }
  }
}

// The recorded batch's position of the best: its first logit equal to the batch's largest (the batch read
// again from the row).
template <typename B, typename T>
__device__ __forceinline__ void resolve_batch(Argmax& best, const T* __restrict__ row, int v1) {
  if (best.batch < 0) return;
  float x[B::K];
  B::load(row, best.batch, v1, x);
#pragma unroll
  for (int e = 0; e < B::K; ++e) {
    if (x[e] == best.value) {
      best.value = x[e];  // of -0 and +0, the one at that index
      best.index = best.batch + B::offset(e);
      break;
    }
  }
  best.batch = -1;
}

template <typename T>
__device__ __forceinline__ void greedy_partial_impl(const T* __restrict__ logits, i64 ld, int V, int chunk, int vec,
                                                    u64* __restrict__ part_key, float* __restrict__ part_ms,
                                                    i64* __restrict__ token, float* __restrict__ logprob) {
  __shared__ u64 sm_key[SEL_WARPS];
  __shared__ float sm_m[SEL_WARPS], sm_s[SEL_WARPS];
  const int n = blockIdx.x, sp = blockIdx.y;
  const int v0 = sp * chunk, v1 = min(V, v0 + chunk);
  const T* row = logits + n * ld;
  float m = NEG_INF, s = 0.f;
  Argmax arg;
  const auto scan = [&](auto kind) {
    using B = decltype(kind);
    // no loads ahead: under greedy's 32-register bound their registers spill (1,024 rows 137 -> 437 us), and a
    // looser bound costs the blocks that keep its loads in flight (6 blocks an SM 176 us, 5 blocks 157)
    scan_batches<B, false>(row, v0 + (int)threadIdx.x * B::SPAN, 0, v1,
                           [&](const float* x, int i0) { greedy_batch<B>(arg, m, s, x, i0, v1); });
    resolve_batch<B>(arg, row, v1);
  };
  if (vec) scan(VecBatch{}); else scan(OneBatch{});
  u64 best = arg.key();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  best = warp_max_u64(best);
  if (lane == 0) sm_key[warp] = best;
  block_lse(m, s, sm_m, sm_s);  // contains the __syncthreads that publishes sm_key
  if (warp != 0) return;
  best = lane < SEL_WARPS ? sm_key[lane] : 0ull;
  best = warp_max_u64(best);
  if (lane != 0) return;
  if (gridDim.y == 1) {
    token[n] = key_index(best);
    logprob[n] = key_value(best) - (m + logf(s));
  } else {
    const i64 p = (i64)n * gridDim.y + sp;
    part_key[p] = best;
    part_ms[2 * p] = m;
    part_ms[2 * p + 1] = s;
  }
}

// One warp per row over its `splits` partials.
extern "C" __global__ void greedy_combine(const u64* __restrict__ part_key, const float* __restrict__ part_ms,
                                          int N, int splits, i64* __restrict__ token, float* __restrict__ logprob) {
  pdl_enter();
  const int lane = threadIdx.x & 31;
  const int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (n >= N) return;  // warp-uniform
  u64 best = 0;
  float m = NEG_INF, s = 0.f;
  for (int i = lane; i < splits; i += 32) {
    const i64 p = (i64)n * splits + i;
    best = part_key[p] > best ? part_key[p] : best;
    lse_merge(m, s, part_ms[2 * p], part_ms[2 * p + 1]);
  }
  best = warp_max_u64(best);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o);
    lse_merge(m, s, m2, s2);
  }
  if (lane == 0) {
    token[n] = key_index(best);
    logprob[n] = key_value(best) - (m + logf(s));
  }
}

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

#define LOGITS_KERNELS(S, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(SEL_THREADS, 8) greedy_partial_##S(                           \
      const T* logits, i64 ld, int V, int chunk, int vec, u64* part_key, float* part_ms, i64* token,          \
      float* logprob) {                                                                                      \
    pdl_enter();                                                                                              \
    greedy_partial_impl<T>(logits, ld, V, chunk, vec, part_key, part_ms, token, logprob);                    \
  }                                                                                                          \
  TOPK_PARTIAL_KERNEL(topk_partial_##S, T, SmemList)                                                         \
  TOPK_PARTIAL_KERNEL(topk_partial_reg_##S, T, RegList)
FOR_EACH_DTYPE(LOGITS_KERNELS)

#define GATHER_THREADS 256
#define GATHER_LOADS 4

extern "C" __global__ void __launch_bounds__(GATHER_THREADS) gather_rows16(const uint4* __restrict__ src, i64 src_ld16,
                                                                           const i64* __restrict__ index,
                                                                           uint4* __restrict__ out, i64 out_ld16,
                                                                           i64 cols16) {
  pdl_enter();
  const i64 n = blockIdx.y;
  const uint4* row = src + index[n] * src_ld16;
  const i64 c0 = (i64)blockIdx.x * GATHER_THREADS * GATHER_LOADS + threadIdx.x;
  uint4 piece[GATHER_LOADS];
#pragma unroll
  for (int u = 0; u < GATHER_LOADS; ++u) {
    const i64 c = c0 + u * GATHER_THREADS;
    if (c < cols16) piece[u] = row[c];
  }
#pragma unroll
  for (int u = 0; u < GATHER_LOADS; ++u) {
    const i64 c = c0 + u * GATHER_THREADS;
    if (c < cols16) out[n * out_ld16 + c] = piece[u];
  }
}
