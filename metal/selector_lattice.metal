// selector_lattice.metal: DFlash 2 candidate selector, fused: pair-score lattice + walk.
//
// Body of an `mx.fast.metal_kernel` (MLX generates the signature; the header is
// selector_walk.metal). One launch replaces the ops path's gathers, matmul and the
// per-step walk ops. Twin: lattice_ops + greedy_walk_ops / sampled_walk_ops.
//
// Template: GT, AT, BT = dtypes of gate, predecessor and successor codebooks (float,
//   float16_t or bfloat16_t; products and sums are accumulated in fp32); K = candidates
//   per position (K * K <= 1024); SAMPLED = 0 greedy walk, 1 sampled walk.
// Inputs (row-contiguous):
//   candidates    int32 [B, L, K]  top-K ids per draft position
//   unary         fp32  [B, L, K]  draft logits of those ids
//   gate          GT    [B, L, R]  G(h_t)
//   pred_codebook AT    [V, R]     A
//   succ_codebook BT    [V, R]     B
//   anchor        int32 [B]        predecessor of every row at t = 0
//   uniforms      fp32  [B, L]     pre-drawn u_t in [0, 1) (SAMPLED; else any [1])
//   temperature   fp32  [1]        T > 0 (SAMPLED; else ignored)
// Outputs:
//   lattice       fp32  [B, L, K, K]  [b, t, i, j] = unary[b, t, j] + <A[p_i] * gate[b, t], B[c_j]>,
//                                     p_i = candidates[b, t-1, i] (anchor[b] at t = 0)
//   path          int32 [B, L]        index into candidates[b, t] chosen at each step
//   q             fp32  [B, L, K]     softmax(S_t(path[t-1], .) / T) (SAMPLED; else [1], unwritten)
// Grid (K * K, B, 1), threadgroup (K * K, 1, 1): one threadgroup per batch row walks the
// steps t = 0..L-1 in order; thread (i, j) = (tid / K, tid % K) owns lattice cell (i, j).
// Per step the gathered rows are staged through threadgroup memory in r-slices of RT
// columns (2 * K * (RT + 1) floats, ~16 KB); thread 0 then takes the walk step, which
// needs only row path[t-1] of this step, so no second launch is required.

constexpr int NT = K * K;
constexpr int RT = 2048 / K;  // r-slice width: K * RT = 2048 staged values per codebook

threadgroup float a_tile[K][RT + 1];  // A[p_i] * gate, one r-slice (+1 pad: no bank conflicts)
threadgroup float b_tile[K][RT + 1];  // B[c_j], same slice
threadgroup float scores[K][K];       // S_t, read by the walk

const int L = candidates_shape[1];
const int R = gate_shape[2];
const uint b = threadgroup_position_in_grid.y;
const uint tid = thread_index_in_threadgroup;
const uint i = tid / K;
const uint j = tid % K;
int prev = 0;  // walk position; meaningful in thread 0 only (rows of t = 0 are all the anchor)

for (int t = 0; t < L; ++t) {
  const size_t bt = size_t(b) * L + t;
  float acc = 0.0f;
  for (int r0 = 0; r0 < R; r0 += RT) {
    const int width = metal::min(RT, R - r0);
    for (int e = tid; e < K * RT; e += NT) {
      const int row = e / RT;
      const int col = e % RT;
      if (col < width) {
        const int p = t == 0 ? anchor[b] : candidates[(bt - 1) * K + row];
        const int c = candidates[bt * K + row];
        const float g = static_cast<float>(gate[bt * R + r0 + col]);
        a_tile[row][col] = static_cast<float>(pred_codebook[size_t(p) * R + r0 + col]) * g;
        b_tile[row][col] = static_cast<float>(succ_codebook[size_t(c) * R + r0 + col]);
      }
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    for (int col = 0; col < width; ++col) {
      acc += a_tile[i][col] * b_tile[j][col];
    }
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);  // slice consumed
  }
  const float s = unary[bt * K + j] + acc;
  lattice[(bt * K + i) * K + j] = s;
  scores[i][j] = s;
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

  if (tid == 0) {
    float row[K];
    for (int c = 0; c < K; ++c) {
      row[c] = scores[prev][c];
    }
    if (SAMPLED) {
      float q_row[K];
      prev = sample_row<K>(row, temperature[0], uniforms[bt], q_row);
      for (int c = 0; c < K; ++c) {
        q[bt * K + c] = q_row[c];
      }
    } else {
      prev = argmax_row<K>(row);
    }
    path[bt] = prev;
  }
  // No barrier needed: thread 0 reaches the next step's first slice barrier only after the
  // walk, and `scores` is rewritten only after that barrier (R >= 1).
}
