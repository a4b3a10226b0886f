"""``image: harness``: the name finds a built image (the cache's manifest) or one in ``images.search_dirs`` (the
provisioned test image, scripts/provision/47-harness-image.sh), or fails saying where it looked and what to
run; the provisioned image carries mini-swe-agent, the openai and anthropic SDKs and the OpenAI Agents SDK."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prorl_cli.exceptions import ImageBuildError
from prorl_cli.images import Cache, resolve_image
from tests.domains.conftest import IMAGES
from tests.harness import REPO, Deployment

HARNESS = IMAGES / "harness"
REQUIREMENTS = REPO / "sif_recipes" / "harness-requirements.txt"
ENV = {"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mswea",
       "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# What the harness image must carry (the lockfile's pins), checked by version inside the sandbox.
PROBE = ("python3 -c 'import importlib.metadata as m, openai, anthropic, agents, minisweagent; "
         "print(\"have\", *(d + \"==\" + m.version(d) for d in (\"mini-swe-agent\", \"openai\", \"anthropic\", "
         "\"openai-agents\")))'")


def _pins() -> list[str]:
    return [line.strip() for line in REQUIREMENTS.read_text().splitlines() if re.match(r"^[A-Za-z]", line)]


def _need_harness_image() -> None:
    if not (HARNESS / "usr" / "local" / "bin" / "mini-swe-agent").is_file():
        pytest.skip(f"{HARNESS} missing (run scripts/provision/47-harness-image.sh as root)")


def test_the_lockfile_pins_the_agents_and_sdks() -> None:
    names = [pin.split("==")[0] for pin in _pins()]
    assert names == ["mini-swe-agent", "openai", "anthropic", "openai-agents"]
    assert all("==" in pin for pin in _pins())


def test_an_image_name_resolves_through_the_manifest_then_the_search_dirs(tmp_path: Path) -> None:
    cache, shared, other = tmp_path / "cache", tmp_path / "shared", tmp_path / "other"
    (shared / "tool.sif").parent.mkdir(parents=True)
    (shared / "tool.sif").write_bytes(b"sif")
    (shared / "rootfs" / "usr").mkdir(parents=True)
    (other / "rootfs").mkdir(parents=True)  # a folder of that name that is no root file system: not an image
    (other / "rootfs" / "notes").write_text("x")
    assert resolve_image("tool", cache, [other, shared]) == shared / "tool.sif"
    assert resolve_image("rootfs", cache, [other, shared]) == shared / "rootfs"
    # A build of the name in the cache wins over the search dirs.
    built = cache / "images" / "tool" / "k1.sif"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"built")
    Cache(cache).record({"key": "k1", "name": "tool", "path": "images/tool/k1.sif"})
    assert resolve_image("tool", cache, [shared]) == built

    with pytest.raises(ImageBuildError) as raised:
        resolve_image("harness", cache, [other])
    message = str(raised.value)
    assert "`prorl build-images harness` builds it where the image list defines 'harness'" in message
    assert str(cache / "manifest.json") in message
    assert str(other / "harness.sif") in message and str(other / "harness") in message, message
    assert "images.search_dirs" in message
    with pytest.raises(ImageBuildError, match=r"images\.search_dirs is empty"):
        resolve_image("harness", cache)


def test_image_harness_runs_the_provisioned_image_with_its_sdks(tmp_path: Path, tiny_model: Path) -> None:
    """A job naming ``image: harness`` gets the provisioned image through ``images.search_dirs``; one
    naming an image that exists nowhere fails saying what to run."""
    _need_harness_image()
    config = {
        "sandbox": {"runtime": "apptainer", "local_dir": str(tmp_path / "sb")},
        "images": {"cache_dir": str(tmp_path / "cache"), "search_dirs": [str(IMAGES)]},
        "inference": {"tokenizer": str(tiny_model)},
        "handlers": {"harness": {"image": "harness", "env": ENV, "poll_s": 0.2}},
    }
    d = Deployment(tmp_path / "home", "himg", config=config)
    try:
        d.start_broker()
        d.start_node("n1")
        ok = d.client.process("harness", {"task": "probe", "settings": {"command": PROBE}}, timeout_s=240)
        assert ok.state == "done", ok.error or ok.output.get("harness_log")
        assert ok.output["harness_exit_code"] == 0, ok.output["harness_log"]
        assert "have " + " ".join(_pins()) in ok.output["harness_log"], ok.output["harness_log"]

        missing = d.client.process("harness", {"task": "probe", "settings": {"command": "true",
                                                                             "image": "harness-nowhere"}},
                                   timeout_s=120)
        assert missing.state == "failed" and missing.critical_error == "init" and missing.error, missing
        message = missing.error["message"]
        assert "prorl build-images harness-nowhere" in message, message
        assert str(IMAGES / "harness-nowhere.sif") in message and "images.search_dirs" in message, message
    finally:
        d.close()
