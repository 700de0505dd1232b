// The T-CNN GPSA's attention core on CPU, one image per task (at::parallel_for), forward and backward.
//
// For one image, head h and query i ([TCNN21] Eq. 7, the content/positional mix of [ConViT21] Eq. 6):
//   S = scale Q^T K,  P = softmax_j(S),  A = g_h P + Pos^h (flushed),  Y = A X
// Backward (dY given; the maps are recomputed, never stored; core/nn/gated_attention.py writes it out):
//   dA = dY X^T,  dX = A^T dY,  dPos = sum_b dA,  r = sum_j dA P,  dg = sum_{b,i} r,
//   dS = g P (dA - r),  dQ^T = scale dS K^T,  dK = scale Q dS.
// The batch sums (dPos, dg) are accumulated per fixed block of images, in image order, and the blocks are
// summed in block order: the result does not depend on the thread count or on scheduling (deterministic).
// Inside the parallel loops everything runs on raw pointers and strides (no ATen call, no tensor created or
// viewed): the products through `gemm` (float32: the register-blocked `sgemm` below; float64, the gradient
// checks: a plain loop), the softmax through ATen's vector functions (float32) or a plain loop (float64),
// strided operands packed by a cache-blocked copy, per-task buffers allocated once per task.
// Layouts are those of core/nn/gated_attention.py: qt [B*heads, d, Lq] or [B, heads, d, Lq], kt likewise with
// L (any strides: e.g. the q and k rows of one projection output), vt [B, C, L] (any strides), pos [heads, Lq, L],
// g [heads]; Y [B, Lq*heads, C] with rows (query, head). The gradients of qt, kt are written into given tensors
// (any strides; e.g. the two halves of one projection's gradient), dX in vt's layout (channels-last or not).
// ATen and the Python binding only, not <torch/extension.h> (the whole C++ frontend): a third less build time.
#include <ATen/ATen.h>
#include <torch/python.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
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

// All rows of one column block of NV vectors: tiles of kMR rows, then one tile of the leftover rows.
template <int NV>
void column_block(int64_t M, int64_t K, const float* a, int64_t lda, int64_t acs, const float* b, int64_t ldb,
                  float* c, int64_t ldc) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) tile<kMR, NV>(K, a + m * lda, lda, acs, b, ldb, c + m * ldc, ldc);
  a += m * lda;
  c += m * ldc;
  switch (M - m) {
    case 5: tile<5, NV>(K, a, lda, acs, b, ldb, c, ldc); break;
    case 4: tile<4, NV>(K, a, lda, acs, b, ldb, c, ldc); break;
    case 3: tile<3, NV>(K, a, lda, acs, b, ldb, c, ldc); break;
    case 2: tile<2, NV>(K, a, lda, acs, b, ldb, c, ldc); break;
    case 1: tile<1, NV>(K, a, lda, acs, b, ldb, c, ldc); break;
    default: break;
  }
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

// Sum of a vector's lanes, pairwise in a fixed order.
inline float hsum(vf v) {
  float t[kW];
  std::memcpy(t, &v, sizeof v);
#pragma GCC unroll 4
  for (int w = kW / 2; w > 0; w /= 2)
#pragma GCC unroll 8
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// C[MR x NR] = A[MR x K] B[NR x K]^T, A's and B's rows contiguous (row strides lda, ldb): dot products along k in
// vector lanes, each lane's sum in k order, then the lanes' pairwise sum and the scalar tail (a fixed order).
template <int MR, int NR>
inline void tile_nt(int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  vf acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[r][n] = vf{};
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    vf av[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = vload(a + r * lda + k);
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      const vf bv = vload(b + n * ldb + k);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][n] += av[r] * bv;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) {
      float sum = hsum(acc[r][n]);
      for (int64_t kk = k; kk < K; ++kk) sum += a[r * lda + kk] * b[n * ldb + kk];
      c[r * ldc + n] = sum;
    }
}

