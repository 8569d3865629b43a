#!/usr/bin/env python3
"""Model benchmarks, every configuration measured side by side in one run.

(b) MLP training step (forward, backward, AdamW), batch 64;
(c) all-MiniLM-L6-v2 encoder forward, batch 8 x 128 tokens, no grad;
(e) all-MiniLM-L6-v2 fine-tuning step (encoder + mean pool + linear head,
cross-entropy, AdamW over every parameter), batch 8 x 128 tokens;
for: CPU eager, torch.compile with inductor on CPU, tpu strict, tpu fused,
torch.compile(backend="tpu") in strict and in fused eager mode, and compiled
with the graph rewrites off (TORCH_TPU_FUSE_PROJECTIONS=0, side by side with
"tpu compile"). Training
steps are written as users write them: the model compiled, the loss
(cross_entropy) outside it, loss.backward(), AdamW() with its defaults
(foreach on tpu) and zero_grad(). Prints milliseconds per call (median of
--iters after --warmup calls), the ratio to CPU eager (lower is faster) and
device programs per call (torch_tpu.metrics()["executions"], averaged over
the timed calls); --split adds, for (b) on tpu, the host's time per step,
the sync's wait after it and each phase's programs run alone.
(d) a fresh process's time to the first result of the compiled encoder and
of the compiled MLP training step with an empty vs a warm cache, with the
executable cache only and with the compile cache above Dynamo too (the
default; the warm process traces nothing and compiles no XLA program).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _minilm  # noqa: E402  (offline environment before transformers)
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch_tpu  # noqa: E402

CONFIGS = ["cpu eager", "cpu inductor", "tpu strict", "tpu fused", "tpu compile", "tpu compile + fused mode",
           "tpu compile, projections unfused"]
# Configurations run with extra environment settings (read when a graph is
# compiled, at the first call): the graph rewrites off, for an A/B in one run.
CONFIG_ENV = {"tpu compile, projections unfused": {"TORCH_TPU_FUSE_PROJECTIONS": "0"}}
# --compare-deferral adds it: tpu compile in strict mode with the deferral
# between graphs off (torch_tpu._C._set_graph_deferral(False), as
# TORCH_TPU_DEFER_BETWEEN_GRAPHS=0), the step as before it (8 programs).
NO_DEFERRAL = "tpu compile, no deferral"


class _deferral:
    """Strict mode's deferral between compiled graphs on or off while timing
    `config` (off for NO_DEFERRAL only)."""

    def __init__(self, config):
        self.on = config != NO_DEFERRAL

    def __enter__(self):
        self.saved = torch_tpu._C._graph_deferral()
        torch_tpu._C._set_graph_deferral(self.on)

    def __exit__(self, *exc):
        torch_tpu._C._set_graph_deferral(self.saved)


@contextlib.contextmanager
def _config_env(config):
    """CONFIG_ENV's settings of `config` in os.environ while it is built and
    first called (where its graphs compile), restored after."""
    extra = CONFIG_ENV.get(config, {})
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _median_ms(fn, sync, warmup, iters):
    # The result is held across the sync: in fused mode a result dropped
    # before the sync point is a dead temporary that is never computed.
    for _ in range(warmup):
        result = fn()
        sync()
    times = []
    executions = torch_tpu.metrics()["executions"]
    for _ in range(iters):
        start = time.perf_counter()
        result = fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    programs = (torch_tpu.metrics()["executions"] - executions) / iters
    del result
    return statistics.median(times), programs


def _sync_for(device):
    return torch.tpu.synchronize if device == "tpu" else (lambda: None)


def _mode(config):
    """The eager mode a configuration runs in."""
    return "fused" if config in ("tpu fused", "tpu compile + fused mode") else "strict"


def _compiled(config, model):
    if config == "cpu inductor":
        return torch.compile(model)
    if config.startswith("tpu compile"):
        return torch.compile(model, backend="tpu")
    return model


def _train_step(model, forward, inputs, target):
    """One training step as users write it (AdamW with its defaults); the
    optimizer is the step's `opt` attribute."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(inputs), target)
        loss.backward()
        opt.step()
        return loss
    step.opt = opt
    return step


