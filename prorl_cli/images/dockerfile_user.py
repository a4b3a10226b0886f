"""Docker's ``USER`` and ``--chown`` in a definition: who the build's steps run as, and who owns what they copy.

Apptainer runs an image as whoever runs it, so ``USER`` means nothing once the
image is built. While it builds (``apptainer build --fakeroot``), the steps
after ``USER app`` run as ``app``, as Docker runs them: a tool that refuses
root (``initdb``) works, and a step cannot write where ``app`` may not. A
``WORKDIR`` after it makes its missing folders ``app``'s, as BuildKit does,
and ``COPY --chown=app`` gives ``app`` what it copies and the folders it makes.

Switching users needs the build's user namespace to map more than root (an
``/etc/subuid`` range for the builder, as ``--fakeroot`` has on most
clusters; ``setpriv`` or ``su`` in the image). Where it cannot, the step runs
as root with the user's ``HOME``, and the build log says so; an owner that
cannot be changed stays root, also said.
"""

from __future__ import annotations

import shlex

#: The shell functions the steps call; defined once at the top of a stage's %post, before the first step that
#: needs them. They run with tracing off, so the build log's last traced line before a failure stays the step's
#: own call (``+ prorl_as app '/bin/sh -c ...'``), which names the command that failed.
USER_FUNCTIONS = r"""prorl_ids() {
  prorl_uid=; prorl_gid=; prorl_name=
  _pu=${1%%:*}; _pg=; case $1 in *:*) _pg=${1#*:} ;; esac
  if [ -r /etc/passwd ]; then
    while IFS=: read -r _pn _px _pi _pj _pr; do
      if [ "$_pn" = "$_pu" ] || [ "$_pi" = "$_pu" ]; then prorl_name=$_pn; prorl_uid=$_pi; prorl_gid=$_pj; break; fi
    done < /etc/passwd
  fi
  if [ -z "$prorl_uid" ]; then
    case $_pu in ''|*[!0-9]*) echo "prorl: no user $_pu in the image's /etc/passwd" >&2; return 1 ;; esac
    prorl_uid=$_pu; prorl_gid=0
  fi
  if [ "$2" = chown ]; then prorl_gid=$prorl_uid; fi
  case $_pg in
    '') ;;
    *[!0-9]*) prorl_gid=
      if [ -r /etc/group ]; then
        while IFS=: read -r _pn _px _pi _pr; do if [ "$_pn" = "$_pg" ]; then prorl_gid=$_pi; break; fi; done < /etc/group
      fi
      if [ -z "$prorl_gid" ]; then echo "prorl: no group $_pg in the image's /etc/group" >&2; return 1; fi ;;
    *) prorl_gid=$_pg ;;
  esac
}
prorl_as() {
  { prorl_x=$-; set +x; } 2>/dev/null
  _prc=0
  if ! prorl_ids "$1" user; then prorl_uid=0; echo "prorl: USER $1: the step runs as root" >&2; fi
  if [ "$prorl_uid" = 0 ]; then /bin/sh -c "$2" || _prc=$?
  elif command -v setpriv >/dev/null 2>&1 && setpriv --reuid="$prorl_uid" --regid="$prorl_gid" --clear-groups true 2>/dev/null; then
    if [ -n "$prorl_name" ]; then setpriv --reuid="$prorl_uid" --regid="$prorl_gid" --init-groups /bin/sh -c "$2" || _prc=$?
    else setpriv --reuid="$prorl_uid" --regid="$prorl_gid" --clear-groups /bin/sh -c "$2" || _prc=$?; fi
  elif [ -n "$prorl_name" ] && command -v su >/dev/null 2>&1 && su -m -s /bin/sh "$prorl_name" -c true 2>/dev/null; then
    su -m -s /bin/sh "$prorl_name" -c "$2" || _prc=$?
  else
    echo "prorl: USER $1: this build cannot switch users (--fakeroot without an /etc/subuid range for the builder, or no setpriv or su in the image): the step runs as root" >&2
    /bin/sh -c "$2" || _prc=$?
  fi
  { case $prorl_x in *x*) set -x ;; esac; return $_prc; } 2>/dev/null
}
prorl_mkdir() {
  { prorl_x=$-; set +x; } 2>/dev/null
  _pd=${3%/}; _pt=
  while [ -n "$_pd" ] && [ ! -e "$_pd" ] && [ ! -L "$_pd" ]; do _pt=$_pd; _pd=${_pd%/*}; done
  mkdir -p "$3"
  if [ -n "$_pt" ] && prorl_ids "$1" "$2"; then
    chown -R "$prorl_uid:$prorl_gid" "$_pt" 2>/dev/null || echo "prorl: $_pt stays root's: this build cannot change owners" >&2
  fi
  { case $prorl_x in *x*) set -x ;; esac; } 2>/dev/null
}
prorl_chown() {
  { prorl_x=$-; set +x; } 2>/dev/null
  _ps=$1; shift
  if prorl_ids "$_ps" chown; then
    chown -R -h "$prorl_uid:$prorl_gid" "$@" 2>/dev/null || echo "prorl: --chown=$_ps: $* stay root's: this build cannot change owners" >&2
  fi
  { case $prorl_x in *x*) set -x ;; esac; } 2>/dev/null
}"""


def is_root(user: str) -> bool:
    """Whether ``USER`` names root (by name or uid, with or without a group): the steps run as they always do."""
    return user.split(":", 1)[0] in ("root", "0")


def run_as(user: str, command: str) -> str:
    """The %post line that runs ``command`` (a shell command line) as ``user`` (``NAME``, ``UID``, ``NAME:GROUP``)."""
    return f"prorl_as {shlex.quote(user)} {shlex.quote(command)}"


def make_dirs_as(owner: str, path: str, *, chown: bool = False) -> str:
    """The %post line that makes the folder ``path`` and gives the folders it makes to ``owner``.

    ``chown``: ``owner`` is a ``--chown`` value, whose group is the user's uid when it names none, as Docker reads
    it; else it is a ``USER`` value, whose group is the user's own.
    """
    return f"prorl_mkdir {shlex.quote(owner)} {'chown' if chown else 'user'} {shlex.quote(path)}"


def chown_paths(owner: str, paths: list[str]) -> str:
    """The %post line that gives ``paths`` (and what folders among them hold) to a ``--chown`` value."""
    return f"prorl_chown {shlex.quote(owner)} " + " ".join(shlex.quote(p) for p in paths)


def home_of(user: str) -> str:
    """The %post step after ``USER NAME``: the steps after it get NAME's home as ``HOME``, where ``pip install
    --user`` and ``~/.cache`` put what a later ``ENV PATH=/home/NAME/.local/bin:$PATH`` expects. A user
    /etc/passwd does not name leaves HOME as it was."""
    u = shlex.quote(user.split(":", 1)[0].strip())
    return ("_home=; if [ -r /etc/passwd ]; then while IFS=: read -r _n _x _uid _gid _gecos _dir _sh; do "
            f"if [ \"$_n\" = {u} ] || [ \"$_uid\" = {u} ]; then _home=$_dir; break; fi; done < /etc/passwd; fi; "
            "if [ -n \"$_home\" ]; then export HOME=\"$_home\"; fi")
