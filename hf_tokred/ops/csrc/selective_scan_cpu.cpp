// Mamba-1 inference kernels for CPU, fp32 throughout (the Python wrappers convert other dtypes).
//
// selective_scan_fwd: the whole SSM step of the mixer in one pass over time,
//   delta = softplus(dt + bias)            (bias, softplus optional)
//   h_t   = exp(delta * A) * h_{t-1} + delta * u_t * B_t
//   y_t   = (C_t . h_t + D * u_t) * silu(z_t)   (D, z optional)
// vectorised over blocks of W channels (one SIMD lane per channel, the N state values of a block in
// a small array), so no horizontal sums and no intermediate [B, D, L] tensors.  u, dt, z are [B, D, L]
// and B, C are [B, N, L] with arbitrary strides (transformers hands over transposed views); y is
// written time-major ([B, L, D] storage, returned as a [B, D, L] view by the wrapper).
//
// causal_conv1d_fwd: depthwise causal convolution (+ bias, + optional silu) of x [B, D, L] (any
// strides) with w [D, K]; output in [B, L, D] storage, vectorised over channels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t W = 8;        // channels per block (one AVX2 register of floats)
constexpr int64_t N_MAX = 64;   // largest state size

struct Strided3 {               // a [B, X, L] float tensor with element strides
  const float *p = nullptr;
  int64_t sb = 0, sx = 0, st = 0;
  Strided3() = default;
  explicit Strided3(const torch::Tensor &t)
      : p(t.data_ptr<float>()), sb(t.stride(0)), sx(t.stride(1)), st(t.stride(2)) {}
  inline float at(int64_t b, int64_t x, int64_t t) const { return p[b * sb + x * sx + t * st]; }
};

// exp for the scan's decay factors exp(delta * A): Cephes' single-precision range reduction and polynomial
// (about 1 ulp), inlined so the compiler vectorises it over the lanes instead of calling libmvec per vector.
// Arguments below -87.3 give ~1e-38 instead of 0 (a decay that is zero to fp32 accuracy either way).
inline float exp_inline(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.f;
  return e * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }  // torch's threshold

template <bool Full>
void scan_block(int64_t b, int64_t d0, int64_t w, int64_t L, int64_t N, const Strided3 &u, const Strided3 &dt,
                const Strided3 &z, bool has_z, const Strided3 &Bm, const Strided3 &Cm, const float *A,
                const float *bias, bool do_softplus, const float *Dv, const float *h0, float *y, int64_t D,
                float *h_out) {
  const int64_t lanes = Full ? W : w;
  alignas(32) float a[N_MAX][W], s[N_MAX][W];
  alignas(32) float bs[W] = {0}, dsk[W] = {0};
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < W; ++j) {
      const bool ok = j < lanes;
      a[n][j] = ok ? A[(d0 + j) * N + n] : 0.f;
      s[n][j] = ok ? h0[(b * D + d0 + j) * N + n] : 0.f;
    }
  for (int64_t j = 0; j < lanes; ++j) {
    bs[j] = bias ? bias[d0 + j] : 0.f;
    dsk[j] = Dv ? Dv[d0 + j] : 0.f;
  }
  for (int64_t t = 0; t < L; ++t) {
    alignas(32) float x[W] = {0}, v[W] = {0}, g[W] = {0}, delta[W], du[W], acc[W] = {0};
    for (int64_t j = 0; j < lanes; ++j) {  // gathers (contiguous when the input is time-major)
      x[j] = u.at(b, d0 + j, t);
      v[j] = dt.at(b, d0 + j, t);
      if (has_z) g[j] = z.at(b, d0 + j, t);
    }
#pragma omp simd
    for (int64_t j = 0; j < W; ++j) {
      const float dv = v[j] + bs[j];
      delta[j] = do_softplus ? softplus(dv) : dv;
      du[j] = delta[j] * x[j];
    }
    for (int64_t n = 0; n < N; ++n) {
      const float bn = Bm.at(b, n, t), cn = Cm.at(b, n, t);
#pragma omp simd
      for (int64_t j = 0; j < W; ++j) {
        const float sn = exp_inline(delta[j] * a[n][j]) * s[n][j] + du[j] * bn;
        s[n][j] = sn;
        acc[j] += cn * sn;
      }
    }
    alignas(32) float out[W];
#pragma omp simd
    for (int64_t j = 0; j < W; ++j) {
      const float o = acc[j] + dsk[j] * x[j];
      out[j] = has_z ? o * (g[j] / (1.f + std::exp(-g[j]))) : o;
    }
    float *yt = y + (b * L + t) * D + d0;
    for (int64_t j = 0; j < lanes; ++j) yt[j] = out[j];
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < lanes; ++j) h_out[(b * D + d0 + j) * N + n] = s[n][j];
}

}  // namespace

