// AMX path (bf16 q and K/V): both matrix products on AMX tiles (TDPBF16PS, float32 accumulation), the
// softmax on AVX-512. Needs AMX-TILE, AMX-BF16, AVX512-BF16 and the Linux permission for tile data
// (requested by the dispatcher before the first call).
//
// Every tile is 16 rows x 64 bytes: tmm0-3 accumulators, tmm4 the A operand, tmm5-7 B operands.
// Per block of BK keys and an item of MP rows (MP/16 row tiles):
//   scores  st^T: C[16 keys, 16 rows] += K[16 keys, 32 dims] x Q^T  (K tiles are loaded straight from
//           the pool when 16 keys sit in consecutive slots, else gathered; q is packed once per item
//           as qp [D/2, MP, 2], the VNNI layout of Q^T)
//   softmax on st [BK, MP] (AVX-512), P transposed into pb [MP, BK] bf16
//   output  ob[16 rows, 16 ch] = P[16 rows, 32 keys] x V (V packed per block as vp [BK/2, Dv, 2]),
//           then o = o * alpha + ob.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

namespace attn_cpu {
namespace {

#include "loop.h"
#include "avx512_math.h"

alignas(64) const uint16_t kZeroBf16[kMaxHeadDim] = {};

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// C[t] += A x B for the B tile of row tile t; B registers rotate over tmm5-7.
template <int T>
inline void dp_acc() {
  if constexpr (T == 0) _tile_dpbf16ps(0, 4, 5);
  else if constexpr (T == 1) _tile_dpbf16ps(1, 4, 6);
  else if constexpr (T == 2) _tile_dpbf16ps(2, 4, 7);
  else _tile_dpbf16ps(3, 4, 5);
}
template <int T>
inline void load_b(const void* p, int stride) {
  if constexpr (T == 0 || T == 3) _tile_loadd(5, p, stride);
  else if constexpr (T == 1) _tile_loadd(6, p, stride);
  else _tile_loadd(7, p, stride);
}
template <int T>
inline void zero_c() {
  if constexpr (T == 0) _tile_zero(0);
  else if constexpr (T == 1) _tile_zero(1);
  else if constexpr (T == 2) _tile_zero(2);
  else _tile_zero(3);
}
template <int T>
inline void store_c(void* p, int stride) {
  if constexpr (T == 0) _tile_stored(0, p, stride);
  else if constexpr (T == 1) _tile_stored(1, p, stride);
  else if constexpr (T == 2) _tile_stored(2, p, stride);
  else _tile_stored(3, p, stride);
}

template <int N, typename F>
inline void static_for(F&& f) {
  if constexpr (N > 0) {
    static_for<N - 1>(f);
    f(std::integral_constant<int, N - 1>{});
  }
}

// st rows of 16 keys: st[key, t*16 + n] = sum_d K[key, d] Q[t*16 + n, d] for NT row tiles.
template <int NT>
inline void qk_tile(const uint16_t* a, int a_stride, const uint16_t* qp, int MP, int D, float* st) {
  static_for<NT>([&](auto t) { zero_c<decltype(t)::value>(); });
  for (int c = 0; c < D / 32; ++c) {
    _tile_loadd(4, a + c * 32, a_stride);
    static_for<NT>([&](auto t) {
      constexpr int T = decltype(t)::value;
      load_b<T>(qp + (static_cast<int64_t>(c) * 16 * MP + T * 16) * 2, MP * 4);
      dp_acc<T>();
    });
  }
  static_for<NT>([&](auto t) { store_c<decltype(t)::value>(st + decltype(t)::value * 16, MP * 4); });
}

// ob[16 rows of row tile mt, ND x 16 channels from dv0] = P x V over BK keys.
template <int ND>
inline void pv_tile(const uint16_t* pb, int BK, int mt, const uint16_t* vp, int DV, int dv0, float* ob) {
  static_for<ND>([&](auto n) { zero_c<decltype(n)::value>(); });
  for (int kc = 0; kc < BK / 32; ++kc) {
    _tile_loadd(4, pb + static_cast<int64_t>(mt) * 16 * BK + kc * 32, BK * 2);
    static_for<ND>([&](auto n) {
      constexpr int N = decltype(n)::value;
      load_b<N>(vp + (static_cast<int64_t>(kc) * 16 * DV + dv0 + N * 16) * 2, DV * 4);
      dp_acc<N>();
    });
  }
  static_for<ND>([&](auto n) {
    constexpr int N = decltype(n)::value;
    store_c<N>(ob + static_cast<int64_t>(mt) * 16 * DV + dv0 + N * 16, DV * 4);
  });
}

struct AmxOps {
  static constexpr int BK = 64;
  static constexpr int MMAX = 64;

