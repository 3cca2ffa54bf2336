// The per-item flash-attention loop shared by every path. Each ISA file includes this header inside an
// anonymous namespace (after its system headers and its ISA pragma), so the loop is compiled once per
// ISA with internal linkage; the file's `Ops` supply the block math:
//
//   static constexpr int BK, MMAX;                       keys per block, rows per item
//   static size_t extra_bytes(const Params&);            the path's own scratch
//   static void load_q(const Params&, Work&, int M)       stage the item's q rows (w.qrows[m])
//   static void block(const Params&, Work&, int M, int ulo, int uhi, bool full)
//       one key block: scores of keys [ulo, uhi) of the block (w.slots[j] >= 0 there), masking by
//       w.vis when !full, online-softmax update of w.mx / w.l, rescale of w.o and w.o += P V.
//
// Softmax state is in the log2 domain: w.mx is the running max of log2-scaled scores, w.l the sum of
// 2^(s - mx); the output row is o / l and its natural LSE (mx + log2 l) * ln 2.

struct Work {
  float* o;          // [MP, Dv] unnormalized output
  float* mx;         // [MP]
  float* l;          // [MP]
  float* alpha;      // [MP] rescale factor of the last block
  int32_t* lo;       // [MP] first visible key of each row (absolute), after the item's key range
  int32_t* hi;       // [MP] one past the last visible key
  int32_t* slots;    // [BK] slot of each key of the block, -1 where not loaded
  uint16_t* vis;     // [BK, MP/16] bit m%16 of vis[j * (MP/16) + m/16]: row m sees key j
  const void** qrows;  // [MP] q row pointers (nullptr for padding rows)
  const uint8_t** mrows;  // [MP] custom-mask row of each row's token (nullptr without a mask)
  int32_t* rq;       // [MP] q head of each row
  int32_t* rt;       // [MP] token row (in q / out) of each row
  char* extra;       // the path's own scratch
  int mp;            // rows padded to 16
  int h;             // KV head
  int b0;            // first key of the current block
};

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
inline size_t align64(size_t n) { return (n + 63) & ~static_cast<size_t>(63); }

template <class Ops>
size_t common_bytes(const Params& p) {
  const size_t mp = kMaxRows, bk = Ops::BK;
  return align64(mp * p.dv * 4) + 3 * align64(mp * 4) + 2 * align64(mp * 4) + align64(bk * 4) +
         align64(bk * (mp / 16) * 2) + 2 * align64(mp * sizeof(void*)) + 2 * align64(mp * 4);
}

template <class Ops>
size_t scratch_bytes(const Params& p) {
  return common_bytes<Ops>(p) + align64(Ops::extra_bytes(p)) + 64;
}

template <class Ops>
Work carve(const Params& p, char* s) {
  Work w;
  const size_t mp = kMaxRows, bk = Ops::BK;
  auto take = [&s](size_t n) {
    char* r = s;
    s += align64(n);
    return r;
  };
  w.o = reinterpret_cast<float*>(take(mp * p.dv * 4));
  w.mx = reinterpret_cast<float*>(take(mp * 4));
  w.l = reinterpret_cast<float*>(take(mp * 4));
  w.alpha = reinterpret_cast<float*>(take(mp * 4));
  w.lo = reinterpret_cast<int32_t*>(take(mp * 4));
  w.hi = reinterpret_cast<int32_t*>(take(mp * 4));
  w.slots = reinterpret_cast<int32_t*>(take(bk * 4));
  w.vis = reinterpret_cast<uint16_t*>(take(bk * (mp / 16) * 2));
  w.qrows = reinterpret_cast<const void**>(take(mp * sizeof(void*)));
  w.mrows = reinterpret_cast<const uint8_t**>(take(mp * sizeof(void*)));
  w.rq = reinterpret_cast<int32_t*>(take(mp * 4));
  w.rt = reinterpret_cast<int32_t*>(take(mp * 4));
  w.extra = take(0);
  w.mp = 0;
  w.h = 0;
  w.b0 = 0;
  return w;
}

