"""Paged attention on ``tpu`` for vLLM, in PyTorch ops that torch_tpu lowers.

vLLM's scheduler hands each step a ragged batch: request ``i`` contributes
``q_i = query_start_loc[i+1] - query_start_loc[i]`` new tokens whose K/V go to
the cache slots ``slot_mapping`` and attends to the first ``seq_lens[i]``
positions of its sequence, stored in the blocks ``block_table[i]``.  One
layout covers every case vLLM schedules: prefills of ragged lengths
(``q_i == seq_lens[i]``), decodes (``q_i == 1``), chunked prefills and
prefix-cache hits (``q_i < seq_lens[i]``: the earlier positions are already
in the cache, written by an earlier step or shared from another request).

KV cache layout (one tensor per layer): ``[num_blocks, block_size, 2,
num_kv_heads, head_size]``, K at ``[:, :, 0]`` and V at ``[:, :, 1]``; slot
``s`` is ``(s // block_size, s % block_size)``.

The device-kernel boundary is :func:`paged_attention` (and
:func:`write_kv` for the cache update): a Pallas or custom StableHLO kernel
replaces these two functions with the same arguments and nothing else moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

TPU = torch.device("tpu", 0)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V in the paged cache, in place.

    kv_cache: [num_blocks, block_size, 2, Hkv, D]; key, value: [T, Hkv, D];
    slot_mapping: [T] int64, every slot in [0, num_blocks * block_size).
    """
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.view(nb * bs, *kv_cache.shape[2:])
    flat.index_copy_(0, slot_mapping, torch.stack([key, value], dim=1).to(kv_cache.dtype))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                    token_block_table: torch.Tensor, token_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of each new token over its request's K/V, read by
    block table.

    query: [T, Hq, D] (the step's tokens, padded to a token bucket);
    kv_cache: [num_blocks, block_size, 2, Hkv, D] (Hq a multiple of Hkv);
    token_block_table: [T, nb] int64, the block table row of each token's
    request (its first nb blocks: nb, the step's block bucket, covers the
    step's longest sequence);
    token_pos: [T] int64, each token's absolute position in its sequence.
    Token t attends to the keys at positions <= token_pos[t] of its request
    (its own K/V must already be written: :func:`write_kv` first).  Padding
    tokens (block row 0, position 0) read vLLM's null block 0; their output
    is dropped by the caller.  Returns [T, Hq, D] in query's dtype; softmax in
    float32.  Every shape depends only on T and nb, so a step padded to a
    bucket reuses one compiled program.
    """
    T, Hq, D = query.shape
    bs, Hkv = kv_cache.shape[1], kv_cache.shape[3]
    g = Hq // Hkv
    L = token_block_table.shape[1] * bs
    kv = kv_cache[token_block_table]                            # [T, nb, bs, 2, Hkv, D]
    kv = kv.reshape(T, L, 2, Hkv, D).to(torch.float32)
    k, v = kv[:, :, 0], kv[:, :, 1]                             # [T, L, Hkv, D]
    q = query.to(torch.float32).reshape(T, Hkv, g, D)
    scores = torch.einsum("thgd,tlhd->thgl", q, k) * scale      # [T, Hkv, g, L]
    key_pos = torch.arange(L, device=query.device)
    allowed = key_pos[None, :] <= token_pos[:, None]            # [T, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgl,tlhd->thgd", probs, v)             # [T, Hkv, g, D]
    return out.reshape(T, Hq, D).to(query.dtype)


@dataclass
class TPUAttentionMetadata:
    """One step's metadata, padded to a token bucket (torch_tpu.vllm.buckets).

    Only tensors are read inside the compiled model (a Python int read there
    would become a guard and recompile per value)."""
    num_actual_tokens: int            # before padding
    num_padded_tokens: int            # the token bucket T
    slot_mapping: torch.Tensor        # [T] int64, tpu; padding -> slot 0 (null block)
    token_block_table: torch.Tensor   # [T, nb] int64, tpu; nb a block bucket
    token_pos: torch.Tensor           # [T] int64, tpu


class TPUPagedAttentionMetadataBuilder(AttentionMetadataBuilder[TPUAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        from torch_tpu.vllm import buckets

        self.block_size = kv_cache_spec.block_size
        self.token_buckets, _ = buckets.for_config(vllm_config)
        max_len = vllm_config.model_config.max_model_len
        self.num_blocks_per_seq = -(-max_len // self.block_size)
        self.block_buckets = buckets.block_buckets(self.num_blocks_per_seq)

    # Set by the model runner's warm-up: the block-table width to build
    # (one of block_buckets), whatever the dummy step's sequence lengths.
    warm_up_blocks: ClassVar[int | None] = None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TPUAttentionMetadata:
        from torch_tpu.vllm import buckets

        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise ValueError("torch_tpu paged attention: only causal decoder attention")
        B = m.num_reqs
        T = m.num_actual_tokens
        Tp = buckets.pad_to(T, self.token_buckets)
        qsl = m.query_start_loc_cpu[: B + 1].to(torch.int64)
        seq_lens = m.seq_lens[:B].to("cpu", torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        longest = int(seq_lens.max()) if B else 0
        if longest > self.num_blocks_per_seq * self.block_size:
            raise ValueError(f"torch_tpu paged attention: a sequence of {longest} positions "
                             f"exceeds max_model_len's {self.num_blocks_per_seq * self.block_size}")
        # The step's block bucket: its longest sequence's blocks, padded
        # (every token's keys lie within them); the warm-up picks it.
        nb = self.warm_up_blocks or buckets.pad_to(max(1, -(-longest // self.block_size)),
                                                    self.block_buckets)
        req = torch.repeat_interleave(torch.arange(B), q_lens)          # [T]
        within = torch.arange(T) - qsl[req]
        pos = torch.zeros(Tp, dtype=torch.int64)
        pos[:T] = (seq_lens - q_lens)[req] + within
        bt = m.block_table_tensor[:B].to("cpu", torch.int64)
        if bt.shape[1] < nb:
            bt = torch.nn.functional.pad(bt, (0, nb - bt.shape[1]))
        tok_bt = torch.zeros(Tp, nb, dtype=torch.int64)
        tok_bt[:T] = bt[req, :nb]
        slots = torch.zeros(Tp, dtype=torch.int64)
        # Negative slots (vLLM's PAD_ID, dummy runs) write into the null block.
        slots[:T] = m.slot_mapping[:T].to("cpu", torch.int64).clamp(min=0)
        return TPUAttentionMetadata(
            num_actual_tokens=T, num_padded_tokens=Tp, slot_mapping=slots.to(TPU),
            token_block_table=tok_bt.to(TPU), token_pos=pos.to(TPU))


class TPUPagedAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str,
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"torch_tpu paged attention: attn_type {attn_type} not supported")
        for what, val in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                          ("logits_soft_cap", logits_soft_cap), ("sinks", sinks)):
            if val is not None:
                raise ValueError(f"torch_tpu paged attention: {what} is not supported")
        if kv_cache_dtype not in ("auto", None):
            raise ValueError(f"torch_tpu paged attention: kv_cache_dtype {kv_cache_dtype!r} "
                             "not supported (only 'auto')")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        """query [T, Hq*D or Hq, D], key/value [T, Hkv, D] -> output [T, Hq*D]."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("torch_tpu paged attention: fused output quantization")
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        T = query.shape[0]  # the padded token count (a static shape, not an int read)
        q = query.reshape(T, self.num_heads, self.head_size)
        k = key.reshape(T, self.num_kv_heads, self.head_size)
        v = value.reshape(T, self.num_kv_heads, self.head_size)
        if self.kv_sharing_target_layer_name is None:
            write_kv(kv_cache, k, v, attn_metadata.slot_mapping)
        out = paged_attention(q, kv_cache, attn_metadata.token_block_table,
                              attn_metadata.token_pos, self.scale)
        output.copy_(out.reshape(output.shape))
        return output


class TPUPagedAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16,
                                                     torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # vLLM's enum slot for an out-of-tree backend (registered below).
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return TPUPagedAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TPUPagedAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, 2, num_kv_heads, head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def _register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CUSTOM,
                     f"{__name__}.{TPUPagedAttentionBackend.__qualname__}")


_register()
