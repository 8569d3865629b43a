#include "runtime/compiled_op.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/Resize.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/hash.h>

#include <bit>
#include <chrono>
#include <cstdlib>
#include <iostream>

#include "lowering/helpers.h"
#include "runtime/disk_cache.h"

namespace torch_tpu::runtime {
namespace {

using lowering::LoweredArg;

bool IsScalarType(const c10::TypePtr& t) {
  if (t->kind() == c10::TypeKind::NumberType) return true;
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::NumberType;
  return false;
}

bool IsOutArg(const c10::Argument& a) {
  return a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite();
}

bool OnTpu(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

[[noreturn]] void DeviceMismatch(const at::Tensor& t) {
  throw std::runtime_error(
      "Expected all tensors to be on the same device, but found at least two devices, tpu:0 and " +
      t.device().str() + "!");
}

// How a scalar reaches the program: floating scalars as f32 unless the call
// has an f64 tensor (then f64), integers as s64, booleans as pred.
hlo::ElementType ScalarElement(const c10::Scalar& s, bool has_f64) {
  if (s.isBoolean()) return hlo::ElementType::kPred;
  if (s.isIntegral(false)) return hlo::ElementType::kS64;
  if (s.isFloatingPoint()) return has_f64 ? hlo::ElementType::kF64 : hlo::ElementType::kF32;
  throw UnsupportedOp("complex scalars are not supported on tpu");
}

hlo::ElementType CpuScalarElement(const at::Tensor& t, bool has_f64) {
  at::ScalarType st = t.scalar_type();
  if (st == at::kDouble && !has_f64) return hlo::ElementType::kF32;
  if (at::isComplexType(st)) throw UnsupportedOp("complex scalars are not supported on tpu");
  return lowering::ToElementType(st);
}

// Storage element type a tensor's storage has (or would get on first use).
hlo::ElementType StorageElement(const at::Tensor& t) {
  auto& s = StorageOf(t);
  return s.initialized() ? s.current().element : lowering::ToElementType(t.scalar_type());
}
int64_t StorageNumel(const at::Tensor& t) {
  auto& s = StorageOf(t);
  if (s.initialized()) return s.current().numel;
  return static_cast<int64_t>(s.nbytes() / ElementSize(lowering::ToElementType(t.scalar_type())));
}

bool CallHasF64(const torch::jit::Stack& stack, size_t first, size_t n) {
  for (size_t i = first; i < first + n; ++i) {
    const auto& v = stack[i];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().dim() > 0 &&
        v.toTensor().scalar_type() == at::kDouble)
      return true;
    if (v.isTensorList())
      for (const auto& t : v.toTensorList())
        if (static_cast<at::Tensor>(t).scalar_type() == at::kDouble) return true;
  }
  return false;
}

// Appends a static argument's value to the key; throws UnsupportedOp for
// values that cannot be part of a key.
void AppendStatic(std::vector<int64_t>& atoms, const c10::IValue& v) {
  if (v.isNone()) {
    atoms.push_back(100);
  } else if (v.isBool()) {
    atoms.push_back(101);
    atoms.push_back(v.toBool());
  } else if (v.isInt()) {
    atoms.push_back(102);
    atoms.push_back(v.toInt());
  } else if (v.isSymInt()) {
    atoms.push_back(102);
    atoms.push_back(v.toSymInt().expect_int());
  } else if (v.isDouble()) {
    atoms.push_back(103);
    atoms.push_back(std::bit_cast<int64_t>(v.toDouble()));
  } else if (v.isIntList()) {
    atoms.push_back(104);
    auto l = v.toIntList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (int64_t x : l) atoms.push_back(x);
  } else if (v.isSymIntList()) {
    atoms.push_back(104);
    auto l = v.toSymIntList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (size_t j = 0; j < l.size(); ++j) atoms.push_back(static_cast<c10::SymInt>(l[j]).expect_int());
  } else if (v.isString()) {
    atoms.push_back(105);
    atoms.push_back(static_cast<int64_t>(std::hash<std::string_view>()(v.toStringView())));
  } else if (v.isDoubleList()) {
    atoms.push_back(106);
    auto l = v.toDoubleList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (double x : l) atoms.push_back(std::bit_cast<int64_t>(x));
  } else if (v.isBoolList()) {
    atoms.push_back(107);
    auto l = v.toBoolList();
    atoms.push_back(static_cast<int64_t>(l.size()));
    for (bool x : l) atoms.push_back(x);
  } else if (v.isDevice()) {
    atoms.push_back(108);
    atoms.push_back(static_cast<int64_t>(v.toDevice().type()));
  } else if (v.isScalar()) {  // a Scalar compiled in as a constant
    atoms.push_back(109);
    auto s = v.toScalar();
    atoms.push_back(s.isFloatingPoint() ? std::bit_cast<int64_t>(s.toDouble()) : s.toLong());
    atoms.push_back(s.isFloatingPoint());
  } else {
    throw UnsupportedOp("argument of type " + v.tagKind() + " is not supported by the tpu lowering path");
  }
}

struct StorageIds {
  std::vector<const DeviceStorage*> seen;
  int64_t Id(const DeviceStorage* s) {
    for (size_t i = 0; i < seen.size(); ++i)
      if (seen[i] == s) return static_cast<int64_t>(i);
    seen.push_back(s);
    return static_cast<int64_t>(seen.size() - 1);
  }
};

void AppendTensor(std::vector<int64_t>& atoms, const at::Tensor& t, StorageIds& ids) {
  atoms.push_back(static_cast<int64_t>(t.scalar_type()));
  atoms.push_back(t.dim());
  for (int64_t s : t.sizes()) atoms.push_back(s);
  for (int64_t s : t.strides()) atoms.push_back(s);
  atoms.push_back(t.storage_offset());
  atoms.push_back(StorageNumel(t));
  atoms.push_back(static_cast<int64_t>(StorageElement(t)));
  atoms.push_back(ids.Id(&StorageOf(t)));
}

// Fills `key` (reusing its storage: this runs for every op).
void BuildKey(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t first,
              const lowering::LoweringEntry& entry, OpKey& key) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  key.op = &schema;
  key.atoms.clear();
  StorageIds ids;
  bool has_f64 = CallHasF64(stack, first, args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[first + i];
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        key.atoms.push_back(1);
      } else if (OnTpu(t)) {
        key.atoms.push_back(2);
        AppendTensor(key.atoms, t, ids);
      } else if (t.dim() == 0 && t.device().is_cpu()) {
        key.atoms.push_back(3);
        key.atoms.push_back(static_cast<int64_t>(t.scalar_type()));
        key.atoms.push_back(static_cast<int64_t>(CpuScalarElement(t, has_f64)));
        key.atoms.push_back(t.unsafeGetTensorImpl()->is_wrapped_number());
      } else {
        DeviceMismatch(t);
      }
    } else if (v.isTensorList() || (v.isList() && args[i].type()->kind() == c10::TypeKind::ListType &&
                                    v.toListRef().size() > 0 &&
                                    (v.toListRef()[0].isTensor() || v.toListRef()[0].isNone()) &&
                                    !v.isIntList())) {
      key.atoms.push_back(4);
      const auto& list = v.toListRef();
      key.atoms.push_back(static_cast<int64_t>(list.size()));
      for (const auto& item : list) {
        if (item.isNone() || !item.toTensor().defined()) {
          key.atoms.push_back(1);
          continue;
        }
        const at::Tensor& t = item.toTensor();
        if (!OnTpu(t)) DeviceMismatch(t);
        key.atoms.push_back(2);
        AppendTensor(key.atoms, t, ids);
      }
    } else if (v.isGenerator()) {
      key.atoms.push_back(5);
    } else if (v.isScalar() && IsScalarType(args[i].type()) && !entry.traits.static_scalars) {
      key.atoms.push_back(6);
      key.atoms.push_back(static_cast<int64_t>(ScalarElement(v.toScalar(), has_f64)));
    } else {
      key.atoms.push_back(7);
      AppendStatic(key.atoms, v);
    }
  }
  size_t h = std::hash<const void*>()(key.op);
  for (int64_t a : key.atoms) h = c10::hash_combine(h, std::hash<int64_t>()(a));
  key.hash = h;
}

lowering::ViewLayout LayoutOf(const at::Tensor& t) {
  return {t.sizes().vec(), t.strides().vec(), t.storage_offset()};
}

at::Tensor ToMeta(const at::Tensor& t) {
  auto meta = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kMeta));
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) meta.unsafeGetTensorImpl()->set_wrapped_number(true);
  return meta;
}

c10::IValue ToMetaValue(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return v;
    if (t.dim() == 0 && t.device().is_cpu()) return v;  // CPU scalars stay CPU scalars
    return ToMeta(t);
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const auto& t : v.toTensorList()) out.push_back(ToMeta(t));
    return out;
  }
  if (v.isList()) {
    const auto& list = v.toListRef();
    bool tensors = false;
    for (const auto& x : list) tensors |= x.isTensor();
    if (!tensors) return v;
    c10::List<std::optional<at::Tensor>> out;
    for (const auto& x : list) {
      if (x.isNone()) out.push_back(std::nullopt);
      else out.push_back(ToMeta(x.toTensor()));
    }
    return out;
  }
  if (v.isDevice()) return c10::Device(c10::kMeta);
  return v;
}

// Every compiled executable is portable across the client's devices.
pjrt::CompileOptions PortableOptions() {
  pjrt::CompileOptions o = Runtime::Get().compile_options();
  o.portable = true;
  return o;
}

bool DumpHlo() {
  static bool dump = [] {
    const char* e = std::getenv("TORCH_TPU_DUMP_HLO");
    return e && *e && std::string(e) != "0";
  }();
  return dump;
}

std::unique_ptr<CompiledOp> Compile(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                    size_t first, const lowering::LoweringEntry& entry) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  auto compiled = std::make_unique<CompiledOp>();
  compiled->entry = &entry;
  compiled->name = schema.name() + (schema.overload_name().empty() ? "" : "." + schema.overload_name());
  bool has_f64 = CallHasF64(stack, first, args.size());

  // 1. Output specs from PyTorch's meta kernels.
  // CPU 0-d tensors stay on the CPU for type promotion; meta kernels that
  // insist on one device get a second try with them on meta too.
  torch::jit::Stack meta_stack;
  for (int attempt = 0;; ++attempt) {
    meta_stack.clear();
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& v = stack[first + i];
      meta_stack.push_back(attempt == 1 && v.isTensor() && v.toTensor().defined() && v.toTensor().is_cpu()
                               ? c10::IValue(ToMeta(v.toTensor()))
                               : ToMetaValue(v));
    }
    try {
      op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), &meta_stack);
      break;
    } catch (const std::exception& e) {
      if (attempt == 1) throw UnsupportedOp(std::string("no meta kernel result: ") + e.what());
    }
  }
  const auto& returns = schema.returns();
  if (meta_stack.size() != returns.size()) throw UnsupportedOp("unexpected meta result count");

  hlo::Builder b;
  lowering::LoweringContext ctx(b, schema);

  // 2. Arguments: storage parameters are created on first read.
  struct StorageParam {
    const DeviceStorage* storage;
    int16_t arg, item;
    hlo::ElementType element;
    int64_t numel;
    std::optional<hlo::Value> param;   // the flat storage as read
    std::optional<hlo::Value> current; // the flat storage after writes
  };
  std::vector<StorageParam> storages;
  auto storage_for = [&](const at::Tensor& t, int16_t arg, int16_t item) -> StorageParam& {
    const DeviceStorage* s = &StorageOf(t);
    for (auto& sp : storages)
      if (sp.storage == s) return sp;
    storages.push_back({s, arg, item, StorageElement(t), StorageNumel(t), std::nullopt, std::nullopt});
    return storages.back();
  };
  auto read_flat = [&](StorageParam& sp) -> hlo::Value {
    if (sp.current) return *sp.current;
    if (!sp.param) {
      sp.param = b.Parameter(hlo::TensorType{sp.element, {sp.numel}});
      compiled->inputs.push_back({InputSlot::Kind::kStorage, sp.arg, sp.item, sp.element});
    }
    return *sp.param;
  };
  auto read_tensor = [&](const at::Tensor& t, int16_t arg, int16_t item) -> hlo::Value {
    StorageParam& sp = storage_for(t, arg, item);
    hlo::Value flat = read_flat(sp);
    hlo::ElementType want = lowering::ToElementType(t.scalar_type());
    if (flat.element() != want) flat = b.BitcastConvert(flat, want);
    return lowering::ReadView(b, flat, LayoutOf(t));
  };
  auto write_tensor = [&](const at::Tensor& t, int16_t arg, int16_t item, hlo::Value value) {
    StorageParam& sp = storage_for(t, arg, item);
    value = lowering::Prepare(b, value, t.scalar_type(), t.sizes().vec());
    if (value.element() != sp.element) value = b.BitcastConvert(value, sp.element);
    auto layout = LayoutOf(t);
    int64_t numel = t.numel();
    bool covers_all = t.is_contiguous() && t.storage_offset() == 0 && numel == sp.numel;
    if (covers_all && !sp.current && !sp.param) {
      int64_t dims[] = {numel};
      sp.current = b.Reshape(value, dims);
    } else {
      sp.current = lowering::WriteView(b, read_flat(sp), layout, value);
    }
  };

  std::vector<int16_t> out_args;
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::Argument& a = args[i];
    const c10::IValue& v = stack[first + i];
    int16_t ai = static_cast<int16_t>(i);
    if (IsOutArg(a)) {
      out_args.push_back(ai);
      continue;
    }
    LoweredArg la;
    la.name = a.name();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) {
        la.kind = LoweredArg::Kind::kNone;
      } else if (OnTpu(t)) {
        la.kind = LoweredArg::Kind::kTensor;
        la.dtype = t.scalar_type();
        la.value = read_tensor(t, ai, -1);
      } else {
        la.kind = LoweredArg::Kind::kScalar;
        hlo::ElementType e = CpuScalarElement(t, has_f64);
        la.value = b.Parameter(hlo::TensorType{e, {}});
        la.dtype = lowering::ToScalarType(e);
        la.wrapped_number = t.unsafeGetTensorImpl()->is_wrapped_number();
        compiled->inputs.push_back({InputSlot::Kind::kScalar, ai, -1, e});
      }
    } else if (v.isTensorList() || (v.isList() && !v.isIntList() && !v.isDoubleList() && !v.isBoolList() &&
                                    v.toListRef().size() > 0 &&
                                    (v.toListRef()[0].isTensor() || v.toListRef()[0].isNone()))) {
      la.kind = LoweredArg::Kind::kTensorList;
      const auto& list = v.toListRef();
      for (size_t j = 0; j < list.size(); ++j) {
        if (list[j].isNone() || !list[j].toTensor().defined()) {
          la.list.push_back(hlo::Value{});
          la.present.push_back(false);
        } else {
          la.list.push_back(read_tensor(list[j].toTensor(), ai, static_cast<int16_t>(j)));
          la.present.push_back(true);
        }
      }
    } else if (v.isGenerator() || (v.isNone() && a.type()->str().find("Generator") != std::string::npos)) {
      la.kind = LoweredArg::Kind::kNone;
    } else if (v.isScalar() && IsScalarType(a.type()) && !entry.traits.static_scalars) {
      la.kind = LoweredArg::Kind::kScalar;
      hlo::ElementType e = ScalarElement(v.toScalar(), has_f64);
      la.value = b.Parameter(hlo::TensorType{e, {}});
      la.dtype = lowering::ToScalarType(e);
      la.wrapped_number = true;
      compiled->inputs.push_back({InputSlot::Kind::kScalar, ai, -1, e});
    } else if (v.isNone()) {
      la.kind = LoweredArg::Kind::kNone;
      la.ivalue = v;
    } else {
      la.kind = LoweredArg::Kind::kStatic;
      la.ivalue = v;
    }
    ctx.args.push_back(std::move(la));
  }
  if (entry.traits.needs_rng) {
    int16_t gen_arg = -1;
    for (size_t i = 0; i < args.size(); ++i)
      if (args[i].type()->str().find("Generator") != std::string::npos) gen_arg = static_cast<int16_t>(i);
    ctx.rng_state_value = b.Parameter(hlo::TensorType{hlo::ElementType::kU64, {2}});
    compiled->inputs.push_back({InputSlot::Kind::kRng, gen_arg, -1, hlo::ElementType::kU64});
  }

  // 3. Returns: a new tensor, or an argument the op writes and returns.
  std::vector<int16_t> return_alias(returns.size(), -1);
  size_t next_out = 0;
  for (size_t r = 0; r < returns.size(); ++r) {
    const auto& ret = returns[r];
    if (ret.type()->kind() != c10::TypeKind::TensorType)
      throw UnsupportedOp("returns a " + ret.type()->str() + ", not a Tensor");
    if (ret.alias_info()) {
      // The argument with the same alias set.
      for (size_t i = 0; i < args.size(); ++i) {
        const auto* ai = args[i].alias_info();
        if (ai && ai->isWrite() && ai->beforeSets() == ret.alias_info()->beforeSets()) {
          return_alias[r] = static_cast<int16_t>(i);
          break;
        }
      }
      if (return_alias[r] < 0 && next_out < out_args.size()) return_alias[r] = out_args[next_out++];
      if (return_alias[r] < 0) throw UnsupportedOp("returns a view of an input");
    }
    const at::Tensor& mt = meta_stack[r].toTensor();
    ctx.outputs.push_back({mt.scalar_type(), mt.sizes().vec()});
  }
  // out= tensors of other sizes are resized as PyTorch's resize_output does
  // (the launch repeats it on every call that shares this key).
  for (size_t r = 0; r < returns.size(); ++r) {
    if (return_alias[r] < 0) continue;
    const at::Tensor& target = stack[first + static_cast<size_t>(return_alias[r])].toTensor();
    if (target.sizes() != ctx.outputs[r].sizes) {
      bool is_out = std::find(out_args.begin(), out_args.end(), return_alias[r]) != out_args.end();
      if (!is_out)
        throw UnsupportedOp("in-place result has sizes " + c10::str(ctx.outputs[r].sizes) + " but the tensor has " +
                            c10::str(target.sizes()));
      at::native::resize_output(target, ctx.outputs[r].sizes);
      compiled->resize_outputs.emplace_back(return_alias[r], ctx.outputs[r].sizes);
    }
    ctx.outputs[r].dtype = target.scalar_type();
  }

  // 4. Lower.
  std::vector<hlo::Value> results;
  try {
    results = entry.fn(ctx);
  } catch (const lowering::LoweringError& e) {
    throw UnsupportedOp(e.what());
  } catch (const hlo::BuildError& e) {
    throw UnsupportedOp(std::string("lowering of ") + compiled->name + " failed: " + e.what());
  }
  if (results.size() != returns.size())
    throw std::logic_error("lowering of " + compiled->name + " returned " + std::to_string(results.size()) +
                           " values for " + std::to_string(returns.size()) + " returns");

  // 5. Outputs: new tensors first, then written storages.
  std::vector<hlo::Value> program_results;
  for (size_t r = 0; r < returns.size(); ++r) {
    if (return_alias[r] >= 0) {
      const at::Tensor& target = stack[first + static_cast<size_t>(return_alias[r])].toTensor();
      write_tensor(target, return_alias[r], -1, results[r]);
      compiled->returns.push_back({true, return_alias[r]});
      continue;
    }
    const auto& spec = ctx.outputs[r];
    hlo::Value v = lowering::Cast(b, results[r], spec.dtype);
    if (v.dims() != spec.sizes) {
      int64_t n = 1;
      for (int64_t s : spec.sizes) n *= s;
      v = n == v.type.numel() ? b.Reshape(v, spec.sizes) : lowering::BroadcastTo(b, v, spec.sizes);
    }
    int64_t n = v.type.numel();
    int64_t flat_dims[] = {n};
    program_results.push_back(b.Reshape(v, flat_dims));
    OutputSlot slot;
    slot.kind = OutputSlot::Kind::kNewTensor;
    slot.dtype = spec.dtype;
    slot.sizes = spec.sizes;
    slot.element = lowering::ToElementType(spec.dtype);
    slot.numel = n;
    compiled->returns.push_back({false, static_cast<int16_t>(compiled->outputs.size())});
    compiled->outputs.push_back(std::move(slot));
  }
  for (auto& [name, value] : ctx.writes) {
    for (size_t i = 0; i < args.size(); ++i) {
      if (args[i].name() != name) continue;
      write_tensor(stack[first + i].toTensor(), static_cast<int16_t>(i), -1, value);
    }
  }
  for (auto& sp : storages) {
    if (!sp.current) continue;
    program_results.push_back(*sp.current);
    OutputSlot slot;
    slot.kind = OutputSlot::Kind::kStorageWrite;
    slot.arg = sp.arg;
    slot.item = sp.item;
    slot.element = sp.element;
    slot.numel = sp.numel;
    compiled->outputs.push_back(std::move(slot));
  }
  for (const auto& o : compiled->outputs) compiled->rng_increment += std::max<int64_t>(o.numel, 1);
  b.Return(program_results);

  // 6. Compile.
  compiled->module_text = b.Module();
  if (DumpHlo()) std::cerr << "[torch_tpu] " << compiled->name << ":\n" << compiled->module_text;
  auto& rt = Runtime::Get();
  auto start = std::chrono::steady_clock::now();
  try {
    compiled->executable = DiskCache::Get().LoadOrCompile(rt.client(), compiled->module_text, PortableOptions());
  } catch (const pjrt::Error& e) {
    throw std::runtime_error("tpu: compiling " + compiled->name + " failed: " + e.what() +
                             "\nmodule:\n" + compiled->module_text);
  }
  rt.metrics().compiles++;
  rt.metrics().compile_time_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  return compiled;
}

