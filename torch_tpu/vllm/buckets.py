"""Fixed shape buckets for serving on ``tpu``: every step is padded to one.

A tpu program is compiled for static shapes, so the model runner pads each
step to the next bucket and the attention metadata builder pads to the same
one; after the start-up warm-up (one compile per bucket) no step compiles.

* token buckets (the model's forward): powers of two from 16 up to the first
  one >= ``max_num_batched_tokens`` (vLLM's scheduler never schedules more
  tokens in a step);
* batch buckets (``compute_logits``, one row per request): powers of two
  from 1 up to the first one >= ``max_num_seqs``;
* block buckets (paged attention's per-token block-table width, i.e. how
  many K/V positions each token's attention reads: blocks x block_size):
  powers of four from 1 block, the last one capped at the blocks of
  ``max_model_len``. A step reads the bucket of its longest sequence, not
  the whole ``max_model_len`` (a factor of four, not two, to keep the
  forward's programs -- one per (token bucket, block bucket) pair -- few).

A count above the largest bucket (which the scheduler does not produce; the
runner's prompt-logprobs path can) is padded to the next power of two: still
correct, but compiled when first met.
"""

from __future__ import annotations

MIN_TOKEN_BUCKET = 16


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while True:
        out.append(n)
        if n >= hi:
            return out
        n *= 2


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token-count buckets for a scheduler budget of ``max_num_batched_tokens``."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    return _powers_of_two(MIN_TOKEN_BUCKET, max_num_batched_tokens)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch-size buckets for at most ``max_num_seqs`` requests per step."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return _powers_of_two(1, max_num_seqs)


def block_buckets(max_blocks: int) -> list[int]:
    """Block-table width buckets for sequences of at most ``max_blocks``
    blocks: 1, 4, 16, ... up to the first >= max_blocks, capped at it."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    out, n = [], 1
    while n < max_blocks:
        out.append(n)
        n *= 4
    out.append(max_blocks)
    return out


def pad_to(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (n >= 0); past the last, the next power of two."""
    if n < 0:
        raise ValueError(f"cannot pad a negative count {n}")
    for b in buckets:
        if b >= n:
            return b
    b = buckets[-1]
    while b < n:
        b *= 2
    return b


def for_config(vllm_config) -> tuple[list[int], list[int]]:
    """(token buckets, batch buckets) of a VllmConfig's scheduler limits."""
    sched = vllm_config.scheduler_config
    return token_buckets(sched.max_num_batched_tokens), batch_buckets(sched.max_num_seqs)
