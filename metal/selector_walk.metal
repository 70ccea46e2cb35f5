// selector_walk.metal: the per-step walk rules of DFlash 2's candidate selector.
//
// Passed as the `header` of the fused selector kernel (selector_lattice.metal); each
// function reads one lattice row S_t(prev, .) held in thread memory and returns the
// index of the next candidate. Both mirror the MLX-ops twins in drafter/selector.py:
// argmax_row == mx.argmax (first index on ties); sample_row == softmax(row / T) then
// inverse CDF: min(#{c : cdf_c <= u}, last c with q_c > 0).

// First index of the largest score: strict '>' keeps the earliest of tied maxima.
template <int K>
inline int argmax_row(thread const float* row) {
  int best = 0;
  for (int c = 1; c < K; ++c) {
    if (row[c] > row[best]) {
      best = c;
    }
  }
  return best;
}

// q = softmax(row / temperature) written to `q`; returns the inverse-CDF draw of `u`.
// Normalizes by multiplying with 1 / sum, as MLX's softmax does.
template <int K>
inline int sample_row(thread const float* row, float temperature, float u, thread float* q) {
  float peak = row[0] / temperature;
  for (int c = 1; c < K; ++c) {
    peak = metal::max(peak, row[c] / temperature);
  }
  float total = 0.0f;
  for (int c = 0; c < K; ++c) {
    q[c] = metal::exp(row[c] / temperature - peak);
    total += q[c];
  }
  const float norm = 1.0f / total;
  float cdf = 0.0f;
  int below = 0;
  int last = 0;
  for (int c = 0; c < K; ++c) {
    q[c] *= norm;
    cdf += q[c];
    below += cdf <= u ? 1 : 0;
    last = q[c] > 0.0f ? c : last;
  }
  // Rounding can leave the cdf's end <= u: never fall through to a candidate with q = 0.
  return metal::min(below, last);
}
