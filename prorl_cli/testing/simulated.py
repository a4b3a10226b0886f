"""A whole deployment on simulated time, in this process: broker, node server, bridges with the sim engine.

What :class:`~prorl_cli.embedded.LocalStack` starts as child processes,
built here from the same classes (:class:`~prorl_cli.broker.server.Broker`,
:class:`~prorl_cli.node.server.NodeServer`,
:class:`~prorl_cli.inference.bridge.InferenceBridge` over
:class:`~prorl_cli.inference.sim_engine.SimEngine`) and run as tasks of one
:class:`~prorl_cli.timebase.SimulatedEventLoop`. They talk over ZeroMQ
``inproc`` sockets in one context (a message is ready for its receiver the
moment it is sent), and every role reads the loop's clock
(:mod:`prorl_cli.timebase`). So the replay's figures follow from the
workload and the seed alone: the host's speed, its load and its scheduler
change how long the replay takes, never what it measures.

The simulated engines run at ``sim_speedup: 1`` (their clock is the GPU's)
and the rollouts' tool waits are the modelled ones: no hop is left to absorb.
Usage (the client is an :class:`~prorl_cli.client.AsyncRolloutClient`)::

    async def main(home):
        async with SimulatedDeployment(home, "replay", config, bridges=4) as dep:
            sampler = DapoSampler(dep.client, "sim_agent", prompts, SamplerConfig(...))
            batch = await sampler.step()

    timebase.run_simulated(main(home))
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml
import zmq
import zmq.asyncio

from prorl_cli import timebase
from prorl_cli.broker.server import Broker
from prorl_cli.client import AsyncRolloutClient
from prorl_cli.config import ProrlConfig, load_config
from prorl_cli.exceptions import ConfigError, ProrlError
from prorl_cli.inference.bridge import InferenceBridge
from prorl_cli.inference.serve import BridgeOptions, build_engine
from prorl_cli.node.server import NodeServer

__all__ = ["SimulatedDeployment"]


class SimulatedDeployment:
    """Broker, ``nodes`` node servers and ``bridges`` sim-engine bridges on the running simulated-time loop.

    ``config``: prorl configuration overrides, as a dict of sections (as
    ``LocalStack`` takes them); ``inference.sim_speedup`` is forced to 1.
    Entering waits (on simulated time) until every node and bridge has registered.
    """

    def __init__(self, home: Path, name: str, config: dict[str, Any] | None = None, *,
                 bridges: int = 1, nodes: int = 1) -> None:
        if bridges < 0 or nodes < 1:
            raise ConfigError(f"a simulated deployment needs at least one node and no negative bridges, "
                              f"got nodes={nodes}, bridges={bridges}")
        self.home = home
        self.name = name
        data = {**(config or {}), "deployment": name, "home": str(home)}
        data["inference"] = {**data.get("inference", {}), "sim_speedup": 1.0}
        home.mkdir(parents=True, exist_ok=True)
        path = home / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        self.config: ProrlConfig = load_config(path)
        self.address = f"inproc://prorl-{name}"
        self.n_bridges = bridges
        self.n_nodes = nodes
        self.broker: Broker | None = None
        self.node_servers: list[NodeServer] = []
        self.bridges: list[InferenceBridge] = []
        self.client = AsyncRolloutClient(address=self.address, config=self.config)
        self._tasks: list[asyncio.Future[Any]] = []

    async def __aenter__(self) -> SimulatedDeployment:
        if not isinstance(asyncio.get_running_loop(), timebase.SimulatedEventLoop):
            raise ProrlError("a SimulatedDeployment runs on timebase.run_simulated's loop (simulated time), "
                             "not on a real-time loop")
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)  # what did start stops, and the broker's socket closes
            raise
        return self

    async def _start(self) -> None:
        # One ZeroMQ context for every role: ``inproc`` only connects sockets of the same context.
        ctx = zmq.asyncio.Context.instance()
        self.broker = Broker(self.config, ctx=zmq.Context.shadow(ctx.underlying))
        self.broker.sock.bind(self.address)
        self._tasks.append(asyncio.ensure_future(self.broker.serve_on_loop()))
        for i in range(self.n_nodes):
            node = NodeServer(self.config, node_id=f"node-{i}", address=self.address)
            node.liveness_sidecar = False  # its thread would heartbeat on real time
            self.node_servers.append(node)
            self._tasks.append(asyncio.ensure_future(node.serve(take_signals=False)))
        host = socket.gethostname()
        for i in range(self.n_bridges):
            backend_id = f"sim-{i}"
            engine = build_engine(BridgeOptions(engine="sim", backend_id=backend_id), self.config, backend_id)
            await engine.start()
            bridge = InferenceBridge(engine, address=self.address, backend_id=backend_id, host=host,
                                     capacity=self.config.inference.capacity)
            self.bridges.append(bridge)
            self._tasks.append(asyncio.ensure_future(bridge.serve()))
        await self._registered()

    async def _registered(self) -> None:
        for _ in range(600):  # simulated seconds: registration takes a few heartbeats at most
            if any(t.done() for t in self._tasks):
                for t in self._tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise ProrlError(f"a simulated role stopped while starting: {t.exception()!r}")
                raise ProrlError("a simulated role stopped while starting")
            st = await self.client.status()
            if (sum(n.alive for n in st.nodes) >= self.n_nodes
                    and sum(b.alive for b in st.backends) >= self.n_bridges):
                return
            await asyncio.sleep(0.1)
        raise ProrlError(f"the simulated roles did not register within 60 s of simulated time "
                         f"({self.n_nodes} node(s), {self.n_bridges} bridge(s))")

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.client.close()
        for node in self.node_servers:
            node.stop()
        for bridge in self.bridges:
            bridge.stop()
        # The node and bridges unregister, then the broker's loop is cancelled (it has nothing left to serve).
        if self._tasks[1:]:
            await asyncio.wait(self._tasks[1:], timeout=30.0)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for bridge in self.bridges:
            await bridge.engine.close()
        if self.broker is not None:
            self.broker.close()
            self.broker = None
