"""The tool server that runs inside every sandbox.

Standard library only, Python 3.8+: it is bind-mounted read-only into the
sandbox and started with the image's own ``python3``, so any image that has
python3 works with nothing installed. It listens on a Unix domain socket at
a short path (socket paths break past ~108 bytes) and serves:

* ``bash``    one persistent shell on a PTY (not tmux): cwd and env persist,
              per-call timeout (Ctrl-C, then kill), output truncated with a note
* ``python``  a persistent namespace (IPython's InteractiveShell when the image
              has IPython, else ``code``-style exec) in a worker process, so a
              timeout can interrupt it (SIGINT, then kill and restart)
* ``edit``    view / create / str_replace / insert / undo
* ``read_file`` / ``write_file``  bytes in and out
* ``relay``   listen on a TCP address inside the sandbox (its own loopback) and
              relay each connection's bytes to a Unix socket bind-mounted from
              the node (the model gateway): a sandbox without a network reaches
              that one service and nothing else

Wire format (both ways): a 4-byte big-endian length, then a UTF-8 JSON object.
Requests carry ``op``; replies carry ``ok`` and either ``result`` or
``error: {type, message}``. The host side is :mod:`prorl_cli.sandbox.client`.

Run: ``python3 toolserver.py --socket PATH [--tcp HOST:PORT] [--mem-gb N]
[--max-procs N] [--max-file-mb N] [--scratch-mb N] [--remount-sys] [--protect-host]``. It prints
``PRORL-TOOLSERVER-READY`` on stdout once it accepts connections. ``toolserver.py --python-worker RFD WFD``
is the ``python`` tool's worker process (same file, same framing over pipes).
"""

import argparse
import base64
import contextlib
import errno
import io
import json
import os
import pty
import select
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

READY_LINE = "PRORL-TOOLSERVER-READY"
MAX_FRAME_BYTES = 512 * 1024 * 1024
_HEADER = struct.Struct(">I")


# --------------------------------------------------------------------- framing
# One framing for every channel: the socket to the host and the pipes to the python worker.
def encode_frame(obj):
    """One length-prefixed JSON frame, as bytes."""
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return _HEADER.pack(len(data)) + data


