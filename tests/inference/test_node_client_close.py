"""A stopping node closes the connections of the HTTP backends its jobs called."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_cli.inference.node_client import NodeInference
from prorl_cli.inference.settings import InferenceConfig


async def _no_broker(*_: Any, **__: Any) -> Any:
    raise AssertionError("no broker request expected")


def test_closing_the_node_inference_closes_its_http_backends_sessions() -> None:
    pytest.importorskip("aiohttp", reason="HTTP backends need aiohttp (pip install 'prorl[http]')")

    async def go() -> tuple[list[Any], dict[str, Any]]:
        inference = NodeInference(_no_broker, InferenceConfig(), "127.0.0.1")
        engines = [inference._http_engine(f"http://127.0.0.1:{port}/v1", None) for port in (9, 10)]
        sessions = [engine.http._get_session() for engine in engines]  # what a first call opens
        assert not any(s.closed for s in sessions)
        await inference.close()
        return sessions, inference._http

    sessions, left = asyncio.run(go())
    assert all(s.closed for s in sessions)
    assert left == {}
