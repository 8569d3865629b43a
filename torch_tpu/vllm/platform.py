"""The vLLM ``Platform`` for torch_tpu's ``tpu`` device.

Follows vllm/platforms/interface.py (vLLM 0.32): device type ``tpu``, dispatch
key ``PrivateUse1``, gloo for the (single-process) distributed group.  vLLM's
custom ops (RMSNorm, rotary embedding, SiluAndMul, ...) dispatch to their
``forward_oot`` -> ``forward_native`` pure-PyTorch paths on an out-of-tree
platform, and every one of those ops is lowered by torch_tpu.

Errors: ``check_and_update_config`` raises ValueError for configurations the
plugin does not run (tensor/pipeline parallelism > 1, a non-decoder model,
speculative decoding, LoRA).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logging config

ATTN_BACKEND = "torch_tpu.vllm.attention.TPUPagedAttentionBackend"
WORKER_CLS = "torch_tpu.vllm.worker.TPUWorker"


class TPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = "gloo"
    # vLLM's own small helper compiles (not the model): nothing to compile.
    simple_compile_backend: str = "eager"
    device_control_env_var: str = "TORCH_TPU_VISIBLE_DEVICES"

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "tpu"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        _free, total = torch.tpu.mem_get_info(device_id)
        return int(total)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.manual_seed(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def import_kernels(cls) -> None:
        # No vLLM C kernels on tpu: every op is a PyTorch op lowered by torch_tpu.
        return

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # vLLM's runner computes slot mappings with a Triton kernel; the
        # runner's bookkeeping is on the host here, so a PyTorch version.
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({
            "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel":
                _compute_slot_mapping,
        })

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        pass

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                             num_heads: int | None = None) -> str:
        if getattr(attn_selector_config, "use_mla", False):
            raise ValueError("torch_tpu vLLM plugin: MLA attention is not supported")
        if getattr(attn_selector_config, "use_sparse", False):
            raise ValueError("torch_tpu vLLM plugin: sparse attention is not supported")
        if selected_backend is not None:
            logger.info("torch_tpu: ignoring attention backend %s; using %s",
                        selected_backend, ATTN_BACKEND)
        return ATTN_BACKEND

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        free, total = torch.tpu.mem_get_info(device)
        return float(total - free)

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError(
                "torch_tpu vLLM plugin runs one device per engine: "
                f"tensor_parallel_size={parallel.tensor_parallel_size}, "
                f"pipeline_parallel_size={parallel.pipeline_parallel_size}; both must be 1")
        if vllm_config.speculative_config is not None:
            raise ValueError("torch_tpu vLLM plugin: speculative decoding is not supported")
        if vllm_config.lora_config is not None:
            raise ValueError("torch_tpu vLLM plugin: LoRA is not supported")
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_CLS
        parallel.disable_custom_all_reduce = True
        if getattr(parallel, "enable_dbo", False):
            parallel.enable_dbo = False

        cache = vllm_config.cache_config
        if cache.block_size is None:
            cache.block_size = 16

        # The scheduler's async mode overlaps CUDA streams; none here.
        vllm_config.scheduler_config.async_scheduling = False

        comp = vllm_config.compilation_config
        # CUDA graphs do not exist here; vLLM's Inductor piecewise compile
        # (VLLM_COMPILE) is replaced by torch.compile(backend="tpu") of the
        # whole model, padded to fixed buckets (worker.py, buckets.py).
        comp.cudagraph_mode = CUDAGraphMode.NONE
        comp.cudagraph_capture_sizes = []
        model_config = vllm_config.model_config
        eager = (model_config is not None and model_config.enforce_eager) or \
            comp.mode == CompilationMode.NONE
        if eager:
            # Each op runs through torch_tpu's eager executor and its per-op
            # program cache; the steps are padded to the same buckets.
            comp.mode = CompilationMode.NONE
        else:
            comp.mode = CompilationMode.STOCK_TORCH_COMPILE
            if comp.backend in ("", "inductor", "eager"):  # vLLM's defaults
                comp.backend = "tpu"

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"


def _compute_slot_mapping(num_tokens: int, max_num_tokens: int,
                          query_start_loc: torch.Tensor, positions: torch.Tensor,
                          block_table: torch.Tensor, block_table_stride: int,
                          slot_mapping: torch.Tensor, KV_CACHE_BLOCK_SIZE: int,
                          TOTAL_CP_WORLD_SIZE: int = 1, TOTAL_CP_RANK: int = 0,
                          CP_KV_CACHE_INTERLEAVE_SIZE: int = 1, PAD_ID: int = -1,
                          BLOCK_SIZE: int = 1024) -> None:
    """slot_mapping[t] = block_table[req(t), pos // bs] * bs + pos % bs for the
    first num_tokens tokens, PAD_ID up to max_num_tokens (host tensors; after
    vllm/v1/worker/block_table.py's Triton kernel)."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise ValueError("torch_tpu vLLM plugin: context parallelism is not supported")
    bs = KV_CACHE_BLOCK_SIZE
    tok = torch.arange(num_tokens)
    req = torch.searchsorted(query_start_loc[1:].to(torch.int64), tok, right=True)
    pos = positions[:num_tokens].to(torch.int64)
    blocks = block_table[req, pos // bs].to(torch.int64)
    slot_mapping[:num_tokens] = blocks * bs + pos % bs
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID
