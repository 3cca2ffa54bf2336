// Python entry points: argument checks, the work plan (items, KV splits), the thread pool run, the
// merge of split items. Built for the baseline ISA; the per-ISA kernels live in their own files.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "common.h"

namespace attn_cpu {
namespace {

enum Path : int64_t { kPortable = 0, kAvx512 = 1, kAmx = 2 };

bool kernels_for(int64_t path, PathKernels* k) {
  switch (path) {
    case kPortable:
      return portable_kernels(k);
    case kAvx512:
      return avx512_kernels(k);
    case kAmx:
      return amx_kernels(k);
    default:
      return false;
  }
}

// Linux hands out AMX tile state only after the process asks for it (once per process).
bool amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

// A split item's partial rows are merged per (request, head group, token block).
struct SplitGroup {
  Item geometry;  // req, h, t0, nt, g0, ng of the unsplit item
  int32_t nsplit;
};

struct Plan {
  std::vector<Item> items;
  std::vector<SplitGroup> groups;
  int64_t part_rows = 0;
};

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

int64_t item_cost(const Item& it) { return static_cast<int64_t>(it.k1 - it.k0) * (it.nt * it.ng + 16); }

// Threads pull items in list order. Items of one (request, KV head, head group) stay together, largest
// first, so the threads work on the same K/V at about the same time (it stays in cache); those groups
// come largest total first, so the small items are left for the end (load balance).
void order_items(std::vector<Item>& items) {
  auto group_of = [](const Item& it) { return std::make_tuple(it.req, it.h, it.g0); };
  std::map<std::tuple<int32_t, int32_t, int32_t>, int64_t> total;
  for (const Item& it : items) total[group_of(it)] += item_cost(it);
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    const auto ga = group_of(a), gb = group_of(b);
    if (ga != gb) {
      const int64_t ta = total[ga], tb = total[gb];
      return ta != tb ? ta > tb : ga < gb;
    }
    return item_cost(a) > item_cost(b);
  });
}

// Base items: rows_cap rows at most (tokens x q heads of one KV head).
std::vector<Item> base_items(const Params& p, int bs, int rows_cap, int64_t* total_keys) {
  const int G = p.group;
  const int ng = std::min(G, rows_cap);
  const int bq = G >= rows_cap ? 1 : rows_cap / G;
  std::vector<Item> base;
  *total_keys = 0;
  for (int r = 0; r < bs; ++r) {
    const int qlen = p.q_lens[r], seq = p.seq_lens[r], prefix = seq - qlen;
    for (int t0 = 0; t0 < qlen; t0 += bq) {
      const int nt = std::min(bq, qlen - t0);
      int klo = 0, khi = seq;
      if (p.mask == nullptr) {
        khi = prefix + t0 + nt;
        if (p.window > 0) klo = std::max(0, prefix + t0 - p.window + 1);
      }
      for (int h = 0; h < p.hkv; ++h)
        for (int g0 = 0; g0 < G; g0 += ng) {
          base.push_back(Item{r, h, t0, nt, g0, std::min(ng, G - g0), klo, khi, -1});
          *total_keys += khi - klo;
        }
    }
  }
  return base;
}

// Items of up to kMaxRows rows, smaller (down to one row group) while there are fewer than 2 per
// thread; then KV splits when there are still fewer than 4 per thread. Split boundaries fall on
// multiples of the block size.
Plan make_plan(const Params& p, int bs, const PathKernels& k, int threads, int max_splits, int min_split_keys) {
  const int BK = k.block_keys;
  const int64_t target = 4 * static_cast<int64_t>(threads);
  int rows_cap = kMaxRows;
  int64_t total_keys = 0;
  std::vector<Item> base = base_items(p, bs, rows_cap, &total_keys);
  while (static_cast<int64_t>(base.size()) < target / 2 && rows_cap > k.group_rows) {
    rows_cap /= 2;
    base = base_items(p, bs, rows_cap, &total_keys);
  }
  Plan plan;
  if (static_cast<int64_t>(base.size()) >= target || max_splits <= 1) {
    plan.items = std::move(base);
  } else {
    const int64_t chunk = round_up(std::max<int64_t>(min_split_keys, (total_keys + target - 1) / target), BK);
    for (const Item& b : base) {
      const int64_t n = b.k1 - b.k0;
      const int64_t s = std::min<int64_t>(max_splits, (n + chunk - 1) / chunk);
      if (s <= 1) {
        plan.items.push_back(b);
        continue;
      }
      const int64_t start = (b.k0 / BK) * BK;
      const int64_t per = round_up((b.k1 - start + s - 1) / s, BK);
      const int32_t rows = b.nt * b.ng;
      SplitGroup g{b, 0};
      g.geometry.part = static_cast<int32_t>(plan.part_rows);
      for (int64_t i = 0; i < s; ++i) {
        const int64_t a = std::max<int64_t>(b.k0, start + i * per), e = std::min<int64_t>(b.k1, start + (i + 1) * per);
        if (a >= e) continue;
        Item it = b;
        it.k0 = static_cast<int32_t>(a);
        it.k1 = static_cast<int32_t>(e);
        it.part = static_cast<int32_t>(plan.part_rows + g.nsplit * rows);
        plan.items.push_back(it);
        ++g.nsplit;
      }
      plan.part_rows += static_cast<int64_t>(g.nsplit) * rows;
      plan.groups.push_back(g);
    }
  }
  order_items(plan.items);
  return plan;
}

