"""vLLM serving on tpu vs Hugging Face ``generate()``, one run, same prompts.

    .venv/bin/python benchmarks/bench_vllm.py [--new-tokens 32] [--prompt-len 32]

Model: the tiny seeded Llama of torch_tpu.vllm.tiny (2 layers, hidden 128,
GQA 4/2 heads, vocabulary 30522, float32), built in a temporary directory.
Prompts: 16 prompts of ``--prompt-len`` random token ids (seed 0); every
configuration generates ``--new-tokens`` greedy tokens per prompt, EOS
ignored, and reports output tokens per second (wall clock) at 1 request
(the first prompt) and 16 concurrent requests (all of them):

1. vLLM on tpu: vLLM's OpenAI server (examples/serve_vllm.py's
   ``vllm_server``; compiled, buckets warmed up at start-up; started with
   ``SERVER_FLAGS``, what a production deployment runs: no periodic stats
   log, no access-log line per request) queried by two clients, each the
   median of 3 timed rounds after an untimed one: one asyncio event loop on
   one ``httpx.AsyncClient`` (serve_vllm.complete_many, as vLLM's serving
   benchmark sends requests) and 16 threads sharing one ``httpx.Client``.
   With the model runner's per-step timeline (TORCH_TPU_VLLM_TIMELINE):
   engine steps and requests per step of each timed round.  And the
   offline engine, ``vllm.LLM(...).generate`` (same limits, in a child
   process, engine in-process), 1 prompt and then the 16 in one call, after
   an untimed call of the same.
2. HF ``generate()`` on tpu, batched: the 16 prompts as one batch (all the
   same length, so no padding), after one untimed generate of the same
   shapes (the per-op program caches are then warm).
3. HF ``generate()`` on CPU, batched the same way.

Load-independent figures (this machine is shared: wall clock moves with
other people's load, CPU time much less): for the offline engine and HF on
tpu, the bench process's CPU seconds (``time.process_time``: all its
threads, the XLA CPU plugin's included) per output token at 16 concurrent,
and the CPU time of the one program every decode step of 16 requests runs
in both (the 16-row ``lm_head`` matmul + argmax of the tiny Llama's
30522-word vocabulary: ``compute_logits`` of vLLM's runner, as a step runs
it) -- the floor under any step of that batch.

Start-up: time from launching ``vllm serve`` to the first token of a first
request (max_tokens=1), with an empty TORCH_TPU_CACHE_DIR (cold: every
bucket is traced by Dynamo and every program compiles) and again with the
same directory (warm: the plugin turns torch_tpu's Dynamo-level compile
cache on, so the graphs come from ``$TORCH_TPU_CACHE_DIR/dynamo`` and the
executables from the disk cache); the ratio cold/warm, and each start
broken down by ``_StartupMonitor`` (the server's log polled every 20 ms for
the lines that end each phase, ``_PHASES``; at each, the CPU seconds of the
API server process and of the engine core, which show the phases' cost
apart from the load): the API server's imports, its vLLM config, the
engine core's fork, its distributed init and model runner, weights, KV
cache, the bucket warm-up (torch_tpu's own phase: load or compile every
bucket's program), vLLM's post-warm-up init, the API server's app, /health,
and the first token.
``--startup-only`` measures only this.

Prints one markdown table; BENCHMARKS.md records a run.  Exits non-zero if a
server fails to start or a request fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import subprocess
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


# What a production deployment runs with: no periodic stats logging in the
# engine core, no uvicorn access-log line per request (vLLM's per-request
# logging is already off unless --enable-log-requests). docs/serving.md.
SERVER_FLAGS = ["--disable-log-stats", "--disable-uvicorn-access-log"]


def _serve_round(serve_vllm, url, model, prompts, new_tokens, timeline, reps=3):
    """{row name: (tokens/s at 1 request, tokens/s at len(prompts) concurrent)}
    for two clients on the same server, each the median of ``reps`` timed
    rounds (rounds are bimodal on this shared machine):

    * asyncio: serve_vllm.complete_many, every request of a round written
      from one event loop on one ``httpx.AsyncClient`` (as vLLM's serving
      benchmark sends them; concurrent users do not share a GIL);
    * threads: ``len(prompts)`` threads sharing one ``httpx.Client`` (pooled
      keep-alive connections; a client per request costs ~60 CPU ms of TLS
      set-up each).  On a loaded machine the threads' sends spread over up
      to ~1.8 s waiting for the GIL, so the server batches fewer requests
      per step.

    Untimed first: one request and one concurrent round of each client
    (compiles nothing new, opens the connections).  ``timeline``: the
    server's TORCH_TPU_VLLM_TIMELINE file, summarized per timed round
    (engine steps, requests per step) with the CPU seconds per process."""
    import statistics

    import httpx

    n = len(prompts)
    tokens = n * new_tokens
    rates: dict = {"asyncio": [], "threads": []}

    def check(results):
        for r in results:
            if r["status"] != 200 or len(r["json"]["choices"][0]["token_ids"]) != new_tokens:
                raise RuntimeError(f"request failed: {r}")

    marks: dict = {}

    def begin(tag):
        marks[tag] = (len(_timeline(timeline)), _tree_cpu(), time.time())

    def end(tag, client, wall):
        n0, cpu0, w0 = marks.pop(tag)
        cpu1 = _tree_cpu()
        per = {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}
        steps = _timeline(timeline)[n0:]
        full = sum(1 for s in steps if s["reqs"] == n)
        busy = sum(s["execute"] + s["sample"] for s in steps)
        print(f"# server, {client} client, {n} concurrent: {tokens / wall:.1f} tokens/s, wall "
              f"{wall:.2f} s; {len(steps)} engine steps, {full} with all {n} requests, mean "
              f"{sum(s['reqs'] for s in steps) / max(len(steps), 1):.1f} requests per step; "
              f"first step {steps[0]['t'] - w0 if steps else float('nan'):.3f} s after the round "
              f"began; model runner busy {busy:.2f} s; CPU s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())), flush=True)
        rates[client].append(tokens / wall)

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
    with httpx.Client(limits=limits) as client, cf.ThreadPoolExecutor(n) as pool:
        def send(p):
            return serve_vllm.complete(url, model, p, new_tokens, client=client)

        check([send(prompts[0])] + list(pool.map(send, prompts)))
        t0 = time.perf_counter()
        check([send(prompts[0])])
        t1 = time.perf_counter() - t0
        for _ in range(reps):
            begin("threads")
            t0 = time.perf_counter()
            many = list(pool.map(send, prompts))
            end("threads", "threads", time.perf_counter() - t0)
            check(many)

    rounds = serve_vllm.complete_many(
        url, model, prompts, new_tokens, rounds=reps + 1,  # the first untimed
        before_round=lambda i: begin("asyncio") if i else None,
        after_round=lambda i, wall: end("asyncio", "asyncio", wall) if i else None)
    for results, _ in rounds:
        check(results)
    return {"vLLM on tpu (OpenAI server, compiled; asyncio client)":
            (new_tokens / t1, statistics.median(rates["asyncio"])),
            "vLLM on tpu (OpenAI server, compiled; 16 client threads)":
            (new_tokens / t1, statistics.median(rates["threads"]))}


def _load(when: str) -> None:
    """Prints the load average (wall-clock figures on a shared machine move
    with it)."""
    print(f"# load average {when}: " + " ".join(f"{x:.2f}" for x in os.getloadavg()),
          flush=True)


def _timeline(path: str) -> list:
    """The model runner's per-step records (torch_tpu/vllm/worker.py,
    TORCH_TPU_VLLM_TIMELINE)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tree_cpu() -> dict:
    """CPU seconds (user + system) of this process's descendants, by role:
    the server (vLLM's API server process) and its children (the engine core)."""
    import psutil

    out: dict = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        role = "api_server" if "vllm.entrypoints.openai.api_server" in cmd else "engine_core+other"
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def _offline_child(model_dir: str, prompts_json: str, new_tokens: int) -> None:
    """In a child process: vLLM's offline engine on tpu; prints JSON rates."""
    os.environ["TORCH_TPU_VLLM"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(prompts_json)]
    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, block_size=16,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=16, max_num_batched_tokens=256,
              seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    rates = []
    for batch in (prompts[:1], prompts):
        llm.generate(batch, sp, use_tqdm=False)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(batch, sp, use_tqdm=False)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        if any(len(o.outputs[0].token_ids) != new_tokens for o in outs):
            raise RuntimeError("offline generate gave fewer tokens")
        rates.append(len(batch) * new_tokens / dt)
    rates.append(cpu / (len(prompts) * new_tokens))  # CPU s per token, 16 concurrent
    rates.append(llm.collective_rpc(_lm_head_cpu, args=(len(prompts),))[0])
    print("RATES " + json.dumps(rates), flush=True)


