// AVX-512 math shared by avx512.cpp and amx.cpp: exp2 and tanh of 16 floats. Included inside each
// file's anonymous namespace under its ISA pragma.

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
