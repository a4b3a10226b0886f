"""Published SWE images from a real local registry and from OCI archives on disk.

A real ``docker-registry`` (Debian's, started here in its own process group
on a free loopback port with a temporary storage folder) serves a small
image that skopeo pushes under SWE-bench's names for two instances;
``prorl build-images --swe --images-from docker://127.0.0.1:PORT/ns/{swebench}``
pulls both with Apptainer over plain HTTP, a second run reuses them. The same
image as an OCI archive and as an OCI layout in a folder is converted
without being asked. The image is built here, offline: a one-layer OCI
layout holding busybox and a marker file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import socket
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.published import (
    SCHEMES,
    instance_fields,
    on_disk,
    plain_http,
    registry_template,
    saved_image_digest,
)
from prorl_cli.processes import stop_group

from .conftest import Workspace, apptainer_missing

MARKER = "published image for the prorl registry test\n"
IDS = ("o__r-1", "o__r-2")


def _missing() -> str | None:
    if apptainer_missing():
        return apptainer_missing()
    for tool in ("skopeo", "docker-registry"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/provision/26-registry-tools.sh installs it)"
    return None


needs_registry = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def _blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_oci_layout(layout: Path) -> None:
    """A one-layer OCI image layout: busybox, /bin/sh and cat, and a marker file."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("bin", "etc", "tmp"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data, mode in (("bin/busybox", Path("/bin/busybox").read_bytes(), 0o755),
                                 ("etc/prorl-marker", MARKER.encode(), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        for tool in ("sh", "cat"):
            info = tarfile.TarInfo(f"bin/{tool}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    layer = _blob(layout, gzip.compress(raw.getvalue(), mtime=0))
    config = _blob(layout, json.dumps({
        "architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()]},
    }).encode())
    manifest = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}],
    }).encode())
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **manifest,
        "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))


@pytest.fixture(scope="module")
def oci_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    layout = tmp_path_factory.mktemp("oci") / "layout"
    make_oci_layout(layout)
    return layout


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, oci_layout: Path) -> Iterator[str]:
    """``127.0.0.1:PORT`` of a running registry holding the test image under SWE-bench's names of :data:`IDS`."""
    root = tmp_path_factory.mktemp("registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = root / "config.yml"
    config.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
                      f"http:\n  addr: 127.0.0.1:{port}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    drain: subprocess.Popen[bytes] | None = None
    try:
        assert proc.stderr is not None
        log = []
        for line in proc.stderr:  # it says when it listens
            log.append(line)
            if "listening on" in line:
                break
        else:
            raise AssertionError("docker-registry exited before listening:\n" + "".join(log))
        # The registry keeps logging every request: drain its stderr so it never blocks on a full pipe.
        drain = subprocess.Popen(["cat"], stdin=proc.stderr, stdout=subprocess.DEVNULL)
        host = f"127.0.0.1:{port}"
        for iid in IDS:
            subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci:{oci_layout}:latest",
                            f"docker://{registry_template(f'docker://{host}/ns').reference(iid)}"],
                           check=True, capture_output=True, timeout=60)
        yield host
    finally:
        stop_group(proc, 10)
        if drain is not None:
            drain.wait(timeout=10)


def _dataset(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"instance_id": iid, "repo": "o/r", "version": "1", "base_commit": "abc", "problem_statement": "",
             "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": []} for iid in IDS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _swe_build(ws: Workspace, dataset: Path, source: str) -> tuple[dict[str, Any], str]:
    out = ws.prorl("build-images", "--swe", str(dataset), "--images-from", source, "--jobs", "2", "--json")
    return json.loads(out.stdout), out.stderr


