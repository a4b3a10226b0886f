"""Loads ``prorl_swe_nodeids`` into every pytest the test run starts, without touching the command line.

Copied into the EVAL sandbox as ``sitecustomize.py`` (on ``PYTHONPATH``) and
as ``usercustomize.py`` (in the user site of ``PYTHONUSERBASE``): Python runs
it at start-up, before pytest reads ``PYTEST_ADDOPTS``, and it adds the
plugin's ``-p`` option there only when the plugin sits beside it, so pytest
never fails on a plugin it cannot import. The user site copy is what reaches
a test command that sets its own ``PYTHONPATH`` (``PYTHONPATH=src pytest``).
Self-contained like the plugin: standard library only.
"""

import os

_OPTION = "-p prorl_swe_nodeids"
_HERE = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("PRORL_SWE_NODEIDS") and os.path.isfile(os.path.join(_HERE, "prorl_swe_nodeids.py")):
    _opts = os.environ.get("PYTEST_ADDOPTS", "")
    if _OPTION not in _opts:
        os.environ["PYTEST_ADDOPTS"] = (_opts + " " + _OPTION).strip()
