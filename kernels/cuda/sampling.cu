// sampling.cu: HF's sampling warpers on float32 scores (semantics and reference:
// kernels/reference_selection.py sampling_warp): temperature (a multiply by the rounded reciprocal, as torch
// divides by a scalar on CUDA, so HF on the GPU), then top-k, then top-p, each cut an exact selection in a
// few passes over the row:
//   1. the row's max; 2. a histogram over 2048 value bins below it (1/64 nat wide; the last holds everything
//   more than 32 nats down), counting elements and summing their softmax mass; the bin holding the cut is
//   found from it; 3. that bin's elements are copied to shared memory and sorted, and the cut read off them.
//   A bin too full to copy is narrowed first by radix passes over the bytes of its elements' order-preserving
//   bits. Bins rather than radix digits first because the top byte of a float is its sign and exponent: a row
//   of logits puts nearly every element in a few of those and the shared-memory atomics would serialise.
// Masses are summed in 2^-40 fixed point: the cut does not depend on the order of the atomics (a seed draws
// the same token every run) and is exact to ~1e-12, where HF's float32 cumsum is not. Rows holding a NaN are
// only scaled: the NaN reaches the softmax, as in torch.
// sampling_warp reads a row with one block; sampling_warp_cluster (sm_90+) with a cluster of 8, each block an
// eighth of it, the leader merging their histograms and candidates through distributed shared memory.

#define WARP_THREADS 1024             // sampling_warp: one block a row
#define SAMPLE_CLUSTER 8              // sampling_warp_cluster (sm_90+): blocks a row
#define SAMPLE_CL_THREADS 512         // sampling_warp_cluster: threads a block
#define BINS 2048                     // level-0 value bins
#define BIN_SCALE 64.f                // level-0 bins per nat below the row's max
#define DIGITS 256                    // radix levels 1-4: a byte of the key
#define CANDIDATES 4096               // elements of the cut's bin sorted in shared memory
#define MASS_ONE 1099511627776.0f     // 2^40: fixed-point unit of exp(x - max) (at most 1 an element)

// Clusters: C blocks share a row (sm_90+), each reading a 1/C slice; the leader (rank 0) merges their
// histograms and candidates through distributed shared memory and decides. C = 1: one block, no cluster.
template <int C> __device__ __forceinline__ void cluster_sync() {
  __syncthreads();  // the block converged: the cluster barrier is the warp-aligned kind
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    cluster_arrive();
    cluster_wait();
  }
#endif
}
template <int C, typename T> __device__ __forceinline__ T peer_load(const T* p, unsigned cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    if constexpr (sizeof(T) == 8) {
      union { unsigned long long u; T v; } bits;
      asm volatile("ld.shared::cluster.u64 %0, [%1];\n" : "=l"(bits.u) : "r"(cluster_map(p, cta)) : "memory");
      return bits.v;
    } else {
      union { unsigned u; T v; } bits;
      asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(bits.u) : "r"(cluster_map(p, cta)) : "memory");
      return bits.v;
    }
  }
#endif
  return *p;
}
// keys[atomicAdd(n, 1)] = key in block `cta`'s shared memory
template <int C> __device__ __forceinline__ void peer_append(unsigned* keys, int* n, unsigned key, unsigned cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    int at;
    asm volatile("atom.shared::cluster.add.u32 %0, [%1], %2;\n"
                 : "=r"(at) : "r"(cluster_map(n, cta)), "r"(1) : "memory");
    if (at < CANDIDATES)
      asm volatile("st.shared::cluster.u32 [%0], %1;\n" :: "r"(cluster_map(keys + at, cta)), "r"(key) : "memory");
    return;
  }
#endif
  const int at = atomicAdd(n, 1);
  if (at < CANDIDATES) keys[at] = key;  // never past it (the histogram counted them), but never out of bounds
}

// One cut's selection over a row's scaled elements x, in shared memory. The candidates are the elements of
// the chosen level-0 bin whose key bytes of levels 1 .. level-1 are the chosen ones (level 0: all elements).
// Every block of a cluster holds its slice's histogram and a copy of level, bin, prefix and chosen_count; the
// rest is the leader's.
struct Selection {
  unsigned int count[BINS];  // per digit of the current level: candidates
  u64 mass[BINS];            // and their mass (top-p), fixed point
  unsigned int keys[CANDIDATES];
  int level;                 // 0: choosing a bin; 1-4: choosing a key byte within it; 5: one key left
  int bin;                   // the chosen bin (level >= 1)
  unsigned int prefix;       // the chosen key bytes, the rest zero
  unsigned int chosen_count; // candidates in the digit just chosen
  u64 carry;                 // top-k: the rank of the cut among the candidates; top-p: the mass below them
  u64 threshold;             // top-p: an element is dropped while the mass at and below it is at most this
  int n;                     // candidates copied into keys
  unsigned int cut;          // the selection's result
};

