"""The bridge's admission to its engine: capacity, first come first served, cancels, weight loads.

The real :class:`InferenceBridge` handling the broker's messages in this
process's event loop; what it would send to the broker is collected instead
(the end-to-end paths through a real broker are in test_e2e, test_routing
and test_weight_sync). The engine holds each call until the test lets it go,
so every ordering here is forced, not timed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from prorl_cli.inference.bridge import InferenceBridge
from prorl_cli.inference.contract import Engine, Generation
from prorl_cli.protocol import Op, SamplingParams, pack_tokens


class HeldEngine(Engine):
    """Each call waits for its own release; records which calls entered, at most how many at once, and cancels."""

    model = "held"
    max_model_len = 1024

    def __init__(self) -> None:
        self.entered: list[int] = []
        self.cancelled: list[int] = []
        self.inside = 0
        self.most_inside = 0
        self.release: dict[int, asyncio.Event] = {}
        self.reloads: list[int] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        tag = prompt_ids[0]
        self.entered.append(tag)
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        try:
            await self.release.setdefault(tag, asyncio.Event()).wait()
        except asyncio.CancelledError:
            self.cancelled.append(tag)
            raise
        finally:
            self.inside -= 1
        return Generation([tag], [-0.5], "stop", None)

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        assert self.inside == 0, "weights loaded under a call in flight"
        self.reloads.append(policy_version)


class Harness:
    def __init__(self, capacity: int) -> None:
        self.engine = HeldEngine()
        self.bridge = InferenceBridge(self.engine, address="tcp://127.0.0.1:1", backend_id="b1", host="h", capacity=capacity)
        self.sent: list[dict[str, Any]] = []
        self.on_send: Any = None

        async def send(header: dict[str, Any], payload: Any = ()) -> None:
            self.sent.append(header)
            if self.on_send is not None:
                self.on_send(header)

        self.bridge.send = send  # type: ignore[method-assign]
        self.background: list[asyncio.Task[Any]] = []

        def spawn(coro: Any) -> asyncio.Task[Any]:
            self.background.append(asyncio.ensure_future(coro))
            return self.background[-1]

        self.bridge.spawn = spawn  # type: ignore[method-assign]

    def generate(self, tag: int) -> None:
        header = {"op": "generate", "rid": tag, "job_id": f"job{tag}", "sampling": {"max_tokens": 4}}
        self.bridge.on_message(Op.GENERATE, header, [pack_tokens([tag, 1, 2])])

    def cancel(self, tag: int) -> None:
        self.bridge.on_message(Op.GENERATE_CANCEL, {"op": "generate_cancel", "rid": tag, "job_id": f"job{tag}"}, [])

    def release(self, tag: int) -> None:
        self.engine.release.setdefault(tag, asyncio.Event()).set()

    def replies(self) -> list[Any]:
        return [h["rid"] for h in self.sent if h["op"] == "generate_reply"]

    async def settle(self) -> None:
        for _ in range(20):
            await asyncio.sleep(0)


def run(coro: Any) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_calls_beyond_capacity_wait_their_turn_first_come_first_served() -> None:
    async def main() -> None:
        h = Harness(capacity=2)
        for tag in (1, 2, 3, 4):
            h.generate(tag)
        await h.settle()
        assert h.engine.entered == [1, 2]
        h.release(2)
        await h.settle()
        assert h.engine.entered == [1, 2, 3] and h.replies() == [2]
        for tag in (1, 3, 4):
            h.release(tag)
        await h.settle()
        assert h.engine.entered == [1, 2, 3, 4] and sorted(h.replies()) == [1, 2, 3, 4]
        assert h.engine.most_inside == 2 and h.bridge._serving == 0 and not h.bridge._generating

    run(main())


def test_a_call_cancelled_while_waiting_never_reaches_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        h = Harness(capacity=1)
        h.generate(1)
        h.generate(2)
        await h.settle()
        h.cancel(2)
        await h.settle()
        h.release(1)
        h.generate(3)
        h.release(3)
        await h.settle()
        assert h.engine.entered == [1, 3] and h.replies() == [1, 3]  # 2 never ran, and its place was not lost
        assert h.bridge._serving == 0 and not h.bridge._generating

    with caplog.at_level(logging.INFO, logger="prorl_cli.inference.bridge"):
        run(main())
    assert "generate for job job2 cancelled before it reached the engine" in caplog.text


def test_a_cancel_that_lands_before_the_call_started_never_submits_it() -> None:
    """The broker routes and cancels back to back: both messages arrive in one read, before the call's task ran."""

    async def main() -> None:
        h = Harness(capacity=4)
        h.generate(1)
        h.cancel(1)
        await h.settle()
        assert h.engine.entered == [] and h.replies() == [] and not h.bridge._generating and h.bridge._serving == 0

    run(main())


