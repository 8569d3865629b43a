"""Size buckets for ``torch.compile(backend="tpu")`` graphs with symbolic
shapes (``dynamic=True``, ``torch._dynamo.mark_dynamic``, or Dynamo's
automatic dynamic after a recompile).

Dynamo traces the symbolic graph once and AOTAutograd turns it into one
symbolic ATen inference graph (its guards decide which calls reach it).
``Bucketed`` serves that graph at every size: at a call, each size symbol
``s`` with real value ``n`` maps to its bucket ``B = bucket(n)`` (the next
power of two, at least ``TORCH_TPU_DYNAMIC_MIN_BUCKET`` = 16, up to
``TORCH_TPU_DYNAMIC_MAX_BUCKET`` = 65536; larger sizes compile exactly);
the graph is specialized at the bucket sizes, with ``n`` as a runtime input
(a 0-d int64 tensor per symbol), and compiled once per bucket through
``torch_tpu._graph._Program`` (the executable cache included). Inputs are
zero-padded along their symbolic dims (through the host: a pad on the
device would compile per size), outputs are narrowed back to the real
sizes (views of the bucket-sized result).

Padding never leaks: a pass over the ATen graph tracks, per value, each
dim as its row-major factors (``(s0,)``, ``(s1, s0)`` for a flattened
batch x sequence dim, ``(4,)``), checked against the FakeTensor shapes.
Only whitelisted ops are bucketed: pointwise ops (``torch.Tag.pointwise``,
``where``, ``masked_fill``, ``tril``/``triu``, casts, clones), views that keep
every symbol a whole factor (view/_unsafe_view/expand/permute/transpose/
unsqueeze/squeeze, full slices of a padded dim, slices/selects/split/cat
on static dims), factories (``full``/``zeros``/``ones``/``arange`` with
symbolic sizes), ``embedding`` (padded index rows), ``native_layer_norm``
over static dims, and contractions/reductions. Before a contraction
(``mm``/``addmm``/``bmm``), reduction (``sum``, ``amax``/``amin``, ``max``/
``min``.dim, ``argmax``/``argmin``, ``prod``, ``any``/``all``,
``logsumexp``) or softmax over a padded dim, the padded positions of the
operand(s) are replaced (``where(arange(B) < n, x, fill)``) by the
operation's identity: 0 for sums and both operands of a contraction (so
a NaN in a padded row cannot reach the result), -inf (the dtype's lowest
for integers) for max/softmax, +inf for min, 1 for prod; ``mean`` becomes
the masked sum divided by the real count; ``cumsum`` needs none (padding is
at the end). A symbolic size may only feed size arguments (view shapes,
factory sizes, slice ends), never a value. Anything else — an op not
listed, a symbol used as a number, a reduction over a flattened
multi-symbol dim, random ops, mutations, a select or partial slice of a
padded dim — makes the graph fall back to per-shape specialization (one
compile per distinct size, exact, no padding), with a debug log naming the
node (``TORCH_TPU_COMPILE_DEBUG=1`` prints it; logger
``torch_tpu.dynamic``).

Only inference graphs are bucketed (``torch.no_grad``, ``inference_mode``
or parameters without grad); a training graph's forward and backward are
``Bucketed`` per exact shape (``compile_symbolic``: AOTAutograd inside
Dynamo's tracing context, so Python float inputs trace). Memory: each padded dim is less than
2x its real size above 16 and 16 below (the attention scores of a padded
sequence less than 4x, 256 elements per head below 16).
``TORCH_TPU_DYNAMIC=0`` turns bucketing off (per-shape specialization).

Bucket statistics: ``stats`` (``bucket_programs``, ``exact_programs``,
``fallback_graphs``).
"""
from __future__ import annotations

import logging
import operator
import os
import warnings
from typing import Any, Callable

import sympy
import torch

from ._graph import GraphLoweringError, _Program
from ._graph import stats as graph_stats

__all__ = ["enabled", "bucket", "compile_symbolic", "Bucketed", "stats"]

log = logging.getLogger("torch_tpu.dynamic")
aten = torch.ops.aten

# Programs compiled per bucket, per exact shape (fallback), and graphs that
# fell back to per-shape specialization.
stats = {"bucket_programs": 0, "exact_programs": 0, "fallback_graphs": 0}


def enabled() -> bool:
    """Whether symbolic inference graphs are bucketed (TORCH_TPU_DYNAMIC, default on)."""
    return os.environ.get("TORCH_TPU_DYNAMIC", "1") not in ("", "0")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a positive integer") from None
    if v < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return v


