// Digests of the compiled CPU codec's outputs over a fixed set of cases, one line per case, so that two
// builds (another instruction set, another architecture under an emulator) can be compared byte for
// byte without Python: tests/kernels/test_cpu_builds.py compiles this for the host and, where a
// cross compiler and qemu are installed, for aarch64 (NEON and scalar), and requires equal lines.
//
// Inputs come from a fixed xorshift generator (plus NaN, inf, subnormals, signed zeros and ranges that
// overflow fp32); every case hashes the payload, the metadata, the new residual and the decoded
// values (store and add) with FNV-1a. Then, per size, block size and bit-width: a bf16 residual, and
// the fused reduce of three messages. Two things are canonicalised before hashing,
// because the format does not fix them: the sign of a zero in the metadata (a block's min may be
// -0 or +0 depending on the lane that saw it first) and the payload of a NaN.

#include "../../fastml_strategy/kernels/quantize_cpu.cpp"

#include <cstdio>

namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform01() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  float normalish() { return (uniform01() + uniform01() + uniform01() - 1.5f) * 2.0f; }
};

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  void floats(const float* f, size_t n, bool zero_sign) {
    for (size_t i = 0; i < n; ++i) {
      float v = f[i];
      if (std::isnan(v)) v = NAN;
      if (zero_sign && v == 0.0f) v = 0.0f;
      bytes(&v, 4);
    }
  }
};

uint16_t to_bf16(float f) {  // truncation is fine: any bf16 pattern is a valid input
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_f16_bits(float f, Rng& rng) {  // a half with f's sign and a random exponent and mantissa
  uint16_t sign = f < 0 ? 0x8000 : 0;
  uint16_t exp = static_cast<uint16_t>(rng.next() % 31);  // 0..30: subnormals included, no inf/NaN
  return static_cast<uint16_t>(sign | (exp << 10) | (rng.next() & 0x3FF));
}

void make_input(std::vector<float>& x, int64_t n, uint64_t seed) {
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  x.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t blk = i / 64;
    const float mag = std::ldexp(1.0f, static_cast<int>(blk % 23) - 11);
    x[i] = rng.normalish() * mag;
  }
  // one special per 64-element stretch, cycling through the kinds (some stretches stay ordinary)
  for (int64_t b = 0; b * 64 < n; ++b) {
    const int64_t i = b * 64 + static_cast<int64_t>(rng.next() % 64);
    if (i >= n) continue;
    switch (b % 11) {
      case 1: x[i] = NAN; break;
      case 2: x[i] = INFINITY; break;
      case 3: x[i] = -INFINITY; break;
      case 4:
        for (int64_t k = b * 64; k < n && k < b * 64 + 64; ++k) x[k] = (k % 2 ? 3e38f : -3e38f);
        break;
      case 5:
        for (int64_t k = b * 64; k < n && k < b * 64 + 64; ++k) x[k] = rng.normalish() * 1e-42f;
        break;
      case 6:
        for (int64_t k = b * 64; k < n && k < b * 64 + 64; ++k) x[k] = (k % 2 ? 0.0f : -0.0f);
        break;
      case 7:
        for (int64_t k = b * 64; k < n && k < b * 64 + 64; ++k) x[k] = 3.25f;
        break;
      case 8:
        for (int64_t k = b * 64; k < n && k < b * 64 + 64; ++k) x[k] = (k % 2 ? FLT_MAX : -FLT_MAX);
        break;
      default: break;
    }
  }
}

}  // namespace

