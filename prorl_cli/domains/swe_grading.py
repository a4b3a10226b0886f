"""SWE instance fields: which test files a test patch touches, and the FAIL_TO_PASS / PASS_TO_PASS lists.

Grading itself lives in :mod:`prorl_cli.swe.grading` (exact node ids, then
the ``swebench`` package's rules).
"""

from __future__ import annotations

import json
import re
from typing import Any

from prorl_cli.exceptions import DomainError


def test_files(test_patch: str) -> list[str]:
    """Files a (unified, git) test patch creates or changes, in order."""
    files = []
    for m in re.finditer(r"^\+\+\+ b/(\S+)", test_patch, re.MULTILINE):
        if m.group(1) not in files:
            files.append(m.group(1))
    return files


#: Files a test patch touches that no test runner takes as an argument (fixtures, data, docs), as SWE-bench's
#: harness leaves them off its command line: pytest stops at such a path ("ERROR: not found"), running no test.
DATA_SUFFIXES = (".json", ".png", ".csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml")


def test_targets(test_patch: str, *test_names: list[str]) -> list[str]:
    """Test files to run: those the test patch touches (data files left out, :data:`DATA_SUFFIXES`), plus the
    files of pytest node ids in ``test_names``."""
    files = [name for name in test_files(test_patch) if not name.lower().endswith(DATA_SUFFIXES)]
    for names in test_names:
        for name in names:
            path = name.split("::", 1)[0]
            if "::" in name and path.endswith(".py") and path not in files:
                files.append(path)
    return files


def test_list(value: Any, field_name: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS as a list (SWE-bench ships them as JSON strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DomainError(f"swe: {field_name} is neither a list nor a JSON list: {e.msg}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise DomainError(f"swe: {field_name} must be a list of test names, got {value!r}")
    return value
