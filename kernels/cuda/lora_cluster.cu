// lora_cluster.cu: lora_apply's cluster version (lora.cu states the semantics, the tile records and the
// two-trip read that every version keeps; the helpers it uses are lora.cu's, which the loader puts first).
//
// lora_apply_cluster_<bf16|f16> (sm_90 thread-block clusters; I and O multiples of 128, R of 16): the 8 blocks
// of a cluster share a tile; block c stages and shrinks only columns [c I/8, (c+1) I/8) of x and A (mma
// m16n8k16, fp32), the 8 partial h are added through distributed shared memory in a fixed order (every block
// gets the same bits), and block c expands its 1/8 of the outputs (Bt by cp.async, issued before the shrink;
// ldmatrix.trans). The exchange between the blocks (cluster barrier, DSMEM reads) stays on chip: no third
// trip to L2. y moves in 8-byte pieces: lane pairs trade accumulator halves. A cluster loops over the tile
// records in turns, as many clusters as the GPU holds at once, so a step's records need no second wave of
// clusters (each of which would wait for a whole cluster's room).

#define LORA_CLUSTER 8     // cluster version: blocks a cluster, each with 1/8 of the inputs and outputs
#define LORA_CL_WARPS 4    // cluster version: warps a block (why 4: above lora_apply_cluster)
#define LORA_CL_IC 512     // cluster version: input columns a block stages a pass (fc2's 4096 / 8 in one)
#define LORA_CL_PAIRS 4    // cluster version: most 16-output pairs a warp (64 outputs, as the mma version's warps)
#define LORA_CL_PASSES 4   // cluster version: most rank passes (ranks up to 64: ops' LORA_MAX_RANK)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // thread-block clusters: the cluster version only
// Two adjacent floats at the same shared address of block `cta` of the cluster (DSMEM).
__device__ __forceinline__ float2 ld_cluster_f2(const float* p, unsigned cta) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n"
               : "=f"(v.x), "=f"(v.y) : "r"(cluster_map(p, cta)) : "memory");
  return v;
}

// One rank pass of the cluster version's shrink: this block's columns of the tile's x rows (x_cols: x's
// column c I/8) and of A's 16 ranks from a_cols to shared memory by cp.async (in one wait with what the
// caller issued before), in passes of LORA_CL_IC columns; warp w adds every LORA_CL_WARPS-th 16-column step
// into hsum (ranks 0..7, 8..15 of the pass; mma c layout). False when the slot's rank is 0 (cluster-uniform).
template <typename T>
__device__ __forceinline__ bool lora_cluster_shrink(float (*hsum)[4], T* xs, T* as, int ld, const T* x_cols,
                                                    const T* a_cols, const int* rec, const int* rank, int I) {
  constexpr int ROW_THREADS = LORA_CL_WARPS * 32 / 16;  // threads copying one of the 16 rows of x and of A
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3, t = tid / ROW_THREADS;
  const int count = rec[LORA_TILE + 1], ic = I / LORA_CLUSTER;
  const T* x_row = x_cols + (i64)rec[t < count ? t : 0] * I;  // unused rows repeat row 0
  const T* a_row = a_cols + (i64)t * I;
  for (int c0 = 0; c0 < ic; c0 += LORA_CL_IC) {
    const int len = min(LORA_CL_IC, ic - c0);
    __syncthreads();  // the previous pass is done reading xs and as
    for (int e = (tid % ROW_THREADS) * 8; e < len; e += ROW_THREADS * 8) {  // 16 bytes a copy
      cp_async16(xs + t * ld + e, x_row + c0 + e);
      cp_async16(as + t * ld + e, a_row + c0 + e);
    }
    cp_async_wait();
    __syncthreads();
    if (*rank == 0) return false;  // cluster-uniform: this adapter leaves the site alone
    for (int k = warp * 16; k < len; k += LORA_CL_WARPS * 16) {
      unsigned a[4];
      a_fragment(a, xs + k, ld, g, q);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const T* a_rank = as + (half * 8 + g) * ld + k;
        const unsigned b[2] = {pair16(a_rank + 2 * q), pair16(a_rank + 8 + 2 * q)};
        mma16816(hsum[half], a, b, T());
      }
    }
  }
  return true;
}

