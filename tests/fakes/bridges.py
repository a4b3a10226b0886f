"""A real inference bridge on a thread of the test, so the test can look into its engine."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Generic, TypeVar

from prorl_cli.inference.bridge import InferenceBridge
from prorl_cli.inference.contract import Engine
from prorl_cli.testing import Deployment

E = TypeVar("E", bound=Engine)


class ThreadBridge(Generic[E]):
    """A real :class:`InferenceBridge` on its own event loop in a thread of this test, serving ``engine``.

    It registers with the deployment's broker as ``backend_id`` before the constructor returns.
    """

    def __init__(self, d: Deployment, backend_id: str, engine: E) -> None:
        self.engine = engine
        self.backend_id = backend_id
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(d.address, d.deployment_dir), daemon=True)
        self.thread.start()
        assert self._ready.wait(10), "the bridge thread did not start"
        d.wait_for(lambda st: any(b.backend_id == backend_id and b.alive for b in st.backends), 30,
                   f"backend {backend_id} to register")

    def _run(self, address: str, deployment_dir: Path) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.bridge = InferenceBridge(self.engine, address=address, backend_id=self.backend_id, host="127.0.0.1",
                                          deployment_dir=deployment_dir)
            self._ready.set()
            await self.bridge.serve()

        try:
            asyncio.run(main())
        except BaseException as e:  # reported by close(): a test thread must not die silently
            self._error = e

    def close(self) -> None:
        """Stop the bridge (when the broker's shutdown has not stopped it already)."""
        with contextlib.suppress(RuntimeError):  # its loop is closed: the broker's shutdown stopped it already
            self.loop.call_soon_threadsafe(self.bridge.stop)
        self.thread.join(15)
        assert not self.thread.is_alive() and self._error is None, self._error