def _mlp(config):
    """(b)'s model (compiled per `config`), inputs and targets, on the
    configuration's device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10))
    device = "tpu" if config.startswith("tpu") else "cpu"
    model = model.to(device)
    x = torch.randn(64, 256).to(device)
    y = torch.randint(0, 10, (64,)).to(device)
    return model, _compiled(config, model), x, y, device


def mlp_step_factory(config):
    model, forward, x, y, device = _mlp(config)
    return _train_step(model, forward, x, y), device


SPLIT_CONFIGS = ["tpu strict", "tpu fused", "tpu compile", "tpu compile + fused mode"]


def split_b(args):
    """(b) on tpu, where a step's time goes, per configuration (one built
    after the other in this process, --iters x 10 steps each after
    --warmup): the host's time until the step returns and the wait in the
    sync after it (medians); then the same step with a sync after each
    phase, so that each phase's programs run alone: the forward, the loss
    and its backward, the optimizer (wall time of each phase's call and of
    its sync, medians). The phase syncs sum the device time of the step's
    programs without overlap with the host."""
    print("\n## (b) where the MLP step's time goes (host until the step returns, then the sync; "
          "phases synced one by one)\n")
    print("| configuration | host (ms) | sync wait (ms) | step (ms) | forward call / sync | loss + backward call / sync "
          "| optimizer call / sync | phase syncs sum (ms) | programs per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    n = args.iters * 10
    sync = torch.tpu.synchronize
    clock = time.perf_counter
    for config in SPLIT_CONFIGS:
        mode = _mode(config)
        with torch_tpu.eager_mode(mode):
            model, forward, x, y, _ = _mlp(config)
            step = _train_step(model, forward, x, y)
            opt = step.opt
            held = None  # the last step's loss, held across the sync (fused mode computes live results only)
            for _ in range(args.warmup):
                held = step()
                sync()
            host, wait, total = [], [], []
            executions = torch_tpu.metrics()["executions"]
            for _ in range(n):
                t0 = clock()
                held = step()
                t1 = clock()
                sync()
                t2 = clock()
                host.append((t1 - t0) * 1e3)
                wait.append((t2 - t1) * 1e3)
                total.append((t2 - t0) * 1e3)
            programs = (torch_tpu.metrics()["executions"] - executions) / n
            phases = [[] for _ in range(6)]
            for _ in range(n):
                opt.zero_grad()
                sync()
                marks = [clock()]
                out = forward(x)
                marks.append(clock())
                sync()
                marks.append(clock())
                loss = torch.nn.functional.cross_entropy(out, y)
                loss.backward()
                marks.append(clock())
                sync()
                marks.append(clock())
                opt.step()
                marks.append(clock())
                sync()
                marks.append(clock())
                for i in range(6):
                    phases[i].append((marks[i + 1] - marks[i]) * 1e3)
            del held
        med = [statistics.median(p) for p in phases]
        print(f"| {config} | {statistics.median(host):.2f} | {statistics.median(wait):.2f} "
              f"| {statistics.median(total):.2f} | {med[0]:.2f} / {med[1]:.2f} | {med[2]:.2f} / {med[3]:.2f} "
              f"| {med[4]:.2f} / {med[5]:.2f} | {med[1] + med[3] + med[5]:.2f} | {programs:g} |", flush=True)


def finetune_factory(config, model_cpu, batch_cpu):
    device = "tpu" if config.startswith("tpu") else "cpu"
    torch.manual_seed(0)
    model = _minilm.Classifier(copy.deepcopy(model_cpu), 3).to(device).train()
    batch = {k: v.to(device) for k, v in batch_cpu.items()}
    labels = torch.arange(8).remainder(3).to(device)
    return _train_step(model, _compiled(config, model), batch, labels), device


def encoder_factory(config, model_cpu, batch_cpu):
    device = "tpu" if config.startswith("tpu") else "cpu"
    model = copy.deepcopy(model_cpu).to(device).eval()
    batch = {k: v.to(device) for k, v in batch_cpu.items()}
    forward = _compiled(config, model)

    def run():
        with torch.no_grad():
            return forward(**batch).last_hidden_state
    return run, device


def measure(name, factory, args, iters, warmup=None):
    print(f"\n## {name}\n")
    print("| configuration | ms per call | ratio to CPU eager | programs per call |")
    print("|---|---|---|---|")
    base = None
    results = {}
    for config in _configs(args):
        mode = _mode(config)
        try:
            torch._dynamo.reset()
            with torch_tpu.eager_mode(mode), _deferral(config), _config_env(config):
                fn, device = factory(config)
                ms, programs = _median_ms(fn, _sync_for(device), args.warmup if warmup is None else warmup, iters)
        except Exception as e:  # a configuration that cannot run is reported, not fatal
            print(f"| {config} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | |")
            continue
        base = base or (ms if config == "cpu eager" else None)
        results[config] = ms
        ratio = f"{ms / base:.2f}x" if base else "n/a"
        shown = f"{programs:g}" if device == "tpu" else "-"
        print(f"| {config} | {ms:.2f} | {ratio} | {shown} |", flush=True)
    return results


def _configs(args):
    configs = CONFIGS + ([NO_DEFERRAL] if args.compare_deferral else [])
    return [c for c in configs if c not in args.skip]


def measure_interleaved(name, factory, args, iters, rounds, warmup):
    """As measure(), but every configuration is built (and warmed up) first
    and then timed in turns: `rounds` rounds, each timing `iters` calls of
    every configuration in order, so machine load drifting over the run
    hits all of them alike (`warmup` calls each first, one more before each
    round's). Prints each configuration's median over the rounds' medians
    and the range of the rounds' medians."""
    print(f"\n## {name} (interleaved: {rounds} rounds of {iters} calls each)\n")
    print("| configuration | ms per call (median of rounds) | rounds' range | ratio to CPU eager | programs per call |")
    print("|---|---|---|---|---|")
    torch._dynamo.reset()
    built = {}
    for config in _configs(args):
        mode = _mode(config)
        try:
            with torch_tpu.eager_mode(mode), _deferral(config), _config_env(config):
                fn, device = factory(config)
                _median_ms(fn, _sync_for(device), warmup, 1)
        except Exception as e:  # a configuration that cannot run is reported, not fatal
            print(f"| {config} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} | | | |")
            continue
        built[config] = (fn, device, mode)
    times = {c: [] for c in built}
    programs = {}
    for _ in range(rounds):
        for config, (fn, device, mode) in built.items():
            with torch_tpu.eager_mode(mode), _deferral(config):
                ms, programs[config] = _median_ms(fn, _sync_for(device), 1, iters)
            times[config].append(ms)
    base = statistics.median(times["cpu eager"]) if "cpu eager" in times else None
    for config, ts in times.items():
        ms = statistics.median(ts)
        ratio = f"{ms / base:.2f}x" if base else "n/a"
        shown = f"{programs[config]:g}" if built[config][1] == "tpu" else "-"
        print(f"| {config} | {ms:.2f} | {min(ts):.2f}-{max(ts):.2f} | {ratio} | {shown} |", flush=True)


FIRST_RESULT = r"""
import os, sys, time
start = time.perf_counter()
sys.path.insert(0, {examples!r})
import _minilm, torch, torch_tpu
tok, model = _minilm.load(_minilm.model_dir())
model = model.eval().to("tpu")
ids = torch.randint(1000, 2000, (8, 128)).to("tpu")
mask = torch.ones(8, 128, dtype=torch.long).to("tpu")
t_compile = time.perf_counter()
cpu_compile = time.process_time()
compiled = torch.compile(model, backend="tpu")
t0 = time.perf_counter()
with torch.no_grad():
    out = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
out.sum().item()
cpu = time.process_time() - cpu_compile
end = time.perf_counter()
print(f"{{end - t0:.3f}} {{end - t_compile:.3f}} {{end - start:.3f}} {{cpu:.3f}}")
"""


FIRST_STEP = r"""
import os, sys, time
start = time.perf_counter()
import torch, torch_tpu
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                            torch.nn.GELU(), torch.nn.Linear(512, 10)).to("tpu")
x = torch.randn(64, 256).to("tpu")
y = torch.randint(0, 10, (64,)).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
t_compile = time.perf_counter()
cpu_compile = time.process_time()
compiled = torch.compile(model, backend="tpu")
t0 = time.perf_counter()
opt.zero_grad()
loss = torch.nn.functional.cross_entropy(compiled(x), y)
loss.backward()
opt.step()
loss.item()
cpu = time.process_time() - cpu_compile
end = time.perf_counter()
print(f"{{end - t0:.3f}} {{end - t_compile:.3f}} {{end - start:.3f}} {{cpu:.3f}}")
"""


def first_result(args):
    """(d): per case and cache variant, `--d-rounds` rounds, each a new
    cache directory, an empty-cache process then a warm one (the variants'
    rounds interleaved, so load drifting over the run hits both alike);
    prints each process's row and the median over the rounds of the
    per-round empty/warm ratio, of wall time and of the window's process
    CPU time (torch.compile() + first call; XLA's threads included)."""
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    cases = [("compiled encoder (forward)", FIRST_RESULT.format(examples=examples)),
             ("compiled MLP training step (forward, backward, AdamW)", FIRST_STEP.format())]
    variants = [("executable cache only (TORCH_TPU_COMPILE_CACHE=0)", {"TORCH_TPU_COMPILE_CACHE": "0"}),
                ("executable + compile cache (the default: TORCH_TPU_COMPILE_CACHE unset)", {})]
    for case, code in cases:
        print(f"\n## (d) fresh process, {case}: time to the first result\n")
        print("| caches | round | state | first call (s) | torch.compile() + first call (s) | "
              "its process CPU (s) | whole process incl. imports and model load (s) |")
        print("|---|---|---|---|---|---|---|")
        ratios = {name: [] for name, _ in variants}
        for rnd in range(args.d_rounds):
            for name, extra in variants:
                with tempfile.TemporaryDirectory() as cache:
                    env = {k: v for k, v in os.environ.items()
                           if k not in ("TORCH_TPU_COMPILE_CACHE", "TORCH_TPU_COMPILE_CACHE_DIR")}
                    env.update(TORCH_TPU_CACHE_DIR=cache, **extra)
                    times = {}
                    for label in ("empty", "warm"):
                        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                        if r.returncode != 0:
                            print(f"| {name} | {rnd} | {label} | failed: {r.stderr.strip().splitlines()[-1][:100]} "
                                  f"| | | |")
                            break
                        first, with_compile, total, cpu = map(float, r.stdout.split()[-4:])
                        times[label] = (first, with_compile, cpu)
                        print(f"| {name} | {rnd} | {label} | {first:.3f} | {with_compile:.3f} | {cpu:.3f} "
                              f"| {total:.3f} |", flush=True)
                    if len(times) == 2:
                        ratios[name].append([times["empty"][i] / times["warm"][i] for i in range(3)])
        summary = []
        for name, rs in ratios.items():
            if rs:
                med = [statistics.median(r[i] for r in rs) for i in range(3)]
                summary.append(f"{name}: first call {med[0]:.1f}x, torch.compile() + first call {med[1]:.1f}x "
                               f"(process CPU {med[2]:.1f}x; median of {len(rs)} rounds)")
        print("\nwarm cache speed-up: " + "; ".join(summary))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip", action="append", default=[],
                   help="a configuration to skip, by its whole name (names may hold commas: "
                        "'tpu compile, projections unfused'); repeat the flag for more, or give "
                        "several names separated by ';'")
    p.add_argument("--only", default="b,c,d,e", help="which benchmarks: b,c,d,e")
    p.add_argument("--finetune-iters", type=int, default=3, help="timed calls of (e) (seconds each on CPU)")
    p.add_argument("--rounds", type=int, default=0,
                   help="(b), (c), (e): time the configurations interleaved, this many rounds of --iters "
                        "(--finetune-iters) calls each")
    p.add_argument("--d-rounds", type=int, default=1,
                   help="(d): rounds of an empty then a warm process per cache variant, interleaved")
    p.add_argument("--compare-deferral", action="store_true",
                   help="also time tpu compile in strict mode with the deferral between graphs off")
    p.add_argument("--split", action="store_true",
                   help="(b): also print where the tpu configurations' step time goes (host, sync wait, and "
                        "each phase's programs run alone)")
    args = p.parse_args()
    args.skip = [name.strip() for value in args.skip for name in value.split(";") if name.strip()]
    known = set(CONFIGS) | {NO_DEFERRAL}
    unknown = [name for name in args.skip if name not in known]
    if unknown:
        p.error(f"--skip: no configuration named {unknown}; the configurations are {sorted(known)}")
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    if not only or set(only) - set("bcde"):
        p.error(f"--only: {args.only!r} is not a comma-separated list of b, c, d, e")
    print(f"torch {torch.__version__}; {torch.tpu.get_device_name()}; {os.cpu_count()} CPU cores; "
          f"torch threads {torch.get_num_threads()}")
    if "b" in only:
        # A step takes a few ms: 10x the calls, so that the median is not one
        # garbage collection or scheduler hiccup away from another run's.
        if args.rounds:
            measure_interleaved("(b) MLP training step (256-512-512-10, batch 64, AdamW)", mlp_step_factory, args,
                                args.iters, args.rounds, args.warmup)
        else:
            measure("(b) MLP training step (256-512-512-10, batch 64, AdamW)", mlp_step_factory, args,
                    args.iters * 10)
        if args.split:
            split_b(args)
    if "c" in only:
        _, model_cpu = _minilm.load(_minilm.model_dir())
        g = torch.Generator().manual_seed(0)
        batch = {"input_ids": torch.randint(1000, 2000, (8, 128), generator=g),
                 "attention_mask": torch.ones(8, 128, dtype=torch.long)}
        name = "(c) all-MiniLM-L6-v2 encoder forward, batch 8 x 128 tokens"
        factory = lambda config: encoder_factory(config, model_cpu, batch)  # noqa: E731
        if args.rounds:
            measure_interleaved(name, factory, args, args.iters, args.rounds, args.warmup)
        else:
            measure(name, factory, args, args.iters)
    if "e" in only:
        _, model_cpu = _minilm.load(_minilm.model_dir())
        g = torch.Generator().manual_seed(0)
        batch = {"input_ids": torch.randint(1000, 2000, (8, 128), generator=g),
                 "attention_mask": torch.ones(8, 128, dtype=torch.long)}
        name = "(e) all-MiniLM-L6-v2 fine-tuning step (encoder + head, AdamW), batch 8 x 128 tokens"
        factory = lambda config: finetune_factory(config, model_cpu, batch)  # noqa: E731
        if args.rounds:
            measure_interleaved(name, factory, args, args.finetune_iters, args.rounds, 2)
        else:
            measure(name, factory, args, args.finetune_iters, warmup=2)
    if "d" in only:
        first_result(args)


if __name__ == "__main__":
    main()
