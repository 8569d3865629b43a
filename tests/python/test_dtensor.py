"""DTensor and tensor parallelism on tpu (2 ranks on localhost, tpu_dist).

Real processes (test_distributed.run_job: spawned, a FileStore, bounded by a
timeout, killed on expiry). Checks:

- distribute_tensor with Shard(0)/Shard(1)/Replicate, every redistribute
  between them, Partial -> Replicate/Shard, full_tensor and a sharded
  matmul: values equal to the CPU tensors they came from (exact: the data
  only moves; the matmul within f32 tolerance);
- DTensor's RNG tracker: torch.distributed.tensor.rand on a Shard(0) DTensor
  equals torch.rand of the whole tensor on one tpu device with the same seed
  (OffsetBasedRNGTracker draws each shard at offset shard_index x shard_numel;
  the tpu generator is counter based per element, as CUDA's Philox);
- parallelize_module on a transformer block (SequenceParallel LayerNorms,
  ColwiseParallel q/k/v and MLP up, RowwiseParallel o and MLP down, the
  activations kept as DTensors) with dropout on the attention weights and on
  both residual branches: per-step losses (Adam) within 1e-5 relative of the
  same block trained in one process on one tpu device with the same seed,
  where the dropout masks are the same draws; and without dropout, within
  1e-5 relative of the block trained on the CPU (PyTorch's reference).
"""
from __future__ import annotations

import pytest
import torch

from test_distributed import run_job

# --------------------------------------------------------------------------
# DTensor API