def _marker(sif: str) -> str:
    return subprocess.run(["apptainer", "exec", sif, "cat", "/etc/prorl-marker"], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def test_naming_schemes_follow_the_datasets_own_rules() -> None:
    assert registry_template("docker://swebench").reference("astropy__astropy-12907") == \
        "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    reg = registry_template("docker://127.0.0.1:5000/mirror/{swegym}")
    assert reg.reference("Project-MONAI__MONAI-3715") == "127.0.0.1:5000/mirror/sweb.eval.x86_64.project-monai_s_monai-3715"
    smith = registry_template("docker://h:1/" + SCHEMES["swesmith"].namespace + "/{swesmith}")
    assert smith.reference("pandas-dev__pandas.95280573.pr_53652") == "h:1/jyangballin/swesmith.x86_64.pandas-dev_1776_pandas.95280573"
    assert instance_fields("o__r-1").get("smith_repo") is None  # not an id in SWE-smith's form
    assert registry_template("docker://r.example/x/{swerebench}").reference("qBraid__pyqasm-120") == \
        "r.example/x/sweb.eval.x86_64.qbraid_1776_pyqasm-120"
    with pytest.raises(ConfigError, match="unknown field"):
        registry_template("docker://ns/{nope}")
    with pytest.raises(ConfigError, match="does not apply"):
        smith.reference("o__r-1")
    with pytest.raises(ConfigError, match="not a valid image reference"):
        registry_template("docker://ns/{instance_id}").reference("Upper__Case-1")


def test_loopback_and_listed_registries_are_pulled_over_plain_http() -> None:
    assert plain_http("127.0.0.1:5000/ns/img:1", []) and plain_http("localhost:5000/ns/img", [])
    assert plain_http("[::1]:5000/ns/img", []) and plain_http("[::1]/ns/img", [])
    assert plain_http("reg.example:5000/ns/img", ["reg.example:5000"])
    assert not plain_http("reg.example:5000/ns/img", []) and not plain_http("swebench/img", [])
    assert not plain_http("[2001:db8::1]:5000/ns/img", [])


def test_images_on_disk_are_recognised_by_their_index(tmp_path: Path) -> None:
    def archive(name: str, members: dict[str, bytes]) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    oci = archive("o__r-1.tar", {"oci-layout": b"{}", "index.json": b'{"v": 1}', "blobs/sha256/aa": b"layer"})
    saved = archive("o__r-2.oci.tar", {"manifest.json": b"[]", "aa/layer.tar": b"layer"})
    archive("o__r-3.tar", {"README": b"not an image"})
    assert on_disk(tmp_path, "o__r-1") == ("oci-archive", oci)
    assert on_disk(tmp_path, "o__r-2") == ("docker-archive", saved)
    with pytest.raises(ConfigError, match="neither an OCI archive"):
        on_disk(tmp_path, "o__r-3")
    assert on_disk(tmp_path, "o__r-4") is None
    before = saved_image_digest("oci-archive", oci)
    archive("o__r-1.tar", {"oci-layout": b"{}", "index.json": b'{"v": 2}', "blobs/sha256/aa": b"layer"})
    assert saved_image_digest("oci-archive", oci) != before  # a new image is a new key


@pytest.mark.apptainer
@pytest.mark.timeout(300)
@needs_registry
def test_swe_images_pulled_from_a_local_registry_then_reused(registry: str, tmp_path: Path, ws: Workspace,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPTAINER_CACHEDIR", str(tmp_path / "apptainer-cache"))  # no layers from earlier runs
    ws.cache.mkdir()
    ws.cache.chmod(0o2775)  # a cache shared by a group
    dataset = _dataset(tmp_path / "published.jsonl")
    first, stderr = _swe_build(ws, dataset, f"docker://{registry}/ns/{{swebench}}")
    results = {r["name"]: r for r in first["results"]}
    assert sorted(r["action"] for r in results.values()) == ["built", "built"], stderr
    assert {r["reasons"][0] for r in results.values()} == {"no lock build of swe-i-o__r-1 in the cache",
                                                           "no lock build of swe-i-o__r-2 in the cache"}
    assert first["problems"] == {}
    mapping = first["repo_images"]
    assert sorted(mapping) == list(IDS)
    assert _marker(mapping["o__r-1"]) == MARKER  # the pushed image, pulled over plain HTTP
    # No spurious warnings: spython's "doesn't exist" and "FROM published: replaced" are gone.
    assert "WARNING" not in stderr and "doesn't exist" not in stderr and "not converted" not in stderr, stderr
    assert "2/2 image(s) ready" in stderr and "--no-https" in stderr  # loopback: plain HTTP
    sif = Path(mapping["o__r-2"])
    assert stat.S_IMODE(sif.stat().st_mode) & 0o064 == 0o064  # group may read and write, others read
    assert sif.parent.stat().st_mode & (stat.S_IWGRP | stat.S_ISGID) == stat.S_IWGRP | stat.S_ISGID

    # Another copy of the dataset (another user's, say) finds the same images in the shared cache.
    other = _dataset(tmp_path / "elsewhere" / "published.jsonl")
    again, _ = _swe_build(ws, other, f"docker://{registry}/ns/{{swebench}}")
    assert [r["action"] for r in again["results"]] == ["reused", "reused"]
    assert again["repo_images"] == mapping


@pytest.mark.apptainer
@pytest.mark.timeout(300)
@needs_registry
def test_oci_archives_and_layouts_on_disk_are_converted(oci_layout: Path, tmp_path: Path, ws: Workspace,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPTAINER_CACHEDIR", str(tmp_path / "apptainer-cache"))
    folder = tmp_path / "published"
    folder.mkdir()
    subprocess.run(["skopeo", "copy", "--quiet", f"oci:{oci_layout}:latest", f"oci-archive:{folder / 'o__r-1.tar'}"],
                   check=True, capture_output=True, timeout=60)
    shutil.copytree(oci_layout, folder / "o__r-2")
    dataset = _dataset(tmp_path / "on-disk.jsonl")
    first, stderr = _swe_build(ws, dataset, str(folder))
    assert [r["action"] for r in first["results"]] == ["built", "built"], stderr
    assert _marker(first["repo_images"]["o__r-1"]) == MARKER
    assert _marker(first["repo_images"]["o__r-2"]) == MARKER
    again, _ = _swe_build(ws, dataset, str(folder))
    assert [r["action"] for r in again["results"]] == ["reused", "reused"]
