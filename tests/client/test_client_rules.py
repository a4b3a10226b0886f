"""Where a client works and where it refuses, naming the rule (real broker, node and clients)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from prorl_cli.client import AsyncRolloutClient, RolloutClient
from prorl_cli.exceptions import ClientMisuse, ProrlError, ProtocolError, ResultTimeout
from prorl_cli.testing.harness import Deployment


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with Deployment(tmp_path_factory.mktemp("rules") / "home", "rules") as d:
        d.start_broker()
        d.start_node("n1")
        yield d


def test_a_client_copied_by_a_fork_refuses_in_the_child_instead_of_hanging(stack: Deployment) -> None:
    client = stack.new_client()
    assert client.status().nodes
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it ends (an alarm if the call hung)
        signal.alarm(30)
        try:
            client.status()
        except ClientMisuse as e:
            if "before a fork" not in str(e):
                os._exit(2)
            try:
                client.close()  # a `with` block left in the child: it lets go, it does not raise
            except BaseException:
                os._exit(5)
            os._exit(0)
        except BaseException:
            os._exit(3)
        os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert client.status().nodes, "the parent's client goes on"
    client.close()


def test_an_async_client_used_in_a_second_event_loop_says_so(stack: Deployment) -> None:
    client = stack.async_client()
    ids = asyncio.run(client.submit("test", [{"echo": 1}]))
    with pytest.raises(ClientMisuse, match="event loop it connected in"):
        asyncio.run(client.wait(ids, timeout_s=30))  # its reader died with the first loop: this waited for ever


def test_a_blocking_client_in_use_by_another_thread_says_so(stack: Deployment) -> None:
    client = stack.new_client()
    (job,) = client.submit("test", [{"sleep_s": {"run": 3.0}}])
    waiter = threading.Thread(target=client.wait, args=([job],), kwargs={"timeout_s": 60})
    waiter.start()
    deadline = time.monotonic() + 30
    while not client._loop.is_running():  # the waiter's call is under way
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ClientMisuse, match="in use by another thread"):
        client.status()
    with pytest.raises(ClientMisuse, match="in use by another thread"):
        client.close()
    waiter.join(60)
    assert client.result(job, timeout_s=10).ok, "the waiter's call was not disturbed"
    client.close()


def test_bad_arguments_are_named(stack: Deployment) -> None:
    with pytest.raises(TypeError, match="request_timeout_s: a number of seconds"):
        RolloutClient("rules", config=stack.load_config(), request_timeout_s="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_timeout_s: must be above 0"):
        AsyncRolloutClient("rules", config=stack.load_config(), request_timeout_s=0)
    client = stack.new_client()
    with pytest.raises(ProtocolError, match=r"instance 1 \('x1'\) cannot be sent"):
        client.submit("test", [{}, {"s": {1, 2}}], job_ids=["x0", "x1"])
    with pytest.raises(ProtocolError, match="max_attempts"):
        client.submit("test", [{}], max_attempts=0)  # was taken for "the default"
    assert not client.list_jobs(prefix="x")
    (job,) = client.submit("test", [{"sleep_s": {"run": 5.0}}])
    with pytest.raises(ResultTimeout) as waited:
        client.result(job, timeout_s=0.2)
    assert isinstance(waited.value, TimeoutError) and isinstance(waited.value, ProrlError)
    with pytest.raises(ResultTimeout):
        client.wait([job], timeout_s=0.2)
    client.request_timeout_s = 7.0
    assert client._aio.request_timeout_s == 7.0, "the setting reaches the requests"
    with client.results([job]) as stream:
        assert stream.ready() == []  # the batching helper, as the async stream has it
        assert next(stream).ok
    client.close()
