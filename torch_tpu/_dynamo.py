"""``torch.compile(model, backend="tpu")``: the TorchDynamo backend.

AOTAutograd turns each Dynamo graph into a functional ATen forward graph and
(for training) a backward graph. Each of them becomes ONE StableHLO module
through the same lowering registry the eager executors use
(``torch_tpu._C.GraphProgram``), compiled once (through the on-disk
executable cache) and launched as one executable per call. Inputs and
outputs stay on the device.

A graph that cannot be lowered as a whole (an op without a lowering, a
lowering that declines its arguments, a non-ATen callable) runs its FX graph
eagerly on tpu instead, with one warning naming the node. Graphs with
symbolic shapes (Dynamo marks a dimension dynamic after a recompile on a new
shape) are specialized per concrete input shape at run time, since the
program is compiled for static shapes.

Registered through the ``torch_dynamo_backends`` entry point (so no import
is needed before ``torch.compile``); ``register()`` registers it by hand
where the package is not installed.

``TORCH_TPU_COMPILE_DEBUG=1`` prints why a graph falls back.
"""
from __future__ import annotations

import functools
import operator
import os
import warnings
from typing import Any, Callable

import torch

__all__ = ["tpu_backend", "register", "stats", "enable_compile_cache"]

_warned: set[str] = set()
# Graphs compiled as one program, and graphs that run op by op instead.
stats = {"programs": 0, "eager_graphs": 0}


class GraphLoweringError(NotImplementedError):
    """The FX graph cannot be lowered as one program (message names the node)."""


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


# --- decompositions ---------------------------------------------------------

def _qualified_name(op: torch._ops.OpOverload) -> str:
    schema = op._schema
    return schema.name + ("." + schema.overload_name if schema.overload_name else "")


@functools.cache
def _decompositions() -> dict:
    """PyTorch's core ATen decompositions, except for ops the tpu lowers
    directly (layer norm backward, embedding backward, gelu backward, ...):
    one lowering is a smaller program than its decomposition."""
    from torch._decomp import core_aten_decompositions, get_decompositions

    from . import _C

    aten = torch.ops.aten
    decompositions = dict(core_aten_decompositions())
    # Functionalized forms that core ATen keeps but the tpu has no lowering
    # for (training-mode batch norm updates its running statistics).
    decompositions.update(get_decompositions([aten._native_batch_norm_legit_functional]))
    table = {}
    for op, fn in decompositions.items():
        if isinstance(op, torch._ops.OpOverload) and _C._graph_has_lowering(_qualified_name(op)):
            continue
        table[op] = fn
    return table


# --- functional _foreach_* ops: their per-tensor calls ----------------------

def _element_type(t) -> str:
    """The per-tensor type of a foreach argument: List[Tensor] -> Tensor,
    List[number] (Scalar[]) -> number, anything else itself."""
    s = str(t)
    return s[5:-1] if s.startswith("List[") and s != "List[int]" else s


def _accepts(param_type, element: str) -> bool:
    """Whether a per-tensor parameter takes a foreach argument's element
    as it is (a Tensor parameter a Tensor, a Scalar one a Scalar)."""
    s = str(param_type)
    return s == element or s == f"Optional[{element}]"


@functools.cache
def _foreach_element_op(target: torch._ops.OpOverload):
    """The per-tensor ATen operator a functional ``aten._foreach_<op>`` applies
    to each list entry, following PyTorch's slow foreach kernels
    (aten/src/ATen/native/ForeachOpsKernels.cpp: ``_foreach_add.Scalar`` is
    ``add(t, scalar)`` per tensor, ``_foreach_pow.ScalarAndTensor`` is
    ``pow(scalar, t)``): the overload of ``aten.<op>`` whose parameters take
    the foreach arguments' elements in order, returning one Tensor, with the
    fewest parameters left to their defaults. Returns (overload, [(name,
    kwarg_only)] per foreach argument). Raises GraphLoweringError when no
    overload fits (``_foreach_addcdiv.Tensor``, whose 1-D ``scalars`` tensor
    feeds a Scalar parameter, runs op by op)."""
    schema = target._schema
    base = schema.name.split("::")[-1][len("_foreach_"):]
    packet = getattr(torch.ops.aten, base, None)
    if schema.is_mutable or packet is None or len(schema.returns) != 1 or \
            str(schema.returns[0].type) != "List[Tensor]":
        raise GraphLoweringError(f"{_qualified_name(target)} is not a functional foreach op")
    elements = [_element_type(a.type) for a in schema.arguments]
    best = None
    for name in packet.overloads():
        op = getattr(packet, name)
        s = op._schema
        if s.is_mutable or len(s.returns) != 1 or str(s.returns[0].type) != "Tensor":
            continue
        params = [a for a in s.arguments if not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)]
        if len(params) < len(elements) or not all(p.has_default_value() for p in params[len(elements):]):
            continue
        if not all(_accepts(p.type, e) for p, e in zip(params, elements)):
            continue
        if best is None or len(params) < best[0]:
            best = (len(params), op, [(p.name, p.kwarg_only) for p in params[:len(elements)]])
    if best is None:
        raise GraphLoweringError(f"{_qualified_name(target)}: no per-tensor aten.{base} overload takes its arguments")
    return best[1], best[2]


