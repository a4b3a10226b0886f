"""A simulated continuous-batching GPU server (``prorl serve inference --engine sim``).

It sits behind the real bridge and answers the real generate contract, so
broker routing, stickiness, cancellation and node pools run for real while
the GPU is a latency model:

* one engine step serves every running sequence: decoding sequences get one
  token each, sequences still in prefill get a chunk of their uncached prompt
  (vLLM's chunked prefill, ``max_batched_tokens`` per step);
* a step takes ``step_base_s + prefill_s_per_token * prefill tokens +
  decode_s_per_seq * decoding sequences + kv_read_s_per_token * their
  context``, so it grows with the batch's tokens;
* a per-backend prefix cache of ``block_tokens``-token blocks (chained hashes,
  as vLLM's automatic prefix caching), LRU-bounded by ``kv_budget_tokens``: the
  cached part of a prompt skips prefill;
* output ids and lengths come from a seeded generator (``ignore_eos`` gives
  exactly ``max_tokens``, which is how benchmarks script lengths); stop
  strings are not matched (the ids have no text; said once in the log).

Time is simulated on a virtual timeline anchored to the wall clock (run
``speedup`` times faster than the GPU), so asyncio's timer jitter does not
leak into the figures: busy seconds, tokens/s and the prefix hit rate are
reported in GPU time through :meth:`SimEngine.stats`, which the bridge puts in
its heartbeat.

With a ledger (``inference.sim_ledger_dir``, or ``ledger_path``), the
engine also accounts every call to its job (the bridge names it in
:data:`~prorl_cli.inference.contract.CALL_JOB_ID`): each step's GPU time is
split among the sequences in it (the step's base cost evenly, prefill by
the tokens each computed, decode and KV reads by each sequence's context),
so the calls' ``gpu_s`` add up to ``busy_s``, and the ledger is written as
JSON on :meth:`SimEngine.close`. ``benchmarks/table3.py`` joins it with the
sampler's outcome of each job.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import json
import logging
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prorl_cli import timebase, yamlfiles
from prorl_cli.exceptions import ContextLengthExceeded, InferenceError, context_length_message
from prorl_cli.inference.contract import CALL_JOB_ID, Engine, Generation, refuse_structured
from prorl_cli.protocol import SamplingParams, pack_tokens

log = logging.getLogger(__name__)

PROFILES_DIR = Path(__file__).resolve().parent / "sim_profiles"
DEFAULT_PROFILE = "h100-8b"


@dataclass
class SimProfile:
    """The latency model and limits of one simulated GPU server (a YAML file in ``sim_profiles/``)."""

    name: str = DEFAULT_PROFILE
    model: str = "sim-8b"
    max_model_len: int = 131072
    vocab_size: int = 128256
    eos_token_id: int = 128009
    step_base_s: float = 0.008
    prefill_s_per_token: float = 8.3e-05
    decode_s_per_seq: float = 5.0e-05
    kv_read_s_per_token: float = 4.0e-08
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    block_tokens: int = 16
    kv_budget_tokens: int = 400000
    output_tokens_median: float = 256.0
    output_tokens_sigma: float = 0.8
    #: GPU seconds an in-place weight load holds the engine (nothing served meanwhile); 0: not modelled.
    reload_s: float = 0.0
    speedup: float = 1.0
    seed: int = 0

    @classmethod
    def load(cls, name_or_path: str | Path | None = None, **overrides: Any) -> SimProfile:
        """A profile by name (``h100-8b``) or YAML path, with ``overrides`` on top; errors name the key."""
        source = name_or_path or DEFAULT_PROFILE
        path = Path(source)
        if not path.suffix:
            path = PROFILES_DIR / f"{source}.yaml"
        try:
            data = yamlfiles.load(path.read_text()) or {}
        except FileNotFoundError as e:
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
            raise InferenceError(f"sim profile {str(source)!r}: no such file or profile (known: {known})") from e
        except (OSError, yaml.YAMLError) as e:
            raise InferenceError(f"sim profile {path}: {e}") from e
        if not isinstance(data, dict):
            raise InferenceError(f"sim profile {path}: expected a map of settings")
        data.update({k: v for k, v in overrides.items() if v is not None})
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise InferenceError(f"sim profile {path}: unknown key(s) {unknown}")
        profile = cls(**data)
        profile.validate(str(path))
        return profile

    def step_s(self, prefill_tokens: int, decoders: int, context_tokens: int) -> float:
        """GPU seconds of one engine step: ``prefill_tokens`` uncached prompt tokens computed, ``decoders``
        sequences decoding one token each over ``context_tokens`` tokens of context in all.

        The one statement of the GPU model: :class:`SimEngine` and the capacity planner
        (:mod:`prorl_cli.planning.simulator`) both cost their steps here, so they cannot drift apart.
        """
        return (self.step_base_s + self.prefill_s_per_token * prefill_tokens + self.decode_s_per_seq * decoders
                + self.kv_read_s_per_token * context_tokens)

    def decode_steps_s(self, decoders: int, context_tokens: int, steps: int) -> float:
        """GPU seconds of ``steps`` decode-only steps of ``decoders`` sequences whose context starts at
        ``context_tokens`` (all of them together) and grows by one token per sequence per step:
        the sum of :meth:`step_s` over those steps, in closed form."""
        return (steps * (self.step_base_s + self.decode_s_per_seq * decoders)
                + self.kv_read_s_per_token * (steps * context_tokens + decoders * steps * (steps - 1) / 2))

    def validate(self, where: str) -> None:
        """Reject settings the simulator cannot run, naming the key."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "model"):
                if not isinstance(value, str) or not value:
                    raise InferenceError(f"sim profile {where}: {f.name} must be a non-empty string")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InferenceError(f"sim profile {where}: {f.name} must be a number, got {value!r}")
            if f.type in ("int", int) and not isinstance(value, int):
                raise InferenceError(f"sim profile {where}: {f.name} must be an integer, got {value!r}")
            if value < 0 or (value == 0 and f.name in ("max_model_len", "vocab_size", "max_num_seqs", "max_batched_tokens",
                                                        "block_tokens", "speedup", "output_tokens_median")):
                raise InferenceError(f"sim profile {where}: {f.name} must be positive, got {value!r}")
        if self.eos_token_id >= self.vocab_size:
            raise InferenceError(f"sim profile {where}: eos_token_id {self.eos_token_id} is outside vocab_size {self.vocab_size}")