def test_a_call_cancelled_in_the_engine_is_cancelled_there(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        h = Harness(capacity=1)
        h.generate(1)
        await h.settle()
        h.cancel(1)
        await h.settle()
        assert h.engine.cancelled == [1] and h.replies() == [] and h.bridge._serving == 0

    with caplog.at_level(logging.INFO, logger="prorl_cli.inference.bridge"):
        run(main())
    assert "generate for job job1 cancelled in the engine" in caplog.text


def test_a_waiter_cancelled_as_its_turn_comes_hands_the_place_on() -> None:
    async def main() -> None:
        h = Harness(capacity=1)
        for tag in (1, 2, 3):
            h.generate(tag)
        await h.settle()

        def cancel_two(header: dict[str, Any]) -> None:
            if header.get("rid") == 1:  # call 1 has left the engine and admitted call 2, which has not run yet
                assert h.bridge._serving == 1 and h.engine.entered == [1]
                h.cancel(2)

        h.on_send = cancel_two
        h.release(1)
        await h.settle()
        assert h.engine.entered == [1, 3]
        h.release(3)
        await h.settle()
        assert h.replies() == [1, 3] and h.bridge._serving == 0

    run(main())


def test_weights_load_between_calls_and_new_calls_wait_for_them() -> None:
    async def main() -> None:
        h = Harness(capacity=4)
        h.generate(1)
        await h.settle()
        h.bridge.on_message(Op.UPDATE_WEIGHTS, {"op": "update_weights", "rid": 99, "checkpoint": "/ckpt", "policy_version": 7}, [])
        await h.settle()
        h.generate(2)
        await h.settle()
        assert h.engine.reloads == [] and h.engine.entered == [1]  # 1 keeps the old weights; 2 waits for the new
        h.release(1)
        await h.settle()
        assert h.engine.reloads == [7] and h.engine.entered == [1, 2]
        h.release(2)
        await h.settle()
        versions = {h_["rid"]: h_.get("policy_version") for h_ in h.sent if h_["op"] == "generate_reply"}
        assert versions == {1: None, 2: 7}
        assert [x["rid"] for x in h.sent if x["op"] == "weights_updated"] == [99]

    run(main())


def test_malformed_calls_are_answered_naming_the_field_and_the_bridge_serves_on() -> None:
    """Each forwarded op is checked once (its typed header); a bad one is answered, never run, never fatal."""

    async def main() -> None:
        h = Harness(capacity=1)
        bad_generates: list[tuple[dict[str, Any], list[bytes]]] = [
            ({"op": Op.GENERATE, "rid": 10, "job_id": "j", "sampling": {"temperature": "hot"}}, [pack_tokens([10])]),
            ({"op": Op.GENERATE, "rid": 11, "sampling": {}}, [pack_tokens([11])]),
            ({"op": Op.GENERATE, "rid": 12, "job_id": "j"}, [pack_tokens([12]), pack_tokens([12])]),
            ({"op": Op.GENERATE, "rid": 13, "job_id": "j", "sampling": {"max_tokens": -1}}, [pack_tokens([13])]),
        ]
        for header, payload in bad_generates:
            h.bridge.on_message(Op.GENERATE, header, payload)
        h.bridge.on_message(Op.UPDATE_WEIGHTS, {"op": Op.UPDATE_WEIGHTS, "rid": 20, "checkpoint": "/x",
                                                "policy_version": "one"}, [])
        h.bridge.on_message(Op.GENERATE_CANCEL, {"op": Op.GENERATE_CANCEL, "rid": [1]}, [])
        await h.settle()
        errors = {m["rid"]: m["error"]["message"] for m in h.sent if "error" in m}
        assert set(errors) == {10, 11, 12, 13, 20}
        assert "temperature" in errors[10] and "job_id" in errors[11] and "payload" in errors[12]
        assert "max_tokens" in errors[13] and "policy_version" in errors[20]
        assert h.engine.entered == [] and h.engine.reloads == [] and not h.bridge._generating
        h.generate(1)
        h.release(1)
        await h.settle()
        assert h.engine.entered == [1] and h.replies()[-1] == 1

    run(main())


def test_a_reload_that_crashes_in_the_engine_is_answered_naming_it_and_calls_go_on() -> None:
    """An unexpected error from the engine's loader (a torn checkpoint) still answers weights_updated."""

    class BrokenLoader(HeldEngine):
        async def reload(self, checkpoint: str, policy_version: int) -> None:
            raise KeyError("model.embed_tokens.weight")

    async def main() -> None:
        h = Harness(capacity=2)
        h.bridge.engine = h.engine = BrokenLoader()
        h.bridge.on_message(Op.UPDATE_WEIGHTS, {"op": "update_weights", "rid": 99, "checkpoint": "/ckpt",
                                                "policy_version": 7}, [])
        await h.settle()
        (answer,) = [x for x in h.sent if x["op"] == "weights_updated"]
        assert answer["rid"] == 99 and answer["error"]["code"] == "reload_failed"
        assert "KeyError" in answer["error"]["message"] and "embed_tokens" in answer["error"]["message"]
        assert h.bridge.policy_version is None
        h.generate(1)  # serving goes on, on the old weights
        h.release(1)
        await h.settle()
        assert h.replies() == [1]

    run(main())


def test_an_error_message_too_long_for_the_protocol_is_cut_so_the_broker_takes_the_reply() -> None:
    """A server's message may echo a whole request: the reply must still pass the broker's check, or the call
    would go unanswered until its timeout."""
    from prorl_cli import protocol as P
    from prorl_cli.exceptions import InferenceError

    class Verbose(HeldEngine):
        async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
            raise InferenceError("HTTP 400: invalid request: " + "x" * 100_000)

    async def main() -> None:
        h = Harness(capacity=1)
        h.bridge.engine = h.engine = Verbose()
        h.generate(1)
        await h.settle()
        (reply,) = [x for x in h.sent if x["op"] == "generate_reply"]
        checked = P.parse(P.decode_header(P.encode(reply)[0]), 0)  # as the broker reads it: no ProtocolError
        assert checked.error["message"].startswith("backend b1: HTTP 400: invalid request: xxx")
        assert "more characters cut" in checked.error["message"]

    run(main())