def _lm_head_cpu(worker, rows: int, reps: int = 20) -> float:
    """On the worker: CPU seconds of the logits program (lm_head + argmax)
    for ``rows`` requests, as a step runs it (logits left on tpu, the
    argmax's ids copied back); the median of ``reps``."""
    import statistics

    import torch

    runner = worker.model_runner
    h = torch.zeros(rows, runner.model_config.get_hidden_size(), dtype=runner.model_config.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(reps + 2):
            runner._in_execute_model = True
            try:
                c0 = time.process_time()
                runner.model.compute_logits(h)
                runner._step_argmax[1].cpu()
                times.append(time.process_time() - c0)
            finally:
                runner._in_execute_model, runner._step_argmax = False, None
    return statistics.median(times[2:])


def _offline_round(model_dir, prompts, new_tokens):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--offline-child", model_dir,
                        json.dumps(prompts), str(new_tokens)], capture_output=True, text=True,
                       env=env, timeout=1200)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RATES ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"offline vLLM child failed ({p.returncode}): {p.stderr[-3000:]}")
    return tuple(json.loads(lines[-1][6:]))


def _hf_round(model_dir, device, prompts, new_tokens):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval().to(device)
    cfg = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                        do_sample=False, eos_token_id=None, pad_token_id=0,
                                        bos_token_id=None)

    def run(batch):
        ids = torch.tensor(batch, device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        out = out.cpu()
        if out.shape[1] - ids.shape[1] != new_tokens:
            raise RuntimeError(f"generate gave {out.shape[1] - ids.shape[1]} tokens")
        return out

    rates = []
    for batch in ([prompts[0]], prompts):
        run(batch)  # untimed: same shapes
        t0, c0 = time.perf_counter(), time.process_time()
        run(batch)
        rates.append(len(batch) * new_tokens / (time.perf_counter() - t0))
    rates.append((time.process_time() - c0) / (len(prompts) * new_tokens))
    return tuple(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--startup-only", action="store_true",
                    help="only the cold / warm vllm serve start-up")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import serve_vllm
    from torch_tpu.vllm.tiny import make_model_dir

    tmp = tempfile.mkdtemp(prefix="bench_vllm_")
    model = make_model_dir(os.path.join(tmp, "tiny-llama"), "llama", seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    cache = os.path.join(tmp, "tpu-cache")  # empty: the first start is cold
    rows, start, phases = {}, {}, {}
    for run in ("cold", "warm"):
        log = os.path.join(tmp, f"server-{run}.log")
        _load(f"before the {run} start")
        t0 = time.perf_counter()
        mon = _StartupMonitor(log)
        timeline = os.path.join(tmp, f"timeline-{run}.jsonl")
        with serve_vllm.vllm_server(model, serve_vllm.free_port(), extra_args=SERVER_FLAGS,
                                    log_path=log, timeout_s=900, env={"TORCH_TPU_CACHE_DIR": cache,
                                         "TORCH_TPU_VLLM_TIMELINE": timeline}) as url:
            mon.mark("API server: -> /health answered")
            r = serve_vllm.complete(url, model, prompts[0], 1)
            mon.mark("-> first token")
            start[run] = time.perf_counter() - t0
            phases[run] = mon.stop()
            if r["status"] != 200:
                raise RuntimeError(f"first request failed: {r}")
            if run == "warm" and not args.startup_only:
                rows.update(_serve_round(serve_vllm, url, model, prompts, args.new_tokens,
                                         timeline))
        print(f"# {run} start: {start[run]:.1f} s to the first token; "
              + ", ".join(f"{k} {v[0]:.1f} s" for k, v in phases[run].items()), flush=True)
        _load(f"after the {run} start")
    if args.startup_only:
        _print_startup(start, phases)
        return
    _load("after the server")
    rows["vLLM on tpu (offline LLM.generate, compiled)"] = _offline_round(
        model, prompts, args.new_tokens)

    import torch_tpu  # noqa: F401
    _load("after the offline engine")
    rows["HF generate() on tpu, batched"] = _hf_round(model, "tpu", prompts, args.new_tokens)
    _load("after HF on tpu")
    rows["HF generate() on CPU, batched"] = _hf_round(model, "cpu", prompts, args.new_tokens)

    base = rows["HF generate() on tpu, batched"]
    n = args.requests
    lm_head = rows["vLLM on tpu (offline LLM.generate, compiled)"][3]
    print(f"\nprompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy\n")
    print(f"| configuration | tokens/s, 1 request | tokens/s, {n} concurrent | "
          f"{n} concurrent vs HF tpu batched | CPU ms per {n} output tokens at {n} "
          f"concurrent (this process's CPU s / token x {n}) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cpu = f"{r[2] * n * 1e3:.1f}" if len(r) > 2 else "-"
        print(f"| {name} | {r[0]:.1f} | {r[1]:.1f} | {r[1] / base[1]:.2f}x | {cpu} |")
    print(f"\nlm_head + argmax program alone, {n} rows: {lm_head * 1e3:.1f} CPU ms "
          f"(the floor of a decode step of {n}, in vLLM and HF alike)")
    _print_startup(start, phases)


_PHASES = [  # (name, the log line that ends it, the process that writes it)
    ("API server: imports, arguments", "non-default args:", "api"),
    ("API server: vLLM config (model config, platform, device-memory probe)",
     "Enabled custom fusions", "api"),
    ("-> engine core started (fork)", "Initializing a V1 LLM engine", "api"),
    ("engine core: distributed init, PJRT client, model runner", "Starting to load model", "core"),
    ("engine core: model built, weights loaded to tpu", "Loading weights took", "core"),
    ("engine core: weights transposed, KV cache allocated", "KV cache size:", "core"),
    ("engine core: buckets warmed up (torch_tpu)", "torch_tpu: warmed up", "core"),
    ("engine core: ready (vLLM's post-warm-up init)", "init engine (profile, create kv cache", "core"),
    ("API server: app built", "Starting vLLM server on", "api"),
]


class _StartupMonitor:
    """Watches a starting ``vllm serve``: polls its log every 20 ms for the
    lines of ``_PHASES`` (so each phase ends within ~20 ms of its log line,
    not at the log's 1 s timestamps) and, at each, the CPU seconds (user +
    system) of the API server (its own, and its reaped children's: the
    forked device-memory probe) and of the engine core. ``stop()`` returns
    {phase: (wall s, API server CPU s, engine core CPU s)}, the last two
    phases (/health answered, first token) from ``mark``."""

    def __init__(self, log_path: str):
        import threading

        self.log_path, self.t0 = log_path, time.perf_counter()
        self.seen: dict = {}
        self._done = threading.Event()
        self._api = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self) -> tuple:
        import psutil

        api = core = 0.0
        try:
            if self._api is None:
                for p in psutil.Process().children():
                    if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
                        self._api = p
            if self._api is not None:
                t = self._api.cpu_times()
                api = t.user + t.system + t.children_user + t.children_system
                for c in self._api.children(recursive=True):
                    with __import__("contextlib").suppress(psutil.Error):
                        ct = c.cpu_times()
                        core += ct.user + ct.system
        except psutil.Error:
            pass
        return api, core

    def mark(self, name: str) -> None:
        self.seen[name] = (time.perf_counter() - self.t0, *self._cpu())

    def _run(self) -> None:
        pos, buf = 0, ""
        while not self._done.is_set():
            try:
                with open(self.log_path, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
            except OSError:
                chunk = ""
            if chunk:
                buf += chunk
                *lines, buf = buf.split("\n")
                for line in lines:
                    for name, marker, _ in _PHASES:
                        if name not in self.seen and marker in line:
                            self.mark(name)
            time.sleep(0.02)

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        out, prev = {}, (0.0, 0.0, 0.0)
        names = [n for n, _, _ in _PHASES] + ["API server: -> /health answered", "-> first token"]
        for name in names:
            if name in self.seen:
                cur = self.seen[name]
                out[name] = tuple(c - p for c, p in zip(cur, prev))
                prev = cur
        out["total"] = prev
        return out


def _print_startup(start: dict, phases: dict) -> None:
    print(f"\n| vllm serve start to first token (wall s; CPU s API server / engine core) "
          f"| cold cache | warm cache | cold / warm (wall) |")
    print("|---|---|---|---|")
    print(f"| tiny Llama, {_programs()} bucket programs | {start['cold']:.1f} s | "
          f"{start['warm']:.1f} s | {start['cold'] / start['warm']:.2f}x |")
    for name in phases["cold"]:
        c, w = phases["cold"][name], phases["warm"].get(name, (float("nan"),) * 3)
        cell = lambda x: f"{x[0]:.1f} s ({x[1]:.1f} / {x[2]:.1f})"  # noqa: E731
        print(f"| {name} | {cell(c)} | {cell(w)} | "
              f"{c[0] / w[0] if w[0] > 0 else float('nan'):.2f}x |")
    # The bound on cold / warm if torch_tpu's phases cost nothing in the
    # warm start: those phases (their whole time: it includes vLLM's own
    # loader work, so this bound is generous) taken out of the warm total;
    # everything else both starts pay (vLLM's imports, config, fork, app).
    ours = [n for n, _, _ in _PHASES if n.startswith("engine core: ") and
            ("weights" in n or "KV cache" in n or "warmed up" in n)]
    for i, what in ((0, "wall s"), (1, "CPU s")):
        cold = sum(phases["cold"]["total"][1:]) if i else phases["cold"]["total"][0]
        warm = sum(phases["warm"]["total"][1:]) if i else phases["warm"]["total"][0]
        mine = sum((sum(phases["warm"][n][1:]) if i else phases["warm"][n][0])
                   for n in ours if n in phases["warm"])
        print(f"# {what}: cold {cold:.1f}, warm {warm:.1f} ({cold / warm:.2f}x), of which "
              f"weights + KV cache + bucket warm-up {mine:.1f}; the rest I = {warm - mine:.1f}: "
              f"a warm start at zero cost for those phases gives at most cold / I = "
              f"{cold / (warm - mine):.2f}x")


def _programs() -> int:
    """The server's compiled programs (its limits: 256 batched tokens, 16
    sequences, 256 positions in blocks of 16): the forward per (token, block)
    bucket pair, the logits program per (token, batch <= token) pair."""
    from torch_tpu.vllm import buckets
    tok, blk, bat = buckets.token_buckets(256), buckets.block_buckets(16), buckets.batch_buckets(16)
    return len(tok) * len(blk) + sum(1 for t in tok for b in bat if b <= t)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--offline-child":
        _offline_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
