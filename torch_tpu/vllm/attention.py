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
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    q_index: torch.Tensor, q_pos: torch.Tensor,
                    max_query_len: int, num_blocks_read: int,
                    scale: float) -> torch.Tensor:
    """Causal attention of ragged queries over K/V read by block table.

    query: [T, Hq, D] (the batch's new tokens, requests back to back);
    kv_cache: [num_blocks, block_size, 2, Hkv, D] (Hq a multiple of Hkv);
    block_table: [B, >= num_blocks_read] int64 block ids per request;
    seq_lens: [B] int64, positions each request attends to (context + new);
    q_index: [T] int64, each token's row in the padded [B * max_query_len]
    query grid; q_pos: [B * max_query_len] int64, each grid row's absolute
    position (0 for padding rows, whose output is dropped);
    max_query_len, num_blocks_read: Python ints (shape parameters).
    Returns [T, Hq, D] in query's dtype.  Softmax in float32.
    """
    T, Hq, D = query.shape
    B = block_table.shape[0]
    bs, Hkv = kv_cache.shape[1], kv_cache.shape[3]
    g = Hq // Hkv
    L = num_blocks_read * bs
    kv = kv_cache[block_table[:, :num_blocks_read]]           # [B, nb, bs, 2, Hkv, D]
    kv = kv.reshape(B, L, 2, Hkv, D).to(torch.float32)
    k, v = kv[:, :, 0], kv[:, :, 1]                             # [B, L, Hkv, D]
    q = torch.zeros(B * max_query_len, Hq, D, dtype=torch.float32, device=query.device)
    q = q.index_copy(0, q_index, query.to(torch.float32))
    q = q.reshape(B, max_query_len, Hkv, g, D)
    scores = torch.einsum("bqhgd,blhd->bhgql", q, k) * scale    # [B, Hkv, g, Q, L]
    key_pos = torch.arange(L, device=query.device)
    qp = q_pos.reshape(B, max_query_len)
    allowed = (key_pos[None, None, :] <= qp[:, :, None]) & \
              (key_pos[None, None, :] < seq_lens[:, None, None])  # [B, Q, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgql,blhd->bqhgd", probs, v)          # [B, Q, Hkv, g, D]
    out = out.reshape(B * max_query_len, Hq, D)
    return out.index_select(0, q_index).to(query.dtype)


@dataclass
class TPUAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    num_blocks_read: int
    block_table: torch.Tensor    # [B, max_blocks] int64, tpu
    seq_lens: torch.Tensor       # [B] int64, tpu
    slot_mapping: torch.Tensor   # [T] int64, tpu
    q_index: torch.Tensor        # [T] int64, tpu
    q_pos: torch.Tensor          # [B * max_query_len] int64, tpu


class TPUPagedAttentionMetadataBuilder(AttentionMetadataBuilder[TPUAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TPUAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise ValueError("torch_tpu paged attention: only causal decoder attention")
        B = m.num_reqs
        T = m.num_actual_tokens
        qsl = m.query_start_loc_cpu[: B + 1].to(torch.int64)
        seq_lens = m.seq_lens[:B].to("cpu", torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        max_q = int(q_lens.max()) if B else 1
        max_seq = int(seq_lens.max()) if B else 1
        req = torch.repeat_interleave(torch.arange(B), q_lens)          # [T]
        within = torch.arange(T) - qsl[req]
        q_index = req * max_q + within
        q_pos = torch.zeros(B * max_q, dtype=torch.int64)
        q_pos[q_index] = (seq_lens - q_lens)[req] + within
        slots = m.slot_mapping[:T].to("cpu", torch.int64)
        if bool((slots < 0).any()):
            raise ValueError("torch_tpu paged attention: negative slot in slot_mapping")
        nblk = -(-max_seq // self.block_size)
        bt = m.block_table_tensor[:B, :nblk].to("cpu", torch.int64)
        return TPUAttentionMetadata(
            num_actual_tokens=T, max_query_len=max_q, num_blocks_read=nblk,
            block_table=bt.to(TPU), seq_lens=seq_lens.to(TPU),
            slot_mapping=slots.to(TPU), q_index=q_index.to(TPU), q_pos=q_pos.to(TPU))


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
        T = attn_metadata.num_actual_tokens
        q = query[:T].reshape(T, self.num_heads, self.head_size)
        k = key[:T].reshape(T, self.num_kv_heads, self.head_size)
        v = value[:T].reshape(T, self.num_kv_heads, self.head_size)
        if self.kv_sharing_target_layer_name is None:
            write_kv(kv_cache, k, v, attn_metadata.slot_mapping)
        out = paged_attention(q, kv_cache, attn_metadata.block_table,
                              attn_metadata.seq_lens, attn_metadata.q_index,
                              attn_metadata.q_pos, attn_metadata.max_query_len,
                              attn_metadata.num_blocks_read, self.scale)
        output[:T].copy_(out.reshape(output[:T].shape))
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
