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
compiled once per size bucket (``torch_tpu._dynamic``); training graphs'
forward and backward per exact shape at run time. A graph holding
functional collectives is split at each of them (``_Split``): programs
between them, the collectives run eagerly (tpu_dist) in graph order.

Registered through the ``torch_dynamo_backends`` entry point (so no import
is needed before ``torch.compile``), which importing torch_tpu names in
Dynamo's registry (``torch_tpu._seed_dynamo_backend``: the lookup then skips
``registry._lazy_import()``, which imports every Dynamo backend module);
``register()`` registers it by hand where the package is not installed.
Importing this module routes ``eval_frame.get_compiler_fn`` for ``tpu``
only through ``_DirectBackend`` (no import of Dynamo's repro chain).

``TORCH_TPU_COMPILE_DEBUG=1`` prints why a graph falls back.

Stages: this module (the backend) -> ``torch_tpu._precompile`` (the compile
cache, when enabled) -> ``torch_tpu._graph`` (one FX graph -> one program);
neither of those imports this one.
"""
from __future__ import annotations

import functools
import math
import operator
import os
import warnings
from typing import Callable

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
    # The same for the strided forms: compiled autograd's graph of DDP's
    # python_reducer hooks allocates each gradient with new_empty_strided and
    # copies into it (torch/_dynamo/compiled_autograd.py). A program's
    # outputs are dense, so the strides of a buffer whose every element the
    # graph then writes do not change any value.
    table[aten.empty_strided.default] = _empty_strided_as_zeros
    table[aten.new_empty_strided.default] = _new_empty_strided_as_zeros
    # PyTorch's fused transformer fast path (nn.TransformerEncoderLayer /
    # nn.MultiheadAttention in eval mode under no_grad) has CPU/CUDA
    # kernels only (eager tpu runs csrc/aten/transformer_kernels.cpp): in a
    # graph, its composite, so it is part of the one program.
    table[aten._transformer_encoder_layer_fwd.default] = _transformer_encoder_layer_fwd
    table[aten._native_multi_head_attention.default] = _native_multi_head_attention
    table[aten._transform_bias_rescale_qkv.default] = _transform_bias_rescale_qkv
    table[aten._masked_softmax.default] = _masked_softmax
    return table


# The fast path's ops as the ATen ops they are built from, step by step as
# PyTorch's CPU kernels (aten/src/ATen/native/transformers/transformer.cpp,
# attention.cpp; aten/src/ATen/native/SoftMax.cpp) and the eager tpu
# kernels (csrc/aten/transformer_kernels.cpp). Shapes: src/query [B, T, D],
# qkv_weight [3D, D], heads nh with D % nh == 0. Nested tensors never reach
# a graph (their fake kernels raise).

def _transform_bias_rescale_qkv(qkv, qkv_bias, num_heads):
    """qkv [B, T, 3D] + bias -> q/sqrt(D/nh), k, v, each [B, nh, T, D/nh]."""
    b, t, three_d = qkv.shape
    d = three_d // 3
    torch._check(num_heads > 0 and d % num_heads == 0,
                 lambda: f"_transform_bias_rescale_qkv: D ({d}) must divide evenly by num_head ({num_heads})")
    dh = d // num_heads
    x = (qkv + qkv_bias).view(b, t, 3, num_heads, dh).permute(2, 0, 3, 1, 4)
    return (x[0] * (1.0 / math.sqrt(dh))).contiguous(), x[1].contiguous(), x[2].contiguous()


def _masked_softmax(x, mask, dim=None, mask_type=None):
    """softmax over `dim` (last by default) with mask's True entries at
    -inf; mask_type 0: mask [L, S], 1: key padding [B, S] of x [B, H, L, S],
    2 or None: x's shape. A fully masked row is NaN, as on CPU."""
    torch._check(mask.dtype == torch.bool, lambda: "Mask should be a boolean tensor")
    dim = x.dim() - 1 if dim is None else dim
    if mask_type == 1:
        mask = mask.view(x.shape[0], 1, 1, x.shape[3])
    mask = mask.expand(x.shape)
    reduced = x.dtype in (torch.float16, torch.bfloat16)
    y = x.float() if reduced else x
    out = torch.softmax(y.masked_fill(mask, float("-inf")), dim)
    return out.to(x.dtype) if reduced else out


def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                 proj_bias, mask=None, need_weights=True, average_attn_weights=True,
                                 mask_type=None):
    """-> (out [B, T, D], attention weights [B, (nh,) T, S] or None)."""
    d = embed_dim
    if query is key and key is value:
        qkv = torch.matmul(query, qkv_weight.t())
    elif key is value:
        w_q, w_kv = qkv_weight.split([d, 2 * d], 0)
        qkv = torch.cat([torch.matmul(query, w_q.t()), torch.matmul(key, w_kv.t())], 2)
    else:
        w_q, w_k, w_v = qkv_weight.chunk(3, 0)
        qkv = torch.cat([torch.matmul(query, w_q.t()), torch.matmul(key, w_k.t()),
                         torch.matmul(value, w_v.t())], 2)
    q, k, v = torch.ops.aten._transform_bias_rescale_qkv(qkv, qkv_bias, num_head)
    b, h, t, dh = q.shape
    scores = torch.matmul(q, k.transpose(-2, -1))
    if mask is not None:
        mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
        scores = torch.ops.aten._masked_softmax(scores, mask, scores.dim() - 1, mask_type)
    else:
        scores = torch.softmax(scores, -1)
    merged = torch.matmul(scores, v).permute(0, 2, 1, 3).reshape(b, t, h * dh)
    out = torch.nn.functional.linear(merged, proj_weight, proj_bias)
    weights = None
    if need_weights:
        weights = scores.sum(1) / num_head if average_attn_weights else scores
    return out, weights


