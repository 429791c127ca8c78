// processors.cu: HF's history processors on float32 scores, one block a row (semantics and reference:
// kernels/reference_selection.py apply_processors). The repetition penalty over the row's distinct history
// tokens (the thread holding a token's first occurrence penalises it, so a repeated token is penalised once,
// as HF's gather/scatter does), then the no-repeat n-gram bans (a thread per window of the history), then the
// </s> ban. In place. A division by the penalty is a multiply by its rounded reciprocal, as torch divides by
// a scalar on CUDA (so HF on the GPU).

#define PROC_THREADS 256

extern "C" __global__ void __launch_bounds__(PROC_THREADS)
    apply_processors(float* __restrict__ scores, i64 stride, int V, const i64* __restrict__ rows,
                     const i64* __restrict__ ids, i64 ids_stride, const i64* __restrict__ lengths,
                     const float* __restrict__ penalty, const i64* __restrict__ ngram,
                     const i64* __restrict__ ban_eos, i64 eos_id) {
  pdl_enter();
  const int n = blockIdx.x, len = (int)lengths[n];
  float* row = scores + rows[n] * stride;
  const i64* seq = ids + (i64)n * ids_stride;
  const float p = penalty[n], inv_p = __frcp_rn(p);
  if (p != 1.f) {
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
      const i64 tok = seq[j];
      bool first = tok >= 0 && tok < V;
      for (int i = 0; i < j && first; ++i) first = seq[i] != tok;
      if (first) {
        const float v = row[tok];
        row[tok] = __fmul_rn(v, v < 0.f ? p : inv_p);
      }
    }
  }
  __syncthreads();  // a ban below must land after the penalty of the same token, never under it
  const int size = (int)ngram[n];
  if (size > 0 && len >= size) {
    const i64* tail = seq + len - size + 1;  // the last size - 1 tokens: the prefix a repeat would start with
    for (int s = threadIdx.x; s + size <= len; s += blockDim.x) {
      bool hit = true;
      for (int i = 0; i < size - 1 && hit; ++i) hit = seq[s + i] == tail[i];
      const i64 tok = seq[s + size - 1];
      if (hit && tok >= 0 && tok < V) row[tok] = NEG_INF;
    }
  }
  if (threadIdx.x == 0 && ban_eos[n] && eos_id < V) row[eos_id] = NEG_INF;
}
