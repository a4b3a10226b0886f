"""A whole deployment as child processes on one machine (quickstart, tests, benchmarks).

Each server is a real ``python -m prorl_cli ...`` child in its own process
group, talking over real ZeroMQ sockets on loopback. :meth:`LocalStack.close`
stops the deployment through the broker and then makes sure every process
group it started is gone (SIGTERM, then SIGKILL); it never touches anything
it did not start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from prorl_cli.client import AsyncRolloutClient, RolloutClient
from prorl_cli.config import ENV_CONFIG, ENV_DEPLOYMENT, ENV_HOME, ProrlConfig, load_config
from prorl_cli.exceptions import BrokerRestarted, BrokerUnavailable, ClientMisuse, StartTimeout
from prorl_cli.processes import DIE_WITH_PARENT_ENV, stop_groups
from prorl_cli.protocol import StatusReport
from prorl_cli.rendezvous import read_rendezvous, wait_rendezvous

STOP_GRACE_S = 10.0


class LocalStack:
    """Servers of one deployment under ``home`` (its own PRORL_HOME), with logs in ``home/logs``."""

    def __init__(self, home: Path | str, name: str, config: dict[str, Any] | None = None) -> None:
        # Absolute: the servers start in ``home`` and read its paths from there (a relative one named home/home).
        home = Path(home).expanduser().absolute()
        self.home = home
        self.name = name
        self.config = {**(config or {}), "deployment": name, "home": str(home)}
        home.mkdir(parents=True, exist_ok=True)
        self.config_path = home / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.logs = home / "logs"
        self.logs.mkdir(exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._client: RolloutClient | None = None
        self._spawner: concurrent.futures.ThreadPoolExecutor | None = None

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def deployment_dir(self) -> Path:
        return self.home / self.name

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[ENV_HOME] = str(self.home)
        env[ENV_DEPLOYMENT] = self.name
        env[ENV_CONFIG] = str(self.config_path)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _server_env(self) -> dict[str, str]:
        """:meth:`env` for a server of the stack: it ends when this process ends, even by SIGKILL."""
        return {**self.env(), DIE_WITH_PARENT_ENV: str(os.getpid())}

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``prorl ARGS`` as a child in its own process group, logging to logs/NAME.log."""
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            # Two servers under one name would take each other's place at the broker, and close() would lose one.
            raise RuntimeError(f"{name!r} of this stack still runs (pid {running.pid}): stop it first, or pick "
                               "another name")
        def start() -> subprocess.Popen[bytes]:
            with open(self.logs / f"{name}.log", "ab") as log:
                return subprocess.Popen(
                    [sys.executable, "-m", "prorl_cli", "-d", self.name, *args],
                    env=self._server_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=self.home,
                )

        # The kernel ties a server's end to the *thread* that forked it (PR_SET_PDEATHSIG): servers started from a
        # short-lived thread (asyncio.to_thread's worker, gone when asyncio.run returns) would die with it. Every
        # server forks from the stack's own thread, which lives until close() (or the interpreter's exit).
        if self._spawner is None:
            self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prorl-stack-spawner")
        proc = self._spawner.submit(start).result()
        self.procs[name] = proc
        return proc

    @staticmethod
    def _refuse_inside_a_loop(what: str) -> None:
        """The stack waits for its servers with a blocking client, which would block a running event loop.

        Refused with :class:`ClientMisuse` (a ``RuntimeError``), the error a client used where it cannot work
        raises, so one ``except`` catches both."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise ClientMisuse(f"LocalStack.{what} blocks, and an event loop runs here (asyncio code, a notebook): call "
                           f"it outside the loop, or from it with `await asyncio.to_thread(stack.{what}, ...)`; "
                           "stack.async_client() is the client for asyncio code")

    def async_client(self, request_timeout_s: float = 15.0) -> AsyncRolloutClient:
        """A new client of this stack for asyncio code (use it in ``async with``)."""
        # Found through the stack's rendezvous file (no fixed address): it follows a broker restarted elsewhere.
        return AsyncRolloutClient(self.name, config=self.load_config(), request_timeout_s=request_timeout_s)

    def start_broker(self, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
        self._refuse_inside_a_loop("start_broker")
        proc = self.spawn("broker", "serve", "broker")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = wait_rendezvous(self.deployment_dir, min(1.0, timeout_s))
                if info.pid == proc.pid:
                    return proc
                # An earlier broker's file (one killed, or still stopping): read again soon, not in a busy loop.
                time.sleep(0.05)
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise BrokerUnavailable(f"broker did not start; its log:\n{self.log('broker')}")

    @property
    def address(self) -> str:
        return read_rendezvous(self.deployment_dir).address

    def start_node(self, node_id: str, *args: str, wait: bool = True, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
        if wait:
            self._refuse_inside_a_loop("start_node")
        proc = self.spawn(node_id, "serve", "node", "--node-id", node_id, *args)
        if wait:
            self.wait_for(
                lambda st: any(n.node_id == node_id and n.alive for n in st.nodes),
                timeout_s, f"node {node_id} to register", node_id,
            )
        return proc

    def wait_for(
        self, predicate: Callable[[StatusReport], bool], timeout_s: float, what: str, log_name: str | None = None
    ) -> StatusReport:
        """Poll the broker's status until ``predicate(status)`` holds; :class:`StartTimeout` (with ``log_name``'s log tail)
        past ``timeout_s`` or once that watched child died."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = self.client.status()
            except BrokerRestarted:
                status = None  # asked at the old address of a broker restarted elsewhere: the next ask goes to the new one
            if status is not None and predicate(status):
                return status
            proc = self.procs.get(log_name) if log_name else None
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                tail = self.log(log_name) if log_name else ""
                raise StartTimeout(f"gave up waiting for {what}\n{tail}")
            time.sleep(0.05)

    @property
    def client(self) -> RolloutClient:
        if self._client is None:
            self._client = self.new_client()
        return self._client

    def load_config(self) -> ProrlConfig:
        """This deployment's configuration, with its own home and name whatever the environment says.

        ``PRORL_HOME`` and ``PRORL_DEPLOYMENT`` beat a config file (a user's shell sets them for
        their cluster deployments); an embedded stack's clients must still find this stack's
        rendezvous file and CURVE keys, so its home and name are passed as overrides.
        """
        return load_config(self.config_path, {"home": str(self.home), "deployment": self.name})

    def new_client(self, request_timeout_s: float = 15.0) -> RolloutClient:
        # Found through the stack's rendezvous file (no fixed address): it follows a broker restarted elsewhere.
        return RolloutClient(self.name, config=self.load_config(), request_timeout_s=request_timeout_s)

    def drop_client(self) -> None:
        """Close the cached :attr:`client`; the next use connects anew (to where the rendezvous file points)."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            client.close()
            return
        # The blocking client runs its own loop, which cannot run in a thread where one runs already (a stack
        # left from asyncio code): it closes in a thread of its own.
        closer = threading.Thread(target=client.close, name="prorl-stack-client-close")
        closer.start()
        closer.join()

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-5000:] if path.exists() else ""

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of one child (one we started)."""
        proc = self.procs[name]
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the deployment through the broker, then wait for every child to exit."""
        self.client.stop()
        for proc in self.procs.values():
            proc.wait(timeout=timeout_s)

    def close(self) -> None:
        """Stop everything this stack started, whatever state it is in."""
        try:
            self.drop_client()
        finally:
            stop_groups(self.procs.values(), STOP_GRACE_S)
            if self._spawner is not None:
                self._spawner.shutdown(wait=True)
                self._spawner = None
