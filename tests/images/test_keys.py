"""Lock keys follow what Apptainer copies into the image (no Apptainer needed)."""

from __future__ import annotations

from pathlib import Path

from .conftest import Workspace


def test_a_link_in_a_copied_folder_counts_by_its_target(ws: Workspace, tmp_path: Path) -> None:
    """Apptainer copies %files with ``cp -L``: a changed link target is a changed image."""
    outside = tmp_path / "shared"
    (outside / "sub").mkdir(parents=True)
    (outside / "weights.bin").write_text("v1\n")
    (outside / "sub" / "vocab.txt").write_text("a\n")
    data = ws.root / "data"
    data.mkdir()
    (data / "weights.bin").symlink_to(outside / "weights.bin")
    (data / "sub").symlink_to(outside / "sub")
    (data / "loop").symlink_to(data)  # a link back into the folder counts by its text, not forever
    ws.write({"tiny": {"template": "busybox.def.j2", "base": "scratch", "files": [{"src": "data", "dst": "/data"}]}})
    keys = [ws.dry_run("--mode", "lock")["tiny"]["key"]]
    (outside / "weights.bin").write_text("v2\n")
    keys.append(ws.dry_run("--mode", "lock")["tiny"]["key"])
    (outside / "sub" / "vocab.txt").write_text("b\n")
    keys.append(ws.dry_run("--mode", "lock")["tiny"]["key"])
    assert len(set(keys)) == 3, keys
