// lora.cu: LoRA for any mix of adapters and base rows.
//
// The prefill (encoder, cross k|v: thousands of rows) adds each site's delta after its GEMM with lora_apply,
// one launch per site, over tiles of rows of one adapter (below). The decoder step has none of these
// (engine/lora.py): add_layer_norm_lora and kv_append_lora add each row's delta from its h as they read the
// projection (common.cuh's lora_expand8), and add_layer_norm_lora makes cross q's and fc1's h for their GEMMs:
// at 256 rows a LoRA launch after each of 72 GEMMs cost ~5 us a site (bench/NOTES.md, stop 14).
//
// lora_tiles: once per forward pass, group the adapted rows into tiles of at most LORA_TILE rows of one
//   adapter. Record k of `tiles` [max_tiles, 32] int32 is [row0 .. row15, slot, count, 0 ...]; count 0
//   marks an unused record. Base rows (slot 0) get no tile, so they cost no LoRA work at all.
//
// lora_apply_*: for token n with adapter slot s = idx[n] and part p of a fused projection,
//   y[n, p*O + o] += sum_{r < ranks[s]} Bt[s, p, r, o] * h[r],  h[r] = sum_i A[s, p, r, i] * x[n, i].
//   Block (k, p, z) takes tile k and a range of outputs of part p.
//
// At decode sizes a launch is bound by the chain of dependent memory round trips (each about a microsecond
// to L2 or HBM) and by how many instructions each warp issues in a row, not by bytes. So every version
// reads in two trips: (1) the tile record; (2) in one batch, the tile's x and A's first LORA_RC ranks
// (the columns of one pass), Bt's first LORA_RC ranks for the block's outputs, y, and the slot's rank. A
// and Bt are read before the rank is known; rows past it are dropped. Only ranks over LORA_RC or inputs
// over one pass's columns take further trips.
//   lora_apply_cluster_<bf16|f16> (v9; sm_90 thread-block clusters, I and O multiples of 128, R of 16):
//     the 8 blocks of a cluster share a tile; block c stages and shrinks only columns [c I/8, (c+1) I/8)
//     of x and A (mma m16n8k16, fp32), the 8 partial h are added through distributed shared memory in a
//     fixed order (every block gets the same bits), and block c expands its 1/8 of the outputs (Bt by
//     cp.async, issued before the shrink; ldmatrix.trans). The exchange between the blocks (cluster
//     barrier, DSMEM reads) stays on chip: no third trip to L2. y moves in 8-byte pieces: lane pairs trade
//     accumulator halves. Being A/B-timed against v7 (kernels/ops.py LORA_KERNEL, tests/kernels timings).
//   lora_apply_mma_<bf16|f16> (v7, tensor cores; I, O and R multiples of 16): x and A go to shared memory
//     by cp.async; warp w takes every LORA_MMA_WARPS-th 16-column step of the shrink (mma m16n8k16, fp32
//     sums), the block adds the warps' sums; h is split in two 16-bit parts (hi + lo, ~16 bits of
//     mantissa) for the expand's mma; warp w owns 64 outputs and adds its fp32 delta to y, rounded once.
//   lora_apply_<dt> (CUDA cores; fp32, or 16-bit shapes the mma cannot take): the tile in sub-tiles of 4
//     rows; warp w dots ranks 2w and 2w + 1 with each row (fp32); each thread adds h . Bt to 4 outputs.
// Earlier versions (bench/NOTES.md): rows sorted by slot with an order -> slot -> rank -> x -> A -> Bt
// chain of six trips took 11 us at one row and 25-38 us a site at 256 rows (v5); the CUDA-core version
// alone with 4-row tiles, 14 us at 256 rows (v6: 255 registers, one block an SM, two waves). v7 takes
// 9.4 us (q|k|v) and 13 us (fc2), half of it each block staging 64 KB (x and A: 16 rows x I) through one
// SM, which v9 splits 8 ways. Moving y through shared memory in whole 16-byte pieces instead of the
// accumulators' 4-byte places was slower (v8, 11.0 us): the extra 32 KB a block to stage cost more.
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
#define LORA_CLUSTER 8     // cluster version: blocks a cluster, each with 1/8 of the inputs and outputs
#define LORA_CL_WARPS 4    // cluster version: warps a block (why 4: above lora_apply_cluster)
#define LORA_CL_IC 512     // cluster version: input columns a block stages a pass (fc2's 4096 / 8 in one)
#define LORA_CL_PAIRS 4    // cluster version: most 16-output pairs a warp (64 outputs, as v7's warps)
#define LORA_CL_PASSES 4   // cluster version: most rank passes (ranks up to 64: ops' LORA_MAX_RANK)

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

// Tensor-core tile product c[16x8] += a[16x16] . b[16x8] (PTX mma m16n8k16, fp32 sums). Fragments, with
// g = lane / 4 and q = lane % 4, each register two 16-bit elements (lower column or k first):
//   a: (row g, k 2q..2q+1), (row g+8, same k), (row g, k 8+2q..), (row g+8, k 8+2q..);
//   b: (k 2q..2q+1, column g), (k 8+2q.., column g);  c: (row g, columns 2q, 2q+1), (row g+8, the same).
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b, bf16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
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

// The cluster version (v9; T 16-bit; I and O multiples of 16 * LORA_CLUSTER, R of 16; A and Bt finite past
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
