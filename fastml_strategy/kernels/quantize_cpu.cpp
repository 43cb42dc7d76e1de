// CPU kernels of FastML's quantization codec, bit-exact with fastml_strategy/kernels/reference.py.
//
// Plain C ABI (no torch or Python headers: it compiles in about two seconds and is loaded with ctypes,
// which releases the GIL for the call). Built by fastml_strategy/kernels/cpu.py with
//   g++ -O3 -march=native -ffp-contract=off -fno-fast-math -fno-trapping-math -shared -fPIC
// -ffp-contract=off matters: the format is IEEE fp32 with one rounding per operation, and a fused
// multiply-add in (v - mn) * inv + u or mn + q * scale would change bytes. (The intrinsics below are
// separate multiplies and adds; none is an FMA.)
//
// Encoder, per block of `bs` elements (the block lives in L1), in chunks of 32 elements:
//   pass 1: v = float(x) + r into a block buffer, with running min / max / sum of v * 0 (a NaN or
//           inf makes v * 0 a NaN: the block's non-finite flag);
//   per block: scale, inverse, exactly as the reference;
//   pass 2: codes q = trunc(min(max(t, 0), L)) for t = (v - mn) * inv + u (= the reference's
//           clamp(floor(t), 0, L); NaN -> 0), narrowed int32 -> uint8 into a byte buffer (8-bit
//           codes: straight into the payload), and the new residual v - (mn + q * scale);
//   pack:   8 one-byte codes (a uint64) -> 8*BITS bits by three shift/mask/or stages, on the 2 or 4
//           uint64 lanes of a SIMD register at once, stored as BITS bytes per group.
// Decoder: the reverse stages expand BITS bytes into 8 one-byte codes (8-bit codes are read in
// place), then y = mn + q * scale, stored or added to `out`.
//
// Explicit SIMD, one instruction set per build (`fastml_cpu_isa()` names it):
//   avx2    (__AVX2__, so AVX-512 machines too)  8 lanes; 32 codes narrowed by two packs, one
//           packus and one permute;
//   sse2    (any x86-64)                         4 lanes; the same narrowing in 128 bits;
//   neon    (aarch64)                            4 lanes; vmovn twice;
//   scalar  (anything else, or -DFASTML_CPU_SCALAR=1: the build cpu.py calls "generic").
// No 512-bit kernels: on a Zen 4 EPYC (family 25; benchmarks/RESULTS.md) a 16-lane AVX-512 version was
// bit-exact and as fast in L2, but slower from memory (100 MB, one thread: int4 encode 11.1 against
// 14.8 GB/s for these 8-lane kernels in the same -march=native build, and 1.4-1.7x slower still
// with 512-bit stores), so an AVX-512 machine runs the AVX2 kernels (GCC's own default vector width
// for most -march targets is 256 bits too); the native build still gets that CPU's encodings and
// tuning. One kernel for every x86 machine with AVX2 is also one kernel to measure and test.
// Why not GCC's generic 16-lane vectors (vector_size(64)), as before: without AVX-512, GCC expands
// most operations on them piecewise, lane by lane (see -Wvector-operation-performance): the
// `v < acc ? v : acc` min/max and the nested `?:` clamp, the int32 -> uint8 and uint16 -> uint32
// __builtin_convertvector, the hash. The AVX2-only build (-march=x86-64-v3) ran scalar code with
// vpextrd/vpinsrb and stack spills: int4 encode at 0.76 GB/s against 14.7 with AVX-512.
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

#if !defined(FASTML_CPU_SCALAR) || !FASTML_CPU_SCALAR
#if defined(__AVX2__)
#define FASTML_ISA_AVX2 1
#elif defined(__SSE2__)
#define FASTML_ISA_SSE2 1
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define FASTML_ISA_NEON 1
#endif
#endif

#if defined(FASTML_ISA_AVX2) || defined(FASTML_ISA_SSE2)
#include <immintrin.h>
#elif defined(FASTML_ISA_NEON)
#include <arm_neon.h>
#endif