def bucket(n: int) -> int:
    """The bucket of a size ``n``: the next power of two >= max(n,
    TORCH_TPU_DYNAMIC_MIN_BUCKET (16)); ``n`` itself above
    TORCH_TPU_DYNAMIC_MAX_BUCKET (65536), where padding would cost too much
    memory (such sizes compile per shape)."""
    low = _env_int("TORCH_TPU_DYNAMIC_MIN_BUCKET", 16)
    high = _env_int("TORCH_TPU_DYNAMIC_MAX_BUCKET", 65536)
    if n > high:
        return n
    b = 1
    while b < max(n, low):
        b *= 2
    return b


class _Reject(Exception):
    """The graph cannot be bucketed (message names the node)."""


_warned: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _debug(message: str) -> None:
    log.debug(message)
    if os.environ.get("TORCH_TPU_COMPILE_DEBUG", "0") not in ("", "0"):
        print(f"[torch_tpu] {message}")


# --- symbolic expressions -----------------------------------------------------

def _expr(s) -> sympy.Expr:
    if isinstance(s, torch.SymInt):
        return _exact_floordiv(s.node.expr)
    return sympy.Integer(int(s))


def _exact_floordiv(e: sympy.Expr) -> sympy.Expr:
    """`e` with each FloorDiv(a, b) whose quotient is exact written as that
    quotient (Dynamo's duck-sized graphs hold (s0*s0)//s0 for s0)."""
    from torch.utils._sympy.functions import FloorDiv

    if not e.has(FloorDiv):
        return e

    def exact(a, b):
        q = sympy.cancel(a / b)
        return q if sympy.fraction(q)[1] == 1 else FloorDiv(a, b)

    return e.replace(FloorDiv, exact)


def _prod(factors) -> sympy.Expr:
    p = sympy.Integer(1)
    for f in factors:
        p = p * (f if isinstance(f, sympy.Symbol) else sympy.Integer(f))
    return p


def _is_sym(dim: tuple) -> bool:
    return any(isinstance(f, sympy.Symbol) for f in dim)


def _plain(e: sympy.Expr, node) -> tuple:
    """The factors of a size that is an integer or one symbol."""
    if e.is_Integer:
        return () if int(e) == 1 else (int(e),)
    if isinstance(e, sympy.Symbol):
        return (e,)
    raise _Reject(f"node {node.format_node()}: size {e} is neither a constant nor one symbol")


def _regroup(factors: list, exprs: list, node) -> list:
    """Row-major reshape of a value with these factors into sizes `exprs`:
    each output dim takes consecutive factors (integers may split, symbols
    may not)."""
    factors = list(factors)
    out, i = [], 0
    for e in exprs:
        cur, prod = [], sympy.Integer(1)
        while True:
            r = sympy.simplify(e / prod)
            if r == 1:
                break
            if i >= len(factors):
                raise _Reject(f"node {node.format_node()}: a reshape splits a symbolic size")
            f = factors[i]
            if isinstance(f, sympy.Symbol):
                cur.append(f)
                prod = prod * f
                i += 1
                continue
            if r.is_Integer and int(r) != f:
                r = int(r)
                if f % r == 0:
                    cur.append(r)
                    prod = prod * r
                    factors[i] = f // r
                    continue
            cur.append(f)
            prod = prod * f
            i += 1
        out.append(_canonical(cur))
    if i != len(factors):
        raise _Reject(f"node {node.format_node()}: a reshape leaves factors {factors[i:]}")
    return out


def _canonical(factors) -> tuple:
    """Factors with adjacent integers merged and 1s dropped ((4, 8) -> (32,))."""
    out: list = []
    for f in factors:
        if isinstance(f, sympy.Symbol):
            out.append(f)
        elif f != 1:
            if out and not isinstance(out[-1], sympy.Symbol):
                out[-1] *= f
            else:
                out.append(int(f))
    return tuple(out)


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# --- the whitelist --------------------------------------------------------------

_POINTWISE_EXTRA = {
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten._to_copy.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
    aten.tril.default, aten.triu.default, aten.bitwise_not.default,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_FACTORIES = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
              aten.scalar_tensor.default}
_LIKE = {aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default}
_NEW = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# Ops whose arguments may hold symbolic sizes (as sizes, never as values).
_SIZE_OPS = _VIEWS | _FACTORIES | _NEW | _ARANGE | {aten.expand.default, aten.slice.Tensor}

_NEG, _POS = "-inf", "+inf"
# reduction op -> (identity of its padded positions, how its reduced dims are given)
_REDUCTIONS = {
    aten.sum.dim_IntList: (0, "list"), aten.sum.default: (0, "all"),
    aten.mean.dim: (0, "list"), aten.mean.default: (0, "all"),
    aten.amax.default: (_NEG, "list"), aten.amin.default: (_POS, "list"),
    aten.max.dim: (_NEG, "one"), aten.min.dim: (_POS, "one"),
    aten.argmax.default: (_NEG, "one"), aten.argmin.default: (_POS, "one"),
    aten.prod.dim_int: (1, "one"), aten.prod.default: (1, "all"),
    aten.any.dim: (False, "one"), aten.any.dims: (False, "list"), aten.any.default: (False, "all"),
    aten.all.dim: (True, "one"), aten.all.dims: (True, "list"), aten.all.default: (True, "all"),
    aten.logsumexp.default: (_NEG, "list"),
    aten._softmax.default: (_NEG, "softmax"), aten._log_softmax.default: (_NEG, "softmax"),
}
_MEANS = {aten.mean.dim, aten.mean.default}

