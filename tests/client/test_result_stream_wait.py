"""``ResultStream.next_within``: the next result, or ``None`` once a bounded wait ends without one (a consumer
that keeps a progress line current while jobs run for minutes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prorl_cli.exceptions import ResultTimeout
from tests.harness import Deployment, one_node_deployment


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    yield from one_node_deployment(tmp_path_factory, "wait")


def test_a_bounded_wait_without_a_result_returns_none_and_the_stream_goes_on(deployment: Deployment) -> None:
    client = deployment.client
    (hung,) = client.submit("test", [{"hang_in": "run"}], timeout_s=120)
    (quick,) = client.submit("test", [{"echo": "quick"}])
    with client.results([hung, quick], timeout_s=120) as stream:
        first = stream.next_within(None)  # waits as next(stream) does
        assert first is not None and first.job_id == quick
        assert stream.next_within(0.0) is None  # the hung job has not ended: nothing, and no error
        assert stream.pending == {hung}
        client.cancel([hung])
        last = stream.next_within(None)
        assert last is not None and (last.job_id, last.state) == (hung, "cancelled")
        with pytest.raises(StopIteration):
            stream.next_within(0.0)


def test_the_streams_own_timeout_still_raises_within_a_longer_wait(deployment: Deployment) -> None:
    client = deployment.client
    (hung,) = client.submit("test", [{"hang_in": "run"}], timeout_s=120)
    try:
        with client.results([hung], timeout_s=0.01) as stream, pytest.raises(ResultTimeout, match="still missing"):
            stream.next_within(600.0)
    finally:
        client.cancel([hung])
        assert client.result(hung, timeout_s=60).state == "cancelled"
