"""A Llama-style model trained with FSDP2 x tensor parallelism on tpu,
checked against a single-process run on the CPU.

    torchrun --nproc-per-node 4 examples/llama_fsdp_tp.py            # DeviceMesh 2 x 2 ("dp", "tp")
    torchrun --nproc-per-node 2 examples/llama_fsdp_tp.py --tp 1     # FSDP2 only, 2 ranks
    options: [--steps 10] [--mode strict|fused] [--tp N] [--tol 1e-4]

The model is transformers' LlamaForCausalLM with seeded random weights (no
hub): 2 decoder layers, hidden 64, 4 attention heads, 2 key/value heads
(grouped-query attention), vocabulary 256, untied embeddings, fp32. Each
rank binds the tpu device LOCAL_RANK and builds the DeviceMesh
(world / tp, tp) named ("dp", "tp") over device "tpu" (init_device_mesh; the
default process group is cpu:gloo,tpu:tpu_dist). Then, as TorchTitan's Llama
recipe does:

- tensor parallelism over "tp" (parallelize_module): q/k/v and the MLP's
  gate/up projections ColwiseParallel (each rank holds heads / tp query
  heads and kv_heads / tp key/value heads, intermediate / tp MLP columns),
  o_proj and down_proj RowwiseParallel (their outputs all-reduced over
  "tp"); embeddings, norms and lm_head replicated over "tp";
- FSDP2 over "dp": fully_shard on every decoder layer, then on the root
  (parameters all-gathered for forward and backward, gradients
  reduce-scattered and averaged over "dp").

Data: a fixed corpus of 8 seeded random sequences of 16 tokens, in a new
order each step (labels = inputs, HF's shifted causal LM loss); "dp" rank d trains on
rows [d * 8 / dp, (d + 1) * 8 / dp), the "tp" ranks of one "dp" group on the
same rows. Optimizer: AdamW (lr 1e-2, weight decay 0.01), 10 steps. The
printed loss is the mean of the "dp" ranks' losses (each rank's loss is the
mean over its tokens; every rank has the same number of tokens).

Rank 0 also trains the same model (same initial weights) in one process on
the CPU on the whole global batch (PyTorch's reference) and prints the
losses side by side. Exits non-zero if a step's loss differs from the
reference by more than --tol relative (default 1e-4) or the loss does not
fall (last < first).
"""
from __future__ import annotations

import argparse
import os

# one tpu device per local rank (the CPU plugin's default is 2 per process)
if "LOCAL_WORLD_SIZE" in os.environ:
    os.environ.setdefault("TORCH_TPU_CPU_DEVICES", os.environ["LOCAL_WORLD_SIZE"])

# strict mode compiles each op once per shape (tens of shapes in this model):
# expected here, so the example turns off the recompile warning unless asked
os.environ.setdefault("TORCH_TPU_RECOMPILE_WARN", "0")

import torch
import torch.distributed as dist

import torch_tpu

GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 256
LR = 1e-2
WEIGHT_DECAY = 0.01


def make_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa")


def make_model():
    """LlamaForCausalLM on the CPU with weights drawn from seed 0 (the same on every rank)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(make_config()).float()


def batch(step: int) -> torch.Tensor:
    """The global batch of step `step`: int64 token ids [GLOBAL_BATCH, SEQ],
    the rows of a fixed corpus of GLOBAL_BATCH random sequences (seed 1000) in
    a per-step random order (seed step): the model can memorize the corpus,
    so the loss falls within a few steps, and the "dp" ranks see different
    sequences each step."""
    corpus = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000))
    return corpus[torch.randperm(GLOBAL_BATCH, generator=torch.Generator().manual_seed(step))]


def reference_losses(steps: int) -> list[float]:
    """One process, CPU, the whole global batch: the losses the parallel run must match."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        ids = batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def parallelize(model, mesh):
    """Applies TP over mesh["tp"] (if its size > 1), then FSDP2 over mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if mesh["tp"].size() > 1:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=True)
    return model


def parallel_losses(steps: int, tp: int) -> tuple[list[float], dict]:
    """Trains on tpu over a (world / tp, tp) mesh; returns the per-step
    losses (mean over "dp") and facts about the sharding of rank's weights."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dp = world // tp
    mesh = init_device_mesh("tpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    per_rank = GLOBAL_BATCH // dp
    model = parallelize(make_model().to("tpu"), mesh)
    q = model.model.layers[0].self_attn.q_proj.weight
    facts = {"q_proj_local_shape": list(q.to_local().shape), "q_proj_placements": str(q.placements)}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        ids = batch(step)[dp_rank * per_rank:(dp_rank + 1) * per_rank].to("tpu")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        losses.append(total.item())
    return losses, facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mode", default="strict", choices=torch_tpu.EAGER_MODES)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the mesh is world/tp x tp)")
    parser.add_argument("--tol", type=float, default=1e-4, help="largest relative loss difference accepted")
    args = parser.parse_args()

    torch.tpu.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch_tpu.set_eager_mode(args.mode)
    dist.init_process_group()
    try:
        world = dist.get_world_size()
        if args.tp < 1 or world % args.tp:
            raise SystemExit(f"--tp {args.tp} must divide the world size {world}")
        if GLOBAL_BATCH % (world // args.tp):
            raise SystemExit(f"the global batch {GLOBAL_BATCH} must divide by dp = {world // args.tp}")
        losses, facts = parallel_losses(args.steps, args.tp)
        ok = True
        if dist.get_rank() == 0:
            ref = reference_losses(args.steps)
            print(f"LlamaForCausalLM, FSDP2 x TP on tpu ({args.mode}): mesh (dp={world // args.tp}, tp={args.tp}) "
                  f"vs single process on CPU")
            print(f"q_proj weight on rank 0: local {facts['q_proj_local_shape']} of [64, 64], "
                  f"placements {facts['q_proj_placements']}")
            print(f"{'step':>4} {'parallel loss':>14} {'reference':>14} {'rel diff':>10}")
            worst = 0.0
            for i, (a, b) in enumerate(zip(losses, ref)):
                rel = abs(a - b) / max(abs(b), 1e-12)
                worst = max(worst, rel)
                print(f"LOSS {i:>4} {a:>14.8f} {b:>14.8f} {rel:>10.2e}")
            ok = worst <= args.tol and losses[-1] < losses[0]
            print(f"max rel diff {worst:.2e} (tolerance {args.tol:.0e}); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
            print("OK" if ok else "MISMATCH")
        ok_t = torch.tensor([1 if ok else 0])
        dist.broadcast(ok_t, src=0)  # a cpu tensor: the default map's gloo
        return 0 if ok_t.item() == 1 else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