template <int MR>
void tile_nt_cols(int nr, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                  int64_t ldc) {
  switch (nr) {
    case 4: tile_nt<MR, 4>(K, a, lda, b, ldb, c, ldc); break;
    case 3: tile_nt<MR, 3>(K, a, lda, b, ldb, c, ldc); break;
    case 2: tile_nt<MR, 2>(K, a, lda, b, ldb, c, ldc); break;
    default: tile_nt<MR, 1>(K, a, lda, b, ldb, c, ldc); break;
  }
}

// C[M x N] (row stride ldc) = A B^T for A [M x K], B [N x K] with contiguous rows: for a narrow N (e.g. dQ^T =
// dS K^T, N = d) where B^T's rows would be too short for `sgemm`'s vectors. Tiles of 3 x 4 dot products.
void sgemm_nt(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
              int64_t ldc) {
  for (int64_t n = 0; n < N; n += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, N - n));
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) tile_nt_cols<3>(nr, K, a + m * lda, lda, b + n * ldb, ldb, c + m * ldc + n, ldc);
    for (; m < M; ++m) tile_nt_cols<1>(nr, K, a + m * lda, lda, b + n * ldb, ldb, c + m * ldc + n, ldc);
  }
}

// C = A B^T for both dtypes: `sgemm_nt` for float32, a plain loop for float64.
template <typename T>
void gemm_nt(int64_t M, int64_t N, int64_t K, const T* a, int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    sgemm_nt(M, N, K, a, lda, b, ldb, c, ldc);
  } else {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        T sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += a[m * lda + k] * b[n * ldb + k];
        c[m * ldc + n] = sum;
      }
  }
}

// sum_j x[j] y[j] of two contiguous rows: float32 in vector lanes (each in j order) then `hsum` and the tail.
template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  int64_t j = 0;
  T sum = 0;
  if constexpr (std::is_same_v<T, float>) {
    vf acc0{}, acc1{};
    for (; j + 2 * kW <= n; j += 2 * kW) {
      acc0 += vload(x + j) * vload(y + j);
      acc1 += vload(x + j + kW) * vload(y + j + kW);
    }
    for (; j + kW <= n; j += kW) acc0 += vload(x + j) * vload(y + j);
    sum = hsum(acc0 + acc1);
  }
  for (; j < n; ++j) sum += x[j] * y[j];
  return sum;
}

// The same product for both dtypes: `sgemm` for float32, a plain loop for float64 (the gradient checks); each
// output element summed over k in order.
template <typename T>
void gemm(int64_t M, int64_t K, int64_t N, const T* a, int64_t lda, int64_t acs, const T* b, int64_t ldb, T* c,
          int64_t ldc) {
  if constexpr (std::is_same_v<T, float>) {
    sgemm(M, K, N, a, lda, acs, b, ldb, c, ldc);
  } else {
    for (int64_t m = 0; m < M; ++m) {
      T* crow = c + m * ldc;
      std::fill(crow, crow + N, T(0));
      for (int64_t k = 0; k < K; ++k) {
        const T av = a[m * lda + k * acs];
        const T* brow = b + k * ldb;
        for (int64_t j = 0; j < N; ++j) crow[j] += av * brow[j];
      }
    }
  }
}

// dst[r * ldd + c] = src[r * rs + c * cs] for r < R, c < C: row copies when the source's rows are contiguous,
// else a copy in cache-sized square blocks (a transpose reads and writes whole cache lines per block).
constexpr int64_t kTB = 16;

template <typename T>
void pack(int64_t R, int64_t C, const T* src, int64_t rs, int64_t cs, T* dst, int64_t ldd) {
  if (cs == 1) {
    for (int64_t r = 0; r < R; ++r) std::memcpy(dst + r * ldd, src + r * rs, C * sizeof(T));
    return;
  }
  for (int64_t r0 = 0; r0 < R; r0 += kTB)
    for (int64_t c0 = 0; c0 < C; c0 += kTB) {
      const int64_t r1 = std::min(R, r0 + kTB), c1 = std::min(C, c0 + kTB);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[r * ldd + c] = src[r * rs + c * cs];
    }
}

