"""Dockerfile recipes: what the converted definition does must be what ``docker build`` would have done.

The conversion tests read the definition prorl writes (no Apptainer needed);
the last test builds one real image from a Dockerfile and reads its files.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import re
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerfile import Conversion, convert_dockerfile
from prorl_cli.images.dockerfile_mounts import BuildMounts, CacheMount, cache_key
from prorl_cli.images.spec import parse_image

from .conftest import Workspace, needs_apptainer


def convert(context: Path, dockerfile: str, *, keep_caches: bool = False, secrets: set[str] | None = None) -> Conversion:
    """Convert ``dockerfile`` written into ``context`` for an image on a scratch base."""
    (context / "Dockerfile").write_text(dockerfile)
    spec = parse_image("img", {"template": "Dockerfile", "base": "scratch"}, "images.yaml: images.img", context, None)
    return convert_dockerfile(context / "Dockerfile", spec, header="Bootstrap: scratch", prorl_version="0",
                              mounts=BuildMounts(keep_caches, frozenset(secrets or ())))


def section(definition: str, name: str) -> list[str]:
    """The lines of one %section of a definition."""
    lines = definition.split(f"\n%{name}\n", 1)[1].split("\n%", 1)[0]
    return lines.splitlines()


def in_image(image: dict[str, Any], *argv: str) -> str:
    """The output of ``argv`` run in a built image (``apptainer exec``; as root, in a user namespace)."""
    args = ["apptainer", "exec", *(["--userns"] if os.geteuid() == 0 else []), image["path"], *argv]
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=60).stdout


def on_busybox(ws: Workspace, *, stages: bool = False, **settings: Any) -> None:
    """The image list: the workspace's Dockerfile as ``app`` on a busybox root image (``stages``: its other stages'
    ``FROM busybox`` too), and ``settings`` in prorl.yaml's images section."""
    app: dict[str, Any] = {"template": "Dockerfile", "base": "image:root"}
    if stages:
        app["stage_bases"] = {"busybox": "image:root"}
    ws.write({"root": {"template": "busybox.def.j2", "base": "scratch"}, "app": app}, **settings)