// Ask for the K/V rows of keys [k0, k1) (the next block) while this block computes: pages are scattered,
// so the hardware prefetchers cannot guess these rows.
inline void prefetch_rows(const Params& p, int h, const int32_t* r2t, int k0, int k1) {
  const int64_t esize = p.kv_dtype == DType::F32 ? 4 : 2;
  const int64_t kbytes = p.d * esize, vbytes = p.dv * esize;
  const char* kb = static_cast<const char*>(p.k) + h * kbytes;
  const char* vb = static_cast<const char*>(p.v) + h * vbytes;
  for (int j = k0; j < k1; ++j) {
    const int64_t slot = r2t[j];
    const char* kr = kb + slot * p.k_slot_stride * esize;
    const char* vr = vb + slot * p.v_slot_stride * esize;
    for (int64_t c = 0; c < kbytes; c += 64) __builtin_prefetch(kr + c, 0, 3);
    for (int64_t c = 0; c < vbytes; c += 64) __builtin_prefetch(vr + c, 0, 3);
  }
}

template <class Ops>
void run_item(const Params& p, const Item& it, Work& w) {
  constexpr int BK = Ops::BK;
  const int M = it.nt * it.ng;
  const int MP = (M + 15) & ~15;
  const int NV = MP / 16;
  w.mp = MP;
  w.h = it.h;
  const int seq = p.seq_lens[it.req];
  const int prefix = seq - p.q_lens[it.req];
  const int q0 = p.q_starts[it.req];
  const int32_t* r2t = p.r2t + p.req_rows[it.req] * p.r2t_stride;
  const uint8_t* mask = p.mask != nullptr ? p.mask + p.mask_indptr[it.req] : nullptr;
  const size_t qsize = p.q_dtype == DType::F32 ? 4 : 2;

  for (int m = 0; m < MP; ++m) {
    if (m >= M) {
      w.lo[m] = w.hi[m] = 0;
      w.qrows[m] = nullptr;
      w.mrows[m] = nullptr;
      w.rq[m] = w.rt[m] = 0;
      continue;
    }
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
  }
  for (int m = 0; m < MP; ++m) {
    w.mx[m] = -INFINITY;
    w.l[m] = 0.f;
    w.alpha[m] = 1.f;
  }
  for (int64_t i = 0; i < static_cast<int64_t>(MP) * p.dv; ++i) w.o[i] = 0.f;
  Ops::load_q(p, w, M);

  for (int b0 = (it.k0 / BK) * BK; b0 < it.k1; b0 += BK) {
    w.b0 = b0;
    int ulo = BK, uhi = 0;
    bool full = mask == nullptr;
    for (int m = 0; m < M; ++m) {
      const int rlo = imin(imax(w.lo[m] - b0, 0), BK);
      const int rhi = imin(imax(w.hi[m] - b0, 0), BK);
      if (rlo < rhi) {
        ulo = imin(ulo, rlo);
        uhi = imax(uhi, rhi);
      }
      if (rlo != 0 || rhi != BK) full = false;
    }
    if (ulo >= uhi) continue;
    for (int j = 0; j < BK; ++j) w.slots[j] = (j >= ulo && j < uhi) ? r2t[b0 + j] : -1;
    prefetch_rows(p, w.h, r2t, b0 + BK, imin(b0 + 2 * BK, it.k1));
    if (!full) {
      for (int i = 0; i < BK * NV; ++i) w.vis[i] = 0;
      for (int m = 0; m < M; ++m) {
        const int rlo = imin(imax(w.lo[m] - b0, 0), BK);
        const int rhi = imin(imax(w.hi[m] - b0, 0), BK);
        const uint16_t bit = static_cast<uint16_t>(1u << (m & 15));
        const uint8_t* mr = w.mrows[m];
        for (int j = rlo; j < rhi; ++j)
          if (mr == nullptr || mr[b0 + j]) w.vis[j * NV + (m >> 4)] |= bit;
      }
    }
    Ops::block(p, w, M, ulo, uhi, full);
  }

  for (int m = 0; m < M; ++m) {
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

// Pull items until none are left (dynamic scheduling; items come sorted by cost, largest first).
template <class Ops>
void run_items(const Params& p, const Item* items, int64_t n_items, std::atomic<int64_t>* next, char* scratch) {
  Work w = carve<Ops>(p, scratch);
  Ops::thread_begin();
  for (int64_t i = next->fetch_add(1); i < n_items; i = next->fetch_add(1)) run_item<Ops>(p, items[i], w);
  Ops::thread_end();
}