def _foreach_calls(target: torch._ops.OpOverload, args, kwargs, vals, node):
    """The per-tensor calls (op, args, kwargs, spec) of a functional foreach
    node, one per list entry; args/kwargs hold graph values, `vals` the
    node's output metadata (one tensor per entry)."""
    op, plan = _foreach_element_op(target)
    schema = target._schema
    full = []
    for k, a in enumerate(schema.arguments):  # the foreach call's arguments, defaults filled in
        if k < len(args):
            full.append(args[k])
        elif a.name in kwargs:
            full.append(kwargs[a.name])
        elif a.has_default_value():
            full.append(a.default_value)
        else:
            raise GraphLoweringError(f"node {node.format_node()}: missing argument {a.name}")
    is_list = [str(a.type).startswith("List[") and str(a.type) != "List[int]" for a in schema.arguments]
    lengths = {len(v) for v, l in zip(full, is_list) if l}
    if len(lengths) != 1 or not isinstance(vals, (list, tuple)) or len(vals) not in lengths:
        raise GraphLoweringError(f"node {node.format_node()}: lists of different lengths")
    calls = []
    for i in range(len(vals)):
        pos, kw = [], {}
        for (name, kwarg_only), value, listed in zip(plan, full, is_list):
            v = value[i] if listed else value
            if kwarg_only:
                kw[name] = v
            else:
                pos.append(v)
        calls.append((op, pos, kw, _spec(vals[i], node)))
    return calls


# --- one FX graph -> one program -------------------------------------------

def _is_symbolic(x: Any) -> bool:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(x, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in x.shape)
    return False


def _spec(val: Any, node: torch.fx.Node) -> tuple | None:
    if val is None:
        return None
    if not isinstance(val, torch.Tensor):
        raise GraphLoweringError(f"node {node.format_node()} produces a {type(val).__name__}, not a tensor")
    if val.device.type not in ("tpu", "cpu"):
        raise GraphLoweringError(f"node {node.format_node()} produces a tensor on {val.device}")
    if _is_symbolic(val):
        raise GraphLoweringError(f"node {node.format_node()} has symbolic sizes")
    return (val.dtype, [int(s) for s in val.shape])


def _whole_contiguous(val: Any) -> bool:
    try:
        return (val.is_contiguous() and val.storage_offset() == 0
                and val.untyped_storage().nbytes() == val.numel() * val.element_size())
    except Exception:
        return False


class _Ref:
    """A graph value in a recipe (pickles without the extension)."""

    __slots__ = ("id",)

    def __init__(self, id: int):
        self.id = id

    def __reduce__(self):
        return (_Ref, (self.id,))


