"""Handlers name images; the node resolves names through the image manifest."""

from __future__ import annotations

from pathlib import Path

from tests.harness import Deployment


def test_an_unbuilt_image_name_fails_the_job_clearly(tmp_path: Path, need_bwrap: None) -> None:
    cache = tmp_path / "images"
    d = Deployment(tmp_path / "home", "imgname", {"sandbox": {"runtime": "bwrap"}, "images": {"cache_dir": str(cache)}})
    try:
        d.start_broker()
        d.start_node("n1")
        r = d.client.process("sandbox_demo", {"image": "never-built"}, timeout_s=60)
        assert r.state == "failed" and r.critical_error == "init"
        assert "never-built" in r.error["message"] and "prorl build-images never-built" in r.error["message"]
        # The node keeps serving.
        assert d.client.process("test", {"echo": 1}).state == "done"
    finally:
        d.close()
