// lora.cu: LoRA for any mix of adapters and base rows.
//
// The prefill (encoder, cross k|v: thousands of rows) adds each site's delta after its GEMM with lora_apply,
// one launch per site, over tiles of rows of one adapter (below). The decoder step has none of these
// (engine/lora.py): add_layer_norm_lora and kv_append_lora add each row's delta from its h as they read the
// projection (common.cuh's lora_expand8), and add_layer_norm_lora makes cross q's and fc1's h for their GEMMs:
// at 256 rows a LoRA launch after each of 72 GEMMs cost ~5 us a site.
//
// lora_tiles: once per forward pass, group the adapted rows into tiles of at most LORA_TILE rows of one
//   adapter. Record k of `tiles` [max_tiles, 32] int32 is [row0 .. row15, slot, count, 0 ...]; count 0
//   marks an unused record. Base rows (slot 0) get no tile, so they cost no LoRA work at all.
//
// lora_apply_*: for token n with adapter slot s = idx[n] and part p of a fused projection,
//   y[n, p*O + o] += sum_{r < ranks[s]} Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i].
//   Block (k, p, z) takes tile k and a range of outputs of part p.
//
// A launch at these sizes is bound by its chain of dependent memory round trips (each about a microsecond to
// L2 or HBM), not by bytes. So every version reads in two trips: (1) the tile record; (2) in one batch, the
// tile's x and A's first LORA_RC ranks (the columns of one pass), Bt's first LORA_RC ranks for the block's
// outputs, y, and the slot's rank. A and Bt are read before the rank is known; rows past it are dropped.
// Only ranks over LORA_RC or inputs over one pass's columns take further trips. Three versions
// (kernels/ops_lora.py picks one; docs/performance.md has their timings):
//   lora_apply_cluster_<bf16|f16> (lora_cluster.cu; sm_90 thread-block clusters, I and O multiples of 128,
//     R of 16): the 8 blocks of a cluster share a tile, each staging and shrinking 1/8 of x and A, so a
//     tile's 64 KB of staging is spread over 8 SMs; fastest while the step's records fit few turns of the
//     clusters the GPU holds at once (the decode-sized sites).
//   lora_apply_mma_<bf16|f16> (tensor cores; I, O and R multiples of 16): x and A go to shared memory
//     by cp.async; warp w takes every LORA_MMA_WARPS-th 16-column step of the shrink (mma m16n8k16, fp32
//     sums), the block adds the warps' sums; h is split in two 16-bit parts (hi + lo, ~16 bits of
//     mantissa) for the expand's mma; warp w owns 64 outputs and adds its fp32 delta to y, rounded once.
//     Fastest for the prefill's thousands of rows.
//   lora_apply_<dt> (CUDA cores; fp32, or 16-bit shapes the mma cannot take): the tile in sub-tiles of 4
//     rows; warp w dots ranks 2w and 2w + 1 with each row (fp32); each thread adds h . Bt to 4 outputs.
//
// Nothing is read on the host: which adapters a step holds is data on the device, so one captured CUDA
// graph serves every mix, adapters loaded after the capture included.

#define LORA_TILE 16       // rows per tile (kernels/reference.py LORA_TILE)
#define LORA_RECORD 32     // ints per tile record
#define LORA_RC 16         // ranks per pass
#define LORA_IC 1024       // CUDA-core version: input columns per pass (staged in shared memory)
#define LORA_SUB 4         // CUDA-core version: rows per sub-tile
#define LORA_THREADS 256   // CUDA-core version: 8 warps, 2 ranks each per pass
#define LORA_OPT 4         // CUDA-core version: outputs per thread (1024 a block)
#define LORA_MMA_WARPS 16  // tensor-core version: 64 outputs a warp (1024 a block)
#define LORA_MMA_IC 2048   // tensor-core version: input columns per pass (fc2's 4096 in two)
#define LORA_LDS (LORA_MMA_IC + 8)  // shared row stride of x and A (16-bit): rows 16-byte aligned, 4 banks apart
#define LORA_BLD (64 + 8)        // shared row stride of a warp's Bt block: likewise

// K contiguous elements as loaded, in one vector access (16-byte aligned pieces).
template <typename T, int K>
struct alignas(K * sizeof(T) < 16 ? K * sizeof(T) : 16) Pack {
  T v[K];
};
template <typename T, int K>
__device__ __forceinline__ Pack<T, K> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, K>*>(p);
}

