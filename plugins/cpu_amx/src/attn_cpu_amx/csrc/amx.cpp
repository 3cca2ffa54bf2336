// AMX path (bf16 q and K/V): both matrix products on AMX tiles (TDPBF16PS, float32 accumulation), the
// softmax on AVX-512. Needs AMX-TILE, AMX-BF16, AVX512-BF16 and the Linux permission for tile data
// (requested by the dispatcher before the first call).
//
// Every tile is 16 rows x 64 bytes: tmm0-3 accumulators (2x2), tmm4-5 A operands, tmm6-7 B operands.
// Per block of BK keys, staged once for all row groups of the item:
//   K^T in VNNI pairs kt [D/2, BK, 2] (16x16 transposes of 32-bit dim pairs), V in VNNI pairs
//   vp [BK/2, Dv, 2] (16-bit interleave of key pairs).
// Per group of up to MG rows (q rows packed once per item as qa [rows, D]):
//   s [MG, BK] = Q K^T on tiles; row-wise softmax into P (bf16) with a lazy max; rows whose max moved
//   are rescaled; o += P V on tiles loaded from and stored to o.
#include <cmath>
#include <cstring>

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace attn_cpu {
namespace {

#include "loop.h"
#include "avx512_math.h"

// In-place transpose of 16 rows of 16 floats.
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  // u[4i + c] lane L holds column 4L + c of rows 4i .. 4i+3
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);
    const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// Lanes lo .. hi-1 of 16 (clamped).
inline __mmask16 lane_range(int lo, int hi) {
  lo = lo < 0 ? 0 : (lo > 16 ? 16 : lo);
  hi = hi < 0 ? 0 : (hi > 16 ? 16 : hi);
  if (lo >= hi) return 0;
  const uint32_t upto = hi == 16 ? 0xFFFFu : ((1u << hi) - 1u);
  return static_cast<__mmask16>(upto & ~((1u << lo) - 1u));
}
alignas(64) const uint16_t kZeroBf16[kMaxHeadDim] = {};

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// One 2x2 (or smaller) block of tile products: C[i][j] (+)= sum over k chunks of A_i[k] x B_j[k].
// C[i][j] lives in tmm(2i + j), A_i in tmm(4 + i), B_j in tmm(6 + j), so every operand load targets a
// register the previous products no longer read. A_i of chunk k is at a[i] + k * a_step (elements), B_j
// at b[j] + k * b_step; strides are in bytes. LOAD_C: start from C in memory, else from zero.
template <int NA, int NB, bool LOAD_C>
inline void tile_block(const uint16_t* const a[2], int a_stride, int64_t a_step, const uint16_t* const b[2], int b_stride, int64_t b_step,
                       int chunks, float* const c[2][2], int c_stride) {
  if constexpr (LOAD_C) {
    _tile_loadd(0, c[0][0], c_stride);
    if constexpr (NB == 2) _tile_loadd(1, c[0][1], c_stride);
    if constexpr (NA == 2) _tile_loadd(2, c[1][0], c_stride);
    if constexpr (NA == 2 && NB == 2) _tile_loadd(3, c[1][1], c_stride);
  } else {
    _tile_zero(0);
    if constexpr (NB == 2) _tile_zero(1);
    if constexpr (NA == 2) _tile_zero(2);
    if constexpr (NA == 2 && NB == 2) _tile_zero(3);
  }
  for (int k = 0; k < chunks; ++k) {
    _tile_loadd(4, a[0] + k * a_step, a_stride);
    _tile_loadd(6, b[0] + k * b_step, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, b[1] + k * b_step, b_stride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NA == 2) {
      _tile_loadd(5, a[1] + k * a_step, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c[0][0], c_stride);
  if constexpr (NB == 2) _tile_stored(1, c[0][1], c_stride);
  if constexpr (NA == 2) _tile_stored(2, c[1][0], c_stride);
  if constexpr (NA == 2 && NB == 2) _tile_stored(3, c[1][1], c_stride);
}

template <bool LOAD_C>
inline void tile_block_any(int na, int nb, const uint16_t* const a[2], int a_stride, int64_t a_step, const uint16_t* const b[2], int b_stride,
                           int64_t b_step, int chunks, float* const c[2][2], int c_stride) {
  if (na == 2 && nb == 2) tile_block<2, 2, LOAD_C>(a, a_stride, a_step, b, b_stride, b_step, chunks, c, c_stride);
  else if (na == 2) tile_block<2, 1, LOAD_C>(a, a_stride, a_step, b, b_stride, b_step, chunks, c, c_stride);
  else if (nb == 2) tile_block<1, 2, LOAD_C>(a, a_stride, a_step, b, b_stride, b_step, chunks, c, c_stride);
  else tile_block<1, 1, LOAD_C>(a, a_stride, a_step, b, b_stride, b_step, chunks, c, c_stride);
}

// P may grow to 2^8 before a row's max (and its output) is rescaled: bf16 keeps 8 exponent bits.
constexpr float kLazyRescale = 8.f;

// 2^y for y <= kLazyRescale (no overflow check), relative error ~1e-7 (degree-6 Taylor of 2^f on
// |f| <= 1/2). Below -126 the result is ~0; callers mask exact zeros.
inline __m512 exp2_small(__m512 y) {
  y = _mm512_max_ps(_mm512_set1_ps(-126.f), y);
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 r = _mm512_set1_ps(0.00015403530393381606f);
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.0013333558146428441f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.009618129107628477f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.055504108664821576f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.2402265069591007f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.6931471805599453f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(r, n);
}

// Row-wise online softmax of a group's scores s [MP, BK] into P (bf16, pb [MP, BK]): scale by `pre`,
// cap, mask (rows' key ranges and custom-mask bytes unless `full`). A row keeps its max mx while the
// block's scores stay below mx + kLazyRescale (one vector compare, no reduction); only when they do
// not (or on the row's first block) is the block max taken and alpha = 2^(mx_old - mx_new) set.
// Row sums accumulate lane-wise in lsum [rows, 16] (reduced by `finish`). Padding rows get P = 0.
template <int BK>
inline void softmax_rows(const float* s, uint16_t* pb, float* lsum, Work& w, int r0, int M, int MP, bool full, float pre, float cap) {
  constexpr int NV = BK / 16;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512 vpre = _mm512_set1_ps(pre);
  const __m512 vlazy = _mm512_set1_ps(kLazyRescale);
  const bool use_cap = cap > 0.f;
  const __m512 inv_cap = _mm512_set1_ps(use_cap ? 1.f / cap : 0.f);
  const __m512 cap_l2e = _mm512_set1_ps(cap * kLog2e);
  for (int m = 0; m < M; ++m) {
    const int r = r0 + m;
    __m512 x[NV];
    __mmask16 km[NV];
    if (full) {
      for (int v = 0; v < NV; ++v) km[v] = 0xFFFF;
    } else {
      int rlo, rhi;
      row_range(w, r, BK, &rlo, &rhi);
      const uint8_t* mr = w.mrows[r] != nullptr ? w.mrows[r] + w.b0 : nullptr;
      for (int v = 0; v < NV; ++v) {
        km[v] = lane_range(rlo - 16 * v, rhi - 16 * v);
        if (mr != nullptr && km[v]) {
          const __m128i bytes = _mm_maskz_loadu_epi8(km[v], mr + 16 * v);
          km[v] &= _mm_test_epi8_mask(bytes, bytes);
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      x[v] = _mm512_mul_ps(_mm512_loadu_ps(s + m * BK + 16 * v), vpre);
      if (use_cap) x[v] = _mm512_mul_ps(cap_l2e, tanh_ps(_mm512_mul_ps(x[v], inv_cap)));
      if (!full) x[v] = _mm512_mask_mov_ps(ninf, km[v], x[v]);
    }
    const float mold = w.mx[r];
    __m512 vm = _mm512_set1_ps(mold);
    __mmask16 grow = 0;
    for (int v = 0; v < NV; ++v) grow |= _mm512_cmp_ps_mask(_mm512_sub_ps(x[v], vm), vlazy, _CMP_GT_OQ);
    float alpha = 1.f;
    if (grow || mold == -INFINITY) {
      __m512 bmax = ninf;
      for (int v = 0; v < NV; ++v) bmax = _mm512_max_ps(bmax, x[v]);
      const float rmax = _mm512_reduce_max_ps(bmax);
      const float mnew = rmax > mold ? rmax : mold;
      alpha = mold == -INFINITY ? 0.f : std::exp2(mold - mnew);
      w.mx[r] = mnew;
      vm = _mm512_set1_ps(mnew == -INFINITY ? 0.f : mnew);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < NV; ++v) {
      __m512 pv = exp2_small(_mm512_sub_ps(x[v], vm));
      if (!full) pv = _mm512_maskz_mov_ps(km[v], pv);
      sum = _mm512_add_ps(sum, pv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + m * BK + 16 * v), (__m256i)_mm512_cvtneps_pbh(pv));
    }
    float* ls = lsum + static_cast<int64_t>(r) * 16;
    const __m512 old = _mm512_loadu_ps(ls);
    _mm512_storeu_ps(ls, alpha == 1.f ? _mm512_add_ps(old, sum) : _mm512_fmadd_ps(old, _mm512_set1_ps(alpha), sum));
    w.alpha[r] = alpha;
  }
  for (int m = M; m < MP; ++m)
    for (int v = 0; v < NV; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + m * BK + 16 * v), _mm256_setzero_si256());
}

struct AmxOps {
  static constexpr int BK = 64;
  static constexpr int MG = 64;
  static constexpr bool kVis = false;

  struct Ext {
    uint16_t* qa;  // [kMaxRows, D] q rows (zero rows after the item's)
    uint16_t* kt;  // [D/2, BK, 2] K^T in VNNI pairs: kt[i, j, e] = K[j, 2i + e]
    uint16_t* vp;  // [BK/2, Dv, 2] V in VNNI pairs: vp[i, c, e] = V[2i + e, c]
    float* s;      // [MG, BK] scores of a group
    uint16_t* pb;  // [MG, BK] P of a group
    float* lsum;   // [kMaxRows, 16] lane-wise row sums
  };
  static size_t extra_bytes(const Params& p) {
    return align64(static_cast<size_t>(kMaxRows) * p.d * 2) + align64(static_cast<size_t>(BK) * p.d * 2) +
           align64(static_cast<size_t>(BK) * p.dv * 2) + align64(MG * BK * 4) + align64(MG * BK * 2) + align64(kMaxRows * 16 * 4);
  }
  static Ext ext(const Params& p, Work& w) {
    Ext e;
    char* s = w.extra;
    e.qa = reinterpret_cast<uint16_t*>(s);
    s += align64(static_cast<size_t>(kMaxRows) * p.d * 2);
    e.kt = reinterpret_cast<uint16_t*>(s);
    s += align64(static_cast<size_t>(BK) * p.d * 2);
    e.vp = reinterpret_cast<uint16_t*>(s);
    s += align64(static_cast<size_t>(BK) * p.dv * 2);
    e.s = reinterpret_cast<float*>(s);
    s += align64(MG * BK * 4);
    e.pb = reinterpret_cast<uint16_t*>(s);
    s += align64(MG * BK * 2);
    e.lsum = reinterpret_cast<float*>(s);
    return e;
  }

  static void thread_begin() {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) {
      cfg.colsb[i] = 64;
      cfg.rows[i] = 16;
    }
    _tile_loadconfig(&cfg);
  }
  static void thread_end() { _tile_release(); }

  static void load_q(const Params& p, Work& w) {
    const Ext e = ext(p, w);
    const int D = p.d, R = w.rows, RP = (R + 15) & ~15;
    for (int m = 0; m < R; ++m) std::memcpy(e.qa + static_cast<int64_t>(m) * D, w.qrows[m], static_cast<size_t>(D) * 2);
    for (int m = R; m < RP; ++m) std::memset(e.qa + static_cast<int64_t>(m) * D, 0, static_cast<size_t>(D) * 2);
    std::memset(e.lsum, 0, static_cast<size_t>(R) * 16 * 4);
  }

  // Row sums: w.l = the lanes of lsum.
  static void finish(const Params& p, Work& w) {
    const Ext e = ext(p, w);
    for (int m = 0; m < w.rows; ++m) w.l[m] = _mm512_reduce_add_ps(_mm512_loadu_ps(e.lsum + m * 16));
  }

  // K^T and V of the block in VNNI pairs (zeros for keys outside [ulo, uhi)).
  static void stage(const Params& p, Work& w, int ulo, int uhi) {
    const Ext e = ext(p, w);
    const int D = p.d, DV = p.dv;
    const uint16_t* kbase = static_cast<const uint16_t*>(p.k) + static_cast<int64_t>(w.h) * p.k_head_stride;
    const uint16_t* vbase = static_cast<const uint16_t*>(p.v) + static_cast<int64_t>(w.h) * p.v_head_stride;
    const int32_t* slots = w.slots;
    // 16 keys x 16 dim pairs at a time: a 16x16 transpose of 32-bit pairs
    for (int j0 = 0; j0 < BK; j0 += 16) {
      const uint16_t* rows[16];
      for (int i = 0; i < 16; ++i) {
        const int j = j0 + i;
        rows[i] = (j >= ulo && j < uhi) ? kbase + k_row(p, slots[j]) : kZeroBf16;
      }
      for (int c = 0; c < D; c += 32) {
        __m512 r16[16];
        for (int i = 0; i < 16; ++i) r16[i] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[i] + c));
        transpose16(r16);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(e.kt + (static_cast<int64_t>(c / 2 + i) * BK + j0) * 2, _mm512_castps_si512(r16[i]));
      }
    }
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34,
                                            2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22, 53, 21, 52, 20, 51,
                                            19, 50, 18, 49, 17, 48, 16);
    for (int r = 0; r < BK / 2; ++r) {
      const int j = 2 * r;
      uint16_t* dst = e.vp + static_cast<int64_t>(r) * DV * 2;
      const bool in0 = j >= ulo && j < uhi, in1 = j + 1 >= ulo && j + 1 < uhi;
      if (!in0 && !in1) {
        for (int c = 0; c < 2 * DV; c += 32) _mm512_storeu_si512(dst + c, _mm512_setzero_si512());
        continue;
      }
      const uint16_t* v0 = in0 ? vbase + v_row(p, slots[j]) : kZeroBf16;
      const uint16_t* v1 = in1 ? vbase + v_row(p, slots[j + 1]) : kZeroBf16;
      for (int c = 0; c < DV; c += 32) {
        const __m512i a = _mm512_loadu_si512(v0 + c);
        const __m512i b = _mm512_loadu_si512(v1 + c);
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
  }

  static void group(const Params& p, Work& w, int r0, int M, int ulo, int uhi, bool full) {
    (void)ulo;
    (void)uhi;
    const Ext e = ext(p, w);
    const int D = p.d, DV = p.dv;
    const int MP = (M + 15) & ~15, NT = MP / 16;
    // s = Q K^T: C (row tile, key tile), A = q rows, B = K^T pairs
    for (int t = 0; t < NT; t += 2) {
      const int na = t + 1 < NT ? 2 : 1;
      const uint16_t* a[2] = {e.qa + static_cast<int64_t>(r0 + t * 16) * D, e.qa + static_cast<int64_t>(r0 + (t + na - 1) * 16) * D};
      for (int kt = 0; kt < BK / 16; kt += 2) {
        const uint16_t* b[2] = {e.kt + kt * 32, e.kt + (kt + 1) * 32};
        float* c[2][2] = {{e.s + t * 16 * BK + kt * 16, e.s + t * 16 * BK + (kt + 1) * 16},
                          {e.s + (t + na - 1) * 16 * BK + kt * 16, e.s + (t + na - 1) * 16 * BK + (kt + 1) * 16}};
        tile_block_any<false>(na, 2, a, D * 2, 32, b, BK * 4, static_cast<int64_t>(32) * BK, D / 32, c, BK * 4);
      }
    }
    softmax_rows<BK>(e.s, e.pb, e.lsum, w, r0, M, MP, full, p.scale * (p.cap > 0.f ? 1.f : kLog2e), p.cap);
    // o = o * alpha (rows whose max moved), then o += P V on tiles loaded from and stored to o
    for (int m = 0; m < M; ++m) {
      const float al = w.alpha[r0 + m];
      if (al == 1.f) continue;
      const __m512 va = _mm512_set1_ps(al);
      float* o = w.o + static_cast<int64_t>(r0 + m) * DV;
      for (int c = 0; c < DV; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), va));
    }
    float* og = w.o + static_cast<int64_t>(r0) * DV;
    for (int t = 0; t < NT; t += 2) {
      const int na = t + 1 < NT ? 2 : 1;
      const uint16_t* a[2] = {e.pb + t * 16 * BK, e.pb + (t + na - 1) * 16 * BK};
      for (int n = 0; n < DV / 16; n += 2) {
        const int nb = n + 1 < DV / 16 ? 2 : 1;
        const uint16_t* b[2] = {e.vp + n * 32, e.vp + (n + nb - 1) * 32};
        float* c[2][2] = {{og + t * 16 * DV + n * 16, og + t * 16 * DV + (n + nb - 1) * 16},
                          {og + (t + na - 1) * 16 * DV + n * 16, og + (t + na - 1) * 16 * DV + (n + nb - 1) * 16}};
        tile_block_any<true>(na, nb, a, BK * 2, 32, b, DV * 4, static_cast<int64_t>(32) * DV, BK / 32, c, DV * 4);
      }
    }
  }
};

void run_amx(const Params& p, const Item* items, int64_t n, std::atomic<int64_t>* next, char* scratch) {
  run_items<AmxOps>(p, items, n, next, scratch);
}

size_t amx_scratch(const Params& p) { return scratch_bytes<AmxOps>(p); }

}  // namespace
}  // namespace attn_cpu

#pragma GCC pop_options

namespace attn_cpu {
bool amx_kernels(PathKernels* out) {
  out->block_keys = AmxOps::BK;
  out->group_rows = AmxOps::MG;
  out->scratch_bytes = &amx_scratch;
  out->run = &run_amx;
  return true;
}
}  // namespace attn_cpu

#else  // not x86-64: the path does not exist in this build

namespace attn_cpu {
bool amx_kernels(PathKernels*) { return false; }
}  // namespace attn_cpu

#endif
