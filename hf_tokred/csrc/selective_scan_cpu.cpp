// Mamba-1 selective scan on CPU: one sequential pass over time per (batch, channel) row, the state
// vector (N values) kept in registers, exp vectorised over the state dimension.
// Inputs (float32, contiguous): u, dt [B, D, L] (dt after bias and softplus), A [D, N],
// Bt, Ct [B, L, N], h0 [B, D, N].  Returns y = C . h  [B, D, L] and the final state [B, D, N].
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

std::vector<torch::Tensor> selective_scan_fwd(torch::Tensor u, torch::Tensor dt, torch::Tensor A,
                                              torch::Tensor Bt, torch::Tensor Ct, torch::Tensor h0) {
  const int64_t Bsz = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  TORCH_CHECK(N <= 256, "state size must be <= 256");
  auto y = torch::empty_like(u);
  auto h = h0.clone();
  const float *up = u.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = Bt.data_ptr<float>(), *Cp = Ct.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *hp = h.data_ptr<float>();
  at::parallel_for(0, Bsz * D, 16, [&](int64_t begin, int64_t end) {
    float state[256];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / D, d = row % D;
      const float *a = Ap + d * N;
      float *hs = hp + row * N;
      for (int64_t n = 0; n < N; ++n) state[n] = hs[n];
      const float *ur = up + row * L, *dr = dtp + row * L;
      float *yr = yp + row * L;
      for (int64_t t = 0; t < L; ++t) {
        const float delta = dr[t], x = delta * ur[t];
        const float *bt = Bp + (b * L + t) * N, *ct = Cp + (b * L + t) * N;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
          const float s = std::exp(delta * a[n]) * state[n] + x * bt[n];
          state[n] = s;
          acc += ct[n] * s;
        }
        yr[t] = acc;
      }
      for (int64_t n = 0; n < N; ++n) hs[n] = state[n];
    }
  });
  return {y, h};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("selective_scan_fwd", &selective_scan_fwd); }