# Ops whose program checks an operand's values (CPU raises there: integer
# division by zero, an embedding index out of range; GraphProgram
# check_messages) -> (argument index, the value its padded positions take:
# one no check fails on). Padding holds zeros, or what the graph computed
# from them (an arange past the real length): masked like a reduction's
# operand, so a check sees only real positions. The division family is
# checked (and masked) only for integer results. A bucketed program with a
# check of any other op is compiled per exact shape (Bucketed._build).
_CHECKED_OPERANDS = {
    aten.remainder.Tensor: (1, 1), aten.remainder.Scalar_Tensor: (1, 1), aten.fmod.Tensor: (1, 1),
    aten.div.Tensor_mode: (1, 1),
    aten.embedding.default: (1, 0),
}
_CHECKED_OP_NAMES = {f"aten::{t._schema.name.split('::')[-1]}" + (f".{t._schema.overload_name}"
                                                                   if t._schema.overload_name else "")
                     for t in _CHECKED_OPERANDS}


def _fill_value(fill, dtype: torch.dtype):
    if dtype == torch.bool:
        return {_NEG: False, _POS: True}.get(fill, bool(fill))
    if fill in (_NEG, _POS):
        if dtype.is_floating_point or dtype.is_complex:
            return float("-inf") if fill == _NEG else float("inf")
        info = torch.iinfo(dtype)
        return info.min if fill == _NEG else info.max
    return fill


class _Plan:
    """What the analysis found: per node the factors of each dim (a list of
    them per output for multi-output nodes), and the masks to insert:
    node -> [(argument index, dim, fill)]."""

    def __init__(self):
        self.dims: dict = {}
        self.masks: dict = {}
        self.symbols: list = []           # in binding order
        self.bindings: dict = {}          # symbol -> ("int", arg index) | ("dim", arg index, dim)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape_exprs(val) -> list:
    return [_expr(s) for s in val.shape]


def _analyze(gm: torch.fx.GraphModule) -> _Plan:
    plan = _Plan()
    dims = plan.dims
    sym_nodes: set = set()
    index = 0
    for node in gm.graph.nodes:
        val = _val(node)
        if node.op == "placeholder":
            if isinstance(val, torch.SymInt):
                e = _expr(val)
                if isinstance(e, sympy.Symbol) and e not in plan.bindings:
                    plan.bindings[e] = ("int", index)
                    plan.symbols.append(e)
                sym_nodes.add(node)
            elif isinstance(val, torch.Tensor):
                ds = []
                for d, s in enumerate(val.shape):
                    e = _expr(s)
                    f = _plain(e, node)
                    if f and isinstance(f[0], sympy.Symbol) and e not in plan.bindings:
                        plan.bindings[e] = ("dim", index, d)
                        plan.symbols.append(e)
                    ds.append(f)
                dims[node] = ds
            elif val is not None and not isinstance(val, (int, float, bool)):
                raise _Reject(f"input {node.name} is a {type(val).__name__}")
            index += 1
            continue
        if node.op == "output":
            for r in node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],):
                if r is None or r in sym_nodes:
                    continue
                if not isinstance(r, torch.fx.Node) or r not in dims or not isinstance(_val(r), torch.Tensor):
                    raise _Reject(f"graph output {r} is not a tensor")
                for dim in dims[r]:
                    if _is_sym(dim) and len(dim) != 1:
                        raise _Reject(f"graph output {r.name} has a flattened symbolic dim {dim}")
            continue
        if node.op != "call_function":
            raise _Reject(f"node {node.format_node()}: {node.op} is not supported")
        target = node.target
        if isinstance(val, (torch.SymFloat, torch.SymBool)):
            raise _Reject(f"node {node.format_node()} computes a symbolic {type(val).__name__}")
        if isinstance(val, torch.SymInt) or (target in (aten.sym_size.int, aten.sym_numel.default)):
            sym_nodes.add(node)
            continue
        if target is operator.getitem:
            src = dims.get(node.args[0])
            if not isinstance(src, list) or not src or not isinstance(src[0], list):
                raise _Reject(f"node {node.format_node()} indexes an unknown value")
            dims[node] = src[node.args[1]]
            continue
        if not isinstance(target, torch._ops.OpOverload):
            raise _Reject(f"node {node.format_node()} calls {target}")
        schema = target._schema
        if not schema.returns and not schema.is_mutable:
            continue  # assertions: dropped
        if schema.is_mutable:
            raise _Reject(f"node {node.format_node()} mutates its input")
        if torch.Tag.nondeterministic_seeded in target.tags:
            raise _Reject(f"node {node.format_node()} draws random numbers")
        uses_syms = any(isinstance(a, torch.fx.Node) and a in sym_nodes
                        for a in _flat(list(node.args) + list(node.kwargs.values())))
        if uses_syms and target not in _SIZE_OPS:
            raise _Reject(f"node {node.format_node()} uses a symbolic size as a value")
        dims[node] = _rule(node, target, dims, plan)
        _check(node, dims[node])
    return plan


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def _check(node, d) -> None:
    """The factors found equal the FakeTensor sizes."""
    val = _val(node)
    vals = val if isinstance(val, (list, tuple)) else [val]
    ds = d if (d and isinstance(d[0], list)) else [d]
    if len(vals) != len(ds):
        raise _Reject(f"node {node.format_node()}: {len(ds)} outputs tracked, {len(vals)} produced")
    for v, dd in zip(vals, ds):
        if v is None:
            continue
        if not isinstance(v, torch.Tensor) or len(v.shape) != len(dd):
            raise _Reject(f"node {node.format_node()}: output rank differs from the tracked one")
        for s, f in zip(v.shape, dd):
            if sympy.simplify(_expr(s) - _prod(f)) != 0:
                raise _Reject(f"node {node.format_node()}: size {s} tracked as {f}")


