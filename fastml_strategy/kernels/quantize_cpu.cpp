// CPU kernels of FastML's quantization codec, bit-exact with fastml_strategy/kernels/reference.py.
//
// Plain C ABI (no torch or Python headers: it compiles in about two seconds and is loaded with ctypes,
// which releases the GIL for the call). Built by fastml_strategy/kernels/cpu.py with
//   g++ -O3 -march=native -ffp-contract=off -fno-fast-math -fno-trapping-math -shared -fPIC
// -ffp-contract=off matters: the format is IEEE fp32 with one rounding per operation, and a fused
// multiply-add in (v - mn) * inv + u or mn + q * scale would change bytes.
//
// Encoder, per block of `bs` elements (the block lives in L1):
//   pass 1: v = float(x) + r into a block buffer, with 16-lane min / max / (v * 0) accumulators
//           (GCC vector extensions, so vectorisation does not hang on the optimiser's mood; a NaN
//           or inf makes v * 0 a NaN: the block's non-finite flag);
//   per block: scale, inverse, exactly as the reference;
//   pass 2: codes q = trunc(clamp((v - mn) * inv + u, 0, L)) (= the reference's clamp(floor(.)) for
//           these non-negative values; NaN -> 0) into a byte buffer, and the new residual
//           v - (mn + q * scale);
//   pack:   8 one-byte codes (a uint64) -> 8*BITS bits by three shift/mask/or stages, stored as BITS
//           bytes.
// Decoder: the reverse stages expand BITS bytes into 8 one-byte codes, then a vectorised
// y = mn + q * scale, stored or added to `out` (or scatter-added at `idx`, for top-k values).
//
// Blocks are independent and byte-aligned in the payload, so `nthreads` threads take contiguous
// ranges of blocks.

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the packing code assumes a little-endian host"
#endif