// The cluster's h of one rank pass (ranks r0..r0+15): this block's warps' sums into its share `part`; once
// every block's share is in place, the 8 shares read through DSMEM and added in block order (every block
// gets the same bits); ranks past the slot's dropped; split into 16-bit hi + lo. On the last pass a block
// arrives at the cluster barrier once done reading: the caller waits on it before exiting, so no block's
// shared memory goes while another still reads it.
template <typename T>
__device__ __forceinline__ void lora_cluster_sum(const float (*hsum)[4], float (*wpart)[16][16], float (*part)[16],
                                                 T (*hi)[16], T (*lo)[16], int r0, int rank, bool last) {
  const int tid = threadIdx.x, warp = tid >> 5, g = (tid & 31) >> 2, q = tid & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    *reinterpret_cast<float2*>(&wpart[warp][g][half * 8 + 2 * q]) = make_float2(hsum[half][0], hsum[half][1]);
    *reinterpret_cast<float2*>(&wpart[warp][g + 8][half * 8 + 2 * q]) = make_float2(hsum[half][2], hsum[half][3]);
  }
  __syncthreads();
  for (int e = 2 * tid; e < 256; e += 2 * blockDim.x) {  // two adjacent entries a thread, in both sums
    float2 v = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < LORA_CL_WARPS; ++w) {
      const float2 u = *reinterpret_cast<const float2*>(&wpart[w][e / 16][e % 16]);
      v.x += u.x;
      v.y += u.y;
    }
    *reinterpret_cast<float2*>(&part[e / 16][e % 16]) = v;
  }
  cluster_arrive();  // every block's share is written ...
  cluster_wait();    // ... and seen
  for (int e = 2 * tid; e < 256; e += 2 * blockDim.x) {
    const int t = e / 16, r = e % 16;
    float v[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < LORA_CLUSTER; ++k) {
      const float2 u = ld_cluster_f2(&part[t][r], k);
      v[0] += u.x;
      v[1] += u.y;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float h = r0 + r + j < rank ? v[j] : 0.f;
      const T h_hi = from_f<T>(h);
      hi[t][r + j] = h_hi;
      lo[t][r + j] = from_f<T>(h - to_f(h_hi));
    }
  }
  if (last) cluster_arrive();  // cluster-uniform; done reading the other blocks' shares
  __syncthreads();             // hi and lo are complete
}

// y's 8-byte pieces from the accumulators of a 16-output pair (mma c layout: n-blocks b0 and b1, columns 2q
// and 2q + 1 of rows g and g + 8): lanes q and q ^ 1 trade one n-block's pair, so lane q holds n-block
// q & 1's columns 4 (q >> 1) .. 4 (q >> 1) + 3: d[0..3] of row g, d[4..7] of row g + 8. Every lane takes part.
__device__ __forceinline__ void pair_to_quads(float* d, const float* b0, const float* b1, int q) {
  const bool odd = q & 1;
#pragma unroll
  for (int e = 0; e < 4; e += 2) {
    const float k0 = odd ? b1[e] : b0[e], k1 = odd ? b1[e + 1] : b0[e + 1];  // kept: n-block q & 1
    const float s0 = odd ? b0[e] : b1[e], s1 = odd ? b0[e + 1] : b1[e + 1];  // sent: the partner's n-block
    const float r0 = __shfl_xor_sync(FULL_MASK, s0, 1), r1 = __shfl_xor_sync(FULL_MASK, s1, 1);
    float* out = d + 2 * e;  // the lower columns belong to the even lane of the two
    out[0] = odd ? r0 : k0;
    out[1] = odd ? r1 : k1;
    out[2] = odd ? k0 : r0;
    out[3] = odd ? k1 : r1;
  }
}

