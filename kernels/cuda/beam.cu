// beam.cu: a beam search step's decisions on the device, one block per segment of nb beams (semantics and
// reference: kernels/reference_selection.py beam_candidates, beam_step). Each replaces ~15 small torch ops,
// whose launches were most of the host's time per step at one sentence.
//
// beam_candidates: the 2nb best of the segment's nb x k accumulated scores (values + the beam's running
//   score, a float32 add), picked in 2nb rounds of a warp-wide max over order-preserving 64-bit keys (value,
//   then the lower candidate index first; NaN largest). One warp; the candidates are re-read each round
//   (nb x k is 32 at 4 beams).
// beam_step: the keep rule on the 2nb candidates (each one's rank among the unstopped, or after them among
//   the stopped), the kept tokens and running scores, then the history reorder. A beam's parent may be
//   another beam of the segment, so every parent entry of a position is read before any is written: each
//   thread owns positions t and moves all nb beams' entries of t through shared memory.

#define BEAM_MAX 64      // ops_selection.BEAM_MAX: GenerationOptions allows num_beams up to 64
#define BEAM_THREADS 128

extern "C" __global__ void __launch_bounds__(32)
    beam_candidates(const float* __restrict__ values, const i64* __restrict__ tokens,
                    const float* __restrict__ row_scores, const i64* __restrict__ rows, int nb, int k,
                    float* __restrict__ scores, i64* __restrict__ parents, i64* __restrict__ picked) {
  pdl_enter();
  const int b = blockIdx.x, lane = threadIdx.x, C = nb * k;
  const float* vals = values + (i64)b * C;
  const i64* toks = tokens + (i64)b * C;
  const i64* beam_rows = rows + (i64)b * nb;
  u64 prev = 0;
  for (int r = 0; r < 2 * nb; ++r) {
    u64 best = 0;
    for (int c = lane; c < C; c += 32) {
      const u64 key = make_key(vals[c] + row_scores[beam_rows[c / k]], (unsigned int)c);
      if ((r == 0 || key < prev) && key > best) best = key;
    }
    best = warp_max_u64(best);
    prev = best;
    if (lane == 0) {
      const i64 c = key_index(best), at = (i64)b * 2 * nb + r;
      scores[at] = key_value(best);
      parents[at] = c / k;
      picked[at] = toks[c];
    }
  }
}

extern "C" __global__ void __launch_bounds__(BEAM_THREADS)
    beam_step(const float* __restrict__ scores, const i64* __restrict__ parents, const i64* __restrict__ tokens,
              const i64* __restrict__ rows, const i64* __restrict__ lengths, const i64* __restrict__ at_max, int nb,
              i64 eos, float excluded, int* __restrict__ history, i64 hist_rs, float* __restrict__ row_scores,
              i64* __restrict__ out) {
  pdl_enter();
  __shared__ unsigned char stopped[2 * BEAM_MAX];
  __shared__ int keep[BEAM_MAX];
  __shared__ i64 src_row[BEAM_MAX];
  __shared__ int moved[BEAM_MAX][BEAM_THREADS];
  const int b = blockIdx.x, tid = threadIdx.x, W = 2 * nb;
  const i64* beam_rows = rows + (i64)b * nb;
  if (tid < W) stopped[tid] = tokens[(i64)b * W + tid] == eos || at_max[b] != 0;
  __syncthreads();
  // 1. keep: candidates ordered unstopped first, each group best first (a stable partition), the first nb
  if (tid < W) {
    int unstopped = 0, same_before = 0;
    for (int i = 0; i < W; ++i) {
      unstopped += !stopped[i];
      same_before += i < tid && stopped[i] == stopped[tid];
    }
    const int rank = stopped[tid] ? unstopped + same_before : same_before;
    if (rank < nb) keep[rank] = tid;
  }
  __syncthreads();
  // 2. each beam's token, running score and parent row
  if (tid < nb) {
    const i64 j = (i64)b * W + keep[tid];
    out[(i64)b * nb + tid] = tokens[j];
    row_scores[beam_rows[tid]] = stopped[keep[tid]] ? __fadd_rn(scores[j], excluded) : scores[j];
    src_row[tid] = beam_rows[parents[j]];
  }
  __syncthreads();
  // 3. history[beam row, :len] = history[parent row, :len], every read of a position before its writes
  const i64 len = lengths[b];
  for (i64 t = tid; t < len; t += BEAM_THREADS) {
    for (int j = 0; j < nb; ++j) moved[j][tid] = history[src_row[j] * hist_rs + t];
    for (int j = 0; j < nb; ++j) history[beam_rows[j] * hist_rs + t] = moved[j][tid];
  }
}
