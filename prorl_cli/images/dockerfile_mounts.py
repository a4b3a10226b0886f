"""BuildKit's ``RUN --mount`` in a definition: what the step sees while it runs, gone after it.

A ``%post`` step cannot mount anything, so each mount is put in place
before the step and taken away after it, whatever the step's exit status:

- ``type=bind`` (the default): the source (from the build context, another
  stage or an image) is staged like a ``COPY`` and moved to the target; the
  target's own content, if the image has any, waits aside and comes back.
  What the step writes there is discarded, as with Docker's ``rw`` bind.
- ``type=cache``: as in Docker, a folder kept between builds (and shared by
  the steps and images that name the same ``id``, by default the target),
  never part of the image. The builder binds the host's folder at
  ``/.prorl-cache/KEY`` for the whole build and the step finds a link to it
  at the target. With ``sharing=private``, with ``uid``/``gid`` (whose
  folder could not stay the building user's on the host), or with
  ``images.build_cache`` off, the step gets an empty folder instead, as a
  ``type=tmpfs`` mount does, owned and moded as the mount says.
- ``type=secret``: a secret ``images.build_secrets`` gives the build (a host
  file, or a variable of the builder's environment) is bound at
  ``/.prorl-secrets/ID`` for the whole build; the step gets a copy at the
  target (``/run/secrets/ID``, mode 0400) or in the variable ``env=`` names,
  both gone after it. The secret never reaches the definition, the lock key,
  the image or the build log (its variable is set with tracing off).
- ``type=ssh``: an SSH agent ``images.build_ssh`` gives the build (its
  socket) is bound at ``/.prorl-ssh/ID``, and the step finds it in
  ``SSH_AUTH_SOCK`` (and at the target, when the mount names one).
- An SSH agent or a secret the build is not given: a step that needs one
  (``required=true``) is an error naming it, else the step runs without it,
  as ``docker build`` does without ``--secret``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import posixpath
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerfile_copy import COPY_STAGING, convert_copy
from prorl_cli.images.dockerfile_text import Instruction, expand
from prorl_cli.images.dockerignore import DockerIgnore

#: Each key BuildKit reads, under the name used here.
_KEYS = {
    "type": "type", "target": "target", "dst": "target", "destination": "target", "source": "source",
    "src": "source", "from": "from", "rw": "rw", "readwrite": "rw", "ro": "ro", "readonly": "ro", "id": "id",
    "sharing": "sharing", "mode": "mode", "uid": "uid", "gid": "gid", "required": "required", "size": "size",
    "env": "env", "relabel": "relabel",
}
_TYPES = ("bind", "cache", "tmpfs", "secret", "ssh")
_SHARING = ("shared", "private", "locked")
_MAKE_STAGING = f"mkdir -p {shlex.quote(COPY_STAGING)}"  # where a mount's target's own content waits

#: Where the builder binds each kept cache's host folder while the image builds; an empty folder per cache stays
#: in the image there, as BuildKit leaves a cache mount's target folder.
CACHE_MOUNTS = "/.prorl-cache"
#: Where the builder binds each secret the build is given (an empty file of that name stays in the image).
SECRET_MOUNTS = "/.prorl-secrets"
#: Where the builder binds each SSH agent's socket the build is given.
SSH_MOUNTS = "/.prorl-ssh"


@dataclass(frozen=True)
class BuildMounts:
    """What the builder gives a RUN's mounts: kept cache folders, and the secrets it has, by id."""

    keep_caches: bool = False
    secrets: frozenset[str] = frozenset()
    ssh: frozenset[str] = frozenset()


NO_MOUNTS = BuildMounts()  # a conversion on its own: no kept caches, no secrets


@dataclass(frozen=True)
class CacheMount:
    """A ``type=cache`` mount kept between builds: its folder's name, and whether builds take turns with it."""

    key: str
    locked: bool  # sharing=locked: one build at a time (apt's lists and archives)


