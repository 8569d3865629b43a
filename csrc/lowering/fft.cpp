// The FFT family: ATen's _fft_r2c, _fft_c2r and _fft_c2c (torch.fft.fft,
// ifft, rfft, irfft, hfft, fftn, rfftn, ..., stft and istft decompose into
// them) lowered to stablehlo.fft, one transformed dimension at a time (moved
// last, transformed, moved back), with PyTorch's normalization modes
// (aten/src/ATen/native/SpectralOpsUtils.h fft_norm_mode: 0 none, 1
// 1/sqrt(n), 2 1/n, n the product of the signal sizes over `dim`). Forward
// transforms use exp(-2 pi i jk/n), backward ones exp(+2 pi i jk/n) with no
// scaling but the mode's, as pocketfft on the CPU. Elements: f32/f64 and
// c64/c128; half-precision transforms (complex32) run on the CPU.
#include <cmath>
#include <numeric>

#include "lowering/helpers.h"

namespace torch_tpu::lowering {
namespace {

const LoweringTraits kComplex{.complex = true};

// Moves dimension `d` to the end (perm) or back (inverse).
std::vector<int64_t> ToLast(int64_t rank, int64_t d) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < rank; ++i)
    if (i != d) p.push_back(i);
  p.push_back(d);
  return p;
}
std::vector<int64_t> Inverse(const std::vector<int64_t>& p) {
  std::vector<int64_t> q(p.size());
  for (size_t i = 0; i < p.size(); ++i) q[static_cast<size_t>(p[i])] = static_cast<int64_t>(i);
  return q;
}

// One transform along `d`: kind FFT/IFFT/RFFT/IRFFT, `n` the signal length.
Value Fft1(Builder& b, const Value& x, int64_t d, std::string_view kind, int64_t n) {
  auto perm = ToLast(x.rank(), d);
  Value t = b.Transpose(x, perm);
  int64_t len[] = {n};
  Value y = b.Fft(t, kind, len);
  return b.Transpose(y, Inverse(perm));
}

std::vector<int64_t> FftDims(const LoweringContext& ctx, int64_t rank) {
  std::vector<int64_t> dims;
  for (int64_t d : ctx.ints("dim")) dims.push_back(NormalizeDim(d, rank));
  if (dims.empty()) throw LoweringError(ctx.op_name() + ": no dimension to transform");
  return dims;
}

void CheckElement(const LoweringContext& ctx, const Value& x) {
  ElementType e = x.element();
  if (e != ElementType::kF32 && e != ElementType::kF64 && !hlo::IsComplex(e))
    throw LoweringError(ctx.op_name() + ": only float, double and their complex types are transformed on tpu");
}

// Multiplies by the normalization of `mode` over `n` signal elements,
// times `extra` (undoing stablehlo's 1/n of IFFT/IRFFT).
Value Normalize(Builder& b, const Value& y, int64_t mode, double n, double extra) {
  double scale = extra;
  if (mode == 1) scale /= std::sqrt(n);
  else if (mode == 2) scale /= n;
  else if (mode != 0) throw LoweringError("fft: unknown normalization mode " + std::to_string(mode));
  if (scale == 1.0) return y;
  return b.Mul(y, ConstLike(b, y, scale));
}

// _fft_c2c(self, dim, normalization, forward)
std::vector<Value> LowerFftC2c(LoweringContext& ctx) {
  Builder& b = ctx.b;
  Value x = ctx.tensor("self");
  CheckElement(ctx, x);
  if (!hlo::IsComplex(x.element())) x = CastElement(b, x, hlo::ComplexOf(x.element()));
  const bool forward = ctx.bool_arg("forward");
  double n = 1;
  for (int64_t d : FftDims(ctx, x.rank())) {
    int64_t len = x.dims()[static_cast<size_t>(d)];
    n *= static_cast<double>(len);
    if (len > 0) x = Fft1(b, x, d, forward ? "FFT" : "IFFT", len);
  }
  return {Normalize(b, x, ctx.int_arg("normalization"), n, forward ? 1.0 : n)};
}

