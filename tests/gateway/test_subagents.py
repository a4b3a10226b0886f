"""A main agent and a sub-agent interleaving their calls in one job, through the official openai SDK.

Each conversation extends its own token buffer whatever order the calls come
in: per-conversation continuity 1.0, one segment per conversation, one merged
sample per conversation, every call labelled with the agent that made it (by
its URL or by the ``X-Prorl-Agent`` header), and a trainer that picks one agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from prorl_cli.agent import Trajectory
from prorl_cli.gateway.server import Gateway
from prorl_cli.protocol import JobResult
from prorl_cli.training.samples import build_samples, samples_from_results
from tests.gateway.conftest import ScriptedModel, open_job
from tests.harness import need_module

TURNS = ["first", "second", "third"]


class Barrier(ScriptedModel):
    """Holds the first calls until ``n`` are in flight: it answers only if they run concurrently."""

    def __init__(self, tok: Any, n: int) -> None:
        super().__init__(tok, TURNS)
        self.n = n
        self.waiting = 0
        self.all_in = asyncio.Event()

    async def __call__(self, prompt_ids: list[int], sampling: Any) -> Any:
        self.waiting += 1
        if self.waiting >= self.n:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 60)  # a gateway that serialises a job never gets here
        return await super().__call__(prompt_ids, sampling)


@contextlib.asynccontextmanager
async def _served(tokenizer: Any, model: Any, **job_options: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A started gateway with one job answering from ``model``, and an openai client of it; both closed after."""
    import openai

    gw = Gateway()
    await gw.start()
    job = open_job(gw, tokenizer, model, **job_options)
    client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0)
    try:
        yield job, client
    finally:
        await client.close()
        await gw.close()


def test_interleaved_main_and_sub_agent_conversations_stay_token_exact_and_labelled(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> tuple[Trajectory, Any]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, TURNS))
        # The main agent names itself by its base URL, the sub-agent by a header.
        lead = openai.AsyncOpenAI(base_url=job.base_url().replace("/v1", "/agents/lead/v1"), api_key=job.api_key,
                                  max_retries=0)
        helper = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0,
                                    default_headers={"X-Prorl-Agent": "researcher"})
        convs: dict[str, list[Any]] = {
            "lead": [{"role": "system", "content": "You lead."}, {"role": "user", "content": "plan"}],
            "researcher": [{"role": "system", "content": "You research."}, {"role": "user", "content": "look"}],
        }
        clients = {"lead": lead, "researcher": helper}
        try:
            for who in ("lead", "researcher", "lead", "researcher", "researcher", "lead"):
                resp = await clients[who].chat.completions.create(model="prorl", messages=convs[who])
                convs[who] += [{"role": "assistant", "content": resp.choices[0].message.content},
                               {"role": "user", "content": "go on"}]
            return job.trajectory, job.buffer
        finally:
            await lead.close()
            await helper.close()
            await gw.close()

    traj, buffer = asyncio.run(main())
    agents = [c.agent for c in traj.calls]
    assert agents == ["lead", "researcher", "lead", "researcher", "researcher", "lead"]
    assert [c.segment for c in traj.calls] == [0, 1, 0, 1, 1, 0]
    assert len(buffer.segments) == 2 and traj.violations == [] and traj.token_exact
    assert buffer.continuity == 1.0 and buffer.continuity_by_conversation() == {0: 1.0, 1: 1.0}
    # Each conversation merges into one sample; a trainer can pick one agent.
    samples, report = build_samples(traj.to_dict(), rollout_id="r", group_id="g", reward=1.0)
    # Every call after its agent's first merges: the merge ratio counts no boundary at a conversation's first call.
    assert [s.agent for s in samples] == ["lead", "researcher"] and report.samples == 2 and report.merge_ratio == 1.0
    assert [s.calls for s in samples] == [[0, 2, 5], [1, 3, 4]]
    results = [JobResult(job_id=j, task="harness", state="done", reward=r, group_id="g",
                         output={"trajectory": traj.to_dict()}) for j, r in (("a", 1.0), ("b", 0.0))]
    everyone = samples_from_results(results)
    research = samples_from_results(results, agents=["researcher"])
    assert {s.agent for s in research.samples} == {"researcher"} and len(research.samples) == 2
    by_job = {s.job_id: s.advantage for s in everyone.samples}
    assert all(s.advantage == by_job[s.job_id] for s in research.samples)  # rollout-level advantage, unchanged


