// AVX-512 path: float32 math on 512-bit FMAs (AVX-512 F/BW/VL/DQ). bf16 K/V are widened per block.
//
// Per block of BK keys: K is staged as kb [D/16, BK, 16] floats (16-dim chunks of every key side by
// side, so every load has an immediate offset), then scores go to st [BK, MP] (key-major):
//  - few rows (M <= 8, decode): dot products of 2 rows x 8 keys at a time, lanes summed by hsum16;
//  - more rows: q is held transposed (qt [D, MP]) and each key's element is broadcast against 16 rows.
// The online softmax runs on st; then o[m] = o[m] * alpha[m] + sum_j P[j, m] V[j] with V rows read in
// place (float32) or widened into vf (bf16).
#include <cmath>
#include <cstring>

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")

namespace attn_cpu {
namespace {

#include "loop.h"
#include "avx512_math.h"

// 16 bf16 -> 16 float32
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Horizontal sums of 16 vectors: element j of the result is the sum of the lanes of a[j].
inline __m512 hsum16(const __m512 a[16]) {
  __m512 s[8], t[4];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88), _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  // t[i] 128-bit lane L holds 4 partial sums of a[4i + L]
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(t[0], t[1]), _mm512_unpackhi_ps(t[0], t[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(t[2], t[3]), _mm512_unpackhi_ps(t[2], t[3]));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
  // element 4L + e of w is the sum of a[4e + L]; put a[j]'s sum at element j
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, w);
}

// Online-softmax update of a row group's scores st [BK, MP] (key-major, rows vectorized; group row m is
// item row r0 + m). Scores are multiplied by `pre`, capped (cap > 0: cap * tanh(s / cap), in log2
// units), masked by w.vis unless `full`; st becomes P = 2^(s - mx_new) for keys [ulo, uhi);
// w.alpha gets 2^(mx_old - mx_new), w.l and w.mx are updated. Padding rows (m >= M) get P = 0.
// w.vis rows are vis_stride words apart (MG / 16 of the path).
inline void softmax_cols(float* st, Work& w, int r0, int M, int MP, int vis_stride, int ulo, int uhi, bool full, float pre, float cap) {
  const int NV = MP / 16;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512 vpre = _mm512_set1_ps(pre);
  const bool use_cap = cap > 0.f;
  const __m512 inv_cap = _mm512_set1_ps(use_cap ? 1.f / cap : 0.f);
  const __m512 cap_l2e = _mm512_set1_ps(cap * kLog2e);
  for (int nv = 0; nv < NV; ++nv) {
    const int valid = M - nv * 16;
    const __mmask16 rows = valid >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1u);
    const bool masked = !full || rows != 0xFFFF;
    __m512 bmax = ninf;
    for (int j = ulo; j < uhi; ++j) {
      float* sp = st + j * MP + nv * 16;
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sp), vpre);
      if (use_cap) s = _mm512_mul_ps(cap_l2e, tanh_ps(_mm512_mul_ps(s, inv_cap)));
      if (masked) s = _mm512_mask_mov_ps(ninf, (full ? rows : static_cast<__mmask16>(w.vis[j * vis_stride + nv] & rows)), s);
      _mm512_storeu_ps(sp, s);
      bmax = _mm512_max_ps(bmax, s);
    }
    float* mxp = w.mx + r0 + nv * 16;
    float* lp = w.l + r0 + nv * 16;
    float* ap = w.alpha + r0 + nv * 16;
    const __m512 mold = _mm512_maskz_loadu_ps(rows, mxp);
    const __m512 mnew = _mm512_max_ps(_mm512_mask_mov_ps(ninf, rows, mold), bmax);
    const __m512 safe = _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __mmask16 old_finite = _mm512_cmp_ps_mask(mold, ninf, _CMP_NEQ_UQ) & rows;
    const __m512 alpha = _mm512_maskz_mov_ps(old_finite, exp2_ps(_mm512_sub_ps(mold, safe)));
    __m512 sum = _mm512_setzero_ps();
    for (int j = ulo; j < uhi; ++j) {
      float* sp = st + j * MP + nv * 16;
      __m512 pj = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(sp), safe));
      if (masked) pj = _mm512_maskz_mov_ps((full ? rows : static_cast<__mmask16>(w.vis[j * vis_stride + nv] & rows)), pj);
      _mm512_storeu_ps(sp, pj);
      sum = _mm512_add_ps(sum, pj);
    }
    _mm512_mask_storeu_ps(lp, rows, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rows, lp), alpha, sum));
    _mm512_mask_storeu_ps(mxp, rows, mnew);
    _mm512_mask_storeu_ps(ap, rows, alpha);
  }
}

alignas(64) const float kZeroRow[kMaxHeadDim] = {};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_float(*p); }

// st[j, 0 .. 16*NV) = sum_d qt[d, .] kb[d, j] for keys [ulo, uhi) (qt rows of qstride floats).
template <int NV>
inline void qk_rows_t(const float* qt, int qstride, const float* kb, int BK, int D, float* st, int MP, int ulo, int uhi) {
  constexpr int KB = NV == 1 ? 16 : NV == 2 ? 8 : 4;
  for (int j0 = (ulo / KB) * KB; j0 < uhi; j0 += KB) {
    __m512 acc[KB][NV];
    for (int kk = 0; kk < KB; ++kk)
      for (int v = 0; v < NV; ++v) acc[kk][v] = _mm512_setzero_ps();
    for (int c = 0; c < D; c += 16) {
      const float* kc = kb + static_cast<int64_t>(c) * BK + j0 * 16;
#pragma GCC unroll 16
      for (int dd = 0; dd < 16; ++dd) {
        __m512 q[NV];
        for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qt + (c + dd) * qstride + 16 * v);
        for (int kk = 0; kk < KB; ++kk) {
          const __m512 kv = _mm512_set1_ps(kc[kk * 16 + dd]);
          for (int v = 0; v < NV; ++v) acc[kk][v] = _mm512_fmadd_ps(q[v], kv, acc[kk][v]);
        }
      }
    }
    for (int kk = 0; kk < KB; ++kk)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(st + (j0 + kk) * MP + 16 * v, acc[kk][v]);
  }
}

// Scores of rows m0, m0+1 (q rows of D floats, the second may be the first again) for 8 keys j0.. .
inline void qk_dot_2x8(const float* q0, const float* q1, const float* kb, int BK, int D, int j0, float* out16) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 16) {
    const __m512 a = _mm512_loadu_ps(q0 + c);
    const __m512 b = _mm512_loadu_ps(q1 + c);
    const float* kc = kb + static_cast<int64_t>(c) * BK + j0 * 16;
#pragma GCC unroll 8
    for (int kk = 0; kk < 8; ++kk) {
      const __m512 kv = _mm512_loadu_ps(kc + kk * 16);
      acc[kk] = _mm512_fmadd_ps(a, kv, acc[kk]);
      acc[8 + kk] = _mm512_fmadd_ps(b, kv, acc[8 + kk]);
    }
  }
  _mm512_storeu_ps(out16, hsum16(acc));
}