def _arg_dims(a, dims):
    if isinstance(a, torch.fx.Node):
        if a not in dims:
            raise _Reject(f"value {a.name} is not tracked")
        return dims[a]
    return None


def _broadcast(node, dims) -> list:
    val = _val(node)
    out_exprs = _shape_exprs(val)
    rank = len(out_exprs)
    operands = [_arg_dims(a, dims) for a in _flat(list(node.args) + list(node.kwargs.values()))
                if isinstance(a, torch.fx.Node)]
    out = []
    for i, e in enumerate(out_exprs):
        choice = None
        for od in operands:
            if od is None or isinstance(od, list) and od and isinstance(od[0], list):
                raise _Reject(f"node {node.format_node()}: an operand is not one tensor")
            j = i - (rank - len(od))
            if j < 0:
                continue
            f = od[j]
            if _is_sym(f) and sympy.simplify(_prod(f) - e) == 0:
                if choice is not None and choice != f:
                    raise _Reject(f"node {node.format_node()}: operands' dim {i} factor differently")
                choice = f
        out.append(choice if choice is not None else _plain(e, node))
    return out


def _reduced_dims(node, kind, rank) -> list:
    args = node.args
    if kind == "all":
        return list(range(rank))
    if kind == "one":
        d = args[1] if len(args) > 1 else node.kwargs.get("dim")
        if d is None:
            raise _Reject(f"node {node.format_node()} reduces the flattened tensor")
        return [_norm_dim(d, rank)]
    if kind == "softmax":
        return [_norm_dim(args[1], rank)]
    d = args[1] if len(args) > 1 else node.kwargs.get("dim")
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return list(range(rank))
    if isinstance(d, int):
        d = [d]
    return [_norm_dim(x, rank) for x in d]


def _keepdim(node, kind) -> bool:
    if kind in ("all", "softmax"):
        return False
    args = node.args
    return bool(args[2] if len(args) > 2 else node.kwargs.get("keepdim", False))


def _mask(plan, node, arg_index, dim, factors, fill):
    if len(factors) != 1:
        raise _Reject(f"node {node.format_node()} reduces over a flattened symbolic dim {factors}")
    plan.masks.setdefault(node, []).append((arg_index, dim, factors[0], fill))


def _mask_checked(node, target, dims, plan) -> None:
    """Masks the padded positions of the operand `target` checks
    (_CHECKED_OPERANDS)."""
    arg_index, fill = _CHECKED_OPERANDS[target]
    val = _val(node)
    if target is not aten.embedding.default and (val.dtype.is_floating_point or val.dtype.is_complex):
        return  # no check: a floating division gives inf/nan, as CPU
    if len(node.args) <= arg_index:
        raise _Reject(f"node {node.format_node()}: its checked operand is not positional")
    operand = _arg_dims(node.args[arg_index], dims)
    for d, f in enumerate(operand or []):
        if _is_sym(f):
            _mask(plan, node, arg_index, d, f, fill)


