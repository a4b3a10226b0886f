"""A ``module:function`` scorer of the ``harness`` task reads the files the agent wrote: RUN copies the
``workdir`` out of the sandbox before the node stops it, and EVAL hands the copy to the scorer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.domains.conftest import ScriptedStack, turn
from tests.fakes.agents import AGENT

# The node imports scorers by module name; its working directory (the deployment's home) is on its sys.path.
SCORERS = '''
import json
from pathlib import Path


def reads_answer(ctx, workspace):
    """1.0 when the agent wrote 5 to answer.txt in its workdir."""
    files = sorted(str(p.relative_to(workspace)) for p in Path(workspace).rglob("*") if p.is_file())
    ctx.output["scorer_saw"] = {"workspace": str(workspace), "files": files,
                                "notes": (Path(workspace) / "sub" / "notes.txt").read_text()}
    return 1.0 if (Path(workspace) / "answer.txt").read_text().strip() == "5" else 0.0


async def ctx_only(ctx):
    """The one-argument form: the copy's path is in ctx.state["workspace"]."""
    return float((Path(ctx.state["workspace"]) / "answer.txt").read_text().strip() == "5")
'''

WRITE = ("bash", {"command": "mkdir -p sub && echo 5 > answer.txt && echo kept > sub/notes.txt && "
                             "ln -s /etc/hostname outside && ln -s answer.txt inside && ls"})


def _instance(tag: str, image: str, scorer: str, **settings: Any) -> dict[str, Any]:
    return {"task": f"[{tag}] Write 5 to answer.txt.",
            "settings": {"image": image, "command": AGENT, "workdir": "/work/out", "scorer": scorer,
                         "poll_s": 0.2, **settings}}


def test_a_module_function_scorer_reads_the_files_the_agent_wrote(stack: ScriptedStack, domain_image: str) -> None:
    (stack.d.home / "prorl_test_scorers.py").write_text(SCORERS)
    for tag in ("WS-two", "WS-one", "WS-big"):
        stack.add(f"[{tag}]", turn("", WRITE), "Done.")
    stack.start_model()
    two, one, big = stack.run("harness", [
        _instance("WS-two", domain_image, "prorl_test_scorers:reads_answer"),
        _instance("WS-one", domain_image, "prorl_test_scorers:ctx_only"),
        _instance("WS-big", domain_image, "prorl_test_scorers:reads_answer", workspace_max_mb=0.001),
    ], timeout_s=300)

    assert two.state == "done" and two.reward == 1.0, two.output.get("failure") or two.output.get("harness_log")
    saw = two.output["scorer_saw"]
    # What the agent wrote, as it wrote it; the link out of the workdir is not copied, the one inside is.
    assert saw["files"] == ["answer.txt", "inside", "sub/notes.txt"] and saw["notes"] == "kept\n", saw
    # The copy was on the node's disk during EVAL only.
    assert saw["workspace"].endswith(f"/{two.job_id}/workspace") and not Path(saw["workspace"]).exists()

    assert one.state == "done" and one.reward == 1.0, one.output.get("failure") or one.output.get("harness_log")

    assert big.state == "failed", big
    message = json.dumps(big.error)
    assert "workspace_max_mb=0.001" in message and "/work/out" in message, message


def test_the_workspace_copy_goes_also_when_the_scorer_cannot_be_imported(tmp_path: Path) -> None:
    """A scorer name with a typo fails EVAL naming it, and leaves no copy behind on the node's disk (one per job)."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from prorl_cli.exceptions import DomainError
    from prorl_cli.handlers.harness import HarnessHandler
    from prorl_cli.node.settings import resolve_settings

    workspace = tmp_path / "jobs" / "j1" / "workspace"
    (workspace / "sub").mkdir(parents=True)
    (workspace / "sub" / "answer.txt").write_text("5\n")
    for scorer in ("prorl_no_such_scorer_module:score", "json:no_such_function"):
        settings = resolve_settings(HarnessHandler.defaults, ("test", {"scorer": scorer}))
        ctx = SimpleNamespace(settings=settings, output={}, state={"workspace": str(workspace)}, reward=None)
        with pytest.raises(DomainError, match="cannot be imported"):
            asyncio.run(HarnessHandler().eval(ctx))  # type: ignore[arg-type]
        assert not workspace.exists(), scorer
        workspace.mkdir(parents=True)


def test_a_scorer_in_the_nodes_working_directory_is_found_without_python_dash_m(
    tmp_path: Path, tiny_model: Path
) -> None:
    """`prorl serve node` started by the `prorl` console script (unlike `python -m prorl_cli`, which the test
    deployments use) finds a scorer module in the folder it started in, where docs/harness.md says it may be:
    the command puts that folder on sys.path at start-up."""
    import subprocess
    import sys

    from tests.harness import Deployment

    cwd = tmp_path / "node-cwd"
    cwd.mkdir()
    (cwd / "prorl_cwd_scorer.py").write_text("def score(ctx, workspace):\n    return 0.75\n")
    # What pip's console script does: sys.path[0] is the script's folder, not the working directory.
    console_script = tmp_path / "bin" / "prorl"
    console_script.parent.mkdir()
    console_script.write_text("import sys\nfrom prorl_cli.cli import main\nsys.exit(main())\n")
    config = {"sandbox": {"runtime": "local", "local_dir": str(tmp_path / "sb")},
              "inference": {"tokenizer": str(tiny_model)}}
    with Deployment(tmp_path / "home", "cwdscorer", config=config) as d:
        d.start_broker()
        with (d.logs / "n1.log").open("ab") as log:
            d.procs["n1"] = subprocess.Popen(
                [sys.executable, str(console_script), "-d", d.name, "serve", "node", "--node-id", "n1"],
                cwd=cwd, env=d.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        d.wait_for(lambda st: any(n.node_id == "n1" and n.alive for n in st.nodes), 60, "node n1 to register", "n1")
        ids = d.client.submit("harness", [
            {"task": "no model call", "settings": {"image": "", "command": "true", "scorer": "prorl_cwd_scorer:score",
                                                   "poll_s": 0.1, "timeout_s": 60.0}}], timeout_s=120)
        (result,) = d.client.wait(ids, timeout_s=180)
    assert result.state == "done" and result.reward == 0.75, result


def _eval(scorer: str, workspace: Path | None = None) -> Any:
    """The harness's EVAL of a ``module:function`` scorer, outside a node: the context it reads, after it."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from prorl_cli.handlers.harness import HarnessHandler
    from prorl_cli.node.settings import resolve_settings

    settings = resolve_settings(HarnessHandler.defaults, ("test", {"scorer": scorer}))
    ctx = SimpleNamespace(settings=settings, output={}, state={"workspace": str(workspace) if workspace else None},
                          reward=None, log=logging.getLogger("test-harness-scorer"))
    asyncio.run(HarnessHandler().eval(ctx))  # type: ignore[arg-type]
    return ctx


def test_an_edited_scorer_scores_the_next_jobs_without_a_node_restart(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The node imports a scorer module once; a user who edits it between submits gets the edit, not the copy
    the node first read (which would score the next jobs with the old code, silently)."""
    import os

    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "prorl_edited_scorer.py"
    module.write_text("def score(ctx, workspace):\n    return 0.25\n")
    assert _eval("prorl_edited_scorer:score").reward == 0.25
    module.write_text("def score(ctx, workspace):\n    return 0.5\n\n\ndef other(ctx, workspace):\n    return 1\n")
    os.utime(module, ns=(1, 1))  # a new mtime even on a file system with coarse timestamps
    assert _eval("prorl_edited_scorer:score").reward == 0.5
    assert _eval("prorl_edited_scorer:other").reward == 1.0  # a function added by the edit is found too
    assert _eval("prorl_edited_scorer:score").reward == 0.5  # unchanged since: not imported again


def test_a_scorer_that_raises_or_returns_no_number_fails_naming_the_scorer(tmp_path: Path, monkeypatch: Any) -> None:
    import pytest

    from prorl_cli.exceptions import DomainError

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "prorl_bad_scorers.py").write_text(
        "import json\n"
        "def raises(ctx, workspace):\n    return json.loads((workspace / 'missing.json').read_text())\n"
        "def a_dict(ctx, workspace):\n    return {'reward': 1.0}\n"
        "def a_string(ctx, workspace):\n    return '0.5'\n"
        "def numpy_like(ctx, workspace):\n    class R:\n        def __float__(self):\n            return 0.75\n"
        "    return R()\n"
        "def a_bool(ctx, workspace):\n    return True\n")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with pytest.raises(DomainError, match=r"scorer 'prorl_bad_scorers:raises' raised FileNotFoundError: .*missing"):
        _eval("prorl_bad_scorers:raises", workspace)
    assert not workspace.exists()  # the copy goes all the same
    with pytest.raises(DomainError, match=r"scorer 'prorl_bad_scorers:a_dict' returned dict \{'reward': 1.0\}; it "
                                          r"must return the reward, a number"):
        _eval("prorl_bad_scorers:a_dict")
    with pytest.raises(DomainError, match=r"returned str '0.5'"):
        _eval("prorl_bad_scorers:a_string")
    assert _eval("prorl_bad_scorers:numpy_like").reward == 0.75  # a numpy scalar: anything float() takes
    assert _eval("prorl_bad_scorers:a_bool").reward == 1.0
    (tmp_path / "prorl_broken_scorer.py").write_text("def score(ctx, workspace)\n    return 1\n")
    with pytest.raises(DomainError, match=r"scorer 'prorl_broken_scorer:score': importing 'prorl_broken_scorer' "
                                          r"raised SyntaxError"):
        _eval("prorl_broken_scorer:score")
