"""How prorl reads its YAML files (prorl.yaml, deploy.yaml, image lists, workloads, sampling files).

``yaml.safe_load`` follows YAML 1.1, whose numbers surprise people who write
YAML 1.2 (and JSON): an unquoted ``24:00:00`` is the base-60 integer 86400,
``012`` the octal 10, and ``1e3`` (no dot) the string ``"1e3"``. :class:`Loader`
is PyYAML's safe loader with YAML 1.2's numbers instead: no base-60 or
leading-zero octal numbers, and exponents with or without a dot. Everything
else resolves as in ``yaml.safe_load``.
"""

from __future__ import annotations

import re
from typing import IO, Any

import yaml

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"


class Loader(yaml.SafeLoader):
    """A safe loader with YAML 1.2's integers and floats (see the module docstring)."""


Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(
    # No YAML 1.1 octal either: an unquoted 012 is not the integer 10 (it stays the text "012").
    _INT, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
                       r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)"
                       r"|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def load(text: str | IO[str]) -> Any:
    """The value of one YAML document (text, or a stream whose ``name`` the parser's errors then give), read
    with :class:`Loader`."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
