"""torch_tpu/vllm/attention.py's paged attention on tpu vs a direct CPU
reference: per request, causal softmax(q k^T * scale) v over the request's
context + new tokens, K/V laid out contiguously (no paging).

One ragged batch mixes a fresh prefill, a decode, a chunked-prefill step
(new tokens after cached context) and a prefix-cache hit (context blocks
shared with another request), over scattered, non-monotonic block ids and
GQA (4 query heads, 2 KV heads); the batch is padded to a token bucket
(padding tokens write and read vLLM's null block 0, their output is dropped).
float32, atol 1e-5.  No CPU fallback; under torch.compile(backend="tpu") the
step is one program with the same values.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")

import torch  # noqa: E402
import torch_tpu  # noqa: E402, F401
import torch_tpu._dynamo  # noqa: E402, F401
from conftest import no_cpu_fallback  # noqa: E402
from torch_tpu.vllm.attention import paged_attention, write_kv  # noqa: E402

BS, HQ, HKV, D, NB = 4, 4, 2, 8, 24


def _reference(q, k, v, ctx):
    """q [n, HQ, D] at positions ctx..ctx+n-1; k, v [ctx+n, HKV, D]."""
    g = HQ // HKV
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,lhd->hql", q, k) * D ** -0.5
    qpos = torch.arange(ctx, ctx + q.shape[0])[:, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(s, -1), v)


def test_paged_attention_matches_reference():
    g = torch.Generator().manual_seed(0)
    # (context already cached, new tokens, blocks)
    reqs = [(0, 7, [5, 2]),            # fresh prefill, ragged length
            (9, 1, [11, 3, 17]),       # decode
            (8, 5, [1, 20, 8, 4]),     # chunked prefill: 8 cached, 5 new
            (8, 2, [11, 3, 9])]        # prefix hit: shares blocks 11, 3 with req 1
    cache = torch.zeros(NB, BS, 2, HKV, D)
    full_k, full_v = {}, {}
    # cached context (req 3's first 8 positions are req 1's)
    for i, (ctx, n, blocks) in enumerate(reqs):
        if i == 3:
            full_k[i], full_v[i] = full_k[1][:8].clone(), full_v[1][:8].clone()
        else:
            full_k[i] = torch.randn(ctx, HKV, D, generator=g)
            full_v[i] = torch.randn(ctx, HKV, D, generator=g)
        for p in range(ctx):
            cache[blocks[p // BS], p % BS, 0] = full_k[i][p]
            cache[blocks[p // BS], p % BS, 1] = full_v[i][p]
    qs, ks, vs, slots, tok_bt, tok_pos = [], [], [], [], [], []
    nblk = max(-(-(ctx + n) // BS) for ctx, n, _ in reqs) + 1  # covers "max_model_len"
    for i, (ctx, n, blocks) in enumerate(reqs):
        qs.append(torch.randn(n, HQ, D, generator=g))
        ks.append(torch.randn(n, HKV, D, generator=g))
        vs.append(torch.randn(n, HKV, D, generator=g))
        row = blocks + [0] * (nblk - len(blocks))
        for j in range(n):
            p = ctx + j
            slots.append(blocks[p // BS] * BS + p % BS)
            tok_bt.append(row)
            tok_pos.append(p)
    T = len(slots)
    PAD = 32 - T  # pad to the bucket 32 as the metadata builder does
    q = torch.cat(qs + [torch.randn(PAD, HQ, D, generator=g)])
    k = torch.cat(ks + [torch.randn(PAD, HKV, D, generator=g)])
    v = torch.cat(vs + [torch.randn(PAD, HKV, D, generator=g)])
    slots_p = torch.tensor(slots + [0] * PAD)
    bt = torch.tensor(tok_bt + [[0] * nblk] * PAD)
    pos = torch.tensor(tok_pos + [0] * PAD)
    t = lambda x: x.to("tpu")  # noqa: E731

    def step(kv, q, k, v, slots, bt, pos):
        write_kv(kv, k, v, slots)
        return paged_attention(q, kv, bt, pos, D ** -0.5)

    kv = t(cache)
    with no_cpu_fallback():
        out = step(kv, t(q), t(k), t(v), t(slots_p), t(bt), t(pos)).cpu()[:T]
    kv_c = t(cache)
    before = dict(torch_tpu._dynamo.stats)
    with no_cpu_fallback():
        out_c = torch.compile(step, backend="tpu", fullgraph=True, dynamic=False)(
            kv_c, t(q), t(k), t(v), t(slots_p), t(bt), t(pos)).cpu()[:T]
    assert torch_tpu._dynamo.stats["programs"] == before["programs"] + 1
    assert torch_tpu._dynamo.stats["eager_graphs"] == before["eager_graphs"]
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_c.cpu()[1:], kv.cpu()[1:])  # block 0: padding's
    start = 0
    for i, (ctx, n, _) in enumerate(reqs):
        ref = _reference(qs[i], torch.cat([full_k[i], ks[i]]), torch.cat([full_v[i], vs[i]]), ctx)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    # the new K/V landed in their slots
    flat = kv.cpu().view(NB * BS, 2, HKV, D)
    torch.testing.assert_close(flat[torch.tensor(slots), 0], k[:T])
    torch.testing.assert_close(flat[torch.tensor(slots), 1], v[:T])


def test_block_buckets():
    """Paged attention reads the block bucket of the step's longest sequence:
    powers of four blocks, the last capped at max_model_len's blocks."""
    from torch_tpu.vllm import buckets

    assert buckets.block_buckets(1) == [1]
    assert buckets.block_buckets(16) == [1, 4, 16]
    assert buckets.block_buckets(20) == [1, 4, 16, 20]
    assert buckets.block_buckets(64) == [1, 4, 16, 64]
    assert [buckets.pad_to(n, [1, 4, 16, 20]) for n in (1, 2, 4, 5, 17, 20)] == [1, 4, 4, 16, 20, 20]
    with pytest.raises(ValueError):
        buckets.block_buckets(0)
