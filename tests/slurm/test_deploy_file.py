"""deploy.yaml: schema, the example kept in step, bad files refused with file and key, rendered sbatch."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from prorl_cli.exceptions import ConfigError
from prorl_cli.slurm.deploy import DeployConfig, load_deploy, time_minutes
from prorl_cli.slurm.render import render_all
from tests.harness import REPO

EXAMPLE = REPO / "examples" / "deploy.yaml"


def _keys(cls: typing.Any, prefix: str = "") -> set[str]:
    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        out.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _keys(hints[f.name], f"{prefix}{f.name}.")
    return out


def _file_keys(data: dict[str, typing.Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        out.add(prefix + k)
        if isinstance(v, dict) and k in ("broker", "nodes", "inference"):
            out |= _file_keys(v, f"{prefix}{k}.")
    return out


def test_example_lists_every_key_with_its_default() -> None:
    data = yaml.safe_load(EXAMPLE.read_text())
    assert _file_keys(data) == _keys(DeployConfig)
    loaded = load_deploy(EXAMPLE)
    defaults = DeployConfig()
    for section in ("broker", "nodes", "inference"):
        assert dataclasses.asdict(getattr(loaded, section)) == dataclasses.asdict(getattr(defaults, section)), section
    # What deploy.yaml leaves unset, prorl.yaml decides: the two files never disagree on a default.
    assert loaded.nodes.sandbox_runtime is None and loaded.broker.bind_host is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("nodes: {count: two}", "nodes.count: expected int"),
        ("nodes: {cores: 4}", "nodes: unknown key(s) ['cores']"),
        ("nodes: {time: soon}", "nodes.time: 'soon' is not a Slurm time"),
        ("nodes: {sandbox_runtime: docker}", "nodes.sandbox_runtime: expected one of"),
        ("inference: {count: 2}", "inference.model: required when count > 0"),
        ("inference: {count: 1, model: m, engine: transformers, vllm_args: [--x]}", "inference.vllm_args: only for engine vllm"),
        ("nodes: {time: '2', signal_delay_s: 300}", "nodes.signal_delay_s: 300 s is not shorter"),
        ("deployment: ../x", "deployment: '../x' is not a valid deployment name"),
        ("broker: {where: cloud}", "broker.where: expected one of"),
        ("- a list", "top level must be a mapping"),
        ("nodes: {sbatch_options: {time: '1:00:00'}}", "nodes.sbatch_options.time: set by prorl; use time"),
        ("broker: {sbatch_options: {job_name: x}}", "broker.sbatch_options.job-name: set by prorl"),
        ("inference: {sbatch_options: {no-requeue: true}}", "inference.sbatch_options.no-requeue: set by prorl; use requeue"),
    ],
)
def test_bad_deploy_file_names_file_and_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_deploy(path)
    assert str(path) in str(info.value)
    assert needle in str(info.value)


def test_slurm_times() -> None:
    assert time_minutes("30") == 30
    assert time_minutes("1:30:00") == 90
    assert time_minutes("2-00:00:00") == 2880
    assert time_minutes("0:90") == 2  # MM:SS rounds up


def test_times_written_as_people_write_them_in_yaml(tmp_path: Path) -> None:
    """Unquoted, ``24:00:00`` is a base-60 integer to YAML 1.1 (86400) and ``30`` an integer: neither was what
    the user meant to refuse, nor 86400 minutes."""
    path = tmp_path / "deploy.yaml"
    path.write_text("deployment: t\nbroker:\n  time: 24:00:00\nnodes:\n  time: 30\ninference:\n  time: 1-12:00\n"
                    "setup: [\"echo 1:30\"]\nrendezvous_wait_s: 0x10\n")
    cfg = load_deploy(path)
    assert (cfg.broker.time, cfg.nodes.time, cfg.inference.time) == ("24:00:00", "30", "1-12:00")
    assert [time_minutes(t) for t in (cfg.broker.time, cfg.nodes.time)] == [1440, 30]
    assert cfg.rendezvous_wait_s == 16, "other integers read as YAML reads them"


def test_render_sbatch_scripts_carry_the_roles_options(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        yaml.safe_dump({
            "deployment": "r", "home": str(tmp_path / "home"), "setup": ["module load cuda"],
            "nodes": {"count": 3, "partition": "cpu", "time": "10", "signal_delay_s": 60, "array_parallelism": 2},
            "inference": {"count": 2, "gpus_per_task": 2, "model": str(tmp_path), "vllm_args": ["--tensor-parallel-size", "2"]},
        })
    )
    written = {p.name: p.read_text() for p in render_all(load_deploy(path), tmp_path / "out")}
    assert set(written) == {"prorl.yaml", "broker.sbatch", "node.sbatch", "inference.sbatch", "all-in-one.sbatch"}
    node = written["node.sbatch"]
    for line in ("#SBATCH --array=0-2%2", "#SBATCH --partition=cpu", "#SBATCH --signal=B:USR2@60",
                 "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --time=0-00:10:00", "module load cuda",
                 "serve node --wait-s 600", "exec "):
        assert line in node, line
    inf = written["inference.sbatch"]
    assert "#SBATCH --gres=gpu:2" in inf and "--tensor-parallel-size 2" in inf
    assert "#SBATCH --gres=gpu:2" in written["all-in-one.sbatch"]
    roles_config = yaml.safe_load(written["prorl.yaml"])
    # deploy.yaml leaves the runtime to prorl.yaml (default auto: the same as a run on one machine).
    assert roles_config["sandbox"]["runtime"] == "auto"
    assert roles_config["deployment"] == "r"
    # Set in deploy.yaml, it wins; set in prorl.yaml only, that is what the roles get.
    config = tmp_path / "prorl.yaml"
    config.write_text("sandbox:\n  runtime: apptainer\nbroker:\n  bind_host: 10.0.0.7\n")
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "config": str(config)}))
    written = {p.name: p.read_text() for p in render_all(load_deploy(path), tmp_path / "out2")}
    assert yaml.safe_load(written["prorl.yaml"])["sandbox"]["runtime"] == "apptainer"
    assert "--bind-host 10.0.0.7" in written["broker.sbatch"]
    path.write_text(yaml.safe_dump({**data, "config": str(config), "nodes": {**data["nodes"], "sandbox_runtime": "bwrap"},
                                    "broker": {"bind_host": "0.0.0.0"}}))
    written = {p.name: p.read_text() for p in render_all(load_deploy(path), tmp_path / "out3")}
    assert yaml.safe_load(written["prorl.yaml"])["sandbox"]["runtime"] == "bwrap"
    assert "--bind-host 0.0.0.0" in written["broker.sbatch"]


def test_slurm_identity_from_the_environment() -> None:
    from prorl_cli.slurm.identity import SlurmIdentity

    env = {"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2", "SLURMD_NODENAME": "n3",
           "SLURM_CPUS_PER_TASK": "4", "CUDA_VISIBLE_DEVICES": "1", "SLURM_RESTART_COUNT": "1"}
    me = SlurmIdentity.from_env(env)
    assert me.in_slurm and me.task_ref == "40_2" and me.node_name == "n3" and me.cpus == 4 and me.gpus == ["1"]
    assert me.member_id("node") == "node-2", "named after the array index: the same after a requeue"
    assert me.member_id("node", 7) == "node-7"
    assert "restart 1" in me.describe()
    assert not SlurmIdentity.from_env({}).in_slurm


def test_each_task_of_an_srun_step_gets_its_own_member_id() -> None:
    """``srun -n 4 prorl serve node`` in a plain job: one name for all four would have them take it from each other."""
    from prorl_cli.slurm.identity import SlurmIdentity

    step = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
    names = {SlurmIdentity.from_env({**step, "SLURM_PROCID": str(rank)}).member_id("node") for rank in (0, 1)}
    assert names == {"node-77.0", "node-77.1"}
    array_step = {**step, "SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "1"}
    assert SlurmIdentity.from_env(array_step).member_id("node") == "node-3.1"
    # The batch script itself (no step: SLURM_STEP_NUM_TASKS unset), and a step of one task, keep the plain name.
    batch = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}
    assert SlurmIdentity.from_env(batch).member_id("node") == "node-77"
    one = {"SLURM_JOB_ID": "77", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert SlurmIdentity.from_env(one).member_id("inference") == "inference-77"


def test_sbatch_options_set_false_or_null_are_left_out_of_the_submitted_script(tmp_path: Path) -> None:
    from prorl_cli.slurm.launcher import plan

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"deployment": "f", "home": str(tmp_path / "home"),
                                    "nodes": {"count": 1, "sbatch_options": {"exclusive": False, "comment": None,
                                                                             "mail_type": "FAIL"}}}))
    (nodes,) = [p for p in plan(load_deploy(path)) if p.role == "nodes"]
    assert "exclusive" not in nodes.script and "comment" not in nodes.script, nodes.script
    assert "#SBATCH --mail-type=FAIL" in nodes.script



@pytest.mark.parametrize(("setup", "after", "code", "said"), [
    # A site init that tests something failing harmlessly inside it: the role goes on.
    (["source {site}"], "", 0, "reached"),
    (["module_that_is_not_here load cuda"], "", 127, "prorl: a setup line failed (exit 127): module_that_is_not_here"),
    (["true | false"], "", 1, "prorl: a setup line failed (exit 1): false"),  # pipefail: the pipeline's failure
    # After the setup lines, any failure stops the script.
    (["true"], "false", 1, None),
], ids=["sourced-file-fails-inside", "missing-command", "pipeline", "after-setup"])
def test_rendered_scripts_stop_at_a_failing_setup_line_naming_it(
        tmp_path: Path, setup: list[str], after: str, code: int, said: str | None) -> None:
    """The rendered scripts' setup lines follow launch's rule: the first line that fails stops the role, named
    in its log; a command that fails inside a file a line sources does not count."""
    import subprocess

    site = tmp_path / "site.sh"
    site.write_text("false\nexport SITE_READ=1\n")
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"deployment": "s", "home": str(tmp_path / "home"),
                                    "setup": [line.format(site=site) for line in setup]}))
    script = {p.name: p for p in render_all(load_deploy(path), tmp_path / "out")}["node.sbatch"].read_text()
    # The shared part: from the top to the line that defines PRORL (what follows starts the role).
    head = script[: script.index("PRORL=(")]
    part = tmp_path / "setup-part.sh"  # run as a file, as sbatch runs the script (a sourced file is then nested)
    part.write_text(f"{head}\n{after}\necho reached SITE_READ=${{SITE_READ:-0}}\n")
    run = subprocess.run(["bash", str(part)], capture_output=True, text=True, timeout=60)
    assert run.returncode == code, run.stdout + run.stderr
    if said == "reached":
        assert "reached SITE_READ=1" in run.stdout, run.stdout + run.stderr
    elif said is not None:
        assert said in run.stderr and "the role does not start" in run.stderr and "reached" not in run.stdout, run.stderr
    else:
        assert "reached" not in run.stdout, run.stdout