namespace {

constexpr uint32_t kHashM1 = 0x7FEB352Du;
constexpr uint32_t kHashM2 = 0x846CA68Bu;
// Elements per SIMD step: every ISA narrows / widens 32 codes at a time (a 32-byte store).
constexpr int kChunk = 32;

// ---- scalar conversions and the hash (exact; the tails and the scalar ISA use them) -------------

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bf16 as torch rounds it (c10::BFloat16): to nearest, ties to even; a NaN becomes 0x7FC0.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0u;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float f16_to_float(uint16_t h) {
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

inline uint32_t hash32(uint32_t h) {
  h ^= h >> 16;
  h *= kHashM1;
  h ^= h >> 15;
  h *= kHashM2;
  h ^= h >> 16;
  return h;
}

inline float uniform(uint32_t seed_s, uint64_t idx) {
  return static_cast<float>(hash32(static_cast<uint32_t>(idx) + seed_s) >> 8) * (1.0f / 16777216.0f);
}

// ---- one SIMD layer per instruction set ----------------------------------------------------------
//
// Each `Isa` has W float lanes and:
//   F / I                      float and int32 vectors
//   set1, zero, load, store    (float)
//   load_bf16, load_f16        W inputs -> fp32 (exact)
//   store_bf16                 W floats -> bf16 as float_to_bf16 rounds them
//   add, sub, mul, div         one IEEE rounding each
//   vmin(v, acc), vmax(v, acc) v < acc ? v : acc (and >): pass 1's running min / max (a NaN may be
//                              dropped or kept: the v * 0 flag marks the block non-finite anyway)
//   clamp(t, L)                min(max(t, 0), L) with NaN -> 0
//   cvtt, cvtf                 float -> int32 by truncation, int32 -> float (exact for codes)
//   uniform(seed_s, i0)        uniform(seed_s, i0 + lane), as the scalar one
//   codes32(q, v)              kChunk / W int32 vectors of codes (0..255) -> kChunk bytes at q
//   widen32(q, f)              kChunk bytes at q -> kChunk / W float vectors
//   lanes(v, out)              the W floats of v

#if defined(FASTML_ISA_AVX2)

struct Isa {
  static constexpr const char* kName = "avx2";
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  static F set1(float a) { return _mm256_set1_ps(a); }
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F load_bf16(const uint16_t* p) {
    I u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static void store_bf16(uint16_t* p, F v) {
    I u = _mm256_castps_si256(v);
    I lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    I r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // 8 values < 2**16 in 32-bit lanes -> 8 uint16 (packus works within each 128-bit half)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  static F load_f16(const uint16_t* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float f[W];
    for (int j = 0; j < W; ++j) f[j] = f16_to_float(p[j]);
    return _mm256_loadu_ps(f);
#endif
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F vmin(F v, F acc) { return _mm256_min_ps(v, acc); }
  static F vmax(F v, F acc) { return _mm256_max_ps(v, acc); }
  static F clamp(F t, F L) { return _mm256_min_ps(_mm256_max_ps(t, zero()), L); }
  static I cvtt(F v) { return _mm256_cvttps_epi32(v); }
  static F cvtf(I v) { return _mm256_cvtepi32_ps(v); }
  static F uniform(uint32_t seed_s, uint64_t i0) {
    I h = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                           _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i0) + seed_s)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kHashM1)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kHashM2)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    return mul(cvtf(_mm256_srli_epi32(h, 8)), set1(1.0f / 16777216.0f));
  }
  static void codes32(uint8_t* q, const I* v) {
    // Codes are 0..255, so the saturating packs are exact. Within each 128-bit half the packs
    // interleave the four vectors by 4 codes (a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7); one
    // dword permute restores the order.
    I ab = _mm256_packs_epi32(v[0], v[1]);
    I cd = _mm256_packs_epi32(v[2], v[3]);
    I b = _mm256_packus_epi16(ab, cd);
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  }
  static void widen32(const uint8_t* q, F* f) {
    for (int j = 0; j < 4; ++j)
      f[j] = cvtf(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j))));
  }
  static void lanes(F v, float* out) { _mm256_storeu_ps(out, v); }
};

#elif defined(FASTML_ISA_SSE2)

