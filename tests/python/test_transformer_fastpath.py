"""PyTorch's fused transformer fast path on tpu (csrc/aten/transformer_kernels.cpp).

In eval mode under no_grad, nn.TransformerEncoder(Layer) and
nn.MultiheadAttention call aten::_transformer_encoder_layer_fwd and
aten::_native_multi_head_attention (PyTorch lists PrivateUse1 among the fast
path's devices). These must run on tpu with no CPU fallback and match the CPU
fast path on the same module and inputs (float32: atol 1e-5, rtol 1e-4; the
ops differ only in summation order)."""
import pytest
import torch
import torch_tpu

from conftest import no_cpu_fallback

TOL = dict(atol=1e-5, rtol=1e-4)


def _padding_mask(b, t):
    m = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):
        m[i, t - i:] = True  # row i pads its last i positions (row 0 none)
    return m


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("padding", [False, True])
def test_encoder_fast_path_on_tpu(norm_first, activation, padding, monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation=activation,
                                             batch_first=True, norm_first=norm_first)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 5, 16)
    mask = _padding_mask(3, 5) if padding else None
    calls = []
    real = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd",
                        lambda *a, **k: calls.append(a[0].device.type) or real(*a, **k))
    with torch.no_grad():
        ref = enc(x, src_key_padding_mask=mask)
        enc.to("tpu")
        with no_cpu_fallback():
            out = enc(x.to("tpu"), src_key_padding_mask=None if mask is None else mask.to("tpu"))
            out = out.cpu()
    # Both devices take PyTorch's fast path, once per layer.
    assert calls == ["cpu", "cpu", "tpu", "tpu"]
    assert out.device.type == "cpu" and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL)


def test_encoder_layer_src_mask_and_gelu_fast_path():
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True).eval()
    x = torch.randn(2, 4, 8)
    src_mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
    with torch.no_grad():
        ref = layer(x, src_mask=src_mask)
        layer.to("tpu")
        with no_cpu_fallback():
            out = layer(x.to("tpu"), src_mask=src_mask.to("tpu")).cpu()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("key_padding", [False, True])
def test_multihead_attention_fast_path(need_weights, average, key_padding):
    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(3, 5, 16)
    kpm = _padding_mask(3, 5) if key_padding else None
    with torch.no_grad():
        ref, ref_w = mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights,
                         average_attn_weights=average)
        mha.to("tpu")
        xt = x.to("tpu")
        with no_cpu_fallback():
            out, w = mha(xt, xt, xt, key_padding_mask=None if kpm is None else kpm.to("tpu"),
                         need_weights=need_weights, average_attn_weights=average)
            out = out.cpu()
            w = None if w is None else w.cpu()
    torch.testing.assert_close(out, ref, **TOL)
    if ref_w is None:
        assert w is None
    else:
        torch.testing.assert_close(w, ref_w, **TOL)


def test_multihead_attention_cross_attention_fast_path():
    """key is value, query differs: the encoder-decoder projection split."""
    torch.manual_seed(3)
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    with torch.no_grad():
        ref, _ = mha(q, kv, kv, need_weights=False)
        mha.to("tpu")
        with no_cpu_fallback():
            out, _ = mha(q.to("tpu"), kv.to("tpu"), kv.to("tpu"), need_weights=False)
            out = out.cpu()
    torch.testing.assert_close(out, ref, **TOL)


def test_masked_softmax_matches_cpu():
    torch.manual_seed(4)
    x = torch.randn(2, 2, 3, 3)
    m1 = torch.zeros(2, 3, dtype=torch.bool)
    m1[0, 2] = True
    m1[1, :] = True  # a fully masked row: NaN on CPU as well
    m0 = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    m2 = torch.rand(2, 2, 3, 3) > 0.5
    with no_cpu_fallback():
        for mask, mt in ((m1, 1), (m0, 0), (m2, 2), (m2, None)):
            got = torch._masked_softmax(x.to("tpu"), mask.to("tpu"), 3, mt).cpu()
            torch.testing.assert_close(got, torch._masked_softmax(x, mask, 3, mt), equal_nan=True, **TOL)
    with pytest.raises(RuntimeError, match="Mask Type should be defined"):
        torch._masked_softmax(x.to("tpu"), m0.to("tpu"), 3, None)


def test_nested_encoder_with_padding_mask_raises_clearly():
    """enable_nested_tensor=True with a padding mask makes PyTorch build a nested
    tensor; tpu has no nested-tensor kernels: an error, never a wrong value."""
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval().to("tpu")
    x = torch.randn(2, 4, 8, device="tpu")
    with torch.no_grad(), pytest.raises((RuntimeError, NotImplementedError)):
        enc(x, src_key_padding_mask=_padding_mask(2, 4).to("tpu")).cpu()


def test_nested_enabled_without_padding_mask_runs_on_tpu():
    """enable_nested_tensor=True builds a nested tensor only for a padding mask;
    without one the layers take the dense fast path."""
    torch.manual_seed(5)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        ref = enc(x)
        enc.to("tpu")
        with no_cpu_fallback():
            out = enc(x.to("tpu")).cpu()
    torch.testing.assert_close(out, ref, **TOL)