def _rule(node, target, dims, plan):
    if target in _CHECKED_OPERANDS:
        _mask_checked(node, target, dims, plan)
    args = node.args
    val = _val(node)
    x = _arg_dims(args[0], dims) if args else None
    if target in _POINTWISE_EXTRA or torch.Tag.pointwise in target.tags:
        if target in (aten.tril.default, aten.triu.default) and any(len(f) > 1 for f in x[-2:]):
            raise _Reject(f"node {node.format_node()}: triangle of a flattened dim")
        return _broadcast(node, dims)
    if target in _VIEWS:
        flat = [f for d in x for f in d]
        return _regroup(flat, _shape_exprs(val), node)
    if target in _FACTORIES or target in _NEW or target in _ARANGE:
        if target in _ARANGE and target is not aten.arange.default:
            if any(isinstance(a, torch.fx.Node) for a in (args[0],)):
                raise _Reject(f"node {node.format_node()}: a symbolic arange start")
        return [_plain(e, node) for e in _shape_exprs(val)]
    if target in _LIKE:
        return list(x)
    if target is aten.expand.default:
        out_exprs = _shape_exprs(val)
        rank = len(out_exprs)
        out = []
        for i, e in enumerate(out_exprs):
            j = i - (rank - len(x))
            if j >= 0 and sympy.simplify(_prod(x[j]) - e) == 0:
                out.append(x[j])
            elif j < 0 or x[j] == ():
                out.append(_plain(e, node))
            else:
                raise _Reject(f"node {node.format_node()}: expands a dim of size {x[j]}")
        return out
    if target is aten.permute.default:
        return [x[_norm_dim(d, len(x))] for d in args[1]]
    if target is aten.transpose.int:
        a, b = _norm_dim(args[1], len(x)), _norm_dim(args[2], len(x))
        out = list(x)
        out[a], out[b] = out[b], out[a]
        return out
    if target is aten.t.default:
        return list(reversed(x))
    if target is aten.unsqueeze.default:
        out = list(x)
        out.insert(_norm_dim(args[1], len(x) + 1), ())
        return out
    if target in (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        exprs = _shape_exprs(_val(args[0]))
        if target is aten.squeeze.default:
            drop = [i for i, e in enumerate(exprs) if e == 1]
        else:
            ds = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
            drop = [_norm_dim(d, len(x)) for d in ds if exprs[_norm_dim(d, len(x))] == 1]
        return [d for i, d in enumerate(x) if i not in drop]
    if target is aten.slice.Tensor:
        d = _norm_dim(args[1] if len(args) > 1 else 0, len(x))
        start = args[2] if len(args) > 2 else None
        step = args[4] if len(args) > 4 else 1
        out = list(x)
        out_e = _shape_exprs(val)[d]
        if _is_sym(x[d]):
            if start not in (None, 0) or step != 1 or sympy.simplify(out_e - _prod(x[d])) != 0:
                raise _Reject(f"node {node.format_node()} slices a padded dim")
        else:
            if any(isinstance(a, torch.fx.Node) for a in args[2:]):
                raise _Reject(f"node {node.format_node()} slices a static dim by a symbolic size")
            out[d] = _plain(out_e, node)
        return out
    if target is aten.select.int:
        d = _norm_dim(args[1], len(x))
        if _is_sym(x[d]):
            raise _Reject(f"node {node.format_node()} selects from a padded dim")
        return x[:d] + x[d + 1:]
    if target in (aten.split.Tensor, aten.split_with_sizes.default):
        d = _norm_dim(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), len(x))
        if _is_sym(x[d]):
            raise _Reject(f"node {node.format_node()} splits a padded dim")
        return [x[:d] + [_plain(_expr(v.shape[d]), node)] + x[d + 1:] for v in val]
    if target is aten.cat.default:
        tensors = args[0]
        rank = len(_val(tensors[0]).shape)
        d = _norm_dim(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), rank)
        parts = [_arg_dims(t, dims) for t in tensors]
        if any(_is_sym(p[d]) for p in parts):
            raise _Reject(f"node {node.format_node()} concatenates along a padded dim")
        out = list(parts[0])
        for p in parts[1:]:
            if [q for i, q in enumerate(p) if i != d] != [q for i, q in enumerate(out) if i != d]:
                raise _Reject(f"node {node.format_node()}: operands factor differently")
        out[d] = _plain(_shape_exprs(val)[d], node)
        return out
    if target is aten.embedding.default:
        w = _arg_dims(args[0], dims)
        if any(_is_sym(f) for f in w):
            raise _Reject(f"node {node.format_node()}: a padded embedding table")
        return list(_arg_dims(args[1], dims)) + [w[1]]
    if target is aten.native_layer_norm.default:
        k = len(args[1])
        if any(_is_sym(f) for f in x[-k:]):
            raise _Reject(f"node {node.format_node()} normalizes over a padded dim")
        stat = x[:-k] + [()] * k
        return [list(x), list(stat), list(stat)]
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        a_i = 1 if target is aten.addmm.default else 0
        a, b = _arg_dims(args[a_i], dims), _arg_dims(args[a_i + 1], dims)
        if target is aten.bmm.default:
            if a[0] != b[0]:
                raise _Reject(f"node {node.format_node()}: batch dims factor differently")
            k_a, k_b, out = 2, 1, [a[0], a[1], b[2]]
        else:
            k_a, k_b, out = 1, 0, [a[0], b[1]]
        if a[k_a] != b[k_b]:
            raise _Reject(f"node {node.format_node()}: contracted dims factor differently")
        if _is_sym(a[k_a]):
            _mask(plan, node, a_i, k_a, a[k_a], 0)
            _mask(plan, node, a_i + 1, k_b, b[k_b], 0)
        if target is aten.addmm.default:
            bias = _arg_dims(args[0], dims)
            for j, f in enumerate(bias):
                i = j + 2 - len(bias)
                if _is_sym(f) and f != out[i]:
                    raise _Reject(f"node {node.format_node()}: bias dims differ")
        return out
    if target is aten.cumsum.default:
        d = _norm_dim(args[1], len(x))
        if _is_sym(x[d]) and len(x[d]) != 1:
            raise _Reject(f"node {node.format_node()}: cumsum over a flattened symbolic dim")
        return list(x)
    if target in _REDUCTIONS:
        fill, kind = _REDUCTIONS[target]
        rank = len(x)
        reduced = _reduced_dims(node, kind, rank)
        for d in reduced:
            if _is_sym(x[d]):
                _mask(plan, node, 0, d, x[d], fill)
        if kind == "softmax":
            return list(x)
        keep = _keepdim(node, kind)
        out = [() if i in reduced else f for i, f in enumerate(x)] if keep else \
            [f for i, f in enumerate(x) if i not in reduced]
        if target in (aten.max.dim, aten.min.dim):
            return [out, list(out)]
        return out
    raise _Reject(f"node {node.format_node()}: {target} is not on the bucketing whitelist")