def cache_key(cache_id: str) -> str:
    """A cache's folder name: its id in letters a path can hold, and a hash that keeps ids apart."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", cache_id).strip("_.")[:40] or "cache"
    return f"{slug}-{hashlib.sha256(cache_id.encode()).hexdigest()[:8]}"


@dataclass
class Mount:
    """One ``--mount=`` of a RUN, its keys read as BuildKit reads them."""

    kind: str
    target: str | None
    source: str | None
    from_: str | None
    id: str | None
    required: bool
    sharing: str = "shared"
    owner: str | None = None  # a cache's, tmpfs's or secret's uid:gid, when either is given
    mode: str | None = None  # a cache's folder mode, a secret's file mode (octal)
    env: str | None = None  # a secret's variable


def parse_mount(value: str, known: dict[str, str]) -> Mount:
    """``type=bind,source=uv.lock,target=uv.lock`` (CSV, as BuildKit reads it) as a :class:`Mount`.

    ``known``: the ENV and ARG values so far, which the value's ``$NAME`` expands to.
    """
    fields: dict[str, str] = {}
    for item in next(csv.reader([expand(value, known)]), []):
        key, has_value, val = item.partition("=")
        name = _KEYS.get(key.strip().lower())
        if name is None:
            raise ConfigError(f"--mount={value}: unknown key {key.strip()!r} (BuildKit reads "
                              f"{', '.join(sorted(set(_KEYS)))})")
        fields[name] = val.strip() if has_value else "true"
    kind = fields.get("type", "bind").lower()
    if kind not in _TYPES:
        raise ConfigError(f"--mount={value}: type {kind!r} is not one of {', '.join(_TYPES)}")
    if kind in ("bind", "cache", "tmpfs") and not fields.get("target"):
        raise ConfigError(f"--mount={value}: a {kind} mount needs target=PATH")
    sharing = fields.get("sharing", "shared").lower()
    if sharing not in _SHARING:
        raise ConfigError(f"--mount={value}: sharing {sharing!r} is not one of {', '.join(_SHARING)}")
    ids = [fields.get(k, "0") for k in ("uid", "gid")]
    if not all(i.isdigit() for i in ids):
        raise ConfigError(f"--mount={value}: uid and gid are numbers, as BuildKit reads them")
    mode = fields.get("mode")
    if mode is not None and not re.fullmatch(r"0?[0-7]{3,4}", mode):
        raise ConfigError(f"--mount={value}: mode {mode!r} is not an octal file mode (0755)")
    env = fields.get("env")
    if env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
        raise ConfigError(f"--mount={value}: env {env!r} is not a variable name")
    if kind == "secret" and not (fields.get("id") or fields.get("target") or env):
        raise ConfigError(f"--mount={value}: a secret mount needs id=NAME (or target=PATH)")
    return Mount(kind, fields.get("target"), fields.get("source"), fields.get("from"), fields.get("id"),
                 fields.get("required", "false").lower() in ("true", "1", "yes"), sharing,
                 ":".join(ids) if ids != ["0", "0"] else None, mode, env)


def mount_stages(flags: list[str], global_args: dict[str, str]) -> list[str]:
    """The ``from=`` values of a RUN's bind mounts: the stages (or images) the step reads, which must be built.

    ``global_args``: the build arguments before the first FROM, which name the stage as they do a COPY's --from.
    """
    out: list[str] = []
    for flag in flags:
        if flag.startswith("--mount="):
            try:
                mount = parse_mount(flag.split("=", 1)[1], global_args)
            except ConfigError:
                continue  # reported with its line when the step is converted
            if mount.kind == "bind" and mount.from_:
                out.append(mount.from_)
    return out


@dataclass
class MountedStep:
    """What a RUN's mounts became: staged files, and the lines around its command."""

    files: list[tuple[Path, str, str]] = field(default_factory=list)  # as CopyConversion.files
    from_files: list[tuple[str, str, str]] = field(default_factory=list)  # as CopyConversion.from_files
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    caches: list[CacheMount] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)  # the ids of the build's secrets the step reads
    ssh: list[str] = field(default_factory=list)  # the ids of the build's SSH agents the step uses

    def wrap(self, command: str, workdir: str) -> str:
        """``command`` as one %post step with the mounts in place, taken away whatever its exit status.

        The trace's ``+ prorl_rc=N`` (N > 0) marks the failure: the build's error names the command before it,
        not the lines that take the mounts away (``build._FAILED_MOUNTED_STEP``).
        """
        if not self.before:
            return command
        w = shlex.quote(workdir)
        # %post runs with `sh -e`: a failing condition of `if` does not stop it, so the mounts still come away.
        return "\n".join([*self.before, f"cd {w}", f"if {command}; then prorl_rc=0; else prorl_rc=$?; fi", "cd /",
                          *self.after, f"cd {w}", 'if [ "$prorl_rc" -ne 0 ]; then exit "$prorl_rc"; fi'])