// dst[r * rs + c * cs] = f src[r * lds + c] (the finished sums scaled, as baddbmm's alpha), blocked like `pack`.
template <typename T>
void unpack(int64_t R, int64_t C, const T* src, int64_t lds, T f, T* dst, int64_t rs, int64_t cs) {
  if (cs == 1) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) dst[r * rs + c] = f * src[r * lds + c];
    return;
  }
  for (int64_t r0 = 0; r0 < R; r0 += kTB)
    for (int64_t c0 = 0; c0 < C; c0 += kTB) {
      const int64_t r1 = std::min(R, r0 + kTB), c1 = std::min(C, c0 + kTB);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[r * rs + c * cs] = f * src[r * lds + c];
    }
}

// p = softmax over each row of scale * sc ([rows, n], contiguous): the scaled scores, max, exp, sum, scale, per
// row (the steps of ATen's softmax kernel; float32 through ATen's vector functions, float64 a plain loop).
template <typename T>
void softmax_rows(int64_t rows, int64_t n, const T* in, T scale, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    using Vec = at::vec::Vectorized<float>;
    for (int64_t r = 0; r < rows; ++r, in += n, out += n) {
      at::vec::map([scale](Vec x) { return x * Vec(scale); }, out, in, n);
      const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, out, n);
      at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, out, out, n);
      const float inv = 1.0f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, out, n);
      at::vec::map([inv](Vec x) { return x * Vec(inv); }, out, out, n);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r, in += n, out += n) {
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, out[j] = in[j] * scale);
      T sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += out[j] = std::exp(out[j] - mx);
      const T inv = T(1) / sum;
      for (int64_t j = 0; j < n; ++j) out[j] *= inv;
    }
  }
}

// Fixed number of image blocks whose partial batch sums are reduced in order (determinism, see above).
constexpr int64_t kBlocks = 16;

struct Dims {
  int64_t b, nh, d, lq, lk, c;
};

// A [B, heads, d, L] operand (q, k or their gradients) as a pointer and strides: element (n, h, e, i) at
// p[n * sn + h * sh + e * se + i * si]; a 3-d [B*heads, d, L] tensor splits its first dimension.
template <typename T>
struct Heads {
  T* p;
  int64_t sn, sh, se, si;
};