# --- specialization at one set of sizes -------------------------------------------

def _concretize(gm, plan: _Plan, sizes: dict, masked: bool, example_args):
    """The graph at concrete `sizes` (symbol -> int): symbolic sizes become
    constants; with `masked`, one 0-d int64 input per symbol (its real size)
    follows the tensor inputs and the planned masks are inserted. Returns
    (GraphModule, tensor input positions, output plan) where the output
    plan lists per graph output ("tensor", program output index, [(dim,
    symbol)]), ("int", sympy expression) or ("none",)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    device = torch.device("tpu", torch.tpu.current_device())
    subs = {s: sympy.Integer(v) for s, v in sizes.items()}
    g = torch.fx.Graph()
    env: dict = {}
    tensor_positions = []
    index = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = _val(node)
        if isinstance(val, torch.Tensor):
            env[node] = g.placeholder(node.name)
            tensor_positions.append(index)
        elif isinstance(val, torch.SymInt):
            env[node] = int(_expr(val).subs(subs))
        else:
            env[node] = example_args[index]
        index += 1
    n_inputs = {s: g.placeholder(f"n_{s}") for s in plan.symbols} if masked else {}
    iotas: dict = {}

    def bucket_size(sym):
        return int(subs[sym])

    def masked_value(value, rank, dim, sym, fill, dtype):
        key = (value, dim, sym, fill)
        if key in iotas:
            return iotas[key]
        b = bucket_size(sym)
        ikey = ("keep", sym)
        if ikey not in iotas:
            iota = g.call_function(aten.arange.default, (b,), {"dtype": torch.int64, "device": device})
            iotas[ikey] = g.call_function(aten.lt.Tensor, (iota, n_inputs[sym]))
        shape = [1] * rank
        shape[dim] = b
        keep = g.call_function(aten.view.default, (iotas[ikey], shape))
        filler = g.call_function(aten.full.default, ([], _fill_value(fill, dtype)),
                                 {"dtype": dtype, "device": device})
        out = g.call_function(aten.where.self, (keep, value, filler))
        iotas[key] = out
        return out

    output_plan = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        val = _val(node)
        if node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (list, tuple)) else (node.args[0],)
            values = []
            for r in results:
                if r is None:
                    output_plan.append(("none",))
                elif isinstance(_val(r), torch.SymInt):
                    output_plan.append(("int", _expr(_val(r))))
                elif isinstance(r, torch.fx.Node) and isinstance(_val(r), torch.Tensor):
                    narrow = [(d, f[0]) for d, f in enumerate(plan.dims[r]) if _is_sym(f)] if masked else []
                    output_plan.append(("tensor", len(values), narrow))
                    values.append(env[r])
                else:
                    raise _Reject(f"graph output {r} is not a tensor")
            g.output(tuple(values))
            continue
        if isinstance(val, torch.SymInt):
            env[node] = int(_expr(val).subs(subs))
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and not target._schema.returns \
                and not target._schema.is_mutable:
            continue
        args = list(torch.fx.node.map_arg(node.args, lambda n: env[n]))
        kwargs = dict(torch.fx.node.map_arg(dict(node.kwargs), lambda n: env[n]))
        if masked and node in plan.masks:
            for arg_index, dim, sym, fill in plan.masks[node]:
                src = node.args[arg_index]
                sval = _val(src)
                args[arg_index] = masked_value(args[arg_index], len(sval.shape), dim, sym, fill, sval.dtype)
        if masked and target in _MEANS and any(_is_sym(plan.dims[node.args[0]][d])
                                               for d in _reduced_dims(node, "all" if target is aten.mean.default
                                                                      else "list", len(_val(node.args[0]).shape))):
            x = node.args[0]
            xd = plan.dims[x]
            rank = len(xd)
            reduced = _reduced_dims(node, "all" if target is aten.mean.default else "list", rank)
            keep = False if target is aten.mean.default else _keepdim(node, "list")
            dtype = kwargs.get("dtype")
            total = g.call_function(aten.sum.dim_IntList, (args[0], reduced, keep), {"dtype": dtype})
            count, static = None, 1
            for d in reduced:
                if _is_sym(xd[d]):
                    n = n_inputs[xd[d][0]]
                    count = n if count is None else g.call_function(aten.mul.Tensor, (count, n))
                else:
                    static *= int(_prod(xd[d]))
            if static != 1:
                count = g.call_function(aten.mul.Tensor, (count, static))
            env[node] = g.call_function(aten.div.Tensor, (total, count))
            continue
        env[node] = g.create_node(node.op, target, tuple(args), kwargs, name=node.name)
    new_gm = torch.fx.GraphModule(gm, g)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = []
    with mode:
        for i in tensor_positions:
            v = _val([n for n in gm.graph.nodes if n.op == "placeholder"][i])
            shape = [int(_expr(s).subs(subs)) for s in v.shape]
            fakes.append(torch.empty(shape, dtype=v.dtype, device=v.device))
        for _ in n_inputs:
            fakes.append(torch.empty((), dtype=torch.int64, device="cpu"))
    FakeTensorProp(new_gm, mode).propagate(*fakes)
    return new_gm, tensor_positions, output_plan, fakes


# --- the compiled callable --------------------------------------------------------

_counter = [0]


def _pad(t: torch.Tensor, shape: list) -> torch.Tensor:
    """`t` zero-padded at the end of each dim to `shape`, on t's device
    (through the host for tpu tensors: no program per size)."""
    if list(t.shape) == shape:
        return t
    host = t.cpu() if t.device.type != "cpu" else t
    out = host.new_zeros(shape)
    out[tuple(slice(0, s) for s in t.shape)] = host
    return out.to(t.device) if t.device.type != "cpu" else out


class Bucketed:
    """A symbolic ATen graph (AOTAutograd's inference, forward or backward
    graph) served per size bucket, or per exact size where the analysis
    rejected it, bucketing is off, or the graph is a training one. Called
    with AOTAutograd's boxed argument list (SymInt placeholders receive
    ints). A graph with a symbolic float or bool input, or one the lowering
    cannot take as one program, runs op by op (its FX graph on the real
    arguments) with one warning naming the reason."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, kind: str = "inference",
                 bucketing: bool = True):
        from ._dynamo import normalize

        self.gm = gm = normalize(gm)
        self.kind = kind
        self.programs: dict = {}
        self.eager = None  # the reason the graph runs op by op
        _counter[0] += 1
        self.name = f"dynamic{_counter[0]}"
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(_val(node), (torch.SymFloat, torch.SymBool)):
                self._run_eagerly(f"input {node.name} is a symbolic {type(_val(node)).__name__}")
                return
        self.plan, self.reason = None, "bucketing is off" if not bucketing else None
        if bucketing:
            try:
                self.plan = _analyze(gm)
            except _Reject as e:
                self.reason = str(e)
                stats["fallback_graphs"] += 1
                _debug(f"{self.name} ({kind}): compiled per shape, not per bucket: {self.reason}")
        if self.plan is None:
            try:
                self.plan = _bindings_only(gm)
            except _Reject as e:
                raise RuntimeError(f"torch_tpu: symbolic graph {self.name}: {e}") from None

    def _run_eagerly(self, reason: str) -> None:
        self.eager = reason
        graph_stats["eager_graphs"] += 1
        _debug(f"{self.name} ({self.kind}) runs op by op: {reason}")
        _warn_once(reason, f"torch_tpu: a {self.kind} graph runs op by op on tpu instead of as one program ({reason})")

    def _sizes(self, args) -> dict:
        sizes = {}
        for s in self.plan.symbols:
            b = self.plan.bindings[s]
            sizes[s] = int(args[b[1]]) if b[0] == "int" else int(args[b[1]].shape[b[2]])
        return sizes

    def _build(self, sizes: dict, masked: bool, args):
        gm, positions, output_plan, fakes = _concretize(self.gm, self.plan, sizes, masked, args)
        kind = "b" if masked else "x"
        program = _Program(gm, fakes, f"{self.name}_{kind}" + "_".join(str(v) for v in sizes.values()))
        if masked:
            # A check on the padding would raise where CPU does not: only
            # the ops whose checked operand is masked may check.
            for message in program.program.check_messages:
                op = message.split(": ", 1)[0]
                if op not in _CHECKED_OP_NAMES:
                    raise _Reject(f"{op} checks its values (padding could fail the check)")
        program.compile()  # GraphLoweringError, RuntimeError: see __call__
        graph_stats["programs"] += 1
        stats["bucket_programs" if masked else "exact_programs"] += 1
        subs = {s: sympy.Integer(v) for s, v in sizes.items()}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        shapes = [[int(_expr(d).subs(subs)) for d in _val(placeholders[i]).shape] for i in positions]
        return program, positions, output_plan, shapes

    def __call__(self, args: list):
        args = list(args) if not isinstance(args, list) else args
        call = list(args)
        args.clear()
        if self.eager is not None:
            return list(self.gm(*call))
        real = self._sizes(call)
        masked = self.reason is None
        sizes = {s: bucket(n) for s, n in real.items()} if masked else real
        key = tuple(sizes.values())  # symbols in a fixed order (plan.symbols)
        entry = self.programs.get(key)
        if entry is None:
            try:
                try:
                    entry = self._build(sizes, masked, call)
                except _Reject as e:  # only a masked build rejects: per exact shape from now on
                    self.reason = str(e)
                    stats["fallback_graphs"] += 1
                    _debug(f"{self.name} ({self.kind}): compiled per shape, not per bucket: {self.reason}")
                    self.programs.clear()
                    masked, sizes = False, real
                    key = tuple(sizes.values())
                    entry = self._build(sizes, masked, call)
            except GraphLoweringError as e:
                self._run_eagerly(str(e))
            except RuntimeError as e:  # a compile error of the module: a lowering bug
                self._run_eagerly(f"compile failed: {str(e).splitlines()[0]}")
            if self.eager is not None:
                return list(self.gm(*call))
            self.programs[key] = entry
        program, positions, output_plan, shapes = entry
        inputs = [_pad(call[i], shape) if masked else call[i] for i, shape in zip(positions, shapes)]
        if masked:
            inputs.extend(torch.tensor(real[s], dtype=torch.int64) for s in self.plan.symbols)
        outs = program(inputs)
        results = []
        for p in output_plan:
            if p[0] == "none":
                results.append(None)
            elif p[0] == "int":
                results.append(int(p[1].subs({s: sympy.Integer(v) for s, v in real.items()})))
            else:
                t = outs[p[1]]
                if masked:
                    for d, s in p[2]:
                        if t.shape[d] != real[s]:
                            t = t.narrow(d, 0, real[s])
                results.append(t)
        return results


