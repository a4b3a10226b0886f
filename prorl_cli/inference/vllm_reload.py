"""In-place weight reload for a vLLM server: a worker extension that makes vLLM's own reload correct.

vLLM (0.32) reloads a checkpoint in place with its workers'
``reload_weights(weights_path=DIR)``, reachable over HTTP through
``POST /collective_rpc`` when the server runs with ``VLLM_SERVER_DEV_MODE=1``.
Alone, that is wrong on the CPU for a model that ties its output head to its
input embeddings (Qwen2.5 0.5B-3B, the tiny test model):

- vLLM makes the tied ``lm_head`` share the embedding's ``Parameter``;
- its CPU backend turns each layer's weight into a kernel-format copy after
  loading (``process_weights_after_loading``: a oneDNN or AMX-packed matrix
  held by ``layer.cpu_linear``), and the head's logits come from that copy;
- ``reload_weights`` re-runs that step only for layers that received weights
  from the checkpoint. A tied head receives none (the checkpoint has no
  ``lm_head.weight``; vLLM logs ``ParallelLMHead: Failed to load weights``),
  so its shared ``Parameter`` holds the new embedding while its packed copy
  still holds the old one: new embeddings in, old output head out.

:class:`ReloadWorkerExtension` (given to vLLM as ``--worker-extension-cls``)
adds one worker method, ``prorl_reload_weights``, which runs vLLM's
``reload_weights`` and then re-derives the kernel copy of every unquantized
embedding-like layer that shares its weight with another layer. That step is
idempotent (it reads the weight and keeps it), so it is also harmless where a
backend keeps no copy (GPUs use the shared weight directly). Quantized tied
heads are left alone, since re-processing a quantized weight could apply a
transform twice, and are reported as such.

This module must stay importable without vLLM (vLLM imports it in its worker).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: What ``--worker-extension-cls`` names (vLLM resolves it in its worker process).
WORKER_EXTENSION = f"{__name__}.ReloadWorkerExtension"
#: The worker method that ``POST /collective_rpc`` calls.
RELOAD_METHOD = "prorl_reload_weights"


def tied_modules(model: Any) -> list[tuple[str, Any]]:
    """The ``(name, module)`` pairs whose own parameters are shared with another module (tied weights)."""
    owners: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append((name, module))
    seen: set[int] = set()
    tied: list[tuple[str, Any]] = []
    for mods in owners.values():
        if len(mods) < 2:
            continue
        for name, module in mods:
            if id(module) not in seen:
                seen.add(id(module))
                tied.append((name, module))
    return tied


def refresh_tied_modules(model: Any) -> dict[str, list[str]]:
    """Re-derive the kernel-format copy of each tied unquantized embedding/head from its (reloaded) weight.

    Returns ``{"refreshed": [names], "not_refreshed": [names]}`` (the latter: tied
    modules with another weight-processing method, left as vLLM's reload left them).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    result: dict[str, list[str]] = {"refreshed": [], "not_refreshed": []}
    for name, module in tied_modules(model):
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            result["refreshed"].append(name)
        elif method is not None:
            result["not_refreshed"].append(name)
    return result


class ReloadWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``: adds :meth:`prorl_reload_weights`.

    Attribute names must not clash with the worker's own (vLLM asserts so):
    everything here starts with ``prorl_``.
    """

    def prorl_reload_weights(self, weights_path: str) -> dict[str, Any]:
        """vLLM's ``reload_weights(weights_path=...)``, then refresh tied heads; returns what was refreshed."""
        worker: Any = self  # the vLLM worker this class is mixed into
        worker.reload_weights(weights_path=weights_path)
        result = refresh_tied_modules(worker.model_runner.get_model())
        if result["not_refreshed"]:
            log.warning("tied modules %s were not refreshed after reloading %s (quantized)",
                        result["not_refreshed"], weights_path)
        return {"weights_path": weights_path, **result}