template <typename T>
Heads<T> heads_of(const at::Tensor& t, int64_t nh) {
  T* p = const_cast<T*>(t.const_data_ptr<T>());
  if (t.dim() == 3) return {p, t.stride(0) * nh, t.stride(0), t.stride(1), t.stride(2)};
  return {p, t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

void check_heads(const at::Tensor& t, const Dims& s, int64_t l, const char* name) {
  const bool ok = t.dim() == 3 ? t.size(0) == s.b * s.nh && t.size(1) == s.d && t.size(2) == l
                               : t.dim() == 4 && t.size(0) == s.b && t.size(1) == s.nh && t.size(2) == s.d &&
                                     t.size(3) == l;
  TORCH_CHECK(ok, "gated_attention: ", name, " must be [B*heads, d, L] or [B, heads, d, L], consistently");
}

Dims check(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& pos,
           const at::Tensor& g) {
  TORCH_CHECK((qt.dim() == 3 || qt.dim() == 4) && (kt.dim() == 3 || kt.dim() == 4) && vt.dim() == 3 &&
                  pos.dim() == 3 && g.dim() == 1,
              "gated_attention: qt, kt must be 3-d or 4-d, vt, pos 3-d and g 1-d");
  TORCH_CHECK(qt.device().is_cpu() && kt.device().is_cpu() && vt.device().is_cpu() && pos.device().is_cpu() &&
                  g.device().is_cpu(), "gated_attention: CPU tensors only");
  auto st = qt.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble, "gated_attention: float32 or float64 only");
  TORCH_CHECK(kt.scalar_type() == st && vt.scalar_type() == st && pos.scalar_type() == st && g.scalar_type() == st,
              "gated_attention: one dtype throughout");
  TORCH_CHECK(pos.is_contiguous() && g.is_contiguous(), "gated_attention: pos and g must be contiguous");
  Dims s{vt.size(0), pos.size(0), qt.size(-2), qt.size(-1), kt.size(-1), vt.size(1)};
  check_heads(qt, s, s.lq, "qt");
  check_heads(kt, s, s.lk, "kt");
  TORCH_CHECK(vt.size(2) == s.lk && pos.size(1) == s.lq && pos.size(2) == s.lk && g.size(0) == s.nh,
              "gated_attention: inconsistent shapes");
  return s;
}

// One task's buffers (allocated once per task, outside the image loop). The forward keeps one head's
// probabilities at a time (a smaller working set), the backward all heads' (dS needs them) and dS itself.
template <typename T>
struct Work {
  std::vector<T> kp, p, a, xp;
  bool all_heads;
  Work(const Dims& s, int64_t xpack, bool all_heads)
      : kp(s.nh * s.d * s.lk), p((all_heads ? s.nh : 1) * s.lq * s.lk), a(s.lq * s.nh * s.lk), xp(xpack),
        all_heads(all_heads) {}
};

// Prefetch into L2 the cache lines of the elements p[sum_k i_k * strides[k]], 0 <= i_k < sizes[k], when they
// span at most 256 KiB (non-negative strides): the next image's operands while this one computes (the first
// touch of a strided projection's rows otherwise stalls its pack).
template <typename T>
void prefetch(const T* p, std::initializer_list<std::pair<int64_t, int64_t>> dims) {
  int64_t extent = 1;
  for (const auto& [size, stride] : dims) {
    if (stride < 0) return;
    extent += (size - 1) * stride;
  }
  const int64_t bytes = extent * static_cast<int64_t>(sizeof(T));
  if (bytes > (int64_t(256) << 10)) return;
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

template <typename T>
void prefetch_heads(const Heads<T>& t, int64_t n, const Dims& s, int64_t l) {
  prefetch(t.p + n * t.sn, {{s.nh, t.sh}, {s.d, t.se}, {l, t.si}});
}

// The next image's q, k and x (vn: its [C, L] map, strides sv1, sv2) into L2 while this one computes.
template <typename T>
void prefetch_image(const Heads<T>& q, const Heads<T>& k, const T* vn, int64_t sv1, int64_t sv2, int64_t n,
                    const Dims& s) {
  prefetch_heads(q, n, s, s.lq);
  prefetch_heads(k, n, s, s.lk);
  prefetch(vn, {{s.c, sv1}, {s.lk, sv2}});
}

// A [R, C] operand (row stride rs, column stride cs) with contiguous rows, as `gemm`'s right operand needs:
// itself when cs == 1, else packed into buf; returns its rows and their stride.
template <typename T>
std::pair<const T*, int64_t> contiguous_rows(int64_t R, int64_t C, const T* src, int64_t rs, int64_t cs,
                                             std::vector<T>& buf) {
  if (cs == 1) return {src, rs};
  pack(R, C, src, rs, cs, buf.data(), C);
  return {buf.data(), C};
}

// The maps of image n ([TCNN21] Eq. 7): w.p [heads (or 1), Lq, L] = softmax(scale Q^T K), w.a [Lq, heads, L]
// = g P + pos with the probabilities <= sqrt(smallest normal) set to zero (core.nn.gpsa._flush_tiny), head by
// head. Returns K's rows for the image, head h at (result + h * result_sh), row stride result_ld, columns
// contiguous (packed into w.kp when k's columns are strided, e.g. a channels-last projection).
template <typename T>
std::tuple<const T*, int64_t, int64_t> maps(const Heads<T>& q, const Heads<T>& k, int64_t n, const T* pos,
                                            const T* g, T scale, const Dims& s, Work<T>& w) {
  const T* kn = k.p + n * k.sn;
  const T* kb = kn;
  int64_t ksh = k.sh, kld = k.se;
  if (k.si != 1) {
    for (int64_t h = 0; h < s.nh; ++h) pack(s.d, s.lk, kn + h * k.sh, k.se, k.si, w.kp.data() + h * s.d * s.lk, s.lk);
    kb = w.kp.data();
    ksh = s.d * s.lk;
    kld = s.lk;
  }
  const T* qn = q.p + n * q.sn;
  const T th = static_cast<T>(std::sqrt(static_cast<double>(std::numeric_limits<T>::min())));
  for (int64_t h = 0; h < s.nh; ++h) {
    T* ph = w.p.data() + (w.all_heads ? h * s.lq * s.lk : 0);
    gemm<T>(s.lq, s.d, s.lk, qn + h * q.sh, q.si, q.se, kb + h * ksh, kld, ph, s.lk);  // Q^T K: A(i,e) = Q[e,i]
    softmax_rows<T>(s.lq, s.lk, ph, scale, ph);                                         // in place
    const T gh = g[h];
    for (int64_t i = 0; i < s.lq; ++i) {
      const T* prow = ph + i * s.lk;
      const T* qrow = pos + (h * s.lq + i) * s.lk;
      T* arow = w.a.data() + (i * s.nh + h) * s.lk;
      for (int64_t j = 0; j < s.lk; ++j) {
        const T v = qrow[j] + prow[j] * gh;
        arow[j] = v <= th ? T(0) : v;
      }
    }
  }
  return {kb, ksh, kld};
}

template <typename T>
void forward_images(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& pos,
                    const at::Tensor& g, T scale, const Dims& s, at::Tensor& y) {
  const Heads<T> q = heads_of<T>(qt, s.nh), k = heads_of<T>(kt, s.nh);
  const T *vp = vt.const_data_ptr<T>(), *pp = pos.const_data_ptr<T>(), *gp = g.const_data_ptr<T>();
  const int64_t sv0 = vt.stride(0), sv1 = vt.stride(1), sv2 = vt.stride(2);
  const bool xrows = sv1 == 1;  // X = vt[n]^T [L, C] has contiguous rows (a channels-last map)
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, s.b, 1, [&](int64_t n0, int64_t n1) {
    Work<T> w(s, xrows ? 0 : s.lk * s.c, false);
    for (int64_t n = n0; n < n1; ++n) {
      if (n + 1 < n1) prefetch_image(q, k, vp + (n + 1) * sv0, sv1, sv2, n + 1, s);
      maps<T>(q, k, n, pp, gp, scale, s, w);
      const auto [xb, ldx] = contiguous_rows(s.lk, s.c, vp + n * sv0, sv2, sv1, w.xp);  // X = vt[n]^T [L, C]
      gemm<T>(s.lq * s.nh, s.lk, s.c, w.a.data(), s.lk, 1, xb, ldx, yp + n * s.lq * s.nh * s.c, s.c);  // Y = A X
    }
  });
}

template <typename T>
void backward_images(const at::Tensor& dy, const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt,
                     const at::Tensor& pos, const at::Tensor& g, T scale, const Dims& s, at::Tensor& dqt,
                     at::Tensor& dkt, at::Tensor& dvt, at::Tensor& dpos_blk, at::Tensor& dg_blk, int64_t nblk) {
  const Heads<T> q = heads_of<T>(qt, s.nh), k = heads_of<T>(kt, s.nh);
  const Heads<T> dq = heads_of<T>(dqt, s.nh), dk = heads_of<T>(dkt, s.nh);
  const T *vp = vt.const_data_ptr<T>(), *pp = pos.const_data_ptr<T>(), *gp = g.const_data_ptr<T>();
  const T* dyp = dy.const_data_ptr<T>();
  const int64_t sv0 = vt.stride(0), sv1 = vt.stride(1), sv2 = vt.stride(2), rows = s.lq * s.nh;
  const int64_t map = rows * s.lk;
  const bool xrows = sv2 == 1;            // vt[n] [C, L] has contiguous rows (NCHW): dA = dY X^T without a pack
  const bool dx_cl = dvt.stride(1) == 1;  // dX in vt's channels-last layout (transposed on the way out)
  T* dvp = dvt.data_ptr<T>();
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    Work<T> w(s, xrows ? 0 : s.c * s.lk, true);
    std::vector<T> da(map), dsb(s.nh * s.lq * s.lk), out(s.d * std::max(s.lq, s.lk)), dxt(dx_cl ? s.c * s.lk : 0);
    T* ds = dsb.data();
    for (int64_t blk = b0; blk < b1; ++blk) {
      T* dpos_acc = dpos_blk.data_ptr<T>() + blk * map;
      T* dg_acc = dg_blk.data_ptr<T>() + blk * s.nh;
      const int64_t first_n = blk * s.b / nblk;  // each block holds >= 1 image (nblk <= B): its first one
      for (int64_t n = first_n; n < (blk + 1) * s.b / nblk; ++n) {  // writes the block's sums, the rest add
        const bool first = n == first_n;
        if (n + 1 < s.b && n + 1 < b1 * s.b / nblk) prefetch_image(q, k, vp + (n + 1) * sv0, sv1, sv2, n + 1, s);
        const auto [kb, ksh, kld] = maps<T>(q, k, n, pp, gp, scale, s, w);
        const T* dyn = dyp + n * rows * s.c;
        const auto [xb, ldx] = contiguous_rows(s.c, s.lk, vp + n * sv0, sv1, sv2, w.xp);  // X = vt[n] [C, L]
        gemm<T>(rows, s.c, s.lk, dyn, s.c, 1, xb, ldx, da.data(), s.lk);  // dA = dY X^T  [Lq*heads, L]
        // dX^T = dY^T A  [C, L] (A's rows streamed: A is too large for L1), into vt's layout
        if (dx_cl) {
          gemm<T>(s.c, rows, s.lk, dyn, 1, s.c, w.a.data(), s.lk, dxt.data(), s.lk);
          unpack(s.c, s.lk, dxt.data(), s.lk, T(1), dvp + n * s.lk * s.c, 1, s.c);
        } else {
          gemm<T>(s.c, rows, s.lk, dyn, 1, s.c, w.a.data(), s.lk, dvp + n * s.c * s.lk, s.lk);
        }
        const T* p = w.p.data();
        for (int64_t h = 0; h < s.nh; ++h) {
          const T gh = gp[h];
          T rsum = 0;
          for (int64_t i = 0; i < s.lq; ++i) {
            const T* prow = p + (h * s.lq + i) * s.lk;
            const T* darow = da.data() + (i * s.nh + h) * s.lk;
            T* dsrow = ds + (h * s.lq + i) * s.lk;
            T* dprow = dpos_acc + (i * s.nh + h) * s.lk;  // dPos += dA (query-major, like A), row in cache
            if (first)
              std::memcpy(dprow, darow, s.lk * sizeof(T));
            else
              for (int64_t j = 0; j < s.lk; ++j) dprow[j] += darow[j];
            const T r = dot(darow, prow, s.lk);
            rsum += r;
            const T gr = gh * r;
            for (int64_t j = 0; j < s.lk; ++j) dsrow[j] = (darow[j] * gh - gr) * prow[j];
          }
          dg_acc[h] = first ? rsum : dg_acc[h] + rsum;
          // dQ^T = scale dS K^T [Lq, d] (rows of dS and K both contiguous along L: no transpose of dS),
          // dK = scale Q dS [d, L]: the finished sums scaled into the outputs, in their strides
          gemm_nt<T>(s.lq, s.d, s.lk, ds + h * s.lq * s.lk, s.lk, kb + h * ksh, kld, out.data(), s.d);
          unpack(s.lq, s.d, out.data(), s.d, scale, dq.p + n * dq.sn + h * dq.sh, dq.si, dq.se);
          gemm<T>(s.d, s.lq, s.lk, q.p + n * q.sn + h * q.sh, q.se, q.si, ds + h * s.lq * s.lk, s.lk, out.data(),
                  s.lk);
          unpack(s.d, s.lk, out.data(), s.lk, scale, dk.p + n * dk.sn + h * dk.sh, dk.se, dk.si);
        }
      }
    }
  });
}

}  // namespace

