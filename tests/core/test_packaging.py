"""The wheel carries handlers/, slurm_templates/ and sif_recipes/ as package data."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.harness import REPO


def test_wheel_ships_the_data_folders(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("prorl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "prorl_cli/handlers/testing.py" in names
    assert any(n.startswith("prorl_cli/sif_recipes/") and n.endswith(".j2") for n in names)
    assert any(n.startswith("prorl_cli/slurm_templates/") for n in names)
    assert "prorl_cli/protocol.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