void ScalarToBytes(const c10::Scalar& s, hlo::ElementType e, void* out) {
  switch (e) {
    case hlo::ElementType::kPred: *static_cast<bool*>(out) = s.toBool(); break;
    case hlo::ElementType::kS64: *static_cast<int64_t*>(out) = s.toLong(); break;
    case hlo::ElementType::kS32: *static_cast<int32_t*>(out) = s.toInt(); break;
    case hlo::ElementType::kF32: *static_cast<float*>(out) = s.toFloat(); break;
    case hlo::ElementType::kF64: *static_cast<double*>(out) = s.toDouble(); break;
    default: {
      // Other dtypes of CPU 0-d tensors: convert through a CPU tensor.
      at::Tensor t = at::scalar_tensor(s, at::TensorOptions().dtype(lowering::ToScalarType(e)));
      std::memcpy(out, t.data_ptr(), t.element_size());
    }
  }
}

}  // namespace

std::string BaseName(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  auto pos = name.find("::");
  if (pos != std::string::npos) name = name.substr(pos + 2);
  if (name.size() > 1 && name.back() == '_' && name[name.size() - 2] != '_' && schema.is_mutable()) name.pop_back();
  return name;
}

OpCache& GlobalOpCache() {
  static OpCache* cache = new OpCache();
  return *cache;
}