// The cluster version (T 16-bit; I and O multiples of 16 * LORA_CLUSTER, R of 16; A and Bt finite past
// each rank): tile record k. Grid (X, P, LORA_CLUSTER * G), clusters (1, 1, LORA_CLUSTER): a cluster takes
// records blockIdx.x, + X, ... one at a time (so returns on one are cluster-uniform; X is as many as the GPU
// holds at once, so a step's records need no second wave of clusters, each of which would wait for a whole
// cluster's room), block c of it the input columns [c I/8, (c+1) I/8); the grid's z spreads the O / 16
// output pairs over its warps, at most LORA_CL_PAIRS a warp (G = ceil(O / 2048) so that they fit; then each
// block owns its 1/8 of a cluster's outputs). False when record k is unused. Why 4 warps: at 256 rows q|k|v
// the grid has 16 tiles x 3 parts x 8 = 384 blocks (~3 an SM) and a block's share is 8 steps of the shrink
// and 8 output pairs: 2 of each a warp, the staging copies one row per 8 threads and the DSMEM sum one 8-byte
// load a thread and block; more warps would idle at every barrier. Dynamic shared memory: xs, as [16][ld] T
// (ld = min(I/8, LORA_CL_IC) + 8), wpart [LORA_CL_WARPS][16][16] and part [LORA_CL_PASSES][16][16] float,
// hi, lo [16][16] T, bs [LORA_CL_WARPS][16][LORA_BLD] T (each warp's Bt, 16 ranks x its pairs).
template <typename T>
__device__ __forceinline__ bool lora_apply_cluster(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ A,
                                                   const T* __restrict__ Bt, const int* __restrict__ tiles, int k,
                                                   const int* __restrict__ ranks, int I, int O, int R, int P) {
  extern __shared__ __align__(16) unsigned char lora_smem[];
  const int ic = I / LORA_CLUSTER, ld = min(ic, LORA_CL_IC) + 8;
  T* xs = reinterpret_cast<T*>(lora_smem);
  T* as = xs + 16 * ld;
  float(*wpart)[16][16] = reinterpret_cast<float(*)[16][16]>(as + 16 * ld);
  float(*part)[16][16] = wpart + LORA_CL_WARPS;
  T(*hi)[16] = reinterpret_cast<T(*)[16]>(part + LORA_CL_PASSES);
  T(*lo)[16] = hi + 16;
  __shared__ int rec[LORA_RECORD], rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3, p = blockIdx.y;
  T(*bs)[LORA_BLD] = reinterpret_cast<T(*)[LORA_BLD]>(lo + 16) + warp * 16;  // this warp's Bt block
  const unsigned c = cluster_ctarank();
  if (!read_record(tiles, k, rec)) return false;  // 1. (cluster-uniform: one record a cluster)
  const i64 s = rec[LORA_TILE];
  const int count = rec[LORA_TILE + 1];

  // 2. the batch: y at this lane's 4 outputs of each of the warp's pairs (rows g and g + 8), the rank, Bt, x, A
  const int slots = gridDim.z * LORA_CL_WARPS, per_warp = (O / 16 + slots - 1) / slots;
  const int pair0 = (blockIdx.z * LORA_CL_WARPS + warp) * per_warp, pairs = max(0, min(per_warp, O / 16 - pair0));
  const int o_warp = pair0 * 16, o_lane = o_warp + (q & 1) * 8 + (q >> 1) * 4;  // pair j: + 16 j (pair_to_quads)
  T* y_g = y + ((i64)rec[g < count ? g : 0] * P + p) * O + o_lane;
  T* y_g8 = y + ((i64)rec[g + 8 < count ? g + 8 : 0] * P + p) * O + o_lane;
  Pack<T, 4> yv[LORA_CL_PAIRS][2];
#pragma unroll
  for (int j = 0; j < LORA_CL_PAIRS; ++j) {
    if (j >= pairs) break;  // warp-uniform
    yv[j][0] = load_pack<T, 4>(y_g + 16 * j);
    yv[j][1] = load_pack<T, 4>(y_g8 + 16 * j);
  }
  if (tid == 0) rank = min(ranks[s], R);
  const T* a_cols = A + (s * P + p) * (i64)R * I + c * ic;
  const T* bt_warp = Bt + (s * P + p) * (i64)R * O + o_warp;
  float acc[LORA_CL_PAIRS][2][4] = {};
  for (int r0 = 0;; r0 += LORA_RC) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // Bt[r0:r0+16, the warp's pairs] to bs, 16 bytes a copy
      const int piece = lane + 32 * i, r = piece / 8, col = (piece % 8) * 8;
      if (col < pairs * 16) cp_async16(&bs[r][col], bt_warp + (i64)(r0 + r) * O + col);
    }
    float hsum[2][4] = {};
    if (!lora_cluster_shrink<T>(hsum, xs, as, ld, x + c * ic, a_cols + (i64)r0 * I, rec, &rank, I)) return true;
    const bool last = r0 + LORA_RC >= rank;
    lora_cluster_sum<T>(hsum, wpart, part[r0 / LORA_RC], hi, lo, r0, rank, last);
    unsigned ha[4], la[4];
    a_fragment(ha, &hi[0][0], 16, g, q);
    a_fragment(la, &lo[0][0], 16, g, q);
