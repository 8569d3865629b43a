"""A warm start of vLLM on tpu: two fresh engines on one TORCH_TPU_CACHE_DIR.

Each start runs in its own child process (this file run as a script, the
engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0), with
TORCH_TPU_COMPILE_CACHE unset, so the plugin's default applies: the worker
turns torch_tpu's Dynamo-level compile cache on (torch_tpu/vllm/worker.py,
torch_tpu/_precompile.py). Checks:

- the first (cold) start traces and compiles every bucket: Dynamo's
  ``unique_graphs`` counter is 3 x 3 (token bucket, block bucket) pairs of
  the forward + 3 x 5 (token bucket, batch bucket) pairs of the logits
  program, and every
  XLA executable is compiled (disk cache misses, no hits);
- the second (warm) start traces nothing (``unique_graphs`` 0: the graphs
  of every bucket come from the saved entries) and compiles nothing (every
  executable is a disk cache hit, no miss);
- both give the same greedy tokens, equal to Hugging Face ``generate()`` on
  CPU on the same model directory, and no op falls back to the CPU;
- after the warm start, more requests of other lengths still trace and
  compile nothing;
- the warm start's warm-up runs the block zeroing once (every per-op
  key's executable loads at its first call, nothing is host-served, so the
  second pass is skipped), as its log line says.

Slow (two vLLM starts, about 1-2 minutes each on a loaded 2-core machine):
full tier (make test-full, TORCH_TPU_TEST_FULL=1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_TIMEOUT_S = 600
PROMPT_LENS = [3, 17, 40, 64]


def _child(model_dir: str, out_path: str) -> None:
    """Runs in the child: one vLLM start and a few greedy requests."""
    import random

    import torch_tpu
    from torch._dynamo.utils import counters
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=256, block_size=16,
              kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=64, max_num_seqs=16,
              seed=0)
    m = torch_tpu.metrics()
    res: dict = {"start": {"unique_graphs": counters["stats"]["unique_graphs"],
                           "disk_cache_hits": m["disk_cache_hits"],
                           "disk_cache_misses": m["disk_cache_misses"]}}
    rng = random.Random(99)
    vocab = llm.get_tokenizer().vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(n)] for n in PROMPT_LENS]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy,
                        use_tqdm=False)
    res["prompts"] = prompts
    res["greedy"] = [list(o.outputs[0].token_ids) for o in outs]
    # more requests, other lengths: still nothing traced or compiled
    more = [TokensPrompt(prompt_token_ids=[rng.randrange(1000, vocab) for _ in range(n)])
            for n in (1, 9, 30, 50, 100)]
    llm.generate(more, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    m = torch_tpu.metrics()
    res["end"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                  "disk_cache_hits": m["disk_cache_hits"],
                  "disk_cache_misses": m["disk_cache_misses"]}
    res["cpu_fallbacks"] = m["cpu_fallbacks"]
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
    sys.exit(0)


import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")
pytest.importorskip("transformers")

import torch  # noqa: E402
from torch_tpu.vllm.tiny import make_model_dir  # noqa: E402


def _start(model_dir: str, cache_dir: str, out) -> dict:
    env = dict(os.environ, TORCH_TPU_VLLM="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TORCH_TPU_CACHE_DIR=cache_dir, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("TORCH_TPU_COMPILE_CACHE", None)  # the plugin's default
    env.pop("TORCH_TPU_COMPILE_CACHE_DIR", None)  # conftest's session store: this test owns $cache/dynamo
    p = subprocess.run([sys.executable, os.path.join(HERE, "test_vllm_warm.py"), model_dir,
                        str(out)], capture_output=True, text=True, env=env,
                       timeout=CHILD_TIMEOUT_S)
    assert p.returncode == 0, f"vLLM child failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    res = json.loads(out.read_text())
    res["log"] = p.stdout + p.stderr
    return res


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


@pytest.mark.full_tier
def test_second_start_traces_and_compiles_nothing(tmp_path):
    model_dir = make_model_dir(str(tmp_path / "llama"), "llama", seed=0)
    cache = str(tmp_path / "tpu-cache")  # empty: the first start is cold
    cold = _start(model_dir, cache, tmp_path / "cold.json")
    warm = _start(model_dir, cache, tmp_path / "warm.json")

    # cold: every bucket traced (3 token buckets for 64 batched tokens, 3
    # block buckets for 256 positions, 5 batch buckets for 16 sequences),
    # every executable compiled
    assert cold["start"]["unique_graphs"] == 3 * 3 + 3 * 5, cold["start"]
    assert cold["start"]["disk_cache_misses"] > 0 and cold["start"]["disk_cache_hits"] == 0
    saved = os.listdir(os.path.join(cache, "dynamo"))
    assert saved, "no Dynamo-level entries were saved"

    # warm: nothing traced, nothing compiled, the same executables loaded
    assert warm["start"]["unique_graphs"] == 0, warm["start"]
    assert warm["start"]["disk_cache_misses"] == 0, warm["start"]
    assert warm["start"]["disk_cache_hits"] == cold["start"]["disk_cache_misses"]
    # and nothing later either (more requests of other lengths)
    assert warm["end"]["unique_graphs"] == 0 and warm["end"]["disk_cache_misses"] == 0, warm["end"]
    assert cold["end"]["unique_graphs"] == cold["start"]["unique_graphs"], cold["end"]

    # the warm-up's block zeroing: no second pass where nothing was host-served
    assert "passes: steps 1, zeroing 1)" in warm["log"], warm["log"][-3000:]

    assert warm["greedy"] == cold["greedy"]
    for prompt, got in zip(warm["prompts"], warm["greedy"]):
        assert got == _hf_greedy(model_dir, prompt, 8), f"prompt of {len(prompt)} tokens"
    assert not cold["cpu_fallbacks"] and not warm["cpu_fallbacks"]
