"""OpenAI-compatible HTTP servers as backends: ``add_llm_server``, ``clear_llm_server``, ``list_llm_servers``.

The router (``broker/routing.py``) owns one :class:`HttpServers` over its
backend table. A call routed to an HTTP backend is answered with a redirect
(the node calls the server itself); the broker cannot reload such a server's
weights. Rules: clearing a server stops new jobs going to it, and it is
dropped once no job and no call uses it; adding it again brings it back.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import Any

from prorl_cli import protocol as P
from prorl_cli import timebase
from prorl_cli.broker.backends import Backend
from prorl_cli.broker.state import SendFn
from prorl_cli.protocol import ErrorCode, Op
from prorl_cli.protocol import headers as H

log = logging.getLogger(__name__)


class HttpServers:
    """The HTTP-backend ops on the router's backend table (``handlers``) and the pruning of cleared ones."""

    def __init__(
        self,
        send: SendFn,
        backends: dict[str, Backend],
        inflight: Callable[[Backend], int],
        statuses: Callable[[], list[P.BackendStatus]],
        release_held: Callable[[], None],
    ) -> None:
        self._send = send
        self._backends = backends
        self._inflight = inflight
        self._statuses = statuses
        self._release_held = release_held
        self.handlers: dict[Op, Callable[[bytes, Any, list[bytes]], None]] = {
            Op.ADD_LLM_SERVER: self.on_add_llm_server,
            Op.CLEAR_LLM_SERVER: self.on_clear_llm_server,
            Op.LIST_LLM_SERVERS: self.on_list_llm_servers,
        }

    def on_add_llm_server(self, identity: bytes, h: H.AddLlmServer, payload: list[bytes]) -> None:
        url = h.url.rstrip("/")
        backend = self._backends.get(url)
        if backend is None or not backend.alive:
            host = urllib.parse.urlsplit(url).hostname or url  # the schema checked it has one
            backend = Backend(backend_id=url, kind="http", url=url, host=host, model=h.model)
            self._backends[url] = backend
        elif h.model is not None:
            backend.model = h.model  # added again naming another model (an adapter): calls name it from now on
        backend.cleared = False
        backend.note_answer()  # added again: the operator says it serves, so a rest it was in ends
        self._send(identity, P.reply(h.rid, backend=backend.status(self._inflight(backend), timebase.now()).to_wire()), ())
        self._release_held()

    def on_clear_llm_server(self, identity: bytes, h: H.ClearLlmServer, payload: list[bytes]) -> None:
        url = h.url
        targets = [b for b in self._backends.values() if url is None or b.backend_id == url.rstrip("/")]
        if url is not None and not targets:
            log.warning("error to %r (rid %r): no backend %r", identity, h.rid, url)
            self._send(identity, P.error_reply(h.rid, ErrorCode.BAD_FIELD, f"no backend {url!r}"), ())
            return
        for b in targets:
            b.cleared = True  # no new jobs; jobs already routed here keep it
        self.prune()
        self._send(identity, P.reply(h.rid, cleared=[b.backend_id for b in targets]), ())

    def on_list_llm_servers(self, identity: bytes, h: H.Request, payload: list[bytes]) -> None:
        self._send(identity, P.reply(h.rid, backends=[s.to_wire() for s in self._statuses()]), ())

    def prune(self) -> None:
        """Drop cleared HTTP backends that no job and no call uses any more."""
        for b in [b for b in self._backends.values()
                  if b.kind == "http" and b.cleared and not b.jobs and not self._inflight(b)]:
            del self._backends[b.backend_id]
