"""Apptainer defaults, for real and rootless: no network, no host home, read-only outside the layer."""

from __future__ import annotations

import pytest

from tests.sandbox.conftest import ScenarioRunner

pytestmark = [pytest.mark.apptainer, pytest.mark.usefixtures("need_apptainer")]


@pytest.mark.parametrize("image", ["dir", "sif"])
def test_isolation_defaults(image: str, scenarios: ScenarioRunner, images: dict[str, str]) -> None:
    r = scenarios.run("isolation", {"runtime": "apptainer", "image": images[image]})
    assert r["sys_class_net"] == ["lo"]
    assert r["proc_net_dev"] == ["lo"]
    assert "TOKEN-4ab9e" not in r["home_visible"] and "rc=1" in r["home_visible"]
    assert "prorl-host-secret" not in r["home_listing"]
    assert "Read-only file system" in r["write_toolserver"]
    assert "rc=1" in r["write_proc_sys"]
    # /usr is in the writable layer: the write works there and never reaches the image
    assert r["write_usr"].strip() == "rc=0"
    assert r["image_untouched"] is True
    assert r["uid"] == "0"  # fakeroot by default: root inside, the test user outside
    a, b = r["ips"]
    assert a != b and a.startswith("127.") and not a.startswith("127.0.")
    assert r["env_ip"] == a
    assert r["listen"] == [f"listening {a}:8000", f"listening {b}:8000"]


def test_writable_none_is_read_only(scenarios: ScenarioRunner, images: dict[str, str]) -> None:
    r = scenarios.run("isolation", {"runtime": "apptainer", "image": images["dir"], "writable": "none"})
    assert "Read-only file system" in r["write_usr"] or "Permission denied" in r["write_usr"]
    assert "rc=1" in r["write_usr"]


def test_shared_network_ports(scenarios: ScenarioRunner, images: dict[str, str]) -> None:
    """With the host's network, the per-sandbox loopback IPs let both listen on port 8000."""
    r = scenarios.run("ports", {"runtime": "apptainer", "image": images["dir"], "network": True})
    a, b = r["ips"]
    assert a != b
    assert r["listen"] == [f"listening {a}:8000", f"listening {b}:8000"]


def test_image_without_python_is_refused_clearly(scenarios: ScenarioRunner, images: dict[str, str]) -> None:
    r = scenarios.run("bad_image", {"runtime": "apptainer", "image": images["busybox"]})
    assert "has no 'python3'" in r["error"]
    assert r["live"] == 0 and r["records"] == [] and r["local_dir_left"] == []


def test_missing_image_is_named(scenarios: ScenarioRunner) -> None:
    r = scenarios.run("bad_image", {"runtime": "apptainer", "image": "/nonexistent/img.sif"})
    assert "image '/nonexistent/img.sif' does not exist" in r["error"]
