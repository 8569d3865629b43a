// torch_tpu._C bindings of GraphProgram: the Dynamo backend
// (torch_tpu/_dynamo.py) walks an FX graph and builds one program from it.
//
//   p = _C.GraphProgram("forward")
//   x = p.add_input(torch.float32, [4, 8])               # -> _GraphValue
//   y, = p.add_call("aten::relu", (x,), {}, [(torch.float32, [4, 8])])
//   p.set_outputs([y]); p.compile(); outs = p.run([tensor])
//
// Arguments of add_call are matched to the op's schema here (positional,
// then keyword, then the schema default): a _GraphValue is a tensor, a
// list holding _GraphValues (or None) a tensor list, anything else a
// constant converted with the schema argument's type.
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "runtime/graph_program.h"
#include "runtime/runtime.h"

namespace py = pybind11;
using torch_tpu::runtime::GraphArg;
using torch_tpu::runtime::GraphProgram;
using torch_tpu::runtime::GraphUnsupported;

namespace {

struct GraphValue {
  int id = -1;
};

bool IsTensorListType(const c10::TypePtr& t) {
  auto list = t->cast<c10::ListType>();
  if (!list) return false;
  auto elem = list->getElementType();
  if (auto opt = elem->cast<c10::OptionalType>()) elem = opt->getElementType();
  return elem->kind() == c10::TypeKind::TensorType;
}

GraphArg ToGraphArg(const py::handle& obj, const c10::Argument& a, const std::string& op) {
  GraphArg g;
  if (obj.is_none()) {
    g.kind = GraphArg::Kind::kNone;
    return g;
  }
  if (py::isinstance<GraphValue>(obj)) {
    g.kind = GraphArg::Kind::kValue;
    g.id = obj.cast<GraphValue&>().id;
    return g;
  }
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    bool has_value = false;
    for (auto item : obj) has_value |= py::isinstance<GraphValue>(item);
    if (has_value || IsTensorListType(a.type())) {
      g.kind = GraphArg::Kind::kList;
      for (auto item : obj) {
        if (item.is_none()) g.list.push_back(-1);
        else if (py::isinstance<GraphValue>(item)) g.list.push_back(item.cast<GraphValue&>().id);
        else
          throw GraphUnsupported(op + ": argument '" + a.name() + "' holds a " +
                                 std::string(py::str(py::type::of(item))) + " where a graph value is expected");
      }
      return g;
    }
  }
  if (IsTensorListType(a.type()) || THPVariable_Check(obj.ptr()))
    throw GraphUnsupported(op + ": argument '" + a.name() + "' is a constant tensor (not a graph value)");
  g.kind = GraphArg::Kind::kConstant;
  auto type = a.type();
  if (auto opt = type->cast<c10::OptionalType>()) type = opt->getElementType();
  if (type->kind() == c10::TypeKind::TensorType &&
      (PyBool_Check(obj.ptr()) || PyLong_Check(obj.ptr()) || PyFloat_Check(obj.ptr()))) {
    // A Python number where the schema has a Tensor (as PyTorch wraps it).
    g.constant = torch::jit::toIValue(obj, c10::NumberType::get());
    return g;
  }
  try {
    g.constant = torch::jit::toIValue(obj, a.type());
  } catch (const std::exception& e) {
    throw GraphUnsupported(op + ": argument '" + a.name() + "' (" + std::string(py::str(obj)) +
                           ") does not convert to " + a.type()->str() + ": " + e.what());
  }
  return g;
}

py::list AddCall(GraphProgram& p, const std::string& qualified_name, const py::sequence& args,
                 const py::dict& kwargs, const py::sequence& outputs) {
  std::string name = qualified_name, overload;
  if (auto dot = qualified_name.find('.'); dot != std::string::npos) {
    name = qualified_name.substr(0, dot);
    overload = qualified_name.substr(dot + 1);
  }
  auto op = c10::Dispatcher::singleton().findSchema({name, overload});
  if (!op) throw GraphUnsupported("unknown operator " + qualified_name);
  const auto& sargs = op->schema().arguments();
  std::vector<GraphArg> gargs;
  size_t positional = 0, used_kwargs = 0;
  for (const auto& a : sargs) {
    if (a.kwarg_only() && a.alias_info() && a.alias_info()->isWrite()) {
      if (kwargs.contains(a.name().c_str()))
        throw GraphUnsupported(qualified_name + ": out= arguments are not supported in graphs");
      continue;
    }
    py::handle obj;
    bool given = false;
    if (!a.kwarg_only() && positional < py::len(args)) {
      obj = args[positional++];
      given = true;
    } else if (kwargs.contains(a.name().c_str())) {
      obj = kwargs[a.name().c_str()];
      given = true;
      ++used_kwargs;
    }
    if (given) {
      gargs.push_back(ToGraphArg(obj, a, qualified_name));
    } else if (a.default_value()) {
      GraphArg d;
      d.kind = a.default_value()->isNone() ? GraphArg::Kind::kNone : GraphArg::Kind::kConstant;
      d.constant = *a.default_value();
      gargs.push_back(std::move(d));
    } else {
      throw GraphUnsupported(qualified_name + ": missing argument '" + a.name() + "'");
    }
  }
  if (positional < py::len(args) || used_kwargs < py::len(kwargs))
    throw GraphUnsupported(qualified_name + ": arguments do not match the schema " + c10::toString(op->schema()));
  std::vector<torch_tpu::lowering::OutputSpec> specs;
  for (auto o : outputs) {
    if (o.is_none()) {
      specs.push_back({at::ScalarType::Undefined, {}});
      continue;
    }
    auto t = o.cast<py::tuple>();
    specs.push_back({t[0].cast<at::ScalarType>(), t[1].cast<std::vector<int64_t>>()});
  }
  std::vector<int> ids = p.AddCall(*op, std::move(gargs), specs);
  py::list out;
  for (int id : ids) {
    if (id < 0) out.append(py::none());
    else out.append(GraphValue{id});
  }
  return out;
}

}  // namespace