def convert_mounts(ins: Instruction, flags: list[str], *, known: dict[str, str], context: Path, workdir: str,
                   image: str, path: Path, resolve_from: Callable[[str], str], ignore: DockerIgnore,
                   given: BuildMounts = NO_MOUNTS) -> MountedStep:
    """The mounts among a RUN's ``flags``; other flags (``--network``, ``--security``) become notes.

    ``given.keep_caches``: a ``type=cache`` mount (unless ``sharing=private``) links to its kept folder (see
    :data:`CACHE_MOUNTS`), which the builder must bind; else it is an empty folder for the step.
    ``given.secrets``: the secrets a ``type=secret`` mount may read (see :data:`SECRET_MOUNTS`).
    """
    out = MountedStep()
    where = f"image {image}: {path}: line {ins.line}"
    undo: list[list[str]] = []
    for n, flag in enumerate(flags):
        if not flag.startswith("--mount="):
            out.notes.append(f"line {ins.line}: RUN {flag} - ignored: the step runs with the build's own network "
                             "and privileges")
            continue
        try:
            mount = parse_mount(flag.split("=", 1)[1], known)
        except ConfigError as e:
            raise ConfigError(f"{where}: RUN {e}") from e
        aside = f"{COPY_STAGING}/aside-{ins.index}-{n}"
        if mount.kind in ("secret", "ssh"):
            # A secret is named by its id, else its target's file name (or its variable); an agent by its id.
            if mount.kind == "secret":
                name = mount.id or posixpath.basename(mount.target or "") or mount.env or ""
            else:
                name = mount.id or "default"
            if mount.kind == "secret" and name in given.secrets:
                _secret_steps(out, mount, name, workdir, aside, undo)
            elif mount.kind == "ssh" and name in given.ssh:
                _ssh_steps(out, mount, name, workdir, aside, undo)
            elif mount.required:
                setting = (f"images.build_secrets: {{{name}: /path/to/file}} (or env:VAR)" if mount.kind == "secret"
                           else f"images.build_ssh: {{{name}: $SSH_AUTH_SOCK}}")
                raise ConfigError(f"{where}: RUN {flag}: the step requires the {mount.kind} {name}; give it in "
                                  f"prorl.yaml, {setting}, or put what it fetches in the build context")
            else:
                out.notes.append(f"line {ins.line}: RUN {flag} - no {mount.kind} {name} is given to the build: the "
                                 "step runs without it")
            continue
        assert mount.target is not None  # parse_mount requires it of bind, cache and tmpfs
        target = posixpath.normpath(posixpath.join(workdir, mount.target))
        if target == "/":
            raise ConfigError(f"{where}: RUN {flag}: a mount over / cannot be put in place for one step")
        t = shlex.quote(target)
        before, restore = _set_aside(out, target, aside)
        if mount.kind == "bind":
            staged = f"{COPY_STAGING}/mount-{ins.index}-{n}"
            # A context path is relative to the context's root even when written /uv.lock, as BuildKit reads it.
            source = mount.source or ""
            source = (source if mount.from_ else source.lstrip("/")) or "."
            from_flag = f"--from={mount.from_} " if mount.from_ else ""
            copy = convert_copy(Instruction(ins.line, "RUN --mount", f"{from_flag}{json.dumps([source, staged])}"),
                                context, "/", f"{ins.index}m{n}", image, path, resolve_from, ignore)
            out.files += copy.files
            out.from_files += copy.from_files
            before += [*copy.post, f"mv {shlex.quote(staged)} {t}"]
            # What another stage's files were staged as, once copied into the mount's source.
            if copy.from_files:
                before.append(f"rm -rf {shlex.quote(COPY_STAGING)}/{ins.index}m{n}-*")
        elif mount.kind == "cache" and given.keep_caches and mount.sharing != "private" and mount.owner is None:
            cache = CacheMount(cache_key(mount.id or mount.target), mount.sharing == "locked")
            if cache not in out.caches:
                out.caches.append(cache)
            # A link, not the folder: a bound folder cannot be moved, and the undo's `rm -rf` removes only the link.
            before.append(f"ln -s {shlex.quote(f'{CACHE_MOUNTS}/{cache.key}')} {t}")
            if mount.mode is not None:  # of the kept folder itself (chmod follows the link): the user's own
                before.append(f"chmod {mount.mode} {t}")
        else:
            before.append(f"mkdir -p {t}")
            # A step run as another USER writes there only if the mount says whose it is, as in BuildKit. A kept
            # cache is the building user's on the host, which a subordinate uid there could not be: such a cache
            # is the step's own folder.
            if mount.owner is not None:
                why = shlex.quote(f"prorl: {target} stays root's: this build cannot change owners")
                before.append(f"chown {mount.owner} {t} 2>/dev/null || echo {why} >&2")
            if mount.mode is not None:
                before.append(f"chmod {mount.mode} {t}")
        out.before += before
        # Taken away in reverse order: a mount inside another's target goes first.
        undo.insert(0, [f"rm -rf {t}", restore])
    # The staging folder goes too unless a later COPY waits in it (%files fills it before %post starts).
    out.after = [line for lines in undo for line in lines] + [f"rmdir {shlex.quote(COPY_STAGING)} 2>/dev/null || true"]
    return out


