// The T-CNN GPSA's attention core on CPU, one image per task (at::parallel_for), forward and backward.
//
// For one image, head h and query i ([TCNN21] Eq. 7, the content/positional mix of [ConViT21] Eq. 6):
//   S = scale Q^T K,  P = softmax_j(S),  A = g_h P + Pos^h (flushed),  Y = A X
// Backward (dY given; the maps are recomputed, never stored; core/nn/gated_attention.py writes it out):
//   dA = dY X^T,  dX = A^T dY,  dPos = sum_b dA,  r = sum_j dA P,  dg = sum_{b,i} r,
//   dS = g P (dA - r),  dQ = scale K dS^T,  dK = scale Q dS.
// The batch sums (dPos, dg) are accumulated per fixed block of images, in image order, and the blocks are
// summed in block order: the result does not depend on the thread count or on scheduling (deterministic).
// Float32 products (A X, dA, dX, the scores, dK) run through the register-blocked `sgemm` below and the
// softmax through ATen's vector functions; float64 (the gradient checks) through ATen's mm/baddbmm/softmax.
// Layouts are those of core/nn/gated_attention.py: qt [B*heads, d, Lq], kt [B*heads, d, L], vt [B, C, L]
// (any strides), pos [heads, Lq, L], g [heads]; Y [B, Lq*heads, C] with rows (query, head).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// ---- A small register-blocked SGEMM for the per-image products (float32) -----------------------------------
// ATen's CPU matmul is MKL's, which takes a slower code path on non-Intel CPUs (about a third of oneDNN's
// convolution FLOP rate on an AMD EPYC, one thread: benchmarks/gpsa_resnet20.py); these products are small
// (e.g. [576 x 64] x [64 x 64]) and their operands sit in cache, so a plain outer-product kernel in the
// compiler's vector extension (AVX-512: 16 floats, AVX2: 8, else 4) keeps up with oneDNN's rate. Each output
// element is summed over k in order, one image per thread: results do not depend on the thread count.
#if defined(__AVX512F__)
constexpr int kW = 16;
#elif defined(__AVX2__)
constexpr int kW = 8;
#else
constexpr int kW = 4;
#endif
constexpr int kNV = kW == 16 ? 4 : 2;  // vectors per row of the C tile (64 or 16 columns)
constexpr int kMR = 6;                 // rows of the C tile: kMR * kNV accumulators in registers
typedef float vf __attribute__((vector_size(kW * sizeof(float))));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// C[MR x NV*kW] = A[MR x K] B[K x NV*kW]; A(r, k) = a[r * lda + k * acs], B rows contiguous (row stride ldb).
template <int MR, int NV>
inline void tile(int64_t K, const float* a, int64_t lda, int64_t acs, const float* b, int64_t ldb, float* c,
                 int64_t ldc) {
  vf acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vf{};
  for (int64_t k = 0; k < K; ++k) {
    const float* brow = b + k * ldb;
    vf bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = vload(brow + kW * v);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float av = a[r * lda + k * acs];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += bv[v] * av;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(c + r * ldc + kW * v, acc[r][v]);
}

// All rows of one column block of NV vectors.
template <int NV>
void column_block(int64_t M, int64_t K, const float* a, int64_t lda, int64_t acs, const float* b, int64_t ldb,
                  float* c, int64_t ldc) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) tile<kMR, NV>(K, a + m * lda, lda, acs, b, ldb, c + m * ldc, ldc);
  for (; m < M; ++m) tile<1, NV>(K, a + m * lda, lda, acs, b, ldb, c + m * ldc, ldc);
}

// C[M x N] (row stride ldc, columns contiguous) = A B, A(m, k) = a[m * lda + k * acs], B[K x N] with
// contiguous rows (row stride ldb). Columns in blocks of kNV vectors, then single vectors, then scalars.
void sgemm(int64_t M, int64_t K, int64_t N, const float* a, int64_t lda, int64_t acs, const float* b, int64_t ldb,
           float* c, int64_t ldc) {
  int64_t n = 0;
  for (; n + kNV * kW <= N; n += kNV * kW) column_block<kNV>(M, K, a, lda, acs, b + n, ldb, c + n, ldc);
  for (; n + kW <= N; n += kW) column_block<1>(M, K, a, lda, acs, b + n, ldb, c + n, ldc);
  for (int64_t m = 0; m < M && n < N; ++m)
    for (int64_t j = n; j < N; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += a[m * lda + k * acs] * b[k * ldb + j];
      c[m * ldc + j] = acc;
    }
}

