"""Call specs from ATen's C++ meta kernels (csrc/runtime/cpp_meta.h).

`import torch` registers Python meta kernels over the C++ structured ones
for most ATen ops, and a call spec (output sizes, dtypes, strides) asked of
the dispatcher's Meta kernel ran Python: ~0.15-0.2 ms per new key. For the
ops in cpp_meta.cpp's table, ComputeSpec calls the C++ meta function
(at::meta::add, ...) instead: CPU's own meta step, so its results are CPU's.
These tests compare every such op's results (dtype, shape, strides, values)
with CPU on inputs where promotion, broadcasting and layouts matter, and
check that no Python meta kernel runs (the same calls with
TORCH_TPU_CPP_META=0 run them: the check can fail).
"""
from __future__ import annotations

import json

import pytest
import torch
import torch_tpu

from conftest import run_python


def _cases():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 4, generator=g)
    i = torch.randint(-5, 5, (3, 4), generator=g)
    b = torch.rand(3, 4, generator=g) > 0.5
    ft = torch.randn(4, 3, generator=g).t()  # a transposed (column-major) input
    row = torch.randn(4, generator=g)
    h = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    w3 = torch.randn(3, generator=g, dtype=torch.float64)
    c4 = torch.randn(2, 4, 3, 5, generator=g).to(memory_format=torch.channels_last)
    F = torch.nn.functional
    return [
        ("add int+float", lambda t: torch.add(t["i"], t["f"], alpha=2)),
        ("add wrapped", lambda t: t["i"] + 2.5),
        ("add_ broadcast", lambda t: t["f"].clone().add_(t["row"], alpha=0.5)),
        ("sub transposed", lambda t: t["ft"] - t["row"]),
        ("sub_", lambda t: t["f"].clone().sub_(t["ft"])),
        ("mul bool*int", lambda t: t["b"] * t["i"]),
        ("mul_", lambda t: t["f"].clone().mul_(t["ft"])),
        ("div int/int", lambda t: t["i"] / (t["i"].abs() + 1)),
        ("div_", lambda t: t["f"].clone().div_(2.0)),
        ("minimum", lambda t: torch.minimum(t["f"], t["ft"])),
        ("maximum int/float", lambda t: torch.maximum(t["i"], t["f"])),
        ("bitwise_and", lambda t: t["b"] & (t["i"] > 0)),
        ("bitwise_or int", lambda t: t["i"] | 3),
        ("eq.Tensor", lambda t: t["i"] == t["i"].flip(0)),
        ("ne.Tensor", lambda t: t["f"] != t["ft"]),
        ("lt.Tensor", lambda t: t["i"] < t["f"]),
        ("le.Scalar", lambda t: t["f"] <= 0.1),
        ("gt.Scalar", lambda t: t["i"] > 1),
        ("ge.Tensor", lambda t: t["ft"] >= t["row"]),
        ("eq.Scalar", lambda t: t["i"] == 2),
        ("ne.Scalar", lambda t: t["b"] != True),  # noqa: E712
        ("lt.Scalar", lambda t: t["ft"] < 0),
        ("pow.Tensor_Scalar", lambda t: t["i"] ** 2),
        ("pow.Tensor_Tensor", lambda t: t["f"].abs() ** t["ft"]),
        ("neg", lambda t: -t["ft"]),
        ("isneginf", lambda t: torch.isneginf(t["f"] / 0)),
        ("cos int", lambda t: torch.cos(t["i"])),
        ("sin", lambda t: torch.sin(t["ft"])),
        ("rsqrt", lambda t: torch.rsqrt(t["f"].abs() + 1)),
        ("exp", lambda t: torch.exp(t["h"])),
        ("sqrt int", lambda t: torch.sqrt(t["i"].abs())),
        ("tanh", lambda t: torch.tanh(t["ft"])),
        ("sigmoid", lambda t: torch.sigmoid(t["f"])),
        ("silu", lambda t: torch.nn.functional.silu(t["ft"])),
        ("gelu tanh", lambda t: torch.nn.functional.gelu(t["f"], approximate="tanh")),
        ("bitwise_not", lambda t: ~t["b"]),
        ("all", lambda t: torch.all(t["b"])),
        ("any", lambda t: torch.any(t["i"])),
        ("all.dim", lambda t: torch.all(t["i"], dim=1)),
        ("any.dim keepdim", lambda t: torch.any(t["b"], dim=0, keepdim=True)),
        ("sum.dim int", lambda t: t["i"].sum(dim=(0, 1))),
        ("sum.dim dtype", lambda t: t["f"].sum(dim=1, keepdim=True, dtype=torch.float64)),
        ("mean.dim", lambda t: t["h"].mean(dim=[-1, 0])),
        ("amax", lambda t: t["ft"].amax(dim=0)),
        ("argmax", lambda t: t["i"].argmax(dim=1, keepdim=True)),
        ("argmax flat", lambda t: t["f"].argmax()),
        ("cumsum int", lambda t: t["i"].cumsum(1)),
        ("cumsum dtype", lambda t: t["b"].cumsum(0, dtype=torch.float32)),
        ("cat promote", lambda t: torch.cat([t["i"], t["f"], t["ft"]], dim=1)),
        ("tril", lambda t: t["ft"].tril(-1)),
        ("triu", lambda t: t["i"].triu(1)),
        ("_softmax", lambda t: t["ft"].softmax(1)),
        ("_log_softmax", lambda t: t["h"].log_softmax(0)),
        ("bmm", lambda t: t["h"] @ t["h"].transpose(1, 2)),
        ("mm", lambda t: t["f"] @ t["f"].t()),
        ("addmm", lambda t: torch.addmm(t["row"][:3], t["f"], t["ft"].t(), beta=0.5, alpha=2)),
        # .Scalar overloads (called by C++ code and decompositions; Python passes wrapped tensors)
        ("add.Scalar int", lambda t: torch.ops.aten.add.Scalar(t["i"], 2, 3)),
        ("sub.Scalar", lambda t: torch.ops.aten.sub.Scalar(t["ft"], 1.5, 2)),
        ("mul.Scalar int*float", lambda t: torch.ops.aten.mul.Scalar(t["i"], 2.5)),
        ("div.Scalar int", lambda t: torch.ops.aten.div.Scalar(t["i"], 2)),
        ("native_layer_norm out", lambda t: torch.ops.aten.native_layer_norm(t["h"], [4], t["h"][0, 0], t["h"][1, 0], 1e-5)[0]),
        ("native_layer_norm mean", lambda t: torch.ops.aten.native_layer_norm(t["h"].float(), [3, 4], None, None, 1e-5)[1]),
        ("native_layer_norm rstd", lambda t: torch.ops.aten.native_layer_norm(t["ft"], [4], None, None, 1e-5)[2]),
        ("masked_fill", lambda t: t["ft"].masked_fill(t["b"], -1.5)),
        ("masked_fill broadcast int", lambda t: t["i"].masked_fill(t["b"][0], 7)),
        ("where promote", lambda t: torch.where(t["b"], t["i"], t["ft"])),
        ("where broadcast", lambda t: torch.where(t["f"] > 0, t["row"], 0.5)),
        ("relu", lambda t: torch.relu(t["ft"])),
        ("relu int", lambda t: torch.relu(t["i"])),
        ("clamp", lambda t: t["f"].clamp(-0.5, 0.5)),
        ("clamp max int", lambda t: t["i"].clamp(max=1)),
        ("clamp_min", lambda t: torch.clamp_min(t["ft"], 0.1)),
        ("clamp_max int float", lambda t: torch.clamp_max(t["i"], 0.5)),
        ("erf", lambda t: torch.erf(t["f"])),
        ("log int", lambda t: torch.log(t["i"].abs() + 1)),
        ("log1p", lambda t: torch.log1p(t["ft"].abs())),
        ("log2", lambda t: torch.log2(t["h"].abs() + 1)),
        ("log10", lambda t: torch.log10(t["f"].abs() + 1)),
        ("floor", lambda t: torch.floor(t["ft"] * 3)),
        ("ceil int", lambda t: torch.ceil(t["i"])),
        ("round", lambda t: torch.round(t["f"] * 3)),
        ("trunc", lambda t: torch.trunc(t["ft"] * 3)),
        ("sign", lambda t: torch.sign(t["i"])),
        ("reciprocal int", lambda t: torch.reciprocal(t["i"] + 10)),
        ("expm1", lambda t: torch.expm1(t["f"])),
        ("exp2 int", lambda t: torch.exp2(t["i"])),
        ("abs", lambda t: torch.abs(t["ft"])),
        ("abs int", lambda t: torch.abs(t["i"])),
        # Session 24: ops whose Python meta kernel was a torch._refs one.
        ("atan", lambda t: torch.atan(t["ft"])),
        ("asin int", lambda t: torch.asin(t["i"].clamp(-1, 1))),
        ("acos", lambda t: torch.acos(t["f"].clamp(-1, 1))),
        ("tan", lambda t: torch.tan(t["h"])),
        ("sinh", lambda t: torch.sinh(t["ft"])),
        ("cosh int", lambda t: torch.cosh(t["i"])),
        ("asinh", lambda t: torch.asinh(t["f"])),
        ("acosh", lambda t: torch.acosh(t["f"].abs() + 1)),
        ("atanh", lambda t: torch.atanh(t["ft"].clamp(-0.9, 0.9))),
        ("erfinv", lambda t: torch.erfinv(t["f"].clamp(-0.9, 0.9))),
        ("lgamma", lambda t: torch.lgamma(t["ft"].abs() + 0.5)),
        ("digamma int", lambda t: torch.digamma(t["i"].abs() + 1)),
        ("frac", lambda t: torch.frac(t["f"] * 3)),
        ("sgn", lambda t: torch.sgn(t["ft"])),
        ("i0", lambda t: torch.i0(t["f"])),
        ("sinc", lambda t: torch.sinc(t["ft"])),
        ("hardsigmoid", lambda t: torch.nn.functional.hardsigmoid(t["f"] * 4)),
        ("mish", lambda t: torch.nn.functional.mish(t["ft"])),
        ("atan2 broadcast", lambda t: torch.atan2(t["f"], t["row"])),
        ("fmod int", lambda t: torch.fmod(t["i"], t["i"].abs() + 1)),
        ("fmod.Scalar", lambda t: torch.fmod(t["ft"], 0.7)),
        ("remainder int/float", lambda t: torch.remainder(t["i"], t["f"].abs() + 0.5)),
        ("remainder.Scalar int", lambda t: torch.remainder(t["i"], 3)),
        ("hypot", lambda t: torch.hypot(t["ft"], t["f"])),
        ("logaddexp", lambda t: torch.logaddexp(t["f"], t["ft"])),
        ("logaddexp2", lambda t: torch.logaddexp2(t["h"], t["h"].flip(0))),
        ("xlogy", lambda t: torch.xlogy(t["f"], t["ft"].abs())),
        ("xlogy.Scalar_Other", lambda t: torch.xlogy(t["f"], 2.0)),
        ("copysign", lambda t: torch.copysign(t["f"], t["ft"])),
        ("copysign.Scalar int", lambda t: torch.copysign(t["i"], -1.0)),
        ("fmax", lambda t: torch.fmax(t["f"], t["row"])),
        ("fmin int", lambda t: torch.fmin(t["i"], t["i"].flip(1))),
        ("nextafter", lambda t: torch.nextafter(t["f"], t["ft"])),
        ("heaviside", lambda t: torch.heaviside(t["f"], t["ft"])),
        ("bitwise_xor bool", lambda t: t["b"] ^ (t["i"] > 0)),
        ("bitwise_xor.Scalar", lambda t: torch.ops.aten.bitwise_xor.Scalar(t["i"], 6)),
        ("tanh_backward", lambda t: torch.ops.aten.tanh_backward(t["f"], t["ft"])),
        ("sigmoid_backward", lambda t: torch.ops.aten.sigmoid_backward(t["ft"], t["f"])),
        ("silu_backward", lambda t: torch.ops.aten.silu_backward(t["f"], t["ft"])),
        ("threshold_backward", lambda t: torch.ops.aten.threshold_backward(t["f"], t["ft"], 0.0)),
        ("gelu_backward tanh", lambda t: torch.ops.aten.gelu_backward(t["f"], t["ft"], approximate="tanh")),
        ("softplus", lambda t: torch.nn.functional.softplus(t["ft"], beta=2, threshold=1)),
        ("elu", lambda t: torch.nn.functional.elu(t["f"], alpha=0.5)),
        ("leaky_relu", lambda t: torch.nn.functional.leaky_relu(t["ft"], 0.2)),
        ("mse_loss", lambda t: torch.nn.functional.mse_loss(t["f"], t["ft"])),
        ("mse_loss none", lambda t: torch.nn.functional.mse_loss(t["f"], t["ft"], reduction="none")),
        ("nll_loss_forward", lambda t: torch.nn.functional.cross_entropy(t["f"], t["i"][:, 0].abs() % 4)),
        ("cumprod dtype", lambda t: t["i"].cumprod(1, dtype=torch.float64)),
        ("pow.Scalar", lambda t: 2 ** t["ft"]),
        ("pow.Scalar int", lambda t: 3 ** t["i"].abs()),
        ("rsub.Scalar int", lambda t: 1.5 - t["i"]),
        ("rsub.Tensor", lambda t: torch.rsub(t["ft"], t["row"], alpha=2)),
        ("mean", lambda t: t["ft"].mean()),
        ("mean dtype", lambda t: t["i"].mean(dtype=torch.float64)),
        ("clamp.Tensor", lambda t: t["f"].clamp(min=t["row"])),
        ("clamp_", lambda t: t["ft"].clone().clamp_(-0.2, 0.3)),
        ("isnan", lambda t: torch.isnan(t["ft"] / t["ft"].round())),
        ("sigmoid_", lambda t: t["f"].clone().sigmoid_()),
        ("exp_", lambda t: t["ft"].clone().exp_()),
        ("tanh_", lambda t: t["h"].clone().tanh_()),
        ("sqrt_", lambda t: t["f"].abs().sqrt_()),
        ("rsqrt_", lambda t: (t["f"].abs() + 1).rsqrt_()),
        ("sin_", lambda t: t["ft"].clone().sin_()),
        ("cos_", lambda t: t["f"].clone().cos_()),
        ("log_", lambda t: (t["f"].abs() + 1).log_()),
        ("neg_ int", lambda t: t["i"].clone().neg_()),
        ("erf_", lambda t: t["f"].clone().erf_()),
        ("log1p_", lambda t: t["ft"].abs().log1p_()),
        ("reciprocal_", lambda t: (t["f"] + 5).reciprocal_()),
        ("floor_", lambda t: (t["f"] * 3).floor_()),
        ("ceil_", lambda t: (t["ft"] * 3).ceil_()),
        ("round_", lambda t: (t["f"] * 3).round_()),
        ("trunc_", lambda t: (t["f"] * 3).trunc_()),
        ("expm1_", lambda t: t["ft"].clone().expm1_()),
        # Session 26: floor_divide, abs_, linalg_vector_norm.
        ("floor_divide int", lambda t: torch.floor_divide(t["i"], t["i"].abs() + 1)),
        ("floor_divide broadcast", lambda t: torch.floor_divide(t["ft"], t["row"])),
        ("floor_divide int//float", lambda t: t["i"] // (t["f"].abs() + 0.5)),
        ("floor_divide.Scalar", lambda t: torch.ops.aten.floor_divide.Scalar(t["i"], 2.5)),
        ("floor_divide.Scalar int", lambda t: torch.ops.aten.floor_divide.Scalar(t["i"], 3)),
        ("abs_", lambda t: t["ft"].clone().abs_()),
        ("abs_ int", lambda t: t["i"].clone().abs_()),
        ("linalg_vector_norm dim", lambda t: torch.linalg.vector_norm(t["ft"], 2, dim=1)),
        ("linalg_vector_norm inf keepdim", lambda t: torch.linalg.vector_norm(t["f"], float("inf"), dim=(0,), keepdim=True)),
        ("linalg_vector_norm dtype", lambda t: torch.linalg.vector_norm(t["f"], 1, dtype=torch.float64)),
        ("norm", lambda t: t["h"].norm()),
        # Session 28: logical_*, hardtanh, stack.
        ("logical_and bool&int broadcast", lambda t: torch.logical_and(t["b"], t["i"][0])),
        ("logical_or transposed", lambda t: torch.logical_or(t["ft"], t["f"] > 0)),
        ("logical_xor int/float", lambda t: torch.logical_xor(t["i"], t["ft"])),
        ("logical_not transposed", lambda t: torch.logical_not(t["ft"])),
        ("logical_not int", lambda t: torch.logical_not(t["i"])),
        ("hardtanh transposed", lambda t: torch.nn.functional.hardtanh(t["ft"], -0.5, 0.5)),
        ("relu6 float64", lambda t: torch.nn.functional.relu6(t["h"] * 4)),
        ("hardtanh non-dense", lambda t: torch.nn.functional.hardtanh(t["h"][:, :, ::2], -0.5, 0.5)),
        ("hardtanh int", lambda t: torch.nn.functional.hardtanh(t["i"], -2, 2)),
        ("stack", lambda t: torch.stack([t["f"], t["f"] * 2, t["f"] + 1])),
        ("stack dim -1", lambda t: torch.stack([t["h"], t["h"] - 1], dim=-1)),
        ("stack dim 1 int", lambda t: torch.stack([t["i"], t["i"].flip(0)], 1)),
        ("stack transposed", lambda t: torch.stack([t["ft"], t["ft"]], 1)),
        ("stack promote", lambda t: torch.stack([t["i"], t["f"]])),
        ("hardswish", lambda t: torch.nn.functional.hardswish(t["ft"] * 4)),
        ("hardswish float64", lambda t: torch.nn.functional.hardswish(t["h"] * 4)),
        ("roll", lambda t: t["f"].roll(1, 1)),
        ("roll dims", lambda t: t["h"].roll((1, -2), (0, 2))),
        ("roll flat", lambda t: t["i"].roll(5)),
        ("roll transposed", lambda t: t["ft"].roll(1, 0)),
        ("scalar_tensor", lambda t: torch.ops.aten.scalar_tensor(2.5, device=t["f"].device) + t["f"]),
        ("where.self_out", lambda t: torch.where(t["b"], t["f"], t["ft"], out=torch.empty(0, device=t["f"].device))),
        ("where.self_out broadcast", lambda t: torch.where(t["b"][:, :1], t["row"], t["f"], out=torch.empty(3, 4, device=t["f"].device))),
        ("_safe_softmax", lambda t: torch.ops.aten._safe_softmax(t["h"].masked_fill(t["h"] > 1, float("-inf")), -1)),
        ("_safe_softmax all -inf row", lambda t: torch.ops.aten._safe_softmax(t["f"].masked_fill(t["b"][:, :1], float("-inf")), 1)),
        ("sdpa", lambda t: torch.nn.functional.scaled_dot_product_attention(t["h"], t["h"] * 0.5, t["h"] + 1)),
        ("clone transposed", lambda t: t["ft"].clone()),
        ("clone non-dense", lambda t: t["h"][:, :, ::2].clone()),
        ("clone expanded", lambda t: t["row"].expand(3, 4).clone()),
        ("clone channels_last", lambda t: t["h"][None].clone(memory_format=torch.channels_last)),
        ("clone contiguous_format", lambda t: t["ft"].clone(memory_format=torch.contiguous_format)),
        ("fill_", lambda t: t["ft"].clone().fill_(2.5)),
        ("fill_ int with float", lambda t: t["i"].clone().fill_(1.75)),
        ("fill_ expanded", lambda t: t["row"][:1].clone().expand(3, 4).fill_(3.0)),
        ("scalar_tensor int", lambda t: torch.ops.aten.scalar_tensor(3, dtype=torch.int64, device=t["i"].device) * t["i"]),
        ("logsumexp", lambda t: t["f"].logsumexp(1)),
        ("logsumexp keepdim dims", lambda t: t["h"].logsumexp((0, 2), keepdim=True)),
        ("logsumexp int", lambda t: t["i"].logsumexp(0)),
        ("logsumexp transposed", lambda t: t["ft"].logsumexp(0)),
        # Session 29: log_sigmoid_forward (CPU: contiguous results whatever
        # the input's layout; the Python meta kernel kept a transposed
        # input's strides), std/var(_mean), native_group_norm.
        ("logsigmoid transposed", lambda t: F.logsigmoid(t["ft"])),
        ("logsigmoid float64 non-dense", lambda t: F.logsigmoid(t["h"][:, :, ::2])),
        ("log_sigmoid_forward buffer", lambda t: torch.ops.aten.log_sigmoid_forward(t["ft"])[1]),
        ("std", lambda t: t["f"].std(1)),
        ("std keepdim dims correction 0", lambda t: t["h"].std((0, 2), keepdim=True, correction=0)),
        ("var all", lambda t: t["h"].var()),
        ("var transposed", lambda t: t["ft"].var(0)),
        ("var dim []", lambda t: torch.ops.aten.var.correction(t["f"], [])),
        ("std_mean std", lambda t: torch.std_mean(t["h"], -1)[0]),
        ("std_mean mean", lambda t: torch.std_mean(t["h"], -1)[1]),
        ("var_mean transposed", lambda t: torch.var_mean(t["ft"], 1, keepdim=True)[1]),
        ("group_norm affine float64", lambda t: F.group_norm(t["h"], 3, t["w3"], t["w3"] + 1)),
        ("group_norm channels_last", lambda t: F.group_norm(t["c4"], 2)),
        ("group_norm transposed input", lambda t: F.group_norm(t["ft"], 2)),
        ("native_group_norm rstd", lambda t: torch.ops.aten.native_group_norm(t["h"], t["w3"], None, 2, 3, 4, 3, 1e-5)[2]),
    ], {"f": f, "i": i, "b": b, "ft": ft, "row": row, "h": h, "w3": w3, "c4": c4}


CASES, INPUTS = _cases()


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("name,fn", CASES, ids=[c[0] for c in CASES])
def test_cpp_meta_results_are_cpus(name, fn, mode):
    """dtype, shape and strides equal CPU's; values exact for integers and
    booleans, within 1e-5 relative for floats."""
    want = fn(INPUTS)
    with torch_tpu.eager_mode(mode):
        got_t = fn({k: v.to("tpu") for k, v in INPUTS.items()})
        got = got_t.cpu()
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    big = [d for d in range(want.dim()) if want.shape[d] > 1]
    assert [got_t.stride(d) for d in big] == [want.stride(d) for d in big], (got_t.stride(), want.stride())
    if want.dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_native_dropout_layout_and_values(mode):
    """native_dropout's C++ meta kernel (random values: not in CASES): the
    output and the bool mask have CPU's dtypes, shapes and strides (dense,
    transposed, channels_last, strided, float16 inputs; train and eval);
    the output is input * mask / (1 - p) for the tpu's own mask (float16:
    1e-3), and about 1 - p of a 2048-element mask is kept (0.75 +- 0.1,
    ~10 standard deviations)."""
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g).t(),
              torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
              torch.randn(16, 32, generator=g)[:, ::2], torch.randn(64, 32, generator=g).half()]
    with torch_tpu.eager_mode(mode):
        for x in inputs:
            for train in (True, False):
                out, mask = torch.native_dropout(x.to("tpu"), 0.25, train)
                cpu_out, cpu_mask = torch.native_dropout(x, 0.25, train)
                assert (out.dtype, mask.dtype, out.shape) == (cpu_out.dtype, cpu_mask.dtype, cpu_out.shape)
                assert (out.stride(), mask.stride()) == (cpu_out.stride(), cpu_mask.stride()), (x.stride(), train)
                o, m = out.cpu(), mask.cpu()
                scale = 1 / 0.75 if train else 1.0
                torch.testing.assert_close(o.float(), x.float() * m * scale, rtol=1e-3, atol=1e-3)
                if train and x.numel() >= 2048:
                    assert 0.65 <= m.float().mean().item() <= 0.85
                else:
                    assert train or bool(m.all())