def _transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                   use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                   norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None,
                                   mask_type=None):
    """(norm_first) x + MHA(LN1(x)), then + FFN(LN2(.)), else LN1(x +
    MHA(x)), then LN2(. + FFN(.)); FFN = W2 act(W1 x + b1) + b2, act = gelu
    (use_gelu) or relu. -> [B, T, D]."""
    F = torch.nn.functional

    def norm(x, w, b):
        return F.layer_norm(x, (embed_dim,), w, b, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = torch.ops.aten._native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias,
                                                    proj_weight, proj_bias, mask, False, True, mask_type)[0]
    x = x + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    pre_ffn = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    h = F.linear(x, ffn_weight_1, ffn_bias_1)
    h = F.gelu(h) if use_gelu else F.relu(h)
    x = F.linear(h, ffn_weight_2, ffn_bias_2) + pre_ffn
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x


# Backward ops whose lowering needs every return defined: op -> (index of
# output_mask, the argument each return is shaped like).
_FULL_MASK = {
    torch.ops.aten.native_layer_norm_backward.default: (7, (1, 5, 6)),
    torch.ops.aten.native_batch_norm_backward.default: (9, (1, 2, 2)),
}


def normalize(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrites an AOTAutograd ATen graph, in place, into ops the lowering
    takes, with the same values:

    - ``prims.convert_element_type(x, dtype)`` (how Dynamo's Python float
      inputs, passed as 0-d float64 tensors, reach the graph:
      torch/fx/passes/_tensorify_python_scalars.py) -> ``aten._to_copy(x,
      dtype=dtype)``, the same cast;
    - a layer/batch norm backward whose ``output_mask`` leaves a return
      undefined (its input or weight needs no grad) computes that return
      too, unused (the lowering returns every output); a return whose
      argument is None (no weight) stays undefined.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.prims.convert_element_type.default:
            node.target = torch.ops.aten._to_copy.default
            node.kwargs = {"dtype": node.args[1]}
            node.args = (node.args[0],)
        elif node.target in _FULL_MASK:
            at, like = _FULL_MASK[node.target]
            mask = list(node.args[at]) if len(node.args) > at else None
            val = node.meta.get("val")
            if mask is None or all(mask) or not isinstance(val, (list, tuple)):
                continue
            vals = list(val)
            for i, m in enumerate(mask):
                ref = node.args[like[i]]
                ref_val = ref.meta.get("val") if isinstance(ref, torch.fx.Node) else None
                if m or not isinstance(ref_val, FakeTensor) or vals[i] is not None:
                    continue
                with ref_val.fake_mode:
                    vals[i] = torch.empty_like(ref_val, memory_format=torch.contiguous_format)
                mask[i] = True
            args = list(node.args)
            args[at] = mask
            node.args = tuple(args)
            node.meta["val"] = type(val)(vals)
    gm.recompile()
    return gm


def _empty_as_zeros(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                    memory_format=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


def _empty_strided_as_zeros(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.zeros(size, dtype=dtype, layout=layout, device=device)


def _new_empty_strided_as_zeros(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    return torch.zeros(size, dtype=self.dtype if dtype is None else dtype,
                       device=self.device if device is None else device)


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


def _is_collective(node: torch.fx.Node) -> bool:
    """A functional collective or its wait (torch.ops._c10d_functional.*:
    all_reduce, all_gather_into_tensor, reduce_scatter_tensor, wait_tensor,
    ...), or an item of one's result."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and _is_collective(src)
    return isinstance(node.target, torch._ops.OpOverload) and \
        node.target.namespace in ("_c10d_functional", "c10d_functional")


class _Split:
    """An ATen graph holding functional collectives, split at each of them:
    the runs of nodes between collectives are compiled programs
    (``_Program``), each collective and wait runs eagerly between them
    (on tpu tensors: the tpu_dist process group, host-staged), in the
    graph's order, so every rank issues the same collectives in the same
    order as the graph does (no deadlock, no CPU fallback). Called with
    the boxed argument list; returns the graph's outputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, name: str, kind: str):
        self.steps: list = []  # ("program", program, input nodes, output nodes) | ("eager", node)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.programs = 0
        later_uses: dict = {}
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            later_uses[n] = max((order[u] for u in n.users), default=-1)
        run: list = []

        def flush():
            if not run:
                return
            inside = set(run)
            inputs, seen = [], set()
            for n in run:
                for a in n.all_input_nodes:
                    if a not in inside and a not in seen:
                        seen.add(a)
                        inputs.append(a)
            last = order[run[-1]]
            outputs = [n for n in run if later_uses[n] > last and not isinstance(n.meta.get("val"), (list, tuple))]
            if any(later_uses[n] > last and isinstance(n.meta.get("val"), (list, tuple)) for n in run):
                raise GraphLoweringError(f"{name}: a multi-output node is used past a collective")
            g = torch.fx.Graph()
            env = {}
            for a in inputs:
                env[a] = g.placeholder(a.name)
                env[a].meta = dict(a.meta)
            for n in run:
                env[n] = g.node_copy(n, lambda x: env[x])
            g.output(tuple(env[n] for n in outputs))
            sub = torch.fx.GraphModule(gm, g)
            program = _Program(normalize(sub), [a.meta.get("val") for a in inputs],
                               f"{name}_part{len(self.steps)}")
            program.compile()
            self.programs += 1
            self.steps.append(("program", program, inputs, outputs))
            run.clear()

        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n.op == "call_function" and _is_collective(n):
                flush()
                self.steps.append(("eager", n))
            elif n.op == "call_function":
                run.append(n)
            else:
                raise GraphLoweringError(f"node {n.format_node()}: {n.op} is not supported")
        flush()

    def __call__(self, args: list):
        env = dict(zip(self.placeholders, args))
        args.clear()
        for step in self.steps:
            if step[0] == "eager":
                node = step[1]
                a = torch.fx.node.map_arg(node.args, lambda x: env[x])
                kw = torch.fx.node.map_arg(node.kwargs, lambda x: env[x])
                env[node] = node.target(*a, **kw)
            else:
                _, program, inputs, outputs = step
                outs = program([env[a] for a in inputs])
                env.update(zip(outputs, outs))
        results = self.output.args[0]
        return list(torch.fx.node.map_arg(results if isinstance(results, (list, tuple)) else (results,),
                                          lambda x: env[x]))


def _compile_graph(gm: torch.fx.GraphModule, example_inputs, kind: str, donations=()) -> Callable:
    _graph_counter[0] += 1
    name = f"{kind}{_graph_counter[0]}"
    if any(_is_collective(n) for n in gm.graph.nodes):
        try:
            split = _Split(gm, example_inputs, name, kind)
            stats["programs"] += split.programs

            def run(args: list):
                return split(args)

            run._boxed_call = True
            run.split = split
            return run
        except GraphLoweringError as e:
            reason = str(e)
        except RuntimeError as e:
            reason = f"compile failed: {str(e).splitlines()[0]}"
        return _fall_back(gm, name, kind, reason)
    try:
        program = _Program(normalize(gm), example_inputs, name, donations)
        program.compile()
        stats["programs"] += 1
        return _boxed(program)
    except GraphLoweringError as e:
        reason = str(e)
    except RuntimeError as e:  # a compile error of the module: a lowering bug
        reason = f"compile failed: {str(e).splitlines()[0]}"
    return _fall_back(gm, name, kind, reason)


def _fall_back(gm: torch.fx.GraphModule, name: str, kind: str, reason: str) -> Callable:
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


def tpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """The ``tpu`` Dynamo backend (``torch.compile(model, backend="tpu")``)."""
    from . import _C  # noqa: F401  (loads the extension: torch_tpu registers the device)

    if any(_is_symbolic(x) for x in example_inputs):
        from . import _dynamic

        # Symbolic shapes: one program per size bucket (inference) or per
        # exact shape (training), torch_tpu._dynamic.
        return _dynamic.compile_symbolic(gm, example_inputs, _decompositions())
    if (getattr(gm, "_backend_id", None) is not None and _precompile.enabled()
            and torch._dynamo.config.caching_precompile):
        # The compile cache: the same compilers, each program saved with the frame.
        return _precompile.aot_compile(gm, example_inputs, _fw_compiler, _bw_compiler, _inference_compiler,
                                       _decompositions)
    return _aot_backend()(gm, example_inputs, **kwargs)


def enable_compile_cache() -> bool:
    """Saves compiled frames under TORCH_TPU_CACHE_DIR for a warm start in
    later processes (see torch_tpu._precompile); call before torch.compile.
    The same as TORCH_TPU_COMPILE_CACHE=1 (all frames, not only those the
    default safe mode saves)."""
    return _precompile.enable()


def register() -> None:
    """Registers ``tpu`` with Dynamo where the entry point is not installed."""
    from torch._dynamo.backends import registry

    registry._lazy_import()
    if "tpu" not in registry._BACKENDS:
        registry.register_backend(tpu_backend, name="tpu")


# --- how Dynamo calls the backend ------------------------------------------

class _DirectBackend:
    """What ``torch.compile(..., backend="tpu")`` hands Dynamo's frame
    converter in place of ``repro.after_dynamo.WrapBackendDebug``: the same
    attributes (``functools.wraps`` of the backend, ``_torchdynamo_orig_backend``,
    ``get_compiler_config``) and, with ``torch._dynamo.config.repro_after``
    unset (its default), the same call, ``backend(gm, example_inputs,
    **kwargs)``; with it set (read at each call, as WrapBackendDebug does),
    the call goes through WrapBackendDebug itself, so the minifier works as
    for any backend. What it saves: ``eval_frame.get_compiler_fn`` imports
    ``torch._dynamo.repro.after_dynamo`` before wrapping any backend, and
    that module imports functorch's AOT modules, the partitioners, networkx
    (~370 modules) and inductor's codecache; a warm process whose frames
    come from the compile cache never needs them (the backend is not
    called), and the import tipped that process into a full garbage
    collection."""

    def __init__(self, backend, compiler_name):
        functools.wraps(backend)(self)
        self._torchdynamo_orig_backend = backend
        self._compiler_name = compiler_name
        if hasattr(backend, "__name__"):
            self.__name__ = backend.__name__
        if hasattr(backend, "compiler_name"):
            self.__name__ = backend.compiler_name
        if hasattr(backend, "get_compiler_config"):
            self.get_compiler_config = backend.get_compiler_config

    def __call__(self, gm, example_inputs, **kwargs):
        # getattr: a config deleted by a test's monkeypatch undo reads as
        # "does not exist" (ConfigModule.__delattr__ hides the entry)
        if getattr(torch._dynamo.config, "repro_after", None) is not None:
            from torch._dynamo.repro.after_dynamo import WrapBackendDebug

            return WrapBackendDebug(self._torchdynamo_orig_backend, self._compiler_name)(
                gm, example_inputs, **kwargs)
        return self._torchdynamo_orig_backend(gm, example_inputs, **kwargs)


def _is_tpu_backend(fn) -> bool:
    # torch.compile passes a torch._TorchCompileWrapper holding the looked-up
    # function; torch._dynamo.optimize the name or the function itself.
    if isinstance(fn, str):
        return fn == "tpu"
    return fn is tpu_backend or getattr(fn, "compiler_fn", None) is tpu_backend


def _install_direct_backend() -> None:
    """Routes ``eval_frame.get_compiler_fn`` for the ``tpu`` backend only
    through ``_DirectBackend`` (every other backend, and ``tpu`` too with
    ``TORCH_TPU_DIRECT_BACKEND=0``, an A/B switch read here, goes to
    PyTorch's function unchanged). Installed when this module is imported,
    which ``torch.compile`` does at its backend lookup, before it calls
    ``get_compiler_fn``; left out (PyTorch's path) where this PyTorch's
    ``get_compiler_fn`` is not the one this mirrors."""
    if os.environ.get("TORCH_TPU_DIRECT_BACKEND", "1") == "0":
        return
    from torch._dynamo import eval_frame

    original = getattr(eval_frame, "get_compiler_fn", None)
    if original is None or getattr(original, "_torch_tpu_direct", False):
        return
    import inspect

    try:
        if list(inspect.signature(original).parameters) != ["compiler_fn"]:
            return
    except (TypeError, ValueError):
        return

    @functools.wraps(original)
    def get_compiler_fn(compiler_fn):
        if not _is_tpu_backend(compiler_fn):
            return original(compiler_fn)
        if isinstance(compiler_fn, str):
            name = compiler_fn
        else:
            name = getattr(compiler_fn, "compiler_name", None)
            name = name if isinstance(name, str) else None
        from torch._dynamo.backends.registry import lookup_backend

        return _DirectBackend(lookup_backend(compiler_fn), name)

    get_compiler_fn._torch_tpu_direct = True
    eval_frame.get_compiler_fn = get_compiler_fn


_install_direct_backend()
_precompile.maybe_enable_from_env()  # on (safe mode) unless TORCH_TPU_COMPILE_CACHE=0; 1/all opts in to more