def read_frame(read):
    """Read one frame with ``read(n)`` (up to n bytes, b"" at end of file); None when the peer closed."""
    header = _read_exact(read, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    body = _read_exact(read, length)
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def _read_exact(read, n):
    chunks = []
    while n:
        chunk = read(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_frame(sock, obj):
    """Send one frame on a socket."""
    sock.sendall(encode_frame(obj))


def recv_frame(sock):
    """Receive one frame from a socket; None when the peer closed the connection."""
    return read_frame(sock.recv)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


#: Signals the pty shell starts with at their default action, whatever the tool server inherited.
_SHELL_DEFAULT_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ)

class ToolError(Exception):
    """A tool call was refused; the message goes back to the caller."""


# ------------------------------------------------------------------------ bash
class BashSession:
    """One interactive bash on a PTY, driven by sourcing a command file per call.

    Each call writes the command to a file and types one line,
    ``. FILE; printf MARKER $?``, so commands that read stdin cannot swallow
    the marker and multi-line commands and heredocs work. Interactive mode
    gives job control: Ctrl-C reaches the foreground job, not the shell.
    """

    def __init__(self, workdir):
        self.workdir = workdir
        self.pid = None
        self.fd = None
        self.counter = 0
        self.lock = threading.Lock()

    def _spawn(self):
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        argv = [shell, "--noprofile", "--norc", "--noediting", "-i"] if shell.endswith("bash") else [shell, "-i"]
        env = dict(os.environ)
        env.update({"PS1": "", "PS2": "", "TERM": "dumb", "HISTFILE": "/dev/null"})
        env.pop("PROMPT_COMMAND", None)
        pid, fd = pty.fork()
        if pid == 0:  # child: the shell
            try:
                # The shell runs in a session of its own (the pty's); its jobs end on the hangup that closing the
                # pty sends. Dispositions inherited as ignored (``nohup`` ignores SIGHUP, Python SIGPIPE) would
                # survive exec and let them outlive the sandbox, so the shell starts with the defaults.
                for sig in _SHELL_DEFAULT_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                attrs = termios.tcgetattr(0)
                attrs[1] &= ~termios.ONLCR  # raw newlines in output
                attrs[3] &= ~(termios.ECHO | termios.ECHONL)  # no echo of our input lines
                termios.tcsetattr(0, termios.TCSANOW, attrs)
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self._run_raw("set +o history 2>/dev/null; unset PROMPT_COMMAND; PS1=''; PS2=''", 10.0, 1 << 16)

    def close(self):
        """Hang up the shell and kill its jobs (they are in its session)."""
        if self.pid is None:
            return
        pid, fd = self.pid, self.fd
        self.pid = self.fd = None
        # Background jobs have process groups of their own in the shell's
        # session: kill the whole session (without a PID namespace, as in the
        # local runtime, nothing else would).
        for member in _session_members(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

    def _alive(self):
        if self.pid is None:
            return False
        try:
            done, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return done == 0

    def run(self, command, timeout_s, max_output_bytes, output_limit_bytes=0):
        with self.lock:
            if not self._alive():
                self.close()
                self._spawn()
            return self._run_raw(command, timeout_s, max_output_bytes, output_limit_bytes)

    def _run_raw(self, command, timeout_s, max_output_bytes, output_limit_bytes=0):
        self.counter += 1
        nonce = f"{os.getpid():x}{self.counter:x}"
        path = os.path.join(self.workdir, f"cmd-{nonce}.sh")
        with open(path, "w") as f:
            f.write(command)
            f.write("\n")
        out = _Output(max_output_bytes)
        marker = (f"\x1ePRORL-{nonce}:").encode()
        self._type(f". {path}; printf '\\036PRORL-{nonce}:%d\\036' \"$?\"\n")
        rc = self._collect(out, marker, time.monotonic() + timeout_s, output_limit_bytes)
        restarted = timed_out = limited = False
        if rc is _EXITED:  # the command ended the shell (``exit 3``): report, start afresh
            rc, restarted = self._reap(), True
            self._spawn()
        elif rc is None or rc is _LIMITED:
            # Past its time, or it printed more than the output limit: interrupt it the same way.
            timed_out, limited = rc is None, rc is _LIMITED
            rc, restarted = self._interrupt(out, nonce)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return {
            "output": out.text(),
            "exit_code": rc,
            "timed_out": timed_out,
            "truncated": out.truncated,
            "output_bytes": out.total,
            "shell_restarted": restarted,
            "output_limited": limited,
        }

    def _type(self, line):
        os.write(self.fd, line.encode())

    def _collect(self, out, marker, deadline, limit_bytes=0):
        """Read until ``marker<rc>\\x1e``; return rc, None at the deadline, ``_EXITED`` at EOF, or
        ``_LIMITED`` once more than ``limit_bytes`` (if set) came."""
        window = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                out.add(window)
                return None
            if limit_bytes and out.total > limit_bytes:
                out.add(window)
                return _LIMITED
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError as e:  # EIO: the shell exited
                if e.errno != errno.EIO:
                    raise
                data = b""
            if not data:
                out.add(window)
                return _EXITED
            window += data
            at = window.find(marker)
            if at >= 0:
                end = window.find(b"\x1e", at + len(marker))
                if end >= 0:
                    out.add(window[:at])
                    return int(window[at + len(marker) : end])
            # Keep only a tail that could hold a marker split across reads.
            keep = len(marker) + 24
            if len(window) > keep:
                out.add(window[:-keep])
                window = window[-keep:]

    def _interrupt(self, out, nonce):
        """Ctrl-C the running command; if it ignores that, kill its process group.

        Returns (exit code or None, whether the shell had to be restarted).
        """
        os.write(self.fd, b"\x03")  # SIGINT to the foreground job (the tty flushes pending input)
        self.counter += 1
        sync = f"{os.getpid():x}{self.counter:x}"
        sync_marker = (f"\x1ePRORL-{sync}:").encode()
        # A job reading the terminal (cat, a prompt) would read the sync line before it dies of the SIGINT:
        # type it once the shell has the terminal back.
        if not self._shell_in_foreground(time.monotonic() + 2.0, out):
            try:  # it ignores SIGINT: kill the foreground process group
                fg = os.tcgetpgrp(self.fd)
                if fg != self.pid:
                    os.killpg(fg, signal.SIGKILL)
            except OSError:
                pass  # it ended by itself meanwhile
            self._shell_in_foreground(time.monotonic() + 2.0, out)
        self._type(f"printf '\\036PRORL-{sync}:%d\\036' \"$?\"\n")
        rc = self._collect(out, sync_marker, time.monotonic() + 2.0)
        if rc is not None and rc is not _EXITED:
            out.drop_marker(nonce)
            return rc, False
        # The shell itself is stuck or gone: start a fresh one (cwd and env are lost).
        self.close()
        self._spawn()
        return None, True

    def _shell_in_foreground(self, deadline, out):
        """Wait until the shell's own process group holds the terminal (its job ended), keeping what is printed
        meanwhile; return whether it does by ``deadline``."""
        while True:
            try:
                if os.tcgetpgrp(self.fd) == self.pid:
                    return True
            except OSError:
                return False  # the terminal is gone with the shell
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], min(remaining, 0.01))
            if ready:
                try:
                    out.add(os.read(self.fd, 1 << 16))
                except OSError:
                    return False

    def _reap(self):
        """Exit status of a shell that ended; None if it was killed by a signal."""
        pid, fd = self.pid, self.fd
        self.pid = self.fd = None
        os.close(fd)
        _, status = os.waitpid(pid, 0)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None