__device__ __forceinline__ int value_bin(float x, float m) {
  const float below = (m - x) * BIN_SCALE;
  return below >= (float)(BINS - 1) ? BINS - 1 : (int)below;  // -inf lands in the last bin too
}
// exp(x - m) in fixed point; 0 for the last bin (more than 32 nats down: under 2^-41)
__device__ __forceinline__ u64 fixed_mass(float x, float m) { return (u64)__float2ull_rn(expf(x - m) * MASS_ONE); }
// the order-preserving bits, -0 as +0 (torch's comparisons do not tell them apart)
__device__ __forceinline__ unsigned int key_of(float x) { return ordered_bits(x + 0.f); }

__device__ __forceinline__ bool is_candidate(const Selection& sel, float x, unsigned int key, float m) {
  if (sel.level == 0) return true;
  if (value_bin(x, m) != sel.bin) return false;
  const int shift = 40 - 8 * sel.level;  // below the chosen bytes (levels 1 .. level-1)
  return sel.level == 1 || (key >> shift) == (sel.prefix >> shift);
}

// f(v, x) for every element v in [lo, hi) of the row, x = row[v] * inv_t. A few blocks read a whole row, so
// latency bounds it unless each thread keeps several loads in flight: 8 here.
template <typename F>
__device__ __forceinline__ void for_each_scaled(const float* row, int lo, int hi, float inv_t, F f) {
  constexpr int U = 8;
  int v = lo + threadIdx.x;
  for (; v + (U - 1) * (int)blockDim.x < hi; v += U * blockDim.x) {
    float x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = row[v + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < U; ++u) f(v + u * blockDim.x, __fmul_rn(x[u], inv_t));
  }
  for (; v < hi; v += blockDim.x) f(v, __fmul_rn(row[v], inv_t));
}

// Count (with_mass: and sum the mass of) this block's candidates at or above key `cut`, per digit of the
// current level.
__device__ void histogram(const float* row, int lo, int hi, float inv_t, float m, unsigned int cut, bool with_mass,
                          Selection& sel) {
  const int digits = sel.level == 0 ? BINS : DIGITS;
  for (int d = threadIdx.x; d < digits; d += blockDim.x) { sel.count[d] = 0; sel.mass[d] = 0; }
  __syncthreads();
  unsigned int far = 0;  // elements of the last bin (often most of a row): one atomic a thread at the end
  for_each_scaled(row, lo, hi, inv_t, [&](int, float x) {
    const unsigned int key = key_of(x);
    if (key < cut || !is_candidate(sel, x, key, m)) return;
    const int d = sel.level == 0 ? value_bin(x, m) : (key >> (32 - 8 * sel.level)) & (DIGITS - 1);
    if (sel.level == 0 && d == BINS - 1) { ++far; return; }
    atomicAdd(&sel.count[d], 1u);
    if (with_mass) atomicAdd(&sel.mass[d], fixed_mass(x, m));
  });
  if (far) atomicAdd(&sel.count[BINS - 1], far);
  __syncthreads();
}

// Warp 0: the first digit, walking `digits` in order (reversed: from the last index down), at which the
// running sum of weights (mass or count) exceeds `bound`; `before` gets the sum of the digits before it.
// -1 when the total does not exceed the bound. Each lane sums a run of digits; the lane where the bound
// falls is then walked (by every lane, the same values).
__device__ int first_crossing(const Selection& sel, int digits, bool reversed, bool by_mass, u64 bound,
                              u64& before) {
  const int lane = threadIdx.x & 31, run = digits / 32;
  auto weight = [&](int i) -> u64 {
    const int d = reversed ? digits - 1 - i : i;
    return by_mass ? sel.mass[d] : (u64)sel.count[d];
  };
  u64 mine = 0;
  for (int i = lane * run; i < (lane + 1) * run; ++i) mine += weight(i);
  const u64 running = warp_prefix_sum_u64(mine);
  const unsigned int over = __ballot_sync(FULL_MASK, running > bound);
  if (!over) return -1;
  const int at = __ffs(over) - 1;
  before = __shfl_sync(FULL_MASK, running - mine, at);
  for (int i = at * run; i < (at + 1) * run; ++i) {
    const u64 w = weight(i);
    if (before + w > bound) return reversed ? digits - 1 - i : i;
    before += w;
  }
  return -1;  // unreachable: lane `at`'s run crosses
}

