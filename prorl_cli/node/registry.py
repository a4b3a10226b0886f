"""Handler discovery: the built-in package, extra paths, and entry points.

Handlers are :class:`~prorl_cli.node.handler.AgentHandler` subclasses with a
non-empty ``name``. Sources, in order:

- the built-in package :mod:`prorl_cli.handlers` (the repository's
  ``handlers/`` folder), each module imported by its package name;
- the folders, files or importable packages (a dotted name such as
  ``prorl_cli.testing.handlers``) in ``node.handler_paths`` (``prorl serve
  node --handlers PATH``) and in ``PRORL_HANDLER_PATHS`` (``os.pathsep``-separated;
  test deployments use it to add :mod:`prorl_cli.testing.handlers`). A file
  inside an importable package is imported by its package name, so its
  classes are the ones tests import; any other file as ``prorl_handlers.<stem>``;
- the ``prorl.handlers`` entry-point group (each entry point names a handler
  class or a module).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from prorl_cli.exceptions import HandlerError, SettingsError, UnknownTask
from prorl_cli.node.handler import AgentHandler
from prorl_cli.node.settings import deployment_settings, resolve_settings

if TYPE_CHECKING:
    from prorl_cli.config import ProrlConfig

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "prorl.handlers"
#: Extra handler paths from the environment (``os.pathsep``-separated), added to ``node.handler_paths``.
ENV_HANDLER_PATHS = "PRORL_HANDLER_PATHS"
BUILTIN_PACKAGE = "prorl_cli.handlers"


@dataclass
class HandlerRegistry:
    """Handler classes by task name, plus the load errors met on the way."""

    handlers: dict[str, type[AgentHandler]] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, cls: type[AgentHandler], origin: str) -> None:
        if not cls.name:
            raise HandlerError(f"{origin}: handler class {cls.__name__} has no name")
        if cls.name in self.handlers and self.handlers[cls.name] is not cls:
            raise HandlerError(
                f"task {cls.name!r} is defined twice: in {self.origins[cls.name]} and in {origin}"
            )
        self.handlers[cls.name] = cls
        self.origins[cls.name] = origin

    def get(self, task: str) -> type[AgentHandler]:
        try:
            return self.handlers[task]
        except KeyError:
            raise UnknownTask(f"unknown task {task!r}; this node serves {sorted(self.handlers)}") from None

    @property
    def tasks(self) -> list[str]:
        return sorted(self.handlers)

    def start_errors(self, config: ProrlConfig) -> list[str]:
        """Why a node serving these handlers with ``config`` refuses to start: handler files or packages that
        failed to load, and bad ``handlers.<task>`` settings. ``prorl config check`` reports the same."""
        return self.errors + self.settings_errors(config)

    def settings_errors(self, config: ProrlConfig) -> list[str]:
        """Problems of ``handlers.<task>`` (or the old ``domains.<task>``) in prorl.yaml for the served handlers.

        Checked at node start, so bad deployment settings stop the node instead of failing every job.
        """
        errors = []
        for name, cls in sorted(self.handlers.items()):
            try:
                where, layer = deployment_settings(config, cls.settings_section or name)
                settings = resolve_settings(cls.defaults, (where, layer))
                declared = {t.name for t in cls.tools}
                unknown = sorted(set(settings.tools or ()) - declared)
                if unknown:
                    raise SettingsError(f"{where}: tools {unknown} do not exist; {name} offers {sorted(declared)}")
            except SettingsError as e:
                errors.append(str(e))
        return errors


def _handler_classes(module: ModuleType) -> list[type[AgentHandler]]:
    return [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, AgentHandler)
        and obj is not AgentHandler
        and obj.name
        and not inspect.isabstract(obj)
        and obj.__module__ == module.__name__
    ]


def _package_name(path: Path) -> str | None:
    """The dotted name ``path`` is importable under (a file in a package on ``sys.path``), else ``None``."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1:
        return None
    roots = {Path(p or ".").resolve() for p in sys.path}
    if folder.resolve() not in roots and not _already_imported(parts[0], folder):
        return None  # a package nobody imports from: load the file on its own
    name = ".".join(parts)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or Path(spec.origin).resolve() != path.resolve():
        return None
    return name


def _already_imported(top: str, folder: Path) -> bool:
    """Whether the package ``top`` is imported already from ``folder`` (an installed prorl_cli, say)."""
    module = sys.modules.get(top)
    paths = getattr(module, "__path__", None) or []
    return any(Path(p).resolve() == (folder / top).resolve() for p in paths)


