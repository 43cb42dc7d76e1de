// The torch operators of FastML's compiled CPU codec: the kernels of quantize_cpu.cpp (plain C++, no
// torch headers) behind `torch.library`, so that torch.compile, the profiler and TorchScript see
// `fastml::quantize`, `fastml::dequantize` and `fastml::reduce_quantize` as operators.
//
// fastml_strategy/kernels/cpu.py builds this file and the kernel source into one library with
// torch.utils.cpp_extension.load (ninja, a cached build per -march) and loads it with
// torch.ops.load_library. The kernel is a separate translation unit, compiled with the same flags: it
// keeps its C ABI, so tests/kernels/codec_digest.cpp can still compile it alone (no torch) for other
// architectures, and an older kernel source (cpu.use_build(source=...)) links here too: the entry
// points added after ABI version 2 are weak, and `features()` says which are present.
//
// FASTML_OP_NAMESPACE names the operators' namespace: `fastml` for the default build, another one for
// each further build a process loads (cpu.use_build: tests and benchmarks run several side by side).
//
// Calling an operator from Python releases the GIL, as ctypes did, so the communication thread encodes
// while Python runs the backward pass. Arguments are checked here (a direct call of the operator must
// not write out of bounds); the Python wrappers only shape the inputs.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#ifndef FASTML_OP_NAMESPACE
#define FASTML_OP_NAMESPACE fastml
#endif

extern "C" {
int fastml_cpu_abi_version();
int fastml_quantize(const void* x, int dtype, int64_t n, const float* r, float* rout, uint8_t* packed,
                    float* meta, int bits, int64_t bs, int stochastic, uint32_t seed_s, int nthreads);
int fastml_dequantize(const uint8_t* packed, int64_t avail, const float* meta, int64_t n, int bits, int64_t bs,
                      float* out, int mode, int nthreads);
// Newer than ABI version 2 (an older kernel source lacks them):
__attribute__((weak)) const char* fastml_cpu_isa();
__attribute__((weak)) int fastml_quantize_r(const void* x, int dtype, int64_t n, const void* r, void* rout,
                                            int r_dtype, uint8_t* packed, float* meta, int bits, int64_t bs,
                                            int stochastic, uint32_t seed_s, int nthreads);
__attribute__((weak)) int fastml_reduce_quantize(const uint8_t* const* packed, const int64_t* avail,
                                                 const float* const* meta, int nsrc, float divisor, int64_t n,
                                                 int bits, int64_t bs, uint8_t* packed_out, float* meta_out,
                                                 int stochastic, uint32_t seed_s, int nthreads);
}

namespace {

constexpr int64_t kFeatureBf16Residual = 1;  // fastml_quantize_r: a bf16 residual read and written natively
constexpr int64_t kFeatureReduce = 2;        // fastml_reduce_quantize: the fused reduce step

int64_t packed_nbytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }
int64_t num_blocks(int64_t n, int64_t bs) { return (n + bs - 1) / bs; }

void check_config(const char* op, int64_t bits, int64_t bs) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 8 && bs >= 8 && (bs & (bs - 1)) == 0, op, ": invalid arguments (bits=",
                    bits, ", block_size=", bs, "): bits must be 1-8 and block_size a power of two >= 8");
}

// A contiguous CPU tensor of `dtype` with `numel` elements (at least `numel` when `at_least`).
void check_tensor(const at::Tensor& t, int64_t numel, c10::ScalarType dtype, const char* name,
                  bool at_least = false) {
  bool size_ok = at_least ? t.numel() >= numel : t.numel() == numel;
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && size_ok && t.is_contiguous() && t.device().is_cpu(), name,
                    ": expected a contiguous CPU ", c10::toString(dtype), " tensor of ", at_least ? "at least " : "",
                    numel, " elements, got ", t.device(), " ", t.scalar_type(), " ", t.sizes(),
                    " (contiguous=", t.is_contiguous(), ")");
}

int dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::Half: return 1;
    case c10::ScalarType::BFloat16: return 2;
    default:
      TORCH_CHECK_TYPE(false, "quantize: x is ", x.scalar_type(), "; the codec takes float32, float16 or bfloat16");
  }
  return -1;
}

void quantize(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic, int64_t seed_s,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& residual_out,
              const at::Tensor& packed, const at::Tensor& meta, int64_t nthreads) {
  check_config("quantize", bits, block_size);
  const int64_t n = x.numel();
  const int code = dtype_code(x);
  check_tensor(x, n, x.scalar_type(), "x");
  check_tensor(packed, packed_nbytes(n, bits), c10::ScalarType::Byte, "packed_out");
  check_tensor(meta, 2 * num_blocks(n, block_size), c10::ScalarType::Float, "meta_out");
  const void* r = nullptr;
  void* rout = nullptr;
  int r_code = 0;
  if (residual) {
    const auto rt = residual->scalar_type();
    TORCH_CHECK_VALUE(rt == c10::ScalarType::Float || rt == c10::ScalarType::BFloat16,
                      "residual: float32 or bfloat16, got ", rt);
    TORCH_CHECK_VALUE(rt == c10::ScalarType::Float || fastml_quantize_r != nullptr,
                      "quantize: this build of the CPU codec takes a float32 residual only");
    check_tensor(*residual, n, rt, "residual");
    r = residual->data_ptr();
    r_code = rt == c10::ScalarType::BFloat16 ? 2 : 0;
    if (residual_out) {
      check_tensor(*residual_out, n, rt, "residual_out");
      rout = residual_out->data_ptr();
    }
  }
  const auto seed = static_cast<uint32_t>(seed_s);
  int rc;
  if (fastml_quantize_r != nullptr) {
    rc = fastml_quantize_r(x.data_ptr(), code, n, r, rout, r_code, packed.data_ptr<uint8_t>(),
                           meta.data_ptr<float>(), bits, block_size, stochastic, seed, nthreads);
  } else {
    rc = fastml_quantize(x.data_ptr(), code, n, static_cast<const float*>(r), static_cast<float*>(rout),
                         packed.data_ptr<uint8_t>(), meta.data_ptr<float>(), bits, block_size, stochastic, seed,
                         nthreads);
  }
  TORCH_CHECK_VALUE(rc == 0, "quantize: the kernel refused its arguments (code ", rc, ")");
}

void check_message(const char* op, const at::Tensor& packed, const at::Tensor& meta, int64_t n, int64_t bits,
                   int64_t bs) {
  const int64_t nb = num_blocks(n, bs);
  TORCH_CHECK_VALUE(packed.scalar_type() == c10::ScalarType::Byte && packed.numel() >= packed_nbytes(n, bits) &&
                        meta.scalar_type() == c10::ScalarType::Float && meta.numel() == 2 * nb,
                    op, ": ", n, " elements of ", bits, " bits in blocks of ", bs, " need ", packed_nbytes(n, bits),
                    " uint8 payload bytes and ", nb, "x2 float32 metadata; got ", packed.numel(), " ",
                    packed.scalar_type(), " and ", meta.numel(), " ", meta.scalar_type(), " metadata values");
  check_tensor(packed, packed.numel(), c10::ScalarType::Byte, "packed");
  check_tensor(meta, meta.numel(), c10::ScalarType::Float, "meta");
}

void dequantize(const at::Tensor& packed, const at::Tensor& meta, int64_t numel, int64_t bits, int64_t block_size,
                const at::Tensor& out, bool accumulate, int64_t nthreads) {
  check_config("dequantize", bits, block_size);
  check_tensor(out, numel, c10::ScalarType::Float, "out");
  if (numel == 0) return;
  check_message("dequantize", packed, meta, numel, bits, block_size);
  int rc = fastml_dequantize(packed.data_ptr<uint8_t>(), packed.numel(), meta.data_ptr<float>(), numel, bits,
                             block_size, out.data_ptr<float>(), accumulate ? 1 : 0, nthreads);
  TORCH_CHECK_VALUE(rc == 0, "dequantize: the kernel refused its arguments (code ", rc, ")");
}