// One block: counting sort of the adapted rows by slot, cut into tiles. Row order inside a slot is
// whatever the atomics give (the result of lora_apply does not depend on it).
extern "C" __global__ void lora_tiles(const i64* __restrict__ idx, int N, int S, int max_tiles,
                                      int* __restrict__ tiles) {
  pdl_enter();
  extern __shared__ int counts[];  // [S] rows per slot, then [S] first tile, then [S] rows placed
  int *first_tile = counts + S, *placed = counts + 2 * S;
  for (int s = threadIdx.x; s < S; s += blockDim.x) counts[s] = placed[s] = 0;
  for (int k = threadIdx.x; k < max_tiles; k += blockDim.x) tiles[k * LORA_RECORD + LORA_TILE + 1] = 0;
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    const i64 s = idx[n];
    if (s > 0 && s < S) atomicAdd(&counts[s], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // S is the adapter slots plus one: a serial scan is shorter than a parallel one
    int next = 0;
    for (int s = 0; s < S; ++s) {
      first_tile[s] = next;
      next += s > 0 ? (counts[s] + LORA_TILE - 1) / LORA_TILE : 0;
    }
  }
  __syncthreads();
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    const i64 s = idx[n];
    if (s <= 0 || s >= S) continue;
    const int pos = atomicAdd(&placed[s], 1);
    int* rec = tiles + (first_tile[s] + pos / LORA_TILE) * LORA_RECORD;
    rec[pos % LORA_TILE] = n;
    if (pos % LORA_TILE == 0) {
      rec[LORA_TILE] = (int)s;
      rec[LORA_TILE + 1] = min(LORA_TILE, counts[s] - pos);
    }
  }
}

// Step 1 of every version: tile record k into shared memory; false when the record is unused (lora_tiles
// fills records from 0 up, so every later one is unused too).
__device__ __forceinline__ bool read_record(const int* __restrict__ tiles, int k, int* rec /* shared [LORA_RECORD] */) {
  if (threadIdx.x < LORA_RECORD) rec[threadIdx.x] = tiles[k * LORA_RECORD + threadIdx.x];
  __syncthreads();
  return rec[LORA_TILE + 1] > 0;
}