def app_result(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """``app``'s result in the output of ``prorl build-images --json``."""
    (app,) = [r for r in json.loads(out.stdout) if r["name"] == "app"]
    return app


def built(ws: Workspace, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    """``prorl build-images --json ARGS app``, which must build ``app``: its result and the CLI's run."""
    out = ws.prorl("build-images", "--json", *args, "app", env=env)
    app = app_result(out)
    assert app["action"] == "built", (app, out.stderr)
    return app, out


def failed_build(ws: Workspace) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Build the workspace's Dockerfile on a busybox root image, which must fail: its result and the CLI's run."""
    on_busybox(ws)
    out = ws.prorl("build-images", "--json", "--mode", "lock", "app", check=False)
    assert out.returncode == 1, out.stdout
    return app_result(out), out


def test_env_and_arg_reach_the_programs_later_steps_run(tmp_path: Path) -> None:
    """In Docker ENV and ARG are environment variables of every later RUN; a bare shell assignment is not."""
    conv = convert(tmp_path, "FROM debian\nARG PIP_INDEX_URL=https://mirror.site/simple\n"
                             "ENV DEBIAN_FRONTEND=noninteractive \\\n    PIP_NO_CACHE_DIR=1\nENV MSG hello world\n"
                             "RUN apt-get install -y git && pip install numpy\n")
    post = section(conv.definition, "post")
    assert post[:4] == ["export PIP_INDEX_URL=https://mirror.site/simple", "export DEBIAN_FRONTEND=noninteractive",
                        "export PIP_NO_CACHE_DIR=1", 'export MSG="hello world"'], post
    assert 'export MSG="hello world"' in section(conv.definition, "environment")


def test_relative_copy_destinations_follow_workdir_and_folders_copy_their_contents(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("numpy\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("print(1)\n")
    (tmp_path / ".dockerignore").write_text("*.pyc\n")
    conv = convert(tmp_path, "FROM python\nWORKDIR /testbed\nCOPY requirements.txt .\nCOPY src/ ./src/\n"
                             "WORKDIR lib\nCOPY src sub\nRUN pip install -r ../requirements.txt\n")
    assert not any("dockerignore" in n for n in conv.not_converted), conv.not_converted
    assert section(conv.definition, "files") == [
        f"{tmp_path}/requirements.txt /testbed/requirements.txt",
        f"{tmp_path}/src/. /testbed/src/",  # Docker copies the folder's contents, not the folder
        f"{tmp_path}/src/. /testbed/lib/sub",
    ]
    post = section(conv.definition, "post")
    assert post[-3:] == ["mkdir -p /testbed/lib", "cd /testbed/lib", "/bin/sh -c 'pip install -r ../requirements.txt'"], post


def test_env_and_arg_values_are_expanded_where_docker_expands_them(tmp_path: Path) -> None:
    """A %files destination is not expanded by a shell: `COPY . $APP_HOME` made a folder named `$APP_HOME`."""
    (tmp_path / "app.py").write_text("print(1)\n")
    conv = convert(tmp_path, "FROM python\nARG PY=3.11\nENV APP_HOME=/srv/app PATH=/opt/py$PY/bin:$PATH\n"
                             'ENV GREETING="hello world"\nENV MESSAGE=$GREETING\n'  # one variable: spython failed on it
                             "WORKDIR $APP_HOME\nCOPY app.py ${APP_HOME}/bin/\nCOPY app.py ${CONF_DIR:-/etc/app}/\n")
    assert section(conv.definition, "files") == [f"{tmp_path}/app.py /srv/app/bin/app.py",
                                                 f"{tmp_path}/app.py /etc/app/app.py"]
    # At run time there is no ARG: the value was fixed at build time; the base image's $PATH is the shell's.
    assert section(conv.definition, "environment")[:4] == ["export APP_HOME=/srv/app", "export PATH=/opt/py3.11/bin:$PATH",
                                                         'export GREETING="hello world"', 'export MESSAGE="hello world"']
    assert section(conv.definition, "post")[-2:] == ["mkdir -p /srv/app", "cd /srv/app"]


def test_labels_are_name_value_pairs(tmp_path: Path) -> None:
    conv = convert(tmp_path, 'FROM debian\nARG V=1.2\nLABEL org.opencontainers.image.version=$V description="a b"\n'
                             "LABEL legacy some value\nMAINTAINER Ada <ada@example.org>\n")
    assert section(conv.definition, "labels")[:4] == ["org.opencontainers.image.version 1.2", "description a b",
                                                      "legacy some value", "maintainer Ada <ada@example.org>"]


def test_comment_lines_inside_a_continued_run_are_dropped(tmp_path: Path) -> None:
    """Kept, a comment line would comment out the rest of the joined command (and run the next line alone)."""
    conv = convert(tmp_path, "FROM debian\nRUN apt-get install -y \\\n    # version control\n\n    git \\\n"
                             "    curl\n")
    assert section(conv.definition, "post") == ["/bin/sh -c 'apt-get install -y     git     curl'"]


def test_here_documents_run_their_bodies(tmp_path: Path) -> None:
    conv = convert(tmp_path, "FROM python\nWORKDIR /app\nRUN <<EOF\nset -e\necho built > /built\nEOF\n"
                             "RUN python3 - <<'PY'\nfrom os import environ\n\nenv = 1\nPY\n"
                             "COPY <<EOF conf/app.ini\n[app]\n\nname = x\nEOF\n")
    post = "\n".join(section(conv.definition, "post"))
    assert "/bin/sh -c 'set -e\necho built > /built'" in post  # a lone here-document is the script
    # A here-document for a command stays one (its empty lines too: "from x import y" is no FROM).
    assert "/bin/sh -c 'python3 - <<'\"'\"'PY'\"'\"'\nfrom os import environ\n\nenv = 1\nPY'" in post
    assert "mkdir -p /app/conf\ncat > /app/conf/app.ini <<EOF\n[app]\n\nname = x\nEOF" in post


def test_copy_flags_are_reported_not_taken_for_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a\n")
    conv = convert(tmp_path, "FROM debian\nCOPY --chmod=644 --keep-git-dir a.txt /opt/a.txt\n"
                             'COPY --from=builder /out /out\nCOPY --link ["a.txt", "/opt/json/"]\n')
    # The copy after the one from another stage (moved in place by a %post step) waits for its turn too.
    assert section(conv.definition, "files") == [f"{tmp_path}/a.txt /opt/a.txt", f"{tmp_path}/a.txt /.prorl-copy/3-0/a.txt"]
    assert "cp -f /.prorl-copy/3-0/a.txt /opt/json/a.txt" in section(conv.definition, "post")
    assert any("flags --keep-git-dir are ignored" in n for n in conv.not_converted), conv.not_converted
    assert section(conv.definition, "post")[0] == "chmod 644 /opt/a.txt"  # --chmod, once the copy is in place
    # No stage is called builder: Docker reads it as an image, which a stage of its own bootstraps.
    assert conv.definition.startswith("Bootstrap: docker\nFrom: builder\nStage: image0\n")
    assert section(conv.definition, "files from image0") == ["    /out /.prorl-copy/2-0/out"]


def test_run_flags_are_options_of_the_step_not_words_of_its_command(tmp_path: Path) -> None:
    """`RUN --mount=type=cache,... pip install` ran `sh -c '--mount=... pip install'`, which failed with "not found"."""
    conv = convert(tmp_path, "FROM python\nRUN --mount=type=cache,target=/root/.cache/pip --network=default pip install x\n"
                             'RUN --mount=type=secret,id=tok ["cat", "/run/secrets/tok"]\n'
                             "RUN --mount=type=cache,target=/c <<EOF\necho a\nEOF\n")
    post = section(conv.definition, "post")
    assert "if /bin/sh -c 'pip install x'; then prorl_rc=0; else prorl_rc=$?; fi" in post, post
    assert post.count("cat /run/secrets/tok") == 1, post  # a secret that is not required: the step runs without it
    assert "if /bin/sh -c 'echo a'; then prorl_rc=0; else prorl_rc=$?; fi" in post, post
    assert not any("--mount" in line for line in post), post
    assert any(n.startswith("line 2: RUN --network=default - ignored") for n in conv.not_converted), conv.not_converted
    assert any(n.startswith("line 3: RUN --mount=type=secret,id=tok - no secret tok") for n in conv.not_converted)
    assert not any("type=cache" in n for n in conv.not_converted), conv.not_converted


def test_run_mounts_are_in_place_for_their_step_only(tmp_path: Path) -> None:
    """uv's documented Dockerfile binds uv.lock and pyproject.toml for `uv sync`: dropped, the step found neither."""
    (tmp_path / "uv.lock").write_text("lock\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    conv = convert(tmp_path, "FROM python\nWORKDIR /app\n"
                             "RUN --mount=type=cache,target=/root/.cache/uv \\\n"
                             "    --mount=type=bind,source=uv.lock,target=uv.lock \\\n"
                             "    --mount=type=bind,source=/pyproject.toml,target=pyproject.toml \\\n"
                             "    uv sync --locked\n")
    assert section(conv.definition, "files") == [f"{tmp_path}/uv.lock /.prorl-copy/mount-2-1",
                                                  f"{tmp_path}/pyproject.toml /.prorl-copy/mount-2-2"]
    assert {f.dst for f in conv.files} == {"/.prorl-copy/mount-2-1", "/.prorl-copy/mount-2-2"}  # in the lock key
    post = "\n".join(section(conv.definition, "post"))
    put = [post.index(s) for s in ("mkdir -p /root/.cache/uv", "mv /.prorl-copy/mount-2-1 /app/uv.lock",
                                   "mv /.prorl-copy/mount-2-2 /app/pyproject.toml", "cd /app\nif /bin/sh -c 'uv sync --locked'")]
    taken = [post.index(s) for s in ("rm -rf /app/pyproject.toml", "rm -rf /app/uv.lock", "rm -rf /root/.cache/uv",
                                     'if [ "$prorl_rc" -ne 0 ]; then exit "$prorl_rc"; fi')]
    assert put == sorted(put) and taken == sorted(taken) and put[-1] < taken[0], post
    # What the image had at a target waits aside and comes back.
    assert "if [ -e /app/uv.lock ] || [ -L /app/uv.lock ]; then mv /app/uv.lock /.prorl-copy/aside-2-1; fi" in post
    assert "if [ -e /.prorl-copy/aside-2-1 ] || [ -L /.prorl-copy/aside-2-1 ]; then mv /.prorl-copy/aside-2-1 /app/uv.lock; fi" in post
    assert conv.not_converted == ["FROM python: replaced by the image list's base scratch"], conv.not_converted


def test_a_bind_mount_from_a_stage_builds_that_stage(tmp_path: Path) -> None:
    conv = convert(tmp_path, "FROM python AS wheels\nRUN pip wheel -w /wheels numpy\nFROM python AS unused\n"
                             "FROM python\nRUN --mount=from=wheels,source=/wheels,target=/tmp/wheels pip install /tmp/wheels/*\n")
    assert "Stage: wheels" in conv.definition and "Stage: unused" not in conv.definition
    assert section(conv.definition, "files from wheels") == ["    /wheels /.prorl-copy/4m0-0/wheels"]
    post = conv.definition.rsplit("\n%post\n", 1)[1].splitlines()  # the target's
    assert "mv /.prorl-copy/mount-4-0 /tmp/wheels" in post and "rm -rf /.prorl-copy/4m0-*" in post, post


def test_a_cache_mount_links_to_a_folder_kept_between_builds(tmp_path: Path) -> None:
    """As in Docker, a cache (by id, else by target) outlives the step and the build, and no image holds it."""
    conv = convert(tmp_path, "FROM python AS wheels\n"
                             "RUN --mount=type=cache,id=pip,target=/root/.cache/pip,sharing=locked pip wheel -w /w x\n"
                             "FROM python\nCOPY --from=wheels /w /w\n"
                             "RUN --mount=type=cache,target=/root/.cache/pip --mount=type=cache,target=/tmp/p,sharing=private "
                             "pip install /w/*\n", keep_caches=True)
    pip, by_target = cache_key("pip"), cache_key("/root/.cache/pip")
    assert conv.caches == [CacheMount(pip, locked=True), CacheMount(by_target, locked=False)]
    wheels, final = conv.definition.split("Stage: ")[1:]
    assert f"ln -s /.prorl-cache/{pip} /root/.cache/pip" in wheels, wheels
    assert f"ln -s /.prorl-cache/{by_target} /root/.cache/pip" in final, final
    assert "mkdir -p /tmp/p" in final  # a private cache is the step's own empty folder
    # The builder binds every cache into every stage's %post: each stage makes every bind's folder.
    for stage in (wheels, final):
        assert section(stage, "setup")[:2] == [f'mkdir -p "$APPTAINER_ROOTFS"/.prorl-cache/{key}' for key in (pip, by_target)]
    moded = convert(tmp_path, "FROM python\nRUN --mount=type=cache,target=/m,mode=0777 true\n", keep_caches=True)
    assert f"ln -s /.prorl-cache/{cache_key('/m')} /m\nchmod 0777 /m" in moded.definition  # the kept folder's mode
    off = convert(tmp_path, "FROM python\nRUN --mount=type=cache,target=/root/.cache/pip pip install x\n")
    assert off.caches == [] and "%setup" not in off.definition and "mkdir -p /root/.cache/pip" in off.definition


def test_a_secret_the_build_is_given_is_the_steps_for_that_step_only(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(
        "FROM python\nRUN --mount=type=secret,id=pypi,target=/root/.pypirc --mount=type=secret,id=tok,env=TOKEN "
        "pip install x\nRUN --mount=type=secret,id=other,required=true true\n")
    spec = parse_image("img", {"template": "Dockerfile", "base": "scratch"}, "images.yaml: images.img", tmp_path, None)
    with pytest.raises(ConfigError, match=r"line 3: .*requires the secret other; give it in prorl.yaml, "
                                          r"images.build_secrets: \{other: /path/to/file\}"):
        convert_dockerfile(tmp_path / "Dockerfile", spec, header="Bootstrap: scratch", prorl_version="0",
                           mounts=BuildMounts(secrets=frozenset({"pypi", "tok"})))
    conv = convert(tmp_path, "FROM python\nRUN --mount=type=secret,id=pypi,target=/root/.pypirc "
                             "--mount=type=secret,id=tok,env=TOKEN --mount=type=secret,target=/run/secrets/gh,uid=7 "
                             "pip install x\n", secrets={"pypi", "tok", "gh"})
    assert conv.secrets == ["pypi", "tok", "gh"]
    assert section(conv.definition, "setup") == ['mkdir -p "$APPTAINER_ROOTFS"/.prorl-secrets',
                                                 'touch "$APPTAINER_ROOTFS"/.prorl-secrets/pypi',
                                                 'touch "$APPTAINER_ROOTFS"/.prorl-secrets/tok',
                                                 'touch "$APPTAINER_ROOTFS"/.prorl-secrets/gh']
    post = "\n".join(section(conv.definition, "post"))
    order = [post.index(line) for line in (
        "cp /.prorl-secrets/pypi /root/.pypirc\nchmod 0400 /root/.pypirc",  # a file only the step's root reads
        "{ prorl_x=$-; set +x; } 2>/dev/null\nTOKEN=$(cat /.prorl-secrets/tok); export TOKEN",  # never traced
        "cp /.prorl-secrets/gh /run/secrets/gh\nchmod 0400 /run/secrets/gh\nchown 7:0 /run/secrets/gh",
        "if /bin/sh -c 'pip install x'; then", "rm -f /run/secrets/gh", "unset TOKEN", "rm -f /root/.pypirc")]
    assert order == sorted(order), post


def test_a_mount_from_a_global_build_argument_builds_that_stage(tmp_path: Path) -> None:
    """BuildKit names the stage a mount reads by the global build arguments, as it does a COPY's --from."""
    conv = convert(tmp_path, "ARG SRC=wheels\nFROM python AS wheels\nRUN pip wheel -w /wheels numpy\n"
                             "FROM python\nRUN --mount=from=$SRC,source=/wheels,target=/w pip install /w/*\n")
    assert "Stage: wheels" in conv.definition and "image0" not in conv.definition, conv.definition
    assert section(conv.definition, "files from wheels") == ["    /wheels /.prorl-copy/4m0-0/wheels"]


def test_copy_exclude_leaves_out_what_it_matches_below_each_source(tmp_path: Path) -> None:
    """BuildKit's COPY --exclude (general since Dockerfile 1.19): patterns relative to what each source copies from."""
    for rel in ("src/a.py", "src/a.txt", "src/tests/t.py", "src/pkg/p.py", "src/pkg/p.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    conv = convert(tmp_path, "FROM python AS b\nRUN make\nFROM python\n"
                             "COPY --exclude=tests --exclude=**/*.txt src/ /app/\n"
                             "COPY --exclude=*.txt src/a.py src/a.txt src/*.* /one/\nCOPY --exclude=x --from=b /out /out\n")
    assert section(conv.definition.split("Stage: ")[-1], "files") == [f"{tmp_path}/src/a.py /app/a.py", f"{tmp_path}/src/pkg/p.py /app/pkg/p.py",
                                                 f"{tmp_path}/src/a.py /one/a.py", f"{tmp_path}/src/a.py /one/a.py"]
    assert not [n for n in conv.not_converted if "--exclude" in n]
    # From another stage, the image's files are known only as the build runs: a step takes out what matches.
    assert "grep -E '^(x)(/.*)?$'" in conv.definition, conv.definition


@needs_apptainer
@pytest.mark.apptainer
def test_copy_exclude_from_another_stage_leaves_out_what_it_matches(ws: Workspace) -> None:
    """`COPY --from=builder --exclude=... /out /app`: below a folder source, relative to it; a file source by its
    name (then nothing is copied); a pattern's matches by theirs."""
    (ws.root / "Dockerfile").write_text(
        "FROM busybox AS builder\nRUN /bin/busybox --install -s /bin && mkdir -p /out/tests /out/pkg/tests && "
        "touch /out/a.py /out/a.txt /out/tests/t.py /out/pkg/p.py /out/pkg/p.txt /out/pkg/tests/k.py /out/one.txt\n"
        "FROM busybox\nRUN /bin/busybox --install -s /bin\n"
        "COPY --from=builder --exclude=tests --exclude=**/*.txt /out /app\n"
        "COPY --from=builder --exclude=*.txt /out/one.txt /f/\nCOPY --from=builder --exclude=a.* /out/*.* /pat/\n"
        "RUN mkdir -p /f && find /app /f /pat | sort > /found\n")
    on_busybox(ws, stages=True)
    image, _ = built(ws, "--mode", "lock")
    assert in_image(image, "cat", "/found").split() == [
        "/app", "/app/a.py", "/app/pkg", "/app/pkg/p.py", "/app/pkg/tests", "/app/pkg/tests/k.py", "/f", "/pat",
        "/pat/one.txt"]


def test_copy_parents_keeps_each_sources_folders(tmp_path: Path) -> None:
    for rel in ("src/tests/t.py", "src/pkg/p.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    conv = convert(tmp_path, "FROM python AS b\nRUN make\nFROM python\n"
                             "COPY --parents src/tests/t.py src/pkg /app/\nCOPY --parents ./src/./tests/t.py src/*/*.py /b/\n"
                             "COPY --parents --from=b /usr/./lib/x /opt/\n")
    final = conv.definition.split("Stage: ")[-1]
    assert section(final, "files") == [
        f"{tmp_path}/src/tests/t.py /app/src/tests/t.py", f"{tmp_path}/src/pkg/. /app/src/pkg",
        f"{tmp_path}/src/tests/t.py /b/tests/t.py",  # from the `/./`
        f"{tmp_path}/src/pkg/p.py /b/src/pkg/p.py", f"{tmp_path}/src/tests/t.py /b/src/tests/t.py"]
    assert "cp -fR /.prorl-copy/5-0/x/. /opt/lib/x/;" in final, final


def test_a_scratch_stage_is_no_warning(tmp_path: Path) -> None:
    """`FROM scratch` is Apptainer's own scratch bootstrap: spython's "not on Docker Hub" was a false warning."""
    (tmp_path / "a.txt").write_text("a\n")
    conv = convert(tmp_path, "FROM scratch AS assets\nCOPY a.txt /a.txt\nFROM python\nCOPY --from=assets /a.txt /\n")
    assert conv.definition.startswith("Bootstrap: scratch\nStage: assets"), conv.definition
    assert conv.not_converted == ["FROM python: replaced by the image list's base scratch"], conv.not_converted


@pytest.mark.parametrize(("mount", "error"), [
    ("type=secret,id=pypi,required=true", "requires the secret pypi"),
    ("type=bind,source=x", "a bind mount needs target=PATH"),
    ("type=volume,target=/x", "type 'volume' is not one of"),
    ("type=cache,target=/x,colour=red", "unknown key 'colour'"),
    ("type=bind,source=missing.txt,target=/x", "RUN --mount source 'missing.txt' does not exist"),
    ("type=cache,target=/", "a mount over / cannot be put in place"),
    ("type=cache,target=/x,sharing=exclusive", "sharing 'exclusive' is not one of shared, private, locked"),
    ("type=ssh,required=true", "requires the ssh default; give it in prorl.yaml, images.build_ssh: {default: $SSH_AUTH_SOCK}"),
    ("type=secret,required=true", "a secret mount needs id=NAME (or target=PATH)"),
    ("type=cache,target=/x,uid=app", "uid and gid are numbers"),
])
def test_a_mount_that_cannot_be_given_is_an_error_naming_it(tmp_path: Path, mount: str, error: str) -> None:
    with pytest.raises(ConfigError, match="line 2") as e:
        convert(tmp_path, f"FROM python\nRUN --mount={mount} true\n")
    assert error in str(e.value), e.value


def test_an_arg_before_from_is_global_as_in_docker(tmp_path: Path) -> None:
    """FROM sees it; a step sees it only where the stage declares it again, and then with the global value."""
    conv = convert(tmp_path, "ARG TAG=3.11-slim\nARG ONLY_FROM=x\nFROM python:${TAG}\nARG TAG\nRUN echo $TAG $ONLY_FROM\n")
    post = section(conv.definition, "post")
    assert post == ['export TAG="3.11-slim"', "/bin/sh -c 'echo $TAG $ONLY_FROM'"], post
    assert conv.from_image == "python:3.11-slim"
    assert not any("ARG" in n for n in conv.not_converted), conv.not_converted  # `ARG TAG` has Docker's default


def test_add_unpacks_a_local_archive(tmp_path: Path) -> None:
    data = b"one\n"
    with tarfile.open(tmp_path / "data.tgz", "w:gz") as tar:
        info = tarfile.TarInfo("d/f.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (tmp_path / "notes.gz").write_bytes(b"not a tar")
    conv = convert(tmp_path, "FROM debian\nADD data.tgz /opt/data\nADD notes.gz /opt/\n")
    assert section(conv.definition, "files") == [f"{tmp_path}/data.tgz /.prorl-add/1-data.tgz",
                                                 f"{tmp_path}/notes.gz /.prorl-copy/2-0/notes.gz"]
    post = section(conv.definition, "post")
    assert post == ["mkdir -p /opt/data/", "tar -xf /.prorl-add/1-data.tgz -C /opt/data/", "rm -f /.prorl-add/1-data.tgz",
                    "mkdir -p /opt", "cp -f /.prorl-copy/2-0/notes.gz /opt/notes.gz",  # not a tar: copied as it is
                    "rm -rf /.prorl-add", "rm -rf /.prorl-copy"], post


def test_each_run_is_its_own_shell_command_under_shell(tmp_path: Path) -> None:
    """A failure inside `a && b` fails the step (in %post's `sh -e` it did not); SHELL picks the shell."""
    conv = convert(tmp_path, "FROM debian\nRUN apt-get update && apt-get install -y git\n"
                             'SHELL ["/bin/bash", "-o", "pipefail", "-c"]\nRUN source /etc/profile && echo "$HOME"\n'
                             'RUN ["python3", "-c", "print(1)"]\n')
    assert section(conv.definition, "post") == ["/bin/sh -c 'apt-get update && apt-get install -y git'",
                                                "/bin/bash -o pipefail -c 'source /etc/profile && echo \"$HOME\"'",
                                                "python3 -c 'print(1)'"]
    assert conv.not_converted == ["FROM debian: replaced by the image list's base scratch"]


@pytest.mark.parametrize(
    ("instructions", "runscript"),
    [
        ('CMD ["python", "app.py"]', ['if [ "$#" -eq 0 ]; then set -- python app.py; fi', 'exec "$@"']),
        ('ENTRYPOINT ["python", "-m", "app"]\nCMD ["--port", "8 000"]',
         ['if [ "$#" -eq 0 ]; then set -- --port \'8 000\'; fi', 'exec python -m app "$@"']),
        ("CMD python app.py --name \"$USER\"",
         ['if [ "$#" -eq 0 ]; then set -- /bin/sh -c \'python app.py --name "$USER"\'; fi', 'exec "$@"']),
        ("ENTRYPOINT exec serve\nCMD [\"--ignored\"]", ["exec /bin/sh -c 'exec serve'"]),
        ("", None),  # none: Apptainer keeps the base image's runscript
    ],
)
def test_runscript_runs_what_docker_run_would(tmp_path: Path, instructions: str, runscript: list[str] | None) -> None:
    conv = convert(tmp_path, f"FROM debian\nWORKDIR /srv\n{instructions}\n")
    if runscript is None:
        assert "%runscript" not in conv.definition and "%startscript" not in conv.definition
        return
    assert section(conv.definition, "runscript") == ["cd /srv", *runscript]
    assert section(conv.definition, "startscript") == ["cd /srv", *runscript]


def test_variables_of_a_dockerfile_entry_are_its_build_args(ws: Workspace) -> None:
    """They were ignored: `ARG PY` stayed unset and `ARG TAG=old` kept its default, with no word."""
    (ws.root / "Dockerfile").write_text('FROM debian\nARG PY\nARG TAG=old MSG="a b"\nENV PYTHON=python$PY\n'
                                        "RUN echo $PY $TAG\n")
    ws.write({"app": {"template": "Dockerfile", "base": "scratch",
                      "variables": {"PY": "3.10", "TAG": "new $HOME", "UNUSED": 1}}})
    out = ws.prorl("build-images", "--dry-run", "--json", "app")
    (plan,) = json.loads(out.stdout)
    post = section(plan["definition"], "post")
    assert post[:4] == ['export PY="3.10"', 'export TAG="new \\$HOME"', 'export MSG="a b"', "export PYTHON=python3.10"]
    assert "variables.UNUSED: the Dockerfile has no ARG UNUSED" in out.stderr
    assert "ARG is not supported" not in out.stderr  # PY has its value now


def test_a_copy_after_a_run_lands_after_it(tmp_path: Path) -> None:
    """%files are all copied before %post: `RUN rm -rf /etc/app` would have deleted what a later COPY put there."""
    (tmp_path / "app.conf").write_text("x = 1\n")
    (tmp_path / "conf.d").mkdir()
    conv = convert(tmp_path, "FROM debian\nCOPY app.conf /opt/early.conf\nRUN rm -rf /etc/app\n"
                             "COPY app.conf /etc/app/\nCOPY conf.d /etc/app/conf.d\n")
    assert section(conv.definition, "files") == [f"{tmp_path}/app.conf /opt/early.conf",  # before any RUN: direct
                                                 f"{tmp_path}/app.conf /.prorl-copy/3-0/app.conf",
                                                 f"{tmp_path}/conf.d/. /.prorl-copy/4-0/"]
    assert section(conv.definition, "post") == ["/bin/sh -c 'rm -rf /etc/app'",
                                                "mkdir -p /etc/app", "cp -f /.prorl-copy/3-0/app.conf /etc/app/app.conf",
                                                "mkdir -p /etc/app/conf.d/", "cp -fR /.prorl-copy/4-0/. /etc/app/conf.d/",
                                                "rm -rf /.prorl-copy"]


def test_every_copy_into_one_folder_counts_toward_the_lock_key(ws: Workspace) -> None:
    for sub in ("src", "tests"):
        (ws.root / sub).mkdir()
        (ws.root / sub / f"{sub}.py").write_text("1\n")
    (ws.root / "Dockerfile").write_text("FROM debian\nCOPY src/ /app/\nCOPY tests/ /app/\n")
    ws.write({"app": {"template": "Dockerfile", "base": "scratch"}})
    before = ws.dry_run("--mode", "lock")["app"]["key"]
    (ws.root / "src" / "src.py").write_text("2\n")  # the first of the two copies into /app/
    assert ws.dry_run("--mode", "lock")["app"]["key"] != before


@needs_apptainer
@pytest.mark.apptainer
def test_a_converted_dockerfile_builds_what_docker_would(ws: Workspace) -> None:
    (ws.root / "requirements.txt").write_text("numpy\n")
    (ws.root / "src").mkdir()
    (ws.root / "src" / "app.py").write_text("print(1)\n")
    (ws.root / "Dockerfile").write_text(
        "FROM busybox\n"
        "RUN /bin/busybox --install -s /bin\n"
        "ENV GREETING=hello\n"
        "WORKDIR /testbed\n"
        "COPY requirements.txt .\n"
        "COPY src/ /testbed/src/\n"
        "RUN sh -c 'echo \"$GREETING\"' > /greeting && ls /testbed/src > /listing \\\n"
        "    # a comment Docker drops\n"
        "    && echo done > /done\n"
        "RUN <<EOF\necho heredoc > /heredoc\nEOF\n"
        "RUN mkdir -p /etc/app && echo old > /etc/app/app.conf\n"
        "COPY requirements.txt /etc/app/app.conf\n"
    )
    on_busybox(ws)
    image, _ = built(ws, "--mode", "lock")

    def cat(path: str) -> str:
        return in_image(image, "cat", path)

    assert cat("/testbed/requirements.txt") == "numpy\n"
    assert cat("/greeting") == "hello\n"  # ENV reached a child process of a RUN step
    assert cat("/listing") == "app.py\n"  # the folder's contents, not /testbed/src/src
    assert cat("/done") == "done\n"
    assert cat("/heredoc") == "heredoc\n"
    assert cat("/etc/app/app.conf") == "numpy\n"  # the COPY after the RUN won


@needs_apptainer
@pytest.mark.apptainer
def test_a_failure_inside_an_and_list_fails_the_build(ws: Workspace) -> None:
    """`docker build` stops at `RUN false && echo`; as a %post line it went on and published the image."""
    (ws.root / "Dockerfile").write_text("FROM busybox\nRUN false && echo never\nRUN echo after > /after\n")
    app, out = failed_build(ws)
    assert app["action"] == "failed" and "Running post scriptlet" in app["error"], app
    assert not Path(app["path"]).exists()


@needs_apptainer
@pytest.mark.apptainer
def test_a_run_with_mounts_sees_them_and_the_image_keeps_none_of_them(ws: Workspace) -> None:
    (ws.root / "lock.txt").write_text("from the context\n")
    (ws.root / "data").mkdir()
    (ws.root / "data" / "x.txt").write_text("x\n")
    (ws.root / "Dockerfile").write_text(
        "FROM busybox AS seed\nRUN /bin/busybox --install -s /bin && mkdir /out && echo seeded > /out/s.txt\n"
        "FROM busybox\nRUN /bin/busybox --install -s /bin\nWORKDIR /app\nRUN echo kept > /app/lock.txt\n"
        "RUN --mount=type=bind,source=lock.txt,target=lock.txt --mount=type=cache,target=/root/.cache "
        "--mount=type=bind,source=data,target=/mnt/data,rw --mount=from=seed,source=/out,target=/seed "
        "cat lock.txt /mnt/data/x.txt /seed/s.txt > /app/seen && echo c > /root/.cache/c && echo w > /mnt/data/w\n"
        # What the image holds after the step, looked at while building (a run binds the host's /root).
        "RUN for p in /root/.cache/c /mnt/data /seed /.prorl-copy; do if [ -e $p ]; then echo $p; fi; done > /left\n")
    on_busybox(ws, stages=True)
    image, _ = built(ws, "--mode", "lock")

    def sh(script: str) -> str:
        return in_image(image, "sh", "-c", script)

    assert sh("cat /app/seen") == "from the context\nx\nseeded\n"  # each mount was there for the step
    assert sh("cat /app/lock.txt") == "kept\n"  # the image's own file at a bind's target came back
    assert sh("cat /left") == ""  # neither the mounts nor what the step wrote into them


def test_the_steps_after_user_run_as_that_user(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.ini").write_text("a\n")
    conv = convert(tmp_path, "FROM debian AS build\nUSER app\nRUN make\nFROM debian\nRUN useradd -m app\n"
                             "COPY --chown=app:staff conf/ /srv/conf/\nUSER app\nWORKDIR /srv/work\n"
                             'RUN ["pip", "install", "--user", "x"]\nRUN --mount=type=cache,target=/c,uid=1000 ls /c\n'
                             "USER 0:0\nRUN id\nCOPY --from=build /out /opt/out\n")
    build, final = conv.definition.split("Stage: ")[1:]
    # Each stage's %post defines the functions its steps call, once, before the first.
    assert build.count("prorl_as() {") == 1 == final.count("prorl_as() {"), final
    assert "prorl_as app '/bin/sh -c make'" in build
    post = "\n".join(section(final, "post"))
    order = [post.index(line) for line in (
        "prorl_as() {", "prorl_mkdir app:staff chown /srv/conf", "cp -fR /.prorl-copy/5-0/. /srv/conf/",
        "prorl_chown app:staff /srv/conf/a.ini", "prorl_mkdir app user /srv/work", "mkdir -p /srv/work\ncd /srv/work",
        "prorl_as app 'pip install --user x'", "chown 1000:0 /c", "if prorl_as app '/bin/sh -c '\"'\"'ls /c'\"'\"''; then",
        "/bin/sh -c id")]
    assert order == sorted(order), post
    assert "prorl_as 0:0" not in post  # USER root again: the steps run as they always do
    assert section(final, "files") == [f"{tmp_path}/conf/. /.prorl-copy/5-0/"]  # waits for its owner's folder
    assert not any("--chown" in note for note in conv.not_converted), conv.not_converted


@needs_apptainer
@pytest.mark.apptainer
def test_user_chown_and_workdir_give_files_to_whom_docker_would(ws: Workspace) -> None:
    """A step after USER runs as that user (a tool that refuses root works; one that writes where the user may not
    fails), and what --chown copies and WORKDIR makes is the user's, as BuildKit builds it."""
    (ws.root / "conf").mkdir()
    (ws.root / "conf" / "app.ini").write_text("[app]\n")
    (ws.root / "Dockerfile").write_text(
        "FROM busybox AS builder\nRUN /bin/busybox --install -s /bin && mkdir -p /out/sub && echo b > /out/sub/b\n"
        "FROM busybox\nRUN /bin/busybox --install -s /bin && echo 'app:x:1000:1000::/home/app:/bin/sh' >> /etc/passwd "
        "&& printf 'app:x:1000:\\nstaff:x:50:\\n' >> /etc/group && mkdir -p /home/app && chown 1000:1000 /home/app\n"
        "COPY --chown=app:staff conf/ /srv/app/conf/\nCOPY --from=builder --chown=app /out /srv/out\n"
        "USER app\nWORKDIR /srv/app/work\n"
        "RUN --mount=type=cache,target=/home/app/.cache,uid=1000 id -u > uid && touch ../conf/edited /home/app/.cache/c "
        "&& if touch /not-mine 2>/dev/null; then echo wrote; else echo refused; fi > refused\n"
        "USER root\nRUN id -u > /root-uid && stat -c '%u:%g %n' /srv/app /srv/app/conf/app.ini /srv/app/conf/edited "
        "/srv/app/work /srv/out /srv/out/sub/b > /owners\n")
    on_busybox(ws, stages=True)
    image, _ = built(ws, "--mode", "lock")

    def cat(*paths: str) -> list[str]:
        return in_image(image, "cat", *paths).splitlines()

    assert cat("/srv/app/work/uid", "/srv/app/work/refused", "/root-uid") == ["1000", "refused", "0"]
    assert cat("/owners") == ["1000:50 /srv/app", "1000:50 /srv/app/conf/app.ini", "1000:1000 /srv/app/conf/edited",
                              "1000:1000 /srv/app/work", "1000:1000 /srv/out", "1000:1000 /srv/out/sub/b"]


@needs_apptainer
@pytest.mark.apptainer
def test_a_cache_mount_keeps_what_a_build_wrote_for_the_next_build(ws: Workspace) -> None:
    """pip's, uv's and apt's cache mounts make a second build faster in Docker; here too, and never in the image."""
    (ws.root / "Dockerfile").write_text(
        "FROM busybox\nRUN /bin/busybox --install -s /bin && mkdir -p /root/.cache && echo own > /root/.cache/own\n"
        "RUN --mount=type=cache,target=/root/.cache --mount=type=cache,id=apt,target=/var/cache/apt,sharing=locked "
        "echo \"$(cat /root/.cache/n)/$(cat /var/cache/apt/n)\" > /seen; n=$(($(cat /root/.cache/n) + 1)); "
        "echo $n > /root/.cache/n; echo $n > /var/cache/apt/n\n"
        "RUN echo $(ls -A /root/.cache /var/cache) > /left\n")
    on_busybox(ws)

    def build() -> list[str]:
        image, _ = built(ws, "--mode", "scratch")
        return in_image(image, "cat", "/seen", "/left").splitlines()

    assert build() == ["/", "/root/.cache: own /var/cache:"]  # the first build found both empty; the image keeps its own
    assert build()[0] == "1/1"  # the second build's step found what the first one's wrote
    kept = ws.cache / "build-cache" / str(os.getuid())
    assert (kept / cache_key("/root/.cache") / "n").read_text() == "2\n" == (kept / cache_key("apt") / "n").read_text()
    ws.write(build_cache=False)
    assert build()[0] == "/"  # off: each step starts from an empty folder
    # `prorl images prune --build-cache` removes the kept folders no build holds.
    from prorl_cli.images.cache import cache_mount_lock

    with cache_mount_lock(kept / cache_key("apt"), exclusive=False):  # as a build holds it while it runs
        out = ws.prorl("images", "prune", "--build-cache").stdout
    assert f"removed build cache {cache_key('/root/.cache')}" in out and cache_key("apt") not in out, out
    assert [p.name for p in kept.iterdir() if p.is_dir()] == [cache_key("apt")]


@needs_apptainer
@pytest.mark.apptainer
def test_a_build_secret_reaches_its_step_and_nothing_else(ws: Workspace) -> None:
    """From a file and from prorl's environment; not in the image, the definition, the build log or the lock key."""
    secret = ws.root / "pypirc"
    secret.write_text("s3cr3t-file\n")
    (ws.root / "Dockerfile").write_text(
        "FROM busybox\nRUN /bin/busybox --install -s /bin\n"
        "RUN --mount=type=secret,id=pypi,target=/root/.pypirc --mount=type=secret,id=tok,env=TOKEN "
        "sha256sum /root/.pypirc | cut -c1-64 > /file-hash && echo \"$TOKEN\" | sha256sum | cut -c1-64 > /env-hash\n"
        "RUN if [ -e /root/.pypirc ] || [ -n \"$TOKEN\" ]; then echo left; fi > /left\n")
    on_busybox(ws, build_secrets={"pypi": str(secret), "tok": "env:PRORL_TEST_TOKEN"})
    token = "s3cr3t-env"
    image, out = built(ws, "--mode", "lock", env={"PRORL_TEST_TOKEN": token})
    seen = in_image(image, "cat", "/file-hash", "/env-hash", "/left").splitlines()
    assert seen == [hashlib.sha256(b"s3cr3t-file\n").hexdigest(), hashlib.sha256(f"{token}\n".encode()).hexdigest()]
    logs = "".join(p.read_text() for p in (ws.cache / "logs" / "app").iterdir())
    assert "s3cr3t" not in logs + out.stdout + out.stderr  # the definition and Apptainer's traced output
    secret.write_text("another\n")  # another secret is the same image, as in Docker
    assert ws.dry_run("--mode", "lock")["app"]["key"] == image["key"]


@needs_apptainer
@pytest.mark.apptainer
def test_an_ssh_mount_finds_the_agent_images_build_ssh_gives(ws: Workspace) -> None:
    """`RUN --mount=type=ssh git clone git@host:org/private.git`: the step finds the agent in SSH_AUTH_SOCK; a
    target's link replaces what the image has there for the step only."""
    import socket

    agent = ws.root / "agent.sock"
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(agent))  # stands for ssh-agent's socket: the step only looks at it
        (ws.root / "Dockerfile").write_text(
            "FROM busybox\nRUN /bin/busybox --install -s /bin\n"
            "RUN --mount=type=ssh if [ -S \"$SSH_AUTH_SOCK\" ]; then echo agent; fi > /default\n"
            "RUN mkdir -p /run && echo kept > /run/agent.sock\n"
            "RUN --mount=type=ssh,id=deploy,target=/run/agent.sock if [ -S /run/agent.sock ] && "
            "[ \"$SSH_AUTH_SOCK\" = /run/agent.sock ]; then echo deploy; fi > /deploy\n"
            "RUN echo \"${SSH_AUTH_SOCK:-none}\" > /after\n")
        on_busybox(ws, build_ssh={"default": str(agent), "deploy": "$PRORL_TEST_AGENT"})
        image, _ = built(ws, "--mode", "lock", env={"PRORL_TEST_AGENT": str(agent)})
    assert in_image(image, "cat", "/default", "/deploy", "/after", "/run/agent.sock").split() == [
        "agent", "deploy", "none", "kept"]
    ws.write(build_ssh={"default": str(ws.root / "gone.sock")})
    failed = app_result(ws.prorl("build-images", "--json", "--mode", "scratch", "app", check=False))
    assert "images.build_ssh.default" in failed["error"] and "is not an SSH agent's socket" in failed["error"], failed


@needs_apptainer
@pytest.mark.apptainer
def test_a_failed_step_with_mounts_is_named_and_fails_the_build(ws: Workspace) -> None:
    (ws.root / "Dockerfile").write_text("FROM busybox\nRUN /bin/busybox --install -s /bin\n"
                                        "RUN --mount=type=cache,target=/c ls /c/missing\nRUN echo never\n")
    app, out = failed_build(ws)
    assert app["action"] == "failed", app
    assert "failed command: /bin/sh -c 'ls /c/missing'" in app["error"], app["error"]


@needs_apptainer
@pytest.mark.apptainer
def test_a_failed_build_names_the_command_that_failed(ws: Workspace) -> None:
    """A step whose output is longer than the log tail (a pip install) pushed the failing command out of sight."""
    (ws.root / "Dockerfile").write_text("FROM busybox\nRUN /bin/busybox --install -s /bin\n"
                                        "RUN for i in $(seq 1 60); do echo noise $i; done && ls /no-such-dir\n"
                                        "RUN echo never\n")
    app, out = failed_build(ws)
    assert app["action"] == "failed", app
    assert "ls /no-such-dir" not in "\n".join(app["log_tail"])  # the noise filled the tail
    assert "failed command: /bin/sh -c 'for i in $(seq 1 60); do echo noise $i; done && ls /no-such-dir'" in app["error"], app["error"]
    assert "failed command" in out.stderr  # what a user reads on the terminal too


def test_each_stage_the_last_one_needs_is_a_stage_of_the_definition(tmp_path: Path) -> None:
    conv = convert(tmp_path, "FROM golang:1.22 AS build\nRUN go build -o /out/app .\n"
                             "FROM build AS test\nRUN go test ./...\n"
                             "FROM debian AS docs\nRUN make docs\n"
                             "FROM debian\nRUN apt-get update\nCOPY --from=test /out/app /usr/local/bin/\n"
                             "COPY --from=ghcr.io/astral-sh/uv:0.4 /uv /uvx /bin/\n")
    d = conv.definition
    # The image a COPY --from reads first, then the stages in order; `docs` is not needed, as BuildKit skips it.
    heads = [block.split("\n%", 1)[0].strip() for block in d.split("Bootstrap: ")[1:]]
    assert [h.split("\n")[0] + " " + h.split("Stage: ")[1].split("\n")[0] for h in heads] == [
        "docker image0", "docker test", "scratch stage3"]
    assert "From: ghcr.io/astral-sh/uv:0.4\n" in d and "From: golang:1.22\n" in d and "make docs" not in d
    # A stage FROM another one starts from that one's image, with its steps first.
    test_stage = d.split("Stage: test\n", 1)[1].split("Bootstrap:", 1)[0]
    assert test_stage.index("go build") < test_stage.index("go test")
    assert section(d, "files from test") == ["    /out/app /.prorl-copy/8-0/app"]
    assert section(d, "files from image0") == ["    /uv /.prorl-copy/9-0/uv", "    /uvx /.prorl-copy/9-1/uvx"]
    post = "\n".join(section(d.split("Stage: stage3\n", 1)[1], "post"))
    # Whether /out/app is a folder is known only in its stage: the step decides, as Docker copies either.
    assert ("if [ -d /.prorl-copy/8-0/app ]; then mkdir -p /usr/local/bin/; cp -fR /.prorl-copy/8-0/app/. "
            "/usr/local/bin/; elif [ -e /.prorl-copy/8-0/app ] || [ -L /.prorl-copy/8-0/app ]; then mkdir -p "
            "/usr/local/bin; cp -f /.prorl-copy/8-0/app /usr/local/bin/app; fi") in post
    assert post.index("apt-get update") < post.index("/.prorl-copy/8-0/app") and post.endswith("\nrm -rf /.prorl-copy")
    assert conv.not_converted == ["FROM debian: replaced by the image list's base scratch"]


def test_add_of_a_url_fetches_it_at_build_time(tmp_path: Path) -> None:
    digest = "ab" * 32
    conv = convert(tmp_path, f"FROM debian\nADD https://example.org/v1/data.json /data/\n"
                             f"ADD --checksum=sha256:{digest} https://example.org/y.bin /opt/y\n"
                             "ADD https://github.com/org/repo.git#v1.2 /src/repo\n")
    post = section(conv.definition, "post")
    assert post[0] == "mkdir -p /data" and "curl -fsSL -o /data/data.json https://example.org/v1/data.json" in post[1]
    assert "wget -q -O /data/data.json" in post[1] and post[2] == "chmod 600 /data/data.json"  # Docker's mode
    assert post[6] == f"echo '{digest}  /opt/y' | sha256sum -c -"
    assert post[7:9] == ["git clone --quiet --depth 1 --branch v1.2 https://github.com/org/repo.git /src/repo",
                         "rm -rf /src/repo/.git"]
    assert conv.not_converted == ["FROM debian: replaced by the image list's base scratch"]
    with pytest.raises(ConfigError, match="ADD --checksum=md5:x: expected sha256"):
        convert(tmp_path, "FROM debian\nADD --checksum=md5:x https://example.org/y /y\n")
    with pytest.raises(ConfigError, match="line 2: ADD https://example.org/ /d/: the URL names no file"):
        convert(tmp_path, "FROM debian\nADD https://example.org/ /d/\n")


@needs_apptainer
@pytest.mark.apptainer
def test_a_multi_stage_dockerfile_builds_its_last_stage_from_the_others(ws: Workspace) -> None:
    """Stages, COPY --from a stage, an index and an image, a stage FROM a stage, ADD of a URL and .dockerignore,
    built for real."""
    served = ws.root / "served"
    served.mkdir()
    (served / "remote.txt").write_text("fetched\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        context = ws.root / "ctx"
        (context / "conf").mkdir(parents=True)
        (context / "conf" / "app.ini").write_text("[app]\n")
        (context / "conf" / "secret.key").write_text("no\n")
        (context / ".dockerignore").write_text("**/*.key\n")
        (context / "Dockerfile").write_text(
            "FROM busybox AS builder\n"
            "RUN /bin/busybox --install -s /bin\n"
            "RUN mkdir -p /out/sub && echo built > /out/sub/a.txt && echo tool > /tool\n"
            "FROM builder AS tester\n"
            "RUN echo tested > /out/tested\n"
            "FROM busybox AS unused\n"
            "RUN exit 1\n"  # never built: the last stage does not need it
            "FROM busybox\n"
            "RUN /bin/busybox --install -s /bin\n"
            "COPY --from=builder /out /app/\n"
            "COPY --from=tester /out/tested /app/tested\n"
            "COPY --from=0 /tool /usr/local/bin/\n"
            "COPY --from=toolbox /message /opt/message\n"
            f"ADD http://127.0.0.1:{server.server_address[1]}/remote.txt /data/\n"
            "COPY . /ctx/\n"
            "RUN echo 'app:x:1000:1000::/home/app:/bin/sh' >> /etc/passwd && mkdir -p /home/app && chown 1000 /home/app\n"
            "USER app\n"
            "RUN echo \"$HOME\" > /home/app/home-of-the-user\n"
        )
        ws.write({"root": {"template": "busybox.def.j2", "base": "scratch"},
                  "app": {"template": "ctx/Dockerfile", "base": "image:root",
                          "stage_bases": {"busybox": "image:root", "toolbox": "image:root"}}})
        image = ws.build("--mode", "lock", "app")["app"]
        server.shutdown()
    assert image["action"] == "built", image

    def cat(path: str) -> str:
        return in_image(image, "cat", path)

    assert cat("/app/sub/a.txt") == "built\n"  # the folder's contents, not /app/out
    assert cat("/app/tested") == "tested\n"
    assert cat("/usr/local/bin/tool") == "tool\n"
    assert cat("/opt/message") == "hello\n"  # from the image the entry's stage_bases named
    assert cat("/data/remote.txt") == "fetched\n"
    assert cat("/ctx/conf/app.ini") == "[app]\n"
    assert cat("/home/app/home-of-the-user") == "/home/app\n"  # a step after USER sees that user's HOME
    assert in_image(image, "ls", "/ctx/conf").split() == ["app.ini"]


def test_stage_bases_are_checked_and_their_images_built_first(tmp_path: Path) -> None:
    from prorl_cli.images.spec import build_order, specs_from_dict

    file = tmp_path / "images.yaml"
    entry = {"template": "Dockerfile", "base": "image:root", "stage_bases": {"golang:1.22": "image:go", "uv": "x.sif"}}
    specs = specs_from_dict({"images": {"app": entry, "go": {"template": "t.def.j2", "base": "scratch"},
                                        "root": {"template": "t.def.j2", "base": "scratch"}}}, file)
    assert specs["app"].dependencies == ["root", "go"]
    assert str(specs["app"].stage_bases["uv"]) == f"localimage:{tmp_path}/x.sif"
    assert build_order(specs, ["app"]) == ["root", "go", "app"]
    with pytest.raises(ConfigError, match=r"images.app.stage_bases: image:gone is not in this image list"):
        specs_from_dict({"images": {"app": {**entry, "base": "scratch", "stage_bases": {"a": "image:gone"}}}}, file)
    with pytest.raises(ConfigError, match=r"images.app.stage_bases: only a Dockerfile template has other stages"):
        specs_from_dict({"images": {"app": {**entry, "template": "t.def.j2", "base": "scratch"}}}, file)
    with pytest.raises(ConfigError, match=r"images.app.stage_bases.a: unknown base 'nope'"):
        specs_from_dict({"images": {"app": {**entry, "base": "scratch", "stage_bases": {"a": "nope"}}}}, file)
    with pytest.raises(ConfigError, match=r"image base cycle: app -> app"):
        specs_from_dict({"images": {"app": {**entry, "base": "scratch", "stage_bases": {"a": "image:app"}}}}, file)


def test_chmod_applies_to_what_each_kind_of_copy_put_in_place(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "run.sh").write_text("echo\n")
    (tmp_path / "entry.sh").write_text("echo\n")
    conv = convert(tmp_path, "FROM debian AS b\nRUN true\nFROM debian\nRUN true\n"
                             "COPY --chmod=755 entry.sh /usr/local/bin/\nCOPY --chmod=u+x bin/ /opt/bin/\n"
                             "COPY --from=b --chmod=0700 /secret /etc/secret\n"
                             "COPY --chmod=755 <<EOF /start.sh\necho hi\nEOF\n")
    post = section(conv.definition.split("Stage: stage1\n", 1)[1], "post")
    assert "chmod 755 /usr/local/bin/entry.sh" in post and "chmod -R u+x /opt/bin/run.sh" in post
    assert "chmod -R 0700 /.prorl-copy/6-0/secret" in post and "chmod 755 /start.sh" in post
    assert post.index("chmod -R 0700 /.prorl-copy/6-0/secret") < post.index("chmod 755 /start.sh")
    assert not any("--chmod" in n for n in conv.not_converted), conv.not_converted
    with pytest.raises(ConfigError, match="COPY --chmod=rwx: not a file mode"):
        convert(tmp_path, "FROM debian\nCOPY --chmod=rwx entry.sh /x\n")


def test_buildkits_platform_arguments_have_this_hosts_values(tmp_path: Path) -> None:
    from prorl_cli.images.dockerfile_text import platform_args

    arch = platform_args()["TARGETARCH"]
    conv = convert(tmp_path, "FROM --platform=$BUILDPLATFORM debian AS build\nARG TARGETARCH TARGETOS\n"
                             "RUN curl -o /x https://example.org/$TARGETOS/$TARGETARCH/x\nFROM build\n")
    post = "\n".join(section(conv.definition, "post"))
    # Declared in the stage (as BuildKit requires), they hold the machine's platform: Apptainer builds for it.
    assert f'export TARGETARCH="{arch}"' in post and 'export TARGETOS="linux"' in post, post
    assert not any("ARG" in n for n in conv.not_converted), conv.not_converted
    assert platform_args("aarch64")["TARGETPLATFORM"] == "linux/arm64"
    assert platform_args("armv7l")["BUILDVARIANT"] == "v7" and platform_args("x86_64")["BUILDARCH"] == "amd64"


def test_dockerignore_leaves_out_what_docker_leaves_out(tmp_path: Path) -> None:
    from prorl_cli.images.dockerignore import DockerIgnore, posix_regex

    rules = DockerIgnore("# build outputs\n/build/\n**/*.pyc\n*/tmp*\n.git\ndocs\n!docs/keep.md\n.\n")
    assert rules.excludes("build") and rules.excludes("build/x/y.o")  # a folder's contents with it
    assert rules.excludes("a.pyc") and rules.excludes("pkg/sub/a.pyc") and not rules.excludes("pkg/a.py")
    assert rules.excludes("pkg/tmpdir") and not rules.excludes("tmpdir") and not rules.excludes("pkg/sub/tmpdir")
    assert rules.excludes(".git/HEAD") and rules.excludes("docs/a.md") and not rules.excludes("docs/keep.md")
    assert not rules.excludes("src/build")  # anchored at the context's root
    # The same rules as a POSIX regular expression, for a step that runs in the image (grep -E), as Python reads it.
    patterns = ["build", "**/*.pyc", "*/tmp*", "a[0-9].b", "x\\*y"]
    regex = re.compile(posix_regex(patterns))
    for path in ("build", "build/x/y.o", "a.pyc", "pkg/sub/a.pyc", "pkg/a.py", "pkg/tmpdir", "tmpdir", "a1.b", "a1xb",
                 "x*y", "xzy", "src/build"):
        assert bool(regex.match(path)) == DockerIgnore("\n".join(patterns)).excludes(path), path

    for rel in ("src/app.py", "src/app.pyc", "src/build/out.o", ".git/HEAD", "build/a.o", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    (tmp_path / ".dockerignore").write_text(".git\nbuild\n**/*.pyc\n")
    (tmp_path / "src" / "z.pyc").write_text("x\n")
    (tmp_path / "src" / "pkg").mkdir()
    (tmp_path / "src" / "pkg" / "m.py").write_text("x\n")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "c.pyc").write_text("x\n")
    conv = convert(tmp_path, "FROM python\nCOPY . /app/\nCOPY src/*.py* /opt/\n")
    # What it leaves out is never copied: the rest in as few parts as cover it (a folder with nothing left out
    # whole), a folder that held only what is left out made empty, as Docker makes it.
    assert section(conv.definition, "files") == [
        f"{tmp_path}/.dockerignore /app/.dockerignore", f"{tmp_path}/Dockerfile /app/Dockerfile",
        f"{tmp_path}/notes.txt /app/notes.txt", f"{tmp_path}/src/app.py /app/src/app.py",
        f"{tmp_path}/src/build/. /app/src/build", f"{tmp_path}/src/pkg/. /app/src/pkg", f"{tmp_path}/src/app.py /.prorl-copy/2-0/app.py"]
    assert section(conv.definition, "post")[0] == "mkdir -p /app/cache"
    assert {str(f.src.relative_to(tmp_path)) for f in conv.files} == {  # nor hashed into the lock key
        ".dockerignore", "Dockerfile", "notes.txt", "src/app.py", "src/build", "src/pkg"}
    with pytest.raises(ConfigError, match="COPY source 'build' is left out of the context by .dockerignore"):
        convert(tmp_path, "FROM python\nCOPY build /opt/build\n")
    (tmp_path / "Dockerfile.dockerignore").write_text("notes.txt\n")  # BuildKit's: the Dockerfile's own wins
    conv = convert(tmp_path, "FROM python\nRUN true\nCOPY . /app/\n")
    assert [line.split()[-1] for line in section(conv.definition, "files")] == [
        "/.prorl-copy/2-0/.dockerignore", "/.prorl-copy/2-0/.git", "/.prorl-copy/2-0/Dockerfile",
        "/.prorl-copy/2-0/Dockerfile.dockerignore", "/.prorl-copy/2-0/build", "/.prorl-copy/2-0/cache",
        "/.prorl-copy/2-0/src"]
    assert section(conv.definition, "post")[-3:] == ["mkdir -p /app/", "cp -fR /.prorl-copy/2-0/. /app/",
                                                     "rm -rf /.prorl-copy"]


def test_a_from_value_of_a_global_build_argument_names_its_stage(tmp_path: Path) -> None:
    conv = convert(tmp_path, "ARG BUILDER=build\nFROM debian AS build\nRUN make\nFROM debian\n"
                             "COPY --from=$BUILDER /out /out\n")
    assert "Stage: build\n" in conv.definition and section(conv.definition, "files from build")
    with pytest.raises(ConfigError, match=r"COPY --from=build: the stage's own build argument names stage build"):
        convert(tmp_path, "FROM debian AS build\nRUN make\nFROM debian\nARG B=build\nCOPY --from=$B /out /out\n")


def test_a_pattern_that_matches_nothing_copies_nothing_as_buildkit_allows(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    conv = convert(tmp_path, "FROM python\nWORKDIR /app\nCOPY pyproject.toml* uv.lock* ./\n")
    assert section(conv.definition, "files") == [f"{tmp_path}/pyproject.toml /app/pyproject.toml"]
    with pytest.raises(ConfigError, match="COPY source 'uv.lock' does not exist"):
        convert(tmp_path, "FROM python\nCOPY uv.lock /app/\n")
