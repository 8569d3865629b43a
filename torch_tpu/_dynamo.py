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
symbolic shapes (``dynamic=True``, ``mark_dynamic``, or Dynamo marking a
dimension dynamic after a recompile on a new shape): inference graphs are
compiled once per size bucket (``torch_tpu._dynamic``); training graphs are
specialized per concrete input shape at run time.

Registered through the ``torch_dynamo_backends`` entry point (so no import
is needed before ``torch.compile``); ``register()`` registers it by hand
where the package is not installed.

``TORCH_TPU_COMPILE_DEBUG=1`` prints why a graph falls back.

Stages: this module (the backend) -> ``torch_tpu._precompile`` (the compile
cache, when enabled) -> ``torch_tpu._graph`` (one FX graph -> one program);
neither of those imports this one.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable

import torch

from . import _precompile
from ._graph import GraphLoweringError, _is_symbolic, _Program, _qualified_name, stats  # noqa: F401

__all__ = ["tpu_backend", "register", "stats"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, stacklevel=3)


# --- decompositions ---------------------------------------------------------

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
    # An uninitialized buffer in a graph (vLLM's attention layer allocates its
    # output with torch.empty and the backend copy_s into it): its contents
    # are unspecified, so zeros are a valid value and lower as one constant.
    table[aten.empty.memory_format] = _empty_as_zeros
    return table


def _empty_as_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                    memory_format=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


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


def _mutation_donations(gm: torch.fx.GraphModule) -> list:
    """(placeholder, output) index pairs of an inference graph whose output
    is the new value of a data-mutated input, from AOTAutograd's metadata
    (torch._functorch._aot_autograd.schemas.ViewAndMutationMeta: the
    graph's first outputs are the mutated inputs' values, in input order,
    and its runtime wrapper then runs ``input.copy_(output)``); [] where
    the graph's inputs are not the runtime's one for one."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    if meta is None or meta.tokens or meta.num_intermediate_bases:
        return []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(meta.input_info):
        return []
    pairs = []
    for out, i in enumerate(meta.mutated_inp_runtime_indices):
        info = meta.input_info[i]
        if not info.mutates_data or info.mutates_metadata or info.mutates_storage_metadata:
            return []  # other outputs precede or follow: donate nothing
        pairs.append((i, out))
    return pairs


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, donations=()) -> Callable:
    _graph_counter[0] += 1
    name = f"{kind}{_graph_counter[0]}"
    try:
        program = _Program(gm, example_inputs, name, donations)
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
    # A training forward graph's first outputs are its mutated inputs' new
    # values too (BatchNorm's running statistics): donated the same way.
    return _compile_graph(gm, example_inputs, "forward", _mutation_donations(gm))


def _bw_compiler(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "backward")


def _inference_compiler(gm, example_inputs):
    return _compile_graph(gm, example_inputs, "inference", _mutation_donations(gm))


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


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``tpu`` Dynamo backend (``torch.compile(model, backend="tpu")``)."""
    from . import _C  # noqa: F401  (loads the extension: torch_tpu registers the device)

    if any(_is_symbolic(x) for x in example_inputs):
        from torch._dynamo import disable

        from . import _dynamic

        if _dynamic.enabled() and not _dynamic.needs_grad(example_inputs):
            # Inference: one program per size bucket (torch_tpu._dynamic).
            return _dynamic.compile_inference(gm, example_inputs, _decompositions(), _fw_compiler, _bw_compiler)
        return disable(_Specializing(gm), reason="tpu: per-shape specialization")
    if (getattr(gm, "_backend_id", None) is not None and _precompile.enabled()
            and torch._dynamo.config.caching_precompile):
        # The compile cache: the same compilers, each program saved with the frame.
        return _precompile.aot_compile(gm, example_inputs, _fw_compiler, _bw_compiler, _inference_compiler,
                                       _decompositions)
    return _aot_backend()(gm, example_inputs, **kwargs)


def enable_compile_cache() -> bool:
    """Saves compiled frames under TORCH_TPU_CACHE_DIR for a warm start in
    later processes (see torch_tpu._precompile); call before torch.compile.
    The same as TORCH_TPU_COMPILE_CACHE=1."""
    return _precompile.enable()


def register() -> None:
    """Registers ``tpu`` with Dynamo where the entry point is not installed."""
    from torch._dynamo.backends import registry

    registry._lazy_import()
    if "tpu" not in registry._BACKENDS:
        registry.register_backend(tpu_backend, name="tpu")


_precompile.maybe_enable_from_env()  # on unless TORCH_TPU_COMPILE_CACHE=0