_EXITED = object()  # _collect's answer when the shell ended
_LIMITED = object()  # _collect's answer when the command printed more than its output limit


def _proc_stats():
    """``(pid, fields)`` for every process in /proc: ``fields`` from its ``stat`` after the command name
    (``fields[0]`` the state, ``[1]`` the parent pid, ``[4]`` the session id)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # it ended while we looked
        yield int(entry), raw[raw.rindex(")") + 2 :].split()


def _session_members(sid):
    """Pids in session ``sid`` (Linux /proc), the leader included."""
    return [pid for pid, fields in _proc_stats() if int(fields[4]) == sid]


class _Output:
    """Keeps the head and tail of a command's output, up to a byte budget."""

    def __init__(self, max_bytes):
        self.max_bytes = max(int(max_bytes), 256)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.truncated = False

    def add(self, data):
        if not data:
            return
        self.total += len(data)
        half = self.max_bytes // 2
        room = half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > half:
                self.truncated = True
                del self.tail[: len(self.tail) - half]

    def drop_marker(self, nonce):
        # A command that finished just as it was interrupted printed its own marker.
        marker = (f"\x1ePRORL-{nonce}:").encode()
        for buf in (self.head, self.tail):
            at = buf.find(marker)
            if at >= 0:
                end = buf.find(b"\x1e", at + len(marker))
                del buf[at : end + 1 if end >= 0 else len(buf)]

    def text(self):
        if not self.truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace")
        note = (
            f"\n[... output truncated: {self.total} bytes in all; "
            f"showing the first {len(self.head)} and the last {len(self.tail)} ...]\n"
        )
        return bytes(self.head).decode("utf-8", "replace") + note + bytes(self.tail).decode("utf-8", "replace")


# ---------------------------------------------------------------------- python
def python_worker(rfd, wfd):
    """The ``python`` tool's worker: run cells in one namespace, one frame in and one out per cell."""
    import ast
    import traceback

    shell = _ipython_shell()
    ns = {"__name__": "__main__"}
    _write_all(wfd, encode_frame({"ready": True, "ipython": shell is not None}))
    while True:
        request = read_frame(lambda n: os.read(rfd, n))
        if request is None:
            return  # the tool server closed the pipe
        code = request["code"]
        limit = int(request.get("max_output_bytes") or 64 * 1024)
        out, err = _CappedText(limit), _CappedText(limit)
        result = error = None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                if shell is not None:
                    r = shell.run_cell(code, store_history=False)
                    if r.error_in_exec is not None or r.error_before_exec is not None:
                        e = r.error_in_exec or r.error_before_exec
                        error = f"{type(e).__name__}: {e}"
                    elif r.result is not None:
                        result = repr(r.result)
                else:
                    tree = ast.parse(code, "<cell>", "exec")
                    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
                    exec(compile(tree, "<cell>", "exec"), ns)
                    if last is not None:
                        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
                        if value is not None:
                            result = repr(value)
        except KeyboardInterrupt:
            error = "KeyboardInterrupt: interrupted at the call's timeout"
        except BaseException as e:  # the cell's error is the tool's answer, whatever it is
            error = "".join(traceback.format_exception_only(type(e), e)).strip()
            err.write(traceback.format_exc())
        _write_all(wfd, encode_frame({"stdout": out.getvalue(), "stderr": err.getvalue(),
                                      "result": _cap_text(result, limit), "error": _cap_text(error, limit)}))


class _CappedText(io.TextIOBase):
    """A cell's stdout or stderr (as ``io.StringIO`` was) that keeps only the head and tail of ``max_bytes``."""

    def __init__(self, max_bytes):
        super().__init__()
        self.out = _Output(max_bytes)
        self._buffer = _CappedBytes(self.out)

    @property
    def buffer(self):
        """The binary side (``sys.stdout.buffer.write(b"...")``): the same budget; shown decoded as UTF-8."""
        return self._buffer

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def write(self, text):
        self.out.add(text.encode("utf-8", "surrogateescape"))
        return len(text)

    def getvalue(self):
        return self.out.text()