  struct Ext {
    uint16_t* qp;  // [D/2, MP, 2]
    float* st;     // [BK, MP]
    uint16_t* pb;  // [MP, BK]
    uint16_t* kg;  // [16, D] gathered keys
    uint16_t* vp;  // [BK/2, Dv, 2]
    float* ob;     // [MP, Dv]
  };
  static size_t extra_bytes(const Params& p) {
    return align64(static_cast<size_t>(p.d) * kMaxRows * 2) + align64(BK * kMaxRows * 4) + align64(kMaxRows * BK * 2) +
           align64(16 * static_cast<size_t>(p.d) * 2) + align64(static_cast<size_t>(BK) * p.dv * 2) +
           align64(static_cast<size_t>(kMaxRows) * p.dv * 4);
  }
  static Ext ext(const Params& p, Work& w) {
    Ext e;
    char* s = w.extra;
    e.qp = reinterpret_cast<uint16_t*>(s);
    s += align64(static_cast<size_t>(p.d) * kMaxRows * 2);
    e.st = reinterpret_cast<float*>(s);
    s += align64(BK * kMaxRows * 4);
    e.pb = reinterpret_cast<uint16_t*>(s);
    s += align64(kMaxRows * BK * 2);
    e.kg = reinterpret_cast<uint16_t*>(s);
    s += align64(16 * static_cast<size_t>(p.d) * 2);
    e.vp = reinterpret_cast<uint16_t*>(s);
    s += align64(static_cast<size_t>(BK) * p.dv * 2);
    e.ob = reinterpret_cast<float*>(s);
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

  static void load_q(const Params& p, Work& w, int M) {
    const Ext e = ext(p, w);
    const int MP = w.mp, half = p.d / 2;
    uint32_t* qp = reinterpret_cast<uint32_t*>(e.qp);
    for (int m = 0; m < MP; ++m) {
      if (m >= M) {
        for (int i = 0; i < half; ++i) qp[i * MP + m] = 0;
        continue;
      }
      const char* src = static_cast<const char*>(w.qrows[m]);
      for (int i = 0; i < half; ++i) {
        uint32_t pair;
        std::memcpy(&pair, src + 4 * i, 4);
        qp[i * MP + m] = pair;
      }
    }
  }

  static void block(const Params& p, Work& w, int M, int ulo, int uhi, bool full) {
    const Ext e = ext(p, w);
    const int MP = w.mp, NT = MP / 16, D = p.d, DV = p.dv;
    const uint16_t* kbase = static_cast<const uint16_t*>(p.k) + static_cast<int64_t>(w.h) * D;
    const uint16_t* vbase = static_cast<const uint16_t*>(p.v) + static_cast<int64_t>(w.h) * DV;
    const int32_t* slots = w.slots;

    // scores, 16 keys at a time
    for (int j0 = 0; j0 < BK; j0 += 16) {
      if (j0 + 16 <= ulo || j0 >= uhi) continue;
      bool direct = j0 >= ulo && j0 + 16 <= uhi;
      for (int i = 1; direct && i < 16; ++i) direct = slots[j0 + i] == slots[j0] + i;
      const uint16_t* a;
      int a_stride;
      if (direct) {
        a = kbase + static_cast<int64_t>(slots[j0]) * p.k_slot_stride;
        a_stride = static_cast<int>(p.k_slot_stride * 2);
      } else {
        for (int i = 0; i < 16; ++i) {
          const int j = j0 + i;
          const uint16_t* src = (j >= ulo && j < uhi) ? kbase + static_cast<int64_t>(slots[j]) * p.k_slot_stride : kZeroBf16;
          std::memcpy(e.kg + i * D, src, static_cast<size_t>(D) * 2);
        }
        a = e.kg;
        a_stride = D * 2;
      }
      float* st = e.st + j0 * MP;
      if (NT == 1) qk_tile<1>(a, a_stride, e.qp, MP, D, st);
      else if (NT == 2) qk_tile<2>(a, a_stride, e.qp, MP, D, st);
      else if (NT == 3) qk_tile<3>(a, a_stride, e.qp, MP, D, st);
      else qk_tile<4>(a, a_stride, e.qp, MP, D, st);
    }

    softmax_block(e.st, w, M, BK, ulo, uhi, full, p.scale * (p.cap > 0.f ? 1.f : kLog2e), p.cap, true);

    // P^T [BK, MP] float -> P [MP, BK] bf16
    for (int j0 = 0; j0 < BK; j0 += 16) {
      for (int t = 0; t < NT; ++t) {
        uint16_t* dst = e.pb + t * 16 * BK + j0;
        if (j0 + 16 <= ulo || j0 >= uhi) {
          for (int r = 0; r < 16; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * BK), _mm256_setzero_si256());
          continue;
        }
        __m512 r16[16];
        for (int r = 0; r < 16; ++r) r16[r] = _mm512_loadu_ps(e.st + (j0 + r) * MP + t * 16);
        transpose16(r16);
        for (int r = 0; r < 16; ++r) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * BK), (__m256i)_mm512_cvtneps_pbh(r16[r]));
      }
    }