def test_an_edit_of_one_conversation_is_a_violation_and_a_new_conversation_is_not(tokenizer: Any) -> None:
    need_module("openai", "test")

    async def main() -> Trajectory:
        a: list[Any] = [{"role": "system", "content": "A."}, {"role": "user", "content": "one"}]
        b: list[Any] = [{"role": "system", "content": "B."}, {"role": "user", "content": "other"}]
        async with _served(tokenizer, ScriptedModel(tokenizer, TURNS)) as (job, client):
            first = await client.chat.completions.create(model="prorl", messages=a)
            a += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "two"}]
            await client.chat.completions.create(model="prorl", messages=b)  # another conversation
            # The same system prompt and task, the reply rewritten: an edit of conversation A.
            await client.chat.completions.create(model="prorl", messages=[a[0], a[1], {"role": "assistant", "content": "edited"},
                                                                         a[3]])
            return job.trajectory

    traj = asyncio.run(main())
    assert [c.segment for c in traj.calls] == [0, 1, 2]
    assert [c.prefix_ok for c in traj.calls] == [True, True, False]
    (v,) = traj.violations
    assert v["call"] == 2 and v["segment"] == 2


def test_an_agent_name_that_is_not_printable_or_too_long_is_refused_naming_it(tokenizer: Any) -> None:
    need_module("openai", "test")
    import openai

    async def main() -> list[str]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, ScriptedModel(tokenizer, TURNS))
        errors = []
        try:
            for headers in ({"X-Prorl-Agent": "x" * 129}, {"X-Prorl-Agent": "tab\there"}):
                client = openai.AsyncOpenAI(base_url=job.base_url(), api_key=job.api_key, max_retries=0,
                                            default_headers=headers)
                try:
                    await client.chat.completions.create(model="prorl", messages=[{"role": "user", "content": "hi"}])
                except openai.BadRequestError as e:
                    errors.append(str(e))
                finally:
                    await client.close()
            return errors
        finally:
            await gw.close()

    errors = asyncio.run(main())
    assert len(errors) == 2 and all("X-Prorl-Agent" in e for e in errors), errors


def _parallel_conversations(tokenizer: Any, n: int, model: Any, max_concurrent: int) -> tuple[Trajectory, Any]:
    """``n`` sub-agents (each named by its URL) talk at once through the openai SDK, two turns each."""
    import openai

    async def main() -> tuple[Trajectory, Any]:
        gw = Gateway()
        await gw.start()
        job = open_job(gw, tokenizer, model, max_concurrent=max_concurrent)
        clients = [openai.AsyncOpenAI(base_url=job.base_url().replace("/v1", f"/agents/sub{i}/v1"),
                                      api_key=job.api_key, max_retries=0) for i in range(n)]

        async def converse(i: int) -> None:
            messages: list[Any] = [{"role": "system", "content": "You help."}, {"role": "user", "content": f"task {i}"}]
            for _ in range(2):
                resp = await clients[i].chat.completions.create(model="prorl", messages=messages)
                messages += [{"role": "assistant", "content": resp.choices[0].message.content},
                             {"role": "user", "content": "go on"}]

        try:
            await asyncio.gather(*(converse(i) for i in range(n)))
            return job.trajectory, job.buffer
        finally:
            for c in clients:
                await c.close()
            await gw.close()

    return asyncio.run(main())


def _each_conversation_is_token_exact(traj: Trajectory, buffer: Any, n: int) -> None:
    assert sorted(c.agent for c in traj.calls) == sorted(f"sub{i}" for i in range(n) for _ in range(2))
    assert len(buffer.segments) == n and traj.violations == [] and traj.token_exact
    assert buffer.continuity_by_conversation() == dict.fromkeys(range(n), 1.0)
    for seg in range(n):  # each conversation's second call extends its own first one token for token
        first, second = [c for c in traj.calls if c.segment == seg]
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids


