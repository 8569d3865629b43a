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
        """Bytes of device memory.  vLLM's API server asks this while it
        builds its config (engine/arg_utils.py get_batch_defaults); a
        process without a PJRT client asks a forked child
        (:func:`_total_memory_in_child`), so the API server stays without
        one and can fork its engine core (:func:`_choose_start_method`)."""
        from torch_tpu import _C

        refuse_if_forked_with_client()
        if not _C._is_initialized():
            total = _total_memory_in_child(device_id)
            if total is not None:
                return total
        _free, total = torch.tpu.mem_get_info(device_id)
        return int(total)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        refuse_if_forked_with_client()
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

        _choose_start_method()
        os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = "1"


def _choose_start_method() -> None:
    """Pick how vLLM starts the engine core (and workers): ``fork`` while
    this process has no PJRT client, else ``spawn``.

    A PJRT client owns threads (the CPU plugin's pool) that a forked child
    does not get, so a child forked after the client exists must not use the
    device: then spawn, as vLLM forces for an initialized CUDA
    (vllm/utils/system_utils.py ``_maybe_force_spawn``).  The API server
    never creates the client (register() probes without it), so its engine
    core is forked and inherits vLLM's imports instead of importing them
    again.  vLLM's CLI entry sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
    when it is unset (vllm/entrypoints/serve/utils/api_utils.py
    ``cli_env_setup``, before the platform is chosen), so a user's own
    setting is told apart by the environment the process was started with
    (:func:`_start_method_at_exec`): it is kept, except ``fork`` with a live
    client (overridden to spawn, with a warning).  The forked child checks
    again (:func:`refuse_if_forked_with_client`, called by
    ``TPUWorker.init_device`` and :meth:`TPUPlatform.set_device`).
    """
    from torch_tpu import _C

    var = "VLLM_WORKER_MULTIPROC_METHOD"
    if _C._is_initialized():
        if os.environ.get(var) == "fork":
            logger.warning("torch_tpu: this process has a PJRT client; forked children cannot use "
                           "it: overriding VLLM_WORKER_MULTIPROC_METHOD=fork to spawn")
        os.environ[var] = "spawn"
        return
    at_exec = _start_method_at_exec()
    if at_exec is None:  # the user chose nothing: vLLM's CLI default is replaced
        os.environ[var] = "fork"
    elif at_exec == "":  # unknown: keep what is set
        os.environ.setdefault(var, "fork")
    logger.info("torch_tpu: vLLM starts its engine processes by %s", os.environ[var])


def _start_method_at_exec() -> str | None:
    """VLLM_WORKER_MULTIPROC_METHOD as this process was started with (Linux
    ``/proc/self/environ``, which later ``os.environ`` changes do not
    touch): its value, None when it was not set, "" when that cannot be
    read."""
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return ""
    for e in entries:
        if e.startswith(b"VLLM_WORKER_MULTIPROC_METHOD="):
            return e.split(b"=", 1)[1].decode(errors="replace")
    return None


def _total_memory_in_child(device_id: int, timeout_s: float = 120.0) -> int | None:
    """``torch.tpu.mem_get_info(device_id)[1]`` (bytes) computed in a
    forked child, which creates the PJRT client there and exits, so this
    process still has none (and on a device one process owns at a time,
    does not hold it).  None when the child fails or does not answer
    within ``timeout_s`` (it is then killed): the caller asks in-process."""
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no client was inherited (checked by the caller)
        code = 1
        try:
            os.close(r)
            _free, total = torch.tpu.mem_get_info(device_id)
            os.write(w, str(int(total)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout_s)
        data = os.read(r, 64) if ready else b""
    finally:
        os.close(r)
        if not data:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    if not data or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        logger.warning("torch_tpu: the forked probe of device memory failed; asking in-process")
        return None
    return int(data)


# True in a process forked while its parent held a PJRT client (whose
# threads the child lacks): the device is then unusable here.
_forked_with_client = False


def _after_fork_in_child() -> None:
    global _forked_with_client
    from torch_tpu import _C

    _forked_with_client = _forked_with_client or _C._is_initialized()


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_if_forked_with_client() -> None:
    """Raise RuntimeError in a process forked after its parent had created
    the PJRT client: the client's copy here has no threads, and using it
    would hang or fail far from the cause.  Every engine process's worker
    calls this first (``TPUWorker.init_device``; vLLM's single-process
    executor never calls :meth:`TPUPlatform.set_device`)."""
    if _forked_with_client:
        raise RuntimeError(
            "torch_tpu: this process was forked after its parent created the PJRT client, whose "
            "threads a forked child does not have; start vLLM's processes with "
            "VLLM_WORKER_MULTIPROC_METHOD=spawn")


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
