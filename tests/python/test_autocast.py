"""torch.autocast("tpu"): CUDA autocast's op lists and policies."""
from __future__ import annotations

import torch
import torch_tpu  # noqa: F401

from conftest import no_cpu_fallback


def test_policies_follow_cuda_lists():
    a, w = torch.randn(8, 16), torch.randn(4, 16)
    with no_cpu_fallback(), torch.autocast("tpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(a.to("tpu"), w.to("tpu"))  # lower_precision_fp
        s = torch.softmax(y, dim=-1)                               # fp32
        p = torch.addcmul(y, y.float(), y)                         # promote: widest input
        z = y + 1                                                  # not listed: unchanged
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert p.dtype == torch.float32 and z.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(a.bfloat16(), w.bfloat16())
    torch.testing.assert_close(y.cpu(), ref, rtol=1.6e-2, atol=1e-2)


def _train(device, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    x = torch.randn(64, 32).to(device)
    y = torch.randint(0, 4, (64,)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_mlp_training_under_autocast_matches_cpu_autocast():
    tpu = _train("tpu")
    cpu = _train("cpu")
    # bf16 matmuls on both sides; losses agree within bf16 rounding
    for t, c in zip(tpu, cpu):
        assert abs(t - c) <= 2e-2 * abs(c) + 1e-3, (t, c)
    assert tpu[-1] < tpu[0]