void merge_splits(const Params& p, const Plan& plan) {
  const int64_t n = static_cast<int64_t>(plan.groups.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    float o[kMaxHeadDim];
    for (int64_t gi = begin; gi < end; ++gi) {
      const SplitGroup& g = plan.groups[gi];
      const Item& it = g.geometry;
      const int rows = it.nt * it.ng;
      for (int m = 0; m < rows; ++m) {
        float hi = -INFINITY;
        for (int s = 0; s < g.nsplit; ++s) hi = std::max(hi, p.part_lse[it.part + s * rows + m]);
        for (int i = 0; i < p.dv; ++i) o[i] = 0.f;
        float sum = 0.f;
        if (hi != -INFINITY) {
          for (int s = 0; s < g.nsplit; ++s) {
            const int64_t row = it.part + s * rows + m;
            const float wgt = std::exp2(p.part_lse[row] - hi);
            sum += wgt;
            const float* src = p.part_o + row * p.dv;
            for (int i = 0; i < p.dv; ++i) o[i] += wgt * src[i];
          }
        }
        const float lse2 = sum > 0.f ? hi + std::log2(sum) : -INFINITY;
        const int64_t token = p.q_starts[it.req] + it.t0 + m / it.ng;
        const int qh = it.h * p.group + it.g0 + m % it.ng;
        write_output_row(p, token, qh, o, sum > 0.f ? 1.f / sum : 0.f, lse2);
      }
    }
  });
}

DType dtype_of(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return DType::F32;
  if (t.scalar_type() == at::kBFloat16) return DType::BF16;
  TORCH_CHECK_VALUE(false, name, ": expected float32 or bfloat16, found ", t.scalar_type());
}

void check_cpu_int(const at::Tensor& t, const char* name, at::ScalarType type, int64_t n) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 1 && t.numel() == n && t.is_contiguous(), name,
                    ": expected a contiguous CPU ", type, " tensor of ", n, " elements");
}