def _api_checks(rank, world, mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    placements = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    out = {"mismatch": []}
    for a, pa in placements.items():
        d = distribute_tensor(x.to("tpu"), mesh, [pa])
        expect_local = x.chunk(world, dim=pa.dim)[rank] if isinstance(pa, Shard) else x
        if not torch.equal(d.to_local().cpu(), expect_local):
            out["mismatch"].append(f"local of {a}")
        if not torch.equal(d.full_tensor().cpu(), x):
            out["mismatch"].append(f"full_tensor of {a}")
        for b, pb in placements.items():
            e = d.redistribute(mesh, [pb])
            expect = x.chunk(world, dim=pb.dim)[rank] if isinstance(pb, Shard) else x
            if not torch.equal(e.to_local().cpu(), expect) or not torch.equal(e.full_tensor().cpu(), x):
                out["mismatch"].append(f"{a} -> {b}")
    # Partial: each rank holds an addend
    local = torch.arange(6, dtype=torch.float32) * (rank + 1)
    total = sum(torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(world))
    p = DTensor.from_local(local.to("tpu"), mesh, [Partial()])
    if not torch.equal(p.redistribute(mesh, [Replicate()]).to_local().cpu(), total):
        out["mismatch"].append("Partial -> R")
    if not torch.equal(p.redistribute(mesh, [Shard(0)]).to_local().cpu(), total.chunk(world)[rank]):
        out["mismatch"].append("Partial -> S0")
    # a sharded matmul (row-sharded @ replicated -> row-sharded)
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    c = distribute_tensor(x.to("tpu"), mesh, [Shard(0)]) @ distribute_tensor(w.to("tpu"), mesh, [Replicate()])
    out["mm_placements"] = str(c.placements)
    out["mm_err"] = (c.full_tensor().cpu() - x @ w).abs().max().item()
    return out


def test_dtensor_api(dtensor_reports):
    for res in dtensor_reports:
        res = res["api"]
        assert res["mismatch"] == [], res["mismatch"]
        assert res["mm_placements"] == "(Shard(dim=0),)"
        assert res["mm_err"] <= 1e-5


# --------------------------------------------------------------------------
# DTensor's RNG tracker


def _rng_state(seed, offset):
    import struct

    return torch.frombuffer(bytearray(struct.pack("<QQ", seed, offset)), dtype=torch.uint8).clone()


def _rng_offset():
    return torch.tpu.get_rng_state()[8:].view(torch.int64).item()


@pytest.mark.parametrize("op", ["rand", "randn", "rand_f64", "bernoulli", "dropout"])
def test_rng_draws_are_counter_based(op):
    """One process: a draw of n values at offset o + k equals values k.. of
    the draw at offset o (the contract DTensor's tracker relies on), and each
    op advances the offset by its element count rounded up to 4."""
    import torch_tpu  # noqa: F401

    def draw(n):
        if op == "rand":
            return torch.rand(n, device="tpu")
        if op == "randn":
            return torch.randn(n, device="tpu")
        if op == "rand_f64":
            return torch.rand(n, device="tpu", dtype=torch.float64)
        if op == "bernoulli":
            return torch.bernoulli(torch.full((n,), 0.5, device="tpu"))
        return torch.nn.functional.dropout(torch.ones(n, device="tpu"), 0.5, True)

    n, k = 24, 8
    torch.tpu.set_rng_state(_rng_state(11, 100))
    whole = draw(n).cpu()
    assert _rng_offset() == 100 + n
    torch.tpu.set_rng_state(_rng_state(11, 100 + k))
    tail = draw(n - k).cpu()
    assert torch.equal(whole[k:], tail), (whole, tail)
    assert not torch.equal(whole[:n - k], tail)
    torch.tpu.set_rng_state(_rng_state(11, 0))
    draw(5)
    assert _rng_offset() == 8  # 5 rounded up to a multiple of 4


def _rng_checks(rank, world, mesh):
    from torch.distributed.tensor import Shard, rand, randn

    torch.manual_seed(1234)
    u = rand((8, 6), device_mesh=mesh, placements=[Shard(0)]).full_tensor().cpu()
    z = randn((16, 4), device_mesh=mesh, placements=[Shard(0)]).full_tensor().cpu()
    # the same draws on one device, without DTensor
    torch.manual_seed(1234)
    u_ref = torch.rand(8, 6, device="tpu").cpu()
    z_ref = torch.randn(16, 4, device="tpu").cpu()
    return {"u_equal": torch.equal(u, u_ref), "z_equal": torch.equal(z, z_ref),
            "u_halves_differ": not torch.equal(u[:4], u[4:]), "u": u.tolist()}


def test_rng_tracker_matches_one_device(dtensor_reports):
    rng = [res["rng"] for res in dtensor_reports]
    for res in rng:
        assert res["u_equal"] and res["z_equal"], res
        assert res["u_halves_differ"]
    assert rng[0]["u"] == rng[1]["u"]


# --------------------------------------------------------------------------
# tensor parallelism on a transformer block

SEQ, DIM, HEADS, HIDDEN = 8, 16, 4, 32
STEPS = 3


def _block(dropout: float):
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        """Pre-LayerNorm attention + MLP block. x: (1, SEQ, DIM) float32.
        Batch 1 keeps a sequence- or head-sharded activation one contiguous
        slice of the whole tensor, so each rank's dropout draws (at DTensor's
        shard offset) are the ones the single-device run draws there."""

        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(DIM)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))
            self.ln2 = nn.LayerNorm(DIM)
            self.w1 = nn.Linear(DIM, HIDDEN)
            self.w2 = nn.Linear(HIDDEN, DIM)
            self.p = dropout

        def forward(self, x):
            b, s, _ = x.shape
            h = self.ln1(x)
            q, k, v = (w(h).view(b, s, HEADS, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            att = torch.softmax(q @ k.transpose(-2, -1) / (DIM // HEADS) ** 0.5, dim=-1)
            att = F.dropout(att, self.p, self.training)
            y = (att @ v).transpose(1, 2).reshape(b, s, DIM)
            x = x + F.dropout(self.wo(y), self.p, self.training)
            x = x + F.dropout(self.w2(F.gelu(self.w1(self.ln2(x)))), self.p, self.training)
            return x

    return Block()


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(1, SEQ, DIM, generator=g), torch.randn(1, SEQ, DIM, generator=g)


def _loss(model, device, step, to_input):
    x, y = _data(step)
    out = model(to_input(x.to(device)))
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return torch.nn.functional.mse_loss(out, y.to(device))


def _train(model, device, steps, to_input, seed):
    """Adam on mse(model(x), y); returns the per-step losses and, first, the
    step-0 loss in eval mode (no dropout)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    model.eval()
    with torch.no_grad():
        losses.append(_loss(model, device, 0, to_input).item())
    model.train()
    torch.manual_seed(seed)
    for step in range(steps):
        loss = _loss(model, device, step, to_input)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tp_checks(rank, world, mesh, p):
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    init = {k: v.clone() for k, v in _block(p).state_dict().items()}

    model = _block(p)
    model.load_state_dict(init)
    model.to("tpu")
    col = ColwiseParallel(input_layouts=Shard(1), use_local_output=False)
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    parallelize_module(model, mesh, {
        "ln1": SequenceParallel(), "ln2": SequenceParallel(),
        "wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row})
    tp_losses = _train(model, "tpu", STEPS, lambda x: distribute_tensor(x, mesh, [Shard(1)]), seed=7)
    out = {"tp": tp_losses, "local_wq_rows": model.wq.weight.to_local().shape[0]}
    if rank == 0:
        ref = _block(p)
        ref.load_state_dict(init)
        device = "tpu" if p > 0 else "cpu"  # dropout draws exist on tpu only; without, CPU is the reference
        out["ref"] = _train(ref.to(device), device, STEPS, lambda x: x, seed=7)
    return out


DROPOUTS = (0.0, 0.25)


def _dtensor_worker(rank, world, args):
    """One 2-rank job for every check (process start-up and compiles are the
    cost): returns {"api": ..., "rng": ..., "tp0.0": ..., "tp0.25": ...}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.tpu.set_device(rank)
    mesh = init_device_mesh("tpu", (world,))
    out = {"api": _api_checks(rank, world, mesh), "rng": _rng_checks(rank, world, mesh)}
    for p in DROPOUTS:
        out[f"tp{p}"] = _tp_checks(rank, world, mesh, p)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def dtensor_reports(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("dtensor"), _dtensor_worker)


@pytest.mark.parametrize("dropout", DROPOUTS)
def test_tensor_parallel_block_matches_single_process(dtensor_reports, dropout):
    results = [res[f"tp{dropout}"] for res in dtensor_reports]
    ref = results[0]["ref"]
    for res in results:
        assert res["local_wq_rows"] == DIM // 2  # the weights really are sharded
        for step, (a, b) in enumerate(zip(res["tp"], ref)):
            assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: TP loss {a} vs single process {b}"
    # losses[0] is step 0 in eval mode; with dropout the training loss differs from it
    assert (abs(ref[1] - ref[0]) > 1e-3 * abs(ref[0])) == (dropout > 0), ref
