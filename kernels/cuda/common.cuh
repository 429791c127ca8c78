// common.cuh: helpers shared by every kernel file (the loader puts this first in the one module).
// Storage types bf16 / fp16 / fp32, always converted to fp32 for arithmetic; 8-element vector
// loads and stores (16 bytes for 16-bit types, 2 x 16 bytes for fp32); warp and block reductions;
// an order-preserving 64-bit key (value, then lower index first; NaN ranks highest, as in torch).
// NVRTC compiles this: no standard headers beyond the CUDA fp16/bf16 ones.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;
typedef unsigned long long u64;
typedef __nv_bfloat16 bf16;

#define NEG_INF __int_as_float(0xff800000)
#define QNAN __int_as_float(0x7fc00000)
#define FULL_MASK 0xffffffffu

// Instantiate M(suffix, type) for every storage dtype: kernels are extern "C" <name>_<suffix>.
#define FOR_EACH_DTYPE(M) M(bf16, bf16) M(f16, __half) M(f32, float)

// Programmatic dependent launch (sm_90+; kernels/loader.py launches every kernel with the attribute there).
// The next kernel in the stream may start while this one runs; griddepcontrol.wait then blocks until the
// kernels before it have finished and their writes are visible. Every kernel calls pdl_enter() before it
// reads anything an earlier kernel wrote or writes anything an earlier kernel reads (torch reuses freed
// memory), so only constant data (weights) may be read before it. Waiting first and letting the next kernel
// start right after keeps at most one kernel launched ahead. Without the attribute both are no-ops.
// One more kind of data may be read before it: what only torch writes, and only before the step that reads it
// (adapter stacks and ranks, each row's adapter slot: lora_fetch8). A kernel of ours lets the next one start
// only once its own wait has returned, when every kernel before it has finished; one such kernel anywhere
// between the write and the reader (the step's first kernel, at the latest) makes the write visible to it.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }

// Round through the storage type (what torch does between two ops on bf16 tensors).
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

// 8 contiguous elements as loaded (16-byte pieces), not yet converted: half the registers of 8 floats for
// 16-bit types, so a loop can keep more loads in flight. p must be 16-byte aligned (the wrappers check
// pointers and strides).
template <typename T> struct Raw8 { uint4 u; };  // bf16, __half
template <> struct Raw8<float> { float4 a, b; };
template <typename T> __device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  return {*reinterpret_cast<const uint4*>(p)};
}
template <> __device__ __forceinline__ Raw8<float> load_raw8(const float* p) {
  return {reinterpret_cast<const float4*>(p)[0], reinterpret_cast<const float4*>(p)[1]};
}
template <typename T> __device__ __forceinline__ void store_raw8(T* p, const Raw8<T>& r) {
  *reinterpret_cast<uint4*>(p) = r.u;
}
template <> __device__ __forceinline__ void store_raw8(float* p, const Raw8<float>& r) {
  reinterpret_cast<float4*>(p)[0] = r.a;
  reinterpret_cast<float4*>(p)[1] = r.b;
}
// bf16 to float is the 16 bits moved up: one shift or one mask an element (the intrinsic took a permute more).
__device__ __forceinline__ void unpack8(const Raw8<bf16>& r, float* out) {
  const unsigned int w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack8(const Raw8<__half>& r, float* out) {
  const __half2* h = reinterpret_cast<const __half2*>(&r.u);
#pragma unroll
  for (int i = 0; i < 4; ++i) { float2 f = __half22float2(h[i]); out[2 * i] = f.x; out[2 * i + 1] = f.y; }
}
__device__ __forceinline__ void unpack8(const Raw8<float>& r, float* out) {
  out[0] = r.a.x; out[1] = r.a.y; out[2] = r.a.z; out[3] = r.a.w;
  out[4] = r.b.x; out[5] = r.b.y; out[6] = r.b.z; out[7] = r.b.w;
}
// 8 contiguous elements as fp32.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* out) { unpack8(load_raw8(p), out); }
// 8 floats rounded to T, as stored.
template <typename T> __device__ __forceinline__ Raw8<T> pack_raw8(const float* v);
template <> __device__ __forceinline__ Raw8<bf16> pack_raw8(const float* v) {
  Raw8<bf16> r;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&r.u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return r;
}
template <> __device__ __forceinline__ Raw8<__half> pack_raw8(const float* v) {
  Raw8<__half> r;
  __half2* h = reinterpret_cast<__half2*>(&r.u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
  return r;
}
template <> __device__ __forceinline__ Raw8<float> pack_raw8(const float* v) {
  return {make_float4(v[0], v[1], v[2], v[3]), make_float4(v[4], v[5], v[6], v[7])};
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float* v) { store_raw8(p, pack_raw8<T>(v)); }

// A linear layer's output y[m, o] (row stride O) from its fp32 sum s: the bias added (none when b is null), then
// ReLU when `relu` (a NaN passes through it, as torch's does), rounded to T once.
template <typename T>
__device__ __forceinline__ void store_linear_out(T* y, int m, int o, int O, float s, const T* b, int relu) {
  s += b != nullptr ? to_f(b[o]) : 0.f;
  y[(i64)m * O + o] = from_f<T>(relu && s < 0.f ? 0.f : s);
}

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

// A reduction over the warp / the whole block (blockDim.x a multiple of 32, at most 1024) with `op`, whose
// identity is `none`; every thread gets it.
template <typename Op> __device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* scratch /* [33] shared */, float none, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_reduce(lane < nwarps ? scratch[lane] : none, op);
}
struct AddOp { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct MaxOp { __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); } };
__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, AddOp()); }
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce(v, scratch, 0.f, AddOp()); }
__device__ __forceinline__ float block_max(float v, float* scratch) {
  return block_reduce(v, scratch, NEG_INF, MaxOp());
}

