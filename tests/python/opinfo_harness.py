"""OpInfo conformance harness: PyTorch's own test data (``op_db``) on ``tpu``.

For an OpInfo, a dtype, an eager mode and a phase ("fwd" or "bwd"), every
sample input from ``op.sample_inputs("cpu", dtype, requires_grad=...)`` is run
on CPU and on a tpu copy of the same inputs, and the results are compared.
Each run gives one ``Outcome``:

  pass      values (or, for random ops, shapes/dtypes/devices) match CPU and
            nothing fell back to the CPU
  fail      tpu raised where CPU did not, or the values differ; ``category``
            says which: "wrong values", "compile error", "runtime error",
            "crash" (the process died: see tools/op_coverage.py) or "timeout"
  fallback  values match, but some ATen ops ran through the CPU fallback
            (``fallbacks`` names them, from torch_tpu.metrics()["cpu_fallbacks"])
  skip      nothing to compare: CPU itself raises for that sample, the sample
            holds complex tensors (except for COMPLEX_OPS, which also run
            complex64 samples), or (debug mode) the NaN/Inf check fired as
            designed on a sample whose values are not finite

Tolerance rule (``tolerance()``), chosen by the dtype of each output (an
int64 sample whose output is floating, ``sin`` of an int, compares as float):
start from a per-dtype default — float32 rtol=1.3e-6 atol=1e-5
(torch.testing's), bfloat16 rtol=1.6e-2 atol=1e-5, integer and bool exact — then
  * bfloat16 outputs of reductions, matmuls, convolutions, norms, losses,
    pooling and interpolation (``reduction_like``): atol=1e-2 (CPU accumulates
    in float32 and rounds once; another summation order differs by bf16
    rounding steps of the partial sums);
  * float32 outputs of those ops, and every float32 gradient (backward sums
    over broadcast dims and chains many ops): rtol=1e-5 atol=5e-5
    (``FLOAT32_ACCUMULATING_TOL``: summation order differs from CPU's);
  * take the max with every ``toleranceOverride`` the OpInfo itself declares
    for that dtype (``op.decorators``, any test, device type None/cpu/cuda):
    PyTorch's own tolerance for that op and dtype where it has one;
and NaN compares equal to NaN (as in PyTorch's assertEqual). Random ops
(``is_random``: names with rand/normal/bernoulli/dropout/..., and samples that
use dropout in training mode) and ops whose values are uninitialized
(``empty*``) compare only shapes, dtypes and devices. Where PyTorch leaves
the index of tied values unspecified (unstable sort/argsort, topk, kthvalue,
mode, median), any tpu index that selects the same value passes.

The explicit expected-failure list (``EXPECTED_FAILURES``) is what
tests/python/test_opinfo.py marks xfail (strict=False): new passes do not make
the suite red, new failures do.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
import itertools
import sys
import time
import types
import unittest
import warnings
from typing import Any, Iterable, Iterator

import torch
import torch_tpu
from torch.utils import _pytree as pytree

TPU = torch.device("tpu")
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int64: "int64", torch.bool: "bool",
               torch.complex64: "complex64"}
# OpInfos whose lowerings compute complex values (LoweringTraits::complex,
# docs/design.md "Complex numbers"): they also run complex64 samples, and
# their complex samples/outputs of other dtypes are compared, not skipped.
COMPLEX_OPS = frozenset({
    "add", "sub", "mul", "div.no_rounding_mode", "true_divide", "pow", "neg", "abs", "sgn", "reciprocal", "sqrt",
    "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "tanh", "sigmoid",
    "where", "masked_fill", "eq", "ne", "isnan", "isinf", "addcmul", "addcdiv", "mm", "bmm", "addmm", "baddbmm",
    "addbmm", "addmv", "mv", "dot", "vdot", "matmul", "einsum", "sum", "mean", "prod", "conj_physical", "angle",
    "polar", "complex", "view_as_real", "view_as_complex", "real", "imag", "conj", "resolve_conj",
    "fft.fft", "fft.ifft", "fft.rfft", "fft.irfft", "fft.hfft", "fft.ihfft", "fft.fftn", "fft.ifftn",
    "fft.rfftn", "fft.irfftn", "fft.fft2", "fft.ifft2", "fft.rfft2", "fft.irfft2", "stft", "istft",
})
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
MODES = ("strict", "debug")
PHASES = ("fwd", "bwd")

# ---------------------------------------------------------------------------
# Loading PyTorch's OpInfo database
# ---------------------------------------------------------------------------


def _ensure_expecttest() -> None:
    """common_methods_invocations imports ``expecttest`` (a test-only package
    PyTorch's own CI installs) only to subclass its TestCase. Where it is not
    installed, an equivalent stand-in lets op_db load; nothing here uses it."""
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        stub.ACCEPT = False
        sys.modules["expecttest"] = stub


_OP_DB = None


def op_db() -> list:
    global _OP_DB
    if _OP_DB is None:
        _ensure_expecttest()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db as db
        _OP_DB = list(db)
    return _OP_DB


def full_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def find_op(name: str):
    for op in op_db():
        if full_name(op) == name:
            return op
    raise KeyError(name)


def tested_dtypes(op) -> list[torch.dtype]:
    """The harness dtypes this OpInfo supports on CPU, in DTYPES order."""
    try:
        supported = op.supported_dtypes("cpu")
    except Exception:  # pragma: no cover - malformed OpInfo
        return []
    out = [d for d in DTYPES if d in supported]
    if full_name(op) in COMPLEX_OPS and torch.complex64 in supported:
        out.append(torch.complex64)
    return out


def backward_supported(op) -> bool:
    if not op.supports_autograd:
        return False
    try:
        return torch.float32 in op.supported_backward_dtypes("cpu")
    except Exception:
        return False


# ---------------------------------------------------------------------------
# Classification of OpInfos
# ---------------------------------------------------------------------------

_RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential",
                 "geometric", "cauchy", "log_normal", "randperm", "randint", "random", "rrelu", "fractional_max_pool")
# Ops whose values are nondeterministic or uninitialized, by OpInfo name.
NONDETERMINISTIC = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "nn.functional.feature_alpha_dropout", "nn.functional.alpha_dropout",
    "torch._C._nn._upsample_nearest_exact", "cuda._random", "normal.number_mean",
    "svd_lowrank", "pca_lowrank", "torch.ops.aten._efficient_attention_forward",
}


# OpInfos whose positional tensor arguments must stay on the CPU (PyTorch
# requires it: tensor_split's indices_or_sections).
CPU_ARGS = {"tensor_split"}
# Factory functions whose samples hold (CPU, 0-d) tensors or no tensor at
# all but make a new tensor on the default device: the tpu run passes
# device="tpu" (so do factory OpInfos, ``op.is_factory_function``, whose
# sample has no tensor).
FACTORY_OPS = {"linspace", "logspace", "arange", "full", "scalar_tensor", "eye"}
# OpInfos whose samples ask for other devices (``x.to("cpu")``).
RETURNS_OTHER_DEVICES = {"to", "cpu"}


def sample_is_random(op, sample) -> bool:
    """Samples of deterministic OpInfos that draw random numbers (dropout
    in training mode)."""
    if op.name == "nn.functional.multi_head_attention_forward":
        return bool(sample.kwargs.get("training", True)) and len(sample.args) > 9 and sample.args[9] > 0
    if op.name == "nn.functional.scaled_dot_product_attention":
        return sample.kwargs.get("dropout_p", 0.0) > 0
    return False


def is_random(op) -> bool:
    name = full_name(op)
    if op.name in NONDETERMINISTIC or name in NONDETERMINISTIC:
        return True
    lowered = name.lower()
    return any(w in lowered for w in _RANDOM_WORDS)


# Ops whose results sum many products/elements (bf16 tolerance atol=1e-2).
_REDUCTION_WORDS = ("sum", "mean", "prod", "var", "std", "norm", "cum", "logsumexp", "logcumsumexp",
                    "mm", "matmul", "bmm", "addmv", "mv", "dot", "inner", "outer", "einsum", "tensordot",
                    "conv", "linear", "bilinear", "cdist", "pdist", "trace", "kron", "softmax",
                    "cross_entropy", "nll_loss", "loss", "pool", "interpolate", "upsample", "grid_sample",
                    "embedding_bag", "baddbmm", "addbmm", "addr", "chain_matmul", "multi_dot", "vdot",
                    "attention", "cosine_similarity", "pairwise_distance", "dist", "renorm", "normalize",
                    "instance_norm", "group_norm", "layer_norm", "batch_norm", "rms_norm", "local_response")


def reduction_like(op) -> bool:
    from torch.testing._internal.opinfo.core import ReductionOpInfo

    if isinstance(op, ReductionOpInfo):
        return True
    name = full_name(op).lower()
    return any(w in name for w in _REDUCTION_WORDS)


DEFAULT_TOL = {
    torch.float32: (1.3e-6, 1e-5),   # (rtol, atol): torch.testing's float32 defaults
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.int64: (0.0, 0.0),
    torch.bool: (0.0, 0.0),
    torch.complex64: (1.3e-6, 1e-5),  # torch.testing's complex64 defaults
}
BF16_REDUCTION_ATOL = 1e-2


def _declared_overrides(op, dtype) -> list[tuple[float, float]]:
    """(rtol, atol) of every toleranceOverride the OpInfo declares for dtype."""
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
    except Exception:  # pragma: no cover
        return []
    found = []
    for info in getattr(op, "decorators", ()) or ():
        if getattr(info, "device_type", None) not in (None, "cpu", "cuda"):
            continue
        for dec in getattr(info, "decorators", ()) or ():
            if isinstance(dec, toleranceOverride) and dtype in dec.d:
                tol = dec.d[dtype]
                found.append((float(tol.rtol), float(tol.atol)))
    return found


FLOAT32_ACCUMULATING_TOL = (1e-5, 5e-5)  # (rtol, atol): reductions, matmuls, convolutions, and gradients


def tolerance(op, dtype, out_dtype=None, phase: str = "fwd") -> tuple[float, float]:
    """(rtol, atol) for an output of ``out_dtype`` (default: the sample
    dtype) of this OpInfo run with sample dtype ``dtype``: see the module
    docstring. Integer and bool outputs compare exactly; an int64 sample
    whose output is floating (``sin`` of an int) uses the float rules."""
    out_dtype = dtype if out_dtype is None else out_dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        return 0.0, 0.0
    rtol, atol = DEFAULT_TOL.get(out_dtype, DEFAULT_TOL[torch.float32])
    if out_dtype in (torch.float16, torch.bfloat16):
        rtol, atol = DEFAULT_TOL[torch.bfloat16]
    if out_dtype in (torch.float16, torch.bfloat16) and reduction_like(op):
        atol = max(atol, BF16_REDUCTION_ATOL)
    if out_dtype in (torch.float32, torch.float64, torch.complex64) and (reduction_like(op) or phase == "bwd"):
        rtol, atol = max(rtol, FLOAT32_ACCUMULATING_TOL[0]), max(atol, FLOAT32_ACCUMULATING_TOL[1])
    for r, a in _declared_overrides(op, dtype):
        rtol, atol = max(rtol, r), max(atol, a)
    return rtol, atol


# ---------------------------------------------------------------------------
# Expected failures (measured with tools/op_coverage.py; see docs/op_coverage.md)
# ---------------------------------------------------------------------------

# (OpInfo full name, dtype name, mode, phase) -> reason; "*" matches any
# dtype/mode/phase. Generated with `python tools/op_coverage.py --print-xfail`
# from a full run and pasted here; an entry whose test passes shows as XPASS
# (not an error), so fixing an op never breaks the suite; a failure not
# listed here does.
_BF16_ACC = ("bfloat16: differs from CPU beyond atol=1e-2 in a few elements (accumulation and rounding order "
             "of a reduction)")
_DEBUG_MASKED_NAN = ("debug mode's NaN/Inf check fires on an intermediate NaN/Inf that the op masks later "
                     "(CPU's result is finite)")

EXPECTED_FAILURES: dict[tuple[str, str, str, str], str] = {
    ("native_layer_norm", "bfloat16", "*", "fwd"):
        "mean/rstd are float32 as PyTorch's meta kernel (and CUDA) give; CPU returns bfloat16",
    ("native_batch_norm", "*", "*", "fwd"):
        "eval-mode save_mean/save_invstd: meta gives shape (C,), CPU returns (0,); bf16 stats float32 as on CUDA",
    ("_native_batch_norm_legit", "*", "*", "fwd"):
        "eval-mode save_mean/save_invstd: meta gives shape (C,), CPU returns (0,); bf16 stats float32 as on CUDA",
    ("nn.functional.adaptive_avg_pool3d", "bfloat16", "*", "fwd"):
        "CPU accumulates bf16 in bf16; tpu accumulates in f32 (closer to the float64 value)",
    ("chalf", "*", "*", "*"): "complex32 (ComplexHalf) has no XLA element type",
    ("linalg.eig", "float32", "*", "bwd"):
        "complex eigenvector phase: the loss depends on it (CPU raises for another sample order)",
    # Measured by the full run (tools/op_coverage.py --full); not in the fast subset's samples.
    ("addr", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("nn.functional.conv_transpose2d", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("nn.functional.conv_transpose3d", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("nn.functional.instance_norm", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("nn.functional.interpolate.area", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("nn.functional.interpolate.trilinear", "bfloat16", "*", "fwd"): _BF16_ACC,
    ("linalg.householder_product", "float32", "*", "bwd"):
        "one sample's gradient (|g| ~ 370) differs from CPU by 1.1e-5 relative; the tpu value is the closer "
        "to float64 (max error 1.3e-3 vs CPU's 3.1e-3): summation order of XLA's blocked Householder product",
    # Debug mode's NaN/Inf check fires on an intermediate that the op masks later.
    ("cumprod", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("linalg.norm", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("linalg.norm.subgradients_at_zero", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("linalg.pinv.singular", "float32", "debug", "*"): _DEBUG_MASKED_NAN,
    ("masked.log_softmax", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.logaddexp", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.logsumexp", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.mean", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.norm", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.softmax", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("masked.softmin", "float32", "debug", "bwd"): _DEBUG_MASKED_NAN,
    ("nn.functional.poisson_nll_loss", "*", "debug", "fwd"): _DEBUG_MASKED_NAN,
}


def expected_failure(name: str, dtype: str, mode: str, phase: str) -> str | None:
    for d, m, p in itertools.product((dtype, "*"), (mode, "*"), (phase, "*")):
        reason = EXPECTED_FAILURES.get((name, d, m, p))
        if reason:
            return reason
    return None


# ---------------------------------------------------------------------------
# Outcomes
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    op: str
    dtype: str
    mode: str
    phase: str
    sample: int
    status: str  # pass / fail / fallback / skip
    reason: str = ""
    category: str = ""  # for fail: wrong values / compile error / runtime error / crash / timeout
    fallbacks: list = dataclasses.field(default_factory=list)
    compiles: int = 0
    compile_s: float = 0.0
    seconds: float = 0.0
    aten_ops: list = dataclasses.field(default_factory=list)  # reached on CPU (fwd+bwd), strict only

    def key(self) -> tuple:
        return (self.op, self.dtype, self.mode, self.phase, self.sample)


def first_line(e: BaseException | str, limit: int = 300) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    if isinstance(e, BaseException):
        line = f"{type(e).__name__}: {line}"
    return line[:limit]


def classify_error(e: BaseException) -> str:
    text = str(e)
    if "compiling" in text and "failed" in text:
        return "compile error"
    if "lowering of" in text or "LoweringError" in text:
        return "compile error"
    return "runtime error"


# ---------------------------------------------------------------------------
# Moving samples
# ---------------------------------------------------------------------------


def _map_tensors(obj, fn, memo: dict, key: str | None = None):
    if isinstance(obj, torch.Tensor):
        k = id(obj)
        if k not in memo:
            memo[k] = (obj, fn(obj))  # keep obj alive so ids stay unique
        return memo[k][1]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*[_map_tensors(x, fn, memo) for x in obj])
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn, memo) for x in obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn, memo) for x in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, memo, k) for k, v in obj.items()}
    return obj


def _device_kwarg(value, device):
    if key_is_device(value):
        return device
    return value


def key_is_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return isinstance(value, str) and value == "cpu"


def _has_tensors(obj) -> bool:
    leaves, _ = pytree.tree_flatten(obj)
    return any(isinstance(x, torch.Tensor) for x in leaves)


def _has_complex(obj, sparse_only: bool = False) -> bool:
    leaves, _ = pytree.tree_flatten(obj)
    return any(isinstance(x, torch.Tensor) and ((x.is_complex() and not sparse_only) or x.is_sparse)
               for x in leaves)


class Prepared:
    """One copy of a sample: input, args, kwargs and the leaves that require grad."""

    def __init__(self, sample, device: torch.device, grad: bool, keep_cpu_args: bool = False,
                 factory: bool = False, keep_requires_grad: bool = False, keep_layout: bool = False):
        memo: dict = {}
        leaves: list = []

        storages: dict = {}

        def copy_layout(t: torch.Tensor) -> torch.Tensor:
            # The same sizes, strides and offset over one device copy per
            # storage: expanded tensors and views sharing a storage stay so.
            st = t.untyped_storage()
            k = (st.data_ptr(), st.nbytes(), t.dtype)
            if k not in storages:
                flat = torch.empty(0, dtype=t.dtype).set_(st, 0, (st.nbytes() // t.element_size(),), (1,))
                storages[k] = (flat, flat.detach().to(device))
            return storages[k][1].as_strided(t.shape, t.stride(), t.storage_offset())

        def move(t: torch.Tensor) -> torch.Tensor:
            wants = grad and t.requires_grad
            c = t.detach()
            if device.type == "cpu":
                c = c.clone()
            elif keep_layout and t.layout == torch.strided and not t.is_neg() and not t.is_conj():
                c = copy_layout(c)
            else:
                c = c.to(device)
            if wants:
                c.requires_grad_(True)
                leaves.append(c)
            elif keep_requires_grad and t.requires_grad:  # error_inputs: autograd's own checks
                c.requires_grad_(True)
            return c

        self.input = _map_tensors(sample.input, move, memo)
        self.args = (_map_tensors(tuple(sample.args), lambda t: t.detach().clone(), {}) if keep_cpu_args
                     else _map_tensors(tuple(sample.args), move, memo))
        kwargs = _map_tensors(dict(sample.kwargs), move, memo)
        if device.type != "cpu" and "device" in kwargs:
            kwargs["device"] = _device_kwarg(kwargs["device"], device)
        if device.type != "cpu" and "device" not in kwargs and factory:
            kwargs["device"] = device
        self.kwargs = kwargs
        self.leaves = leaves
        self.output_process_fn_grad = sample.output_process_fn_grad

    def call(self, fn):
        return fn(self.input, *self.args, **self.kwargs)


def _to_cpu(obj):
    return pytree.tree_map(lambda x: x.detach().to("cpu") if isinstance(x, torch.Tensor) else x, obj)


def _tensor_devices(obj) -> set:
    leaves, _ = pytree.tree_flatten(obj)
    return {x.device.type for x in leaves if isinstance(x, torch.Tensor)}


def _nonfinite(obj) -> bool:
    leaves, _ = pytree.tree_flatten(obj)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() and not torch.isfinite(
                x.detach().to("cpu")).all():
            return True
        if isinstance(x, float) and not (x == x and abs(x) != float("inf")):
            return True
    return False


# ---------------------------------------------------------------------------
# Comparing
# ---------------------------------------------------------------------------


class Mismatch(AssertionError):
    pass


def compare(actual, expected, rtol=None, atol=None, values: bool = True, path: str = "out", tol=None) -> None:
    """Raises Mismatch naming the first leaf that differs. ``actual`` is the
    tpu result already moved to CPU (devices are checked separately).
    ``tol(out_dtype) -> (rtol, atol)`` chooses per-leaf tolerances; else rtol/atol."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if len(a_leaves) != len(e_leaves):
        raise Mismatch(f"{path}: structure differs: tpu {a_spec} vs cpu {e_spec}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = f"{path}[{i}]" if len(e_leaves) > 1 else path
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{where}: tpu returned {type(a).__name__}, cpu a Tensor")
            if a.shape != e.shape:
                raise Mismatch(f"{where}: shape {tuple(a.shape)} != cpu {tuple(e.shape)}")
            if a.dtype != e.dtype:
                raise Mismatch(f"{where}: dtype {a.dtype} != cpu {e.dtype}")
            if not values:
                continue
            r, t = tol(e.dtype) if tol else (rtol, atol)
            try:
                torch.testing.assert_close(a, e, rtol=r, atol=t, equal_nan=True, check_device=False,
                                           check_layout=False)
            except AssertionError as err:
                lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
                detail = "; ".join(lines[:4])
                raise Mismatch(f"{where}: {detail}") from None
        elif isinstance(e, float) and isinstance(a, (float, int)):
            r, t = tol(torch.float64) if tol else (rtol, atol)
            if values and not (a == e or (a != a and e != e) or abs(a - e) <= t + r * abs(e)):
                raise Mismatch(f"{where}: {a} != cpu {e}")
        elif values and a != e:
            raise Mismatch(f"{where}: {a!r} != cpu {e!r}")


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


class _AtenRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ATen overloads a CPU run reaches (after autograd and the
    CompositeImplicitAutograd decompositions: what the tpu key would see)."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))  # "aten.add.Tensor"
        return func(*args, **(kwargs or {}))


def _delta(before: dict, after: dict) -> list[str]:
    return sorted(k for k, v in after.items() if v != before.get(k, 0))


def generate_samples(op, dtype, requires_grad: bool, limit: int | None = None, seed: int = 0) -> list:
    """The OpInfo's sample inputs on CPU, reproducibly (seeded)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = op.sample_inputs("cpu", dtype, requires_grad=requires_grad)
        return list(itertools.islice(it, limit)) if limit is not None else list(it)


@dataclasses.dataclass
class Reference:
    """The CPU result of one sample (computed once, shared by both modes)."""
    ok: bool
    error: str = ""
    out: Any = None  # forward result (fwd) or input grads (bwd)
    nonfinite_input: bool = False
    aten_ops: tuple = ()


def _grad_outputs(outs: list) -> list:
    """Output gradients: seeded normal values, made on CPU, on each output's device."""
    g = torch.Generator().manual_seed(1234)
    res = []
    for o in outs:
        if o.dtype.is_floating_point:
            v = torch.randn(o.shape, generator=g, dtype=o.dtype)
        else:
            v = torch.ones(o.shape, dtype=o.dtype)
        res.append(v.to(o.device))
    return res


def _diff_outputs(prepared: Prepared, out) -> list:
    out = prepared.output_process_fn_grad(out)
    leaves, _ = pytree.tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _backward(prepared: Prepared, out, grad_outputs: list):
    outs = _diff_outputs(prepared, out)
    if not outs:
        raise _NoGrad("no output requires grad")
    if not prepared.leaves:
        raise _NoGrad("no input requires grad")
    grads = torch.autograd.grad(outs, prepared.leaves, grad_outputs, allow_unused=True)
    return list(grads)


class _NoGrad(Exception):
    pass


def _cpu_run(op, sample, phase: str, recorder: _AtenRecorder | None = None):
    """Runs the sample on CPU copies; ``recorder`` (if given) is active only
    around the op and its backward, not around the harness's own copies."""
    prepared = Prepared(sample, torch.device("cpu"), grad=(phase == "bwd"))

    def traced():
        return recorder if recorder is not None else contextlib.nullcontext()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with traced():
            out = prepared.call(op.op)
        if phase == "bwd":
            outs = _diff_outputs(prepared, out)
            if not outs:
                raise _NoGrad("no output requires grad")
            if not prepared.leaves:
                raise _NoGrad("no input requires grad")
            gouts = _grad_outputs(outs)
            with traced():
                out = list(torch.autograd.grad(outs, prepared.leaves, gouts, allow_unused=True))
    return prepared, out


def trace_aten_ops(op, sample, phase: str) -> tuple:
    """The ATen overloads a CPU run of the sample reaches (forward, and the
    backward for phase "bwd"); () where the traced run raises."""
    recorder = _AtenRecorder()
    try:
        _cpu_run(op, sample, phase, recorder)
    except Exception:  # noqa: BLE001
        pass
    return tuple(sorted(recorder.ops))


def cpu_reference(op, sample, phase: str, trace: bool = False) -> Reference:
    try:
        prepared, out = _cpu_run(op, sample, phase)
    except _NoGrad as e:
        return Reference(False, error=f"no gradient to compare ({e})")
    except Exception as e:  # noqa: BLE001 - CPU rejects the sample
        return Reference(False, error=f"CPU raises {first_line(e)}")
    nonfinite = _nonfinite((sample.input, sample.args, sample.kwargs))
    return Reference(True, out=_to_cpu(out), nonfinite_input=nonfinite,
                     aten_ops=trace_aten_ops(op, sample, phase) if trace else ())


def _sort_dim(op, sample) -> int:
    args, kwargs = sample.args, sample.kwargs
    if "dim" in kwargs:
        return kwargs["dim"]
    if op.name == "topk":
        return args[1] if len(args) > 1 else -1
    return args[0] if args and isinstance(args[0], int) and not isinstance(args[0], bool) else -1


# Ops returning (values, indices) along a dim whose index for tied values
# PyTorch does not document: (position of dim, position of keepdim) in args.
_TIED_INDEX_OPS = {"kthvalue": (1, 2), "mode": (0, 1), "median": (0, 1), "nanmedian": (0, 1)}


def _tied_index_ok(op, sample, actual, expected, tol) -> bool:
    dim_pos, keep_pos = _TIED_INDEX_OPS[op.name]
    args, kwargs = sample.args, sample.kwargs
    if not (isinstance(actual, (tuple, list)) and len(actual) == 2):
        return False
    dim = kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else -1)
    keepdim = kwargs.get("keepdim", args[keep_pos] if len(args) > keep_pos else False)
    inp = sample.input.detach()
    values, indices = actual
    compare(values, expected[0], tol=tol)
    if indices.dtype != expected[1].dtype or indices.shape != expected[1].shape:
        return False
    if inp.dim() == 0:
        return bool((indices == 0).all())
    idx = indices if keepdim else indices.unsqueeze(dim)
    vals = values if keepdim else values.unsqueeze(dim)
    compare(inp.gather(dim, idx), vals, 0, 0)
    return True


def _ties_explain(op, sample, actual, expected, tol) -> bool:
    """Unstable sort/argsort and topk may order equal values differently from
    CPU (PyTorch documents no tie order unless stable=True), and kthvalue,
    mode, median may return any index of a tied value: accept tpu indices
    that select the same values from the input."""
    if op.name in _TIED_INDEX_OPS and isinstance(sample.input, torch.Tensor):
        try:
            return _tied_index_ok(op, sample, actual, expected, tol)
        except (Mismatch, RuntimeError, IndexError):
            return False
    if op.name not in ("sort", "argsort", "topk", "msort") or not isinstance(sample.input, torch.Tensor):
        return False
    if sample.kwargs.get("stable", False) or (op.name == "sort" and len(sample.args) > 2 and sample.args[2]):
        return False
    inp = sample.input.detach()
    dim = _sort_dim(op, sample) if inp.dim() else 0
    try:
        if op.name == "argsort":
            got, want = inp.gather(dim, actual) if inp.dim() else inp, inp.gather(dim, expected) if inp.dim() else inp
            compare(got, want, 0, 0)
            return True
        if op.name == "msort":
            return False
        values, indices = actual
        compare(values, expected[0], tol=tol)
        compare(indices.dtype, expected[1].dtype, 0, 0)
        if inp.dim():
            compare(inp.gather(dim, indices), values, 0, 0)
            if op.name == "sort":  # a permutation along dim
                compare(indices.sort(dim).values, expected[1].sort(dim).values, 0, 0)
        return True
    except (Mismatch, RuntimeError, IndexError):
        return False


# Ops whose outputs PyTorch documents as unique only up to sign (singular
# vectors, eigenvectors; the completion of U/Vh for full_matrices): their
# OpInfos pass an ``output_process_fn_grad`` that keeps the sign-invariant part
# (|U|, |Vh|, U @ Vh, S; eigenvalues and |eigenvectors|), which is what a tpu
# forward is compared through when the raw outputs differ.
_SIGN_AMBIGUOUS_OPS = ("svd", "linalg.svd", "linalg.eigh")


def _sign_explain(op, sample, actual, expected, tol) -> bool:
    if op.name not in _SIGN_AMBIGUOUS_OPS:
        return False
    fn = sample.output_process_fn_grad
    try:
        compare(fn(actual), fn(expected), tol=tol)
        return True
    except (Mismatch, RuntimeError, IndexError, TypeError):
        return False


def run_on_tpu(op, sample, phase: str, mode: str, ref: Reference):
    """Runs the sample on tpu in `mode`; returns the result moved to CPU and
    the set of devices of the returned tensors."""
    factory = op.name in FACTORY_OPS or (getattr(op, "is_factory_function", False)
                                         and not _has_tensors((sample.input, sample.args, sample.kwargs)))
    def prepare():
        return Prepared(sample, TPU, grad=(phase == "bwd"), keep_cpu_args=op.name in CPU_ARGS, factory=factory)

    with torch_tpu.eager_mode(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "strict" and not is_random(op):
            # Strict mode serves a key's first calls on the CPU kernel
            # (host-first; by default the second call queues the compile):
            # two warm-up calls on fresh inputs, then metrics() waits for the
            # queued compiles, so the compared call runs the device programs
            # (else strict mode would compare CPU's kernel with CPU).
            for _ in range(2):
                warm = prepare()
                w = warm.call(op.op)
                if phase == "bwd":
                    w = _backward(warm, w, _grad_outputs(_diff_outputs(warm, w)))
                _to_cpu(w)
            torch_tpu.metrics()
        prepared = prepare()
        out = prepared.call(op.op)
        if phase == "bwd":
            outs = _diff_outputs(prepared, out)
            out = _backward(prepared, out, _grad_outputs(outs))
        devices = _tensor_devices(out)
        result = _to_cpu(out)  # a sync point: strict mode's errors surface here
        torch.tpu.synchronize()
    return result, devices


def run_sample(op, sample, index: int, dtype, mode: str, phase: str, ref: Reference | None = None) -> Outcome:
    name, dname = full_name(op), DTYPE_NAMES[dtype]
    outcome = Outcome(name, dname, mode, phase, index, "skip")
    complex_ok = name in COMPLEX_OPS
    if _has_complex((sample.input, sample.args, sample.kwargs), sparse_only=complex_ok):
        outcome.reason = "complex or sparse tensors"
        return outcome
    if name.startswith("sparse.") or name.startswith("to_sparse"):
        outcome.reason = "sparse OpInfo: compressed layouts have no tpu kernels; COO samples run in tests/python/test_sparse.py"
        return outcome
    if ref is None:
        ref = cpu_reference(op, sample, phase)
    if mode == "strict":
        outcome.aten_ops = list(ref.aten_ops)
    if not ref.ok:
        outcome.reason = ref.error
        return outcome
    if _has_complex(ref.out, sparse_only=complex_ok):
        outcome.reason = "complex or sparse tensors"
        return outcome
    m0 = torch_tpu.metrics()
    t0 = time.perf_counter()
    fb0 = dict(m0["cpu_fallbacks"])
    error: BaseException | None = None
    try:
        result, devices = run_on_tpu(op, sample, phase, mode, ref)
    except Exception as e:  # noqa: BLE001
        error = e
        try:
            torch.tpu.synchronize()
        except Exception:  # noqa: BLE001 - the same error again
            pass
    m1 = torch_tpu.metrics()
    outcome.seconds = time.perf_counter() - t0
    outcome.compiles = m1["compiles"] - m0["compiles"]
    outcome.compile_s = m1["compile_time_s"] - m0["compile_time_s"]
    outcome.fallbacks = _delta(fb0, m1["cpu_fallbacks"])
    if error is not None:
        msg = first_line(error)
        if mode == "debug" and "tpu debug mode:" in str(error) and ("NaN" in str(error) or "Inf" in str(error)):
            if ref.nonfinite_input or _nonfinite(ref.out):
                outcome.status, outcome.reason = "skip", f"debug NaN/Inf check fired as designed: {msg}"
                return outcome
        category = classify_error(error)
        if mode == "debug" and "tpu debug mode:" in str(error):
            category = "debug check"  # debug mode raised where CPU computes finite values
        outcome.status, outcome.reason, outcome.category = "fail", msg, category
        return outcome
    def tol(out_dtype):
        return tolerance(op, dtype, out_dtype, phase)

    try:
        if phase == "fwd" and devices - {"tpu"} and op.name not in RETURNS_OTHER_DEVICES:
            raise Mismatch(f"returned tensors on {sorted(devices)}, expected tpu")
        try:
            compare(result, ref.out, values=not (is_random(op) or sample_is_random(op, sample)),
                    path="out" if phase == "fwd" else "grad", tol=tol)
        except Mismatch:
            if not (phase == "fwd" and (_ties_explain(op, sample, result, ref.out, tol)
                                        or _sign_explain(op, sample, result, ref.out, tol))):
                raise
    except Mismatch as e:
        outcome.status, outcome.reason, outcome.category = "fail", str(e)[:400], "wrong values"
        return outcome
    if outcome.fallbacks:
        outcome.status = "fallback"
        outcome.reason = "CPU fallback: " + ", ".join(outcome.fallbacks)
    else:
        outcome.status = "pass"
    return outcome


# ---------------------------------------------------------------------------
# error_inputs: invalid inputs that CPU rejects
# ---------------------------------------------------------------------------
#
# Every OpInfo's ``error_inputs(device)`` yields ErrorInputs: a sample, the
# exception type PyTorch raises for it and a regex its message matches
# (PyTorch's own test_ops.py::test_errors asserts exactly that on each
# device). Here each ErrorInput generated for "cpu" is first checked on CPU
# (CPU must raise error_type matching error_regex; else the case is a skip:
# the ErrorInput does not hold on this PyTorch), then its tensors are copied
# to tpu and the call runs in the chosen eager mode. The tpu run, the move
# of the result to the host and a synchronize() are all inside the
# expectation: in strict and fused mode an error that needs device values
# surfaces at that sync point, in debug mode at the op.
#
# Some ErrorInputs depend on the device they are generated for: PyTorch
# guards a few with ``device == "cpu"`` (CPU's kernels raise a CPU-specific
# message, or CUDA does not check), and adds cases mixing a CPU tensor into
# an accelerator call (``device != "cpu"``). So error_inputs("tpu") is
# generated too: an ErrorInput of that list whose sample has the same
# structure (tensor shapes and dtypes, other arguments) as a CPU one is the
# expectation PyTorch declares for a non-CPU device, accepted as an
# alternative; the rest (cross-device cases) run as generated, with
# PyTorch's expectation and no CPU run.
#
# Outcomes (phase "error", dtype "-"): pass (tpu raised the expected type
# with a matching message; ``fallbacks`` says when the error came from an op
# that ran on the CPU), fail with category "no error" (tpu returned a
# value), "wrong exception type" or "message differs", or skip.
# ``error_inputs_sparse`` is not run here: for the COO layout (the sparse
# layout tpu has) PyTorch 2.13 defines none (tests/python/test_sparse.py
# checks that, and runs the OpInfos' COO samples); compressed layouts
# (CSR/CSC/BSR/BSC) have no tpu kernels.

ERROR_PHASE = "error"
ERROR_DTYPE = "-"


@dataclasses.dataclass
class ErrorCase:
    """One ErrorInput: ``sample`` on CPU (or, when ``device_only``, as
    generated for tpu), with the expectations a tpu run may meet."""
    index: int
    sample: Any
    expected: list  # [(exception type, regex)], the first from the "cpu" list
    device_only: bool = False


def _error_signature(sample, device_type: str) -> tuple:
    """The structure of a sample, values aside: tensors as (shape, dtype,
    "dev" on ``device_type`` else their device type), other leaves as repr."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    sig = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            sig.append(("T", tuple(x.shape), str(x.dtype), "dev" if x.device.type == device_type else x.device.type))
        elif isinstance(x, torch.device) or (isinstance(x, str) and x in ("cpu", device_type)):
            sig.append(("D",))
        else:
            sig.append(repr(x)[:200])
    return str(spec), tuple(sig)


def _list_error_inputs(op, device: str) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return list(op.error_inputs(device))


def has_error_inputs(op) -> bool:
    return getattr(op, "error_inputs_func", None) is not None


def generate_error_cases(op) -> tuple[list[ErrorCase], str]:
    """The OpInfo's ErrorInputs as ErrorCases, and a note ("" or why the
    tpu-generated list could not be made)."""
    cpu_list = _list_error_inputs(op, "cpu")
    note = ""
    try:
        with torch_tpu.eager_mode("strict"):
            tpu_list = _list_error_inputs(op, "tpu")
            torch.tpu.synchronize()
    except Exception as e:  # noqa: BLE001 - generating on tpu failed: CPU list only
        tpu_list, note = [], f"error_inputs('tpu') raises {first_line(e)}"
    unpaired = {}
    for e in tpu_list:
        unpaired.setdefault(_error_signature(e.sample_input, "tpu"), []).append(e)
    cases = []
    for i, e in enumerate(cpu_list):
        expected = [(e.error_type, e.error_regex)]
        group = unpaired.get(_error_signature(e.sample_input, "cpu"))
        if group:
            alt = group.pop(0)
            if (alt.error_type, alt.error_regex) != expected[0]:
                expected.append((alt.error_type, alt.error_regex))
        cases.append(ErrorCase(i, e.sample_input, expected))
    rest = [e for group in unpaired.values() for e in group]
    for j, e in enumerate(rest):
        cases.append(ErrorCase(len(cpu_list) + j, e.sample_input, [(e.error_type, e.error_regex)], device_only=True))
    return cases, note


def _raises_as_expected(e: BaseException, expected: list) -> tuple[bool, bool]:
    """(type matches one expectation, type and message match one)."""
    import re

    type_ok = any(isinstance(e, t) for t, _ in expected)
    full = any(isinstance(e, t) and re.search(r, str(e)) for t, r in expected)
    return type_ok, bool(full)


def _call_error_sample(op, sample):
    out = op.op(sample.input, *sample.args, **sample.kwargs)
    _to_cpu(out)
    return out


def _describe_expected(expected: list) -> str:
    return " or ".join(f"{t.__name__} /{r}/" for t, r in expected)


def run_error_case(op, case: ErrorCase, mode: str) -> Outcome:
    """Runs one ErrorInput on tpu in ``mode`` (see the section comment)."""
    name = full_name(op)
    outcome = Outcome(name, ERROR_DTYPE, mode, ERROR_PHASE, case.index, "skip")
    sample = case.sample
    if _has_complex((sample.input, sample.args, sample.kwargs)):
        outcome.reason = "complex or sparse tensors"
        return outcome
    if not case.device_only:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _call_error_sample(op, sample)
            outcome.reason = "CPU does not raise for this ErrorInput (expected " + _describe_expected(
                case.expected[:1]) + ")"
            return outcome
        except Exception as e:  # noqa: BLE001
            if not _raises_as_expected(e, case.expected[:1])[1]:
                outcome.reason = (f"CPU raises {first_line(e)}, not the declared "
                                  + _describe_expected(case.expected[:1]))
                return outcome
            cpu_error = first_line(e)
    else:
        cpu_error = "(cross-device case: no CPU run) " + _describe_expected(case.expected)
    m0 = torch_tpu.metrics()
    fb0 = dict(m0["cpu_fallbacks"])
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        if case.device_only:
            run = sample
        else:
            factory = op.name in FACTORY_OPS or (getattr(op, "is_factory_function", False)
                                                 and not _has_tensors((sample.input, sample.args, sample.kwargs)))
            run = Prepared(sample, TPU, grad=False, keep_cpu_args=op.name in CPU_ARGS, factory=factory,
                           keep_requires_grad=True, keep_layout=True)
        with torch_tpu.eager_mode(mode), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _call_error_sample(op, run)  # the result moved to the host: a sync point
            torch.tpu.synchronize()
    except Exception as e:  # noqa: BLE001
        error = e
    try:
        torch.tpu.synchronize()  # nothing left pending for the next case
    except Exception:  # noqa: BLE001
        pass
    m1 = torch_tpu.metrics()
    outcome.seconds = time.perf_counter() - t0
    outcome.compiles = m1["compiles"] - m0["compiles"]
    outcome.compile_s = m1["compile_time_s"] - m0["compile_time_s"]
    outcome.fallbacks = _delta(fb0, m1["cpu_fallbacks"])
    want = _describe_expected(case.expected)
    if error is None:
        outcome.status, outcome.category = "fail", "no error"
        outcome.reason = f"tpu returned a value; CPU raises {cpu_error}"
        return outcome
    type_ok, full = _raises_as_expected(error, case.expected)
    if full:
        outcome.status = "pass"
        outcome.reason = first_line(error) + (" (raised by the CPU fallback)" if outcome.fallbacks else "")
        return outcome
    outcome.status = "fail"
    outcome.category = "message differs" if type_ok else "wrong exception type"
    outcome.reason = f"tpu raises {first_line(error, 200)}; expected {want[:200]}"
    return outcome


# The fast subset (tests/python/test_opinfo.py, tools/op_coverage.py without
# --full): the first FAST_MAX_ERROR_INPUTS ErrorInputs of every OpInfo in
# strict mode, and all of them in debug mode too for FAST_DEBUG_ERROR_OPS
# (the ops whose checks differ between modes). Full: every ErrorInput in
# strict and debug mode.
FAST_MAX_ERROR_INPUTS = 4
FAST_DEBUG_ERROR_OPS = ("gather", "scatter", "scatter_add", "index_select", "take", "multinomial", "pow",
                        "masked_select", "cat", "nn.functional.embedding")


def error_plan(op, full: bool) -> list[tuple[str, int | None]]:
    """[(mode, max ErrorInputs or None for all)] for one OpInfo."""
    if not has_error_inputs(op):
        return []
    if full:
        return [(m, None) for m in MODES]
    runs = [("strict", FAST_MAX_ERROR_INPUTS)]
    if full_name(op) in FAST_DEBUG_ERROR_OPS:
        runs = [("strict", None), ("debug", None)]
    return runs


def run_error_inputs(op, modes: Iterable[str], skip_keys: set | None = None, on_start=None,
                     limit: int | None = None) -> Iterator[Outcome]:
    """Every error_inputs outcome of one OpInfo in the given modes (the
    first ``limit`` ErrorInputs when given)."""
    name = full_name(op)
    try:
        cases, note = generate_error_cases(op)
        if limit is not None:
            cases = cases[:limit]
    except Exception as e:  # noqa: BLE001
        for mode in modes:
            yield Outcome(name, ERROR_DTYPE, mode, ERROR_PHASE, -1, "skip", f"error_inputs raises {first_line(e)}")
        return
    for case in cases:
        for mode in modes:
            key = (name, ERROR_DTYPE, mode, ERROR_PHASE, case.index)
            if skip_keys and key in skip_keys:
                continue
            if on_start:
                on_start(key)
            try:
                outcome = run_error_case(op, case, mode)
            except Exception as e:  # noqa: BLE001 - a case the harness cannot handle
                outcome = Outcome(name, ERROR_DTYPE, mode, ERROR_PHASE, case.index, "skip",
                                  f"harness cannot run the error input: {first_line(e)}")
            yield outcome


# (OpInfo full name, mode, ErrorInput index) -> reason; "*" matches any mode
# or index. What tests/python/test_opinfo.py marks xfail for error_inputs.
_INDEX_VALUE = ("strict mode: an out-of-range index is found by a device-side check (a pred), so the message "
                "names the dimension and size but not the index value (debug mode names it)")
ERROR_EXPECTED_FAILURES: dict[tuple[str, str, Any], str] = {
    ("gather", "strict", 4): _INDEX_VALUE,
    ("scatter", "strict", 3): _INDEX_VALUE,
    ("scatter_add", "strict", 3): _INDEX_VALUE,
    ("aminmax", "*", 3): "out= of another dtype: aminmax's exact-dtype check on out= is not made (the runtime "
                         "casts a result into out=); the values written are CPU's, cast",
    ("multinomial", "*", 2): "out= of another dtype: multinomial's Long-only check on out= is not made (the "
                             "runtime casts into out=)",
    ("kthvalue", "*", 0): "values/indices out= overlapping the input: CPU checks it in its kernel, not in the "
                          "meta kernel the runtime runs, so the overlap is not seen",
    ("gradient", "*", 3): "torch.gradient's device check on spacing tensors (a Python composite): the meta "
                          "run of an op it calls fails first",
    ("gradient", "*", 10): "torch.gradient's device check on spacing tensors (a Python composite): the meta "
                           "run of an op it calls fails first",
}


def expected_error_failure(name: str, mode: str, index: int) -> str | None:
    for m, i in itertools.product((mode, "*"), (index, "*")):
        reason = ERROR_EXPECTED_FAILURES.get((name, m, i))
        if reason:
            return reason
    return None


# ---------------------------------------------------------------------------
# What to run: the full plan and the fast subset
# ---------------------------------------------------------------------------

FAST_MAX_SAMPLES = 2
# OpInfos that also get a debug-mode forward in the fast subset (indexing ops,
# whose checks live in the debug executor, and a few common ones).
FAST_DEBUG_OPS = ("add", "mul", "sum", "mm", "index_select", "gather", "scatter", "take_along_dim",
                  "nn.functional.embedding", "index_put", "index_add", "scatter_reduce.sum", "softmax", "where",
                  "nn.functional.conv2d", "nn.functional.layer_norm")


@dataclasses.dataclass(frozen=True)
class Run:
    """One (phase, dtype) of an OpInfo, in one or more modes (sharing the CPU reference)."""
    phase: str
    dtype: torch.dtype
    modes: tuple


def _stable_hash(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode())


def plan(op, full: bool) -> list[Run]:
    """Full: every harness dtype forward and float32 backward, both modes.
    Fast subset: float32 plus one other supported dtype (rotating between
    bfloat16, int64 and bool by a hash of the name, so each is covered),
    strict forward, float32 strict backward, and a debug-mode forward for
    FAST_DEBUG_OPS."""
    dtypes = tested_dtypes(op)
    if not dtypes:
        return []
    bwd = backward_supported(op) and torch.float32 in dtypes
    name = full_name(op)
    if full:
        runs = [Run("fwd", d, MODES) for d in dtypes]
        if bwd:
            runs.append(Run("bwd", torch.float32, MODES))
        return runs
    others = [d for d in dtypes if d not in (torch.float32, torch.complex64)]
    chosen = [torch.float32] if torch.float32 in dtypes else []
    if others:
        chosen.append(others[_stable_hash(name) % len(others)])
    if not chosen:
        return []
    debug = name in FAST_DEBUG_OPS
    runs = [Run("fwd", d, ("strict", "debug") if debug and d == chosen[0] else ("strict",)) for d in chosen]
    if torch.complex64 in dtypes:
        runs.append(Run("fwd", torch.complex64, ("strict",)))
    if bwd:
        runs.append(Run("bwd", torch.float32, ("strict",)))
    return runs


def run_op(op, runs: Iterable[Run], max_samples: int | None = None, skip_keys: set | None = None,
           on_start=None, trace: bool = False) -> Iterator[Outcome]:
    """Every outcome of one OpInfo for the given runs. ``skip_keys`` (op,
    dtype, mode, phase, sample) are not run (a crash recorded by the caller);
    ``on_start`` is called with the key before each tpu run (crash
    bookkeeping); ``trace`` records the ATen ops each sample reaches."""
    name = full_name(op)
    for run in runs:
        dname = DTYPE_NAMES[run.dtype]
        try:
            samples = generate_samples(op, run.dtype, requires_grad=(run.phase == "bwd"), limit=max_samples)
        except Exception as e:  # noqa: BLE001
            for mode in run.modes:
                yield Outcome(name, dname, mode, run.phase, -1, "skip", f"sample_inputs raises {first_line(e)}")
            continue
        for i, sample in enumerate(samples):
            ref = None
            for mode in run.modes:
                key = (name, dname, mode, run.phase, i)
                if skip_keys and key in skip_keys:
                    continue
                if on_start:
                    on_start(key)
                if name.startswith(("sparse.", "to_sparse")):
                    yield Outcome(name, dname, mode, run.phase, i, "skip",
                                  "sparse OpInfo: compressed layouts have no tpu kernels; COO samples run in tests/python/test_sparse.py")
                    continue
                try:
                    if ref is None:
                        ref = cpu_reference(op, sample, run.phase, trace=trace)
                    outcome = run_sample(op, sample, i, run.dtype, mode, run.phase, ref)
                except Exception as e:  # noqa: BLE001 - a sample the harness cannot handle
                    outcome = Outcome(name, dname, mode, run.phase, i, "skip",
                                      f"harness cannot run the sample: {first_line(e)}")
                yield outcome


# ---------------------------------------------------------------------------
# Static view of the lowering registry (for the coverage report)
# ---------------------------------------------------------------------------

# Ops the tpu key serves without a lowering: direct kernels in
# csrc/aten/kernels.cpp, and the metadata-only view ops whose
# CompositeExplicitAutograd kernels are built from as_strided/view/alias.
DIRECT_KERNELS = {"empty", "empty_strided", "as_strided", "view", "_reshape_alias", "resize", "set", "_copy_from",
                  "_copy_from_and_resize", "_local_scalar_dense", "_fused_sdp_choice"}
VIEW_OPS = {"alias", "expand", "permute", "select", "slice", "squeeze", "unsqueeze", "diagonal", "split_with_sizes",
            "split", "t", "transpose", "unfold", "narrow", "unbind", "view_as_real", "view_as_complex", "detach",
            "_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "movedim", "chunk", "tensor_split",
            "expand_as", "view_as"}
# Queries of sizes/strides: answered by PyTorch's TensorImpl, never a device op.
METADATA_OPS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "sym_is_contiguous"}


def base_name(op_name: str) -> str:
    """"aten::add_.Tensor" / "aten.add_.Tensor" -> "add"."""
    name = op_name.replace("::", ".")
    parts = name.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return base


def lowered_names() -> set[str]:
    return set(torch_tpu._C.lowered_ops())


@functools.lru_cache(maxsize=None)
def _has_tpu_kernel(op_name: str) -> bool:
    """A kernel registered for the tpu (PrivateUse1) key itself, e.g. the
    data-dependent-shape kernels of csrc/aten/dynamic_shape_kernels.cpp (the
    boxed CPU fallback is a fallback, not a kernel)."""
    name = op_name.replace("::", ".")
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    if not parts:
        return False
    qualified = "aten::" + parts[0] + (f".{parts[1]}" if len(parts) > 1 and parts[1] != "default" else "")
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "PrivateUse1"))
    except RuntimeError:
        return False


def natively_served(op_name: str, lowered: set[str] | None = None) -> str | None:
    """Why the tpu key serves this ATen op natively, or None."""
    lowered = lowered_names() if lowered is None else lowered
    base = base_name(op_name)
    if base in lowered:
        return "lowering"
    if base in DIRECT_KERNELS or _has_tpu_kernel(op_name):
        return "direct kernel"
    if base in VIEW_OPS:
        return "view"
    if base in METADATA_OPS:
        return "metadata"
    return None


def fallback_to_overload(metric_name: str) -> str:
    """"aten::add.Tensor" (metrics) -> "aten.add.Tensor"; "aten::neg" -> "aten.neg.default"."""
    name = metric_name.replace("::", ".")
    return name if name.count(".") >= 2 else name + ".default"


def core_aten_ops() -> list[str]:
    """Every overload of torch.ops.aten tagged torch.Tag.core (PyTorch's core
    ATen op set), as "aten.add.Tensor". The overloads are enumerated from the
    dispatcher's registry: ``dir(torch.ops.aten)`` lists only the packets
    already looked up."""
    found = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        packet_name, _, overload_name = qualified[len("aten::"):].partition(".")
        try:
            overload = getattr(getattr(torch.ops.aten, packet_name), overload_name or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.core in overload.tags:
            found.add(str(overload))
    return sorted(found)


def has_composite_kernel(overload_name: str) -> str | None:
    """"CompositeExplicitAutograd"/"CompositeImplicitAutograd" if PyTorch has a
    decomposition kernel that the tpu key would use, else None."""
    parts = overload_name.split(".")
    qual = f"aten::{parts[1]}" + ("" if parts[2] == "default" else f".{parts[2]}")
    for key in ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"):
        try:
            if torch._C._dispatch_has_kernel_for_dispatch_key(qual, key):
                return key
        except Exception:  # noqa: BLE001
            return None
    return None