class _Recording:
    """A GraphProgram under construction and the list of calls that built
    it (add_input, add_call, set_outputs), replayable in another process."""

    def __init__(self, program):
        self.program = program
        self.recipe: list = []

    @staticmethod
    def _to_refs(value):
        from . import _C

        if isinstance(value, _C._GraphValue):
            return _Ref(value.id)
        if isinstance(value, list):
            return [_Recording._to_refs(v) for v in value]
        if isinstance(value, tuple):
            return tuple(_Recording._to_refs(v) for v in value)
        if isinstance(value, dict):
            return {k: _Recording._to_refs(v) for k, v in value.items()}
        return value

    def add_input(self, dtype, sizes):
        v = self.program.add_input(dtype, sizes)
        self.recipe.append(("input", dtype, list(sizes), v.id))
        return v

    def add_call(self, op, args, kwargs, specs):
        outs = self.program.add_call(op, args, kwargs, specs)
        self.recipe.append(("call", op, self._to_refs(args), self._to_refs(kwargs), specs,
                            [None if o is None else o.id for o in outs]))
        return outs

    def set_outputs(self, values):
        self.program.set_outputs(values)
        self.recipe.append(("outputs", [v.id for v in values]))

    @staticmethod
    def replay(name: str, recipe: list):
        from . import _C

        program = _C.GraphProgram(name)
        values: dict[int, Any] = {}

        def resolve(value):
            if isinstance(value, _Ref):
                return values[value.id]
            if isinstance(value, list):
                return [resolve(v) for v in value]
            if isinstance(value, tuple):
                return tuple(resolve(v) for v in value)
            if isinstance(value, dict):
                return {k: resolve(v) for k, v in value.items()}
            return value

        for step in recipe:
            if step[0] == "input":
                _, dtype, sizes, vid = step
                values[vid] = program.add_input(dtype, sizes)
            elif step[0] == "call":
                _, op, args, kwargs, specs, out_ids = step
                outs = program.add_call(op, resolve(args), resolve(kwargs), specs)
                if len(outs) != len(out_ids):
                    raise RuntimeError(f"replaying {op}: {len(outs)} outputs, recorded {len(out_ids)}")
                for o, vid in zip(outs, out_ids):
                    if vid is not None:
                        values[vid] = o
            elif step[0] == "outputs":
                program.set_outputs([values[i] for i in step[1]])
            else:
                raise RuntimeError(f"unknown recipe step {step[0]!r}")
        return program


