"""vLLM platform plugin for the ``tpu`` device (entry point ``vllm.platform_plugins``).

vLLM calls :func:`register` at start-up in every process.  It returns the
class path of :class:`torch_tpu.vllm.platform.TPUPlatform` only when the user
chose this platform -- ``TORCH_TPU_VLLM=1`` in the environment, or
``VLLM_PLUGINS`` naming ``torch_tpu`` (the entry point's name) -- and the tpu device is usable; otherwise
``None``, so a plain CPU vLLM user keeps vLLM's own CPU platform.

"Usable" is decided without creating the PJRT client: a plugin library was
found when torch_tpu was imported (``torch_tpu._plugin_error is None``).  The
API server calls this too, and a process that never created a client can
start the engine core by ``fork`` (no PJRT/XLA threads to lose; the child
keeps the ~40 s of vLLM imports already done, see platform.py).  When the
client already exists in this process, ``torch.tpu.is_available()`` is asked
as before.  A plugin that is found but cannot start then fails in the engine
core with the loader's error naming it, rather than at registration.

See docs/serving.md for what runs where.
"""

from __future__ import annotations

import os

ENV_VAR = "TORCH_TPU_VLLM"


def _chosen() -> bool:
    if os.environ.get(ENV_VAR, "") == "1":
        return True
    plugins = os.environ.get("VLLM_PLUGINS", "")
    return "torch_tpu" in [p.strip() for p in plugins.split(",") if p.strip()]


def register() -> str | None:
    """Return the TPUPlatform class path when chosen and usable, else None."""
    if not _chosen():
        return None
    try:
        import torch
        import torch_tpu  # noqa: F401  (registers the PrivateUse1 backend)

        from torch_tpu import _C

        if _C._is_initialized():
            if not torch.tpu.is_available():
                return None
        elif torch_tpu._plugin_error is not None:
            return None
    except Exception:  # the device can't start: don't hijack vLLM
        return None
    return "torch_tpu.vllm.platform.TPUPlatform"
