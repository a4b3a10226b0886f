"""The README's word on ``LocalStack`` from asyncio code, run as written against a real broker and node."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prorl_cli.embedded import LocalStack
from prorl_cli.exceptions import ClientMisuse


def test_a_local_stack_started_from_asyncio_as_the_readme_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blocking start inside the loop is refused naming the way out; ``asyncio.to_thread`` and
    ``stack.async_client()`` run jobs; the stack's home is its own, whatever ``PRORL_HOME`` says."""
    monkeypatch.setenv("PRORL_HOME", str(tmp_path / "elsewhere"))

    async def main() -> list[tuple[str, float | None]]:
        with LocalStack(tmp_path / "stack", "demo", {"node": {"handler_paths": ["prorl_cli.testing.handlers"]}}) as stack:
            with pytest.raises(ClientMisuse, match=r"await asyncio.to_thread\(stack.start_broker"):
                stack.start_broker()
            await asyncio.to_thread(stack.start_broker)
            await asyncio.to_thread(stack.start_node, "node-0")
            async with stack.async_client() as client:
                ids = await client.submit("test", [{"echo": "hi"}], n=2)
                done = [(r.state, r.reward) async for r in client.as_completed(ids)]
            await asyncio.to_thread(stack.stop)
            return done

    assert sorted(asyncio.run(main())) == [("done", 1.0), ("done", 1.0)]
    assert (tmp_path / "stack").is_dir() and not (tmp_path / "elsewhere").exists()
