"""vLLM worker and model runner for the ``tpu`` device.

What runs where (see docs/serving.md):

* on ``tpu``: the model's weights, its whole forward (vLLM's own model
  definitions with their ``forward_native`` layers), the paged KV cache and
  paged attention (torch_tpu/vllm/attention.py), and ``compute_logits``;
* on the host (CPU tensors, as vLLM's CPU runner keeps them): the runner's
  bookkeeping -- input batch, block tables, slot mappings, positions -- and
  vLLM's sampler over the logits.  Inputs move to ``tpu`` at the model
  boundary and hidden states/logits come back, one transfer each per step.

The runner is vLLM's ``CPUModelRunner`` (which subclasses ``GPUModelRunner``
and stubs CUDA streams and events) with three changes: the model is wrapped
at its boundary, the KV cache is allocated on ``tpu`` in the layout the
attention backend reads, and block zeroing uses one ``index_fill_`` per layer.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import torch
from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import bind_kv_cache
from vllm.v1.worker.worker_base import CompilationTimes

import torch_tpu.vllm.attention  # noqa: F401  (registers the attention backend)

logger = init_logger(__name__)

TPU = torch.device("tpu", 0)


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return x


class TPUModelRunner(CPUModelRunner):
    """CPUModelRunner whose model and KV cache live on ``tpu``."""

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        model = self.model
        for p in model.parameters():
            if p.device.type != "tpu":
                raise RuntimeError(
                    f"torch_tpu vLLM: a parameter was loaded on {p.device}, not tpu")
        forward = model.forward
        compute_logits = model.compute_logits

        @functools.wraps(forward)
        def forward_on_tpu(*args, **kwargs):
            args = [_to(a, TPU) for a in args]
            kwargs = {k: _to(v, TPU) for k, v in kwargs.items()}
            out = forward(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                return out.cpu()
            return out  # IntermediateTensors/tuples only for PP/aux outputs

        @functools.wraps(compute_logits)
        def compute_logits_on_tpu(hidden_states, *args, **kwargs):
            logits = compute_logits(hidden_states.to(TPU), *args, **kwargs)
            return None if logits is None else logits.cpu()

        model.forward = forward_on_tpu
        model.compute_logits = compute_logits_on_tpu

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
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.int64, device=TPU)
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
        set_random_seed(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time)