// o[r, dc ..] = o[r, dc ..] * alpha[r] + sum_j pt[j, r] V[j, dc ..] for rows r < nr (<= 4), 16*NZ channels.
template <int NZ>
inline void pv_tile(float* o, int DV, int nr, const float* alpha, const float* pt, int MP, const float* const* vrow, int dc, int ulo, int uhi) {
  __m512 acc[4][NZ];
  for (int r = 0; r < 4; ++r) {
    const __m512 a = _mm512_set1_ps(r < nr ? alpha[r] : 0.f);
    for (int z = 0; z < NZ; ++z) acc[r][z] = r < nr ? _mm512_mul_ps(_mm512_loadu_ps(o + r * DV + 16 * z), a) : _mm512_setzero_ps();
  }
  for (int j = ulo; j < uhi; ++j) {
    const float* vp = vrow[j] + dc;
    __m512 v[NZ];
    for (int z = 0; z < NZ; ++z) v[z] = _mm512_loadu_ps(vp + 16 * z);
    const float* pp = pt + j * MP;
    for (int r = 0; r < 4; ++r) {
      const __m512 pr = _mm512_set1_ps(pp[r]);
      for (int z = 0; z < NZ; ++z) acc[r][z] = _mm512_fmadd_ps(v[z], pr, acc[r][z]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(o + r * DV + 16 * z, acc[r][z]);
}

template <typename TQ, typename TKV>
struct Avx512Ops {
  static constexpr int BK = 32;
  static constexpr int MG = 32;
  static constexpr bool kVis = true;
  static constexpr int kDotRows = 8;  // items with at most this many rows (decode) use the dot-product form

  struct Ext {
    float* q;  // dot form: [R, D]; else per group g: [D, MG] at q + g * D * MG (scaled, zero-padded)
    float* st;  // [BK, MG]
    float* kb;  // [D/16, BK, 16]
    float* vf;  // [BK, Dv] widened bf16 V
    const float** vrow;  // [BK]
  };
  static size_t extra_bytes(const Params& p) {
    return align64(static_cast<size_t>(kMaxRows) * p.d * 4) + align64(BK * MG * 4) + align64(static_cast<size_t>(BK) * p.d * 4) +
           align64(static_cast<size_t>(BK) * p.dv * 4) + align64(BK * sizeof(void*));
  }
  static Ext ext(const Params& p, Work& w) {
    Ext e;
    char* s = w.extra;
    e.q = reinterpret_cast<float*>(s);
    s += align64(static_cast<size_t>(kMaxRows) * p.d * 4);
    e.st = reinterpret_cast<float*>(s);
    s += align64(BK * MG * 4);
    e.kb = reinterpret_cast<float*>(s);
    s += align64(static_cast<size_t>(BK) * p.d * 4);
    e.vf = reinterpret_cast<float*>(s);
    s += align64(static_cast<size_t>(BK) * p.dv * 4);
    e.vrow = reinterpret_cast<const float**>(s);
    return e;
  }

  static void thread_begin() {}
  static void thread_end() {}
  static void finish(const Params&, Work&) {}

  static void load_q(const Params& p, Work& w) {
    const Ext e = ext(p, w);
    const float mult = p.scale * (p.cap > 0.f ? 1.f : kLog2e);
    const __m512 vm = _mm512_set1_ps(mult);
    const int D = p.d, R = w.rows;
    if (R <= kDotRows) {
      for (int m = 0; m < R; ++m) {
        const TQ* src = static_cast<const TQ*>(w.qrows[m]);
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(e.q + m * D + c, _mm512_mul_ps(load16(src + c), vm));
      }
      return;
    }
    for (int r0 = 0; r0 < R; r0 += MG) {
      float* qt = e.q + static_cast<int64_t>(r0) * D;  // group r0 / MG, [D, MG]
      for (int i = 0; i < D * MG; i += 16) _mm512_storeu_ps(qt + i, _mm512_setzero_ps());
      for (int m = 0; m < MG && r0 + m < R; ++m) {
        const TQ* src = static_cast<const TQ*>(w.qrows[r0 + m]);
        for (int i = 0; i < D; ++i) qt[i * MG + m] = load1(src + i) * mult;
      }
    }
  }

  // K as kb [D/16, BK, 16] (zeros outside [ulo, uhi) in the 16-key groups touched), V rows in place
  // (float32) or widened into vf (bf16).
  static void stage(const Params& p, Work& w, int ulo, int uhi) {
    const Ext e = ext(p, w);
    const int D = p.d, DV = p.dv;
    const TKV* kbase = static_cast<const TKV*>(p.k) + static_cast<int64_t>(w.h) * p.k_head_stride;
    const TKV* vbase = static_cast<const TKV*>(p.v) + static_cast<int64_t>(w.h) * p.v_head_stride;
    for (int j = ulo & ~15; j < ((uhi + 15) & ~15); ++j) {
      float* dst = e.kb + j * 16;
      if (j < ulo || j >= uhi) {
        for (int c = 0; c < D; c += 16) _mm512_storeu_ps(dst + static_cast<int64_t>(c) * BK, _mm512_setzero_ps());
        continue;
      }
      const TKV* kr = kbase + k_row(p, w.slots[j]);
      for (int c = 0; c < D; c += 16) _mm512_storeu_ps(dst + static_cast<int64_t>(c) * BK, load16(kr + c));
    }
    for (int j = ulo; j < uhi; ++j) {
      const TKV* vr = vbase + v_row(p, w.slots[j]);
      if constexpr (sizeof(TKV) == 4) {
        e.vrow[j] = reinterpret_cast<const float*>(vr);
      } else {
        float* dst = e.vf + static_cast<int64_t>(j) * DV;
        for (int c = 0; c < DV; c += 16) _mm512_storeu_ps(dst + c, load16(vr + c));
        e.vrow[j] = dst;
      }
    }
  }

  static void group(const Params& p, Work& w, int r0, int M, int ulo, int uhi, bool full) {
    const Ext e = ext(p, w);
    const int D = p.d, DV = p.dv;
    const int MP = (M + 15) & ~15;
    if (w.rows <= kDotRows) {
      alignas(64) float tmp[16];
      for (int m = 0; m < M; m += 2) {
        const int m1 = m + 1 < M ? m + 1 : m;
        const float* q0 = e.q + m * D;
        const float* q1 = e.q + m1 * D;
        for (int j0 = ulo & ~7; j0 < uhi; j0 += 8) {
          qk_dot_2x8(q0, q1, e.kb, BK, D, j0, tmp);
          for (int kk = 0; kk < 8; ++kk) {
            e.st[(j0 + kk) * MP + m] = tmp[kk];
            e.st[(j0 + kk) * MP + m1] = tmp[8 + kk];
          }
        }
      }
    } else {
      const float* qt = e.q + static_cast<int64_t>(r0) * D;
      if (MP == 16) qk_rows_t<1>(qt, MG, e.kb, BK, D, e.st, MP, ulo, uhi);
      else qk_rows_t<2>(qt, MG, e.kb, BK, D, e.st, MP, ulo, uhi);
    }
    softmax_cols(e.st, w, r0, M, MP, MG / 16, ulo, uhi, full, 1.f, p.cap);
    // o = o * alpha + P V, 4 rows x 64 channels at a time
    for (int m0 = 0; m0 < M; m0 += 4) {
      float* o = w.o + static_cast<int64_t>(r0 + m0) * DV;
      const int nr = imin(4, M - m0);
      for (int dc = 0; dc < DV; dc += 64) {
        const int nz = (DV - dc) >= 64 ? 4 : (DV - dc) / 16;
        const float* pt = e.st + m0;
        const float* al = w.alpha + r0 + m0;
        if (nz == 4) pv_tile<4>(o + dc, DV, nr, al, pt, MP, e.vrow, dc, ulo, uhi);
        else if (nz == 3) pv_tile<3>(o + dc, DV, nr, al, pt, MP, e.vrow, dc, ulo, uhi);
        else if (nz == 2) pv_tile<2>(o + dc, DV, nr, al, pt, MP, e.vrow, dc, ulo, uhi);
        else pv_tile<1>(o + dc, DV, nr, al, pt, MP, e.vrow, dc, ulo, uhi);
      }
    }
  }
};

template <typename TQ, typename TKV>
void run_typed(const Params& p, const Item* items, int64_t n, std::atomic<int64_t>* next, char* scratch) {
  run_items<Avx512Ops<TQ, TKV>>(p, items, n, next, scratch);
}

void run_avx512(const Params& p, const Item* items, int64_t n, std::atomic<int64_t>* next, char* scratch) {
  if (p.q_dtype == DType::F32) {
    if (p.kv_dtype == DType::F32) return run_typed<float, float>(p, items, n, next, scratch);
    return run_typed<float, uint16_t>(p, items, n, next, scratch);
  }
  if (p.kv_dtype == DType::F32) return run_typed<uint16_t, float>(p, items, n, next, scratch);
  return run_typed<uint16_t, uint16_t>(p, items, n, next, scratch);
}

size_t avx512_scratch(const Params& p) { return scratch_bytes<Avx512Ops<float, float>>(p); }

}  // namespace
}  // namespace attn_cpu

#pragma GCC pop_options

namespace attn_cpu {
bool avx512_kernels(PathKernels* out) {
  out->block_keys = Avx512Ops<float, float>::BK;
  out->group_rows = Avx512Ops<float, float>::MG;
  out->scratch_bytes = &avx512_scratch;
  out->run = &run_avx512;
  return true;
}
}  // namespace attn_cpu

#else  // not x86-64: the path does not exist in this build

namespace attn_cpu {
bool avx512_kernels(PathKernels*) { return false; }
}  // namespace attn_cpu

#endif
