"""``prorl build-images --swe``: a 3-instance dataset over 2 repositories, offline (local base image, wheels folder).

Builds one environment image (wheels and the repository) per
repository/version on the local base in lock mode (the second run reuses
them), then ``prorl eval`` with
the oracle grades all three instances on those images, and an agent's probe
finds no commit after ``base_commit`` in an image that holds the repository.
The fixtures live at fixed paths under the test image cache with fixed
bytes, so later test sessions reuse the images too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.domains.conftest import IMAGES, ScriptedStack, turn
from tests.harness import image_build_config, need_module
from tests.swe.spacey import FILE, make_spacey

ROOT = IMAGES / "swe-datasets"


def _wheel(folder: Path, name: str) -> None:
    """A pure-Python wheel of one module ``name`` (fixed timestamps: the same bytes every time)."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": f"NAME = {name!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: prorl-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0)), text)


@pytest.fixture(scope="module")
def dataset(domain_image: str) -> dict[str, Any]:
    need_module("swebench", "swe")
    if ROOT.exists():
        shutil.rmtree(ROOT)
    repos, wheels = ROOT / "repos", ROOT / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels, "spacey_dep_a")
    _wheel(wheels, "spacey_dep_b")
    flat = make_spacey(repos / "prorl__spacey")
    src = make_spacey(repos / "prorl__spacey-src", src_layout=True)
    rows = [
        {**flat.instance, "install_config": {"pip_packages": ["spacey-dep-a"]}},
        {**flat.instance, "instance_id": "prorl__spacey-flat-2", "install_config": {"pip_packages": ["spacey-dep-a"]}},
        {**src.instance, "install_config": {"pip_packages": ["spacey-dep-b"],
                                            "test_cmd": f"PYTHONPATH=src python3 -m pytest -rA -p no:cacheprovider {FILE}"}},
    ]
    path = ROOT / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": path, "rows": rows, "repos": repos, "wheels": wheels, "base": domain_image, "fix": flat.fix_commit}


def _build(data: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRORL_")}
    built = subprocess.run(
        [sys.executable, "-m", "prorl_cli", "--config", str(image_build_config(ROOT)), "build-images", "--swe", str(data["path"]), "--base",
         f"localimage:{data['base']}", "--wheels", str(data["wheels"]), "--repos-dir", str(data["repos"]),
         "--cache-dir", str(IMAGES / "images"), "--mode", "lock", "--map-out", str(ROOT / "repo_images.json"), "--json"],
        capture_output=True, text=True, timeout=1200, env=env, start_new_session=True)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    out: dict[str, Any] = json.loads(built.stdout)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_build_images_swe_layers_reuse_and_eval(stack: ScriptedStack, dataset: dict[str, Any], tmp_path: Path) -> None:
    first = _build(dataset)
    names = sorted(r["name"] for r in first["results"])
    assert names == ["swe-prorl-spacey-0.1", "swe-prorl-spacey-src-0.1"]  # 2 environments for 3 instances
    assert all(r["action"] in ("built", "reused") for r in first["results"]), first["results"]
    assert sorted(first["repo_images"]) == ["prorl/spacey-src@0.1", "prorl/spacey@0.1"]
    second = _build(dataset)
    assert [r["action"] for r in second["results"]] == ["reused"] * 2, second["results"]  # lock mode: all reused

    # The repository layer: the wheels installed offline, the repository in /testbed, no later commit in it.
    image = first["repo_images"]["prorl/spacey@0.1"]
    probe = subprocess.run(["apptainer", "exec", "--containall", image, "sh", "-c",
                            "python3 -c 'import spacey_dep_a' && cd /testbed && git log --all --format=%H | wc -l && "
                            f"git cat-file -t {dataset['fix']} >/dev/null 2>&1; echo cat-file=$?"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and "cat-file=1" in probe.stdout, probe.stdout + probe.stderr

    # prorl eval with the oracle on those images: 3/3 resolved.
    rows = [{**r, "settings": {"repo_images": first["repo_images"]}} for r in dataset["rows"]]
    on_images = tmp_path / "dataset.jsonl"
    on_images.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ran = subprocess.run([sys.executable, "-m", "prorl_cli", "-d", stack.d.name, "eval", "--task", "swe_oracle",
                          str(on_images), "--out", str(tmp_path / "out")],
                         env=stack.d.env(), capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and "resolved 3/3" in ran.stdout, ran.stdout + ran.stderr[-3000:]

    # An agent on the image that holds the repository finds nothing after base_commit.
    fix = dataset["fix"]
    stack.add("[I-probe]", turn("", ("bash", {"command": f"cd /testbed && git log --all --format=%H | grep -c {fix}; "
                                                        f"git cat-file -t {fix}; echo tags=$(git tag | wc -l)"})),
              "Nothing.")
    stack.start_model()
    (probed,) = stack.run("swe", [{**rows[0], "problem_statement": "[I-probe] look around"}], timeout_s=300)
    out = [m["content"] for m in probed.output["trajectory"]["messages"] if m["role"] == "tool"][0]
    assert out.startswith("0") and "tags=0" in out and "commit" not in out.split("\n")[1], out