def test_eight_parallel_sub_agents_are_answered_at_once_and_each_stays_token_exact(tokenizer: Any) -> None:
    """Eight conversations with a call in flight together: the model sees all eight before it answers any."""
    need_module("openai", "test")
    traj, buffer = _parallel_conversations(tokenizer, 8, Barrier(tokenizer, 8), max_concurrent=8)
    _each_conversation_is_token_exact(traj, buffer, 8)


def test_a_jobs_bound_on_requests_at_once_holds_and_every_request_is_answered(tokenizer: Any) -> None:
    need_module("openai", "test")
    from prorl_cli.inference.contract import Generation

    class Counting(ScriptedModel):
        def __init__(self, tok: Any) -> None:
            super().__init__(tok, TURNS)
            self.inflight = self.peak = 0

        async def __call__(self, prompt_ids: list[int], sampling: Any) -> Generation:
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            try:
                for _ in range(20):  # give the other requests every chance to come in meanwhile
                    await asyncio.sleep(0)
                return await super().__call__(prompt_ids, sampling)
            finally:
                self.inflight -= 1

    model = Counting(tokenizer)
    traj, buffer = _parallel_conversations(tokenizer, 8, model, max_concurrent=2)
    assert model.peak <= 2
    _each_conversation_is_token_exact(traj, buffer, 8)


def _ask(tokenizer: Any, requests: list[list[Any]], *, together: bool) -> tuple[Trajectory, Any]:
    """Each request once, through the openai SDK: one after another, or all at once (the model then holds
    every call until all are in, so the gateway sees each conversation's first call still in flight)."""
    need_module("openai", "test")

    async def main() -> tuple[Trajectory, Any]:
        model = Barrier(tokenizer, len(requests)) if together else ScriptedModel(tokenizer, TURNS)
        async with _served(tokenizer, model, max_concurrent=8) as (job, client):
            if together:
                await asyncio.gather(*(client.chat.completions.create(model="prorl", messages=m) for m in requests))
            else:
                for m in requests:
                    await client.chat.completions.create(model="prorl", messages=m)
            return job.trajectory, job.buffer

    return asyncio.run(main())


SHARED = {"role": "system", "content": "You are a focused sub-agent."}


def test_sub_agents_sharing_a_system_prompt_are_conversations_whether_asked_in_turn_or_at_once(tokenizer: Any) -> None:
    """The agent-as-tool pattern: one system prompt, a task each. Neither order makes them edits."""
    tasks = [[SHARED, {"role": "user", "content": f"task {i}"}] for i in range(3)]
    for together in (False, True):
        traj, buffer = _ask(tokenizer, tasks, together=together)
        assert traj.violations == [], together
        assert sorted(c.segment for c in traj.calls) == [0, 1, 2] and buffer.conversations == 3
        assert buffer.continuity == 1.0


def test_the_same_request_asked_again_is_recorded_alike_in_turn_or_at_once(tokenizer: Any) -> None:
    """A retry or a second sample of one turn (n > 1 is refused): a violation either way, never by timing."""
    same = [[SHARED, {"role": "user", "content": "the task"}]] * 3
    verdicts = []
    for together in (False, True):
        traj, buffer = _ask(tokenizer, same, together=together)
        assert len(traj.violations) == 2 and buffer.conversations == 3, together
        verdicts.append(sorted(c.prefix_ok for c in traj.calls))
    assert verdicts[0] == verdicts[1] == [False, False, True]


