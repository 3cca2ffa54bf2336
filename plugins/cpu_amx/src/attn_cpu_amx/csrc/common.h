// Plain data shared by the dispatcher (bindings.cpp) and the per-ISA kernels (portable.cpp,
// avx512.cpp, amx.cpp). No torch and no intrinsics here: every translation unit includes it.
#pragma once

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace attn_cpu {

enum class DType : int32_t { F32 = 0, BF16 = 1 };

// One attention call over a batch. Shapes (elements, not bytes):
//   q    [T, Hq, D]   rows of token t start at q + t * q_row_stride
//   k/v  pool buffers, slot s head h at k + kv_row(s) + h * k_head_stride (v alike), where kv_row(s) =
//        (s >> page_shift) * k_page_stride + (s & (2^page_shift - 1)) * k_slot_stride: attn's NHD pools
//        [num_slots, Hkv, D] (page_shift 0, k_page_stride the slot stride) and page-major HND buffers
//        [num_pages, Hkv, page_size, D] with any strides (engine-owned caches) alike
//   out  [T, Hq, Dv]  (q dtype), lse [T, Hq] float32 natural log (optional)
//   r2t  req_to_token [rows, r2t_stride] int32 slot ids; request r uses row req_rows[r]
//   seq_lens / q_lens / q_starts [bs] int32; token i of request r is q row q_starts[r] + i and sits at
//   position seq_lens[r] - q_lens[r] + i
//   mask (optional) flattened bool [q_len, seq_len] per request at mask + mask_indptr[r]
struct Params {
  const void* q = nullptr;
  int64_t q_row_stride = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_slot_stride = 0;  // token stride inside a page (unused when page_shift is 0)
  int64_t v_slot_stride = 0;
  int64_t k_page_stride = 0;  // page stride (the slot stride when page_shift is 0)
  int64_t v_page_stride = 0;
  int64_t k_head_stride = 0;
  int64_t v_head_stride = 0;
  int32_t page_shift = 0;  // log2 of the tokens per page in the addressing (0: one slot per row)
  void* out = nullptr;
  int64_t out_row_stride = 0;
  float* lse = nullptr;
  const int32_t* r2t = nullptr;
  int64_t r2t_stride = 0;
  const int64_t* req_rows = nullptr;
  const int32_t* seq_lens = nullptr;
  const int32_t* q_lens = nullptr;
  const int32_t* q_starts = nullptr;
  const uint8_t* mask = nullptr;
  const int64_t* mask_indptr = nullptr;
  const float* sinks = nullptr;  // [Hq] natural-log sink logits
  DType q_dtype = DType::F32;
  DType kv_dtype = DType::F32;
  int32_t hq = 0, hkv = 0, group = 0, d = 0, dv = 0;
  float scale = 1.f;    // softmax scale (k_scale folded in)
  float v_scale = 1.f;  // multiplies the output
  float cap = 0.f;      // logit cap, 0 = off
  int32_t window = 0;   // sliding window in keys, 0 = off
  float* part_o = nullptr;    // [num_partial_rows, Dv] normalized partial outputs of split items
  float* part_lse = nullptr;  // [num_partial_rows] their log2-domain LSEs
};

// Element offset of slot `slot`'s row (head 0) in a buffer with these page / token strides.
inline int64_t kv_row(int64_t slot, int32_t page_shift, int64_t page_stride, int64_t token_stride) {
  return (slot >> page_shift) * page_stride + (slot & ((int64_t{1} << page_shift) - 1)) * token_stride;
}
inline int64_t k_row(const Params& p, int64_t slot) { return kv_row(slot, p.page_shift, p.k_page_stride, p.k_slot_stride); }
inline int64_t v_row(const Params& p, int64_t slot) { return kv_row(slot, p.page_shift, p.v_page_stride, p.v_slot_stride); }

// A unit of work: q heads g0..g0+ng-1 of KV head h for tokens t0..t0+nt-1 of request req, over keys
// [k0, k1). Rows are token-major: row m = (t0 + m / ng, g0 + m % ng). part < 0: write the final
// output; else write partial rows part .. part + nt*ng - 1.
struct Item {
  int32_t req, h, t0, nt, g0, ng, k0, k1, part;
};

// Limits shared by every path.
constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 256;  // rows (tokens x q heads) per item

// What one path exports. `run` is called once per thread; it pulls item indices from `next` until
// they run out. `scratch` is this thread's slice (scratch_bytes of it, 64-byte aligned).
struct PathKernels {
  int block_keys;  // keys per block (a multiple of 16)
  int group_rows;  // rows a block is computed for at a time (a multiple of 16, <= kMaxRows)
  size_t (*scratch_bytes)(const Params& p);
  void (*run)(const Params& p, const Item* items, int64_t n_items, std::atomic<int64_t>* next, char* scratch);
};

// Defined in the per-ISA files; `supported` is false when the file was built for another architecture.
bool portable_kernels(PathKernels* out);
bool avx512_kernels(PathKernels* out);
bool amx_kernels(PathKernels* out);

// ---- output helpers (inline, plain C++; each TU includes this before any ISA pragma) ----

inline uint16_t float_to_bf16(float f) {
  uint32_t b;
  __builtin_memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  b += 0x7fffu + ((b >> 16) & 1u);                     // round to nearest even
  return static_cast<uint16_t>(b >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &b, 4);
  return f;
}

constexpr float kLn2 = 0.693147180559945309f;
constexpr float kLog2e = 1.442695040888963407f;

// Write the final output row of (token row `row`, q head `qh`): out = o * mult (then the sink, the
// v scale and the dtype conversion); lse2 is the row's log2-domain LSE (-inf when it saw no key).
inline void write_output_row(const Params& p, int64_t row, int qh, const float* o, float mult, float lse2) {
  if (p.sinks != nullptr) {
    const float s2 = p.sinks[qh] * kLog2e;
    const float hi = lse2 > s2 ? lse2 : s2;
    const float tot = hi + std::log2(std::exp2(lse2 - hi) + std::exp2(s2 - hi));
    mult *= (lse2 == -INFINITY) ? 0.f : std::exp2(lse2 - tot);
    lse2 = tot;
  }
  mult *= p.v_scale;
  const int dv = p.dv;
  if (p.q_dtype == DType::F32) {
    float* dst = static_cast<float*>(p.out) + row * p.out_row_stride + static_cast<int64_t>(qh) * dv;
    for (int i = 0; i < dv; ++i) dst[i] = o[i] * mult;
  } else {
    uint16_t* dst = static_cast<uint16_t*>(p.out) + row * p.out_row_stride + static_cast<int64_t>(qh) * dv;
    for (int i = 0; i < dv; ++i) dst[i] = float_to_bf16(o[i] * mult);
  }
  if (p.lse != nullptr) p.lse[row * p.hq + qh] = lse2 * kLn2;
}

}  // namespace attn_cpu