// u, dt, z: [B, D, L]; A: [D, N] contiguous; Bm, Cm: [B, N, L]; bias, Dv: [D] or empty; h0: [B, D, N]
// contiguous.  Returns y in [B, L, D] storage and the final state [B, D, N].
std::vector<torch::Tensor> selective_scan_fwd(torch::Tensor u, torch::Tensor dt, torch::Tensor A, torch::Tensor Bm,
                                              torch::Tensor Cm, torch::Tensor h0, torch::Tensor bias,
                                              bool do_softplus, torch::Tensor Dv, torch::Tensor z) {
  const int64_t Bsz = u.size(0), D = u.size(1), L = u.size(2), N = A.size(1);
  TORCH_CHECK(N <= N_MAX, "state size must be <= 64");
  TORCH_CHECK(A.is_contiguous() && h0.is_contiguous(), "A and h0 must be contiguous");
  auto y = torch::empty({Bsz, L, D}, u.options());
  auto h = torch::empty({Bsz, D, N}, u.options());
  const Strided3 us(u), dts(dt), Bs(Bm), Cs(Cm);
  const bool has_z = z.numel() > 0;
  const Strided3 zs = has_z ? Strided3(z) : Strided3();
  const float *Ap = A.data_ptr<float>(), *h0p = h0.data_ptr<float>();
  const float *bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const float *Dp = Dv.numel() ? Dv.data_ptr<float>() : nullptr;
  float *yp = y.data_ptr<float>(), *hp = h.data_ptr<float>();
  const int64_t blocks = (D + W - 1) / W;
  at::parallel_for(0, Bsz * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = (i % blocks) * W, w = std::min(W, D - d0);
      if (w == W)
        scan_block<true>(b, d0, w, L, N, us, dts, zs, has_z, Bs, Cs, Ap, bp, do_softplus, Dp, h0p, yp, D, hp);
      else
        scan_block<false>(b, d0, w, L, N, us, dts, zs, has_z, Bs, Cs, Ap, bp, do_softplus, Dp, h0p, yp, D, hp);
    }
  });
  return {y, h};
}

// x: [B, D, L] any strides; w: [D, K] contiguous; bias: [D] or empty.  Returns [B, L, D] storage.
torch::Tensor causal_conv1d_fwd(torch::Tensor x, torch::Tensor w, torch::Tensor bias, bool silu) {
  const int64_t Bsz = x.size(0), D = x.size(1), L = x.size(2), K = w.size(1);
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  auto out = torch::empty({Bsz, L, D}, x.options());
  const Strided3 xs(x);
  const float *wp = w.data_ptr<float>();
  const float *bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float *op = out.data_ptr<float>();
  at::parallel_for(0, Bsz * L, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / L, t = i % L;
      float *o = op + i * D;
      for (int64_t d = 0; d < D; ++d) o[d] = bp ? bp[d] : 0.f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t tt = t - (K - 1) + k;
        if (tt < 0) continue;
        const float *xr = xs.p + b * xs.sb + tt * xs.st;
        const int64_t sx = xs.sx;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += wp[d * K + k] * xr[d * sx];
      }
      if (silu) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = o[d] / (1.f + std::exp(-o[d]));
      }
    }
  });
  return out;
}

// Token matching at an anchor: for each row of a block of similarities sim [G, m, k] (contiguous),
// round(sim * scale[g, j]) (cosines in units of the tie grid: the rows of sim come from unit vectors, scale is
// the other side's inverse norm over the grid) and the first column attaining the row's maximum, in one pass
// in cache instead of three tensor passes.  One multiply per element, so fast-math cannot reassociate it.
std::vector<torch::Tensor> grid_argmax(torch::Tensor sim, torch::Tensor scale) {
  TORCH_CHECK(sim.is_contiguous() && scale.is_contiguous(), "inputs must be contiguous");
  const int64_t G = sim.size(0), m = sim.size(1), k = sim.size(2);
  auto best = torch::empty({G, m}, sim.options());
  auto idx = torch::empty({G, m}, sim.options().dtype(torch::kLong));
  const float *sp = sim.data_ptr<float>(), *cp = scale.data_ptr<float>();
  float *bestp = best.data_ptr<float>();
  int64_t *idxp = idx.data_ptr<int64_t>();
  at::parallel_for(0, G * m, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> vals(k);
    for (int64_t r = begin; r < end; ++r) {
      const float *row = sp + r * k, *sc = cp + (r / m) * k;
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < k; ++j) {
        const float v = std::nearbyint(row[j] * sc[j]);
        vals[j] = v;
        mx = std::max(mx, v);
      }
      int64_t at = 0;
      while (at < k && vals[at] != mx) ++at;
      bestp[r] = mx;
      idxp[r] = at;
    }
  });
  return {best, idx};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grid_argmax", &grid_argmax);
  m.def("selective_scan_fwd", &selective_scan_fwd);
  m.def("causal_conv1d_fwd", &causal_conv1d_fwd);
}