class _Program:
    """A compiled FX graph: the program, how each graph input is fed, and how
    the outputs are assembled."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, name: str):
        from . import _C

        self.name = name
        program = _Recording(_C.GraphProgram(name))
        env: dict[torch.fx.Node, Any] = {}
        self.input_devices: list[bool] = []   # per placeholder: needs an upload to tpu
        self.constants: list[torch.Tensor] = []  # get_attr tensors, fed after the placeholders
        placeholder_index = 0

        def lookup(a):
            if isinstance(a, torch.fx.Node):
                if a not in env:
                    raise GraphLoweringError(f"node {a.format_node()} has no graph value")
                return env[a]
            return a

        output_plan: list = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if val is None and placeholder_index < len(example_inputs):
                    val = example_inputs[placeholder_index]
                placeholder_index += 1
                if not isinstance(val, torch.Tensor):
                    raise GraphLoweringError(f"input {node.name} is a {type(val).__name__}, not a tensor")
                if _is_symbolic(val):
                    raise GraphLoweringError(f"input {node.name} has symbolic sizes")
                on_tpu = val.device.type == "tpu"
                if not on_tpu and val.device.type != "cpu":
                    raise GraphLoweringError(f"input {node.name} is on {val.device}")
                # CPU inputs (scalars, data the graph moves with .to("tpu")) are
                # uploaded at the call: the whole graph runs on tpu.
                self.input_devices.append(not on_tpu)
                env[node] = program.add_input(val.dtype, [int(s) for s in val.shape])
            elif node.op == "get_attr":
                value: Any = gm
                for atom in str(node.target).split("."):
                    value = getattr(value, atom, None)
                if not isinstance(value, torch.Tensor):
                    raise GraphLoweringError(f"get_attr {node.target} is not a tensor")
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():  # compilers run under the tracing fake mode
                    tensor = value.detach()
                    if tensor.device.type != "tpu":
                        tensor = tensor.to("tpu")
                self.constants.append(tensor)
                env[node] = program.add_input(tensor.dtype, list(tensor.shape))
            elif node.op == "call_function":
                target = node.target
                if target is operator.getitem:
                    src = lookup(node.args[0])
                    if not isinstance(src, (list, tuple)):
                        raise GraphLoweringError(f"node {node.format_node()} indexes a non-sequence")
                    env[node] = src[node.args[1]]
                    continue
                if not isinstance(target, torch._ops.OpOverload):
                    raise GraphLoweringError(f"node {node.format_node()} calls {target}, not an ATen operator")
                val = node.meta.get("val")
                qualified = _qualified_name(target)
                if qualified.startswith("aten::_foreach_") and not _C._graph_has_lowering(qualified):
                    # A functional foreach op (AOTAutograd's form of the
                    # optimizers' in-place ones): its per-tensor calls.
                    args = torch.fx.node.map_aggregate(node.args, lookup)
                    kwargs = dict(torch.fx.node.map_aggregate(dict(node.kwargs), lookup))
                    outs = []
                    for op, a, kw, spec in _foreach_calls(target, args, kwargs, val, node):
                        try:
                            outs.extend(program.add_call(_qualified_name(op), a, kw, [spec]))
                        except _C.GraphUnsupported as e:
                            raise GraphLoweringError(f"node {node.format_node()} ({_qualified_name(op)}): {e}") from None
                    env[node] = outs
                    continue
                returns = target._schema.returns
                if not returns and not target._schema.is_mutable:
                    env[node] = None  # nothing to compute (metadata assertions)
                    continue
                single = len(returns) == 1 and not isinstance(returns[0].type, torch._C.ListType)
                if single:
                    specs = [_spec(val, node)]
                else:
                    if not isinstance(val, (list, tuple)):
                        raise GraphLoweringError(f"node {node.format_node()} has no output metadata")
                    specs = [_spec(v, node) for v in val]
                if target is torch.ops.aten.as_strided.default:
                    src = node.args[0]
                    if not (isinstance(src, torch.fx.Node) and _whole_contiguous(src.meta.get("val"))):
                        raise GraphLoweringError(f"node {node.format_node()}: as_strided of a view")
                args = torch.fx.node.map_aggregate(node.args, lookup)
                kwargs = dict(torch.fx.node.map_aggregate(dict(node.kwargs), lookup))
                if target is torch.ops.aten._to_copy.default:
                    # Devices are tags here: every value lives on tpu; graph
                    # outputs on CPU are copied to the host after the run.
                    kwargs.pop("device", None)
                try:
                    outs = program.add_call(_qualified_name(target), args, kwargs, specs)
                except _C.GraphUnsupported as e:
                    raise GraphLoweringError(f"node {node.format_node()}: {e}") from None
                env[node] = outs[0] if single else list(outs)
            elif node.op == "output":
                results = node.args[0]
                if not isinstance(results, (list, tuple)):
                    results = (results,)
                values = []
                for r in results:
                    v = lookup(r)
                    if v is None:
                        output_plan.append(None)
                    elif isinstance(v, _C._GraphValue):
                        meta = r.meta.get("val") if isinstance(r, torch.fx.Node) else None
                        to_host = isinstance(meta, torch.Tensor) and meta.device.type == "cpu"
                        output_plan.append((len(values), to_host))
                        values.append(v)
                    else:
                        raise GraphLoweringError(f"graph output {r} is a {type(v).__name__}")
                program.set_outputs(values)
            else:
                raise GraphLoweringError(f"node {node.format_node()}: {node.op} is not supported")
        self.output_plan = output_plan
        self.recipe = program.recipe  # what built the program, for the compile cache
        self.program = program.program
        self.device = torch.device("tpu", torch.tpu.current_device())

    @classmethod
    def from_recipe(cls, name: str, recipe: list, input_devices: list, output_plan: list) -> "_Program":
        """The program rebuilt from its recorded calls, without the FX graph."""
        self = cls.__new__(cls)
        self.name = name
        self.program = _Recording.replay(name, recipe)
        self.recipe = recipe
        self.input_devices = list(input_devices)
        self.constants = []
        self.output_plan = list(output_plan)
        self.device = torch.device("tpu", torch.tpu.current_device())
        return self

    def compile(self) -> None:
        self.program.compile()

    def __call__(self, args: list) -> list:
        inputs = list(args)
        args.clear()
        for i, move in enumerate(self.input_devices):
            if move:
                inputs[i] = inputs[i].to(self.device)
        if self.constants:
            inputs.extend(self.constants)
        outs = self.program.run(inputs)
        return [None if k is None else (outs[k[0]].cpu() if k[1] else outs[k[0]]) for k in self.output_plan]


def _boxed(program: _Program) -> Callable:
    """A function (not the object: wrappers such as torch._dynamo.disable
    copy a function's __dict__, where `_boxed_call` must be) taking the
    argument list."""

    def run(args: list):
        return program(args)

    run._boxed_call = True
    run.program = program
    return run


def _eager(gm: torch.fx.GraphModule) -> Callable:
    """The FX graph run op by op (the tpu eager executor), boxed."""

    def run(args: list):
        a = list(args)
        args.clear()
        return gm(*a)

    run._boxed_call = True
    return run


_graph_counter = [0]


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str) -> Callable:
    _graph_counter[0] += 1
    name = f"{kind}{_graph_counter[0]}"
    try:
        program = _Program(gm, example_inputs, name)
        program.compile()
        stats["programs"] += 1
        return _boxed(program)
    except GraphLoweringError as e:
        reason = str(e)
    except RuntimeError as e:  # a compile error of the module: a lowering bug
        reason = f"compile failed: {str(e).splitlines()[0]}"
    if os.environ.get("TORCH_TPU_COMPILE_DEBUG", "0") not in ("", "0"):
        print(f"[torch_tpu] {name} runs eagerly: {reason}\n{gm.graph}")
    stats["eager_graphs"] += 1
    _warn_once(reason, f"torch_tpu: a {kind} graph runs op by op on tpu instead of as one program ({reason})")
    return _eager(gm)


def _fw_compiler(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "forward")


def _bw_compiler(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "backward")


def _inference_compiler(gm, example_inputs):
    compiled = _compile_graph(gm, example_inputs, "inference")
    if _capture:
        _capture[-1].append(_savable(compiled, example_inputs))
    return compiled


@functools.cache
def _aot_backend():
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_fw_compiler, bw_compiler=_bw_compiler,
                        inference_compiler=_inference_compiler, decompositions=_decompositions)


# --- symbolic shapes --------------------------------------------------------

class _Specializing:
    """A Dynamo graph with symbolic shapes: one AOT-compiled static program
    per concrete input signature, built on first use (the integer inputs
    that carry the symbolic sizes become constants of that graph)."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.gm = gm
        self.cache: dict[tuple, Callable] = {}

    @staticmethod
    def _key(args) -> tuple:
        key = [torch.is_grad_enabled()]
        for a in args:
            if isinstance(a, torch.Tensor):
                key.append((a.dtype, tuple(a.shape), a.device, a.requires_grad))
            else:
                key.append((type(a), a))
        return tuple(key)

    def _specialize(self, args) -> Callable:
        from torch._functorch.aot_autograd import aot_module_simplified

        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {}
        tensor_positions = []
        index = 0
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                a = args[index]
                if not isinstance(a, torch.Tensor):
                    env[node] = a  # a concrete size: a constant of this graph
                    index += 1
                    continue
                tensor_positions.append(index)
                index += 1
            env[node] = graph.node_copy(node, lambda n: env[n])
        gm = torch.fx.GraphModule(self.gm, graph)
        tensors = [args[i] for i in tensor_positions]
        compiled = aot_module_simplified(gm, tensors, fw_compiler=_fw_compiler, bw_compiler=_bw_compiler,
                                         inference_compiler=_inference_compiler,
                                         decompositions=_decompositions())

        def run(*call_args):
            return compiled(*[call_args[i] for i in tensor_positions])

        return run

    def __call__(self, *args):
        key = self._key(args)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache[key] = self._specialize(args)
        return fn(*args)


# --- the compile cache (torch_tpu._precompile) ---------------------------------

# One list per backend call being compiled: what its AOT graphs left to save.
_capture: list[list] = []
_PRECOMPILE_FORMAT = 1


def _savable(compiled: Callable, example_inputs) -> tuple | str:
    """(recipe, input_devices, output_plan) of an inference program whose
    AOTAutograd wrapper passes the Dynamo graph's arguments through and
    returns its outputs unchanged; else why not."""
    from torch._functorch._aot_autograd.schemas import OutputType

    program = getattr(compiled, "program", None)
    if program is None:
        return "runs op by op"
    if program.constants:
        return "has constants"
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None:
        return "no AOTAutograd metadata"
    if any(i.mutates_data or i.mutates_metadata for i in meta.input_info):
        return "mutates an input"
    if any(o.output_type != OutputType.non_alias for o in meta.output_info):
        return "an output aliases"
    if meta.num_intermediate_bases or meta.tokens or meta.is_rng_op_functionalized:
        return "AOTAutograd wraps the graph"
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

    if any(isinstance(m, SubclassCreationMeta) for m in list(meta.subclass_inp_meta or ()) +
           list(meta.subclass_fw_graph_out_meta or ())):
        return "tensor subclass inputs or outputs"
    return (program.recipe, program.input_devices, program.output_plan, [
        (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x) for x in example_inputs])


def _record_artifact(backend_id: str, example_inputs, captured: list) -> None:
    """Saves the backend's program for the compile cache when its whole
    output is one pass-through inference program."""
    import pickle

    if len(captured) != 1 or isinstance(captured[0], str):
        return
    recipe, input_devices, output_plan, signature = captured[0]
    if signature != [(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x)
                     for x in example_inputs]:
        return  # AOTAutograd changed the arguments (deduplicated, synthetic bases)
    if not all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in example_inputs):
        return
    try:
        content = pickle.dumps({"format": _PRECOMPILE_FORMAT, "recipe": recipe, "input_devices": input_devices,
                                "output_plan": output_plan})
    except Exception:
        return
    from torch._dynamo.precompile_context import PrecompileContext

    PrecompileContext.record_artifact(TpuProgramArtifact(backend_id, content))


