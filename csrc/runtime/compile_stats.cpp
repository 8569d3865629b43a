#include "runtime/compile_stats.h"
#include "runtime/env.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <stdexcept>

namespace torch_tpu::runtime {
namespace {

void Mix(size_t& h, int64_t v) { h = c10::hash_combine(h, std::hash<int64_t>()(v)); }

std::string SizesText(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

void AddTensor(CallSignature& sig, const at::Tensor& t, std::string& shapes) {
  if (!t.defined()) {
    Mix(sig.statics, -1);
    return;
  }
  Mix(sig.dtypes, static_cast<int64_t>(t.scalar_type()));
  Mix(sig.dtypes, static_cast<int64_t>(t.device().type()));
  Mix(sig.layout, t.dim());
  for (int64_t s : t.sizes()) Mix(sig.layout, s);
  for (int64_t s : t.strides()) Mix(sig.layout, s);
  Mix(sig.layout, t.storage_offset());
  if (t.has_storage()) Mix(sig.layout, static_cast<int64_t>(t.storage().nbytes() / t.element_size()));  // elements
  if (t.device().type() != c10::DeviceType::CPU || t.dim() > 0) {
    if (!shapes.empty()) shapes += ", ";
    shapes += SizesText(t.sizes());
  }
}

bool IsSymIntLike(const c10::Argument& a) { return a.real_type()->str().find("SymInt") != std::string::npos; }

void AddStatic(size_t& h, const c10::IValue& v) {
  if (v.isInt()) {
    Mix(h, v.toInt());
  } else if (v.isDouble()) {
    Mix(h, std::bit_cast<int64_t>(v.toDouble()));
  } else if (v.isBool()) {
    Mix(h, 2 + v.toBool());
  } else if (v.isString()) {
    h = c10::hash_combine(h, std::hash<std::string_view>()(v.toStringView()));
  } else if (v.isIntList()) {
    for (int64_t x : v.toIntList()) Mix(h, x);
    Mix(h, static_cast<int64_t>(v.toIntList().size()));
  } else if (v.isSymInt()) {
    Mix(h, v.toSymInt().expect_int());
  } else if (v.isSymIntList()) {
    auto l = v.toSymIntList();
    for (size_t j = 0; j < l.size(); ++j) Mix(h, static_cast<c10::SymInt>(l[j]).expect_int());
    Mix(h, static_cast<int64_t>(l.size()));
  } else if (v.isDoubleList()) {
    for (double x : v.toDoubleList()) Mix(h, std::bit_cast<int64_t>(x));
  } else if (v.isBoolList()) {
    for (bool x : v.toBoolList()) Mix(h, x);
  } else if (v.isScalar()) {
    auto s = v.toScalar();
    if (s.isComplex()) {
      Mix(h, std::bit_cast<int64_t>(s.toComplexDouble().real()));
      Mix(h, std::bit_cast<int64_t>(s.toComplexDouble().imag()));
    } else {
      Mix(h, s.isFloatingPoint() ? std::bit_cast<int64_t>(s.toDouble()) : s.toLong());
    }
  } else if (v.isDevice()) {
    Mix(h, static_cast<int64_t>(v.toDevice().type()));
  } else if (v.isNone()) {
    Mix(h, -2);
  } else {
    h = c10::hash_combine(h, std::hash<std::string>()(v.tagKind()));
  }
}

}  // namespace

const char* CompileCauseName(CompileCause cause) {
  switch (cause) {
    case CompileCause::kFirst: return "first";
    case CompileCause::kNewShape: return "new_shape";
    case CompileCause::kNewDtype: return "new_dtype";
    case CompileCause::kNewStatic: return "new_static";
    case CompileCause::kOther: return "other";
  }
  return "other";
}

CallSignature SignatureOf(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
                          bool static_scalars) {
  const auto& args = op.schema().arguments();
  CallSignature sig;
  Mix(sig.dtypes, static_cast<int64_t>(c10::get_default_dtype_as_scalartype()));
  for (size_t i = 0; i < args.size() && first + i < stack.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    Mix(sig.statics, static_cast<int64_t>(i));
    if (v.isTensor()) {
      AddTensor(sig, v.toTensor(), sig.shapes);
    } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList())) {
      const auto& list = v.toListRef();
      Mix(sig.layout, static_cast<int64_t>(list.size()));
      for (const auto& item : list) {
        if (item.isTensor()) AddTensor(sig, item.toTensor(), sig.shapes);
        else Mix(sig.statics, -1);  // None in an optional-tensor list
      }
    } else if (args[i].real_type()->str().find("ScalarType") != std::string::npos) {
      AddStatic(sig.dtypes, v);  // dtype= arguments
    } else if (v.isScalar() && !static_scalars && args[i].real_type()->str().find("Scalar") != std::string::npos) {
      Mix(sig.dtypes, v.isDouble() ? 1 : v.isInt() ? 2 : v.isBool() ? 3 : 4);  // a runtime input: its kind only
    } else if (IsSymIntLike(args[i])) {
      AddStatic(sig.layout, v);  // sizes (view, expand, zeros, ...): shape-like
      if (v.isIntList() || v.isSymIntList()) {
        if (!sig.shapes.empty()) sig.shapes += ", ";
        sig.shapes += args[i].name() + "=" + (v.isIntList() ? SizesText(v.toIntVector()) : "[...]");
      }
    } else if (!v.isGenerator()) {
      AddStatic(sig.statics, v);
    }
  }
  return sig;
}