    // V in VNNI pairs: vp[r, c, 0..1] = V[2r, c], V[2r+1, c]
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
      const uint16_t* v0 = in0 ? vbase + static_cast<int64_t>(slots[j]) * p.v_slot_stride : kZeroBf16;
      const uint16_t* v1 = in1 ? vbase + static_cast<int64_t>(slots[j + 1]) * p.v_slot_stride : kZeroBf16;
      for (int c = 0; c < DV; c += 32) {
        const __m512i a = _mm512_loadu_si512(v0 + c);
        const __m512i b = _mm512_loadu_si512(v1 + c);
        _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }

    // ob = P V, then o = o * alpha + ob
    for (int t = 0; t < NT; ++t) {
      for (int dv0 = 0; dv0 < DV; dv0 += 64) {
        const int nd = (DV - dv0) >= 64 ? 4 : (DV - dv0) / 16;
        if (nd == 4) pv_tile<4>(e.pb, BK, t, e.vp, DV, dv0, e.ob);
        else if (nd == 3) pv_tile<3>(e.pb, BK, t, e.vp, DV, dv0, e.ob);
        else if (nd == 2) pv_tile<2>(e.pb, BK, t, e.vp, DV, dv0, e.ob);
        else pv_tile<1>(e.pb, BK, t, e.vp, DV, dv0, e.ob);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_set1_ps(w.alpha[m]);
      float* o = w.o + static_cast<int64_t>(m) * DV;
      const float* b = e.ob + static_cast<int64_t>(m) * DV;
      for (int c = 0; c < DV; c += 16) _mm512_storeu_ps(o + c, _mm512_fmadd_ps(_mm512_loadu_ps(o + c), a, _mm512_loadu_ps(b + c)));
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
  out->max_rows = AmxOps::MMAX;
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