namespace {

constexpr uint32_t kHashM1 = 0x7FEB352Du;
constexpr uint32_t kHashM2 = 0x846CA68Bu;
constexpr int kLanes = 16;

// ---- 16-lane vectors (GCC/Clang vector extensions: AVX-512, AVX2, SSE or NEON as available) ------

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint8_t vb __attribute__((vector_size(16)));
static_assert(sizeof(vf) / sizeof(float) == kLanes, "16 lanes");


// ---- input conversion (exact) ----------------------------------------------------------------

struct F32 {
  using T = float;
  static inline float cvt(float v) { return v; }
  static inline vf vload(const float* p);
};

struct BF16 {
  using T = uint16_t;
  static inline vf vload(const uint16_t* p);
  static inline float cvt(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct F16 {
  using T = uint16_t;
  static inline vf vload(const uint16_t* p);
  static inline float cvt(uint16_t h) {
#if defined(__F16C__) && defined(__FLT16_MAX__)
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return static_cast<float>(v);
#else
    // Exact IEEE half -> single, subnormals included.
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0x1Fu) {
      u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
      u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
      u = sign;
    } else {
      float f = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2**-24, exact
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
  }
};

inline float uniform(uint32_t seed_s, uint64_t idx) {
  uint32_t h = static_cast<uint32_t>(idx) + seed_s;
  h ^= h >> 16;
  h *= kHashM1;
  h ^= h >> 15;
  h *= kHashM2;
  h ^= h >> 16;
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline vf load16(const float* p) { return loadf(p); }
inline vf load16_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline vf load16_f16(const uint16_t* p) {
#if defined(__FLT16_MAX__)
  typedef _Float16 vhf __attribute__((vector_size(32)));
  vhf h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vf);
#else
  vf f;
  for (int j = 0; j < kLanes; ++j) f[j] = F16::cvt(p[j]);
  return f;
#endif
}

inline vf F32::vload(const float* p) { return load16(p); }
inline vf BF16::vload(const uint16_t* p) { return load16_bf16(p); }
inline vf F16::vload(const uint16_t* p) { return load16_f16(p); }

inline vf uniform16(uint32_t seed_s, uint64_t idx0) {
  const vu iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vu h = iota + (static_cast<uint32_t>(idx0) + seed_s);
  h ^= h >> 16;
  h *= kHashM1;
  h ^= h >> 15;
  h *= kHashM2;
  h ^= h >> 16;
  return __builtin_convertvector(__builtin_convertvector(h >> 8, vi), vf) * (1.0f / 16777216.0f);
}

// ---- bit packing: 8 one-byte codes <-> 8*BITS bits ---------------------------------------------

// `width` low bits set in every `lane`-bit lane of a uint64.
constexpr uint64_t rep_mask(int width, int lane) {
  uint64_t m = 0;
  for (int i = 0; i < 64; i += lane) m |= ((uint64_t{1} << width) - 1) << i;
  return m;
}

// 8 one-byte codes (each < 2**BITS) -> their 8*BITS-bit little-endian stream, in three stages.
template <int BITS>
inline uint64_t compress8(uint64_t x) {
  if (BITS == 8) return x;
  constexpr uint64_t m8 = rep_mask(BITS, 16), m16 = rep_mask(2 * BITS, 32), m32 = rep_mask(4 * BITS, 64);
  x = (x & m8) | (((x >> 8) & m8) << BITS);
  x = (x & m16) | (((x >> 16) & m16) << (2 * BITS));
  x = (x & m32) | (((x >> 32) & m32) << (4 * BITS));
  return x;
}

// The inverse of compress8 (bits above 8*BITS must be 0).
template <int BITS>
inline uint64_t expand8(uint64_t x) {
  if (BITS == 8) return x;
  constexpr uint64_t m8 = rep_mask(BITS, 16), m16 = rep_mask(2 * BITS, 32), m32 = rep_mask(4 * BITS, 64);
  x = (x & m32) | (((x >> (4 * BITS)) & m32) << 32);
  x = (x & m16) | (((x >> (2 * BITS)) & m16) << 16);
  x = (x & m8) | (((x >> BITS) & m8) << 8);
  return x;
}

// Pack `ngroups` groups of 8 codes from q into dst (BITS bytes per group). `room` = bytes writable
// at dst (the block's payload); 8-byte stores overlap the next group while they fit in it.
template <int BITS>
void pack(const uint8_t* q, int64_t ngroups, uint8_t* dst, int64_t room) {
  int64_t g = 0;
  for (; g < ngroups && g * BITS + 8 <= room; ++g) {
    uint64_t w;
    std::memcpy(&w, q + 8 * g, 8);
    w = compress8<BITS>(w);
    std::memcpy(dst + g * BITS, &w, 8);
  }
  for (; g < ngroups; ++g) {
    uint64_t w;
    std::memcpy(&w, q + 8 * g, 8);
    w = compress8<BITS>(w);
    int64_t nb = room - g * BITS < BITS ? room - g * BITS : BITS;
    std::memcpy(dst + g * BITS, &w, nb);
  }
}

// Unpack `ngroups` groups into q (8 codes each) from src, of which `avail` bytes are readable.
template <int BITS>
void unpack(const uint8_t* src, int64_t ngroups, uint8_t* q, int64_t avail) {
  int64_t g = 0;
  for (; g < ngroups && g * BITS + 8 <= avail; ++g) {
    uint64_t w;
    std::memcpy(&w, src + g * BITS, 8);
    if (BITS < 8) w &= (1ull << (8 * BITS)) - 1;
    w = expand8<BITS>(w);
    std::memcpy(q + 8 * g, &w, 8);
  }
  for (; g < ngroups; ++g) {
    uint64_t w = 0;
    int64_t nb = avail - g * BITS;
    nb = nb < 0 ? 0 : (nb < BITS ? nb : BITS);
    std::memcpy(&w, src + g * BITS, nb);
    w = expand8<BITS>(w);
    std::memcpy(q + 8 * g, &w, 8);
  }
}

using PackFn = void (*)(const uint8_t*, int64_t, uint8_t*, int64_t);
using UnpackFn = void (*)(const uint8_t*, int64_t, uint8_t*, int64_t);

PackFn pack_fn(int bits) {
  static const PackFn fns[9] = {nullptr, pack<1>, pack<2>, pack<3>, pack<4>, pack<5>, pack<6>, pack<7>, pack<8>};
  return fns[bits];
}
UnpackFn unpack_fn(int bits) {
  static const UnpackFn fns[9] = {nullptr, unpack<1>, unpack<2>, unpack<3>, unpack<4>, unpack<5>, unpack<6>, unpack<7>, unpack<8>};
  return fns[bits];
}

// ---- encoder ----------------------------------------------------------------------------------

struct EncodeArgs {
  const void* x;
  const float* r;
  float* rout;
  uint8_t* packed;
  float* meta;
  int64_t n;
  int64_t bs;
  int bits;
  uint32_t seed_s;
};

template <class In, bool HAS_RES, bool STOCH>
void encode_blocks(const EncodeArgs& a, int64_t b0, int64_t b1) {
  using T = typename In::T;
  const T* x = static_cast<const T*>(a.x);
  const int64_t bs = a.bs;
  const int bits = a.bits;
  const float L = static_cast<float>((1 << bits) - 1);
  const PackFn packf = pack_fn(bits);
  std::vector<float> vbuf_(bs + kLanes);
  std::vector<uint8_t> qbuf_(bs + 8);
  float* vbuf = vbuf_.data();
  uint8_t* qbuf = qbuf_.data();

  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * bs;
    const int64_t len = a.n - start < bs ? a.n - start : bs;
    const T* xb = x + start;
    const float* rb = HAS_RES ? a.r + start : nullptr;

    // pass 1: v, min, max, non-finite
    vf vmn = vf{} + INFINITY, vmx = vf{} - INFINITY, vz = vf{};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      vf v = In::vload(xb + i);
      if (HAS_RES) v = v + loadf(rb + i);
      storef(vbuf + i, v);
      vmn = v < vmn ? v : vmn;
      vmx = v > vmx ? v : vmx;
      vz = vz + v * 0.0f;  // NaN for a NaN or an inf
    }
    float mn = INFINITY, mx = -INFINITY, z = 0.0f;
    for (; i < len; ++i) {
      float v = In::cvt(xb[i]);
      if (HAS_RES) v = v + rb[i];
      vbuf[i] = v;
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
      z = z + v * 0.0f;
    }
    for (int j = 0; j < kLanes; ++j) {
      mn = vmn[j] < mn ? vmn[j] : mn;
      mx = vmx[j] > mx ? vmx[j] : mx;
      z = z + vz[j];
    }
    // v * 0 is NaN for a NaN or an inf. The block must also be representable (format step 2): a
    // finite range, and a top code that decodes to a finite number.
    const float diff = mx - mn;
    float scale;
    if (std::isinf(diff)) {  // finite block whose range overflows: halve, divide, double, cap
      scale = ((mx * 0.5f - mn * 0.5f) / L) * 2.0f;
      if (scale > FLT_MAX) scale = FLT_MAX;
    } else {
      scale = diff / L;
    }
    const bool finite = (z == 0.0f) && std::isfinite(diff) && std::isfinite(mn + L * scale);

    float* mb = a.meta + 2 * blk;
    uint8_t* pb = a.packed + start * bits / 8;
    const int64_t groups = (len + 7) / 8;
    // This block's bytes only: a wider overlapping store would race with the thread that owns the
    // next block.
    const int64_t room = (len * bits + 7) / 8;
    if (!finite) {
      mb[0] = NAN;
      mb[1] = NAN;
      std::memset(pb, 0, static_cast<size_t>((len * bits + 7) / 8));
      if (HAS_RES && a.rout != a.r) std::memcpy(a.rout + start, rb, sizeof(float) * len);
      continue;
    }
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    mb[0] = mn;
    mb[1] = scale;

    // pass 2: codes and the new residual. For t >= 0, clamp(floor(t), 0, L) = trunc(min(t, L)), so
    // the clamp comes first and a truncating conversion does the floor; NaN fails both tests -> 0.
    float* ro = HAS_RES ? a.rout + start : nullptr;
    int64_t k = 0;
    for (; k + kLanes <= len; k += kLanes) {
      vf v = loadf(vbuf + k);
      vf t = (v - mn) * inv;
      t = t + (STOCH ? uniform16(a.seed_s, static_cast<uint64_t>(start + k)) : vf{} + 0.5f);
      t = t >= 0.0f ? (t <= L ? t : vf{} + L) : vf{};
      vi qi = __builtin_convertvector(t, vi);
      vb q8 = __builtin_convertvector(qi, vb);
      std::memcpy(qbuf + k, &q8, sizeof(q8));
      if (HAS_RES) {
        vf y = mn + __builtin_convertvector(qi, vf) * scale;
        storef(ro + k, v - y);
      }
    }
    for (; k < len; ++k) {
      float t = (vbuf[k] - mn) * inv;
      t = t + (STOCH ? uniform(a.seed_s, static_cast<uint64_t>(start + k)) : 0.5f);
      t = t >= 0.0f ? (t <= L ? t : L) : 0.0f;
      int32_t qi = static_cast<int32_t>(t);
      qbuf[k] = static_cast<uint8_t>(qi);
      if (HAS_RES) {
        float y = mn + static_cast<float>(qi) * scale;
        ro[k] = vbuf[k] - y;
      }
    }
    for (int64_t k = len; k < groups * 8; ++k) qbuf[k] = 0;
    packf(qbuf, groups, pb, room);
  }
}

using EncodeFn = void (*)(const EncodeArgs&, int64_t, int64_t);

template <class In>
EncodeFn encode_fn(bool has_res, bool stoch) {
  if (has_res) return stoch ? encode_blocks<In, true, true> : encode_blocks<In, true, false>;
  return stoch ? encode_blocks<In, false, true> : encode_blocks<In, false, false>;
}

// ---- decoder ----------------------------------------------------------------------------------

struct DecodeArgs {
  const uint8_t* packed;
  int64_t avail;  // readable payload bytes
  const float* meta;
  float* out;
  const int64_t* idx;
  int64_t n;
  int64_t bs;
  int bits;
};

template <int MODE>  // 0: store, 1: add, 2: scatter-add at idx
void decode_blocks(const DecodeArgs& a, int64_t b0, int64_t b1) {
  const int64_t bs = a.bs;
  const int bits = a.bits;
  const UnpackFn unpackf = unpack_fn(bits);
  std::vector<uint8_t> qbuf_(bs + 8);
  uint8_t* qbuf = qbuf_.data();
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * bs;
    const int64_t len = a.n - start < bs ? a.n - start : bs;
    const int64_t off = start * bits / 8;
    unpackf(a.packed + off, (len + 7) / 8, qbuf, a.avail - off);
    const float mn = a.meta[2 * blk], sc = a.meta[2 * blk + 1];
    if (MODE == 2) {
      const int64_t* ib = a.idx + start;
      for (int64_t k = 0; k < len; ++k) a.out[ib[k]] = a.out[ib[k]] + (mn + static_cast<float>(qbuf[k]) * sc);
      continue;
    }
    float* ob = a.out + start;
    for (int64_t k = 0; k < len; ++k) {
      float y = mn + static_cast<float>(qbuf[k]) * sc;
      ob[k] = MODE == 1 ? ob[k] + y : y;
    }
  }
}