def _set_aside(out: MountedStep, target: str, aside: str) -> tuple[list[str], str]:
    """The lines that move what the image has at ``target`` to ``aside`` (the staging folder made by the step's
    first such line) and make ``target``'s folder, and the line that brings it back once the mount is gone."""
    t, a = shlex.quote(target), shlex.quote(aside)
    before = [_MAKE_STAGING] * (_MAKE_STAGING not in out.before) + [
        f"if [ -e {t} ] || [ -L {t} ]; then mv {t} {a}; fi", f"mkdir -p {shlex.quote(posixpath.dirname(target))}"]
    return before, f"if [ -e {a} ] || [ -L {a} ]; then mv {a} {t}; fi"


def _secret_steps(out: MountedStep, mount: Mount, secret_id: str, workdir: str, aside: str,
                  undo: list[list[str]]) -> None:
    """A secret the build has, for one step: a copy of the bound file at the target, its variable, or both."""
    bound = shlex.quote(f"{SECRET_MOUNTS}/{secret_id}")
    if secret_id not in out.secrets:
        out.secrets.append(secret_id)
    # BuildKit mounts a secret's file unless it is given as a variable only (env= and no target).
    if mount.target or not mount.env:
        target = posixpath.normpath(posixpath.join(workdir, mount.target or f"/run/secrets/{secret_id}"))
        t = shlex.quote(target)
        before, restore = _set_aside(out, target, aside)
        out.before += [*before, f"cp {bound} {t}", f"chmod {mount.mode or '0400'} {t}"]
        if mount.owner is not None:
            out.before.append(f"chown {mount.owner} {t}")
        undo.insert(0, [f"rm -f {t}", restore])
    if mount.env:
        # Set with tracing off: %post runs with `sh -x`, whose trace would print the value into the build log.
        out.before += ["{ prorl_x=$-; set +x; } 2>/dev/null", f'{mount.env}=$(cat {bound}); export {mount.env}',
                       "{ case $prorl_x in *x*) set -x ;; esac; } 2>/dev/null"]
        undo.insert(0, [f"unset {mount.env}"])


def _ssh_steps(out: MountedStep, mount: Mount, agent_id: str, workdir: str, aside: str,
               undo: list[list[str]]) -> None:
    """An SSH agent the build has, for one step: ``SSH_AUTH_SOCK`` names its bound socket (or the target, a link
    to it; what the image has there is set aside for the step and comes back after it)."""
    bound = f"{SSH_MOUNTS}/{agent_id}"
    if agent_id not in out.ssh:
        out.ssh.append(agent_id)
    sock = bound
    if mount.target:
        sock = posixpath.normpath(posixpath.join(workdir, mount.target))
        t = shlex.quote(sock)
        before, restore = _set_aside(out, sock, aside)
        out.before += [*before, f"ln -s {shlex.quote(bound)} {t}"]
        undo.insert(0, [f"rm -f {t}", restore])
    out.before.append(f"SSH_AUTH_SOCK={shlex.quote(sock)}; export SSH_AUTH_SOCK")
    undo.insert(0, ["unset SSH_AUTH_SOCK"])