class _LoadedProgram:
    """A saved backend program: rebuilt from its recipe at the first call
    (the executable then comes from the executable cache)."""

    def __init__(self, name: str, content: dict):
        self.name = name
        self.content = content
        self.program: _Program | None = None

    def __call__(self, *args):
        if self.program is None:
            c = self.content
            self.program = _Program.from_recipe(self.name, c["recipe"], c["input_devices"], c["output_plan"])
            self.program.compile()
            stats["programs"] += 1
        return self.program(list(args))


def _artifact_class():
    from torch._dynamo.precompile_context import BackendCacheArtifact

    class TpuProgramArtifact(BackendCacheArtifact):
        """A tpu backend's compiled graph in Dynamo's compile package."""

        def after_deserialization(self):
            import pickle

            content = pickle.loads(self.content)
            if not isinstance(content, dict) or content.get("format") != _PRECOMPILE_FORMAT:
                raise RuntimeError("torch_tpu compile cache: unknown program format")
            return _LoadedProgram(f"cached{self.key}", content)

    TpuProgramArtifact.__module__ = __name__
    TpuProgramArtifact.__qualname__ = "TpuProgramArtifact"
    return TpuProgramArtifact


def __getattr__(name):
    if name == "TpuProgramArtifact":  # defined on first use: torch._dynamo is imported late
        cls = globals()["TpuProgramArtifact"] = _artifact_class()
        return cls
    raise AttributeError(name)


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``tpu`` Dynamo backend (``torch.compile(model, backend="tpu")``)."""
    from . import _C  # noqa: F401  (loads the extension: torch_tpu registers the device)

    if any(_is_symbolic(x) for x in example_inputs):
        from torch._dynamo import disable

        return disable(_Specializing(gm), reason="tpu: per-shape specialization")
    backend_id = getattr(gm, "_backend_id", None)
    if backend_id is None or not torch._dynamo.config.caching_precompile:
        return _aot_backend()(gm, example_inputs, **kwargs)
    _capture.append([])
    try:
        compiled = _aot_backend()(gm, example_inputs, **kwargs)
        captured = _capture[-1]
    finally:
        _capture.pop()
    try:
        _record_artifact(backend_id, example_inputs, captured)
    except Exception as e:  # the cache is best effort
        _warn_once(f"precompile:{type(e).__name__}", f"torch_tpu: cannot save a compiled graph ({e})")
    return compiled


def enable_compile_cache() -> bool:
    """Saves compiled frames under TORCH_TPU_CACHE_DIR for a warm start in
    later processes (see torch_tpu._precompile); call before torch.compile.
    The same as TORCH_TPU_COMPILE_CACHE=1."""
    from . import _precompile

    return _precompile.enable()


def register() -> None:
    """Registers ``tpu`` with Dynamo where the entry point is not installed."""
    from torch._dynamo.backends import registry

    registry._lazy_import()
    if "tpu" not in registry._BACKENDS:
        registry.register_backend(tpu_backend, name="tpu")


if os.environ.get("TORCH_TPU_COMPILE_CACHE", "0") not in ("", "0"):
    from . import _precompile as _pc

    _pc.maybe_enable_from_env()