#: Jobs whose last ids and block hashes an engine keeps for their next call (a bridge serves at most a few hundred live).
_CHAINS_KEPT = 4096


class PrefixCache:
    """Which prompt prefixes this backend holds in KV: full blocks keyed by chained hashes, LRU-bounded."""

    def __init__(self, block_tokens: int, capacity_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def block_hashes(self, ids: list[int], known: tuple[list[int], list[int]] | None = None) -> list[int]:
        """One hash per full block; each covers every token before it, so equal hashes mean equal prefixes.

        ``known``: earlier ids and their hashes (a job's last prompt and output): the leading blocks
        whose tokens are the same keep their hashes, and only the rest are hashed (an agent's next
        prompt extends its last one by a few blocks, and hashing all of it each turn is quadratic in the turns).
        """
        n = self.block_tokens
        full = len(ids) // n
        out: list[int] = []
        if known is not None:
            known_ids, known_hashes = known
            reuse = min(len(known_hashes), full)
            if reuse and ids[: reuse * n] != known_ids[: reuse * n]:
                reuse = 0  # the ids went another way: hash them all (a rare case not worth a search)
            out = known_hashes[:reuse]
        h = out[-1] if out else 0
        done = len(out)
        raw = pack_tokens(ids[done * n: full * n])
        for i in range(full - done):
            h = hash((h, raw[4 * n * i: 4 * n * (i + 1)]))
            out.append(h)
        return out

    def cached_blocks(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` held in the cache (they become most recently used)."""
        hit = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            hit += 1
        return hit

    def insert(self, hashes: list[int]) -> None:
        """Hold these blocks (most recently used), evicting the least recently used beyond capacity."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


@dataclass
class CallRecord:
    """One generate call as the engine served it (the ledger's row); times are wall-clock ``timebase.now()``
    seconds on the engine's virtual timeline (CLOCK_MONOTONIC is one clock for every process of a machine)."""

    job_id: str | None
    submitted_at: float
    prompt_tokens: int
    planned_tokens: int
    admitted_at: float | None = None
    ended_at: float | None = None
    #: Prompt tokens found in the prefix cache at admission (they skipped prefill).
    cached_tokens: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    #: This call's share of the engine's busy GPU seconds.
    gpu_s: float = 0.0
    #: ``done``, ``aborted`` (cancelled: the job ended) or ``running`` (still in the engine at close).
    outcome: str = "running"


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    future: asyncio.Future[None]
    hashes: list[int] = dataclasses.field(default_factory=list)
    #: The job the call is for (``None``: not told), whose last ids and hashes the next call can reuse.
    job_id: str | None = None
    to_prefill: int = 0
    generated: int = 0
    record: CallRecord | None = None

    @property
    def decoding(self) -> bool:
        return self.to_prefill == 0


@dataclass
class SimCounters:
    """Cumulative figures, in GPU time (wall time times ``speedup``)."""

    busy_s: float = 0.0
    steps: int = 0
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    #: How far behind its virtual timeline the engine was at its steps' ends (wall seconds; 0 when on time):
    #: an engine short of CPU falls behind, and its calls' ends are stamped on the timeline, earlier than
    #: they were answered.
    lag_sum_s: float = 0.0
    lag_max_s: float = 0.0
    lag_samples: int = 0
    #: In-place weight loads, and the GPU seconds they held the engine (``reload_s`` each).
    reloads: int = 0
    reload_s: float = 0.0

    def note_lag(self, behind_s: float) -> None:
        self.lag_samples += 1
        if behind_s > 0:
            self.lag_sum_s += behind_s
            self.lag_max_s = max(self.lag_max_s, behind_s)


class SimEngine(Engine):
    """The simulated server; see the module docstring for its model."""

    def __init__(
        self, profile: SimProfile | None = None, *, backend_id: str | None = None, ledger_path: Path | None = None,
        keep_ledger: bool = False,
    ) -> None:
        self.profile = profile or SimProfile()
        #: Every call served (with ``ledger_path`` or ``keep_ledger``), and the idle spans between busy ones.
        self.ledger: list[CallRecord] | None = [] if ledger_path is not None or keep_ledger else None
        self.idle_spans: list[tuple[float, float]] = []
        self.ledger_path = ledger_path
        self.model = self.profile.model
        self.max_model_len = self.profile.max_model_len
        self.backend_id = backend_id
        self.cache = PrefixCache(self.profile.block_tokens, self.profile.kv_budget_tokens)
        self.counters = SimCounters()
        self._rng = random.Random(self.profile.seed)
        #: Per job, its last call's prompt and output ids and their block hashes (the most recent jobs only).
        self._chains: collections.OrderedDict[str, tuple[list[int], list[int]]] = collections.OrderedDict()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._started_wall = timebase.now()
        self._t = self._started_wall  # wall time at which the next step starts (the virtual timeline)
        self._told_stop = False  # said once that stop strings are not matched here

    # ------------------------------------------------------------- contract

    async def start(self) -> None:
        if self._loop_task is None:
            self._started_wall = self._t = timebase.now()
            self._loop_task = asyncio.ensure_future(self._schedule())

    async def healthy(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self.ledger_path is not None:
            self.write_ledger(self.ledger_path)

    def write_ledger(self, path: Path) -> None:
        """The ledger as one JSON document: the engine's totals, its idle spans and every call."""
        doc = {
            "backend_id": self.backend_id, "speedup": self.profile.speedup, "started_at": self._started_wall,
            "closed_at": timebase.now(), **self.stats(),
            "busy_s": self.counters.busy_s, "prefill_tokens": self.counters.prefill_tokens, "idle_spans": self.idle_spans,
            "lag_mean_s": self.counters.lag_sum_s / max(1, self.counters.lag_samples), "lag_max_s": self.counters.lag_max_s,
            "calls": [dataclasses.asdict(r) for r in self.ledger or ()],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        """Simulated weights: nothing is read, but the load holds the engine for the profile's ``reload_s``
        (the bridge has drained it first), and the prefix cache goes, as a real engine's does with new weights:
        a rollout's next call after the load prefills its whole context again."""
        self.cache = PrefixCache(self.profile.block_tokens, self.profile.kv_budget_tokens)
        self.counters.reloads += 1
        if self.profile.reload_s > 0:
            self.counters.reload_s += self.profile.reload_s
            # On the virtual timeline: the engine's next step starts after the load.
            self._t = max(self._t, timebase.now()) + self.profile.reload_s / self.profile.speedup
            await asyncio.sleep(max(0.0, self._t - timebase.now()))

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if not prompt_ids:
            raise InferenceError("generate needs at least one prompt token")
        refuse_structured("simulated engine", sampling)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ContextLengthExceeded(context_length_message(len(prompt_ids), self.max_model_len))
        await self.start()
        if sampling.stop and not self._told_stop:
            # Its ids are drawn with no text behind them, and its lengths from the profile, which no content
            # shapes: a stop string has nothing to match, so a call goes on as without one. Said once, not
            # refused: handlers that send stop strings (Search-R1's) run on it unchanged.
            self._told_stop = True
            log.info("sim engine: sampling.stop is not matched (the simulated ids have no text); calls end at "
                     "their simulated length")
        ids, lps, finish = self._plan_output(prompt_ids, sampling, min(sampling.max_tokens, room))
        req = _Request(list(prompt_ids), ids, lps, finish, asyncio.get_running_loop().create_future(),
                       job_id=CALL_JOB_ID.get())
        if self.ledger is not None:
            req.record = CallRecord(req.job_id, max(self._t, timebase.now()), len(prompt_ids), len(ids))
            self.ledger.append(req.record)
        self.counters.requests += 1
        self._waiting.append(req)
        self._wake.set()
        try:
            await req.future
        except asyncio.CancelledError:
            # The job ended (generate_cancel): stop spending GPU time on it at once.
            self.counters.aborted += 1
            if req.record is not None:
                req.record.outcome = "aborted"
                req.record.ended_at = max(self._t, timebase.now())
            if req in self._running:
                self._running.remove(req)
            elif req in self._waiting:
                self._waiting.remove(req)
            self._wake.set()  # a decode run in progress re-plans without it
            raise
        return Generation(req.output_ids, req.logprobs, req.finish_reason, self.backend_id)

    def stats(self) -> dict[str, float]:
        """Busy fraction, tokens/s and prefix hit rate since start, plus the counters behind them (GPU time)."""
        c = self.counters
        elapsed_s = max(1e-9, (timebase.now() - self._started_wall) * self.profile.speedup)
        return {
            "busy_fraction": round(min(1.0, c.busy_s / elapsed_s), 4),
            "tokens_per_s": round(c.output_tokens / elapsed_s, 1),
            "prefix_hit_rate": round(c.cached_tokens / c.prompt_tokens, 4) if c.prompt_tokens else 0.0,
            "busy_s": round(c.busy_s, 3),
            "elapsed_s": round(elapsed_s, 3),
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "output_tokens": c.output_tokens,
            "requests": c.requests,
            "aborted": c.aborted,
            "reloads": c.reloads,
            "reload_s": round(c.reload_s, 3),
            "running": len(self._running),
            # What the broker's KV admission sizes this backend's live jobs by.
            "kv_capacity_tokens": self.profile.kv_budget_tokens,
            "waiting": len(self._waiting),
        }

    # ------------------------------------------------------------- outputs

    def _plan_output(self, prompt_ids: list[int], sampling: SamplingParams, budget: int) -> tuple[list[int], list[float], str]:
        p = self.profile
        if sampling.seed is not None:
            # Same seed and prompt: same answer, whatever else the engine served.
            rng = random.Random(f"{p.seed}:{sampling.seed}:{zlib.crc32(pack_tokens(prompt_ids))}")
        else:
            rng = random.Random(self._rng.getrandbits(64))
        stop_id = sampling.stop_token_ids[0] if sampling.stop_token_ids else p.eos_token_id
        if sampling.ignore_eos:
            length, finish = budget, "length"
        else:
            drawn = max(1, int(round(p.output_tokens_median * math.exp(p.output_tokens_sigma * rng.gauss(0.0, 1.0)))))
            length, finish = (budget, "length") if drawn >= budget else (drawn, "stop")
        avoid = {p.eos_token_id, *sampling.stop_token_ids}
        if sum(0 <= t < p.vocab_size for t in avoid) >= p.vocab_size:
            raise InferenceError(f"sampling.stop_token_ids with the EOS id leave no token of the sim profile's "
                                 f"vocabulary ({p.vocab_size}) to generate")
        ids = []
        for _ in range(length - (finish == "stop")):
            t = rng.randrange(p.vocab_size)
            # Step past every stop id, not just one: stop ids often sit side by side (Llama 3's 128008 and
            # 128009), and a stop id inside an output that went on would break the contract.
            while t in avoid:
                t = (t + 1) % p.vocab_size
            ids.append(t)
        if finish == "stop":
            ids.append(stop_id)
        lps = [-rng.expovariate(2.0) for _ in ids]
        return ids, lps, finish

    # ------------------------------------------------------------- scheduler

    def _admit(self) -> None:
        p = self.profile
        while self._waiting and len(self._running) < p.max_num_seqs:
            req = self._waiting.popleft()
            req.hashes = self.cache.block_hashes(req.prompt_ids, self._chains.get(req.job_id) if req.job_id else None)
            cached = self.cache.cached_blocks(req.hashes) * p.block_tokens
            # The last prompt token is always computed (it yields the first output token).
            cached = min(cached, len(req.prompt_ids) - 1)
            req.to_prefill = len(req.prompt_ids) - cached
            self.counters.prompt_tokens += len(req.prompt_ids)
            self.counters.cached_tokens += cached
            if req.record is not None:
                req.record.admitted_at = self._t
                req.record.cached_tokens = cached
            self._running.append(req)

    def _step_s(self, n_prefill: int, decoders: int, context: int) -> float:
        return self.profile.step_s(n_prefill, decoders, context)

    async def _schedule(self) -> None:
        speedup = self.profile.speedup
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                idle_from, self._t = self._t, max(self._t, timebase.now())
                if self.ledger is not None and self._t > idle_from:
                    self.idle_spans.append((idle_from, self._t))
            self._admit()
            if not self._running:
                continue
            if any(not r.decoding for r in self._running) or self._waiting:
                await self._mixed_step(speedup)
            else:
                await self._decode_steps(speedup)

    async def _mixed_step(self, speedup: float) -> None:
        """One step with prefill chunks: decoders get a token, the rest of the token budget prefills."""
        decoders = [r for r in self._running if r.decoding]
        budget = self.profile.max_batched_tokens - len(decoders)
        chunks: list[tuple[_Request, int]] = []
        for r in self._running:
            if budget <= 0:
                break
            if not r.decoding:
                take = min(r.to_prefill, budget)
                chunks.append((r, take))
                budget -= take
        n_prefill = sum(n for _, n in chunks)
        step_s = self._step_s(n_prefill, len(decoders), sum(len(r.prompt_ids) + r.generated for r in decoders))
        if self.ledger is not None:
            self._charge_mixed(chunks, decoders)
        await self._advance(step_s, speedup)
        self.counters.prefill_tokens += n_prefill
        for r, n in chunks:
            r.to_prefill -= n
            if r.to_prefill == 0:
                self.cache.insert(r.hashes)
                decoders.append(r)  # its last prefill token yields the first output token
        self._emit(decoders, 1)

    async def _decode_steps(self, speedup: float) -> None:
        """Decode-only steps until the next sequence finishes, in one sleep; a new arrival cuts it short."""
        running = list(self._running)
        k = min(len(r.output_ids) - r.generated for r in running)
        context = sum(len(r.prompt_ids) + r.generated for r in running)
        ends: list[float] = []
        total = 0.0
        for i in range(k):
            total += self._step_s(0, len(running), context + i * len(running))
            ends.append(total)
        start = self._t
        self._wake.clear()
        wait_s = start + total / speedup - timebase.now()
        if wait_s > 0:
            # Not wait_for: before 3.12 it can swallow a cancel that races the wake-up.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([waiter], timeout=wait_s)
            finally:
                waiter.cancel()
        done_gpu_s = (timebase.now() - start) * speedup
        # Steps already over, at least the one in progress; all of them if nothing arrived.
        n = k if not self._wake.is_set() else max(1, min(k, bisect.bisect_right(ends, done_gpu_s)))
        self._t = start + ends[n - 1] / speedup
        self.counters.note_lag(timebase.now() - self._t)
        if self.ledger is not None:
            self._charge_decode(running, n, ends[n - 1])
        self.counters.busy_s += ends[n - 1]
        self.counters.steps += n
        self._emit(running, n)

    def _charge_mixed(self, chunks: list[tuple[_Request, int]], decoders: list[_Request]) -> None:
        """Split one mixed step's time among its sequences (the terms of :meth:`_step_s`, each to whom it costs)."""
        p = self.profile
        base = p.step_base_s / (len(chunks) + len(decoders))
        for r, n in chunks:
            if r.record is not None:
                r.record.gpu_s += base + p.prefill_s_per_token * n
                r.record.prefill_tokens += n
        for r in decoders:
            if r.record is not None:
                r.record.gpu_s += base + p.decode_s_per_seq + p.kv_read_s_per_token * (len(r.prompt_ids) + r.generated)

    def _charge_decode(self, running: list[_Request], n: int, total_s: float) -> None:
        """Split ``n`` decode-only steps (``total_s`` in all) among ``running``; the shares add up to ``total_s``."""
        p = self.profile
        shares = []
        for r in running:
            context = len(r.prompt_ids) + r.generated
            shares.append(n * (p.step_base_s / len(running) + p.decode_s_per_seq)
                          + p.kv_read_s_per_token * (n * context + n * (n - 1) / 2))
        # The steps' own sum (float rounding aside, equal to the shares') is what busy_s counts.
        scale = total_s / sum(shares)
        for r, share in zip(running, shares, strict=True):
            if r.record is not None:
                r.record.gpu_s += share * scale

    async def _advance(self, step_s: float, speedup: float) -> None:
        self._t += step_s / speedup
        self.counters.busy_s += step_s
        self.counters.steps += 1
        wait_s = self._t - timebase.now()
        self.counters.note_lag(-wait_s)
        if wait_s > 0:
            await asyncio.sleep(wait_s)

    def _emit(self, decoders: list[_Request], n: int) -> None:
        """``n`` more tokens for each decoder; finished sequences leave the batch and answer."""
        finished = False
        for r in decoders:
            if r.future.done():  # cancelled while the step ran: it has left the batch
                continue
            r.generated += n
            self.counters.output_tokens += n
            if r.record is not None:
                r.record.output_tokens = r.generated
            if r.generated >= len(r.output_ids):
                finished = True
                if r.record is not None:
                    r.record.outcome, r.record.ended_at = "done", self._t
                # What it wrote is in KV too: the next turn's prompt extends it.
                ids = r.prompt_ids + r.output_ids
                hashes = self.cache.block_hashes(ids, (r.prompt_ids, r.hashes))
                self.cache.insert(hashes)
                if r.job_id is not None:
                    self._chains[r.job_id] = (ids, hashes)
                    self._chains.move_to_end(r.job_id)
                    if len(self._chains) > _CHAINS_KEPT:
                        self._chains.popitem(last=False)
                r.future.set_result(None)
        if finished:
            self._running = [r for r in self._running if not r.future.done()]
