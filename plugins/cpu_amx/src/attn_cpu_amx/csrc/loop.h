// The per-item flash-attention loop shared by every path. Each ISA file includes this header inside an
// anonymous namespace (after its system headers and its ISA pragma), so the loop is compiled once per
// ISA with internal linkage; the file's `Ops` supply the block math:
//
//   static constexpr int BK;          keys per block (a multiple of 16)
//   static constexpr int MG;          rows per group (a multiple of 16, <= 64)
//   static constexpr bool kVis;       whether `group` reads w.vis (key-major row bits)
//   static size_t extra_bytes(const Params&);            the path's own scratch
//   static void thread_begin(); static void thread_end();
//   static void load_q(const Params&, Work&)             stage the item's q rows (w.qrows[0 .. w.rows))
//   static void finish(const Params&, Work&)             make w.l final after the last block
//   static void stage(const Params&, Work&, int ulo, int uhi)
//       stage K/V of keys [ulo, uhi) of the block (w.slots[j] >= 0 there) for every row group
//   static void group(const Params&, Work&, int r0, int M, int ulo, int uhi, bool full)
//       rows r0 .. r0+M-1 against keys [ulo, uhi) of the block: scores, masking (by w.lo / w.hi /
//       w.mrows, or w.vis when !full), online-softmax update of w.mx / w.l, rescale of w.o, w.o += P V.
//
// An item is up to kMaxRows rows (tokens x q heads of one KV head) processed in groups of MG rows, so
// every K/V block is loaded and staged once for all its groups. Softmax state is in the log2 domain:
// w.mx is the running max of log2-scaled scores, w.l the sum of 2^(s - mx); the output row is o / l and
// its natural LSE (mx + log2 l) * ln 2.

struct Work {
  float* o;               // [kMaxRows, Dv] unnormalized output
  float* mx;              // [kMaxRows]
  float* l;               // [kMaxRows]
  float* alpha;           // [kMaxRows] rescale factor of the last block
  int32_t* lo;            // [kMaxRows] first visible key of each row (absolute), within the item's keys
  int32_t* hi;            // [kMaxRows] one past the last visible key
  int32_t* slots;         // [BK] slot of each key of the block, -1 where not loaded
  uint16_t* vis;          // [BK, MG/16] bit m%16 of vis[j * (MG/16) + m/16]: group row m sees key j
  const void** qrows;     // [kMaxRows] q row pointers
  const uint8_t** mrows;  // [kMaxRows] custom-mask row of each row's token (nullptr without a mask)
  int32_t* rq;            // [kMaxRows] q head of each row
  int32_t* rt;            // [kMaxRows] token row (in q / out) of each row
  char* extra;            // the path's own scratch
  int rows;               // rows of the item
  int h;                  // KV head
  int b0;                 // first key of the current block
};

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline size_t align64(size_t n) { return (n + 63) & ~static_cast<size_t>(63); }

template <class Ops>
size_t common_bytes(const Params& p) {
  const size_t r = kMaxRows, bk = Ops::BK;
  return align64(r * p.dv * 4) + 3 * align64(r * 4) + 2 * align64(r * 4) + align64(bk * 4) + align64(bk * (Ops::MG / 16) * 2) +
         2 * align64(r * sizeof(void*)) + 2 * align64(r * 4);
}

template <class Ops>
size_t scratch_bytes(const Params& p) {
  return common_bytes<Ops>(p) + align64(Ops::extra_bytes(p)) + 64;
}

template <class Ops>
Work carve(const Params& p, char* s) {
  Work w;
  const size_t r = kMaxRows, bk = Ops::BK;
  auto take = [&s](size_t n) {
    char* out = s;
    s += align64(n);
    return out;
  };
  w.o = reinterpret_cast<float*>(take(r * p.dv * 4));
  w.mx = reinterpret_cast<float*>(take(r * 4));
  w.l = reinterpret_cast<float*>(take(r * 4));
  w.alpha = reinterpret_cast<float*>(take(r * 4));
  w.lo = reinterpret_cast<int32_t*>(take(r * 4));
  w.hi = reinterpret_cast<int32_t*>(take(r * 4));
  w.slots = reinterpret_cast<int32_t*>(take(bk * 4));
  w.vis = reinterpret_cast<uint16_t*>(take(bk * (Ops::MG / 16) * 2));
  w.qrows = reinterpret_cast<const void**>(take(r * sizeof(void*)));
  w.mrows = reinterpret_cast<const uint8_t**>(take(r * sizeof(void*)));
  w.rq = reinterpret_cast<int32_t*>(take(r * 4));
  w.rt = reinterpret_cast<int32_t*>(take(r * 4));
  w.extra = take(0);
  w.rows = 0;
  w.h = 0;
  w.b0 = 0;
  return w;
}

// Ask for the K/V rows of keys [k0, k1) (the next block) while this block computes: pages are scattered,
// so the hardware prefetchers cannot guess these rows. Into L2: the current block fills L1.
inline void prefetch_rows(const Params& p, int h, const int32_t* r2t, int k0, int k1) {
  const int64_t esize = p.kv_dtype == DType::F32 ? 4 : 2;
  const int64_t kbytes = p.d * esize, vbytes = p.dv * esize;
  const char* kb = static_cast<const char*>(p.k) + h * p.k_head_stride * esize;
  const char* vb = static_cast<const char*>(p.v) + h * p.v_head_stride * esize;
  for (int j = k0; j < k1; ++j) {
    const int64_t slot = r2t[j];
    const char* kr = kb + k_row(p, slot) * esize;
    const char* vr = vb + v_row(p, slot) * esize;
    for (int64_t c = 0; c < kbytes; c += 64) __builtin_prefetch(kr + c, 0, 2);
    for (int64_t c = 0; c < vbytes; c += 64) __builtin_prefetch(vr + c, 0, 2);
  }
}

