"""The FFT family on the device (_fft_r2c / _fft_c2r / _fft_c2c lowered to
stablehlo.fft): torch.fft's transforms with every norm mode, round trips,
and stft/istft, compared with CPU (pocketfft) on the same inputs, with no
CPU fallback.

Tolerances: float32/complex64 within rtol=1e-5, atol=1e-4 of CPU (an n-point
FFT's rounding grows like log n; the signals here are N(0, 1) of at most
256 points); float64/complex128 within 1e-10."""
from __future__ import annotations

import pytest
import torch

from conftest import no_cpu_fallback


def _tol(dtype):
    if dtype in (torch.float64, torch.complex128):
        return dict(rtol=1e-10, atol=1e-10)
    return dict(rtol=1e-5, atol=1e-4)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _compare(fn, *inputs, dtype):
    want = fn(*inputs)
    with no_cpu_fallback():
        got = fn(*[x.to("tpu") for x in inputs])
    assert got.device.type == "tpu"
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, **_tol(dtype))


NORMS = [None, "forward", "ortho", "backward"]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("norm", NORMS)
def test_fft_ifft(dtype, norm):
    x = _randn(3, 16, dtype=dtype)
    _compare(lambda x: torch.fft.fft(x, norm=norm), x, dtype=dtype)
    _compare(lambda x: torch.fft.ifft(x, norm=norm), x, dtype=dtype)
    _compare(lambda x: torch.fft.fft(x, n=10, dim=0, norm=norm), x, dtype=dtype)  # pad + other dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", NORMS)
def test_rfft_irfft_hfft(dtype, norm):
    x = _randn(4, 15, dtype=dtype, seed=1)
    _compare(lambda x: torch.fft.rfft(x, norm=norm), x, dtype=dtype)
    _compare(lambda x: torch.fft.fft(x, norm=norm), x, dtype=dtype)          # real input, full spectrum
    spec = torch.fft.rfft(x)
    _compare(lambda s: torch.fft.irfft(s, norm=norm), spec, dtype=dtype)
    _compare(lambda s: torch.fft.irfft(s, n=15, norm=norm), spec, dtype=dtype)  # odd length
    _compare(lambda s: torch.fft.hfft(s, norm=norm), spec, dtype=dtype)
    _compare(lambda x: torch.fft.ihfft(x, norm=norm), x, dtype=dtype)


@pytest.mark.parametrize("norm", NORMS)
def test_fftn_rfftn_irfftn(norm):
    x = _randn(2, 6, 8, 5, seed=2)
    c = _randn(2, 6, 8, 5, dtype=torch.complex64, seed=3)
    _compare(lambda x: torch.fft.fftn(x, norm=norm), c, dtype=torch.complex64)
    _compare(lambda x: torch.fft.ifftn(x, dim=(1, 3), norm=norm), c, dtype=torch.complex64)
    _compare(lambda x: torch.fft.fft2(x, norm=norm), c, dtype=torch.complex64)
    _compare(lambda x: torch.fft.rfftn(x, norm=norm), x, dtype=torch.float32)
    _compare(lambda x: torch.fft.rfft2(x, norm=norm), x, dtype=torch.float32)
    spec = torch.fft.rfftn(x, dim=(1, 2, 3))
    _compare(lambda s: torch.fft.irfftn(s, s=(6, 8, 5), dim=(1, 2, 3), norm=norm), spec, dtype=torch.float32)


def test_round_trips_on_device():
    x = _randn(8, 64, seed=4)
    c = _randn(8, 64, dtype=torch.complex64, seed=5)
    with no_cpu_fallback():
        xt, ct = x.to("tpu"), c.to("tpu")
        back_r = torch.fft.irfft(torch.fft.rfft(xt), n=64)
        back_c = torch.fft.ifft(torch.fft.fft(ct))
        back_n = torch.fft.irfftn(torch.fft.rfftn(xt), s=x.shape)
    torch.testing.assert_close(back_r.cpu(), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back_c.cpu(), c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back_n.cpu(), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("onesided", [True, False])
def test_stft_istft_match_cpu_and_round_trip(onesided):
    sig = _randn(2, 256, seed=6)
    window = torch.hann_window(64)
    kw = dict(n_fft=64, hop_length=16, window=window, center=True, return_complex=True, onesided=onesided)
    want = torch.stft(sig, **kw)
    with no_cpu_fallback():
        spec = torch.stft(sig.to("tpu"), **{**kw, "window": window.to("tpu")})
        back = torch.istft(spec, n_fft=64, hop_length=16, window=window.to("tpu"), onesided=onesided, length=256)
    assert spec.dtype == want.dtype and spec.shape == want.shape
    torch.testing.assert_close(spec.cpu(), want, rtol=1e-5, atol=1e-4)
    want_back = torch.istft(want, n_fft=64, hop_length=16, window=window, onesided=onesided, length=256)
    torch.testing.assert_close(back.cpu(), want_back, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back.cpu(), sig, rtol=1e-5, atol=1e-5)


def test_istft_rejects_a_vanishing_window_envelope_like_cpu():
    # center=False with a Hann window: the overlap-add envelope is 0 at the
    # ends, which CPU rejects (a check on device values: raised at its sync).
    spec = torch.stft(_randn(256, seed=9), n_fft=64, hop_length=16, window=torch.hann_window(64),
                      center=False, return_complex=True)
    with pytest.raises(RuntimeError, match="window overlap add min") as cpu_err:
        torch.istft(spec, n_fft=64, hop_length=16, window=torch.hann_window(64), center=False)
    with pytest.raises(RuntimeError, match="window overlap add min"):
        torch.istft(spec.to("tpu"), n_fft=64, hop_length=16, window=torch.hann_window(64, device="tpu"),
                    center=False)
    assert cpu_err.type is RuntimeError


def test_fft_backward_matches_cpu():
    x = _randn(4, 32, seed=7)
    w = _randn(4, 17, dtype=torch.complex64, seed=8)

    def run(device):
        xx = x.detach().clone().to(device).requires_grad_()
        y = torch.fft.rfft(xx, norm="ortho")
        loss = (torch.view_as_real(y * w.to(device))).sum() + torch.fft.irfft(y, n=32).pow(2).sum()
        loss.backward()
        return loss.detach(), xx.grad

    want = run("cpu")
    with no_cpu_fallback():
        got = run("tpu")
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g.cpu(), w_, rtol=1e-5, atol=1e-4)
