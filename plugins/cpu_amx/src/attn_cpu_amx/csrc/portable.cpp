// Portable path: plain C++ in float32, built for the baseline ISA of the compiler (no intrinsics).
// It runs on any CPU; the compiler may auto-vectorize the inner loops.
#include <cmath>
#include <cstring>

#include "common.h"

namespace attn_cpu {
namespace {

#include "loop.h"

inline float load_elem(const float* p, int64_t i) { return p[i]; }
inline float load_elem(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

template <typename TQ, typename TKV>
struct PortableOps {
  static constexpr int BK = 32;
  static constexpr int MG = 32;
  static constexpr bool kVis = true;

  // q rows as float32 [kMaxRows, D] (scaled), then a group's scores [BK, MG]
  static size_t extra_bytes(const Params& p) { return align64(static_cast<size_t>(kMaxRows) * p.d * 4) + align64(BK * MG * 4); }
  static float* qf(const Params& p, Work& w) { return reinterpret_cast<float*>(w.extra); }
  static float* st(const Params& p, Work& w) { return reinterpret_cast<float*>(w.extra + align64(static_cast<size_t>(kMaxRows) * p.d * 4)); }

  static void thread_begin() {}
  static void thread_end() {}
  static void finish(const Params&, Work&) {}

  static void load_q(const Params& p, Work& w) {
    const float mult = p.scale * (p.cap > 0.f ? 1.f : kLog2e);
    float* q = qf(p, w);
    for (int m = 0; m < w.rows; ++m) {
      const TQ* src = static_cast<const TQ*>(w.qrows[m]);
      for (int i = 0; i < p.d; ++i) q[m * p.d + i] = load_elem(src, i) * mult;
    }
  }

  static void stage(const Params&, Work&, int, int) {}

  static void group(const Params& p, Work& w, int r0, int M, int ulo, int uhi, bool full) {
    constexpr int NV = MG / 16;
    const int D = p.d, DV = p.dv;
    const TKV* kbase = static_cast<const TKV*>(p.k) + static_cast<int64_t>(w.h) * p.k_head_stride;
    const TKV* vbase = static_cast<const TKV*>(p.v) + static_cast<int64_t>(w.h) * p.v_head_stride;
    const float* q = qf(p, w) + static_cast<int64_t>(r0) * D;
    float* s = st(p, w);
    for (int j = ulo; j < uhi; ++j) {
      const TKV* kr = kbase + k_row(p, w.slots[j]);
      for (int m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int i = 0; i < D; ++i) acc += q[m * D + i] * load_elem(kr, i);
        s[j * MG + m] = acc;
      }
    }
    const float cap_l2e = p.cap * kLog2e;
    for (int m = 0; m < M; ++m) {
      const int r = r0 + m;
      float bmax = -INFINITY;
      for (int j = ulo; j < uhi; ++j) {
        float x = s[j * MG + m];
        if (p.cap > 0.f) x = cap_l2e * std::tanh(x / p.cap);
        if (!full && !(w.vis[j * NV + (m >> 4)] & (1u << (m & 15)))) x = -INFINITY;
        s[j * MG + m] = x;
        bmax = std::fmax(bmax, x);
      }
      const float mnew = std::fmax(w.mx[r], bmax);
      const float safe = mnew == -INFINITY ? 0.f : mnew;
      const float alpha = w.mx[r] == -INFINITY ? 0.f : std::exp2(w.mx[r] - safe);
      float sum = 0.f;
      float* o = w.o + static_cast<int64_t>(r) * DV;
      for (int i = 0; i < DV; ++i) o[i] *= alpha;
      for (int j = ulo; j < uhi; ++j) {
        const float x = s[j * MG + m];
        if (x == -INFINITY) continue;
        const float pj = std::exp2(x - safe);
        sum += pj;
        const TKV* vr = vbase + v_row(p, w.slots[j]);
        for (int i = 0; i < DV; ++i) o[i] += pj * load_elem(vr, i);
      }
      w.l[r] = w.l[r] * alpha + sum;
      w.mx[r] = mnew;
    }
  }
};

template <typename TQ, typename TKV>
void run_typed(const Params& p, const Item* items, int64_t n, std::atomic<int64_t>* next, char* scratch) {
  run_items<PortableOps<TQ, TKV>>(p, items, n, next, scratch);
}

void run_portable(const Params& p, const Item* items, int64_t n, std::atomic<int64_t>* next, char* scratch) {
  if (p.q_dtype == DType::F32) {
    if (p.kv_dtype == DType::F32) return run_typed<float, float>(p, items, n, next, scratch);
    return run_typed<float, uint16_t>(p, items, n, next, scratch);
  }
  if (p.kv_dtype == DType::F32) return run_typed<uint16_t, float>(p, items, n, next, scratch);
  return run_typed<uint16_t, uint16_t>(p, items, n, next, scratch);
}

size_t portable_scratch(const Params& p) { return scratch_bytes<PortableOps<float, float>>(p); }

}  // namespace

bool portable_kernels(PathKernels* out) {
  out->block_keys = PortableOps<float, float>::BK;
  out->group_rows = PortableOps<float, float>::MG;
  out->scratch_bytes = &portable_scratch;
  out->run = &run_portable;
  return true;
}

}  // namespace attn_cpu
