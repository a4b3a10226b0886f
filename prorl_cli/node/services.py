"""What a node offers its jobs: inference (through the broker) and sandboxes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prorl_cli import timebase
from prorl_cli.exceptions import ImageBuildError, SandboxError
from prorl_cli.node.handler import JobContext, Services
from prorl_cli.observe.timeline import GENERATE, SANDBOX_START, SANDBOX_STOP, record_span
from prorl_cli.protocol import SamplingParams
from prorl_cli.sandbox.settings import SandboxConfig

if TYPE_CHECKING:
    from prorl_cli.inference.contract import Generation
    from prorl_cli.inference.node_client import NodeInference
    from prorl_cli.sandbox.manager import SandboxManager
    from prorl_cli.sandbox.sandbox import Sandbox

log = logging.getLogger(__name__)


class NodeServices(Services):
    """Wires the inference client and the sandbox manager into job contexts.

    Takes what it needs: the sandbox section, the image cache, the node's run
    directory (sandbox records), how to find a task's default image, and a
    factory for the inference client (bound to the node's broker connection).
    Both subsystems are created on first use, so a node whose handlers use
    neither pays nothing for them; the sandbox manager is started eagerly
    (:meth:`start`) so it reaps leftovers and says which runtime it picked.
    """

    def __init__(
        self,
        *,
        node_id: str,
        sandbox: SandboxConfig,
        image_cache_dir: str,
        run_dir: Path,
        image_search_dirs: Sequence[str] = (),
        image_of: Callable[[str], str | None],
        make_inference: Callable[[], NodeInference],
    ) -> None:
        self.node_id = node_id
        self.sandbox_config = sandbox
        self.image_cache_dir = image_cache_dir
        self.image_search_dirs = tuple(image_search_dirs)
        self.run_dir = run_dir
        self.image_of = image_of
        self.make_inference = make_inference
        self._inference: NodeInference | None = None
        self._sandboxes: SandboxManager | None = None
        self._sandbox_error: SandboxError | None = None

    @property
    def runtime_name(self) -> str | None:
        """The sandbox runtime in use (``auto`` resolved), or ``None`` when none is usable."""
        return self._sandboxes.runtime.name if self._sandboxes is not None else None

    def _sandbox_manager(self) -> SandboxManager:
        if self._sandboxes is None:
            from prorl_cli.sandbox import SandboxManager

            self._sandboxes = SandboxManager(self.sandbox_config, self.run_dir, logging.getLogger("prorl.sandbox"))
        return self._sandboxes

    async def start(self) -> None:
        """At node start: pick the runtime, and reap sandboxes that dead nodes on this host left.

        A sandbox runtime that cannot work here (say, ``apptainer`` on a host
        without it) is logged loudly; the node still serves handlers that need
        no sandbox, and ``start_sandbox`` then raises the same error.
        """
        try:
            manager = self._sandbox_manager()
        except SandboxError as e:
            self._sandbox_error = e
            log.error("sandboxes unavailable on this node: %s", e)
            return
        log.info("node %s: sandbox runtime %s%s", self.node_id, manager.runtime.name,
                 f" (sandbox.runtime: {self.sandbox_config.runtime})" if self.sandbox_config.runtime == "auto" else "")
        reaped = manager.reap_leftovers()
        if reaped:
            log.warning("reaped %d sandbox(es) left by dead node processes", reaped)

    async def stop(self) -> None:
        if self._sandboxes is not None:
            await self._sandboxes.stop_all()
        if self._inference is not None:
            await self._inference.close()

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if self._inference is None:
            self._inference = self.make_inference()
        started = timebase.now()
        try:
            gen = await self._inference.generate(ctx.job_id, prompt_ids, sampling)
        except Exception as e:
            record_span(GENERATE, started, {"prompt": len(prompt_ids), "ok": False, "error": type(e).__name__})
            raise
        record_span(GENERATE, started, {"backend": gen.backend_id, "prompt": len(prompt_ids), "output": len(gen.output_ids)})
        return gen

    def generate_held(self, job_id: str, held: bool) -> None:
        """The broker holds (or released) a generate call of ``job_id``: its clocks stand still meanwhile."""
        if self._inference is not None:
            self._inference.held(job_id, held)

    def _is_image_name(self, image: str) -> bool:
        """A bare name ("python") rather than a path or "host": look it up in the image manifest."""
        return (self.runtime_name or self.sandbox_config.runtime) != "local" and image != "host" \
            and os.sep not in image and not image.endswith(".sif")

    def _resolve_image_name(self, name: str) -> Path:
        from prorl_cli.images import resolve_image

        try:
            return resolve_image(name, self.image_cache_dir, self.image_search_dirs)
        except ImageBuildError as e:
            raise SandboxError(f"image {name!r}: {e}") from e  # the error says where it looked and what to run

    async def start_sandbox(self, ctx: JobContext, **options: Any) -> Sandbox:
        if self._sandbox_error is not None:
            raise SandboxError(f"sandboxes unavailable on node {self.node_id}: {self._sandbox_error}")
        # The handler's own image is the default; sandbox.image is the fallback.
        handler_image = self.image_of(ctx.task)
        if handler_image and options.get("image") is None:
            options["image"] = handler_image
        image = options.get("image")
        if isinstance(image, str) and self._is_image_name(image):
            options["image"] = str(self._resolve_image_name(image))
        manager = self._sandbox_manager()
        started = timebase.now()
        try:
            sandbox = await manager.start(ctx.job_id, **options)
        except Exception as e:
            record_span(SANDBOX_START, started, {"runtime": manager.runtime.name, "ok": False, "error": type(e).__name__})
            raise
        record_span(SANDBOX_START, started, {"runtime": manager.runtime.name, "sandbox": sandbox.sandbox_id})

        async def stop() -> None:
            stopping = timebase.now()
            try:
                await sandbox.stop()
            finally:
                record_span(SANDBOX_STOP, stopping, {"sandbox": sandbox.sandbox_id})

        ctx.add_cleanup(stop)
        return sandbox
