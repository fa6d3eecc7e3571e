// Paged decode attention for the CPU cache node (loaded by cache_node/attention.py via ctypes).
//
// Plain C++17 + OpenMP with a C ABI and no torch headers: it compiles in a few seconds, where a
// torch extension (torch/extension.h) takes ~45 s on two cores. Python validates every argument and
// passes raw pointers; this file still bounds-checks physical block ids because a bad id would read
// another tenant's memory.
//
// Cache layout, one layer: k_cache / v_cache are [num_blocks, Hk, block_size, D], so the rows of one
// (physical block, kv head) are contiguous: block_size * D elements.
//
// Work item = (sequence b, kv head h, partition p). It walks its share of b's logical blocks with an
// online softmax and processes the G = Hq / Hk query heads of h together, so each K/V byte is read
// once. With one partition per sequence the item writes the final output; with more (few sequences,
// many threads: flash-decoding split) it writes a partial (max, sum, acc) that a second pass merges.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max), Cephes polynomial: ~1 ulp, vectorizes (no libm
// call), flushes below -87 to 0.
inline float exp_nonpos(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}

// tanh through exp_nonpos (vectorizes, unlike std::tanh): |error| ~1e-7, fine for a soft-cap's
// cap * tanh(s / cap) next to float32 scores.
inline float tanh_fast(float x) {
  const float e = exp_nonpos(-2.0f * std::fabs(x));
  return std::copysign((1.0f - e) / (1.0f + e), x);
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half -> normal float
    exp = 113u;
    while ((mant & 0x400u) == 0) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// Row loaders: return a float view of n contiguous elements, converting into `buf` when needed.
struct F32 {
  using T = float;
  static const float* rows(const float* src, float*, int64_t) { return src; }
};
struct F16 {
  using T = uint16_t;
  static const float* rows(const uint16_t* src, float* buf, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) buf[i] = half_to_float(src[i]);
    return buf;
  }
};
struct BF16 {
  using T = uint16_t;
  static const float* rows(const uint16_t* src, float* buf, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;  // bf16 is the top half of a float
      std::memcpy(buf + i, &bits, sizeof(bits));
    }
    return buf;
  }
};