class _CappedBytes(io.RawIOBase):
    """The ``buffer`` of a :class:`_CappedText`: bytes into the same head-and-tail budget."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def writable(self):
        return True

    def write(self, data):
        data = bytes(data)
        self.out.add(data)
        return len(data)


def _cap_text(text, limit):
    """``text`` cut to its head and tail when longer than ``limit`` characters (None stays None)."""
    if text is None or len(text) <= limit:
        return text
    half = max(limit // 2, 128)
    return f"{text[:half]}\n[... {len(text)} characters in all; showing the first and the last {half} ...]\n{text[-half:]}"


def _ipython_shell():
    """IPython's InteractiveShell in plain-text mode, or None when the image has no IPython."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
    except ImportError:
        return None
    shell = InteractiveShell.instance()
    # Plain text for a model to read: no colours, no "Out[n]:" echo of results.
    for scheme in ("nocolor", "NoColor"):
        try:
            shell.colors = scheme
            break
        except Exception:  # IPython versions name the scheme differently
            continue
    shell.displayhook.write_output_prompt = lambda: None
    shell.displayhook.write_format_data = lambda *a, **k: None
    return shell


class PythonSession:
    """A persistent Python namespace in a worker process that a timeout can interrupt."""

    def __init__(self):
        self.proc = None
        self.rfd = self.wfd = None
        self.ipython = False
        self.lock = threading.Lock()

    def _spawn(self):
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--python-worker", str(to_worker_r), str(from_worker_w)],
            pass_fds=(to_worker_r, from_worker_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        self.wfd, self.rfd = to_worker_w, from_worker_r
        hello = self._read(30.0)
        if hello is None:
            raise ToolError("the python worker did not start")
        self.ipython = bool(hello.get("ipython"))

    def close(self):
        if self.proc is None:
            return
        self.proc.kill()
        self.proc.wait()
        for fd in (self.rfd, self.wfd):
            os.close(fd)
        self.proc = None

    def _read(self, timeout_s):
        """The worker's next frame, or None if none starts within ``timeout_s`` (or the worker died)."""
        if not select.select([self.rfd], [], [], max(0.0, timeout_s))[0]:
            return None
        # The worker writes each frame at once: once it starts, the rest follows.
        return read_frame(lambda n: os.read(self.rfd, n))

    def run(self, code, timeout_s, max_output_bytes=64 * 1024):
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._spawn()
            _write_all(self.wfd, encode_frame({"code": code, "max_output_bytes": max_output_bytes}))
            reply = self._read(timeout_s)
            if reply is not None:
                reply.update(timed_out=False, restarted=False)
                return reply
            self.proc.send_signal(signal.SIGINT)  # KeyboardInterrupt in the cell
            reply = self._read(2.0)
            if reply is not None:
                reply.update(timed_out=True, restarted=False,
                             error=f"KeyboardInterrupt: interrupted at the {timeout_s:.1f} s timeout")
                return reply
            self.close()  # it ignored SIGINT: the namespace is lost
            return {"stdout": "", "stderr": "", "result": None, "timed_out": True, "restarted": True,
                    "error": f"timed out after {timeout_s:.1f} s; the python worker was killed and its namespace reset"}


def _absolute(path):
    """``path``, refused unless absolute: a relative one would resolve against the tool server's own folder
    (the node's, under the local runtime), not the shell's working directory."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ToolError(f"path must be absolute: {path!r}")
    return path


# ---------------------------------------------------------------------- editor
class Editor:
    """File editing with per-file undo history."""

    def __init__(self):
        self.history = {}
        self.lock = threading.Lock()

    @staticmethod
    def _read(path):
        if not os.path.isabs(path):
            raise ToolError(f"path must be absolute: {path!r}")
        if os.path.isdir(path):
            raise ToolError(f"{path} is a directory")
        try:
            # newline="": the file's own line endings, read and written back as they are
            with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
                return f.read()
        except FileNotFoundError as e:
            raise ToolError(f"no such file: {path}") from e

    @staticmethod
    def _lf(raw):
        """(text with LF line ends, whether the file ends every line in CRLF).

        A CRLF file is edited as LF text (the model's old_str spans lines with LF) and written back in CRLF,
        so an edit changes only its own lines; a file of mixed endings is edited as it is.
        """
        crlf = "\r\n" in raw and raw.count("\r\n") == raw.count("\n")
        return (raw.replace("\r\n", "\n"), True) if crlf else (raw, False)

    def _write(self, path, text, before, crlf=False):
        self.history.setdefault(path, []).append(before)
        _write_text(path, text.replace("\n", "\r\n") if crlf else text)

    def call(self, req):
        command, path = req.get("command"), req.get("path", "")
        method = self.COMMANDS.get(command)
        if method is None:
            raise ToolError(f"unknown editor command {command!r} ({', '.join(self.COMMANDS)})")
        with self.lock:
            return method(self, path, req)

    def _view(self, path, req):
        return self.view(path, req.get("view_range"))

    def _create(self, path, req):
        if not os.path.isabs(path):
            raise ToolError(f"path must be absolute: {path!r}")
        before = self._read(path) if os.path.exists(path) else None
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._write(path, req.get("file_text", ""), before)
        return f"created {path}"

    def _str_replace(self, path, req):
        raw = self._read(path)
        text, crlf = self._lf(raw)
        old, new = req.get("old_str", ""), req.get("new_str", "")
        if crlf:
            old, new = old.replace("\r\n", "\n"), new.replace("\r\n", "\n")
        if not old:
            raise ToolError("str_replace needs a non-empty old_str")
        count = text.count(old)
        if count == 0:
            raise ToolError(f"no replacement: old_str does not occur in {path}")
        if count > 1:
            lines = [str(text[: i].count("\n") + 1) for i in _find_all(text, old)]
            raise ToolError(f"no replacement: old_str occurs {count} times in {path} "
                            f"(lines {', '.join(lines)}); make it unique")
        self._write(path, text.replace(old, new, 1), raw, crlf)
        return f"edited {path}"

    def _insert(self, path, req):
        raw = self._read(path)
        text, crlf = self._lf(raw)
        lines = text.split("\n")
        line = req.get("insert_line")
        if not isinstance(line, int) or not 0 <= line <= len(lines):
            raise ToolError(f"insert_line must be an int in [0, {len(lines)}], got {line!r}")
        new_str = req.get("new_str", "")
        new_lines = (new_str.replace("\r\n", "\n") if crlf else new_str).split("\n")
        self._write(path, "\n".join(lines[:line] + new_lines + lines[line:]), raw, crlf)
        return f"inserted {len(new_lines)} line(s) after line {line} of {path}"

    def _undo(self, path, req):
        stack = self.history.get(path)
        if not stack:
            raise ToolError(f"nothing to undo for {path}")
        before = stack.pop()
        if before is None:
            os.unlink(path)
            return f"undid the creation of {path} (removed)"
        _write_text(path, before)
        return f"undid the last edit of {path}"

    COMMANDS = {"view": _view, "create": _create, "str_replace": _str_replace, "insert": _insert, "undo": _undo}

    def view(self, path, view_range):
        if os.path.isdir(path):
            names = sorted(os.listdir(path))
            return "\n".join(n + ("/" if os.path.isdir(os.path.join(path, n)) else "") for n in names)
        lines = self._lf(self._read(path))[0].split("\n")
        start, end = 1, len(lines)
        if view_range is not None:
            if not (isinstance(view_range, list) and len(view_range) == 2):
                raise ToolError(f"view_range must be [start, end], got {view_range!r}")
            start, end = view_range
            end = len(lines) if end == -1 else end
            if not 1 <= start <= end <= len(lines):
                raise ToolError(f"view_range {view_range!r} is outside the file's {len(lines)} lines")
        return "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(start, end + 1))


def _write_text(path, text):
    with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
        f.write(text)


def _find_all(text, sub):
    at = text.find(sub)
    while at >= 0:
        yield at
        at = text.find(sub, at + 1)


# ---------------------------------------------------------------------- server
class FileOps:
    """Byte-exact file copy in and out of the sandbox (base64 on the wire)."""

    @staticmethod
    def read_file(req):
        path = _absolute(req["path"])
        offset, max_bytes = int(req.get("offset") or 0), req.get("max_bytes")
        try:
            with open(path, "rb") as f:
                if offset:
                    f.seek(offset)
                data = f.read(-1 if max_bytes is None else int(max_bytes))
                return {"data": base64.b64encode(data).decode("ascii")}
        except OSError as e:
            raise ToolError(f"cannot read {path}: {e.strerror}") from e

    @staticmethod
    def write_file(req):
        path = _absolute(req["path"])
        data = base64.b64decode(req["data"])
        try:
            if req.get("make_parents", True) and os.path.dirname(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            if req.get("mode") is not None:
                os.chmod(path, int(req["mode"]))
        except OSError as e:
            raise ToolError(f"cannot write {path}: {e.strerror}") from e
        return {"bytes": len(data)}


class Relay:
    """TCP listeners inside the sandbox whose connections are piped to a Unix socket (both ways)."""

    def __init__(self):
        self.listeners = []

    def start(self, req):
        host, port, target = str(req.get("host") or "127.0.0.1"), int(req.get("port") or 0), str(req["target"])
        if not os.path.exists(target):
            raise ToolError(f"relay target {target} does not exist")
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            srv.bind((host, port))
        except OSError as e:
            srv.close()
            raise ToolError(f"relay cannot listen on {host}:{port}: {e.strerror}") from e
        srv.listen(128)
        self.listeners.append(srv)
        threading.Thread(target=self._accept, args=(srv, target), daemon=True).start()
        return {"host": host, "port": srv.getsockname()[1], "target": target}

    def _accept(self, srv, target):
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._connect, args=(conn, target), daemon=True).start()

    @staticmethod
    def _connect(conn, target):
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(target)
        except OSError:
            conn.close()
            upstream.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(upstream, conn), daemon=True)
        back.start()
        _pump(conn, upstream)
        back.join()
        conn.close()
        upstream.close()

    def close(self):
        for srv in self.listeners:
            with contextlib.suppress(OSError):
                srv.close()


def _pump(src, dst):
    """Copy bytes until ``src`` ends, then end ``dst``'s writing side (so the peer sees EOF)."""
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass  # either side went away: the shutdown below tells the other
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class ToolServer:
    """Dispatches requests to the tools through :attr:`ops`; one instance per sandbox."""

    def __init__(self, workdir):
        self.bash = BashSession(workdir)
        self.python = PythonSession()
        self.editor = Editor()
        self.files = FileOps()
        self.relay = Relay()
        self.ops = {
            "ping": self._ping,
            "bash": lambda req: self.bash.run(str(req["command"]), float(req.get("timeout_s", 60.0)),
                                              int(req.get("max_output_bytes", 64 * 1024)),
                                              int(req.get("output_limit_bytes") or 0)),
            "python": lambda req: self.python.run(str(req["code"]), float(req.get("timeout_s", 60.0)),
                                                  int(req.get("max_output_bytes", 64 * 1024))),
            "edit": lambda req: {"output": self.editor.call(req)},
            "read_file": self.files.read_file,
            "write_file": self.files.write_file,
            "relay": self.relay.start,
        }

    def handle(self, req):
        name = req.get("op") if isinstance(req, dict) else None
        op = self.ops.get(name) if isinstance(name, str) else None
        if op is None:
            raise ToolError(f"unknown op {req.get('op')!r}")
        return op(req)

    @staticmethod
    def _ping(req):
        return {"pid": os.getpid(), "python": sys.version.split()[0], "uid": os.getuid(),
                "loopback_ip": os.environ.get("PRORL_LOOPBACK_IP")}

    def own_children(self):
        """Pids of the children this server waits for itself (its shell and its python worker)."""
        return {pid for pid in (self.bash.pid, self.python.proc.pid if self.python.proc else None) if pid}

    def close(self):
        self.relay.close()
        self.bash.close()
        self.python.close()


def _make_handler(server):
    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            while True:
                try:
                    req = recv_frame(self.request)
                except (ValueError, OSError) as e:
                    send_frame(self.request, {"ok": False, "error": {"type": "ProtocolError", "message": str(e)}})
                    return
                if req is None:
                    return
                try:
                    reply = {"ok": True, "result": server.handle(req)}
                except ToolError as e:
                    reply = {"ok": False, "error": {"type": "ToolError", "message": str(e)}}
                except KeyError as e:
                    reply = {"ok": False, "error": {"type": "ToolError", "message": f"missing field {e}"}}
                except Exception as e:  # report, keep serving: one bad call must not end the sandbox
                    reply = {"ok": False, "error": {"type": type(e).__name__, "message": str(e)}}
                send_frame(self.request, reply)

    return Handler


class _ReapAdopted:
    """Between requests, collects the exit status of orphans adopted as a child subreaper (``--subreaper``)."""

    tool_server = None  # the ToolServer: its shell and python worker it waits for itself

    def service_actions(self):
        super().service_actions()
        if self.tool_server is not None and _SUBREAPER[0]:
            _reap_adopted(self.tool_server.own_children())


class _UnixServer(_ReapAdopted, socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _TCPServer(_ReapAdopted, socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().server_bind()


def _apply_limits(mem_gb, max_procs, max_file_mb=0):
    import resource

    if mem_gb:
        limit = int(mem_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if max_procs:
        resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
    if max_file_mb:
        # No file may grow past the sandbox's disk limit (a write beyond it fails with EFBIG, SIGXFSZ).
        limit = int(max_file_mb * (1 << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    # When the host runs out of memory, the kernel's OOM killer takes the sandbox's processes (which
    # inherit this) before the node's or anyone else's. Raising one's own score needs no privilege.
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass  # no /proc (not Linux as usual): the limits above still hold


_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
#: Mount options that must be kept in a remount from a user namespace (the kernel locks them).
_LOCKED_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": 1 << 10,
                 "nodiratime": 1 << 11, "relatime": 1 << 21, "strictatime": 1 << 24}
_SCRATCH = {"tmp": "/tmp", "var_tmp": "/var/tmp", "shm": "/dev/shm"}


def _mounts():
    """The mount table as (target, fstype, options) rows, targets unescaped, in mount order."""
    rows = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 4:
                rows.append((fields[1].replace("\\040", " "), fields[2], fields[3].split(",")))
    return rows


def _private_scratch(size_mb):
    """Bounded in-memory scratch, for Apptainer's fakeroot sandboxes (root in their own user and mount namespace).

    Apptainer gives /tmp, /var/tmp, /dev/shm, /dev, /etc/hosts and /etc/resolv.conf
    as tmpfs without a size: writing there would take the host's memory. One
    tmpfs of ``size_mb`` now holds /tmp, /var/tmp and /dev/shm (a directory of it
    bound on each, so they share the budget), and the other tmpfs mounts are made
    read-only. Returns whether it worked; on failure it says why on stderr (the
    sandbox's log) and the mounts stay as they were.
    """
    mount = _libc_mount()
    try:
        before = _mounts()
        targets = {name: path for name, path in _SCRATCH.items() if os.path.isdir(path)}
        mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={int(size_mb)}m,mode=1777")
        for name in targets:
            os.mkdir(f"/tmp/{name}")
            os.chmod(f"/tmp/{name}", 0o1777)
        for name, path in targets.items():
            if name != "tmp":
                mount(f"/tmp/{name}", path, None, _MS_BIND)
        mount("/tmp/tmp", "/tmp", None, _MS_BIND)  # last: covers the tmpfs's root and its other directories
    except OSError as e:
        sys.stderr.write(f"toolserver: could not set up bounded scratch space ({e}); /tmp, /var/tmp and /dev/shm "
                         "stay in the session folder\n")
        return False
    done = True
    for target, fstype, _ in before:
        # /sys/fs/cgroup: hidden by _protect_host (or under a fresh /sys already).
        if fstype != "tmpfs" or target in _SCRATCH.values() or target.startswith(("/sys/", "/proc/")):
            continue
        try:
            _remount_read_only(mount, target)
        except OSError as e:
            sys.stderr.write(f"toolserver: {target} stays a writable tmpfs without a size ({e})\n")
            done = False
    return done


def _libc_mount():
    """``mount(source, target, fstype, flags, data)`` through libc, raising ``OSError``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data=None):
        if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                      data.encode() if data else None) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

    return mount


def _mount_options(target):
    """The options of the mount on ``target`` (the topmost), or None if ``target`` is no mount point."""
    found = None
    for mounted, _, options in _mounts():
        if mounted == target:
            found = options
    return found


def _remount_read_only(mount, target):
    """Make ``target`` read-only (bound onto itself first when it is no mount point of its own)."""
    options = _mount_options(target)
    if options is None:
        mount(target, target, None, _MS_BIND)
        options = _mount_options(target) or []
    if "ro" in options:
        return
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    for option in options:
        flags |= _LOCKED_FLAGS.get(option, 0)  # a user namespace may not drop these
    mount("none", target, None, flags)


def _protect_host():
    """The host's settings and files out of the sandbox's reach, for Apptainer's fakeroot sandboxes.

    Run by a root node, the sandbox's root is the host's uid 0 (without its
    capabilities): file permissions alone would let it write the host's
    sysctls (/proc/sys), /proc/sysrq-trigger, /sys (when it is the host's), the
    host's cgroup hierarchy, and the host files Apptainer binds into /etc
    (/etc/localtime; /etc/hosts and /etc/resolv.conf with the host's network).
    Those become read-only, and /sys/fs/cgroup is covered.
    """
    mount = _libc_mount()
    done = True
    etc = sorted({target for target, _, _ in _mounts() if target.startswith("/etc/")})
    for target in ("/proc/sys", "/proc/sysrq-trigger", "/sys", *etc):
        if not os.path.exists(target):
            continue
        try:
            _remount_read_only(mount, target)
        except OSError as e:
            sys.stderr.write(f"toolserver: {target} stays writable ({e})\n")
            done = False
    if os.path.ismount("/sys/fs/cgroup"):
        # The host's cgroup hierarchy (a /sys shared with the host): out of sight, so no process
        # inside can leave the sandbox's cgroup or touch another's.
        try:
            mount("tmpfs", "/sys/fs/cgroup", "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k")
        except OSError as e:
            sys.stderr.write(f"toolserver: /sys/fs/cgroup stays visible ({e})\n")
            done = False
    return done


_PR_SET_CHILD_SUBREAPER = 36
_SUBREAPER = [False]  # set once main() has made this process a child subreaper


def _become_subreaper():
    """Adopt the orphans of what the tools start (a daemon's double fork), so they stay our descendants.

    Without a PID namespace (the local runtime) an orphan would go to the host's init, out of the node's
    reach when it stops the sandbox; as our descendant it is found and ended with us.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write(f"toolserver: cannot become a child subreaper: {os.strerror(ctypes.get_errno())}\n")
        return
    _SUBREAPER[0] = True


def _reap_adopted(own):
    """Collect exited adopted orphans (zombies whose parent we are), leaving the children in ``own`` alone."""
    me = os.getpid()
    for pid, fields in _proc_stats():
        if pid not in own and fields[0] == "Z" and int(fields[1]) == me:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def _remount_sys():
    # A fresh sysfs shows this sandbox's network namespace (only lo), not the
    # host's devices; it needs root in the sandbox's user namespace (fakeroot).
    try:
        _libc_mount()("sysfs", "/sys", "sysfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError as e:
        sys.stderr.write(f"toolserver: could not mount a fresh /sys: {e.strerror}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description="prorl sandbox tool server")
    parser.add_argument("--socket", help="Unix socket path to listen on")
    parser.add_argument("--tcp", help="HOST:PORT to listen on instead (benchmarks)")
    parser.add_argument("--mem-gb", type=float, default=0.0)
    parser.add_argument("--max-procs", type=int, default=0)
    parser.add_argument("--max-file-mb", type=float, default=0.0)
    parser.add_argument("--scratch-mb", type=int, default=0,
                        help="one tmpfs of this size for /tmp, /var/tmp, /dev/shm; other tmpfs read-only (needs root "
                             "in the sandbox's user namespace)")
    parser.add_argument("--remount-sys", action="store_true")
    parser.add_argument("--protect-host", action="store_true",
                        help="make /proc/sys, /proc/sysrq-trigger, /sys and the binds into /etc read-only, cover "
                             "/sys/fs/cgroup (needs root in the sandbox's user namespace)")
    parser.add_argument("--subreaper", action="store_true",
                        help="adopt orphaned descendants (the local runtime: no PID namespace holds them)")
    parser.add_argument("--python-worker", nargs=2, type=int, metavar=("RFD", "WFD"),
                        help="run as the python tool's worker on these pipe fds (the tool server starts it)")
    args = parser.parse_args(argv)
    if args.python_worker:
        python_worker(*args.python_worker)
        return
    if bool(args.socket) == bool(args.tcp):
        parser.error("give exactly one of --socket and --tcp")
    if args.subreaper:
        _become_subreaper()
    if args.remount_sys:
        _remount_sys()
    if args.scratch_mb:
        _private_scratch(args.scratch_mb)  # before any tool runs: it covers what /tmp held
    if args.protect_host:
        _protect_host()
    # The bash tool's command files: beside the socket (the run directory, outside the sandbox's scratch
    # space), so a command that fills /tmp does not leave the tools unable to run the next one.
    workdir = tempfile.mkdtemp(prefix="prorl-tools-", dir=os.path.dirname(args.socket) if args.socket else None)
    server = ToolServer(workdir)
    _apply_limits(args.mem_gb, args.max_procs, args.max_file_mb)
    if args.socket:
        if os.path.exists(args.socket):
            os.unlink(args.socket)
        srv = _UnixServer(args.socket, _make_handler(server))
    else:
        host, port = args.tcp.rsplit(":", 1)
        srv = _TCPServer((host, int(port)), _make_handler(server))
    srv.tool_server = server

    def _stop(signum, frame):
        # Shut down from another thread: serve_forever() is running in this one.
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if args.tcp:
        sys.stdout.write(f"{READY_LINE} {srv.server_address[0]}:{srv.server_address[1]}\n")
    else:
        sys.stdout.write(READY_LINE + "\n")
    sys.stdout.flush()
    # Nobody reads our stdout after the ready line; send later writes (ours and
    # the python worker's) to stderr, the sandbox's log, so no pipe fills up.
    os.dup2(2, 1)
    try:
        srv.serve_forever(poll_interval=0.5)
    finally:
        server.close()
        srv.server_close()
        if args.socket and os.path.exists(args.socket):
            os.unlink(args.socket)


if __name__ == "__main__":
    main()