CompileStats& CompileStats::Get() {
  static CompileStats* stats = new CompileStats();
  return *stats;
}

int64_t CompileStats::WarnThreshold() {
  static const int64_t threshold = EnvInteger("TORCH_TPU_RECOMPILE_WARN", 8, 0, std::numeric_limits<int64_t>::max(),
                                              "a non-negative integer");
  return threshold;
}

CompileCause CompileStats::Record(const std::string& op_name, const CallSignature& sig, double seconds) {
  const int64_t threshold = WarnThreshold();
  std::string warning;
  CompileCause cause;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    PerOp& p = ops_[op_name];
    bool same_all = false, same_dtype_static = false, same_static = false;
    for (const Seen& s : p.seen) {
      if (s.statics != sig.statics) continue;
      same_static = true;
      if (s.dtypes != sig.dtypes) continue;
      same_dtype_static = true;
      if (s.layout == sig.layout) same_all = true;
    }
    if (p.seen.empty()) cause = CompileCause::kFirst;
    else if (same_all) cause = CompileCause::kOther;
    else if (same_dtype_static) cause = CompileCause::kNewShape;
    else if (same_static) cause = CompileCause::kNewDtype;
    else cause = CompileCause::kNewStatic;
    if (!same_all) p.seen.push_back({sig.layout, sig.dtypes, sig.statics});
    if (std::find(p.layouts.begin(), p.layouts.end(), sig.layout) == p.layouts.end()) {
      p.layouts.push_back(sig.layout);
      // Layouts differing only in strides print alike: keep each text once.
      if (p.stats.shapes.size() < kKeptShapes &&
          std::find(p.stats.shapes.begin(), p.stats.shapes.end(), sig.shapes) == p.stats.shapes.end())
        p.stats.shapes.push_back(sig.shapes);
    }
    p.stats.compiles++;
    p.stats.by_cause[static_cast<size_t>(cause)]++;
    p.stats.distinct_shapes = static_cast<int64_t>(p.layouts.size());
    p.stats.seconds += seconds;
    if (threshold > 0 && !p.warned && p.stats.distinct_shapes >= threshold) {
      p.warned = true;
      warning = "torch_tpu: " + op_name + " has compiled for " + std::to_string(p.stats.distinct_shapes) +
                " different shapes (";
      for (size_t i = 0; i < p.stats.shapes.size(); ++i) warning += (i ? "; " : "") + p.stats.shapes[i];
      warning +=
          "): every new shape costs a compile in strict and debug mode. Remedies: fused mode "
          "(torch_tpu.set_eager_mode(\"fused\")), torch.compile(model, backend=\"tpu\", dynamic=True), or padding "
          "inputs to a few bucket sizes. torch_tpu.metrics()[\"compiles_by_op\"] counts compiles by op and cause; "
          "TORCH_TPU_RECOMPILE_WARN=N sets this warning's threshold (0 disables it).";
    }
  }
  // Verbatim: the text names the op and shapes already; PyTorch's handler
  // would otherwise append "(Triggered internally at compile_stats.cpp...)".
  if (!warning.empty())
    c10::warn(c10::Warning(c10::UserWarning(), {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, warning,
                           /*verbatim=*/true));
  return cause;
}

int64_t CompileStats::DistinctShapes(const std::string& op_name) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = ops_.find(op_name);
  return it == ops_.end() ? 0 : it->second.stats.distinct_shapes;
}

std::map<std::string, OpCompileStats> CompileStats::Snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, OpCompileStats> out;
  for (const auto& [name, p] : ops_) out[name] = p.stats;
  return out;
}

std::array<int64_t, kNumCompileCauses> CompileStats::TotalsByCause() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::array<int64_t, kNumCompileCauses> totals{};
  for (const auto& [name, p] : ops_)
    for (size_t c = 0; c < kNumCompileCauses; ++c) totals[c] += p.stats.by_cause[c];
  return totals;
}

}  // namespace torch_tpu::runtime