struct Isa {
  static constexpr const char* kName = "sse2";
  static constexpr int W = 4;
  using F = __m128;
  using I = __m128i;
  static F set1(float a) { return _mm_set1_ps(a); }
  static F zero() { return _mm_setzero_ps(); }
  static F load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, F v) { _mm_storeu_ps(p, v); }
  static F load_bf16(const uint16_t* p) {
    I h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));  // h << 16 per lane
  }
  static void store_bf16(uint16_t* p, F v) {
    I u = _mm_castps_si128(v);
    I lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    I r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7FFF), lsb)), 16);
    I nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    r = _mm_or_si128(_mm_andnot_si128(nan, r), _mm_and_si128(nan, _mm_set1_epi32(0x7FC0)));
    // 4 values < 2**16 -> uint16 with SSE2's signed pack: shift into int16's range and back
    I h = _mm_packs_epi32(_mm_sub_epi32(r, _mm_set1_epi32(0x8000)), _mm_setzero_si128());
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_xor_si128(h, _mm_set1_epi16(static_cast<short>(0x8000))));
  }
  static F load_f16(const uint16_t* p) {
#if defined(__F16C__)
    return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
    float f[W];
    for (int j = 0; j < W; ++j) f[j] = f16_to_float(p[j]);
    return _mm_loadu_ps(f);
#endif
  }
  static F add(F a, F b) { return _mm_add_ps(a, b); }
  static F sub(F a, F b) { return _mm_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static F div(F a, F b) { return _mm_div_ps(a, b); }
  static F vmin(F v, F acc) { return _mm_min_ps(v, acc); }
  static F vmax(F v, F acc) { return _mm_max_ps(v, acc); }
  static F clamp(F t, F L) { return _mm_min_ps(_mm_max_ps(t, zero()), L); }
  static I cvtt(F v) { return _mm_cvttps_epi32(v); }
  static F cvtf(I v) { return _mm_cvtepi32_ps(v); }
  static I mullo(I a, I b) {
#if defined(__SSE4_1__)
    return _mm_mullo_epi32(a, b);
#else
    I even = _mm_mul_epu32(a, b);
    I odd = _mm_mul_epu32(_mm_srli_epi64(a, 32), _mm_srli_epi64(b, 32));
    return _mm_unpacklo_epi32(_mm_shuffle_epi32(even, _MM_SHUFFLE(0, 0, 2, 0)),
                              _mm_shuffle_epi32(odd, _MM_SHUFFLE(0, 0, 2, 0)));
#endif
  }
  static F uniform(uint32_t seed_s, uint64_t i0) {
    I h = _mm_add_epi32(_mm_setr_epi32(0, 1, 2, 3),
                        _mm_set1_epi32(static_cast<int>(static_cast<uint32_t>(i0) + seed_s)));
    h = _mm_xor_si128(h, _mm_srli_epi32(h, 16));
    h = mullo(h, _mm_set1_epi32(static_cast<int>(kHashM1)));
    h = _mm_xor_si128(h, _mm_srli_epi32(h, 15));
    h = mullo(h, _mm_set1_epi32(static_cast<int>(kHashM2)));
    h = _mm_xor_si128(h, _mm_srli_epi32(h, 16));
    return mul(cvtf(_mm_srli_epi32(h, 8)), set1(1.0f / 16777216.0f));
  }
  static void codes32(uint8_t* q, const I* v) {
    for (int j = 0; j < 2; ++j) {
      I ab = _mm_packs_epi32(v[4 * j], v[4 * j + 1]);
      I cd = _mm_packs_epi32(v[4 * j + 2], v[4 * j + 3]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm_packus_epi16(ab, cd));
    }
  }
  static void widen32(const uint8_t* q, F* f) {
    const I z = _mm_setzero_si128();
    for (int j = 0; j < 2; ++j) {
      I b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j));
      I lo = _mm_unpacklo_epi8(b, z), hi = _mm_unpackhi_epi8(b, z);
      f[4 * j + 0] = cvtf(_mm_unpacklo_epi16(lo, z));
      f[4 * j + 1] = cvtf(_mm_unpackhi_epi16(lo, z));
      f[4 * j + 2] = cvtf(_mm_unpacklo_epi16(hi, z));
      f[4 * j + 3] = cvtf(_mm_unpackhi_epi16(hi, z));
    }
  }
  static void lanes(F v, float* out) { _mm_storeu_ps(out, v); }
};

#elif defined(FASTML_ISA_NEON)

