"""ResultStream on its own, against a stand-in client: what it asks the client to watch, and when."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

from prorl_cli.client.results import ResultStream
from prorl_cli.exceptions import BrokerUnavailable
from prorl_cli.protocol import JobResult


class _Client:
    """What a stream uses of ``AsyncRolloutClient``; ``_watch`` fails ``failures`` times, then the broker
    pushes each watched job's result."""

    def __init__(self, failures: int) -> None:
        self._streams: list[ResultStream] = []
        self._results: dict[str, JobResult] = {}
        self.failures = failures
        self.asked: list[list[str]] = []
        self.closed = False

    def _check_loop(self) -> None:
        """One loop here: nothing to refuse."""

    async def _watch(self, job_ids: Iterable[str]) -> None:
        ids = list(job_ids)
        self.asked.append(ids)
        if self.failures:
            self.failures -= 1
            raise BrokerUnavailable("no reply from the broker")
        for job_id in ids:
            result = JobResult(job_id=job_id, task="test", state="succeeded")
            self._results[job_id] = result
            for stream in self._streams:
                stream._offer(result)


def test_ids_a_failed_watch_did_not_watch_are_watched_by_the_next_call() -> None:
    async def main() -> list[str]:
        client = _Client(failures=1)
        stream = ResultStream(client, ["a", "b"], timeout_s=10)  # type: ignore[arg-type]  # a stand-in
        with pytest.raises(BrokerUnavailable):
            await stream.__anext__()
        got = [(await stream.__anext__()).job_id, (await stream.__anext__()).job_id]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        assert client.asked == [["a", "b"], ["a", "b"]]
        return got

    got: Any = asyncio.run(main())
    assert sorted(got) == ["a", "b"]