#pragma unroll
    for (int j = 0; j < LORA_CL_PAIRS; ++j) {
      if (j >= pairs) break;
      unsigned b[4];  // b fragments of the pair's n-blocks (b[0], b[1]) and (b[2], b[3])
      const int m = lane >> 3;
      ldmatrix_x4_trans(b, &bs[(m & 1) * 8 + (lane & 7)][(2 * j + (m >> 1)) * 8]);
      mma16816(acc[j][0], ha, b, T());
      mma16816(acc[j][0], la, b, T());
      mma16816(acc[j][1], ha, b + 2, T());
      mma16816(acc[j][1], la, b + 2, T());
    }
    if (last) break;
  }
  // 3. y += delta rounded once, 8 bytes a lane and row
#pragma unroll
  for (int j = 0; j < LORA_CL_PAIRS; ++j) {
    if (j >= pairs) break;
    float d[8];
    pair_to_quads(d, acc[j][0], acc[j][1], q);
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
      if (g + 8 * hrow >= count) continue;
      Pack<T, 4> out;
#pragma unroll
      for (int e = 0; e < 4; ++e) out.v[e] = from_f<T>(to_f(yv[j][hrow].v[e]) + d[4 * hrow + e]);
      *reinterpret_cast<Pack<T, 4>*>((hrow ? y_g8 : y_g) + 16 * j) = out;
    }
  }
  cluster_wait();  // arrived at in the last lora_cluster_sum: every block is done reading this one's part (and,
  return true;     // for the next record, done with this block's shared memory)
}

// lora_apply_cluster_<dt>: records blockIdx.x, + gridDim.x, ... below K (the tiles' rows) up to the first unused.
#define LORA_CLUSTER_KERNELS(S, T)                                                                           \
  extern "C" __global__ void __cluster_dims__(1, 1, LORA_CLUSTER) __launch_bounds__(LORA_CL_WARPS * 32)      \
      lora_apply_cluster_##S(T* y, const T* x, const T* A, const T* Bt, const int* tiles, int K,             \
                             const int* ranks, int I, int O, int R, int P) {                                 \
    pdl_enter();                                                                                             \
    for (int k = blockIdx.x; k < K && lora_apply_cluster<T>(y, x, A, Bt, tiles, k, ranks, I, O, R, P);       \
         k += gridDim.x) {                                                                                   \
    }                                                                                                        \
  }
LORA_CLUSTER_KERNELS(bf16, bf16)
LORA_CLUSTER_KERNELS(f16, __half)
#endif
