"""Parameter identity across device moves, as on CUDA.

``Module.to("tpu")`` / ``.to(device)`` / ``.tpu()`` / ``to_empty(device=...)``
move each Parameter in place (``param.data = moved``), because
``torch._has_compatible_shallow_copy_type(cpu_param, tpu_tensor)`` is True
(csrc/aten/kernels.cpp, ``HasCompatibleShallowCopyType``). So tied weights
stay tied and an optimizer made before the move keeps working. The
references are PyTorch's own CPU behaviour (moves between CPU dtypes keep the
Parameter the same way) and, for training, CPU losses on the same weights
and batches.
"""
from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest
import torch
import torch_tpu  # noqa: F401

TPU = torch.device("tpu", 0)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, idx):
        return self.head(torch.relu(self.lin(self.emb(idx))) * self.scale)


def _params(m):
    return {n: p for n, p in m.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("move", [
    lambda m: m.to("tpu"),
    lambda m: m.to(TPU),
    lambda m: m.to(device="tpu", dtype=torch.float32),
    lambda m: m.tpu(),
    lambda m: m.to_empty(device="tpu"),
], ids=["to_str", "to_device", "to_kwargs", "tpu", "to_empty"])
def test_moves_keep_every_parameter_object(move):
    torch.manual_seed(0)
    m = Tied()
    before = _params(m)
    move(m)
    after = _params(m)
    assert after.keys() == before.keys()
    for name, p in after.items():
        assert p is before[name], name
        assert p.device == TPU and isinstance(p, torch.nn.Parameter) and p.requires_grad
    assert m.head.weight is m.emb.weight
    assert m.scale.device == TPU


def test_move_keeps_values_and_grads_and_moves_back():
    torch.manual_seed(0)
    m = Tied()
    ref = copy.deepcopy(m)
    idx = torch.tensor([1, 2, 3])
    m(idx).sum().backward()
    ref(idx).sum().backward()
    w = m.lin.weight
    m.to("tpu")
    assert m.lin.weight is w and w.grad.device == TPU
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=0, msg=n)
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=0, atol=0, msg=n)
    m.to("cpu")
    assert m.lin.weight is w and w.device.type == "cpu" and w.grad.device.type == "cpu"
    torch.testing.assert_close(w, ref.lin.weight, rtol=0, atol=0)


def test_cpu_and_meta_behaviour_unchanged():
    # CPU dtype moves keep the Parameter (PyTorch's own rule); meta -> device
    # does not keep it on any device (meta is not a dense backend), and
    # neither on tpu.
    m = Tied()
    w = m.lin.weight
    m.double()
    assert m.lin.weight is w and w.dtype == torch.float64
    cpu_answer = torch._has_compatible_shallow_copy_type(torch.empty(1, device="meta"), torch.empty(1))
    tpu_answer = torch._has_compatible_shallow_copy_type(torch.empty(1, device="meta"),
                                                         torch.empty(1, device="tpu"))
    assert cpu_answer is False and tpu_answer is cpu_answer
    with torch.device("meta"):
        m = Tied()
    w = m.lin.weight
    m.to_empty(device="tpu")
    assert m.lin.weight is not w and m.lin.weight.device == TPU
    # Sparse and dense stay incompatible, as on CPU.
    sp = torch.eye(2).to_sparse()
    assert torch._has_compatible_shallow_copy_type(sp, torch.empty(1, device="tpu")) is False
    assert torch._has_compatible_shallow_copy_type(sp, torch.empty(1)) is False


def test_set_data_across_devices_like_cuda():
    p = torch.nn.Parameter(torch.randn(3))
    t = torch.randn(3, device="tpu")
    p.data = t
    assert p.device == TPU
    torch.testing.assert_close(p.cpu(), t.cpu())


def test_load_state_dict_assign_behaves_like_cpu():
    torch.manual_seed(0)
    src = Tied()
    for device in ("cpu", "tpu"):
        sd = {k: v.to(device) for k, v in src.state_dict().items()}
        with torch.device("meta"):
            m = Tied()
        m.load_state_dict(sd, assign=True)
        assert m.lin.weight.device.type == device
        assert m.lin.weight.data_ptr() == sd["lin.weight"].data_ptr()
        assert isinstance(m.lin.weight, torch.nn.Parameter)
        torch.testing.assert_close(m.lin.weight.cpu(), src.lin.weight, rtol=0, atol=0)
    # Without assign, a tpu module keeps its Parameters and takes the values.
    m = Tied().to("tpu")
    w = m.lin.weight
    m.load_state_dict(src.state_dict())
    assert m.lin.weight is w and w.device == TPU
    torch.testing.assert_close(w.cpu(), src.lin.weight, rtol=0, atol=0)


def test_optimizer_made_before_the_move_trains_like_cpu():
    torch.manual_seed(0)
    m = Tied()
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    m.to("tpu")
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    target = torch.tensor([[2, 3, 4], [5, 6, 7]])
    for _ in range(5):
        for model, o, dev in ((m, opt, TPU), (ref, ref_opt, torch.device("cpu"))):
            o.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(idx.to(dev)).flatten(0, 1), target.to(dev).flatten())
            loss.backward()
            o.step()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-5, atol=1e-6, msg=n)
    assert all(s["exp_avg"].device == TPU for s in opt.state.values())


# --- Hugging Face models with tied embeddings -------------------------------

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(cfg)


def _bert_mlm():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, tie_word_embeddings=True)
    return BertForMaskedLM(cfg)


def _tied_pair(model):
    return model.get_output_embeddings().weight, model.get_input_embeddings().weight


def _batches(n, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        labels = ids.clone()
        labels[:, ::3] = -100
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("make", [_gpt2, _bert_mlm], ids=["gpt2", "bert_mlm"])
def test_hf_tied_model_trains_8_steps_on_tpu_like_cpu(make):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    out_w, in_w = _tied_pair(model)
    assert out_w is in_w
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # made before the move
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model.to("tpu")
    out_w2, in_w2 = _tied_pair(model)
    assert out_w2 is in_w2 is out_w and out_w.device == TPU
    if hasattr(model, "transformer"):
        assert model.lm_head.weight is model.transformer.wte.weight
    model.train()
    ref.train()
    losses, ref_losses = [], []
    for ids, labels in _batches(8, model.config.vocab_size):
        for m, o, dev, acc in ((model, opt, TPU, losses), (ref, ref_opt, torch.device("cpu"), ref_losses)):
            o.zero_grad()
            loss = m(input_ids=ids.to(dev), labels=labels.to(dev)).loss
            loss.backward()
            o.step()
            acc.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-4, atol=0)
    assert losses[-1] < losses[0]
    out_w3, in_w3 = _tied_pair(model)
    assert out_w3 is in_w3
    torch.testing.assert_close(out_w3.cpu(), _tied_pair(ref)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device_map", ["tpu", "auto"])
def test_hf_from_pretrained_device_map_keeps_ties_and_places_on_tpu(device_map, tmp_path):
    torch.manual_seed(0)
    src = _gpt2()
    src.save_pretrained(tmp_path)
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(tmp_path, device_map=device_map)
    assert model.lm_head.weight is model.transformer.wte.weight
    # "auto" may spread a model over several devices where each has its own
    # memory; every parameter and buffer is on a tpu device either way.
    for name, p in model.named_parameters():
        assert p.device.type == "tpu", name
    for name, b in model.named_buffers():
        assert b.device.type == "tpu", name
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to(model.device)).logits.cpu(), src(ids).logits, rtol=1e-4, atol=1e-5)