def test_a_repeated_request_is_named_as_one_in_its_violation(tokenizer: Any) -> None:
    """A retry, or best-of-k by asking the same turn again: the reason names the call first asked it, not a
    count of messages; which calls count as violations, and the continuity, are as before."""
    need_module("openai", "test")
    task: list[Any] = [SHARED, {"role": "user", "content": "the task"}]

    async def main() -> tuple[Trajectory, Any]:
        async with _served(tokenizer, ScriptedModel(tokenizer, TURNS)) as (job, client):
            first = await client.chat.completions.create(model="prorl", messages=task)
            follow = [*task, {"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "go on"}]
            for messages in (follow, follow, follow, follow[:3], task):
                await client.chat.completions.create(model="prorl", messages=messages)
            return job.trajectory, job.buffer

    traj, buffer = asyncio.run(main())
    assert [c.prefix_ok for c in traj.calls] == [True, True, False, False, False, False]
    assert buffer.continuity == 0.2
    assert [v["call"] for v in traj.violations] == [2, 3, 4, 5]
    retry, again, cut, task_again = (v["reason"] for v in traj.violations)
    assert retry == again == "the same messages as call 1 (4 message(s)): a retry, or another sample of it"
    assert task_again == "the same messages as call 0 (2 message(s)): a retry, or another sample of it"
    # A prefix no call asked (the task and the first reply): the later messages were dropped.
    assert cut == "the request's 3 message(s) are the first of the 5 of the conversation so far: the later ones " \
                  "were dropped"


def test_a_conversation_whose_first_call_never_came_back_is_not_counted(tokenizer: Any) -> None:
    need_module("openai", "test")

    from prorl_cli.inference.contract import Generation

    class Held(ScriptedModel):
        """Each call waits for the gate; ``gave_up`` is set when a held call is cancelled."""

        def __init__(self, tok: Any) -> None:
            super().__init__(tok, TURNS)
            self.gate = asyncio.Event()
            self.gave_up = asyncio.Event()

        async def __call__(self, prompt_ids: list[int], sampling: Any) -> Generation:
            try:
                return await super().__call__(prompt_ids, sampling)
            except asyncio.CancelledError:
                self.gave_up.set()
                raise

    async def main() -> tuple[Trajectory, Any]:
        model = Held(tokenizer)
        async with _served(tokenizer, model, max_concurrent=8) as (job, client):
            # A's first call is held at the model; the client gives up on it, as on a timeout.
            a = asyncio.ensure_future(client.chat.completions.create(
                model="prorl", messages=[{"role": "system", "content": "A."}, {"role": "user", "content": "a"}]))
            await asyncio.wait_for(model.entered.wait(), 60)
            model.entered.clear()
            b = asyncio.ensure_future(client.chat.completions.create(
                model="prorl", messages=[{"role": "system", "content": "B."}, {"role": "user", "content": "b"}]))
            await asyncio.wait_for(model.entered.wait(), 60)  # B's first call is in flight behind A's
            a.cancel()
            await asyncio.wait_for(model.gave_up.wait(), 60)
            model.gate.set()
            await b
            return job.trajectory, job.buffer

    traj, buffer = asyncio.run(main())
    assert [c.segment for c in traj.calls] == [1] and traj.violations == []
    assert buffer.conversations == 1  # segment 0 left no call: not a conversation


def test_an_agent_name_that_changes_per_request_is_warned_of_once(tokenizer: Any, caplog: Any) -> None:
    """A tracing wrapper that sets OpenAI's ``user`` to a fresh id per call splits one conversation per call:
    the record stays right (each is a conversation of its own), and the log says why, once."""
    need_module("openai", "test")
    import logging


    async def main() -> Trajectory:
        conv: list[Any] = [{"role": "system", "content": "S."}, {"role": "user", "content": "go"}]
        async with _served(tokenizer, ScriptedModel(tokenizer, TURNS)) as (job, client):
            for i in range(3):
                resp = await client.chat.completions.create(model="prorl", messages=conv, user=f"req-{i}")
                conv += [{"role": "assistant", "content": resp.choices[0].message.content},
                         {"role": "user", "content": "more"}]
            return job.trajectory

    with caplog.at_level(logging.WARNING, logger="prorl_cli.gateway.buffer"):
        traj = asyncio.run(main())
    assert [c.segment for c in traj.calls] == [0, 1, 2] and traj.violations == []
    warned = [r.getMessage() for r in caplog.records if "splits one conversation" in r.getMessage()]
    assert len(warned) == 1 and "agent 'req-1' extends agent 'req-0'" in warned[0]
