"""nn.LSTM / nn.GRU / LSTMCell / GRUCell on tpu against CPU.

ATen runs these through the fused cells it picks for accelerator devices
(_thnn_fused_lstm_cell, _thnn_fused_gru_cell and their backward kernels,
csrc/aten/rnn_kernels.cpp), which have no CPU kernel: without the tpu
kernels these modules could not run at all. Outputs, final states and every
parameter gradient are compared with CPU's (non-fused) path: float32 within
rtol 1e-5 / atol 1e-5 (different order of the gate sums). No op may fall
back to the CPU.
"""
import pytest
import torch

from conftest import no_cpu_fallback

TPU = torch.device("tpu")
TOL = dict(rtol=1e-5, atol=1e-5)


def _compare(make, inputs, extra=()):
    torch.manual_seed(0)
    cpu = make()
    tpu = make().to(TPU)
    tpu.load_state_dict(cpu.state_dict())
    out_c = cpu(*inputs, *extra)
    with no_cpu_fallback():
        out_t = tpu(*[x.to(TPU) for x in inputs], *[tuple(h.to(TPU) for h in e) if isinstance(e, tuple)
                                                      else e.to(TPU) for e in extra])
    flat_c = torch.utils._pytree.tree_leaves(out_c)
    flat_t = torch.utils._pytree.tree_leaves(out_t)
    assert len(flat_c) == len(flat_t)
    for c, t in zip(flat_c, flat_t):
        assert t.device.type == "tpu"
        torch.testing.assert_close(t.cpu(), c, **TOL)
    weights = torch.linspace(-1, 1, flat_c[0].numel()).reshape(flat_c[0].shape)
    (flat_c[0] * weights).sum().backward()
    with no_cpu_fallback():
        (flat_t[0] * weights.to(TPU)).sum().backward()
    for (name, pc), (_, pt) in zip(cpu.named_parameters(), tpu.named_parameters()):
        torch.testing.assert_close(pt.grad.cpu(), pc.grad, **TOL, msg=name)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
@pytest.mark.parametrize("bias,layers,bidirectional,batch_first", [
    (True, 1, False, False), (False, 2, False, True), (True, 2, True, False)])
def test_lstm_gru_match_cpu(cls, bias, layers, bidirectional, batch_first):
    x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
    _compare(lambda: cls(4, 6, num_layers=layers, bias=bias, bidirectional=bidirectional,
                         batch_first=batch_first), [x])


def test_lstm_with_initial_state():
    g = torch.Generator().manual_seed(2)
    x, h0, c0 = torch.randn(4, 2, 3, generator=g), torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
    _compare(lambda: torch.nn.LSTM(3, 5), [x], extra=[(h0, c0)])


@pytest.mark.parametrize("cls", [torch.nn.LSTMCell, torch.nn.GRUCell])
def test_cells_match_cpu(cls):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    _compare(lambda: cls(4, 6), [x])