def _bindings_only(gm) -> _Plan:
    """The symbols and where their values come from, for per-shape
    specialization of a graph the analysis rejected."""
    plan = _Plan()
    for index, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        val = _val(node)
        if isinstance(val, torch.SymInt):
            e = _expr(val)
            if isinstance(e, sympy.Symbol) and e not in plan.bindings:
                plan.bindings[e] = ("int", index)
                plan.symbols.append(e)
        elif isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                e = _expr(s)
                if isinstance(e, sympy.Symbol) and e not in plan.bindings:
                    plan.bindings[e] = ("dim", index, d)
                    plan.symbols.append(e)
    free = set()
    for node in gm.graph.nodes:
        val = _val(node)
        vals = val if isinstance(val, (list, tuple)) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor):
                for s in v.shape:
                    free |= _expr(s).free_symbols
            elif isinstance(v, torch.SymInt):
                free |= _expr(v).free_symbols
    missing = free - set(plan.bindings)
    if missing:
        raise _Reject(f"sizes {sorted(map(str, missing))} are not given by any input")
    return plan


def _boxed(fn: Callable) -> Callable:
    def run(args: list):
        return fn(args)

    run._boxed_call = True
    run.bucketed = fn
    return run


def compile_symbolic(gm: torch.fx.GraphModule, example_inputs, decompositions: dict) -> Callable:
    """AOTAutograd over a symbolic Dynamo graph, inside Dynamo's tracing
    context (its fake mode and ShapeEnv: a Python float input Dynamo
    passes as a 0-d tensor is traced the way Dynamo expects), each ATen
    graph served by ``Bucketed``: the inference graph per size bucket
    (per exact size with TORCH_TPU_DYNAMIC=0), the forward and backward
    graphs of training per exact size."""
    from torch._functorch.aot_autograd import aot_module_simplified

    bucketing = enabled()

    def compiler(kind: str, bucketed: bool):
        def compile(agm, inputs):
            return _boxed(Bucketed(agm, inputs, kind, bucketed))
        return compile

    return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("forward", False),
                                 bw_compiler=compiler("backward", False),
                                 inference_compiler=compiler("inference", bucketing),
                                 decompositions=decompositions)