// out [T, Hq, Dv] (q's dtype) and lse [T, Hq] float32 (optional) are written in place. Returns the plan's
// shape: (work items, split groups, largest item rows).
std::tuple<int64_t, int64_t, int64_t> attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& out, const c10::optional<at::Tensor>& lse,
               const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens, const at::Tensor& q_lens,
               const at::Tensor& q_starts, const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& mask_indptr,
               const c10::optional<at::Tensor>& sinks, double scale, double v_scale, double cap, int64_t window, int64_t path,
               int64_t max_splits, int64_t min_split_keys) {
  PathKernels kern;
  TORCH_CHECK_VALUE(kernels_for(path, &kern), "path ", path, " is not compiled into this build");
  TORCH_CHECK_VALUE(path != kAmx || amx_permission(), "the kernel did not grant AMX tile state (arch_prctl)");
  TORCH_CHECK_VALUE(q.dim() == 3 && out.dim() == 3, "q, out: expected 3-D tensors");
  // K/V: [slots, Hkv, D] (NHD) or [pages, Hkv, page_size, D] (HND), any strides with a contiguous last dimension
  TORCH_CHECK_VALUE((k_buf.dim() == 3 || k_buf.dim() == 4) && v_buf.dim() == k_buf.dim(), "k_buf, v_buf: expected two 3-D (NHD) or 4-D (HND) buffers");
  const bool hnd = k_buf.dim() == 4;
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_buf.size(1), dv = v_buf.size(-1);
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_buf.device().is_cpu() && v_buf.device().is_cpu() && out.device().is_cpu(), "expected CPU tensors");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && q.stride(1) == d, "q: expected contiguous heads");
  TORCH_CHECK_VALUE(k_buf.stride(-1) == 1 && k_buf.size(-1) == d, "k_buf: expected [slots, Hkv, D] or [pages, Hkv, page_size, D] with a contiguous last dimension");
  TORCH_CHECK_VALUE(v_buf.stride(-1) == 1 && v_buf.size(1) == hkv && v_buf.size(0) == k_buf.size(0) && (!hnd || v_buf.size(2) == k_buf.size(2)),
                    "v_buf: expected K's slots (pages), heads and page size with a contiguous last dimension");
  const int64_t page = hnd ? k_buf.size(2) : 1;
  TORCH_CHECK_VALUE(page > 0 && (page & (page - 1)) == 0, "k_buf: expected a power-of-two page size");
  TORCH_CHECK_VALUE(out.size(0) == T && out.size(1) == hq && out.size(2) == dv && out.stride(2) == 1 && out.stride(1) == dv,
                    "out: expected [T, Hq, Dv] with contiguous heads");
  TORCH_CHECK_VALUE(out.scalar_type() == q.scalar_type(), "out: expected q's dtype");
  TORCH_CHECK_VALUE(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf: expected one dtype");
  TORCH_CHECK_VALUE(hkv > 0 && hq % hkv == 0, "q heads: expected a multiple of the KV heads");
  TORCH_CHECK_VALUE(d % 16 == 0 && dv % 16 == 0 && d <= kMaxHeadDim && dv <= kMaxHeadDim, "head dims: expected multiples of 16 up to 256");
  const int64_t bs = seq_lens.numel();
  check_cpu_int(req_rows, "req_rows", at::kLong, bs);
  check_cpu_int(seq_lens, "seq_lens", at::kInt, bs);
  check_cpu_int(q_lens, "q_lens", at::kInt, bs);
  check_cpu_int(q_starts, "q_starts", at::kInt, bs);
  TORCH_CHECK_VALUE(req_to_token.device().is_cpu() && req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
                        req_to_token.stride(1) == 1,
                    "req_to_token: expected a CPU int32 [rows, max_context_len] table");

  Params p;
  p.q = q.data_ptr();
  p.q_row_stride = q.stride(0);
  p.k = k_buf.data_ptr();
  p.v = v_buf.data_ptr();
  p.k_page_stride = k_buf.stride(0);
  p.v_page_stride = v_buf.stride(0);
  p.k_head_stride = k_buf.stride(1);
  p.v_head_stride = v_buf.stride(1);
  p.k_slot_stride = hnd ? k_buf.stride(2) : 0;
  p.v_slot_stride = hnd ? v_buf.stride(2) : 0;
  p.page_shift = static_cast<int32_t>(__builtin_ctzll(static_cast<unsigned long long>(page)));
  p.out = out.data_ptr();
  p.out_row_stride = out.stride(0);
  p.r2t = req_to_token.data_ptr<int32_t>();
  p.r2t_stride = req_to_token.stride(0);
  p.req_rows = req_rows.data_ptr<int64_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.q_lens = q_lens.data_ptr<int32_t>();
  p.q_starts = q_starts.data_ptr<int32_t>();
  p.q_dtype = dtype_of(q, "q");
  p.kv_dtype = dtype_of(k_buf, "k_buf");
  TORCH_CHECK_VALUE(path != kAmx || (p.q_dtype == DType::BF16 && p.kv_dtype == DType::BF16 && d % 32 == 0 && dv % 32 == 0),
                    "the AMX path needs bf16 q and K/V and head dims that are multiples of 32");
  p.hq = static_cast<int32_t>(hq);
  p.hkv = static_cast<int32_t>(hkv);
  p.group = static_cast<int32_t>(hq / hkv);
  p.d = static_cast<int32_t>(d);
  p.dv = static_cast<int32_t>(dv);
  p.scale = static_cast<float>(scale);
  p.v_scale = static_cast<float>(v_scale);
  p.cap = static_cast<float>(cap);
  p.window = static_cast<int32_t>(window);
  if (lse.has_value()) {
    TORCH_CHECK_VALUE(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->numel() == T * hq, "lse: expected float32 [T, Hq]");
    p.lse = lse->data_ptr<float>();
  }
  if (mask.has_value()) {
    TORCH_CHECK_VALUE(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask_indptr.has_value(), "mask: expected contiguous bool with an indptr");
    check_cpu_int(*mask_indptr, "mask_indptr", at::kLong, mask_indptr->numel());
    TORCH_CHECK_VALUE(mask_indptr->numel() >= bs, "mask_indptr: expected one offset per request");
    p.mask = reinterpret_cast<const uint8_t*>(mask->data_ptr<bool>());
    p.mask_indptr = mask_indptr->data_ptr<int64_t>();
  }
  if (sinks.has_value()) {
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == hq, "sinks: expected float32 [Hq]");
    p.sinks = sinks->data_ptr<float>();
  }
  // every index the kernels will follow must be in range
  for (int64_t r = 0; r < bs; ++r) {
    const int32_t seq = p.seq_lens[r], ql = p.q_lens[r];
    TORCH_CHECK_VALUE(p.req_rows[r] >= 0 && p.req_rows[r] < req_to_token.size(0), "req_rows: row out of range");
    TORCH_CHECK_VALUE(ql >= 0 && seq >= ql && seq <= req_to_token.size(1), "seq_lens/q_lens: expected 0 <= q_len <= seq_len <= max_context_len");
    TORCH_CHECK_VALUE(p.q_starts[r] >= 0 && p.q_starts[r] + ql <= T, "q_starts: token rows out of range");
    if (p.mask != nullptr) {
      TORCH_CHECK_VALUE(p.mask_indptr[r] >= 0 && p.mask_indptr[r] + static_cast<int64_t>(ql) * seq <= mask->numel(), "mask: too short");
    }
  }

  const int threads = std::max(1, at::get_num_threads());
  Plan plan = make_plan(p, static_cast<int>(bs), kern, threads, static_cast<int>(max_splits), static_cast<int>(min_split_keys));
  const int64_t n_items = static_cast<int64_t>(plan.items.size());
  int64_t widest = 0;
  for (const Item& it : plan.items) widest = std::max<int64_t>(widest, it.nt * it.ng);
  const auto shape = std::make_tuple(n_items, static_cast<int64_t>(plan.groups.size()), widest);
  if (n_items == 0) return shape;
  const size_t per_thread = (kern.scratch_bytes(p) + 63) & ~static_cast<size_t>(63);
  const int workers = static_cast<int>(std::min<int64_t>(threads, n_items));
  // all scratch comes from torch's allocator (so memory profilers see it)
  at::Tensor scratch = at::empty({static_cast<int64_t>(per_thread * workers + 64)}, at::kByte);
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(scratch.data_ptr()) + 63) & ~static_cast<uintptr_t>(63));
  at::Tensor part;
  if (plan.part_rows > 0) {
    part = at::empty({plan.part_rows * (dv + 1)}, at::kFloat);
    p.part_o = part.data_ptr<float>();
    p.part_lse = p.part_o + plan.part_rows * dv;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) kern.run(p, plan.items.data(), n_items, &next, base + per_thread * w);
  });
  if (!plan.groups.empty()) merge_splits(p, plan);
  return shape;
}