void reduce_quantize(at::TensorList packed, at::TensorList meta, double divisor, int64_t numel, int64_t bits,
                     int64_t block_size, const at::Tensor& packed_out, const at::Tensor& meta_out, bool stochastic,
                     int64_t seed_s, int64_t nthreads) {
  TORCH_CHECK_VALUE(fastml_reduce_quantize != nullptr, "reduce_quantize: this build of the CPU codec has no "
                    "fused reduce (see cpu.has_reduce())");
  check_config("reduce_quantize", bits, block_size);
  TORCH_CHECK_VALUE(!packed.empty() && packed.size() == meta.size(), "reduce_quantize: ", packed.size(),
                    " payloads and ", meta.size(), " metadata tensors; give one of each per source (at least one)");
  check_tensor(packed_out, packed_nbytes(numel, bits), c10::ScalarType::Byte, "packed_out");
  check_tensor(meta_out, 2 * num_blocks(numel, block_size), c10::ScalarType::Float, "meta_out");
  if (numel == 0) return;
  const size_t nsrc = packed.size();
  std::vector<const uint8_t*> p(nsrc);
  std::vector<int64_t> avail(nsrc);
  std::vector<const float*> m(nsrc);
  for (size_t i = 0; i < nsrc; ++i) {
    check_message("reduce_quantize", packed[i], meta[i], numel, bits, block_size);
    p[i] = packed[i].data_ptr<uint8_t>();
    avail[i] = packed[i].numel();
    m[i] = meta[i].data_ptr<float>();
  }
  int rc = fastml_reduce_quantize(p.data(), avail.data(), m.data(), static_cast<int>(nsrc),
                                  static_cast<float>(divisor), numel, bits, block_size,
                                  packed_out.data_ptr<uint8_t>(), meta_out.data_ptr<float>(), stochastic,
                                  static_cast<uint32_t>(seed_s), nthreads);
  TORCH_CHECK_VALUE(rc == 0, "reduce_quantize: the kernel refused its arguments (code ", rc, ")");
}

int64_t abi_version() { return fastml_cpu_abi_version(); }
std::string isa() { return fastml_cpu_isa != nullptr ? fastml_cpu_isa() : "?"; }
int64_t features() {
  return (fastml_quantize_r != nullptr ? kFeatureBf16Residual : 0) |
         (fastml_reduce_quantize != nullptr ? kFeatureReduce : 0);
}

}  // namespace

// seed_s: the hash's seed term, seed * 0x9E3779B9 mod 2**32 (reference.py); nthreads: threads for the call.
TORCH_LIBRARY(FASTML_OP_NAMESPACE, m) {
  m.def("quantize(Tensor x, int bits, int block_size, bool stochastic, int seed_s, Tensor(a!)? residual, "
        "Tensor(b!)? residual_out, Tensor(c!) packed, Tensor(d!) meta, int nthreads) -> ()");
  m.def("dequantize(Tensor packed, Tensor meta, int numel, int bits, int block_size, Tensor(a!) out, "
        "bool accumulate, int nthreads) -> ()");
  m.def("reduce_quantize(Tensor[] packed, Tensor[] meta, float divisor, int numel, int bits, int block_size, "
        "Tensor(a!) packed_out, Tensor(b!) meta_out, bool stochastic, int seed_s, int nthreads) -> ()");
  m.def("abi_version() -> int", &abi_version);
  m.def("isa() -> str", &isa);
  m.def("features() -> int", &features);
}

TORCH_LIBRARY_IMPL(FASTML_OP_NAMESPACE, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("reduce_quantize", &reduce_quantize);
}