// _fft_r2c(self, dim, normalization, onesided): the last of `dim` keeps
// n/2+1 outputs when onesided, else the full (Hermitian) spectrum.
std::vector<Value> LowerFftR2c(LoweringContext& ctx) {
  Builder& b = ctx.b;
  Value x = ctx.tensor("self");
  CheckElement(ctx, x);
  if (hlo::IsComplex(x.element())) throw LoweringError(ctx.op_name() + ": complex input");
  auto dims = FftDims(ctx, x.rank());
  double n = 1;
  for (int64_t d : dims) n *= static_cast<double>(x.dims()[static_cast<size_t>(d)]);
  if (n == 0) throw LoweringError(ctx.op_name() + ": empty signal");
  const bool onesided = ctx.bool_arg("onesided");
  const int64_t last = dims.back();
  if (onesided) {
    x = Fft1(b, x, last, "RFFT", x.dims()[static_cast<size_t>(last)]);
  } else {
    x = CastElement(b, x, hlo::ComplexOf(x.element()));
    x = Fft1(b, x, last, "FFT", x.dims()[static_cast<size_t>(last)]);
  }
  for (size_t i = 0; i + 1 < dims.size(); ++i)
    x = Fft1(b, x, dims[i], "FFT", x.dims()[static_cast<size_t>(dims[i])]);
  return {Normalize(b, x, ctx.int_arg("normalization"), n, 1.0)};
}

// _fft_c2r(self, dim, normalization, last_dim_size): the inverse of a
// onesided r2c; the last of `dim` grows to last_dim_size, reading its first
// last_dim_size/2+1 inputs (zero-padded if fewer), as pocketfft's c2r.
std::vector<Value> LowerFftC2r(LoweringContext& ctx) {
  Builder& b = ctx.b;
  Value x = ctx.tensor("self");
  CheckElement(ctx, x);
  if (!hlo::IsComplex(x.element())) x = CastElement(b, x, hlo::ComplexOf(x.element()));
  auto dims = FftDims(ctx, x.rank());
  const int64_t last = dims.back();
  const int64_t out_len = ctx.int_arg("last_dim_size");
  if (out_len <= 0) throw LoweringError(ctx.op_name() + ": last_dim_size must be positive");
  double n = static_cast<double>(out_len);
  for (size_t i = 0; i + 1 < dims.size(); ++i) {
    int64_t len = x.dims()[static_cast<size_t>(dims[i])];
    n *= static_cast<double>(len);
    if (len > 0) x = Fft1(b, x, dims[i], "IFFT", len);
  }
  const int64_t want = out_len / 2 + 1;
  const int64_t have = x.dims()[static_cast<size_t>(last)];
  if (have > want) {
    std::vector<int64_t> start(static_cast<size_t>(x.rank()), 0), limit = x.dims(),
        stride(static_cast<size_t>(x.rank()), 1);
    limit[static_cast<size_t>(last)] = want;
    x = b.Slice(x, start, limit, stride);
  } else if (have < want) {
    std::vector<int64_t> lo(static_cast<size_t>(x.rank()), 0), hi(static_cast<size_t>(x.rank()), 0),
        interior(static_cast<size_t>(x.rank()), 0);
    hi[static_cast<size_t>(last)] = want - have;
    x = b.Pad(x, Const(b, x.element(), 0), lo, hi, interior);
  }
  x = Fft1(b, x, last, "IRFFT", out_len);
  return {Normalize(b, x, ctx.int_arg("normalization"), n, n)};
}

}  // namespace

TORCH_TPU_LOWERINGS({
    {"_fft_c2c", LowerFftC2c, kComplex},
    {"_fft_r2c", LowerFftR2c, kComplex},
    {"_fft_c2r", LowerFftC2r, kComplex},
});

}  // namespace torch_tpu::lowering
