// The T-CNN GPSA's attention core on CPU, one image per task (at::parallel_for), forward and backward.
//
// For one image, head h and query i ([TCNN21] Eq. 7, the content/positional mix of [ConViT21] Eq. 6):
//   S = scale Q^T K,  P = softmax_j(S),  A = g_h P + Pos^h (flushed),  Y = A X
// Backward (dY given; the maps are recomputed, never stored; core/nn/gated_attention.py writes it out):
//   dA = dY X^T,  dX = A^T dY,  dPos = sum_b dA,  r = sum_j dA P,  dg = sum_{b,i} r,
//   dS = g P (dA - r),  dQ = scale K dS^T,  dK = scale Q dS.
// The batch sums (dPos, dg) are accumulated per fixed block of images, in image order, and the blocks are
// summed in block order: the result does not depend on the thread count or on scheduling (deterministic).
// Layouts are those of core/nn/gated_attention.py: qt [B*heads, d, Lq], kt [B*heads, d, L], vt [B, C, L]
// (any strides), pos [heads, Lq, L], g [heads]; Y [B, Lq*heads, C] with rows (query, head).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

// Fixed number of image blocks whose partial batch sums are reduced in order (determinism, see above).
constexpr int64_t kBlocks = 16;

struct Dims {
  int64_t b, nh, d, lq, lk, c;
};

Dims check(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& pos,
           const at::Tensor& g) {
  TORCH_CHECK(qt.dim() == 3 && kt.dim() == 3 && vt.dim() == 3 && pos.dim() == 3 && g.dim() == 1,
              "gated_attention: qt, kt, vt, pos must be 3-d and g 1-d");
  TORCH_CHECK(qt.device().is_cpu() && kt.device().is_cpu() && vt.device().is_cpu() && pos.device().is_cpu() &&
                  g.device().is_cpu(), "gated_attention: CPU tensors only");
  auto st = qt.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, "gated_attention: float32 or float64 only");
  TORCH_CHECK(kt.scalar_type() == st && vt.scalar_type() == st && pos.scalar_type() == st && g.scalar_type() == st,
              "gated_attention: one dtype throughout");
  TORCH_CHECK(pos.is_contiguous() && g.is_contiguous(), "gated_attention: pos and g must be contiguous");
  Dims s{vt.size(0), pos.size(0), qt.size(1), qt.size(2), kt.size(2), vt.size(1)};
  TORCH_CHECK(qt.size(0) == s.b * s.nh && kt.size(0) == s.b * s.nh && kt.size(1) == s.d && vt.size(2) == s.lk &&
                  pos.size(1) == s.lq && pos.size(2) == s.lk && g.size(0) == s.nh,
              "gated_attention: inconsistent shapes");
  return s;
}

// The maps of image n: p [heads, Lq, L] = softmax(scale Q^T K) (s: the scores' buffer), a [Lq, heads, L] =
// g P + pos with the probabilities <= sqrt(smallest normal) set to zero (core.nn.gpsa._flush_tiny).
template <typename T>
void maps(const at::Tensor& q, const at::Tensor& k, const T* pos, const T* g, double scale, const Dims& s,
          at::Tensor& sc, at::Tensor& p, at::Tensor& a) {
  at::baddbmm_out(sc, sc, q.transpose(1, 2), k, /*beta=*/0.0, /*alpha=*/scale);
  at::_softmax_out(p, sc, -1, false);
  const T th = static_cast<T>(std::sqrt(static_cast<double>(std::numeric_limits<T>::min())));
  const T* pp = p.const_data_ptr<T>();
  T* ap = a.data_ptr<T>();
  for (int64_t h = 0; h < s.nh; ++h) {
    const T gh = g[h];
    for (int64_t i = 0; i < s.lq; ++i) {
      const T* prow = pp + (h * s.lq + i) * s.lk;
      const T* qrow = pos + (h * s.lq + i) * s.lk;
      T* arow = ap + (i * s.nh + h) * s.lk;
      for (int64_t j = 0; j < s.lk; ++j) {
        const T v = qrow[j] + prow[j] * gh;
        arow[j] = v <= th ? T(0) : v;
      }
    }
  }
}

struct Buffers {
  at::Tensor sc, p, a;
  Buffers(const at::Tensor& like, const Dims& s)
      : sc(at::empty({s.nh, s.lq, s.lk}, like.options())),
        p(at::empty({s.nh, s.lq, s.lk}, like.options())),
        a(at::empty({s.lq, s.nh, s.lk}, like.options())) {}
};

}  // namespace

// Y [B, Lq*heads, C] = A X, one image per task.
at::Tensor forward(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& pos,
                   const at::Tensor& g, double scale) {
  const Dims s = check(qt, kt, vt, pos, g);
  at::Tensor y = at::empty({s.b, s.lq * s.nh, s.c}, vt.options());
  AT_DISPATCH_FLOATING_TYPES(qt.scalar_type(), "gated_attention_forward", [&] {
    at::parallel_for(0, s.b, 1, [&](int64_t n0, int64_t n1) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // plain kernels (grad mode is per thread)
      Buffers w(vt, s);
      for (int64_t n = n0; n < n1; ++n) {
        auto q = qt.narrow(0, n * s.nh, s.nh), k = kt.narrow(0, n * s.nh, s.nh);
        maps<scalar_t>(q, k, pos.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), scale, s, w.sc, w.p,
                       w.a);
        auto yn = y.select(0, n);
        at::mm_out(yn, w.a.view({s.lq * s.nh, s.lk}), vt.select(0, n).t());
      }
    });
  });
  return y;
}