void BindGraphProgram(py::module& m) {
  py::register_exception<GraphUnsupported>(m, "GraphUnsupported", PyExc_NotImplementedError);

  py::class_<GraphValue>(m, "_GraphValue")
      .def_readonly("id", &GraphValue::id)
      .def("__repr__", [](const GraphValue& v) { return "<graph value " + std::to_string(v.id) + ">"; });

  // Held by shared_ptr: a launch recorded into a fused region keeps its
  // program alive until the region has run (GraphProgram::Run).
  py::class_<GraphProgram, std::shared_ptr<GraphProgram>>(m, "GraphProgram")
      .def(py::init<std::string>(), py::arg("name") = "graph")
      .def(
          "add_input",
          [](GraphProgram& p, at::ScalarType dtype, const std::vector<int64_t>& sizes) {
            return GraphValue{p.AddInput(dtype, sizes)};
          },
          py::arg("dtype"), py::arg("sizes"))
      .def("add_call", &AddCall, py::arg("op"), py::arg("args"), py::arg("kwargs"), py::arg("outputs"),
           "Adds one ATen call ('aten::add.Tensor'); outputs: (dtype, sizes) or None per returned tensor")
      .def(
          "set_outputs",
          [](GraphProgram& p, const std::vector<GraphValue>& values) {
            std::vector<int> ids;
            for (const auto& v : values) ids.push_back(v.id);
            p.SetOutputs(ids);
          },
          py::arg("values"))
      .def("donate_input", &GraphProgram::DonateInput, py::arg("input"), py::arg("output"),
           "Output `output` (the new value of input `input`) may reuse the input's buffer")
      // Without the GIL: the compile cache's warm start loads a saved graph's
      // executable on a worker thread while Dynamo builds its guards
      // (torch_tpu/_precompile.py, TpuOutputCode).
      .def("compile", &GraphProgram::Compile, py::call_guard<py::gil_scoped_release>())
      // Without the GIL, as PyTorch's own op bindings: the launch waits for
      // the device (PJRT's Execute, donated buffers) and other Python threads
      // (vLLM's engine-core socket threads) run meanwhile.
      .def("run", &GraphProgram::Run, py::arg("inputs"), py::call_guard<py::gil_scoped_release>(),
           "Runs the program (in fused eager mode: records it as one call of the fused region); "
           "releases the GIL while it runs")
      .def_property_readonly("compiled", &GraphProgram::compiled)
      .def_property_readonly("module_text", &GraphProgram::module_text)
      .def_property_readonly("name", &GraphProgram::name)
      .def_property_readonly("num_inputs", &GraphProgram::num_inputs)
      .def_property_readonly("num_calls", &GraphProgram::num_calls)
      .def_property_readonly("num_rng_ops", &GraphProgram::num_rng_ops)
      // The checks the program computes (after set_outputs): their
      // messages, each starting with the ATen op ("aten::floor_divide:
      // ZeroDivisionError ..."), without the runtime's RuntimeError mark.
      .def_property_readonly("check_messages", [](const GraphProgram& p) {
        const std::string mark = torch_tpu::runtime::Runtime::ValueCheckMessage("");
        std::vector<std::string> out;
        for (const auto& m : p.check_messages())
          out.push_back(m.compare(0, mark.size(), mark) == 0 ? m.substr(mark.size()) : m);
        return out;
      });

  m.def("_graph_has_lowering", &GraphProgram::HasLowering, py::arg("op"),
        "Whether an op ('aten::add.Tensor') has a tpu lowering");
}