const CompiledOp& OpCache::Lookup(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                                  const lowering::LoweringEntry& entry) {
  size_t num_args = op.schema().arguments().size();
  size_t first = stack.size() - num_args;
  thread_local OpKey key;
  BuildKey(op, stack, first, entry, key);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = map_.find(key);
  auto& metrics = Runtime::Get().metrics();
  if (it != map_.end()) {
    metrics.cache_hits++;
    return *it->second;
  }
  metrics.cache_misses++;
  auto compiled = Compile(op, stack, first, entry);
  auto [pos, inserted] = map_.emplace(key, std::move(compiled));
  return *pos->second;
}

DeviceStorage& StorageOf(const at::Tensor& t) {
  void* ctx = t.storage().data_ptr().get_context();
  if (!ctx) throw std::runtime_error("tpu tensor without device storage");
  return *static_cast<DeviceStorage*>(ctx);
}

at::Tensor WrapBuffer(StorageBuffer buffer, at::IntArrayRef sizes, at::ScalarType dtype, int device_index) {
  c10::DeviceGuard guard(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
  at::Tensor t = at::detail::empty_generic(sizes, c10::GetAllocator(c10::DeviceType::PrivateUse1),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), dtype,
                                           std::nullopt);
  StorageOf(t).Set(std::move(buffer));
  return t;
}