// First bad slot of any visible key, as a message; empty when every slot is in [0, num_slots).
std::string check_slots(const at::Tensor& req_to_token, const at::Tensor& req_rows, const at::Tensor& seq_lens, int64_t num_slots) {
  const int64_t bs = seq_lens.numel();
  check_cpu_int(req_rows, "req_rows", at::kLong, bs);
  check_cpu_int(seq_lens, "seq_lens", at::kInt, bs);
  const int32_t* r2t = req_to_token.data_ptr<int32_t>();
  for (int64_t r = 0; r < bs; ++r) {
    const int64_t row = req_rows.data_ptr<int64_t>()[r];
    const int32_t seq = seq_lens.data_ptr<int32_t>()[r];
    if (row < 0 || row >= req_to_token.size(0) || seq < 0 || seq > req_to_token.size(1))
      return "request " + std::to_string(r) + ": row or length out of range";
    const int32_t* slots = r2t + row * req_to_token.stride(0);
    for (int32_t j = 0; j < seq; ++j)
      if (slots[j] < 0 || slots[j] >= num_slots)
        return "request " + std::to_string(r) + " key " + std::to_string(j) + ": slot " + std::to_string(slots[j]) + " outside [0, " +
               std::to_string(num_slots) + ")";
  }
  return "";
}

}  // namespace
}  // namespace attn_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attn-cpu-amx kernels: paged decode/extend attention on CPU (portable, AVX-512, AMX paths)";
  m.def("attention", &attn_cpu::attention, "paged attention of a batch (writes out and lse in place); returns (items, split groups, widest item rows)");
  m.def("check_slots", &attn_cpu::check_slots, "first out-of-range slot of a batch, or an empty string");
}