# sys.setprofile sees the Python calls the dispatcher makes (a Python meta
# kernel is a PythonKernelHolder calling a Python function): the files of
# PyTorch's Python meta kernels, refs and prims are counted while new keys
# of table ops build their programs (each key's first call: ComputeSpec).
NO_PYTHON_META = r"""
import json, sys, torch, torch_tpu
torch_tpu.set_eager_mode("strict")
x = torch.randn(5, 7).to("tpu")
y = torch.randn(5, 7).to("tpu")
hits = []
def prof(frame, event, arg):
    if event == "call":
        f = frame.f_code.co_filename
        if "_meta_registrations" in f or "/_refs/" in f or "/_prims" in f or "_decomp" in f:
            hits.append(frame.f_code.co_name)
sys.setprofile(prof)
r = [(x + y), (x * y), torch.cat([x, y], 1), (x > 0), x.sum(1), torch.exp(x), x.softmax(1), x @ y.t(),
     torch.logical_and(x, y), torch.logical_not(x), torch.nn.functional.hardtanh(x), torch.stack([x, y]),
     x.t().clone(), x.clone().fill_(2.0)]
sys.setprofile(None)
print(json.dumps({"hits": len(hits), "names": sorted(set(hits))[:20]}))
"""


@pytest.mark.parametrize("cpp_meta", ["1", "0"])
def test_table_ops_run_no_python_meta_kernel(cpp_meta, tmp_path):
    r = run_python(NO_PYTHON_META, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_CPP_META": cpp_meta},
                   timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if cpp_meta == "1":
        assert out["hits"] == 0, out
    else:
        assert out["hits"] > 0, out  # the control: the dispatcher's Meta kernels are Python ones


# The first call of a Python meta kernel that is a reference implementation
# (torch._refs: elementwise ops, native_layer_norm) imports torch._dynamo
# (torch._disable_dynamo wraps it): ~0.9 s once per process, 94% of the first
# pass over issue 12's (c) block and of a TransformerEncoderLayer's first 20
# forwards. A transformer's common ops have C++ meta kernels: no import.
NO_DYNAMO_IMPORT = r"""
import json, sys, torch, torch_tpu
import torch.nn.functional as F
torch_tpu.set_eager_mode("strict")
before = "torch._dynamo" in sys.modules
x = torch.randn(2, 5, 8).to("tpu")
w, b = torch.ones(8).to("tpu"), torch.zeros(8).to("tpu")
m = torch.ones(5, 5, dtype=torch.bool).tril().to("tpu")
s = torch.randn(2, 5, 5).to("tpu")
h = F.layer_norm(x, (8,), w, b)
r = [h, F.relu(h), h * 0.5, torch.ops.aten.mul.Scalar(h, 0.5), torch.ops.aten.add.Scalar(h, 1),
     s.masked_fill(~m, float("-inf")).softmax(-1), torch.where(m, s, 0.0), h.clamp(-1, 1), torch.log1p(h.abs()),
     torch.erf(h), F.gelu(h), F.silu(h), torch.rsqrt(h.abs() + 1)]
for t in r:
    t.cpu()
print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules}))
"""


# Session 24's table ops (each imported torch._dynamo on a fresh process's
# first call): activations, losses, pointwise math, in-place unary ops;
# session 26's (floor_divide, abs_, norm); session 28's (logical_*, hardtanh,
# relu6, stack, hardswish, roll, logsumexp, scalar_tensor, where.self_out:
# scaled_dot_product_attention's math path, native_dropout: training-mode
# dropout); session 29's (logsigmoid, std, var, std_mean, var_mean,
# group_norm).
NO_DYNAMO_IMPORT_MORE = r"""
import json, sys, torch, torch_tpu
import torch.nn.functional as F
torch_tpu.set_eager_mode("strict")
before = "torch._dynamo" in sys.modules
x = torch.randn(4, 8).to("tpu")
y = torch.randn(4, 8).to("tpu")
t = torch.tensor([1, 0, 3, 2]).to("tpu")
r = [torch.atan(x), torch.tan(x), torch.atan2(x, y), torch.fmod(x, y), torch.remainder(x, 2), torch.hypot(x, y),
     torch.logaddexp(x, y), torch.xlogy(x.abs(), y.abs()), torch.copysign(x, y), torch.fmax(x, y), torch.lgamma(x.abs()),
     F.softplus(x), F.elu(x), F.leaky_relu(x), F.mish(x), F.hardsigmoid(x), F.mse_loss(x, y), F.cross_entropy(x, t),
     x.clamp(min=y), 1 - x, 2 ** x, x.mean(), x.isnan(), x.cumprod(1), x.clone().sigmoid_(), x.clone().exp_(),
     x.clone().clamp_(0, 1), (x > 0) ^ (y > 0), torch.floor_divide(x, y), x.clone().abs_(), x.norm(),
     torch.linalg.vector_norm(x, 1, dim=1), torch.logical_and(x > 0, y), torch.logical_or(x, y < 0),
     torch.logical_xor(x, y), torch.logical_not(x), F.hardtanh(x), F.relu6(x), torch.stack([x, y]),
     torch.stack([x, y], dim=-1), F.hardswish(x), x.roll(1, 1), x.logsumexp(1),
     torch.ops.aten.scalar_tensor(0.5, device=x.device) * x, F.scaled_dot_product_attention(x[None], y[None], y[None]),
     torch.where(x > 0, x, y, out=torch.empty(0, device=x.device)), F.dropout(x, 0.5, True), F.logsigmoid(x),
     x.std(1), x.var(), torch.std_mean(x, 0)[0], torch.var_mean(x, 1)[1], F.group_norm(x, 2)]
for v in r:
    v.cpu()
print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules}))
"""


@pytest.mark.parametrize("script", ["transformer", "more"])
@pytest.mark.parametrize("cpp_meta", ["1", "0"])
def test_common_ops_do_not_import_dynamo(cpp_meta, script, tmp_path):
    r = run_python(NO_DYNAMO_IMPORT if script == "transformer" else NO_DYNAMO_IMPORT_MORE, env={"TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_CPP_META": cpp_meta},
                   timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["before"], out
    assert out["after"] == (cpp_meta == "0"), out  # the control: Python refs import it


@pytest.mark.parametrize("mode", ["strict", "fused", "debug"])
def test_layer_norm_mixed_dtypes_raise_as_cpu(mode):
    """A weight of another dtype than a float32/float64 input is CPU's
    "mixed dtype" error on every call (review, session 22: the device
    program, the third strict call, returned values)."""
    x = torch.randn(3, 2, dtype=torch.float64)
    for w in (torch.tensor([1, 2]), torch.ones(2)):  # int64, float32
        with pytest.raises(RuntimeError) as cpu:
            torch.ops.aten.native_layer_norm(x, [2], w, None, 1e-5)
        with torch_tpu.eager_mode(mode):
            for i in range(3):
                if i == 2:
                    torch_tpu.metrics()
                with pytest.raises(RuntimeError) as got:
                    torch.ops.aten.native_layer_norm(x.to("tpu"), [2], w.to("tpu"), None, 1e-5)[0].cpu()
                assert str(cpu.value).splitlines()[0] in str(got.value), (str(got.value), str(cpu.value))
