"""What a node offers its jobs: inference (through the broker) and sandboxes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prorl_cli.exceptions import ImageBuildError, SandboxError
from prorl_cli.node.handler import JobContext, Services
from prorl_cli.protocol import SamplingParams

if TYPE_CHECKING:
    from prorl_cli.node.server import NodeServer

log = logging.getLogger(__name__)


class NodeServices(Services):
    """Wires the inference client and the sandbox manager into job contexts.

    Both are created on first use, so a node whose handlers use neither pays
    nothing for them; the sandbox manager is started eagerly when the
    configured runtime needs leftovers of a crashed predecessor reaped.
    """

    def __init__(self, node: NodeServer) -> None:
        self.node = node
        self._inference: Any = None
        self._sandboxes: Any = None
        self._sandbox_error: SandboxError | None = None

    def _sandbox_manager(self) -> Any:
        if self._sandboxes is None:
            from prorl_cli.sandbox import SandboxManager

            self._sandboxes = SandboxManager(
                self.node.config.sandbox, self.node.run_dir, logging.getLogger("prorl.sandbox")
            )
        return self._sandboxes

    async def start(self) -> None:
        """At node start: reap sandboxes a crashed predecessor left in this run dir.

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
        reaped = manager.reap_leftovers()
        if reaped:
            log.warning("reaped %d sandbox(es) left by a previous node process", reaped)

    async def stop(self) -> None:
        if self._sandboxes is not None:
            await self._sandboxes.stop_all()

    async def generate(self, ctx: JobContext, prompt_ids: list[int], sampling: SamplingParams) -> Any:
        if self._inference is None:
            from prorl_cli.inference import NodeInference

            self._inference = NodeInference(
                self.node.request, self.node.config.inference, self.node.host, notify=self.node.send
            )
        return await self._inference.generate(ctx.job_id, prompt_ids, sampling)

    def _is_image_name(self, image: str) -> bool:
        """A bare name ("python") rather than a path or "host": look it up in the image manifest."""
        return self.node.config.sandbox.runtime != "local" and image != "host" and os.sep not in image and not image.endswith(".sif")

    def _resolve_image_name(self, name: str) -> Path:
        from prorl_cli.images import resolve_image

        try:
            return resolve_image(name, self.node.config.images.cache_dir)
        except ImageBuildError as e:
            raise SandboxError(f"image {name!r}: {e} (build it with 'prorl build-images {name}')") from e

    async def start_sandbox(self, ctx: JobContext, **options: Any) -> Any:
        if self._sandbox_error is not None:
            raise SandboxError(f"sandboxes unavailable on node {self.node.node_id}: {self._sandbox_error}")
        # The handler's own image is the default; sandbox.image is the fallback.
        handler_image = self.node.registry.get(ctx.task).image
        if handler_image and options.get("image") is None:
            options["image"] = handler_image
        image = options.get("image")
        if isinstance(image, str) and self._is_image_name(image):
            options["image"] = str(self._resolve_image_name(image))
        sandbox = await self._sandbox_manager().start(ctx.job_id, **options)
        ctx.add_cleanup(sandbox.stop)
        return sandbox