// Warp 0, top-p where rounding kept every digit at or under the threshold: the largest nonempty digit (in
// value order) and the mass below it.
__device__ int largest_nonempty(const Selection& sel, int digits, u64& before) {
  const int lane = threadIdx.x & 31;
  int best = -1;  // in value order: level 0 counts bins down from the max
  u64 total = 0;
  for (int d = lane; d < digits; d += 32) {
    total += sel.mass[d];
    const int rank = sel.level == 0 ? digits - 1 - d : d;
    if (sel.count[d] && rank > best) best = rank;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(FULL_MASK, best, o));
  total = warp_sum_u64(total);
  const int d = sel.level == 0 ? digits - 1 - best : best;
  before = total - sel.mass[d];
  return d;
}

// Sort keys[0, n) (n <= CANDIDATES) in shared memory: bitonic over the next power of two, padded with `pad`.
__device__ void sort_keys(unsigned int* keys, int n, bool ascending, unsigned int pad) {
  int size = 2;
  while (size < n) size <<= 1;
  for (int i = n + threadIdx.x; i < size; i += blockDim.x) keys[i] = pad;
  __syncthreads();
  for (int span = 2; span <= size; span <<= 1) {
    for (int stride = span >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size / 2; i += blockDim.x) {
        const int a = 2 * i - (i & (stride - 1)), b = a + stride;
        const bool up = ((a & span) == 0) == ascending;
        const unsigned int ka = keys[a], kb = keys[b];
        if ((ka > kb) == up) { keys[a] = kb; keys[b] = ka; }
      }
      __syncthreads();
    }
  }
}

// Leader's warp 0: the digit of this level holding the cut, from the merged histogram; advances the state.
__device__ void choose_digit(Selection& sel, bool top_k, double top_p) {
  const int digits = sel.level == 0 ? BINS : DIGITS;
  if (!top_k && sel.level == 0) {
    u64 total = 0;
    for (int d = threadIdx.x; d < BINS; d += 32) total += sel.mass[d];
    total = warp_sum_u64(total);
    sel.threshold = (u64)((1.0 - top_p) * (double)total);  // every lane writes the same value
  }
  __syncwarp();
  u64 before = 0;
  // top-k walks values down (bins up, key bytes down), top-p up
  int d = first_crossing(sel, digits, (sel.level == 0) != top_k, !top_k,
                         top_k ? sel.carry - 1 : sel.threshold - sel.carry, before);
  if (d < 0) d = largest_nonempty(sel, digits, before);
  __syncwarp();
  if (threadIdx.x == 0) {
    sel.carry = top_k ? sel.carry - before : sel.carry + before;
    sel.chosen_count = sel.count[d];
    if (sel.level == 0) sel.bin = d;
    else sel.prefix |= (unsigned int)d << (32 - 8 * sel.level);
    ++sel.level;
    sel.n = 0;
  }
}

// Leader's warp 0, top-p: in the sorted candidates (ascending), the first at which the mass at and below it
// passes the threshold (the largest where rounding never does).
__device__ unsigned int top_p_in_candidates(const Selection& sel, float m) {
  const int lane = threadIdx.x, n = sel.n, run = (n + 31) / 32;
  u64 mine = 0;
  for (int i = lane * run; i < min(n, (lane + 1) * run); ++i) mine += fixed_mass(unordered_bits(sel.keys[i]), m);
  const u64 running = warp_prefix_sum_u64(mine);
  const unsigned int over = __ballot_sync(FULL_MASK, sel.carry + running > sel.threshold);
  if (!over) return sel.keys[n - 1];
  const int at = __ffs(over) - 1;
  u64 acc = sel.carry + __shfl_sync(FULL_MASK, running - mine, at);
  for (int i = at * run; i < min(n, (at + 1) * run); ++i) {
    acc += fixed_mass(unordered_bits(sel.keys[i]), m);
    if (acc > sel.threshold) return sel.keys[i];
  }
  return sel.keys[n - 1];  // unreachable: lane `at`'s run passes it
}

// The cut of one warper over the row's elements at or above key `cut`: top_k, the key of the k-th largest;
// else top-p, the smallest key it keeps. This block reads elements [lo, hi); rank 0 leads.
template <int C>
__device__ unsigned int select_cut(const float* row, int lo, int hi, float inv_t, float m, unsigned int cut,
                                   bool top_k, i64 k, double top_p, Selection& sel) {
  const unsigned rank = C > 1 ? blockIdx.x : 0;
  if (threadIdx.x == 0) { sel.level = 0; sel.prefix = 0; sel.carry = top_k ? (u64)k : 0; }
  __syncthreads();  // every thread reads the level before the histogram's first barrier
  // 1. narrow the candidates a level at a time until they fit in shared memory (or are one key)
  do {
    histogram(row, lo, hi, inv_t, m, cut, !top_k, sel);
    cluster_sync<C>();  // every slice's histogram is complete
    if (rank == 0) {
      const int digits = sel.level == 0 ? BINS : DIGITS;
      for (unsigned c = 1; c < C; ++c)
        for (int d = threadIdx.x; d < digits; d += blockDim.x) {
          sel.count[d] += peer_load<C>(&sel.count[d], c);
          if (!top_k) sel.mass[d] += peer_load<C>(&sel.mass[d], c);
        }
      __syncthreads();
      if (threadIdx.x < 32) choose_digit(sel, top_k, top_p);
    }
    cluster_sync<C>();  // the leader's choice is made (and it is done reading the others' histograms)
    if (rank != 0 && threadIdx.x == 0) {
      sel.level = peer_load<C>(&sel.level, 0);
      sel.bin = peer_load<C>(&sel.bin, 0);
      sel.prefix = peer_load<C>(&sel.prefix, 0);
      sel.chosen_count = peer_load<C>(&sel.chosen_count, 0);
    }
    __syncthreads();
  } while (sel.chosen_count > CANDIDATES && sel.level < 5);
  if (sel.level == 5) return sel.prefix;  // the candidates are one value
  // 2. the leader gathers them, sorts them and reads the cut off
  for_each_scaled(row, lo, hi, inv_t, [&](int, float x) {
    const unsigned int key = key_of(x);
    if (key >= cut && is_candidate(sel, x, key, m)) peer_append<C>(sel.keys, &sel.n, key, 0);
  });
  cluster_sync<C>();  // every candidate is in the leader's keys
  if (rank == 0) {
    if (threadIdx.x == 0) sel.n = min(sel.n, CANDIDATES);
    __syncthreads();
    sort_keys(sel.keys, sel.n, !top_k, top_k ? 0u : 0xffffffffu);
    if (threadIdx.x < 32) {
      const unsigned int found = top_k ? sel.keys[min(sel.carry, (u64)sel.n) - 1] : top_p_in_candidates(sel, m);
      if (threadIdx.x == 0) sel.cut = found;
    }
  }
  // the cut is decided; the leader writes the next one only after the next selection's first cluster barrier,
  // which every block reaches after reading this one
  cluster_sync<C>();
  return peer_load<C>(&sel.cut, 0);
}

// The row's max of the scaled elements (NaN: the row holds one) over the whole cluster.
template <int C>
__device__ float row_max(const float* row, int lo, int hi, float inv_t, float* scratch, float* part, bool& nan) {
  float m = NEG_INF;
  int has_nan = 0;
  for_each_scaled(row, lo, hi, inv_t, [&](int, float x) {
    has_nan |= x != x;
    m = fmaxf(m, x);
  });
  has_nan = __syncthreads_or(has_nan);
  m = block_max(m, scratch);
  if (threadIdx.x == 0) *part = has_nan ? QNAN : m;
  cluster_sync<C>();
  float all = NEG_INF;
  nan = false;
  for (unsigned c = 0; c < C; ++c) {
    const float v = peer_load<C>(part, c);
    nan |= v != v;
    all = fmaxf(all, v);
  }
  return all;
}

template <int C>
__device__ void sampling_warp_row(const float* __restrict__ scores, i64 stride, int V,
                                  const float* __restrict__ temperature, const i64* __restrict__ top_k,
                                  const double* __restrict__ top_p, float* __restrict__ out, i64 out_stride) {
  __shared__ Selection sel;
  __shared__ float scratch[33], part;
  pdl_enter();
  const int n = blockIdx.y, slice = (V + C - 1) / C;
  const int lo = min(V, (C > 1 ? (int)blockIdx.x : 0) * slice), hi = min(V, lo + slice);
  const float* row = scores + (i64)n * stride;
  float* dst = out + (i64)n * out_stride;
  const float inv_t = __frcp_rn(temperature[n]);
  // 1. the scaled row's max, and whether it holds a NaN
  bool nan;
  const float m = row_max<C>(row, lo, hi, inv_t, scratch, &part, nan);
  // 2. the cuts: keep the elements whose key is at least `cut` (0 keeps everything)
  unsigned int cut = 0;
  if (!nan && m != NEG_INF) {
    const i64 k = top_k[n];
    if (k > 0 && k < V) cut = select_cut<C>(row, lo, hi, inv_t, m, 0, true, k, 1.0, sel);
    if (top_p[n] < 1.0) cut = select_cut<C>(row, lo, hi, inv_t, m, cut, false, 0, top_p[n], sel);
  }
  // 3. the warped row
  for_each_scaled(row, lo, hi, inv_t, [&](int v, float x) { dst[v] = key_of(x) >= cut ? x : NEG_INF; });
  cluster_sync<C>();  // no block leaves while another may still read its shared memory (`part`)
}

