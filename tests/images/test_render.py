"""Rendering, configuration errors, keys and decisions: everything that needs no Apptainer."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorl_cli.config import config_from_dict
from prorl_cli.exceptions import ConfigError
from prorl_cli.images.render import bootstrap_header, host_debian_mirror
from prorl_cli.images.spec import Base, load_image_specs

from .conftest import Workspace


def test_missing_variable_names_template_line_and_variable(ws: Workspace) -> None:
    (ws.root / "mine.def.j2").write_text("{{ bootstrap }}\n\n%files\n    {{ name }} /opt/name\n%post\n    echo {{ greeting }}\n")
    ws.write({"mine": {"template": "mine.def.j2", "base": "scratch"}})
    out = ws.prorl("build-images", "--dry-run", check=False)
    assert out.returncode == 1
    assert "mine.def.j2, line 6" in out.stderr
    assert "undefined variable 'greeting'" in out.stderr
    assert "images.mine.variables" in out.stderr


def test_syntax_error_and_unknown_template_are_named(ws: Workspace) -> None:
    (ws.root / "broken.def.j2").write_text("{{ bootstrap }}\n%post\n  {% if x %}\n    echo\n")
    ws.write({"broken": {"template": "broken.def.j2", "base": "scratch"}})
    out = ws.prorl("build-images", "--dry-run", check=False)
    assert out.returncode == 1 and "broken.def.j2, line 4" in out.stderr and "syntax error" in out.stderr
    ws.write({"gone": {"template": "nowhere.def.j2", "base": "scratch"}})
    out = ws.prorl("build-images", "--dry-run", check=False)
    assert out.returncode == 1 and "template 'nowhere.def.j2' not found" in out.stderr


def test_a_template_needs_no_tool_server(ws: Workspace) -> None:
    """The runtimes bind the tool server: a bare recipe builds, and the old copy setting is an unknown key."""
    (ws.root / "bare.def.j2").write_text("{{ bootstrap }}\n%post\n    true\n")
    ws.write({"bare": {"template": "bare.def.j2", "base": "scratch"}})
    assert ws.dry_run()["bare"]["action"] == "would-build"
    ws.write({"bare": {"template": "bare.def.j2", "base": "scratch", "tool_server": "bind"}})
    out = ws.prorl("build-images", "--dry-run", check=False)
    assert out.returncode == 1 and "images.bare: unknown key(s) ['tool_server']" in out.stderr


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"template": "busybox.def.j2"}, "images.x: missing required key 'base'"),
        ({"template": "busybox.def.j2", "base": "ftp://x"}, "images.x.base: unknown base 'ftp://x'"),
        ({"template": "busybox.def.j2", "base": "scratch", "colour": 1}, "images.x: unknown key(s) ['colour']"),
        ({"template": "busybox.def.j2", "base": "scratch", "files": ["nope.txt:/n"]}, "images.x.files[0].src:"),
        ({"template": "busybox.def.j2", "base": "scratch", "files": ["data.txt:rel"]}, "images.x.files[0].dst: must be an absolute path"),
        ({"template": "busybox.def.j2", "base": "scratch", "lockfile": "missing.txt"}, "images.x.lockfile:"),
        ({"template": "busybox.def.j2", "base": "image:y"}, "images.x.base: image:y is not in this image list"),
    ],
)
def test_bad_image_config_names_file_and_key(ws: Workspace, entry: dict[str, object], message: str) -> None:
    ws.write({"x": entry})
    with pytest.raises(ConfigError) as e:
        load_image_specs(ws.root / "images.yaml")
    assert str(ws.root / "images.yaml") in str(e.value)
    assert message in str(e.value)
    out = ws.prorl("build-images", "--dry-run", check=False)  # the CLI says the same, without a traceback
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr


def test_base_cycle_is_reported(ws: Workspace) -> None:
    ws.write({"a": {"template": "busybox.def.j2", "base": "image:b"}, "b": {"template": "busybox.def.j2", "base": "image:a"}})
    with pytest.raises(ConfigError, match="image base cycle: a -> b -> a"):
        load_image_specs(ws.root / "images.yaml")


def test_bad_images_section_of_prorl_yaml() -> None:
    with pytest.raises(ConfigError, match=r"prorl.yaml: images.mode: expected one of \['scratch', 'versioned', 'lock'\]"):
        config_from_dict({"images": {"mode": "sometimes"}}, "prorl.yaml")
    with pytest.raises(ConfigError, match="images.jobs: must be at least 1"):
        config_from_dict({"images": {"jobs": 0}}, "prorl.yaml")
    with pytest.raises(ConfigError, match=r"images.build_ssh: 'a/b' is not an id"):
        config_from_dict({"images": {"build_ssh": {"a/b": "/x"}}}, "prorl.yaml")
    with pytest.raises(ConfigError, match=r"images.build_secrets: 'a b' is not an id"):
        config_from_dict({"images": {"build_secrets": {"a b": "/x"}}}, "prorl.yaml")
    with pytest.raises(ConfigError, match=r"images.build_secrets.tok: 'env:1X': env: takes a variable name"):
        config_from_dict({"images": {"build_secrets": {"tok": "env:1X"}}}, "prorl.yaml")
    with pytest.raises(ConfigError, match=r"images.build_secrets"):
        config_from_dict({"images": {"build_secrets": {"tok": 5}}}, "prorl.yaml")


def test_host_mirror_comes_from_deb822_sources(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "a.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n"
    )
    assert host_debian_mirror(d, tmp_path / "none.list") == "http://mirror.invalid/debian"
    (d / "a.sources").unlink()
    (tmp_path / "sources.list").write_text("# old style\ndeb [arch=amd64] http://other.invalid/debian bookworm main\n")
    assert host_debian_mirror(d, tmp_path / "sources.list") == "http://other.invalid/debian"
    (tmp_path / "sources.list").unlink()
    assert host_debian_mirror(d, tmp_path / "sources.list") is None


def test_bootstrap_headers_for_every_base_kind(tmp_path: Path) -> None:
    deb = bootstrap_header(Base("debootstrap", "bookworm"), base_path=None, mirror="http://m.invalid/debian", docker_registry=None, include=["python3"])
    assert deb.splitlines() == ["Bootstrap: debootstrap", "OSVersion: bookworm", "MirrorURL: http://m.invalid/debian", "Include: python3"]
    docker = bootstrap_header(Base("docker", "python:3.11-slim"), base_path=None, mirror=None, docker_registry="registry.site.invalid")
    assert docker.splitlines() == ["Bootstrap: docker", "From: python:3.11-slim", "Registry: registry.site.invalid"]
    # A reference with its own registry is pulled from there: the site's mirror in front would make it invalid.
    own = bootstrap_header(Base("docker", "127.0.0.1:5000/ns/img:1"), base_path=None, mirror=None,
                           docker_registry="registry.site.invalid")
    assert own.splitlines() == ["Bootstrap: docker", "From: 127.0.0.1:5000/ns/img:1"]
    local = bootstrap_header(Base("localimage", "/x/y.sif"), base_path=None, mirror=None, docker_registry=None)
    assert local == "Bootstrap: localimage\nFrom: /x/y.sif"
    dep = bootstrap_header(Base("image", "base"), base_path=tmp_path / "b.sif", mirror=None, docker_registry=None)
    assert dep == f"Bootstrap: localimage\nFrom: {tmp_path / 'b.sif'}"
    with pytest.raises(ConfigError, match="no Debian mirror"):
        bootstrap_header(Base("debootstrap", "bookworm"), base_path=None, mirror=None, docker_registry=None)


def test_shipped_recipes_render_with_configured_mirror(ws: Workspace) -> None:
    ws.write(config_file=None, mirror="http://mirror.invalid/debian")
    (ws.root / "images.yaml").unlink()
    plans = ws.dry_run()  # the shipped sif_recipes/images.yaml
    assert set(plans) == {"base", "python", "math", "swe", "harness"}
    assert "-r /opt/prorl/lock/" in plans["harness"]["definition"]  # the harness lockfile is pip-installed
    assert "Include: python3 python3-sympy" in plans["math"]["definition"]
    assert "MirrorURL: http://mirror.invalid/debian" in plans["base"]["definition"]
    assert "OSVersion: bookworm" in plans["python"]["definition"]
    assert "Include: python3 python3-pip python3-venv git ca-certificates" in plans["swe"]["definition"]
    for p in plans.values():
        assert "tool_server" not in p["definition"] and "PRORL_TOOL_SERVER" not in p["definition"]
    assert "git" in plans["swe"]["definition"]


def test_keys_per_mode_follow_the_right_inputs(ws: Workspace) -> None:
    """Dry runs in separate processes: a copied file moves the lock key only; the base moves both."""
    lock1, ver1 = ws.dry_run("--mode", "lock")["tiny"], ws.dry_run("--mode", "versioned")["tiny"]
    assert ws.dry_run("--mode", "lock")["tiny"]["key"] == lock1["key"]  # stable across processes
    assert lock1["key"].startswith("lock-") and ver1["key"].startswith("versioned-")
    (ws.root / "data.txt").write_text("two\n")
    lock2, ver2 = ws.dry_run("--mode", "lock")["tiny"], ws.dry_run("--mode", "versioned")["tiny"]
    assert lock2["key"] != lock1["key"] and ver2["key"] == ver1["key"]
    ws.write({"tiny": {**ws.images["tiny"], "base": "localimage:other.sif"}})
    lock3, ver3 = ws.dry_run("--mode", "lock")["tiny"], ws.dry_run("--mode", "versioned")["tiny"]
    assert lock3["key"] != lock2["key"] and ver3["key"] != ver2["key"]
    assert f"From: {ws.root / 'other.sif'}" in lock3["definition"]


def test_dry_run_prints_definitions_and_decisions(ws: Workspace) -> None:
    out = ws.prorl("build-images", "--dry-run")
    assert "tiny: lock key lock-" in out.stdout and "no lock build of tiny in the cache" in out.stdout
    assert "Bootstrap: scratch" in out.stdout and "/data.txt" in out.stdout
    assert not (ws.cache / "manifest.json").exists()


def test_example_image_list_renders(ws: Workspace) -> None:
    ws.write(config_file=str(Path(__file__).resolve().parents[2] / "examples" / "images.yaml"), mirror="http://mirror.invalid/debian",
             docker_registry="registry.site.invalid")
    plans = ws.dry_run()
    assert set(plans) == {"base", "python", "math", "swe", "python-oci"}
    assert "Bootstrap: docker\nFrom: python:3.11-slim\nRegistry: registry.site.invalid" in plans["python-oci"]["definition"]
    assert "(cd /testbed && git init -q .)" in plans["swe"]["definition"]
    assert "python3-numpy" in plans["python"]["definition"]


def test_dockerfile_conversion_warns_only_about_what_it_drops(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                              caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from prorl_cli.images.dockerfile import convert_dockerfile
    from prorl_cli.images.spec import parse_image

    context = tmp_path / "recipe"
    context.mkdir()
    (context / "repo.bundle").write_bytes(b"bundle")
    (context / "Dockerfile").write_text("FROM prorl-swe-base\nARG NO_DEFAULT\nCOPY repo.bundle /opt/repo.bundle\n"
                                        "EXPOSE 80\n")
    monkeypatch.chdir(tmp_path)  # spython looked for COPY sources here, and warned on every --swe build
    spec = parse_image("img", {"template": "Dockerfile", "base": "scratch"}, "images.yaml: images.img", context, None)
    with caplog.at_level(logging.DEBUG, logger="prorl.images"):
        conv = convert_dockerfile(context / "Dockerfile", spec, header="Bootstrap: scratch", prorl_version="0")
    assert capfd.readouterr().err == ""  # spython itself prints nothing
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2, warned
    assert "line 4: EXPOSE 80" in warned[0]
    assert "spython: ARG is not supported" in warned[1] and "NO_DEFAULT" in warned[1]
    # The base replacing FROM is what the image list asked for: a comment in the definition, not a warning.
    assert "# prorl: not converted: FROM prorl-swe-base: replaced by the image list's base scratch" in conv.definition
    assert f"{context}/repo.bundle /opt/repo.bundle" in conv.definition