// 8-wide float vectors through the GCC/Clang vector extension: one AVX2 register on x86, two NEON
// registers on ARM, no intrinsics. Loads and stores go through memcpy, so any alignment is fine.
typedef float f8 __attribute__((vector_size(32)));

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
inline f8 splat8(float x) { return f8{x, x, x, x, x, x, x, x}; }
inline float hsum8(f8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// Per block and query head: scores s = q K^T, then (after the softmax) acc += s V, in register tiles
// of eight independent FMA chains (8 rows, or 8 vectors of acc). Sharing K/V loads across the G heads
// of a KV head (4 heads x 2 rows tiles) measured no faster: with K/V in L1 the loads are not the limit.

// s[t] = q . K[t] for kRows rows at a time, from t; needs D % 8 == 0.
template <int kRows>
inline int64_t score_tile(const float* q, const float* K, int64_t n, int64_t D, float* s, int64_t t) {
  for (; t + kRows <= n; t += kRows) {
    f8 a[kRows] = {};
    for (int64_t d = 0; d < D; d += 8) {
      const f8 qv = load8(q + d);
      for (int r = 0; r < kRows; ++r) a[r] += qv * load8(K + (t + r) * D + d);
    }
    for (int r = 0; r < kRows; ++r) s[t + r] = hsum8(a[r]);
  }
  return t;
}

inline void score_rows(const float* q, const float* K, int64_t n, int64_t D, float* s) {
  int64_t t = 0;
  if (D % 8 == 0) {
    t = score_tile<8>(q, K, n, D, s, t);
    t = score_tile<1>(q, K, n, D, s, t);
  }
  for (; t < n; ++t) {
    float dot = 0.0f;
    for (int64_t d = 0; d < D; ++d) dot += q[d] * K[t * D + d];
    s[t] = dot;
  }
}

// acc[d] += sum_t w[t] * V[t][d] for columns from d in steps of 8 * kVecs: that slice of acc stays in
// registers for the whole block instead of a load and a store per token.
template <int kVecs>
inline int64_t accumulate_tile(const float* w, const float* V, int64_t n, int64_t D, float* acc, int64_t d) {
  for (; d + 8 * kVecs <= D; d += 8 * kVecs) {
    f8 a[kVecs];
    for (int i = 0; i < kVecs; ++i) a[i] = load8(acc + d + 8 * i);
    for (int64_t t = 0; t < n; ++t) {
      const f8 wt = splat8(w[t]);
      for (int i = 0; i < kVecs; ++i) a[i] += wt * load8(V + t * D + d + 8 * i);
    }
    for (int i = 0; i < kVecs; ++i) store8(acc + d + 8 * i, a[i]);
  }
  return d;
}

inline void accumulate_rows(const float* w, const float* V, int64_t n, int64_t D, float* acc) {
  int64_t d = accumulate_tile<8>(w, V, n, D, acc, 0);
  d = accumulate_tile<1>(w, V, n, D, acc, d);
  for (; d < D; ++d) {
    float a = acc[d];
    for (int64_t t = 0; t < n; ++t) a += w[t] * V[t * D + d];
    acc[d] = a;
  }
}

struct Params {
  const float* q;              // [B, Hq, D], float32
  const void* k_cache;         // [num_blocks, Hk, bs, D]
  const void* v_cache;
  const int64_t* block_tables; // [B, table_stride]
  const int64_t* seq_lens;     // [B]
  int64_t B, Hq, Hk, D, bs, num_blocks, table_stride, num_partitions;
  float scale;
  int64_t window, chunk;  // 0 = off: keys p - window < t (the last `window`), t // chunk == p // chunk
  float softcap;          // 0 = off: s = softcap * tanh(s / softcap) on the scaled score
  const float* sinks;     // [Hq] or null: one more denominator term per query head, no value
  float* out;        // [B, Hq, D] float32
  float* lse;        // [B, Hq]
  float* block_lse;  // [B, Hq, table_stride] or null; entries of blocks never visited are left alone
};

// Scratch per thread: q (G*D), acc (G*D), scores (G*bs), converted rows (bs*D), m (G), l (G).
inline int64_t scratch_floats(const Params& p) {
  const int64_t G = p.Hq / p.Hk;
  return 2 * G * p.D + G * p.bs + p.bs * p.D + 2 * G;
}

// Processes one work item. Returns false (touching nothing) on a physical block id out of range.
template <class L>
bool attend_item(const Params& p, int64_t b, int64_t h, int64_t part, float* work, float* part_out,
                 int64_t* bad_logical, int64_t* bad_value) {
  using T = typename L::T;
  const int64_t G = p.Hq / p.Hk, D = p.D, bs = p.bs;
  const int64_t seq_len = p.seq_lens[b];
  const int64_t num_logical = (seq_len + bs - 1) / bs;
  // The lowest key the query (at seq_len - 1) sees: blocks wholly before it are never read.
  const int64_t qpos = seq_len - 1;
  int64_t lo = 0;
  if (p.window > 0) lo = std::max<int64_t>(lo, qpos - p.window + 1);
  if (p.chunk > 0) lo = std::max<int64_t>(lo, qpos - qpos % p.chunk);
  const int64_t first = lo / bs;
  const int64_t per_part = (num_logical - first + p.num_partitions - 1) / p.num_partitions;
  const int64_t j0 = std::min(num_logical, first + part * per_part);
  const int64_t j1 = std::min(num_logical, j0 + per_part);
  const int64_t* table = p.block_tables + b * p.table_stride;
  for (int64_t j = j0; j < j1; ++j) {
    if (table[j] < 0 || table[j] >= p.num_blocks) {
      *bad_logical = j;
      *bad_value = table[j];
      return false;
    }
  }

  float* qs = work;
  float* acc = qs + G * D;
  float* s = acc + G * D;
  float* conv = s + G * bs;
  float* m = conv + bs * D;
  float* l = m + G;
  const float* qsrc = p.q + (b * p.Hq + h * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = qsrc[i] * p.scale;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, kNegInf);
  std::fill(l, l + G, 0.0f);

  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t skip = std::max<int64_t>(0, lo - j * bs);  // rows before the window (first block)
    const int64_t n = std::min(bs, seq_len - j * bs) - skip;
    const int64_t base = ((table[j] * p.Hk + h) * bs + skip) * D;
    if (j + 1 < j1) {  // the next block is elsewhere in memory: start pulling its first lines early
      const int64_t next = (table[j + 1] * p.Hk + h) * bs * D;
      __builtin_prefetch(kc + next);
      __builtin_prefetch(vc + next);
    }
    const float* K = L::rows(kc + base, conv, n * D);
    for (int64_t g = 0; g < G; ++g) score_rows(qs + g * D, K, n, D, s + g * bs);
    if (p.softcap > 0.0f) {
      const float cap = p.softcap, inv = 1.0f / p.softcap;
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s + g * bs;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) sg[t] = cap * tanh_fast(sg[t] * inv);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * bs;
      float block_max = kNegInf;
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
      const float m_new = std::max(m[g], block_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_nonpos(sg[t] - m_new);
        sum += sg[t];
      }
      if (m[g] != m_new) {
        const float alpha = std::exp(m[g] - m_new);  // exp(-inf) = 0 on the first block
        l[g] *= alpha;
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        m[g] = m_new;
      }
      l[g] += sum;
      if (p.block_lse) p.block_lse[(b * p.Hq + h * G + g) * p.table_stride + j] = m_new + std::log(sum);
    }
    const float* V = L::rows(vc + base, conv, n * D);
    for (int64_t g = 0; g < G; ++g) accumulate_rows(s + g * bs, V, n, D, acc + g * D);
  }

  if (p.sinks != nullptr && part == 0) {  // the sink joins one partition only, so the merge counts it once
    for (int64_t g = 0; g < G; ++g) {
      const float sink = p.sinks[h * G + g];
      const float m_new = std::max(m[g], sink);
      const float alpha = std::exp(m[g] - m_new);  // 0 when the partition saw no key (m = -inf)
      l[g] = l[g] * alpha + std::exp(sink - m_new);
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
      m[g] = m_new;
    }
  }

  if (part_out == nullptr) {  // single partition: normalize in place
    for (int64_t g = 0; g < G; ++g) {
      const int64_t row = b * p.Hq + h * G + g;
      const float inv = 1.0f / l[g];
      float* o = p.out + row * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      p.lse[row] = m[g] + std::log(l[g]);
    }
  } else {  // partial record per query head: [m, l, acc[D]]
    for (int64_t g = 0; g < G; ++g) {
      float* rec = part_out + g * (D + 2);
      rec[0] = m[g];
      rec[1] = l[g];
      std::memcpy(rec + 2, acc + g * D, D * sizeof(float));
    }
  }
  return true;
}

