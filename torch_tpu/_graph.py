"""One FX graph -> one ``torch_tpu._C.GraphProgram``: the lowering stage of
``torch.compile(model, backend="tpu")`` (``torch_tpu._dynamo`` drives it,
``torch_tpu._precompile`` rebuilds saved programs with it).

``_Program(gm, example_inputs, name)`` walks a functional ATen FX graph
(AOTAutograd's forward, backward or inference graph) and adds each node to
one program through the lowering registry the eager executors use; it raises
GraphLoweringError naming the node where the graph cannot be one program.
``_Recording`` keeps the calls that built a program (its recipe), so another
process can rebuild it without the FX graph (``_Program.from_recipe``).
Imports only the extension and ``_fx_passes`` (the graph rewrites applied
before lowering): nothing of Dynamo or of the compile cache.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch

# Graphs compiled as one program, and graphs that run op by op instead
# (torch_tpu._dynamo.stats).
stats = {"programs": 0, "eager_graphs": 0}


class GraphLoweringError(NotImplementedError):
    """The FX graph cannot be lowered as one program (message names the node)."""


def _qualified_name(op: torch._ops.OpOverload) -> str:
    schema = op._schema
    return schema.name + ("." + schema.overload_name if schema.overload_name else "")


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

    def donate_input(self, input: int, output: int):
        self.program.donate_input(input, output)
        self.recipe.append(("donate", input, output))

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
            elif step[0] == "donate":
                program.donate_input(step[1], step[2])
            else:
                raise RuntimeError(f"unknown recipe step {step[0]!r}")
        return program


class _Program:
    """A compiled FX graph: the program, how each graph input is fed, and how
    the outputs are assembled."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, name: str, donations=()):
        """`donations`: (placeholder index, graph output index) pairs, an
        output being the new value of a mutated input (AOTAutograd's input
        mutations): the program may write it into the input's buffer
        (GraphProgram.donate_input); device outputs only. The graph is
        first rewritten in place by ``_fx_passes`` (one dot for the
        projections of one input), unless TORCH_TPU_FUSE_PROJECTIONS=0."""
        from . import _C, _fx_passes

        if _fx_passes.enabled():
            _fx_passes.fuse_projections(gm)
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
                for input_index, output_index in donations:
                    plan = output_plan[output_index] if output_index < len(output_plan) else None
                    if plan is not None and not plan[1]:
                        try:
                            program.donate_input(input_index, plan[0])
                        except ValueError:
                            pass  # not the input's type, or an input/output twice: a copy
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