// (dqt, dkt, dvt, dpos, dg) for dY [B, Lq*heads, C] (contiguous); the maps recomputed per image.
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& qt, const at::Tensor& kt,
                                 const at::Tensor& vt, const at::Tensor& pos, const at::Tensor& g, double scale) {
  const Dims s = check(qt, kt, vt, pos, g);
  TORCH_CHECK(dy.is_contiguous() && dy.size(0) == s.b && dy.size(1) == s.lq * s.nh && dy.size(2) == s.c,
              "gated_attention: dy must be contiguous [B, Lq*heads, C]");
  auto opt = vt.options();
  at::Tensor dqt = at::empty({s.b * s.nh, s.d, s.lq}, opt), dkt = at::empty({s.b * s.nh, s.d, s.lk}, opt);
  at::Tensor dvt = at::empty({s.b, s.c, s.lk}, opt);
  const int64_t nblk = std::min(s.b, kBlocks), map = s.lq * s.nh * s.lk;
  at::Tensor dpos_blk = at::zeros({nblk, map}, opt), dg_blk = at::zeros({nblk, s.nh}, opt);
  AT_DISPATCH_FLOATING_TYPES(qt.scalar_type(), "gated_attention_backward", [&] {
    using T = scalar_t;
    const T* gp = g.const_data_ptr<T>();
    at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      Buffers w(vt, s);
      at::Tensor da = at::empty({s.lq * s.nh, s.lk}, opt), ds = at::empty({s.nh, s.lq, s.lk}, opt);
      for (int64_t blk = b0; blk < b1; ++blk) {
        T* dpos_acc = dpos_blk.data_ptr<T>() + blk * map;
        T* dg_acc = dg_blk.data_ptr<T>() + blk * s.nh;
        for (int64_t n = blk * s.b / nblk; n < (blk + 1) * s.b / nblk; ++n) {
          auto q = qt.narrow(0, n * s.nh, s.nh), k = kt.narrow(0, n * s.nh, s.nh);
          maps<T>(q, k, pos.const_data_ptr<T>(), gp, scale, s, w.sc, w.p, w.a);
          auto dyn = dy.select(0, n), xn = vt.select(0, n), dvn = dvt.select(0, n);
          at::mm_out(da, dyn, xn);                                          // dA = dY X^T  [Lq*heads, L]
          at::mm_out(dvn, dyn.t(), w.a.view({s.lq * s.nh, s.lk}));          // dX^T = dY^T A  [C, L]
          const T* pp = w.p.const_data_ptr<T>();
          const T* dap = da.const_data_ptr<T>();
          T* dsp = ds.data_ptr<T>();
          for (int64_t e = 0; e < map; ++e) dpos_acc[e] += dap[e];  // query-major, like A
          for (int64_t h = 0; h < s.nh; ++h) {
            const T gh = gp[h];
            T rsum = 0;
            for (int64_t i = 0; i < s.lq; ++i) {
              const T* prow = pp + (h * s.lq + i) * s.lk;
              const T* darow = dap + (i * s.nh + h) * s.lk;
              T* dsrow = dsp + (h * s.lq + i) * s.lk;
              T r = 0;
              for (int64_t j = 0; j < s.lk; ++j) r += darow[j] * prow[j];
              rsum += r;
              const T gr = gh * r;
              for (int64_t j = 0; j < s.lk; ++j) dsrow[j] = (darow[j] * gh - gr) * prow[j];
            }
            dg_acc[h] += rsum;
          }
          auto dqn = dqt.narrow(0, n * s.nh, s.nh), dkn = dkt.narrow(0, n * s.nh, s.nh);
          at::baddbmm_out(dqn, dqn, k, ds.transpose(1, 2), 0.0, scale);  // dQ = scale K dS^T
          at::baddbmm_out(dkn, dkn, q, ds, 0.0, scale);                  // dK = scale Q dS
        }
      }
    });
  });
  // the blocks' partial sums, in block order (each element independently: any split of the range agrees)
  at::Tensor dpos = at::empty({s.lq, s.nh, s.lk}, opt), dg = at::empty({s.nh}, opt);
  AT_DISPATCH_FLOATING_TYPES(qt.scalar_type(), "gated_attention_reduce", [&] {
    using T = scalar_t;
    const T* src = dpos_blk.const_data_ptr<T>();
    T* dst = dpos.data_ptr<T>();
    at::parallel_for(0, map, 4096, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) {
        T acc = 0;
        for (int64_t blk = 0; blk < nblk; ++blk) acc += src[blk * map + e];
        dst[e] = acc;
      }
    });
    const T* gsrc = dg_blk.const_data_ptr<T>();
    T* gdst = dg.data_ptr<T>();
    for (int64_t h = 0; h < s.nh; ++h) {
      T acc = 0;
      for (int64_t blk = 0; blk < nblk; ++blk) acc += gsrc[blk * s.nh + h];
      gdst[h] = acc;
    }
  });
  return {dqt, dkt, dvt, dpos.transpose(0, 1), dg};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "Y = A X, A = g softmax(scale Q^T K) + Pos ([TCNN21] Eq. 7)");
  m.def("backward", &backward, "(dQ^T, dK^T, dX^T, dPos, dg), the maps recomputed");
}
