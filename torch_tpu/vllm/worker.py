"""vLLM worker and model runner for the ``tpu`` device.

What runs where (see docs/serving.md):

* on ``tpu``: the model's weights, its whole forward (vLLM's own model
  definitions with their ``forward_native`` layers), the paged KV cache and
  paged attention (torch_tpu/vllm/attention.py), and ``compute_logits``;
* on the host (CPU tensors, as vLLM's CPU runner keeps them): the runner's
  bookkeeping -- input batch, block tables, slot mappings, positions -- and
  vLLM's sampler when a step needs more than greedy argmax.  Inputs move to
  ``tpu`` at the model boundary; inside ``execute_model`` the hidden states
  stay on ``tpu`` (:class:`_DeviceHidden`) and the logits program gathers
  the sampled rows itself; it also computes each row's argmax, so a step whose requests are all
  greedy (no logprobs, penalties, bad words, allowed-token masks, logit bias
  or min-tokens) copies back only the sampled token ids (``[B]`` int64)
  instead of the ``[B, vocab]`` logits (:meth:`TPUModelRunner._sample`).

The runner is vLLM's ``CPUModelRunner`` (which subclasses ``GPUModelRunner``
and stubs CUDA streams and events) with four changes: the model is wrapped
at its boundary, the KV cache is allocated on ``tpu`` in the layout the
attention backend reads, block zeroing uses one ``index_fill_`` per layer,
and greedy sampling reads the argmax computed on ``tpu``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from contextlib import nullcontext
from typing import Any

import torch
from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import bind_kv_cache
from vllm.v1.worker.worker_base import CompilationTimes

import torch_tpu.vllm.attention  # noqa: F401  (registers the attention backend)

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logging config

TPU = torch.device("tpu", 0)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return x


def greedy_on_tpu_ok(md) -> bool:
    """Whether vLLM's ``Sampler`` would return exactly ``logits.argmax(-1)``
    for this SamplingMetadata and nothing else (vllm/v1/sample/sampler.py:
    all-greedy, no logprobs, no penalties / bad words / allowed-token mask /
    thinking budget, and the logits processors that can change an argmax --
    vLLM's built-in logit bias and min-tokens -- idle).  Any other
    processor, or any doubt, is False: the logits go to vLLM's sampler."""
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    if not md.all_greedy or md.max_num_logprobs is not None or md.logprob_token_ids:
        return False
    if not md.no_penalties or md.bad_words_token_ids or md.allowed_token_ids_mask is not None:
        return False
    holder = getattr(md, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return False
    for proc in md.logitsprocs.non_argmax_invariant:
        if type(proc) is LogitBiasLogitsProcessor and not proc.biases:
            continue
        if type(proc) is MinTokensLogitsProcessor and not proc.min_toks:
            continue
        return False
    return True


def _pad_forward_context(ctx, n: int, padded: int) -> None:
    """Check that the step's attention metadata was built for the token
    bucket ``padded``, and point the forward context's per-layer slot
    mappings (length ``n``, read by vLLM's attention layer inside the
    compiled model) at the metadata's padded ones, so no tensor the compiled
    model reads has a length other than a bucket's."""
    from torch_tpu.vllm.attention import TPUAttentionMetadata

    meta = ctx.attn_metadata
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise NotImplementedError(
            f"torch_tpu vLLM: attention metadata of type {type(meta).__name__} (only one "
            "dict per step; no speculative decoding or micro-batching)")
    for m in meta.values():
        if isinstance(m, TPUAttentionMetadata) and m.num_padded_tokens != padded:
            raise RuntimeError(
                f"torch_tpu vLLM: the model got {n} tokens (bucket {padded}) but the "
                f"attention metadata was built for bucket {m.num_padded_tokens}")
    if isinstance(ctx.slot_mapping, dict):
        ctx.slot_mapping = {
            name: meta[name].slot_mapping if isinstance(meta.get(name), TPUAttentionMetadata)
            else sm for name, sm in ctx.slot_mapping.items()}


class _LogitsAndArgmax:
    """``(compute_logits(hidden_states[rows]), its row argmax)`` in one
    program (vLLM's greedy_sample takes the first max, as ``argmax`` does),
    for the model's own ``compute_logits`` (the bound method, kept before
    the runner replaces the model's attribute with its wrapper).

    hidden_states: ``[T, hidden]`` on tpu, the forward program's padded
    output (T a token bucket); rows: ``[B]`` int64 on tpu, the rows to
    compute logits for (B a batch bucket; every value in ``[0, T)``, checked
    by the caller). Returns logits ``[B, vocab]`` and argmax ``[B]`` int64.
    The row gather is in the program, so the hidden states never leave tpu
    between the forward and the logits (one program per (T, B) pair, B <= T).

    A method, compiled as ``self.__call__``: torch_tpu's compile cache saves
    the guards reached from ``self`` (and re-checks the identity of
    ``compute_logits.__func__`` when a later process loads them), not those
    reached through a closure cell or from another argument
    (torch_tpu/_precompile.py)."""

    def __init__(self, compute_logits):
        self.compute_logits = compute_logits

    def __call__(self, hidden_states, rows):
        logits = self.compute_logits(hidden_states.index_select(0, rows))
        return logits, logits.argmax(dim=-1)


def _host_args(x: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.host() if isinstance(v, _DeviceHidden) else v, x)


class _DeviceHidden:
    """The hidden states of a step's forward, left on tpu for the logits
    program: ``padded`` ``[T, hidden]`` (T the step's token bucket), the real
    tokens its first ``n`` rows, ``rows`` (host int64 ``[B]``, every value in
    ``[0, n)``) the rows selected, or None for all ``n``.

    What vLLM's ``execute_model`` does with a forward's output is
    ``hidden_states[logits_indices]`` (a 1-D integer index: kept lazy, here)
    then ``compute_logits`` of that (the runner's wrapper runs the gather in
    the logits program), and ``hidden_states[:num_scheduled_tokens]`` for
    prompt logprobs (a prefix slice: kept lazy). Anything else -- another
    index, an attribute, a torch function -- gets the host tensor
    (``padded.cpu()[:n][rows]``, copied once), so code that reads the hidden
    states sees the same values as before, only later."""

    def __init__(self, padded: torch.Tensor, n: int, rows: torch.Tensor | None = None):
        self.padded, self.n, self.rows, self._host = padded, n, rows, None

    def host(self) -> torch.Tensor:
        if self._host is None:
            h = self.padded.cpu()[:self.n]
            self._host = h if self.rows is None else h[self.rows]
        return self._host

    def __len__(self) -> int:
        return self.n if self.rows is None else int(self.rows.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self), *self.padded.shape[1:]))

    def __getitem__(self, key):
        if self.rows is None:
            if isinstance(key, torch.Tensor) and key.dim() == 1 and key.device.type == "cpu" \
                    and key.dtype in (torch.int32, torch.int64) and key.numel() > 0 \
                    and int(key.min()) >= 0 and int(key.max()) < self.n:
                return _DeviceHidden(self.padded, self.n, key.to(torch.int64, copy=True))
            if isinstance(key, slice) and key.step in (None, 1) and key.start in (None, 0):
                r = range(self.n)[key]
                if r.start == 0 and r.step == 1:
                    return _DeviceHidden(self.padded, len(r))
        return self.host()[key]

    def __getattr__(self, name):  # only for names not found above
        if name.startswith("__") or name in ("padded", "n", "rows", "_host"):
            raise AttributeError(name)
        return getattr(self.host(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_host_args(args), **_host_args(kwargs or {}))


def _enable_compile_cache() -> bool:
    """Turn on torch_tpu's Dynamo-level compile cache (torch_tpu/_precompile.py)
    in the engine process, so that a later start on the same
    TORCH_TPU_CACHE_DIR loads every bucket's graph instead of tracing it:
    ``TORCH_TPU_COMPILE_CACHE`` unset -> the safe mode; ``0`` (or empty) ->
    off; otherwise as torch_tpu reads it ("safe", "1"). Returns whether it is
    on (False too when TORCH_TPU_CACHE_DIR is disabled)."""
    import os

    from torch_tpu import _precompile

    value = os.environ.get(_precompile.ENV)
    if value is not None and value in ("", "0"):
        return False
    if value is None:
        mode = "safe"
    else:
        mode = "safe" if value == "safe" else "all"
    if not _precompile.enable(mode, quiet=True):
        return False
    _ir_ops_by_reference()
    return True


def _ir_ops_by_reference() -> None:
    """vLLM's IR ops (``vllm.ir.ops.rms_norm``, ...) are ``IrOp`` objects
    bound to the name of their native implementation (``@register_op``), so
    torch_tpu's compile cache cannot find that function again by module and
    name and would not save the model's frame (its CLOSURE_MATCH guard on
    ``ir.ops.rms_norm._priority_impls[0].impl_fn``, the native function the
    layer dispatches to). ``__wrapped__`` (as functools.wraps sets it) on
    each op names its native implementation: the identity guard is then
    saved as the function's module and name, and re-checked when a later
    process loads the entry (a process whose priority picks another
    implementation does not load it and compiles)."""
    try:
        import vllm.ir.op as ir_op
        import vllm.ir.ops as ir_ops
    except ImportError:
        return
    for name in dir(ir_ops):
        op = getattr(ir_ops, name)
        if isinstance(op, ir_op.IrOp) and "native" in op.impls and \
                not hasattr(op, "__wrapped__"):
            op.__wrapped__ = op.impls["native"].impl_fn


class _TransposedWeightGemm:
    """``apply`` of an unquantized linear layer or LM head whose weight is
    kept transposed on tpu: ``x @ layer.weight_t (+ bias)``, with
    ``weight_t`` ``[in, out]`` contiguous; the same values as vLLM's
    ``F.linear(x, weight, bias)`` (vllm/model_executor/layers/utils.py
    ``default_unquantized_gemm``), x ``[..., in]`` -> ``[..., out]``.

    Why: in a tpu program on the XLA CPU plugin, ``F.linear``'s dot
    contracts the weight's minor dimension and costs about twice the CPU of
    the same product with the weight stored ``[in, out]`` (the 16-row
    lm_head + argmax of the test Llama, 30522 x 128: 12.3 vs 6.5 CPU ms
    per call, docs/serving.md). A strided view (vLLM's XPU trick,
    ``weight.t().contiguous().t()``) does not help: a program's inputs are
    made contiguous first."""

    def apply(self, layer, x, bias=None):
        out = torch.matmul(x, layer.weight_t)
        return out if bias is None else out + bias


class _TPULinearMethod(_TransposedWeightGemm, UnquantizedLinearMethod):
    pass


class _TPUEmbeddingMethod(_TransposedWeightGemm, UnquantizedEmbeddingMethod):
    pass


def _transpose_gemm_weights(model: torch.nn.Module) -> list[str]:
    """Keep every unquantized linear layer's and LM head's 2-D tpu weight
    transposed (``weight_t``, a buffer ``[in, out]``) and compute through
    it (:class:`_TransposedWeightGemm`). ``weight`` stays the same Parameter
    object (vLLM's weight loaders keep working), its data now a view of
    ``weight_t``: no extra memory, except for an LM head whose weight is
    shared with another module (tied embeddings), which gets its own
    transposed copy while the embedding keeps its rows. Returns the names
    of the layers changed. Anything else (quantized, already changed,
    not 2-D, not on tpu) is left as it is."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    changed = []
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if type(qm) is UnquantizedLinearMethod:
            cls = _TPULinearMethod
        elif type(qm) is UnquantizedEmbeddingMethod and isinstance(module, ParallelLMHead):
            cls = _TPUEmbeddingMethod
        else:
            continue
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.device.type != "tpu":
            continue
        with torch.no_grad():
            wt = w.detach().t().contiguous()
        module.register_buffer("weight_t", wt, persistent=False)
        if owners.get(id(w), 0) == 1:
            w.data = wt.t()
        method = cls.__new__(cls)  # the same state, the transposed apply
        method.__dict__.update(qm.__dict__)
        module.quant_method = method
        changed.append(name)
    return changed


def _again_if_host_served(run) -> int:
    """Call ``run()``, and a second time only if that first call served any
    op on the host (``torch_tpu.metrics()["host_served"]`` moved): torch_tpu's
    strict executor serves a per-op key's first call on the host and
    compiles it at its second (``TORCH_TPU_HOST_FIRST_COMPILE_AFTER``,
    default 2; docs/design.md "Host-first calls"), so a shape met once at
    warm-up would compile while serving. With a warm disk cache
    (TORCH_TPU_CACHE_DIR) a key's first call loads its executable and runs
    it, nothing is host-served, and the second pass is skipped. Returns the
    number of passes."""
    import torch_tpu

    before = torch_tpu.metrics()["host_served"]
    run()
    if torch_tpu.metrics()["host_served"] == before:
        return 1
    run()
    return 2


class _CompileOnFirstCall:
    """``torch.compile(fn, backend, fullgraph=True, dynamic=False)``, called
    at the first call rather than at model load. With torch_tpu's compile
    cache on, ``torch.compile`` is where a saved entry is loaded and its
    guards built, and they are built against the state at that moment: the
    thread's grad / inference mode (a step runs under
    ``torch.inference_mode()``; guards built outside it reject every call)
    and vLLM's forward context (which the attention layers read; it exists
    only inside a step). The first call is the warm-up's first dummy step,
    in both."""

    def __init__(self, fn, backend):
        self.fn, self.backend, self.compiled = fn, backend, None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, backend=self.backend, fullgraph=True,
                                          dynamic=False)
        return self.compiled(*args, **kwargs)


class TPUModelRunner(CPUModelRunner):
    """CPUModelRunner whose model and KV cache live on ``tpu``."""

    def load_model(self, load_dummy_weights: bool = False) -> None:
        """Load the model on tpu and wrap it at its boundary.

        ``forward`` pads the step's tokens to the next token bucket
        (torch_tpu.vllm.buckets), moves them to tpu and runs the model;
        inside :meth:`execute_model` it returns the padded hidden states
        still on tpu (:class:`_DeviceHidden`), elsewhere those of the real
        tokens on the host. ``compute_logits`` pads its row indices to the
        next batch bucket and gathers the rows, computes their logits and
        the row argmax in one program (:class:`_LogitsAndArgmax`, one per
        (token bucket, batch bucket) pair).  Inside :meth:`execute_model` it
        returns the logits on tpu (``[B, vocab]``, not copied) and keeps the
        argmax for :meth:`_sample`; elsewhere (prompt logprobs, dummy runs)
        it returns them on the host.  Under
        ``CompilationMode.STOCK_TORCH_COMPILE`` (the platform's default unless
        ``enforce_eager``) both run through ``torch.compile`` with the backend
        of vLLM's ``CompilationConfig.init_backend`` (``"tpu"``),
        ``fullgraph=True, dynamic=False``: one program per bucket, compiled
        by :meth:`warm_up_buckets` at start-up, ``torch.compile`` itself
        called at the first call (:class:`_CompileOnFirstCall`), with
        torch_tpu's Dynamo-level compile cache on (:func:`_enable_compile_cache`):
        a later start on the same TORCH_TPU_CACHE_DIR loads every bucket's
        graph instead of tracing it.
        """
        from torch_tpu.vllm import buckets

        super().load_model(load_dummy_weights=load_dummy_weights)
        model = self.model
        for p in model.parameters():
            if p.device.type != "tpu":
                raise RuntimeError(
                    f"torch_tpu vLLM: a parameter was loaded on {p.device}, not tpu")
        self.token_buckets, self.batch_buckets = buckets.for_config(self.vllm_config)
        if os.environ.get("TORCH_TPU_VLLM_TRANSPOSE_WEIGHTS", "1") != "0":
            changed = _transpose_gemm_weights(model)
            logger.info("torch_tpu: %d linear layers keep their weight transposed", len(changed))
        forward = model.forward
        compute_logits = _LogitsAndArgmax(model.compute_logits).__call__
        self.tpu_compiled = self.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
        if self.tpu_compiled:
            from vllm.compilation.counter import compilation_counter

            backend = self.compilation_config.init_backend(self.vllm_config)
            # One Dynamo cache entry per (token, block) bucket pair of the
            # forward and per (token, batch) bucket pair of the logits
            # program (and a few spare).
            max_blocks = -(-self.model_config.max_model_len // self.cache_config.block_size)
            limit = len(self.token_buckets) * (len(buckets.block_buckets(max_blocks))
                                               + len(self.batch_buckets)) + 8
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit, limit)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
            compilation_counter.stock_torch_compile_count += 1
            self.tpu_compile_cache = _enable_compile_cache()
            forward = _CompileOnFirstCall(forward, backend)
            compute_logits = _CompileOnFirstCall(compute_logits, backend)
        token_buckets, batch_buckets = self.token_buckets, self.batch_buckets
        self._logits_program = compute_logits
        # The hidden states stay on tpu between the forward and the logits
        # program inside execute_model (_DeviceHidden), unless the runner
        # reads them for more than logits (pooling, speculative decoding,
        # auxiliary hidden states) or TORCH_TPU_VLLM_HIDDEN_ON_TPU=0.
        self.hidden_on_tpu = (
            os.environ.get("TORCH_TPU_VLLM_HIDDEN_ON_TPU", "1") != "0"
            and not self.is_pooling_model and self.speculative_config is None
            and not getattr(self, "use_aux_hidden_state_outputs", False))

        @functools.wraps(model.forward)
        def forward_on_tpu(input_ids=None, positions=None, intermediate_tensors=None,
                           inputs_embeds=None, **kwargs):
            if input_ids is None or inputs_embeds is not None or intermediate_tensors is not None:
                raise NotImplementedError(
                    "torch_tpu vLLM: only token-id inputs (no inputs_embeds, no pipeline "
                    "parallelism)")
            n = input_ids.shape[0]
            padded = buckets.pad_to(n, token_buckets)
            from vllm.forward_context import get_forward_context, is_forward_context_available
            if is_forward_context_available():
                _pad_forward_context(get_forward_context(), n, padded)
            ids = torch.zeros(padded, dtype=input_ids.dtype)
            ids[:n] = input_ids
            pos = torch.zeros((*positions.shape[:-1], padded), dtype=positions.dtype)
            pos[..., :n] = positions
            kwargs = {k: _to(v, TPU) for k, v in kwargs.items()}
            t0 = time.perf_counter()
            out = forward(ids.to(TPU), pos.to(TPU), **kwargs)
            if isinstance(out, torch.Tensor):
                if runner._in_execute_model and runner.hidden_on_tpu:
                    runner._mark("forward", t0, tokens=n, bucket=padded)  # the launch
                    return _DeviceHidden(out, n)
                out = out.cpu()[:n]
                runner._mark("forward", t0, tokens=n, bucket=padded)
                return out
            raise NotImplementedError(
                f"torch_tpu vLLM: the model returned {type(out).__name__}, not hidden states")

        @functools.wraps(model.compute_logits)
        def compute_logits_on_tpu(hidden_states, *args, **kwargs):
            if args or kwargs:
                raise NotImplementedError(
                    "torch_tpu vLLM: compute_logits with arguments other than the hidden states")
            if isinstance(hidden_states, _DeviceHidden):  # this step's forward, on tpu
                src, n = hidden_states.padded, len(hidden_states)
                rows = hidden_states.rows if hidden_states.rows is not None else \
                    torch.arange(n, dtype=torch.int64)
            else:  # host hidden states (dummy runs, prompt logprobs)
                hidden_states = hidden_states.cpu()
                n = hidden_states.shape[0]
                src = torch.zeros((buckets.pad_to(n, token_buckets), *hidden_states.shape[1:]),
                                  dtype=hidden_states.dtype)
                src[:n] = hidden_states
                src = src.to(TPU)
                rows = torch.arange(n, dtype=torch.int64)
            padded = buckets.pad_to(n, batch_buckets)
            idx = torch.zeros(padded, dtype=torch.int64)  # padding rows read row 0
            idx[:n] = rows
            t0 = time.perf_counter()
            logits, ids = compute_logits(src, idx.to(TPU))
            runner._mark("logits", t0, rows=n, bucket=padded, tokens_bucket=src.shape[0])
            if logits is None:
                return None
            if not runner._in_execute_model:
                return logits.cpu()[:n]
            logits = logits[:n]
            runner._step_argmax = (logits, ids, n)
            return logits

        runner = self

        model.forward = forward_on_tpu
        model.compute_logits = compute_logits_on_tpu

    _in_execute_model = False
    _step_argmax = None  # (tpu logits [n, V], tpu argmax [padded], n) of this step
    _timeline = None  # the open TORCH_TPU_VLLM_TIMELINE file, or None
    _step = None  # this step's timeline record

    def _mark(self, phase: str, t0: float, **info) -> None:
        """Record one phase (seconds from ``t0`` to now) in this step's
        timeline record, when TORCH_TPU_VLLM_TIMELINE is set."""
        if self._step is not None:
            self._step[phase] = round(time.perf_counter() - t0, 6)
            for k, v in info.items():
                self._step[f"{phase}_{k}"] = v

    def execute_model(self, scheduler_output, *args, **kwargs):
        """vLLM's execute_model; ``compute_logits`` inside it leaves the
        logits on tpu (see :meth:`load_model`).

        With ``TORCH_TPU_VLLM_TIMELINE=path`` set, each step appends one JSON
        line to ``path``: ``t`` (time.time() at the step's start, s),
        ``reqs`` and ``tokens`` (scheduled requests and tokens), ``execute``
        and ``sample`` (seconds in execute_model and sample_tokens),
        ``forward`` / ``logits`` (seconds in the two programs' calls, with
        their buckets); the gaps between steps are the engine's own time."""
        if self._timeline is None and os.environ.get("TORCH_TPU_VLLM_TIMELINE"):
            self._timeline = open(os.environ["TORCH_TPU_VLLM_TIMELINE"], "a", buffering=1)
        if self._timeline is not None and scheduler_output.total_num_scheduled_tokens:
            self._step = {"t": round(time.time(), 6),
                          "reqs": len(scheduler_output.num_scheduled_tokens),
                          "tokens": scheduler_output.total_num_scheduled_tokens}
        self._in_execute_model, self._step_argmax = True, None
        t0 = time.perf_counter()
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            self._in_execute_model = False
            self._mark("execute", t0)

    def sample_tokens(self, grammar_output):
        """vLLM's sample_tokens; a structured-output step first brings the
        logits to the host (vLLM applies the grammar bitmask there)."""
        state = self.execute_model_state
        if grammar_output is not None and state is not None and \
                isinstance(state.logits, torch.Tensor) and state.logits.device.type == "tpu":
            self.execute_model_state = state._replace(logits=state.logits.cpu())
        t0 = time.perf_counter()
        try:
            return super().sample_tokens(grammar_output)
        finally:
            step, self._step = self._step, None
            if step is not None:
                step["sample"] = round(time.perf_counter() - t0, 6)
                self._timeline.write(json.dumps(step) + "\n")

    def _sample(self, logits, spec_decode_metadata):
        """Greedy steps (:func:`greedy_on_tpu_ok`) take the argmax the logits
        program computed on tpu: one ``[B]`` int64 copy, returned as vLLM's
        SamplerOutput (``sampled_token_ids`` ``[B, 1]`` int32, no logprobs).
        Otherwise the logits come to the host and vLLM's sampler runs."""
        from vllm.v1.outputs import SamplerOutput

        step, self._step_argmax = self._step_argmax, None
        if isinstance(logits, torch.Tensor) and logits.device.type == "tpu":
            if (step is not None and step[0] is logits and spec_decode_metadata is None
                    and greedy_on_tpu_ok(self.input_batch.sampling_metadata)):
                self.input_batch.update_async_output_token_ids()  # as vLLM's _sample
                ids = step[1].cpu()[:step[2]]
                return SamplerOutput(sampled_token_ids=ids.to(torch.int32).unsqueeze(-1),
                                     logprobs_tensors=None)
            logits = logits.cpu()
        return super()._sample(logits, spec_decode_metadata)

    def warm_up_buckets(self) -> dict:
        """Run one dummy step per (token bucket, block bucket) pair (with
        attention metadata, so the paged attention is in the program; the
        block-table width forced through
        ``TPUPagedAttentionMetadataBuilder.warm_up_blocks``) and the logits
        program per (token bucket T, batch bucket B <= T) pair, and zero the
        null block once per batch bucket; returns {"token_buckets",
        "block_buckets", "batch_buckets", "seconds", "passes"}.

        A compiled graph compiles (or loads) at its first call: one pass.
        Eager (``enforce_eager``) steps and the block zeroing (eager in both
        modes) run again only when their first pass served a call on the
        host (:func:`_again_if_host_served`)."""
        import time

        from vllm.config import CUDAGraphMode

        from torch_tpu.vllm.attention import TPUPagedAttentionMetadataBuilder as Builder

        t0 = time.perf_counter()
        hidden = self.model_config.get_hidden_size()
        block_buckets = sorted({nb for groups in self.attn_groups for g in groups
                                for b in g.metadata_builders if isinstance(b, Builder)
                                for nb in b.block_buckets}) or [None]

        def forward_pass():
            try:
                for n in self.token_buckets:
                    if n > self.scheduler_config.max_num_batched_tokens:
                        n = self.scheduler_config.max_num_batched_tokens  # the same bucket
                    for nb in block_buckets:  # the forward: every (token, block) bucket pair
                        Builder.warm_up_blocks = nb
                        self._dummy_run(n, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                        force_attention=True, allow_microbatching=False,
                                        skip_eplb=True)
            finally:
                Builder.warm_up_blocks = None

        def logits_pass():
            with torch.inference_mode():  # as execute_model: Dynamo guards on grad mode
                for t in self.token_buckets:  # the logits program: every (T, B <= T) pair
                    h = torch.zeros(t, hidden, dtype=self.model_config.dtype, device=TPU)
                    for b in self.batch_buckets:
                        if b <= t:
                            ids = self._logits_program(h, torch.zeros(b, dtype=torch.int64,
                                                                      device=TPU))[1]
                    ids.cpu()

        def zero_pass():
            with torch.inference_mode():
                for b in self.batch_buckets:
                    self._zero_block_ids([0] * b)  # the null block: nothing real is zeroed

        if self.tpu_compiled:
            forward_pass()
            t_fwd = time.perf_counter()
            logits_pass()
            t_logits, step_passes = time.perf_counter(), 1
        else:
            step_passes = _again_if_host_served(lambda: (forward_pass(), logits_pass()))
            t_fwd = t_logits = time.perf_counter()
        zero_passes = _again_if_host_served(zero_pass)
        t1 = time.perf_counter()
        seconds = t1 - t0
        logger.info("torch_tpu: warmed up token buckets %s, block buckets %s and batch buckets "
                    "%s in %.1f s (forward %.1f s, logits %.1f s, block zeroing %.1f s; "
                    "passes: steps %d, zeroing %d)", self.token_buckets, block_buckets,
                    self.batch_buckets, seconds, t_fwd - t0, t_logits - t_fwd, t1 - t_logits,
                    step_passes, zero_passes)
        return {"token_buckets": list(self.token_buckets), "block_buckets": block_buckets,
                "batch_buckets": list(self.batch_buckets), "seconds": seconds,
                "passes": {"steps": step_passes, "zeroing": zero_passes}}

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes,
                                    kv_cache_allocation_context=None):
        """One ``[num_blocks, block_size, 2, num_kv_heads, head_size]`` tensor
        per attention layer on ``tpu`` (K at [:, :, 0], V at [:, :, 1])."""
        from torch_tpu.vllm.attention import TPUPagedAttentionBackend

        kv_caches: dict[str, torch.Tensor] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            num_blocks = kv_cache_config.num_blocks_of(tensor)
            for name in tensor.layers:
                spec = next(g.kv_cache_spec for g in kv_cache_config.kv_cache_groups
                            if name in g.layer_names)
                if not isinstance(spec, AttentionSpec):
                    raise ValueError(
                        f"torch_tpu vLLM: layer {name} has a {type(spec).__name__} "
                        "KV cache; only attention layers are supported")
                shape = TPUPagedAttentionBackend.get_kv_cache_shape(
                    num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
                kv_caches[name] = torch.zeros(shape, dtype=spec.dtype, device=TPU)
        for layer_name, target in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context,
                      self.kv_caches, 1,
                      kv_cache_groups=kv_cache_config.kv_cache_groups)
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero newly allocated blocks: one ``index_fill_`` per layer, the id
        list padded with vLLM's null block 0 to a batch bucket (a fixed set
        of shapes, compiled at warm-up)."""
        from torch_tpu.vllm import buckets

        if not block_ids:
            return
        padded = buckets.pad_to(len(block_ids), self.batch_buckets)
        ids = torch.zeros(padded, dtype=torch.int64)
        ids[:len(block_ids)] = torch.tensor(block_ids, dtype=torch.int64)
        ids = ids.to(TPU)
        seen: set[int] = set()
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                ctx = self.compilation_config.static_forward_context.get(name)
                kv = getattr(ctx, "kv_cache", None)
                if isinstance(kv, torch.Tensor) and id(kv) not in seen:
                    seen.add(id(kv))
                    kv.index_fill_(0, ids, 0)


class TPUWorker(Worker):
    """vLLM's GPU ``Worker`` with the device parts replaced (after CPUWorker)."""

    def init_device(self) -> None:
        from torch_tpu.vllm.platform import refuse_if_forked_with_client

        refuse_if_forked_with_client()  # before anything touches the device
        self.device = torch.device("cpu")  # the runner's bookkeeping device
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method,
            self.local_rank, "gloo")
        set_random_seed(self.model_config.seed)
        self.model_runner = TPUModelRunner(self.vllm_config, torch.device("cpu"))

    def _maybe_get_memory_pool_context(self, tag: str):
        return nullcontext()

    def _scoped_allocator_max_split(self, max_split_size_mb: int):
        return nullcontext()

    def sleep(self, level: int = 1) -> None:
        logger.warning("sleep mode is not supported on tpu; ignored")

    def wake_up(self, tags: list[str] | None = None) -> None:
        logger.warning("sleep mode is not supported on tpu; ignored")

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: ``--kv-cache-memory-bytes`` when given,
        else ``gpu_memory_utilization * total - used`` from
        ``torch.tpu.mem_get_info()`` (after the weights are loaded)."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            return int(explicit)
        free, total = torch.tpu.mem_get_info(TPU)
        used = total - free
        budget = int(total * self.cache_config.gpu_memory_utilization) - used
        if budget <= 0:
            raise ValueError(
                f"torch_tpu vLLM: no memory left for the KV cache: tpu has "
                f"{total} bytes, {used} in use, gpu_memory_utilization="
                f"{self.cache_config.gpu_memory_utilization}; raise it or pass "
                "kv_cache_memory_bytes")
        return budget

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Compile every bucket before serving (vLLM calls this at start-up,
        after the KV cache exists); eager mode warms the per-op caches the
        same way."""
        times = self.model_runner.warm_up_buckets()
        self.compilation_config.compilation_time += times["seconds"]
        set_random_seed(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time)