// Elements of K per thread below which another thread costs more than it saves (waking a thread and
// the barrier are microseconds; 64 Ki floats of K plus V stream in about that time).
constexpr int64_t kGrainElements = 1 << 16;

template <class L>
int64_t decode(const Params& p, int max_threads, int64_t* bad) {
  const int64_t G = p.Hq / p.Hk, P = p.num_partitions;
  const int64_t num_items = p.B * p.Hk * P;
  int64_t total_tokens = 0;
  for (int64_t b = 0; b < p.B; ++b) total_tokens += p.seq_lens[b];
  const int64_t useful = std::max<int64_t>(1, total_tokens * p.Hk * p.D / kGrainElements);
  const int num_threads = static_cast<int>(std::min<int64_t>({max_threads, useful, num_items}));
  std::vector<float> partials;
  if (P > 1) partials.resize(static_cast<size_t>(num_items * G * (p.D + 2)));
  int64_t status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> work(static_cast<size_t>(scratch_floats(p)));
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t b = item / (p.Hk * P), h = (item / P) % p.Hk, part = item % P;
      float* part_out = P > 1 ? partials.data() + item * G * (p.D + 2) : nullptr;
      int64_t bad_logical = 0, bad_value = 0;
      if (!attend_item<L>(p, b, h, part, work.data(), part_out, &bad_logical, &bad_value)) {
#pragma omp critical(pagedkv_bad_block)
        {
          if (status == 0) {
            status = 1;
            bad[0] = b;
            bad[1] = bad_logical;
            bad[2] = bad_value;
          }
        }
      }
    }
    if (P > 1 && status == 0) {
      // Merge the partitions of each (sequence, query head) by their log-sum-exp.
#pragma omp for schedule(static)
      for (int64_t row = 0; row < p.B * p.Hq; ++row) {
        const int64_t b = row / p.Hq, hq = row % p.Hq, h = hq / G, g = hq % G;
        const float* first = partials.data() + ((b * p.Hk + h) * P * G + g) * (p.D + 2);
        const int64_t stride = G * (p.D + 2);
        float m_max = kNegInf;
        for (int64_t i = 0; i < P; ++i) m_max = std::max(m_max, first[i * stride]);
        float total = 0.0f;
        float* o = p.out + row * p.D;
        std::fill(o, o + p.D, 0.0f);
        for (int64_t i = 0; i < P; ++i) {
          const float* rec = first + i * stride;
          if (rec[1] == 0.0f) continue;  // empty partition
          const float w = std::exp(rec[0] - m_max);
          total += rec[1] * w;
#pragma omp simd
          for (int64_t d = 0; d < p.D; ++d) o[d] += w * rec[2 + d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < p.D; ++d) o[d] *= inv;
        p.lse[row] = m_max + std::log(total);
      }
    }
  }
  return status;
}

}  // namespace

extern "C" {

int pagedkv_abi_version() { return 2; }

// dtype: 0 = float32, 1 = float16, 2 = bfloat16 (of k_cache / v_cache). Returns 0 on success, 1 when
// a physical block id is out of range (bad = {sequence, logical block, id}); out/lse are then garbage.
int64_t pagedkv_paged_decode(int64_t dtype, const float* q, const void* k_cache, const void* v_cache,
                             const int64_t* block_tables, const int64_t* seq_lens, int64_t B, int64_t Hq,
                             int64_t Hk, int64_t D, int64_t block_size, int64_t num_blocks,
                             int64_t table_stride, int64_t num_partitions, float scale, int64_t window,
                             int64_t chunk, float softcap, const float* sinks, float* out, float* lse,
                             float* block_lse, int64_t num_threads, int64_t* bad) {
  const Params p{q, k_cache, v_cache, block_tables, seq_lens, B, Hq, Hk, D, block_size, num_blocks,
                 table_stride, num_partitions, scale, window, chunk, softcap, sinks, out, lse, block_lse};
  const int threads = static_cast<int>(std::max<int64_t>(1, num_threads));
  switch (dtype) {
    case 0: return decode<F32>(p, threads, bad);
    case 1: return decode<F16>(p, threads, bad);
    case 2: return decode<BF16>(p, threads, bad);
    default: return 2;
  }
}

}  // extern "C"