std::vector<at::Tensor> Launch(const CompiledOp& op, torch::jit::Stack& stack, size_t num_args) {
  auto& rt = Runtime::Get();
  const size_t first = stack.size() - num_args;
  auto tensor_at = [&](const InputSlot& s) -> const at::Tensor& {
    const c10::IValue& v = stack[first + static_cast<size_t>(s.arg)];
    if (s.item < 0) return v.toTensor();
    return v.toListRef()[static_cast<size_t>(s.item)].toTensor();
  };
  for (const auto& [arg, sizes] : op.resize_outputs)
    at::native::resize_output(stack[first + static_cast<size_t>(arg)].toTensor(), sizes);
  int device_index = -1;
  constexpr size_t kMaxInline = 16;
  pjrt::Buffer* inline_args[kMaxInline];
  std::vector<pjrt::Buffer*> heap_args;
  pjrt::Buffer** arg_buffers = inline_args;
  if (op.inputs.size() > kMaxInline) {
    heap_args.resize(op.inputs.size());
    arg_buffers = heap_args.data();
  }
  std::vector<std::shared_ptr<pjrt::Buffer>> temps;
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    const InputSlot& s = op.inputs[i];
    if (s.kind == InputSlot::Kind::kStorage) {
      const at::Tensor& t = tensor_at(s);
      if (device_index < 0) device_index = t.device().index();
      arg_buffers[i] = StorageOf(t).Materialize(s.element).buffer.get();
    }
  }
  if (device_index < 0) {
    // Factories: the device argument, else the current device.
    device_index = 0;
    for (size_t i = first; i < stack.size(); ++i)
      if (stack[i].isDevice() && stack[i].toDevice().has_index()) device_index = stack[i].toDevice().index();
      else if (stack[i].isDevice()) device_index = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getDevice().index();
  }
  for (size_t i = 0; i < op.inputs.size(); ++i) {
    const InputSlot& s = op.inputs[i];
    if (s.kind == InputSlot::Kind::kScalar) {
      const c10::IValue& v = stack[first + static_cast<size_t>(s.arg)];
      c10::Scalar scalar = v.isTensor() ? v.toTensor().item() : v.toScalar();
      alignas(16) char bytes[16] = {};
      ScalarToBytes(scalar, s.element, bytes);
      temps.push_back(rt.ScalarBuffer(bytes, s.element, device_index));
      arg_buffers[i] = temps.back().get();
    } else if (s.kind == InputSlot::Kind::kRng) {
      at::Generator gen;
      if (s.arg >= 0 && stack[first + static_cast<size_t>(s.arg)].isGenerator())
        gen = stack[first + static_cast<size_t>(s.arg)].toGenerator();
      else
        gen = at::globalContext().defaultGenerator(
            c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device_index)));
      uint64_t state[2];
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        state[0] = gen.current_seed();
        state[1] = gen.get_offset();
        gen.set_offset(state[1] + static_cast<uint64_t>(op.rng_increment));
      }
      int64_t dims[] = {2};
      temps.push_back(rt.Upload(state, hlo::ElementType::kU64, dims, device_index));
      arg_buffers[i] = temps.back().get();
    }
  }

  std::unique_ptr<pjrt::Event> done;
  auto outs = op.executable->Execute(std::span<pjrt::Buffer* const>(arg_buffers, op.inputs.size()),
                                     rt.device(device_index), {}, &done);
  rt.metrics().executions++;

  std::vector<at::Tensor> new_tensors;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    const OutputSlot& o = op.outputs[i];
    StorageBuffer sb{std::shared_ptr<pjrt::Buffer>(std::move(outs[i])), o.element, o.numel, op.name};
    if (o.kind == OutputSlot::Kind::kNewTensor) {
      new_tensors.push_back(WrapBuffer(std::move(sb), o.sizes, o.dtype, device_index));
    } else {
      InputSlot s{InputSlot::Kind::kStorage, o.arg, o.item, o.element};
      StorageOf(tensor_at(s)).Set(std::move(sb));
    }
  }
  if (done) rt.Track(std::move(done), op.name);

  // Replace the arguments by the returns.
  std::vector<c10::IValue> returns;
  returns.reserve(op.returns.size());
  for (const auto& r : op.returns) {
    if (r.is_arg) returns.push_back(stack[first + static_cast<size_t>(r.index)]);
    else returns.emplace_back(new_tensors[static_cast<size_t>(r.index)]);
  }
  stack.erase(stack.begin() + static_cast<std::ptrdiff_t>(first), stack.end());
  for (auto& v : returns) stack.push_back(std::move(v));
  return new_tensors;
}

}  // namespace torch_tpu::runtime
