// logits.cu: token selection over the vocabulary, one read of the logits (fp32 or bf16 / fp16).
//
// greedy_partial_<dt>: block (n, s) reduces logits[n, s*chunk : (s+1)*chunk] to its best key (value,
//   then lowest index; NaN ranks highest, like torch.argmax) and an online log-sum-exp (m, sum).
//   With one split per row it writes the answer itself: token[n] = argmax, logprob[n] =
//   logits[n, token] - logsumexp(logits[n]) (= log_softmax at the argmax); otherwise partials, and
//   greedy_combine (one warp per row) finishes.
//   The batches, their scan (scan_batches) and the block's log-sum-exp are topk.cu's too.

// gather_rows16: out row n = src row index[n], as 16-byte pieces (cols16 of them a row; row strides src_ld16 and
//   out_ld16 in pieces). Grid (ceil(cols16 / (GATHER_THREADS * GATHER_LOADS)), N), each thread's loads in flight
//   before its stores.

#define SEL_THREADS 256
#define SEL_WARPS 8
#define SEL_LOADS 4
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
// unpack() converts it; load_batch() does both.
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
};

// The batch of kind B that starts at logit i0, as floats.
template <typename B, typename T>
__device__ __forceinline__ void load_batch(const T* __restrict__ row, int i0, int v1, float* x) {
  B::unpack(B::load_raw(row, i0, v1), x);
}

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
      load_batch<B>(row, b + lane_offset, v1, x);
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
  load_batch<B>(row, best.batch, v1, x);
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

#define LOGITS_KERNELS(S, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(SEL_THREADS, 8) greedy_partial_##S(                           \
      const T* logits, i64 ld, int V, int chunk, int vec, u64* part_key, float* part_ms, i64* token,          \
      float* logprob) {                                                                                      \
    pdl_enter();                                                                                              \
    greedy_partial_impl<T>(logits, ld, V, chunk, vec, part_key, part_ms, token, logprob);                    \
  }
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