extern "C" __global__ void __launch_bounds__(WARP_THREADS, 1)
    sampling_warp(const float* __restrict__ scores, i64 stride, int V, const float* __restrict__ temperature,
                  const i64* __restrict__ top_k, const double* __restrict__ top_p, float* __restrict__ out,
                  i64 out_stride) {
  sampling_warp_row<1>(scores, stride, V, temperature, top_k, top_p, out, out_stride);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
extern "C" __global__ void __cluster_dims__(SAMPLE_CLUSTER, 1, 1) __launch_bounds__(SAMPLE_CL_THREADS, 2)
    sampling_warp_cluster(const float* __restrict__ scores, i64 stride, int V, const float* __restrict__ temperature,
                          const i64* __restrict__ top_k, const double* __restrict__ top_p, float* __restrict__ out,
                          i64 out_stride) {
  sampling_warp_row<SAMPLE_CLUSTER>(scores, stride, V, temperature, top_k, top_p, out, out_stride);
}
#endif

// ---- the draw ------------------------------------------------------------------------------------------------
// sample_draw: torch.multinomial's one-sample draw (semantics and reference: kernels/reference_selection.py
// sample_draw), each row with its own CUDA generator, in one launch: argmax_v p[v] / q[v], q what exponential_(1)
// writes for that generator over a [1, V] tensor. torch's CUDA exponential_ (distribution_nullary_kernel) runs
// `g` threads (256 a block), thread t taking curand_init(seed, t, offset) and element t + 4g j + g i from
// component i of its j-th curand_uniform4; a Philox4x32-10 counter is (offset / 4 + j, t) under key = seed, so
// any element's noise is one Philox block, made here only where p != 0 (q > 0 everywhere: 0 / q = 0). The
// uniform is curand's x * 2^-32 + 2^-33 and q = -log(u), with torch's guard at u = 1; p / q is an IEEE division
// as torch's. The bits match torch's own draw, so a seed draws HF's tokens.
#define DRAW_THREADS 1024

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k.x += 0x9E3779B9u;
      k.y += 0xBB67AE85u;
    }
    const unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// Element v's Exp(1) noise of a draw (seed, Philox offset `block` = offset / 4) over g threads.
__device__ __forceinline__ float exponential_noise(u64 seed, u64 block, u64 v, u64 g) {
  const u64 j = v / (4 * g), r = v % (4 * g), part = r / g, t = r % g;
  const u64 ctr = block + j;
  const uint4 o = philox4x32_10(make_uint4((unsigned)ctr, (unsigned)(ctr >> 32), (unsigned)t, (unsigned)(t >> 32)),
                                make_uint2((unsigned)seed, (unsigned)(seed >> 32)));
  const unsigned x = part == 0 ? o.x : part == 1 ? o.y : part == 2 ? o.z : o.w;
  const float u = x * 2.3283064e-10f + (2.3283064e-10f / 2.0f);
  const float half_eps = 5.9604645e-08f;  // FLT_EPSILON / 2: log(1) would be 0
  return -1.0f * (u >= 1.0f - half_eps ? -half_eps : logf(u));
}

extern "C" __global__ void __launch_bounds__(DRAW_THREADS)
    sample_draw(const float* __restrict__ probs, i64 stride, int V, const i64* __restrict__ seeds,
                const i64* __restrict__ offsets, i64 g, i64* __restrict__ out) {
  __shared__ u64 warp_best[DRAW_THREADS / 32];
  pdl_enter();
  const int n = blockIdx.x;
  const float* row = probs + (i64)n * stride;
  const u64 seed = (u64)seeds[n], block = (u64)offsets[n] / 4;
  u64 best = 0;
  for (int v = threadIdx.x; v < V; v += DRAW_THREADS) {
    const float p = row[v];
    const float x = p != 0.f ? p / exponential_noise(seed, block, (u64)v, (u64)g) : 0.f;  // NaN: p / q is NaN
    const u64 key = make_key(isnan(x) ? __int_as_float(0x7fffffff) : x, (unsigned)v);  // torch.argmax: NaN wins
    best = key > best ? key : best;
  }
  best = warp_max_u64(best);
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = warp_max_u64(warp_best[threadIdx.x]);
    if (threadIdx.x == 0) out[n] = key_index(best);
  }
}
