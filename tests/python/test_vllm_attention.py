"""torch_tpu/vllm/attention.py's paged attention on tpu vs a direct CPU
reference: per request, causal softmax(q k^T * scale) v over the request's
context + new tokens, K/V laid out contiguously (no paging).

One ragged batch mixes a fresh prefill, a decode, a chunked-prefill step
(new tokens after cached context) and a prefix-cache hit (context blocks
shared with another request), over scattered, non-monotonic block ids and
GQA (4 query heads, 2 KV heads).  float32, atol 1e-5.  No CPU fallback.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make installs requirements-serving.txt)")

import torch  # noqa: E402
import torch_tpu  # noqa: E402, F401
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
    qs, ks, vs, slots, qidx, seq_lens = [], [], [], [], [], []
    max_q = max(n for _, n, _ in reqs)
    q_pos = torch.zeros(len(reqs) * max_q, dtype=torch.int64)
    for i, (ctx, n, blocks) in enumerate(reqs):
        qs.append(torch.randn(n, HQ, D, generator=g))
        ks.append(torch.randn(n, HKV, D, generator=g))
        vs.append(torch.randn(n, HKV, D, generator=g))
        for j in range(n):
            p = ctx + j
            slots.append(blocks[p // BS] * BS + p % BS)
            qidx.append(i * max_q + j)
            q_pos[i * max_q + j] = p
        seq_lens.append(ctx + n)
    nblk = max(-(-s // BS) for s in seq_lens)
    bt = torch.zeros(len(reqs), nblk, dtype=torch.int64)
    for i, (_, _, blocks) in enumerate(reqs):
        bt[i, :len(blocks)] = torch.tensor(blocks)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    t = lambda x: x.to("tpu")  # noqa: E731
    kv = t(cache)
    with no_cpu_fallback():
        write_kv(kv, t(k), t(v), t(torch.tensor(slots)))
        out = paged_attention(t(q), kv, t(bt), t(torch.tensor(seq_lens)), t(torch.tensor(qidx)),
                              t(q_pos), max_q, nblk, D ** -0.5).cpu()
    start = 0
    for i, (ctx, n, _) in enumerate(reqs):
        ref = _reference(qs[i], torch.cat([full_k[i], ks[i]]), torch.cat([full_v[i], vs[i]]), ctx)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    # the new K/V landed in their slots
    flat = kv.cpu().view(NB * BS, 2, HKV, D)
    torch.testing.assert_close(flat[torch.tensor(slots), 0], k)
    torch.testing.assert_close(flat[torch.tensor(slots), 1], v)