template <class Fn>
void run_parallel(int64_t nblocks, int nthreads, Fn fn) {
  if (nthreads <= 1 || nblocks < 2) {
    fn(0, nblocks);
    return;
  }
  if (nthreads > nblocks) nthreads = static_cast<int>(nblocks);
  std::vector<std::thread> pool;
  pool.reserve(nthreads - 1);
  const int64_t per = (nblocks + nthreads - 1) / nthreads;
  for (int t = 1; t < nthreads; ++t) {
    int64_t b0 = t * per, b1 = b0 + per < nblocks ? b0 + per : nblocks;
    if (b0 < b1) pool.emplace_back([=] { fn(b0, b1); });
  }
  fn(0, per < nblocks ? per : nblocks);
  for (auto& th : pool) th.join();
}

}  // namespace

extern "C" {

int fastml_cpu_abi_version() { return 1; }

// dtype: 0 float32, 1 float16, 2 bfloat16. r == nullptr: no error feedback. Returns 0, or a
// negative value for invalid arguments.
int fastml_quantize(const void* x, int dtype, int64_t n, const float* r, float* rout, uint8_t* packed,
                    float* meta, int bits, int64_t bs, int stochastic, uint32_t seed_s, int nthreads) {
  if (bits < 1 || bits > 8 || bs < 8 || (bs & (bs - 1)) != 0 || n < 0) return -1;
  if (n == 0) return 0;
  EncodeArgs a{x, r, rout ? rout : const_cast<float*>(r), packed, meta, n, bs, bits, seed_s};
  const bool has_res = r != nullptr, st = stochastic != 0;
  EncodeFn fn;
  switch (dtype) {
    case 0: fn = encode_fn<F32>(has_res, st); break;
    case 1: fn = encode_fn<F16>(has_res, st); break;
    case 2: fn = encode_fn<BF16>(has_res, st); break;
    default: return -2;
  }
  const int64_t nblocks = (n + bs - 1) / bs;
  run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
  return 0;
}

// mode: 0 out = y, 1 out += y, 2 out[idx[i]] += y[i] (idx unique; int64). avail: payload bytes.
int fastml_dequantize(const uint8_t* packed, int64_t avail, const float* meta, int64_t n, int bits,
                      int64_t bs, float* out, int mode, const int64_t* idx, int nthreads) {
  if (bits < 1 || bits > 8 || bs < 8 || (bs & (bs - 1)) != 0 || n < 0) return -1;
  if (n == 0) return 0;
  DecodeArgs a{packed, avail, meta, out, idx, n, bs, bits};
  const int64_t nblocks = (n + bs - 1) / bs;
  switch (mode) {
    case 0: run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { decode_blocks<0>(a, b0, b1); }); break;
    case 1: run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { decode_blocks<1>(a, b0, b1); }); break;
    case 2: decode_blocks<2>(a, 0, nblocks); break;  // scatter: one thread (indices may share lines)
    default: return -2;
  }
  return 0;
}

}  // extern "C"