// Y [B, Lq*heads, C] = A X, one image per task.
at::Tensor forward(const at::Tensor& qt, const at::Tensor& kt, const at::Tensor& vt, const at::Tensor& pos,
                   const at::Tensor& g, double scale) {
  const Dims s = check(qt, kt, vt, pos, g);
  at::Tensor y = at::empty({s.b, s.lq * s.nh, s.c}, vt.options());
  AT_DISPATCH_FLOATING_TYPES(qt.scalar_type(), "gated_attention_forward", [&] {
    forward_images<scalar_t>(qt, kt, vt, pos, g, static_cast<scalar_t>(scale), s, y);
  });
  return y;
}

// (dqt, dkt, dvt, dpos, dg) for dY [B, Lq*heads, C] (contiguous); the maps recomputed per image. dqt, dkt are
// written into the given tensors (qt's and kt's shapes, any non-overlapping strides) or into new ones like qt,
// kt; dvt comes in vt's layout when vt's channels are contiguous (a channels-last map), else contiguous.
std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& qt, const at::Tensor& kt,
                                 const at::Tensor& vt, const at::Tensor& pos, const at::Tensor& g, double scale,
                                 std::optional<at::Tensor> dqt_out, std::optional<at::Tensor> dkt_out) {
  const Dims s = check(qt, kt, vt, pos, g);
  TORCH_CHECK(dy.is_contiguous() && dy.size(0) == s.b && dy.size(1) == s.lq * s.nh && dy.size(2) == s.c &&
                  dy.scalar_type() == qt.scalar_type(),
              "gated_attention: dy must be contiguous [B, Lq*heads, C] of the inputs' dtype");
  auto opt = vt.options();
  at::Tensor dqt = dqt_out ? *dqt_out : at::empty_like(qt), dkt = dkt_out ? *dkt_out : at::empty_like(kt);
  TORCH_CHECK(dqt.sizes() == qt.sizes() && dkt.sizes() == kt.sizes() && dqt.scalar_type() == qt.scalar_type() &&
                  dkt.scalar_type() == kt.scalar_type() && dqt.device().is_cpu() && dkt.device().is_cpu(),
              "gated_attention: dqt, dkt must be CPU tensors shaped like qt, kt");
  const bool cl = vt.stride(1) == 1 && s.c > 1;
  at::Tensor dvt = cl ? at::empty({s.b, s.lk, s.c}, opt).transpose(1, 2) : at::empty({s.b, s.c, s.lk}, opt);
  const int64_t nblk = std::min(s.b, kBlocks), map = s.lq * s.nh * s.lk;
  at::Tensor dpos_blk = at::empty({nblk, map}, opt), dg_blk = at::empty({nblk, s.nh}, opt);  // all written
  AT_DISPATCH_FLOATING_TYPES(qt.scalar_type(), "gated_attention_backward", [&] {
    backward_images<scalar_t>(dy, qt, kt, vt, pos, g, static_cast<scalar_t>(scale), s, dqt, dkt, dvt, dpos_blk,
                              dg_blk, nblk);
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
  m.def("backward", &backward, "(dQ^T, dK^T, dX^T, dPos, dg), the maps recomputed", py::arg("dy"), py::arg("qt"),
        py::arg("kt"), py::arg("vt"), py::arg("pos"), py::arg("g"), py::arg("scale"), py::arg("dqt") = py::none(),
        py::arg("dkt") = py::none());
}
