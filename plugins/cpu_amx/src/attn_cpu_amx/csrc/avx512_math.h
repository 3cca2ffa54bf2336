// AVX-512 helpers shared by avx512.cpp and amx.cpp: exp2, tanh, bf16 loads, a 16x16 transpose, the
// 16-way horizontal sum and the online-softmax update of a score block. Included inside each file's
// anonymous namespace under its ISA pragma, after loop.h (it uses Work).

// 2^x with relative error ~1e-8 (degree-7 Taylor of 2^f on |f| <= 1/2, then scalef). Inputs below -127
// give ~0 (callers mask exact zeros); NaN propagates.
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-127.f), x);  // (const, x): NaN in x propagates
  x = _mm512_min_ps(_mm512_set1_ps(127.f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 r = _mm512_set1_ps(1.5252733804059838e-05f);
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.00015403530393381606f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.0013333558146428441f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.009618129107628477f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.055504108664821576f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.2402265069591007f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(0.6931471805599453f));
  r = _mm512_fmadd_ps(r, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(r, n);
}

// tanh with relative error ~1e-7: odd Taylor series to x^15 below |x| = 1/2, (1 - t) / (1 + t) with
// t = e^(-2|x|) above.
inline __m512 tanh_ps(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512 a = _mm512_andnot_ps(sign, x);
  const __m512 t = exp2_ps(_mm512_mul_ps(a, _mm512_set1_ps(-2.f * kLog2e)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));
  const __m512 x2 = _mm512_mul_ps(a, a);
  __m512 r = _mm512_set1_ps(-0.0014558343870513183f);
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(0.003592128036572481f));
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(-0.008863235529902197f));
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(0.021869488536155203f));
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(-0.05396825396825397f));
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(0.13333333333333333f));
  r = _mm512_fmadd_ps(r, x2, _mm512_set1_ps(-0.3333333333333333f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, x2), r, a);
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.5f), _CMP_LT_OQ);
  const __m512 y = _mm512_mask_mov_ps(big, is_small, small);
  return _mm512_or_ps(y, _mm512_and_ps(sign, x));
}

// 16 bf16 -> 16 float32
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

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

// New running max of a row: the block max, but with lazy > 0 only when it exceeds the old max by more
// than `lazy` (P then stays <= 2^lazy and alpha is exactly 1 for most blocks).
inline __m512 next_max(__m512 mold, __m512 bmax, float lazy) {
  if (lazy > 0.f) {
    const __mmask16 grow = _mm512_cmp_ps_mask(bmax, _mm512_add_ps(mold, _mm512_set1_ps(lazy)), _CMP_GT_OQ);
    return _mm512_mask_mov_ps(mold, grow, bmax);
  }
  return _mm512_max_ps(mold, bmax);
}

// Online-softmax update of a row group's scores st [BK, MP] (key-major, rows vectorized; group row m is
// item row r0 + m). Scores are multiplied by `pre`, capped (cap > 0: cap * tanh(s / cap), in log2
// units), masked by w.vis unless `full`; st becomes P = 2^(s - mx_new) for keys [ulo, uhi);
// w.alpha gets 2^(mx_old - mx_new), w.l and w.mx are updated. Padding rows (m >= M) get P = 0.
// w.vis rows are vis_stride words apart (MG / 16 of the path).
inline void softmax_cols(float* st, Work& w, int r0, int M, int MP, int vis_stride, int ulo, int uhi, bool full, float pre, float cap,
                         float lazy) {
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
    const __m512 mnew = next_max(_mm512_mask_mov_ps(ninf, rows, mold), bmax, lazy);
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

// Lanes lo .. hi-1 of 16 (clamped).
inline __mmask16 lane_range(int lo, int hi) {
  lo = lo < 0 ? 0 : (lo > 16 ? 16 : lo);
  hi = hi < 0 ? 0 : (hi > 16 ? 16 : hi);
  if (lo >= hi) return 0;
  const uint32_t upto = hi == 16 ? 0xFFFFu : ((1u << hi) - 1u);
  return static_cast<__mmask16>(upto & ~((1u << lo) - 1u));
}