// Block-relative visible range of row r.
inline void row_range(const Work& w, int r, int BK, int* rlo, int* rhi) {
  *rlo = imin(imax(w.lo[r] - w.b0, 0), BK);
  *rhi = imin(imax(w.hi[r] - w.b0, 0), BK);
}

template <class Ops>
void run_item(const Params& p, const Item& it, Work& w) {
  constexpr int BK = Ops::BK, MG = Ops::MG;
  const int R = it.nt * it.ng;
  w.rows = R;
  w.h = it.h;
  const int seq = p.seq_lens[it.req];
  const int prefix = seq - p.q_lens[it.req];
  const int q0 = p.q_starts[it.req];
  const int32_t* r2t = p.r2t + p.req_rows[it.req] * p.r2t_stride;
  const uint8_t* mask = p.mask != nullptr ? p.mask + p.mask_indptr[it.req] : nullptr;
  const size_t qsize = p.q_dtype == DType::F32 ? 4 : 2;

  for (int m = 0; m < R; ++m) {
    const int t = it.t0 + m / it.ng;
    const int qh = it.h * p.group + it.g0 + m % it.ng;
    const int pos = prefix + t;
    int lo = 0, hi = seq;
    if (mask == nullptr) {
      hi = pos + 1;
      if (p.window > 0) lo = imax(0, pos - p.window + 1);
    }
    w.lo[m] = imax(lo, it.k0);
    w.hi[m] = imin(hi, it.k1);
    w.rq[m] = qh;
    w.rt[m] = q0 + t;
    w.qrows[m] = static_cast<const char*>(p.q) + (static_cast<int64_t>(q0 + t) * p.q_row_stride + static_cast<int64_t>(qh) * p.d) * qsize;
    w.mrows[m] = mask != nullptr ? mask + static_cast<int64_t>(t) * seq : nullptr;
    w.mx[m] = -INFINITY;
    w.l[m] = 0.f;
    w.alpha[m] = 1.f;
  }
  for (int64_t i = 0; i < static_cast<int64_t>(R) * p.dv; ++i) w.o[i] = 0.f;
  Ops::load_q(p, w);

  for (int b0 = (it.k0 / BK) * BK; b0 < it.k1; b0 += BK) {
    w.b0 = b0;
    int ulo = BK, uhi = 0;
    for (int m = 0; m < R; ++m) {
      int rlo, rhi;
      row_range(w, m, BK, &rlo, &rhi);
      if (rlo < rhi) {
        ulo = imin(ulo, rlo);
        uhi = imax(uhi, rhi);
      }
    }
    if (ulo >= uhi) continue;
    for (int j = 0; j < BK; ++j) w.slots[j] = (j >= ulo && j < uhi) ? r2t[b0 + j] : -1;
    prefetch_rows(p, w.h, r2t, b0 + BK, imin(b0 + 2 * BK, it.k1));
    Ops::stage(p, w, ulo, uhi);

    for (int r0 = 0; r0 < R; r0 += MG) {
      const int M = imin(MG, R - r0);
      int glo = BK, ghi = 0;
      bool full = mask == nullptr;
      for (int m = r0; m < r0 + M; ++m) {
        int rlo, rhi;
        row_range(w, m, BK, &rlo, &rhi);
        if (rlo < rhi) {
          glo = imin(glo, rlo);
          ghi = imax(ghi, rhi);
        }
        if (rlo != 0 || rhi != BK) full = false;
      }
      if (glo >= ghi) continue;
      if (Ops::kVis && !full) {
        constexpr int NV = MG / 16;
        for (int i = 0; i < BK * NV; ++i) w.vis[i] = 0;
        for (int m = 0; m < M; ++m) {
          int rlo, rhi;
          row_range(w, r0 + m, BK, &rlo, &rhi);
          const uint16_t bit = static_cast<uint16_t>(1u << (m & 15));
          const uint8_t* mr = w.mrows[r0 + m];
          for (int j = rlo; j < rhi; ++j)
            if (mr == nullptr || mr[b0 + j]) w.vis[j * NV + (m >> 4)] |= bit;
        }
      }
      Ops::group(p, w, r0, M, glo, ghi, full);
    }
  }

  Ops::finish(p, w);
  for (int m = 0; m < R; ++m) {
    const float l = w.l[m];
    const float lse2 = l > 0.f ? w.mx[m] + std::log2(l) : -INFINITY;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float* o = w.o + static_cast<int64_t>(m) * p.dv;
    if (it.part >= 0) {
      float* dst = p.part_o + static_cast<int64_t>(it.part + m) * p.dv;
      for (int i = 0; i < p.dv; ++i) dst[i] = o[i] * inv;
      p.part_lse[it.part + m] = lse2;
    } else {
      write_output_row(p, w.rt[m], w.rq[m], o, inv, lse2);
    }
  }
}

// Pull items until none are left (dynamic scheduling; see order_items for the order).
template <class Ops>
void run_items(const Params& p, const Item* items, int64_t n_items, std::atomic<int64_t>* next, char* scratch) {
  Work w = carve<Ops>(p, scratch);
  Ops::thread_begin();
  for (int64_t i = next->fetch_add(1); i < n_items; i = next->fetch_add(1)) run_item<Ops>(p, items[i], w);
  Ops::thread_end();
}
