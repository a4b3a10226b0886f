"""A discrete-event simulation of a prorl deployment serving one workload, on a simulated clock.

Pure Python, no processes, no wall clock: the same workload and cluster shape
give the same figures to the last digit. What it models:

* ``bridges`` backends, each a continuous-batching engine on the
  :class:`~prorl_cli.inference.sim_engine.SimProfile` GPU model, scheduled as
  :class:`~prorl_cli.inference.sim_engine.SimEngine` schedules: new calls are
  admitted at a step's start up to ``max_num_seqs``; a step with prefill work
  gives every decoding sequence one token and the rest of ``max_batched_tokens``
  to prefill chunks (chunked prefill); without prefill work, decode-only steps
  run until the next sequence finishes (jumped over at once, their cost summed
  in closed form by :meth:`SimProfile.decode_steps_s`), cut short at the step
  boundary after a new call arrives; every step costs :meth:`SimProfile.step_s`;
* a prefix cache per backend, per rollout: a rollout's context (prompt and output
  of its latest call, in full blocks of ``block_tokens``) stays cached on its
  backend, LRU over rollouts within ``kv_budget_tokens``, so a later call
  prefills only what is new, as the engine's chained-hash block cache does for
  a context that grows by appending;
* the broker's routing (``least_loaded_sticky``: a rollout's first call to the
  backend with the fewest live rollouts, then fewest calls in flight, then fewest
  served; its later calls follow) and its KV admission (``broker.kv_admission``:
  a first call waits for a backend whose live rollouts' reservations leave room,
  at most ``kv_admission_max_wait_s``);
* ``nodes x slots`` rollout slots; the sampler keeps ``in_flight`` rollouts
  submitted (a finished one is replaced at once), those beyond the slots queue;
* a rollout holds its slot for ``lead_s``, then alternates a generate call and
  its tool wait, then holds it ``tail_s`` more.

Not modelled: weight-sync pauses, DAPO steps and their early termination,
prompts shared between a group's rollouts, network hops, failures.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from prorl_cli.inference.sim_engine import SimProfile
from prorl_cli.planning.workload import PlanError, RolloutShape, Workload

_STEP_END, _CALL, _END, _ADMIT_TIMEOUT = 0, 1, 2, 3
_IDLE, _MIXED, _DECODE = 0, 1, 2


@dataclass(frozen=True)
class ClusterShape:
    """What is asked of Slurm: inference bridges, and node slots for the rollouts."""

    bridges: int
    gpus_per_bridge: int = 1
    nodes: int = 1
    #: Rollout slots per node (the node's run slots); ``None``: as many as the sampler keeps in flight.
    slots: int | None = None
    #: ``broker.kv_admission``: share of a backend's KV cache its live rollouts may reserve (0: off).
    kv_admission: float = 1.0
    kv_admission_max_wait_s: float = 120.0

    def validate(self) -> None:
        """Reject shapes the simulation cannot run, naming the setting."""
        for name, value in (("bridges", self.bridges), ("gpus_per_bridge", self.gpus_per_bridge), ("nodes", self.nodes)):
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be at least 1, got {value!r}")
        if self.slots is not None and (not isinstance(self.slots, int) or self.slots < 1):
            raise PlanError(f"slots must be at least 1 per node, got {self.slots!r}")
        if not 0 <= self.kv_admission <= 4:
            raise PlanError(f"kv_admission must be a share of the KV cache in [0, 4] (0: off), got {self.kv_admission!r}")
        if self.kv_admission_max_wait_s < 0:
            raise PlanError(f"kv_admission_max_wait_s must be >= 0, got {self.kv_admission_max_wait_s!r}")

    @property
    def gpus(self) -> int:
        return self.bridges * self.gpus_per_bridge


@dataclass(frozen=True)
class SimResult:
    """One simulation's figures, over its measurement window (after the warm-up completions)."""

    in_flight: int
    #: Rollouts completed in the window, and its length (simulated seconds).
    rollouts: int
    window_s: float
    rollouts_per_s: float
    #: Busy share of the backends' time in the window (engine steps running).
    gpu_busy_share: float
    #: Mean seconds from a rollout taking its slot to its end, over the window's rollouts.
    mean_rollout_s: float
    prefix_hit_rate: float
    #: Whole run: simulated seconds and engine steps.
    simulated_s: float
    steps: int


class _Seq:
    __slots__ = ("rollout", "prompt", "output", "to_prefill", "generated")

    def __init__(self, rollout: _Rollout, prompt: int, output: int) -> None:
        self.rollout = rollout
        self.prompt = prompt
        self.output = output
        self.to_prefill = 0
        self.generated = 0