// u64 sums over the warp: of every lane, and inclusive over lanes 0..lane.
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ u64 warp_prefix_sum_u64(u64 v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u64 t = __shfl_up_sync(FULL_MASK, v, o);
    if (lane >= o) v += t;
  }
  return v;
}

// 2^x, results below 2^-126 flushed to 0 (exp2f spends a compare and two multiplies a call on making them
// denormal): for sums that already hold a term of 1, the softmaxes' and log-sum-exps' case.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online log-sum-exp state (natural log): value = m + log(s).
// NaN inputs make s NaN (propagates); -inf inputs contribute nothing; m itself is never NaN.
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  float M = fmaxf(m, m2);
  float a = (m == M) ? s : s * __expf(m - M);
  float b = (m2 == M) ? s2 : s2 * __expf(m2 - M);
  m = M; s = a + b;
}

// Order-preserving key: larger key = larger value; NaN largest; ties broken towards the lower index.
// Key 0 means "empty" (below every real element, -inf included).
__device__ __forceinline__ unsigned int ordered_bits(float x) {
  if (x != x) return 0xffffffffu;
  unsigned int b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unordered_bits(unsigned int u) {
  if (u == 0xffffffffu) return QNAN;
  return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}
__device__ __forceinline__ u64 make_key(float x, unsigned int idx) {
  return ((u64)ordered_bits(x) << 32) | (u64)(0xffffffffu - idx);
}
__device__ __forceinline__ float key_value(u64 k) { return unordered_bits((unsigned int)(k >> 32)); }
__device__ __forceinline__ i64 key_index(u64 k) { return (i64)(0xffffffffu - (unsigned int)(k & 0xffffffffu)); }

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) { u64 w = __shfl_xor_sync(FULL_MASK, v, o); v = w > v ? w : v; }
  return v;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // thread-block clusters
// This block's rank in its cluster; the cluster barrier (every thread of every block of the cluster: writes
// before arrive are seen after wait); the cluster-shared address of shared variable p in block `cta` (DSMEM).
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned cta) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(cta));
  return remote;
}
#endif