struct Isa {
  static constexpr const char* kName = "neon";
  static constexpr int W = 4;
  using F = float32x4_t;
  using I = int32x4_t;
  static F set1(float a) { return vdupq_n_f32(a); }
  static F zero() { return vdupq_n_f32(0.0f); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static F load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static F load_f16(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
  static void store_bf16(uint16_t* p, F v) {
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFF), lsb));
    uint32x4_t is_num = vceqq_f32(v, v);
    r = vbslq_u32(is_num, r, vdupq_n_u32(0x7FC00000u));
    vst1_u16(p, vshrn_n_u32(r, 16));
  }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F vmin(F v, F acc) { return vminq_f32(v, acc); }
  static F vmax(F v, F acc) { return vmaxq_f32(v, acc); }
  // vmaxnm returns the number when one operand is NaN: max(NaN, 0) = 0.
  static F clamp(F t, F L) { return vminq_f32(vmaxnmq_f32(t, zero()), L); }
  static I cvtt(F v) { return vcvtq_s32_f32(v); }
  static F cvtf(I v) { return vcvtq_f32_s32(v); }
  static F uniform(uint32_t seed_s, uint64_t i0) {
    static const uint32_t iota[4] = {0, 1, 2, 3};
    uint32x4_t h = vaddq_u32(vld1q_u32(iota), vdupq_n_u32(static_cast<uint32_t>(i0) + seed_s));
    h = veorq_u32(h, vshrq_n_u32(h, 16));
    h = vmulq_u32(h, vdupq_n_u32(kHashM1));
    h = veorq_u32(h, vshrq_n_u32(h, 15));
    h = vmulq_u32(h, vdupq_n_u32(kHashM2));
    h = veorq_u32(h, vshrq_n_u32(h, 16));
    return mul(vcvtq_f32_u32(vshrq_n_u32(h, 8)), set1(1.0f / 16777216.0f));
  }
  static void codes32(uint8_t* q, const I* v) {
    for (int j = 0; j < 2; ++j) {
      uint16x8_t lo = vcombine_u16(vmovn_u32(vreinterpretq_u32_s32(v[4 * j])),
                                   vmovn_u32(vreinterpretq_u32_s32(v[4 * j + 1])));
      uint16x8_t hi = vcombine_u16(vmovn_u32(vreinterpretq_u32_s32(v[4 * j + 2])),
                                   vmovn_u32(vreinterpretq_u32_s32(v[4 * j + 3])));
      vst1q_u8(q + 16 * j, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
    }
  }
  static void widen32(const uint8_t* q, F* f) {
    for (int j = 0; j < 2; ++j) {
      uint8x16_t b = vld1q_u8(q + 16 * j);
      uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
      f[4 * j + 0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
      f[4 * j + 1] = vcvtq_f32_u32(vmovl_high_u16(lo));
      f[4 * j + 2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
      f[4 * j + 3] = vcvtq_f32_u32(vmovl_high_u16(hi));
    }
  }
  static void lanes(F v, float* out) { vst1q_f32(out, v); }
};

#else  // scalar: one lane; the compiler may still vectorise the fixed-size loops

struct Isa {
  static constexpr const char* kName = "scalar";
  static constexpr int W = 1;
  using F = float;
  using I = int32_t;
  static F set1(float a) { return a; }
  static F zero() { return 0.0f; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static F load_f16(const uint16_t* p) { return f16_to_float(*p); }
  static void store_bf16(uint16_t* p, F v) { *p = float_to_bf16(v); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F vmin(F v, F acc) { return v < acc ? v : acc; }
  static F vmax(F v, F acc) { return v > acc ? v : acc; }
  static F clamp(F t, F L) { return t > 0.0f ? (t < L ? t : L) : 0.0f; }
  static I cvtt(F v) { return static_cast<int32_t>(v); }
  static F cvtf(I v) { return static_cast<float>(v); }
  static F uniform(uint32_t seed_s, uint64_t i0) { return ::uniform(seed_s, i0); }
  static void codes32(uint8_t* q, const I* v) {
    for (int j = 0; j < kChunk; ++j) q[j] = static_cast<uint8_t>(v[j]);
  }
  static void widen32(const uint8_t* q, F* f) {
    for (int j = 0; j < kChunk; ++j) f[j] = static_cast<float>(q[j]);
  }
  static void lanes(F v, float* out) { *out = v; }
};

#endif

constexpr int kVecs = kChunk / Isa::W;  // vectors per chunk
static_assert(kChunk % Isa::W == 0, "a chunk is whole vectors");

// ---- input types --------------------------------------------------------------------------------

struct F32 {
  using T = float;
  static float cvt(float v) { return v; }
  static Isa::F vload(const float* p) { return Isa::load(p); }
};

struct BF16 {
  using T = uint16_t;
  static float cvt(uint16_t h) { return bf16_to_float(h); }
  static Isa::F vload(const uint16_t* p) { return Isa::load_bf16(p); }
};

struct F16 {
  using T = uint16_t;
  static float cvt(uint16_t h) { return f16_to_float(h); }
  static Isa::F vload(const uint16_t* p) { return Isa::load_f16(p); }
};

// ---- residual types (read and written) ------------------------------------------------------------

struct ResF32 : F32 {
  static float from(float v) { return v; }
  static void vstore(float* p, Isa::F v) { Isa::store(p, v); }
};

struct ResBF16 : BF16 {
  static uint16_t from(float v) { return float_to_bf16(v); }
  static void vstore(uint16_t* p, Isa::F v) { Isa::store_bf16(p, v); }
};

// ---- bit packing: 8 one-byte codes <-> 8*BITS bits ---------------------------------------------

// `width` low bits set in every `lane`-bit lane of a uint64.
constexpr uint64_t rep_mask(int width, int lane) {
  uint64_t m = 0;
  for (int i = 0; i < 64; i += lane) m |= ((uint64_t{1} << width) - 1) << i;
  return m;
}

// 8 one-byte codes (each < 2**BITS) -> their 8*BITS-bit little-endian stream, in three stages.
// (Shifts and masks, not BMI2's pext/pdep: those are microcoded and slow on AMD before Zen 3.)
// U: uint64_t, or a vector of them (GCC vector extension: the same stages on every lane).
template <int BITS, class U>
inline U compress8(U x) {
  if (BITS == 8) return x;
  constexpr uint64_t m8 = rep_mask(BITS, 16), m16 = rep_mask(2 * BITS, 32), m32 = rep_mask(4 * BITS, 64);
  x = (x & m8) | (((x >> 8) & m8) << BITS);
  x = (x & m16) | (((x >> 16) & m16) << (2 * BITS));
  x = (x & m32) | (((x >> 32) & m32) << (4 * BITS));
  return x;
}

// The inverse of compress8 (bits above 8*BITS must be 0).
template <int BITS, class U>
inline U expand8(U x) {
  if (BITS == 8) return x;
  constexpr uint64_t m8 = rep_mask(BITS, 16), m16 = rep_mask(2 * BITS, 32), m32 = rep_mask(4 * BITS, 64);
  x = (x & m32) | (((x >> (4 * BITS)) & m32) << 32);
  x = (x & m16) | (((x >> (2 * BITS)) & m16) << 16);
  x = (x & m8) | (((x >> BITS) & m8) << 8);
  return x;
}

// Groups of 8 codes that one SIMD register packs at once (1: scalar only).
#if defined(FASTML_ISA_AVX2)
constexpr int kPackGroups = 4;
#elif defined(FASTML_ISA_SSE2) || defined(FASTML_ISA_NEON)
constexpr int kPackGroups = 2;
#else
constexpr int kPackGroups = 1;
#endif
typedef uint64_t u64v __attribute__((vector_size(8 * kPackGroups)));

// Pack `ngroups` groups of 8 codes from q into dst (BITS bytes per group). `room` = bytes writable
// at dst (the block's payload); 8-byte stores overlap the next group while they fit in it.
template <int BITS>
void pack(const uint8_t* q, int64_t ngroups, uint8_t* dst, int64_t room) {
  int64_t g = 0;
  if (kPackGroups > 1 && BITS < 8) {
    // kPackGroups groups per register: the three stages on every 64-bit lane at once.
    for (; g + kPackGroups <= ngroups && (g + kPackGroups - 1) * BITS + 8 <= room; g += kPackGroups) {
      u64v w;
      std::memcpy(&w, q + 8 * g, sizeof(w));
      w = compress8<BITS>(w);
      for (int l = 0; l < kPackGroups; ++l) {
        uint64_t e = w[l];
        std::memcpy(dst + (g + l) * BITS, &e, 8);
      }
    }
  }
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
  if (kPackGroups > 1 && BITS < 8) {
    constexpr uint64_t keep = BITS < 8 ? (1ull << (8 * BITS)) - 1 : ~0ull;
    for (; g + kPackGroups <= ngroups && (g + kPackGroups - 1) * BITS + 8 <= avail; g += kPackGroups) {
      u64v w;
      for (int l = 0; l < kPackGroups; ++l) {
        uint64_t e;
        std::memcpy(&e, src + (g + l) * BITS, 8);
        w[l] = e;
      }
      w = expand8<BITS>(w & keep);
      std::memcpy(q + 8 * g, &w, sizeof(w));
    }
  }
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
  static const UnpackFn fns[9] = {nullptr,   unpack<1>, unpack<2>, unpack<3>, unpack<4>,
                                  unpack<5>, unpack<6>, unpack<7>, unpack<8>};
  return fns[bits];
}

// ---- encoder ----------------------------------------------------------------------------------

struct EncodeArgs {
  const void* x;
  const void* r;  // the residual's type: ResF32 or ResBF16
  void* rout;
  uint8_t* packed;
  float* meta;
  int64_t n;
  int64_t bs;
  int bits;
  uint32_t seed_s;
};

// Where a block's encoding goes, and how: shared by the encoder and the fused reduce.
struct BlockOut {
  float* meta;      // 2 floats per block: min, scale
  uint8_t* packed;  // the payload
  int bits;
  uint32_t seed_s;
};

// The second half of a block's encoding, once its values v are in `vbuf` with their min, max and
// sum of v * 0 (`z`): the block's metadata, its codes (packed into the payload) and, with HAS_RES,
// the new residual `ro` (`rb`: the residual read, copied to `ro` unchanged for a non-finite block).
template <class Res, bool HAS_RES, bool STOCH>
inline void quantize_block(const BlockOut& o, const float* vbuf, uint8_t* qbuf, int64_t blk, int64_t start,
                           int64_t len, float mn, float mx, float z, const typename Res::T* rb,
                           typename Res::T* ro) {
  using F = Isa::F;
  using I = Isa::I;
  constexpr int W = Isa::W;
  const int bits = o.bits;
  const float L = static_cast<float>((1 << bits) - 1);
  const int64_t main_len = len - len % kChunk;
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

  float* mb = o.meta + 2 * blk;
  uint8_t* pb = o.packed + start * bits / 8;
  const int64_t groups = (len + 7) / 8;
  // This block's bytes only: a wider overlapping store would race with the thread that owns the
  // next block.
  const int64_t room = (len * bits + 7) / 8;
  if (!finite) {
    mb[0] = NAN;
    mb[1] = NAN;
    std::memset(pb, 0, static_cast<size_t>(room));
    if (HAS_RES && ro != rb) std::memcpy(ro, rb, sizeof(typename Res::T) * len);
    return;
  }
  const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  mb[0] = mn;
  mb[1] = scale;

  // pass 2: codes and the new residual. For t >= 0, clamp(floor(t), 0, L) = trunc(min(t, L)), so
  // the clamp comes first and a truncating conversion does the floor; NaN -> 0.
  uint8_t* qd = bits == 8 ? pb : qbuf;  // 8-bit codes are the payload: no packing
  const F vmn_b = Isa::set1(mn), vinv = Isa::set1(inv), vsc = Isa::set1(scale), vL = Isa::set1(L);
  const F half = Isa::set1(0.5f);
  for (int64_t k = 0; k < main_len; k += kChunk) {
    I qi[kVecs];
    for (int j = 0; j < kVecs; ++j) {
      const int64_t off = k + j * W;
      F v = Isa::load(vbuf + off);
      F t = Isa::mul(Isa::sub(v, vmn_b), vinv);
      t = Isa::add(t, STOCH ? Isa::uniform(o.seed_s, static_cast<uint64_t>(start + off)) : half);
      qi[j] = Isa::cvtt(Isa::clamp(t, vL));
      if (HAS_RES) {
        F y = Isa::add(vmn_b, Isa::mul(Isa::cvtf(qi[j]), vsc));
        Res::vstore(ro + off, Isa::sub(v, y));
      }
    }
    Isa::codes32(qd + k, qi);
  }
  for (int64_t k = main_len; k < len; ++k) {
    float t = (vbuf[k] - mn) * inv;
    t = t + (STOCH ? uniform(o.seed_s, static_cast<uint64_t>(start + k)) : 0.5f);
    t = t > 0.0f ? (t < L ? t : L) : 0.0f;
    int32_t qi = static_cast<int32_t>(t);
    qd[k] = static_cast<uint8_t>(qi);
    if (HAS_RES) {
      float y = mn + static_cast<float>(qi) * scale;
      ro[k] = Res::from(vbuf[k] - y);
    }
  }
  if (bits < 8) {
    for (int64_t k = len; k < groups * 8; ++k) qbuf[k] = 0;
    pack_fn(bits)(qbuf, groups, pb, room);
  }
}

// The running min / max / sum of v * 0 of pass 1, one chunk of kVecs vectors at a time: each chunk
// is reduced by a tree, then into one accumulator (accumulator arrays were spilled to the stack on
// every step). The encoder and the fused reduce use the same order, so a block's min is the same
// float (-0.0 and 0.0 included) whichever computed it.
struct MinMax {
  Isa::F vmn = Isa::set1(INFINITY), vmx = Isa::set1(-INFINITY), vz = Isa::zero();
  float mn = INFINITY, mx = -INFINITY, z = 0.0f;
  void chunk(const Isa::F* v) {
    Isa::F cmn = v[0], cmx = v[0], cz = Isa::mul(v[0], Isa::zero());  // v * 0: NaN for a NaN or an inf
    for (int j = 1; j < kVecs; ++j) {
      cmn = Isa::vmin(v[j], cmn);
      cmx = Isa::vmax(v[j], cmx);
      cz = Isa::add(cz, Isa::mul(v[j], Isa::zero()));
    }
    vmn = Isa::vmin(cmn, vmn);
    vmx = Isa::vmax(cmx, vmx);
    vz = Isa::add(vz, cz);
  }
  void scalar(float v) {  // the tail, after every chunk
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    z = z + v * 0.0f;
  }
  void lanes() {  // after the tail: the vector accumulators into mn / mx / z
    constexpr int W = Isa::W;
    float l0[W], l1[W], l2[W];
    Isa::lanes(vmn, l0);
    Isa::lanes(vmx, l1);
    Isa::lanes(vz, l2);
    for (int k = 0; k < W; ++k) {
      mn = l0[k] < mn ? l0[k] : mn;
      mx = l1[k] > mx ? l1[k] : mx;
      z = z + l2[k];
    }
  }
};

template <class In, class Res, bool HAS_RES, bool STOCH>
void encode_blocks(const EncodeArgs& a, int64_t b0, int64_t b1) {
  using T = typename In::T;
  using R = typename Res::T;
  using F = Isa::F;
  constexpr int W = Isa::W;
  const T* x = static_cast<const T*>(a.x);
  const int64_t bs = a.bs;
  const BlockOut o{a.meta, a.packed, a.bits, a.seed_s};
  std::vector<float> vbuf_(bs + kChunk);
  std::vector<uint8_t> qbuf_(bs + kChunk);
  float* vbuf = vbuf_.data();
  uint8_t* qbuf = qbuf_.data();

  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * bs;
    const int64_t len = a.n - start < bs ? a.n - start : bs;
    const int64_t main_len = len - len % kChunk;
    const T* xb = x + start;
    const R* rb = HAS_RES ? static_cast<const R*>(a.r) + start : nullptr;

    // pass 1: v, min, max, non-finite.
    MinMax m;
    for (int64_t i = 0; i < main_len; i += kChunk) {
      F v[kVecs];
      for (int j = 0; j < kVecs; ++j) {
        v[j] = In::vload(xb + i + j * W);
        if (HAS_RES) v[j] = Isa::add(v[j], Res::vload(rb + i + j * W));
        Isa::store(vbuf + i + j * W, v[j]);
      }
      m.chunk(v);
    }
    for (int64_t i = main_len; i < len; ++i) {
      float v = In::cvt(xb[i]);
      if (HAS_RES) v = v + Res::cvt(rb[i]);
      vbuf[i] = v;
      m.scalar(v);
    }
    m.lanes();
    quantize_block<Res, HAS_RES, STOCH>(o, vbuf, qbuf, blk, start, len, m.mn, m.mx, m.z, rb,
                                        HAS_RES ? static_cast<R*>(a.rout) + start : nullptr);
  }
}

using EncodeFn = void (*)(const EncodeArgs&, int64_t, int64_t);

template <class In>
EncodeFn encode_fn(bool has_res, bool res_bf16, bool stoch) {
  if (has_res && res_bf16)
    return stoch ? encode_blocks<In, ResBF16, true, true> : encode_blocks<In, ResBF16, true, false>;
  if (has_res) return stoch ? encode_blocks<In, ResF32, true, true> : encode_blocks<In, ResF32, true, false>;
  return stoch ? encode_blocks<In, ResF32, false, true> : encode_blocks<In, ResF32, false, false>;
}

// ---- decoder ----------------------------------------------------------------------------------

struct DecodeArgs {
  const uint8_t* packed;
  int64_t avail;  // readable payload bytes
  const float* meta;
  float* out;
  int64_t n;
  int64_t bs;
  int bits;
};

template <int MODE>  // 0: store, 1: add
void decode_blocks(const DecodeArgs& a, int64_t b0, int64_t b1) {
  using F = Isa::F;
  constexpr int W = Isa::W;
  const int64_t bs = a.bs;
  const int bits = a.bits;
  const UnpackFn unpackf = unpack_fn(bits);
  std::vector<uint8_t> qbuf_(bs + kChunk);
  uint8_t* qbuf = qbuf_.data();
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * bs;
    const int64_t len = a.n - start < bs ? a.n - start : bs;
    const int64_t off = start * bits / 8;
    const uint8_t* qs = qbuf;
    if (bits == 8) {
      qs = a.packed + off;  // 8-bit codes are the payload (n bytes, all readable)
    } else {
      unpackf(a.packed + off, (len + 7) / 8, qbuf, a.avail - off);
    }
    const float mn = a.meta[2 * blk], sc = a.meta[2 * blk + 1];
    float* ob = a.out + start;
    const F vmn = Isa::set1(mn), vsc = Isa::set1(sc);
    const int64_t main_len = len - len % kChunk;
    for (int64_t k = 0; k < main_len; k += kChunk) {
      F q[kVecs];
      Isa::widen32(qs + k, q);
      for (int j = 0; j < kVecs; ++j) {
        F y = Isa::add(vmn, Isa::mul(q[j], vsc));
        if (MODE == 1) y = Isa::add(Isa::load(ob + k + j * W), y);
        Isa::store(ob + k + j * W, y);
      }
    }
    for (int64_t k = main_len; k < len; ++k) {
      float y = mn + static_cast<float>(qs[k]) * sc;
      ob[k] = MODE == 1 ? ob[k] + y : y;
    }
  }
}

// ---- fused reduce: decode nsrc messages, sum, divide, encode (no residual) ------------------------
//
// The reduce step of scatter-reduce-allgather, one block at a time in L1: the block of every source
// is decoded and added in source order (the first stored, as decode mode 0, the others added, as
// mode 1), the sum divided by `divisor` (an IEEE division, as torch's div_), and the block encoded
// as the encoder would encode that fp32 tensor. The same bytes as dequantize + dequantize(add) ... +
// div_ + quantize, without writing and re-reading the fp32 sum: for 2 sources that is 24.5 bytes of
// memory traffic per element down to 1.5.

struct ReduceArgs {
  const uint8_t* const* packed;  // nsrc payloads
  const int64_t* avail;          // the readable bytes of each
  const float* const* meta;      // nsrc metadata arrays (2 floats per block)
  int nsrc;
  float divisor;
  uint8_t* out_packed;
  float* out_meta;
  int64_t n;
  int64_t bs;
  int bits;
  uint32_t seed_s;
};

template <bool STOCH>
void reduce_blocks(const ReduceArgs& a, int64_t b0, int64_t b1) {
  using F = Isa::F;
  constexpr int W = Isa::W;
  const int64_t bs = a.bs;
  const int bits = a.bits;
  const UnpackFn unpackf = unpack_fn(bits);
  const BlockOut o{a.out_meta, a.out_packed, bits, a.seed_s};
  std::vector<float> vbuf_(bs + kChunk);
  std::vector<uint8_t> qbuf_(bs + kChunk), qin_(bs + kChunk);
  float* vbuf = vbuf_.data();
  uint8_t* qbuf = qbuf_.data();
  uint8_t* qin = qin_.data();
  const F vdiv = Isa::set1(a.divisor);

  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t start = blk * bs;
    const int64_t len = a.n - start < bs ? a.n - start : bs;
    const int64_t main_len = len - len % kChunk;
    const int64_t off = start * bits / 8;
    MinMax m;
    for (int s = 0; s < a.nsrc; ++s) {
      const bool last = s == a.nsrc - 1;
      const uint8_t* qs = qin;
      if (bits == 8) {
        qs = a.packed[s] + off;
      } else {
        unpackf(a.packed[s] + off, (len + 7) / 8, qin, a.avail[s] - off);
      }
      const float smn = a.meta[s][2 * blk], ssc = a.meta[s][2 * blk + 1];
      const F vmn = Isa::set1(smn), vsc = Isa::set1(ssc);
      for (int64_t k = 0; k < main_len; k += kChunk) {
        F q[kVecs];
        Isa::widen32(qs + k, q);
        for (int j = 0; j < kVecs; ++j) {
          F y = Isa::add(vmn, Isa::mul(q[j], vsc));
          if (s > 0) y = Isa::add(Isa::load(vbuf + k + j * W), y);
          if (last) y = Isa::div(y, vdiv);
          Isa::store(vbuf + k + j * W, y);
          q[j] = y;
        }
        if (last) m.chunk(q);
      }
      for (int64_t k = main_len; k < len; ++k) {
        float y = smn + static_cast<float>(qs[k]) * ssc;
        if (s > 0) y = vbuf[k] + y;
        if (last) y = y / a.divisor;
        vbuf[k] = y;
      }
    }
    for (int64_t k = main_len; k < len; ++k) m.scalar(vbuf[k]);
    m.lanes();
    quantize_block<ResF32, false, STOCH>(o, vbuf, qbuf, blk, start, len, m.mn, m.mx, m.z, nullptr, nullptr);
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

int fastml_cpu_abi_version() { return 2; }

// The instruction set this build's kernels use: "avx2", "sse2", "neon" or "scalar".
const char* fastml_cpu_isa() { return Isa::kName; }

// dtype: 0 float32, 1 float16, 2 bfloat16 (x); r_dtype: 0 float32, 2 bfloat16 (the residual r and
// rout, read as float and written rounded to nearest even). r == nullptr: no error feedback. Returns 0,
// or a negative value for invalid arguments. (Newer than ABI version 2: look it up before use.)
int fastml_quantize_r(const void* x, int dtype, int64_t n, const void* r, void* rout, int r_dtype,
                      uint8_t* packed, float* meta, int bits, int64_t bs, int stochastic, uint32_t seed_s,
                      int nthreads) {
  if (bits < 1 || bits > 8 || bs < 8 || (bs & (bs - 1)) != 0 || n < 0) return -1;
  if (r_dtype != 0 && r_dtype != 2) return -2;
  if (n == 0) return 0;
  EncodeArgs a{x, r, rout ? rout : const_cast<void*>(r), packed, meta, n, bs, bits, seed_s};
  const bool has_res = r != nullptr, st = stochastic != 0, rb16 = r_dtype == 2;
  EncodeFn fn;
  switch (dtype) {
    case 0: fn = encode_fn<F32>(has_res, rb16, st); break;
    case 1: fn = encode_fn<F16>(has_res, rb16, st); break;
    case 2: fn = encode_fn<BF16>(has_res, rb16, st); break;
    default: return -2;
  }
  const int64_t nblocks = (n + bs - 1) / bs;
  run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { fn(a, b0, b1); });
  return 0;
}

// The encoder with a float32 residual (ABI version 2).
int fastml_quantize(const void* x, int dtype, int64_t n, const float* r, float* rout, uint8_t* packed,
                    float* meta, int bits, int64_t bs, int stochastic, uint32_t seed_s, int nthreads) {
  return fastml_quantize_r(x, dtype, n, r, rout, 0, packed, meta, bits, bs, stochastic, seed_s, nthreads);
}

// mode: 0 out = y, 1 out += y. avail: payload bytes.
int fastml_dequantize(const uint8_t* packed, int64_t avail, const float* meta, int64_t n, int bits,
                      int64_t bs, float* out, int mode, int nthreads) {
  if (bits < 1 || bits > 8 || bs < 8 || (bs & (bs - 1)) != 0 || n < 0) return -1;
  if (n == 0) return 0;
  DecodeArgs a{packed, avail, meta, out, n, bs, bits};
  const int64_t nblocks = (n + bs - 1) / bs;
  switch (mode) {
    case 0: run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { decode_blocks<0>(a, b0, b1); }); break;
    case 1: run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { decode_blocks<1>(a, b0, b1); }); break;
    default: return -2;
  }
  return 0;
}