class _Rollout:
    __slots__ = ("rid", "shape", "k", "engine", "started_at", "waiting_since")

    def __init__(self, rid: int, shape: RolloutShape) -> None:
        self.rid = rid
        self.shape = shape
        self.k = 0  # the call it is at
        self.engine: _Engine | None = None
        self.started_at = 0.0
        self.waiting_since: float | None = None  # waiting at the broker for KV room (its first call)


class _RolloutCache:
    """A backend's prefix cache by rollout: full blocks of each rollout's latest context, LRU over rollouts."""

    def __init__(self, block_tokens: int, capacity_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._total = 0

    def lookup(self, rid: int, prompt: int) -> int:
        """Prompt tokens of rollout ``rid`` found cached (it becomes most recently used)."""
        held = self._blocks.get(rid)
        if held is None:
            return 0
        self._blocks.move_to_end(rid)
        return min(held, prompt // self.block_tokens) * self.block_tokens

    def insert(self, rid: int, tokens: int) -> None:
        """Rollout ``rid``'s context is ``tokens`` long; evict least recently used rollouts beyond capacity."""
        new = tokens // self.block_tokens
        self._total += new - self._blocks.pop(rid, 0)
        self._blocks[rid] = new
        while self._total > self.capacity_blocks:
            _, dropped = self._blocks.popitem(last=False)
            self._total -= dropped


class _Engine:
    """One backend: SimEngine's scheduler on the simulated clock (see the module docstring)."""

    def __init__(self, sim: _Simulation, profile: SimProfile) -> None:
        self.sim = sim
        self.p = profile
        self.cache = _RolloutCache(profile.block_tokens, profile.kv_budget_tokens)
        self.running: list[_Seq] = []
        self.waiting: deque[_Seq] = deque()
        self.prefilling = 0
        self.state = _IDLE
        self.version = 0
        self.t0 = 0.0
        self.k = self.m = self.ctx = 0
        self.chunks: list[tuple[_Seq, int]] = []
        self.decoders: list[_Seq] = []
        self.idle_since = 0.0
        self.idle_total = 0.0
        self.prompt_tokens = self.cached_tokens = self.steps = 0
        # The broker's view of this backend.
        self.jobs = self.inflight = self.served = self.kv_load = 0

    def busy_s(self, t: float) -> float:
        """Busy seconds from 0 to ``t`` (the current simulated time): steps run back to back while there is work."""
        return t - self.idle_total - (t - self.idle_since if self.state == _IDLE else 0.0)

    def submit(self, seq: _Seq, t: float) -> None:
        self.waiting.append(seq)
        self.inflight += 1
        if self.state == _IDLE:
            self.idle_total += t - self.idle_since
            self._start(t)
        elif self.state == _DECODE and self.k > 1:
            # The step in progress ends, then the new call is admitted: find that step's boundary.
            lo, hi = 1, self.k
            while lo < hi:
                mid = (lo + hi) // 2
                if self.t0 + self.p.decode_steps_s(self.m, self.ctx, mid) >= t:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < self.k:
                self.k = lo
                self.version += 1
                self.sim.push(self.t0 + self.p.decode_steps_s(self.m, self.ctx, lo), _STEP_END, self, self.version)

    def _start(self, t: float) -> None:
        """Admit waiting calls and start the next step (or batch of decode steps) at ``t``."""
        p = self.p
        while self.waiting and len(self.running) < p.max_num_seqs:
            seq = self.waiting.popleft()
            # The last prompt token is always computed (it yields the first output token).
            cached = min(self.cache.lookup(seq.rollout.rid, seq.prompt), seq.prompt - 1)
            seq.to_prefill = seq.prompt - cached
            self.prefilling += 1
            self.prompt_tokens += seq.prompt
            self.cached_tokens += cached
            self.running.append(seq)
        if not self.running:
            self.state = _IDLE
            self.idle_since = t
            return
        if self.prefilling:
            decoders = [r for r in self.running if r.to_prefill == 0]
            budget = p.max_batched_tokens - len(decoders)
            chunks: list[tuple[_Seq, int]] = []
            for r in self.running:
                if budget <= 0:
                    break
                if r.to_prefill:
                    take = min(r.to_prefill, budget)
                    chunks.append((r, take))
                    budget -= take
            self.chunks, self.decoders = chunks, decoders
            dur = p.step_s(sum(n for _, n in chunks), len(decoders), sum(r.prompt + r.generated for r in decoders))
            self.state = _MIXED
        else:
            # With calls waiting for a batch place, SimEngine steps one at a time, but no call is admitted
            # before one finishes: the same steps as one batch.
            self.k = min(r.output - r.generated for r in self.running)
            self.m = len(self.running)
            self.ctx = sum(r.prompt + r.generated for r in self.running)
            dur = p.decode_steps_s(self.m, self.ctx, self.k)
            self.state = _DECODE
        self.t0 = t
        self.version += 1
        self.sim.push(t + dur, _STEP_END, self, self.version)

    def step_end(self, t: float, version: int) -> None:
        if version != self.version:
            return  # a decode batch cut short: this end was replaced
        if self.state == _MIXED:
            decoders = self.decoders
            for r, n in self.chunks:
                r.to_prefill -= n
                if r.to_prefill == 0:
                    self.prefilling -= 1
                    self.cache.insert(r.rollout.rid, r.prompt)
                    decoders.append(r)  # its last prefill token yields the first output token
            self.steps += 1
            self._emit(decoders, 1, t)
        else:
            self.steps += self.k
            self._emit(self.running, self.k, t)
        self._start(t)

    def _emit(self, decoders: list[_Seq], n: int, t: float) -> None:
        finished = []
        for r in decoders:
            r.generated += n
            if r.generated >= r.output:
                finished.append(r)
        if finished:
            self.running = [r for r in self.running if r.generated < r.output]
            for r in finished:
                # What it wrote is in KV too: the next turn's prompt extends it.
                self.cache.insert(r.rollout.rid, r.prompt + r.output)
                self.inflight -= 1
                self.sim.call_done(r.rollout, t)


class _Simulation:
    """The event loop: engines, the broker's routing and admission, slots and the sampler."""

    def __init__(self, workload: Workload, profile: SimProfile, cluster: ClusterShape, in_flight: int,
                 seed: int = 0) -> None:
        # A results file lists rollouts in the order they ended, the quickest of each burst first: replayed in
        # that order, a simulation shorter than the file would see only its quick ones. A seeded shuffle makes
        # any stretch of the replay a fair sample of the file (a description's draws are independent anyway).
        self.shapes = list(workload.shapes)
        random.Random(seed).shuffle(self.shapes)
        self.cluster = cluster
        self.engines = [_Engine(self, profile) for _ in range(cluster.bridges)]
        self.kv_capacity = profile.kv_budget_tokens
        self.in_flight = in_flight
        self.slots = in_flight if cluster.slots is None else cluster.nodes * cluster.slots
        self.free_slots = self.slots
        self.queued: deque[_Rollout] = deque()  # submitted, waiting for a slot
        self.admission_wait: list[_Rollout] = []  # first calls waiting for KV room, in arrival order
        self.mean_call_tokens = 0.0
        self.calls_routed = 0
        self.reserved: dict[int, tuple[_Engine, int]] = {}
        self.submitted = 0
        self.completed = 0
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.now = 0.0

    def push(self, t: float, kind: int, obj: Any, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, version))

    # ---------------------------------------------------------------- sampler and slots

    def submit_rollout(self, t: float) -> None:
        r = _Rollout(self.submitted, self.shapes[self.submitted % len(self.shapes)])
        self.submitted += 1
        self.queued.append(r)
        self.fill_slots(t)

    def fill_slots(self, t: float) -> None:
        while self.queued and self.free_slots:
            r = self.queued.popleft()
            self.free_slots -= 1
            r.started_at = t
            self.push(t + r.shape.lead_s, _CALL, r)

    # ---------------------------------------------------------------- broker

    def reservation(self, tokens: int) -> int:
        return max(tokens, int(self.mean_call_tokens))

    def has_room(self, e: _Engine, tokens: int) -> bool:
        if self.cluster.kv_admission <= 0:
            return True
        return e.kv_load == 0 or e.kv_load + self.reservation(tokens) <= self.kv_capacity * self.cluster.kv_admission

    def route(self, r: _Rollout, t: float, force: bool = False) -> bool:
        """Send rollout ``r``'s next call to its backend (choosing one for a first call); False: it must wait."""
        call = r.shape.calls[r.k]
        tokens = call.prompt_tokens + call.output_tokens
        e = r.engine
        if e is None:
            candidates = self.engines if force else [x for x in self.engines if self.has_room(x, tokens)]
            if not candidates:
                return False
            e = min(candidates, key=lambda x: (x.jobs, x.inflight, x.served))
            r.engine = e
            e.jobs += 1
        # The broker's KV bookkeeping (broker/admission.py: note).
        self.calls_routed += 1
        self.mean_call_tokens += (tokens - self.mean_call_tokens) / min(self.calls_routed, 100)
        self.forget(r)
        reserved = self.reservation(tokens)
        self.reserved[r.rid] = (e, reserved)
        e.kv_load += reserved
        e.served += 1
        e.submit(_Seq(r, call.prompt_tokens, call.output_tokens), t)
        return True

    def forget(self, r: _Rollout) -> None:
        old = self.reserved.pop(r.rid, None)
        if old is not None:
            old[0].kv_load -= old[1]

    def call_arrives(self, r: _Rollout, t: float) -> None:
        if self.route(r, t):
            return
        self.admission_wait.append(r)  # only a first call waits (a placed rollout's calls always go)
        r.waiting_since = t
        self.push(t + self.cluster.kv_admission_max_wait_s, _ADMIT_TIMEOUT, r)

    def retry_waiting(self, t: float) -> None:
        waiting, self.admission_wait = self.admission_wait, []
        for r in waiting:
            if self.route(r, t):
                r.waiting_since = None
            else:
                self.admission_wait.append(r)

    def call_done(self, r: _Rollout, t: float) -> None:
        r.k += 1
        if r.k < len(r.shape.calls):
            self.push(t + r.shape.gaps_s[r.k - 1], _CALL, r)
        else:
            self.push(t + r.shape.tail_s, _END, r)

    def rollout_end(self, r: _Rollout, t: float) -> None:
        assert r.engine is not None
        r.engine.jobs -= 1
        self.forget(r)
        self.free_slots += 1
        self.completed += 1
        self.submit_rollout(t)
        if self.admission_wait:
            self.retry_waiting(t)

    # ---------------------------------------------------------------- the run

    def run(self, rollouts: int, warmup: int) -> SimResult:
        for _ in range(self.in_flight):
            self.submit_rollout(0.0)
        t_a = 0.0
        busy_a = 0.0
        tokens_a = (0, 0)
        durations: list[float] = []
        heap = self.heap
        while self.completed < rollouts:
            t, _, kind, obj, version = heapq.heappop(heap)
            self.now = t
            if kind == _STEP_END:
                obj.step_end(t, version)
            elif kind == _CALL:
                self.call_arrives(obj, t)
            elif kind == _END:
                self.rollout_end(obj, t)
                if self.completed > warmup:
                    durations.append(t - obj.started_at)
                if self.completed == warmup:
                    t_a = t
                    busy_a = sum(e.busy_s(t) for e in self.engines)
                    tokens_a = (sum(e.prompt_tokens for e in self.engines), sum(e.cached_tokens for e in self.engines))
            elif obj.waiting_since is not None:
                # Waited kv_admission_max_wait_s at the broker (a rollout waits once): to the policy's choice anyway.
                self.admission_wait.remove(obj)
                obj.waiting_since = None
                self.route(obj, t, force=True)
        t_b = self.now
        window = t_b - t_a
        busy = sum(e.busy_s(t_b) for e in self.engines) - busy_a
        prompt = sum(e.prompt_tokens for e in self.engines) - tokens_a[0]
        cached = sum(e.cached_tokens for e in self.engines) - tokens_a[1]
        n = rollouts - warmup
        return SimResult(
            in_flight=self.in_flight, rollouts=n, window_s=window,
            rollouts_per_s=n / window if window > 0 else 0.0,
            gpu_busy_share=busy / (window * len(self.engines)) if window > 0 else 0.0,
            mean_rollout_s=sum(durations) / len(durations) if durations else 0.0,
            prefix_hit_rate=cached / prompt if prompt else 0.0,
            simulated_s=t_b, steps=sum(e.steps for e in self.engines),
        )


def simulate(workload: Workload, profile: SimProfile, cluster: ClusterShape, in_flight: int, rollouts: int,
             seed: int = 0) -> SimResult:
    """Run ``workload`` on ``cluster`` with ``in_flight`` rollouts kept submitted until ``rollouts`` have ended.

    The first quarter of the completions is warm-up (every rollout starts at once at time 0); the figures
    are over the rest. Shapes are used in an order shuffled with ``seed`` (not the file's order, which is
    the order rollouts ended in), cycling.
    """
    cluster.validate()
    if not isinstance(in_flight, int) or in_flight < 1:
        raise PlanError(f"in_flight must be at least 1, got {in_flight!r}")
    if rollouts < 2:
        raise PlanError(f"rollouts must be at least 2 (a warm-up and a measured one), got {rollouts}")
    if not workload.shapes:
        raise PlanError(f"{workload.source}: no rollouts")
    for i, shape in enumerate(workload.shapes):
        for j, call in enumerate(shape.calls):
            if call.prompt_tokens < 1 or call.prompt_tokens >= profile.max_model_len:
                raise PlanError(f"{workload.source}: rollout {i} call {j}: prompt of {call.prompt_tokens} tokens "
                                f"does not fit profile {profile.name}'s max_model_len {profile.max_model_len}")
    return _Simulation(workload, profile, cluster, in_flight, seed).run(rollouts, max(1, rollouts // 4))