// out = l r for 2-d tensors (any strides): the kernel above for float32, packing r into ``pack`` when its rows
// are not contiguous (no pack: r's rows must be); ATen's mm for other dtypes (float64: the gradient checks).
template <typename T>
void matmul(at::Tensor& out, const at::Tensor& l, const at::Tensor& r, at::Tensor* pack = nullptr) {
  if constexpr (std::is_same_v<T, float>) {
    TORCH_INTERNAL_ASSERT(out.stride(1) == 1, "gated_attention: output rows must be contiguous");
    const float* rp = r.const_data_ptr<float>();
    int64_t ldr = r.stride(0);
    if (r.stride(1) != 1) {
      TORCH_INTERNAL_ASSERT(pack != nullptr, "gated_attention: a strided right operand needs a pack buffer");
      pack->copy_(r);
      rp = pack->const_data_ptr<float>();
      ldr = pack->stride(0);
    }
    sgemm(l.size(0), l.size(1), r.size(1), l.const_data_ptr<float>(), l.stride(0), l.stride(1), rp, ldr,
          out.data_ptr<float>(), out.stride(0));
  } else {
    at::mm_out(out, l, r);
  }
}

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

// out[h] = scale l[h] r[h] over the heads (3-d views, out contiguous): `sgemm` per head when r's rows are
// contiguous, then the scale on the finished sums (as baddbmm's alpha); ATen's baddbmm otherwise (other dtypes,
// other layouts).
template <typename T>
void heads_product(at::Tensor& out, const at::Tensor& l, const at::Tensor& r, double scale) {
  if constexpr (std::is_same_v<T, float>) {
    if (r.stride(2) != 1) {
      at::baddbmm_out(out, out, l, r, /*beta=*/0.0, /*alpha=*/scale);
      return;
    }
    const int64_t nh = out.size(0), m = out.size(1), n = out.size(2), kk = l.size(2);
    float* o = out.data_ptr<float>();
    for (int64_t h = 0; h < nh; ++h)
      sgemm(m, kk, n, l.const_data_ptr<float>() + h * l.stride(0), l.stride(1), l.stride(2),
            r.const_data_ptr<float>() + h * r.stride(0), r.stride(1), o + h * m * n, n);
    using Vec = at::vec::Vectorized<float>;
    const float f = static_cast<float>(scale);
    at::vec::map([f](Vec x) { return x * Vec(f); }, o, o, out.numel());
  } else {
    at::baddbmm_out(out, out, l, r, /*beta=*/0.0, /*alpha=*/scale);
  }
}

// p = softmax over the last dimension of sc ([rows, n], contiguous), ATen's own vector functions for float32
// (max, exp, sum, scale: the steps of ATen's softmax kernel), ATen's softmax otherwise.
template <typename T>
void softmax_rows(const at::Tensor& sc, at::Tensor& p) {
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    const int64_t n = sc.size(-1), rows = sc.numel() / n;
    const float* in = sc.const_data_ptr<float>();
    float* out = p.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r, in += n, out += n) {
      const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, in, n);
      at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, out, in, n);
      const float inv = 1.0f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, out, n);
      at::vec::map([inv](Vec x) { return x * Vec(inv); }, out, out, n);
    }
  } else {
    at::_softmax_out(p, sc, -1, false);
  }
}

// The maps of image n: p [heads, Lq, L] = softmax(scale Q^T K) (s: the scores' buffer), a [Lq, heads, L] =
// g P + pos with the probabilities <= sqrt(smallest normal) set to zero (core.nn.gpsa._flush_tiny).
template <typename T>
void maps(const at::Tensor& q, const at::Tensor& k, const T* pos, const T* g, double scale, const Dims& s,
          at::Tensor& sc, at::Tensor& p, at::Tensor& a) {
  heads_product<T>(sc, q.transpose(1, 2), k, scale);  // S = scale Q^T K
  softmax_rows<T>(sc, p);
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
      at::Tensor xpack = at::empty({s.lk, s.c}, vt.options());
      for (int64_t n = n0; n < n1; ++n) {
        auto q = qt.narrow(0, n * s.nh, s.nh), k = kt.narrow(0, n * s.nh, s.nh);
        maps<scalar_t>(q, k, pos.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), scale, s, w.sc, w.p,
                       w.a);
        auto yn = y.select(0, n);
        matmul<scalar_t>(yn, w.a.view({s.lq * s.nh, s.lk}), vt.select(0, n).t(), &xpack);  // Y = A X
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
      at::Tensor xpack = at::empty({s.c, s.lk}, opt);
      for (int64_t blk = b0; blk < b1; ++blk) {
        T* dpos_acc = dpos_blk.data_ptr<T>() + blk * map;
        T* dg_acc = dg_blk.data_ptr<T>() + blk * s.nh;
        for (int64_t n = blk * s.b / nblk; n < (blk + 1) * s.b / nblk; ++n) {
          auto q = qt.narrow(0, n * s.nh, s.nh), k = kt.narrow(0, n * s.nh, s.nh);
          maps<T>(q, k, pos.const_data_ptr<T>(), gp, scale, s, w.sc, w.p, w.a);
          auto dyn = dy.select(0, n), xn = vt.select(0, n), dvn = dvt.select(0, n);
          matmul<T>(da, dyn, xn, &xpack);                                   // dA = dY X^T  [Lq*heads, L]
          matmul<T>(dvn, dyn.t(), w.a.view({s.lq * s.nh, s.lk}));           // dX^T = dY^T A  [C, L]
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
          heads_product<T>(dkn, q, ds, scale);                           // dK = scale Q dS
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