int main() {
  const int64_t sizes[] = {1, 13, 40, 1000, 5003, 30011};
  const int64_t block_sizes[] = {8, 64, 512};
  int cases = 0;
  std::printf("isa %s\n", fastml_cpu_isa());
  for (int64_t n : sizes) {
    std::vector<float> xf;
    make_input(xf, n, static_cast<uint64_t>(n));
    Rng rng{static_cast<uint64_t>(n) * 7 + 3};
    std::vector<uint16_t> xb(n), xh(n);
    for (int64_t i = 0; i < n; ++i) {
      xb[i] = to_bf16(xf[i]);
      xh[i] = to_f16_bits(xf[i], rng);
    }
    std::vector<float> r0(n);
    for (int64_t i = 0; i < n; ++i) r0[i] = rng.normalish() * 0.01f;

    for (int64_t bs : block_sizes) {
      for (int bits = 1; bits <= 8; ++bits) {
        for (int dtype = 0; dtype < 3; ++dtype) {
          for (int variant = 0; variant < 4; ++variant) {  // bit 0: residual, bit 1: stochastic
            const bool res = variant & 1, stoch = variant & 2;
            const int threads = (n > 1000 && bits == 5) ? 3 : 1;
            const void* x = dtype == 0 ? static_cast<const void*>(xf.data())
                                       : dtype == 1 ? static_cast<const void*>(xh.data())
                                                    : static_cast<const void*>(xb.data());
            const int64_t nbytes = (n * bits + 7) / 8, nb = (n + bs - 1) / bs;
            std::vector<uint8_t> packed(nbytes + 16, 0xA5);
            std::vector<float> meta(2 * nb), r = r0;
            const uint32_t seed_s = static_cast<uint32_t>(1234567u * 0x9E3779B9u);
            int rc = fastml_quantize(x, dtype, n, res ? r.data() : nullptr, nullptr, packed.data(), meta.data(),
                                     bits, bs, stoch, seed_s, threads);
            std::vector<float> y(n), acc(n);
            for (int64_t i = 0; i < n; ++i) acc[i] = r0[(i * 7) % n];
            rc |= fastml_dequantize(packed.data(), nbytes, meta.data(), n, bits, bs, y.data(), 0, threads);
            rc |= fastml_dequantize(packed.data(), nbytes, meta.data(), n, bits, bs, acc.data(), 1, threads);
            Fnv h;
            h.bytes(packed.data(), packed.size());  // the 16 guard bytes too: nothing written past the end
            h.floats(meta.data(), meta.size(), true);
            h.floats(r.data(), r.size(), false);
            h.floats(y.data(), y.size(), false);
            h.floats(acc.data(), acc.size(), false);
            std::printf("n=%lld bs=%lld bits=%d dtype=%d res=%d stoch=%d rc=%d %016llx\n",
                        static_cast<long long>(n), static_cast<long long>(bs), bits, dtype, res ? 1 : 0,
                        stoch ? 1 : 0, rc, static_cast<unsigned long long>(h.h));
            ++cases;
          }
        }
        // fp32 input, with and without stochastic rounding: a bf16 residual (read, and written
        // rounded to nearest even), and the fused reduce of three messages (decode, sum, divide by 3,
        // encode).
        for (int stoch = 0; stoch < 2; ++stoch) {
          const int threads = (n > 1000 && bits == 5) ? 3 : 1;
          const int64_t nbytes = (n * bits + 7) / 8, nb = (n + bs - 1) / bs;
          const uint32_t seed_s = static_cast<uint32_t>(7654321u * 0x9E3779B9u);
          std::vector<uint16_t> r16(n);
          for (int64_t i = 0; i < n; ++i) r16[i] = float_to_bf16(r0[i]);
          std::vector<uint8_t> packed(nbytes + 16, 0xA5);
          std::vector<float> meta(2 * nb);
          int rc = fastml_quantize_r(xf.data(), 0, n, r16.data(), nullptr, 2, packed.data(), meta.data(), bits, bs,
                                     stoch, seed_s, threads);
          Fnv h;
          h.bytes(packed.data(), packed.size());
          h.floats(meta.data(), meta.size(), true);
          h.bytes(r16.data(), 2 * r16.size());
          std::printf("n=%lld bs=%lld bits=%d r=bf16 stoch=%d rc=%d %016llx\n", static_cast<long long>(n),
                      static_cast<long long>(bs), bits, stoch, rc, static_cast<unsigned long long>(h.h));
          ++cases;

          std::vector<std::vector<uint8_t>> sp(3, std::vector<uint8_t>(nbytes + 16, 0));
          std::vector<std::vector<float>> sm(3, std::vector<float>(2 * nb));
          std::vector<float> xs(n);
          for (int s = 0; s < 3; ++s) {
            for (int64_t i = 0; i < n; ++i) xs[i] = xf[(i + 5 * s) % n] * static_cast<float>(s + 1);
            rc |= fastml_quantize(xs.data(), 0, n, nullptr, nullptr, sp[s].data(), sm[s].data(), bits, bs, 1,
                                  seed_s + s, 1);
          }
          const uint8_t* srcp[3] = {sp[0].data(), sp[1].data(), sp[2].data()};
          const int64_t avail[3] = {nbytes, nbytes, nbytes};
          const float* srcm[3] = {sm[0].data(), sm[1].data(), sm[2].data()};
          std::vector<uint8_t> out(nbytes + 16, 0xA5);
          std::vector<float> out_meta(2 * nb);
          rc |= fastml_reduce_quantize(srcp, avail, srcm, 3, 3.0f, n, bits, bs, out.data(), out_meta.data(), stoch,
                                       seed_s, threads);
          Fnv g;
          g.bytes(out.data(), out.size());
          g.floats(out_meta.data(), out_meta.size(), true);
          std::printf("n=%lld bs=%lld bits=%d reduce=3 stoch=%d rc=%d %016llx\n", static_cast<long long>(n),
                      static_cast<long long>(bs), bits, stoch, rc, static_cast<unsigned long long>(g.h));
          ++cases;
        }
      }
    }
  }
  std::printf("cases %d\n", cases);
  return 0;
}