def _import_module(name: str, path: Path) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as e:  # a plugin may raise anything at import; report it by file and line
        raise HandlerError(f"{_where(e, path)}: import failed: {type(e).__name__}: {e}") from e


def _import_file(path: Path) -> ModuleType:
    package_name = _package_name(path)
    if package_name is not None:
        return _import_module(package_name, path)
    name = f"prorl_handlers.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise HandlerError(f"{path}: cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a plugin may raise anything at import; report it by file and line
        sys.modules.pop(name, None)
        raise HandlerError(f"{_where(e, path)}: import failed: {type(e).__name__}: {e}") from e
    return module


def _where(e: BaseException, path: Path) -> str:
    """``file:line`` of the handler file where an import failed (the deepest frame in that file)."""
    if isinstance(e, SyntaxError) and e.lineno is not None:
        return f"{e.filename or path}:{e.lineno}"
    line = None
    tb = e.__traceback__
    target = path.resolve()
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == target:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}:{line}" if line is not None else str(path)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    raise HandlerError(f"{path}: handler path does not exist")


def _add_package(reg: HandlerRegistry, package_name: str) -> None:
    """Every module of a package (or the one module) named ``package_name``, imported by name."""
    try:
        package = importlib.import_module(package_name)
    except Exception as e:  # plugin code: report which package broke
        reg.errors.append(f"handler package {package_name}: import failed: {type(e).__name__}: {e}")
        return
    if not hasattr(package, "__path__"):
        _add_module(reg, package)
        return
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        path = Path(package.__path__[0]) / f"{info.name}.py"
        try:
            _add_module(reg, _import_module(f"{package_name}.{info.name}", path))
        except HandlerError as e:
            reg.errors.append(str(e))


def _add_module(reg: HandlerRegistry, module: ModuleType) -> None:
    for cls in _handler_classes(module):
        try:
            reg.add(cls, str(getattr(module, "__file__", None) or module.__name__))
        except HandlerError as e:
            reg.errors.append(str(e))


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _is_module_name(entry: str) -> bool:
    """A dotted name (``prorl_cli.testing.handlers``) rather than a path, importable here."""
    if not _MODULE_NAME.fullmatch(entry) or Path(entry).exists():
        return False
    try:
        return importlib.util.find_spec(entry) is not None
    except (ImportError, ValueError):
        return False


def discover(extra_paths: list[str] | None = None, only: list[str] | None = None) -> HandlerRegistry:
    """Find every handler. A module that fails to import is recorded in ``errors`` and skipped.

    Callers that serve handlers (the node) refuse to start while ``errors`` is not empty.
    """
    reg = HandlerRegistry()
    _add_package(reg, BUILTIN_PACKAGE)
    from_env = [p for p in os.environ.get(ENV_HANDLER_PATHS, "").split(os.pathsep) if p]
    for entry in dict.fromkeys([*(extra_paths or []), *from_env]):
        if _is_module_name(entry):
            _add_package(reg, entry)
            continue
        root = Path(entry).expanduser()
        try:
            files = _files(root)
        except HandlerError as e:
            reg.errors.append(str(e))
            continue
        for file in files:
            try:
                module = _import_file(file)
                for cls in _handler_classes(module):
                    reg.add(cls, str(file))
            except HandlerError as e:
                reg.errors.append(str(e))
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # third-party code: report which entry point broke
            reg.errors.append(f"entry point {ep.name!r} ({ep.value}): {type(e).__name__}: {e}")
            continue
        classes = _handler_classes(obj) if inspect.ismodule(obj) else [obj]
        for cls in classes:
            if not (inspect.isclass(cls) and issubclass(cls, AgentHandler)):
                reg.errors.append(f"entry point {ep.name!r} ({ep.value}) is not an AgentHandler")
                continue
            try:
                reg.add(cls, f"entry point {ep.name}")
            except HandlerError as e:
                reg.errors.append(str(e))
    if only:
        missing = sorted(set(only) - set(reg.handlers))
        if missing:
            # A task whose file or package failed to import is "unknown" only because of that failure: the
            # failure (file, line, error) goes first, or the user hunts for a typo in the task's name.
            raise HandlerError("; ".join([*reg.errors, f"node.tasks names unknown task(s) {missing}; found {reg.tasks}"]))
        reg.handlers = {k: v for k, v in reg.handlers.items() if k in only}
    return reg