// A LoRA delta expanded where the projection's output is read (embed_norm.cu's add_layer_norm_lora, kv_cache.cu's
// kv_append_lora): the GEMM over the weight stacked on every slot's A rows
// wrote each row's h for every slot after its P*O outputs, h of (slot s, part p, rank r) at column
// P*O + (s*P + p)*R + r (hrow points at column P*O). delta[e] = sum_{r < rank} h[r] * Bt[s, p, r, o + e] for the
// 8 outputs o..o+7 of part p, fp32 sums in rank order, in passes of 16 ranks (A's rows past a slot's rank are
// zero, so h is 0 there and adds nothing; Bt is zero there too); slot 0 (no adapter): no delta.
// The row's slot and its rank are read before pdl_enter (lora_slot: the slots, ranks and Bt are written only by
// torch copies before the step, see pdl_enter), so after it h, Bt and the projection arrive in one trip. Where
// a launch is one wave either way (add_layer_norm_lora: a block a row) the first 16 ranks' Bt rows are read
// before it too (lora_fetch8: 64 registers held over the wait; in an expand launch of a block per row and 1024
// outputs they made two waves of 256 rows).
struct LoraSlot {
  i64 s;     // the row's slot (<= 0: no adapter)
  int rank;  // min(ranks[s], R); 0 for no adapter
};
__device__ __forceinline__ LoraSlot lora_slot(i64 s, const int* __restrict__ ranks, int R) {
  return {s, s > 0 ? min(ranks[s], R) : 0};
}
// K ranks added to 8 outputs: acc[e] += h[j] * bt[j][e] for j = 0..K-1, one fma chain in rank order.
template <typename T, int K>
__device__ __forceinline__ void lora_ranks(float* acc, const float* h, const Raw8<T>* bt) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float b[8];
    unpack8(bt[j], b);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(h[j], b[e], acc[e]);
  }
}
// One 16-rank pass: delta[e] += h[j] * bt[j][e] for j = 0..15 in order (h: the pass's 16 values of h).
template <typename T>
__device__ __forceinline__ void lora_pass16(float* delta, const T* __restrict__ h, const Raw8<T>* bt) {
  float hf[16];
  unpack8(load_raw8(h), hf);
  unpack8(load_raw8(h + 8), hf + 8);
  lora_ranks<T, 16>(delta, hf, bt);
}
// Bt[s, p, r0 .. r0 + 15, o .. o + 7] (bt points at Bt[s, p, 0, o]).
template <typename T>
__device__ __forceinline__ void lora_bt16(Raw8<T>* out, const T* __restrict__ bt, int r0, int O) {
#pragma unroll
  for (int j = 0; j < 16; ++j) out[j] = load_raw8(bt + (i64)(r0 + j) * O);
}
template <typename T>
__device__ __forceinline__ const T* lora_bt_at(const T* Bt, const LoraSlot& slot, int p, int o, int R, int O, int P) {
  return Bt + ((slot.s * P + p) * (i64)R) * O + o;
}
// The first pass's Bt rows, read before pdl_enter (where the registers allow it).
template <typename T>
__device__ __forceinline__ void lora_fetch8(Raw8<T>* out, const T* __restrict__ Bt, const LoraSlot& slot, int p,
                                            int o, int R, int O, int P) {
  if (slot.rank > 0) lora_bt16(out, lora_bt_at(Bt, slot, p, o, R, O, P), 0, O);
}
// The delta; `fetched`: lora_fetch8's first-pass rows (null: read here).
template <typename T>
__device__ __forceinline__ void lora_expand8(float* delta, const T* __restrict__ hrow, const LoraSlot& slot,
                                             const Raw8<T>* fetched, const T* __restrict__ Bt, int p, int o, int R,
                                             int O, int P) {
#pragma unroll
  for (int e = 0; e < 8; ++e) delta[e] = 0.f;
  const T* h = hrow + (slot.s * P + p) * R;
  const T* bt = lora_bt_at(Bt, slot, p, o, R, O, P);
  int r0 = 0;
  if (fetched != nullptr && slot.rank > 0) {
    lora_pass16(delta, h, fetched);
    r0 = 16;
  }
#pragma unroll 1
  for (; r0 < slot.rank; r0 += 16) {
    Raw8<T> bv[16];
    lora_bt16(bv, bt, r0, O);
    lora_pass16(delta, h + r0, bv);
  }
}