// The CUDA-core version: one sub-tile of LORA_SUB rows (rows[t], t < count) through shrink and expand.
template <typename T>
__device__ __forceinline__ void lora_fma_rows(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ A,
                                              const T* __restrict__ Bt, const int* rows, int count, i64 s,
                                              const int* rank, float (*xs)[LORA_IC], float (*h)[LORA_RC],
                                              int I, int O, int R, int P) {
  constexpr int XV = LORA_SUB * LORA_IC / 8 / LORA_THREADS;  // x pieces of 8 per thread and pass
  constexpr int AV = LORA_IC / 8 / 32;                       // A pieces of 8 per lane, rank and pass
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, p = blockIdx.y;
  i64 row[LORA_SUB];
#pragma unroll
  for (int t = 0; t < LORA_SUB; ++t) row[t] = rows[t < count ? t : 0];  // unused entries repeat row 0
  const int o = (blockIdx.z * LORA_THREADS + tid) * LORA_OPT;
  const bool has_o = o < O;
  const T* bt = Bt + (s * P + p) * (i64)R * O + o;
  const T* a_site = A + (s * P + p) * (i64)R * I;
  Pack<T, LORA_OPT> yv[LORA_SUB], bv[LORA_RC];
#pragma unroll
  for (int t = 0; t < LORA_SUB; ++t)
    if (has_o) yv[t] = load_pack<T, LORA_OPT>(y + (row[t] * P + p) * (i64)O + o);
  float acc[LORA_SUB][LORA_OPT];
  for (int r0 = 0;; r0 += LORA_RC) {
    if (has_o) {
#pragma unroll
      for (int j = 0; j < LORA_RC; ++j)
        if (r0 + j < R) bv[j] = load_pack<T, LORA_OPT>(bt + (i64)(r0 + j) * O);
    }
    float hs[2][LORA_SUB] = {};
    for (int c0 = 0; c0 < I; c0 += LORA_IC) {
      const int len = min(LORA_IC, I - c0);
      Pack<T, 8> xv[XV], av[2][AV];
#pragma unroll
      for (int k = 0; k < XV; ++k) {
        const int v = tid + k * LORA_THREADS, t = v / (LORA_IC / 8), c = (v % (LORA_IC / 8)) * 8;
        if (c < len) xv[k] = load_pack<T, 8>(x + row[t] * I + c0 + c);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int r = r0 + 2 * warp + j;
#pragma unroll
        for (int k = 0; k < AV; ++k) {
          const int c = (lane + 32 * k) * 8;
          if (r < R && c < len) av[j][k] = load_pack<T, 8>(a_site + (i64)r * I + c0 + c);
        }
      }
      __syncthreads();  // the previous pass (or sub-tile) is done reading xs and h
#pragma unroll
      for (int k = 0; k < XV; ++k) {
        const int v = tid + k * LORA_THREADS, t = v / (LORA_IC / 8), c = (v % (LORA_IC / 8)) * 8;
        if (c < len)
#pragma unroll
          for (int e = 0; e < 8; ++e) xs[t][c + e] = to_f(xv[k].v[e]);
      }
      __syncthreads();
      if (*rank == 0) return;  // block-uniform: this adapter leaves the site alone
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (r0 + 2 * warp + j >= R) continue;
#pragma unroll
        for (int k = 0; k < AV; ++k) {
          const int c = (lane + 32 * k) * 8;
          if (c >= len) continue;
#pragma unroll
          for (int t = 0; t < LORA_SUB; ++t) {
            const float4 x0 = *reinterpret_cast<const float4*>(&xs[t][c]);
            const float4 x1 = *reinterpret_cast<const float4*>(&xs[t][c + 4]);
            const T* a = av[j][k].v;
            hs[j][t] += to_f(a[0]) * x0.x + to_f(a[1]) * x0.y + to_f(a[2]) * x0.z + to_f(a[3]) * x0.w +
                        to_f(a[4]) * x1.x + to_f(a[5]) * x1.y + to_f(a[6]) * x1.z + to_f(a[7]) * x1.w;
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int t = 0; t < LORA_SUB; ++t) {
        const float sum = warp_sum(hs[j][t]);
        if (lane == 0) h[t][2 * warp + j] = sum;
      }
    __syncthreads();
    if (r0 == 0) {
#pragma unroll
      for (int t = 0; t < LORA_SUB; ++t)
#pragma unroll
        for (int e = 0; e < LORA_OPT; ++e) acc[t][e] = has_o ? to_f(yv[t].v[e]) : 0.f;
    }
    if (has_o) {
#pragma unroll
      for (int j = 0; j < LORA_RC; ++j) {
        if (r0 + j >= R || r0 + j >= *rank) break;  // uniform; rows past the rank may hold anything
#pragma unroll
        for (int t = 0; t < LORA_SUB; ++t) {
          const float hv = h[t][j];
#pragma unroll
          for (int e = 0; e < LORA_OPT; ++e) acc[t][e] += hv * to_f(bv[j].v[e]);
        }
      }
    }
    if (r0 + LORA_RC >= *rank) break;
  }
  if (!has_o) return;
#pragma unroll
  for (int t = 0; t < LORA_SUB; ++t) {
    if (t >= count) break;
    Pack<T, LORA_OPT> out;
#pragma unroll
    for (int e = 0; e < LORA_OPT; ++e) out.v[e] = from_f<T>(acc[t][e]);
    *reinterpret_cast<Pack<T, LORA_OPT>*>(y + (row[t] * P + p) * (i64)O + o) = out;
  }
}

template <typename T>
__device__ __forceinline__ void lora_apply_fma(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ A,
                                               const T* __restrict__ Bt, const int* __restrict__ tiles,
                                               const int* __restrict__ ranks, int I, int O, int R, int P) {
  __shared__ float xs[LORA_SUB][LORA_IC];
  __shared__ float h[LORA_SUB][LORA_RC];
  __shared__ int rec[LORA_RECORD], rank;
  if (!read_record(tiles, blockIdx.x, rec)) return;  // block-uniform
  const i64 s = rec[LORA_TILE];
  if (threadIdx.x == 0) rank = min(ranks[s], R);  // read at the sub-tile's first barrier
  for (int t0 = 0; t0 < rec[LORA_TILE + 1]; t0 += LORA_SUB)
    lora_fma_rows<T>(y, x, A, Bt, rec + t0, rec[LORA_TILE + 1] - t0, s, &rank, xs, h, I, O, R, P);
}

// 16 bytes global -> shared without a register stop (sm_80+); completes at cp_async_wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;\n" ::); }

// Four 8x8 16-bit matrices from shared memory, transposed (lanes 8m..8m+7 give matrix m's row addresses):
// with rows = k and columns = n, r[m] is matrix m's b fragment for mma16816 (k 2q..2q+1, column g).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
template <typename T>
__device__ __forceinline__ unsigned pair16(const T* p) { return *reinterpret_cast<const unsigned*>(p); }
template <typename T>
__device__ __forceinline__ void a_fragment(unsigned* a, const T* m /* row 0, column k */, int ld, int g, int q) {
  a[0] = pair16(m + g * ld + 2 * q);
  a[1] = pair16(m + (g + 8) * ld + 2 * q);
  a[2] = pair16(m + g * ld + 8 + 2 * q);
  a[3] = pair16(m + (g + 8) * ld + 8 + 2 * q);
}

// The tensor-core version (T 16-bit; I, O and R multiples of 16; A and Bt finite past each rank, as the
// registry's zero padding is). Warp w owns outputs [64 w, 64 w + 64) of the block's 1024 (8 mma columns
// of 8) and every 16th 16-column step of the shrink. Dynamic shared memory: xs, as [16][LORA_LDS] T, then
// part [LORA_MMA_WARPS][16][16] float, then hi, lo [16][16] T, then bs [LORA_MMA_WARPS][16][LORA_BLD] T
// (each warp's 16 ranks x 64 outputs of Bt).
template <typename T>
__device__ __forceinline__ void lora_apply_mma(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ A,
                                               const T* __restrict__ Bt, const int* __restrict__ tiles,
                                               const int* __restrict__ ranks, int I, int O, int R, int P) {
  extern __shared__ __align__(16) unsigned char lora_smem[];
  T(*xs)[LORA_LDS] = reinterpret_cast<T(*)[LORA_LDS]>(lora_smem);
  T(*as)[LORA_LDS] = xs + 16;
  float(*part)[16][16] = reinterpret_cast<float(*)[16][16]>(as + 16);
  T(*hi)[16] = reinterpret_cast<T(*)[16]>(part + LORA_MMA_WARPS);
  T(*lo)[16] = hi + 16;
  __shared__ int rec[LORA_RECORD], rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3, p = blockIdx.y;
  T(*bs)[LORA_BLD] = reinterpret_cast<T(*)[LORA_BLD]>(lo + 16) + warp * 16;  // this warp's Bt block
  if (!read_record(tiles, blockIdx.x, rec)) return;  // 1. (block-uniform)
  const i64 s = rec[LORA_TILE];
  const int count = rec[LORA_TILE + 1];

  // 2. the batch: y at this lane's accumulator places (rows g and g + 8), the rank, then Bt and x and A below
  const int o_warp = (blockIdx.z * LORA_MMA_WARPS + warp) * 64;
  T* y_g = y + ((i64)rec[g < count ? g : 0] * P + p) * O;
  T* y_g8 = y + ((i64)rec[g + 8 < count ? g + 8 : 0] * P + p) * O;
  Pack<T, 2> yv[8][2];
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
    const int o = o_warp + nb * 8 + 2 * q;
    if (o < O) {
      yv[nb][0] = load_pack<T, 2>(y_g + o);
      yv[nb][1] = load_pack<T, 2>(y_g8 + o);
    }
  }
  if (tid == 0) rank = min(ranks[s], R);
  const T* a_site = A + (s * P + p) * (i64)R * I;
  const T* bt_site = Bt + (s * P + p) * (i64)R * O;
  float acc[8][4] = {};
  for (int r0 = 0;; r0 += LORA_RC) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // Bt[r0:r0+16, o_warp:o_warp+64] to this warp's bs, 16 bytes a copy
      const int piece = lane + 32 * i, r = piece / 8, c = (piece % 8) * 8;
      if (o_warp + c < O) cp_async16(&bs[r][c], bt_site + (i64)(r0 + r) * O + o_warp + c);
    }
    float hsum[2][4] = {};  // h for ranks r0..r0+7 and r0+8..r0+15, this warp's columns of the shrink
    for (int c0 = 0; c0 < I; c0 += LORA_MMA_IC) {
      const int len = min(LORA_MMA_IC, I - c0);
      __syncthreads();  // the previous pass is done reading xs and as
#pragma unroll
      for (int t = 0; t < 16; ++t) {  // x rows and A's 16 ranks, 16 bytes a copy
        const T* x_row = x + (i64)rec[t < count ? t : 0] * I + c0;  // unused rows repeat row 0
        const T* a_row = a_site + (i64)(r0 + t) * I + c0;
        for (int c = tid * 8; c < len; c += LORA_MMA_WARPS * 32 * 8) {
          cp_async16(&xs[t][c], x_row + c);
          cp_async16(&as[t][c], a_row + c);
        }
      }
      cp_async_wait();
      __syncthreads();
      if (rank == 0) return;  // block-uniform: this adapter leaves the site alone
      for (int k = warp * 16; k < len; k += LORA_MMA_WARPS * 16) {
        unsigned a[4];
        a_fragment(a, &xs[0][k], LORA_LDS, g, q);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const unsigned b[2] = {pair16(&as[half * 8 + g][k + 2 * q]), pair16(&as[half * 8 + g][k + 8 + 2 * q])};
          mma16816(hsum[half], a, b, T());
        }
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      part[warp][g][half * 8 + 2 * q] = hsum[half][0];
      part[warp][g][half * 8 + 2 * q + 1] = hsum[half][1];
      part[warp][g + 8][half * 8 + 2 * q] = hsum[half][2];
      part[warp][g + 8][half * 8 + 2 * q + 1] = hsum[half][3];
    }
    __syncthreads();
    for (int e = tid; e < 256; e += blockDim.x) {  // h = the warps' sums; ranks past the slot's dropped
      const int t = e / 16, r = e % 16;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < LORA_MMA_WARPS; ++w) v += part[w][t][r];
      v = r0 + r < rank ? v : 0.f;
      const T v_hi = from_f<T>(v);
      hi[t][r] = v_hi;
      lo[t][r] = from_f<T>(v - to_f(v_hi));
    }
    __syncthreads();
    unsigned ha[4], la[4];
    a_fragment(ha, &hi[0][0], 16, g, q);
    a_fragment(la, &lo[0][0], 16, g, q);
