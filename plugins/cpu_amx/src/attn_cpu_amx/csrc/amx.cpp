// AMX path (bf16 q and K/V): both matrix products on AMX tiles (TDPBF16PS, float32 accumulation), the
// softmax on AVX-512. Needs AMX-TILE, AMX-BF16, AVX512-BF16 and the Linux permission for tile data
// (requested by the dispatcher before the first call).
//
// Every tile is 16 rows x 64 bytes: tmm0-3 accumulators (2x2), tmm4-5 A operands, tmm6-7 B operands.
// Per block of BK keys and an item of MP rows (MP/16 row tiles):
//   scores  st^T: C[16 keys, 16 rows] += K[16 keys, 32 dims] x Q^T  (K tiles are loaded straight from
//           the pool when 16 keys sit in consecutive slots, else gathered; q is packed once per item
//           as qp [D/2, MP, 2], the VNNI layout of Q^T)
//   softmax on st [BK, MP] (AVX-512), P transposed into pb [MP, BK] bf16
//   output  rows whose max moved are rescaled (lazily: only when the max grows by more than 2^8), then
//           o[16 rows, 16 ch] += P[16 rows, 32 keys] x V on tiles loaded from and stored to o
//           (V packed per block as vp [BK/2, Dv, 2]).
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

struct AmxOps {
  static constexpr int BK = 64;
  static constexpr int MMAX = 64;

  struct Ext {
    uint16_t* qp;  // [D/2, MP, 2]
    float* st;     // [BK, MP]
    uint16_t* pb;  // [MP, BK]
    uint16_t* kg;  // [BK, D] gathered keys
    uint16_t* vp;  // [BK/2, Dv, 2]
  };
  static size_t extra_bytes(const Params& p) {
    return align64(static_cast<size_t>(p.d) * kMaxRows * 2) + align64(BK * kMaxRows * 4) + align64(kMaxRows * BK * 2) +
           align64(static_cast<size_t>(BK) * p.d * 2) + align64(static_cast<size_t>(BK) * p.dv * 2);
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
    s += align64(static_cast<size_t>(BK) * p.d * 2);
    e.vp = reinterpret_cast<uint16_t*>(s);
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

    // K tiles: straight from the pool when 16 keys sit in consecutive slots, else gathered
    const uint16_t* ka[BK / 16];
    int ks[BK / 16];
    for (int kt = 0; kt < BK / 16; ++kt) {
      const int j0 = kt * 16;
      ka[kt] = nullptr;
      if (j0 + 16 <= ulo || j0 >= uhi) continue;
      bool direct = j0 >= ulo && j0 + 16 <= uhi;
      for (int i = 1; direct && i < 16; ++i) direct = slots[j0 + i] == slots[j0] + i;
      if (direct) {
        ka[kt] = kbase + static_cast<int64_t>(slots[j0]) * p.k_slot_stride;
        ks[kt] = static_cast<int>(p.k_slot_stride * 2);
        continue;
      }
      for (int i = 0; i < 16; ++i) {
        const int j = j0 + i;
        const uint16_t* src = (j >= ulo && j < uhi) ? kbase + static_cast<int64_t>(slots[j]) * p.k_slot_stride : kZeroBf16;
        std::memcpy(e.kg + static_cast<int64_t>(j) * D, src, static_cast<size_t>(D) * 2);
      }
      ka[kt] = e.kg + static_cast<int64_t>(j0) * D;
      ks[kt] = D * 2;
    }
    // st^T = K Q^T in 2x2 blocks of (key tile, row tile); pairs of key tiles share a stride when possible
    for (int kt = 0; kt < BK / 16;) {
      if (ka[kt] == nullptr) {
        ++kt;
        continue;
      }
      const int na = (kt + 1 < BK / 16 && ka[kt + 1] != nullptr && ks[kt + 1] == ks[kt]) ? 2 : 1;
      const uint16_t* a[2] = {ka[kt], na == 2 ? ka[kt + 1] : ka[kt]};
      for (int t = 0; t < NT; t += 2) {
        const int nb = t + 1 < NT ? 2 : 1;
        const uint16_t* b[2] = {e.qp + t * 32, e.qp + (t + nb - 1) * 32};
        float* c[2][2] = {{e.st + kt * 16 * MP + t * 16, e.st + kt * 16 * MP + (t + nb - 1) * 16},
                          {e.st + (kt + na - 1) * 16 * MP + t * 16, e.st + (kt + na - 1) * 16 * MP + (t + nb - 1) * 16}};
        tile_block_any<false>(na, nb, a, ks[kt], 32, b, MP * 4, static_cast<int64_t>(32) * MP, D / 32, c, MP * 4);
      }
      kt += na;
    }

    softmax_block(e.st, w, M, BK, ulo, uhi, full, p.scale * (p.cap > 0.f ? 1.f : kLog2e), p.cap, true, kLazyRescale);

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

    // o = o * alpha (rows whose max moved), then o += P V on the tiles
    for (int m = 0; m < M; ++m) {
      const float a = w.alpha[m];
      if (a == 1.f) continue;
      const __m512 va = _mm512_set1_ps(a);
      float* o = w.o + static_cast<int64_t>(m) * DV;
      for (int c = 0; c < DV; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), va));
    }
    for (int t = 0; t < NT; t += 2) {
      const int na = t + 1 < NT ? 2 : 1;
      const uint16_t* a[2] = {e.pb + t * 16 * BK, e.pb + (t + na - 1) * 16 * BK};
      for (int n = 0; n < DV / 16; n += 2) {
        const int nb = n + 1 < DV / 16 ? 2 : 1;
        const uint16_t* b[2] = {e.vp + n * 32, e.vp + (n + nb - 1) * 32};
        float* c[2][2] = {{w.o + t * 16 * DV + n * 16, w.o + t * 16 * DV + (n + nb - 1) * 16},
                          {w.o + (t + na - 1) * 16 * DV + n * 16, w.o + (t + na - 1) * 16 * DV + (n + nb - 1) * 16}};
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