// The reduce step: decode nsrc messages of n elements (payload `packed[s]`, `avail[s]` readable bytes,
// metadata `meta[s]`), sum them in source order, divide by `divisor` and encode the result into
// `packed_out` / `meta_out`, byte for byte as the separate calls would. Returns 0, or a negative
// value for invalid arguments. (Newer than ABI version 2: look it up before use.)
int fastml_reduce_quantize(const uint8_t* const* packed, const int64_t* avail, const float* const* meta,
                           int nsrc, float divisor, int64_t n, int bits, int64_t bs, uint8_t* packed_out,
                           float* meta_out, int stochastic, uint32_t seed_s, int nthreads) {
  if (bits < 1 || bits > 8 || bs < 8 || (bs & (bs - 1)) != 0 || n < 0 || nsrc < 1) return -1;
  if (n == 0) return 0;
  ReduceArgs a{packed, avail, meta, nsrc, divisor, packed_out, meta_out, n, bs, bits, seed_s};
  const int64_t nblocks = (n + bs - 1) / bs;
  if (stochastic) {
    run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { reduce_blocks<true>(a, b0, b1); });
  } else {
    run_parallel(nblocks, nthreads, [&](int64_t b0, int64_t b1) { reduce_blocks<false>(a, b0, b1); });
  }
  return 0;
}

}  // extern "C"
