"""The address a broker bound to every interface publishes: one peers on other hosts can dial."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from prorl_cli.broker import endpoint


def _resolving(table: dict[str, str]) -> Any:
    def getaddrinfo(name: str, *args: Any, **kwargs: Any) -> list[Any]:
        if name not in table:
            raise socket.gaierror(name)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[name], 0))]

    return getaddrinfo


def test_a_host_name_mapped_to_loopback_is_not_published(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many clusters' /etc/hosts map the host name to 127.0.1.1: nodes on other hosts would dial their own
    loopback. The address of the routed interface is published instead (here: this machine's own)."""
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "login1")
    monkeypatch.setattr(socket, "getaddrinfo", _resolving({"localhost": "127.0.0.1", "login1": "127.0.1.1"}))
    host = endpoint.advertised_host()
    assert host not in ("localhost", "login1") and not host.startswith("127.")
    socket.inet_aton(host)  # an IPv4 address


def test_a_routable_name_is_published_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "node12.cluster.example")
    monkeypatch.setattr(socket, "getaddrinfo", _resolving({"node12.cluster.example": "10.1.2.12"}))
    assert endpoint.advertised_host() == "node12.cluster.example"
    # The fully qualified name unresolvable here, the short one fine: the short one.
    monkeypatch.setattr(socket, "getfqdn", lambda: "node12")
    monkeypatch.setattr(socket, "gethostname", lambda: "node12-ib")
    monkeypatch.setattr(socket, "getaddrinfo", _resolving({"node12-ib": "10.2.2.12"}))
    assert endpoint.advertised_host() == "node12-ib"