#pragma unroll
    for (int nb = 0; nb < 8; nb += 2) {
      if (o_warp + nb * 8 >= O) break;  // O is a multiple of 16: n-blocks come in pairs
      unsigned b[4];  // b fragments of n-blocks nb (b[0], b[1]) and nb + 1 (b[2], b[3])
      const int m = lane >> 3;
      ldmatrix_x4_trans(b, &bs[(m & 1) * 8 + (lane & 7)][(nb + (m >> 1)) * 8]);
      mma16816(acc[nb], ha, b, T());
      mma16816(acc[nb], la, b, T());
      mma16816(acc[nb + 1], ha, b + 2, T());
      mma16816(acc[nb + 1], la, b + 2, T());
    }
    if (r0 + LORA_RC >= rank) break;
  }
  // 3. y += delta, rounded once, straight from the accumulators
#pragma unroll
  for (int nb = 0; nb < 8; ++nb) {
    const int o = o_warp + nb * 8 + 2 * q;
    if (o >= O) break;
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
      if (g + 8 * hrow >= count) continue;
      Pack<T, 2> out;
      out.v[0] = from_f<T>(to_f(yv[nb][hrow].v[0]) + acc[nb][2 * hrow]);
      out.v[1] = from_f<T>(to_f(yv[nb][hrow].v[1]) + acc[nb][2 * hrow + 1]);
      *reinterpret_cast<Pack<T, 2>*>((hrow ? y_g8 : y_g) + o) = out;
    }
  }
}

#define LORA_KERNELS(S, T)                                                                                   \
  extern "C" __global__ void __launch_bounds__(LORA_THREADS)                                                 \
      lora_apply_##S(T* y, const T* x, const T* A, const T* Bt, const int* tiles, const int* ranks, int I,   \
                     int O, int R, int P) {                                                                  \
    pdl_enter();                                                                                             \
    lora_apply_fma<T>(y, x, A, Bt, tiles, ranks, I, O, R, P);                                                \
  }
FOR_EACH_DTYPE(LORA_KERNELS)

#define LORA_MMA_KERNELS(S, T)                                                                               \
  extern "C" __global__ void __launch_bounds__(LORA_MMA_WARPS * 32)                                          \
      lora_apply_mma_##S(T* y, const T* x, const T* A, const T* Bt, const int* tiles, const int* ranks,      \
                         int I, int O, int R, int P) {                                                       \
    pdl_enter();                                                                                             \
    lora_apply_mma<T>(y, x, A, Bt, tiles, ranks, I, O, R, P);                                                \
  }
LORA_MMA_KERNELS(bf16, bf16)
LORA_MMA_KERNELS(f16, __half)
