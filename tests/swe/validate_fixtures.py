"""Six SWE instances, one per class ``prorl swe validate`` tells apart, on the tinycalc and spacey repositories.

Each is a real row (a real gold patch and test patch made by git) with
``repo_path``, so every sandbox clones the repository from this machine and
any image with python3, pytest and git serves (the domain test image):

- ``valid``: tinycalc as shipped;
- ``gold-fails``: its gold patch also breaks ``add`` (a PASS_TO_PASS test fails in every gold run);
- ``env-broken``: an install step that fails (a module the image lacks), so no run is evaluated;
- ``f2p-passes``: FAIL_TO_PASS lists ``test_add``, which passes without the fix;
- ``flaky``: its test patch adds a test that depends on state outside the repository (a folder
  every sandbox of the run shares, :data:`SHARED_INSIDE`): it fails on every other run;
- ``spaces``: spacey, whose node ids hold spaces, brackets and unicode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prorl_cli.domains.tinyrepo import make_tinyrepo
from tests.swe.spacey import make_spacey

#: Where the flaky test finds the shared folder (the test binds a host folder there).
SHARED_INSIDE = "/mnt/prorl-shared"
FLAKY_TEST = f'''import os

SHARED = "{SHARED_INSIDE}"


def test_shared_counter():
    # Depends on state outside the repository: the runs take turns, and every other one fails.
    n = 0
    while True:
        try:
            os.close(os.open(os.path.join(SHARED, f"run-{{n}}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            n += 1
    assert n % 2 == 1
'''
FLAKY_ID = "tests/test_flaky.py::test_shared_counter"
EXPECTED = {
    "prorl__tinycalc-valid": "valid",
    "prorl__tinycalc-gold-fails": "gold-fails",
    "prorl__tinycalc-env-broken": "env-broken",
    "prorl__tinycalc-f2p-passes": "f2p-passes-without-fix",
    "prorl__tinycalc-flaky": "flaky",
    "prorl__spacey-flat-1": "valid",
}


def new_file_diff(path: str, text: str) -> str:
    """A git diff creating ``path`` with ``text``."""
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def make_rows(root: Path) -> list[dict[str, Any]]:
    """The six rows (repositories made under ``root``), in the order of :data:`EXPECTED`."""
    calc = make_tinyrepo(root / "tinycalc")
    spacey = make_spacey(root / "spacey")
    base = {**calc.instance, "repo_path": str(calc.path)}
    add = "tests/test_calc.py::test_add"
    return [
        {**base, "instance_id": "prorl__tinycalc-valid"},
        {**base, "instance_id": "prorl__tinycalc-gold-fails", "patch": calc.breaking_patch},
        {**base, "instance_id": "prorl__tinycalc-env-broken", "install": "python3 -c 'import tinycalc_native_speedups'"},
        {**base, "instance_id": "prorl__tinycalc-f2p-passes", "FAIL_TO_PASS": [*base["FAIL_TO_PASS"], add],
         "PASS_TO_PASS": [p for p in base["PASS_TO_PASS"] if p != add]},
        {**base, "instance_id": "prorl__tinycalc-flaky",
         "test_patch": base["test_patch"] + new_file_diff("tests/test_flaky.py", FLAKY_TEST),
         "PASS_TO_PASS": [*base["PASS_TO_PASS"], FLAKY_ID]},
        {**spacey.instance, "repo_path": str(spacey.path)},
    ]
