"""Protocol framing, records, config validation and handler discovery (no processes)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import msgpack
import pytest

from prorl_cli import protocol as P
from prorl_cli.config import config_from_dict, load_config
from prorl_cli.exceptions import ConfigError, HandlerError, ProtocolError, UnknownTask
from prorl_cli.node.registry import discover
from prorl_cli.node.timer import PausableTimer


def test_token_frames_are_int32_little_endian() -> None:
    ids = [0, 1, 151643, 2**31 - 1, -1]
    data = P.pack_tokens(ids)
    assert data[:8] == b"\x00\x00\x00\x00\x01\x00\x00\x00"
    assert P.unpack_tokens(data) == ids
    lp = [-0.5, -1.25, 0.0]
    assert P.unpack_floats(P.pack_floats(lp)) == lp
    with pytest.raises(ProtocolError, match="int32"):
        P.unpack_tokens(b"\x00\x01\x02")


def test_header_round_trip_and_errors() -> None:
    frames = P.encode({"op": "status", "rid": 7})
    h = P.decode_header(frames[0])
    assert h["op"] is P.Op.STATUS and h["rid"] == 7 and h["v"] == P.PROTOCOL_VERSION
    with pytest.raises(ProtocolError) as e:
        P.decode_header(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": 5}))
    assert e.value.code == P.ErrorCode.MISSING_FIELD
    with pytest.raises(ProtocolError) as e:
        P.validate(P.decode_header(msgpack.packb({"v": P.PROTOCOL_VERSION, "op": "cancel", "rid": True, "job_ids": []})))
    assert e.value.code == P.ErrorCode.BAD_FIELD and "rid" in e.value.message


def test_job_spec_validation_names_the_field() -> None:
    with pytest.raises(ProtocolError, match="job_id"):
        P.JobSpec.from_wire({"job_id": "", "task": "t"})
    with pytest.raises(ProtocolError, match=r"stage_timeouts_s.key' must be one of \['eval', 'init', 'run'\], got 'warmup'"):
        P.JobSpec.from_wire({"job_id": "a", "task": "t", "stage_timeouts_s": {"warmup": 1}})
    with pytest.raises(ProtocolError, match="unknown field"):
        P.JobSpec.from_wire({"job_id": "a", "task": "t", "colour": "red"})
    spec = P.JobSpec.from_wire({"job_id": "a", "task": "t", "timeout_s": 2})
    assert P.JobSpec.from_wire(spec.to_wire()) == spec


def test_config_errors_name_file_and_key(tmp_path: Path) -> None:
    f = tmp_path / "prorl.yaml"
    f.write_text("broker:\n  heartbeat_interval_s: fast\n")
    with pytest.raises(ConfigError, match=r"prorl.yaml: broker.heartbeat_interval_s: expected float, got str 'fast'"):
        load_config(f)
    f.write_text("node: [1, 2]\n")
    with pytest.raises(ConfigError, match="node: expected a mapping"):
        load_config(f)
    f.write_text("node: {n_run: 0}\n")
    with pytest.raises(ConfigError, match="node.n_run: must be at least 1"):
        load_config(f)
    f.write_text("broker: {receive_window_messages: 0}\n")
    with pytest.raises(ConfigError, match="broker.receive_window_messages: must be at least 1, got 0"):
        load_config(f)
    f.write_text("node: {n_run: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load_config(f)
    # One line, and the parser's position names the file.
    assert "\n" not in str(caught.value) and f'in "{f}", line' in str(caught.value), caught.value
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"a folder, not a config file"):
        load_config(tmp_path)
    f.write_bytes(b"node: {n_run: 2}\n# caf\xe9\n")  # Latin-1, as an editor may save it
    with pytest.raises(ConfigError, match=r"prorl.yaml: not a UTF-8 text file \(invalid .* at byte 22\)"):
        load_config(f)
    cfg = config_from_dict({"jobs": {"timeout_s": 5}, "node": {"handler_paths": ["a"]}})
    assert cfg.jobs.timeout_s == 5.0 and cfg.node.handler_paths == ["a"]


def test_overrides_beat_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "prorl.yaml"
    f.write_text("deployment: from-file\nnode: {n_run: 3}\n")
    monkeypatch.setenv("PRORL_DEPLOYMENT", "from-env")
    cfg = load_config(f, {"node.n_run": 5})
    assert cfg.deployment == "from-env" and cfg.node.n_run == 5
    assert load_config(f, {"deployment": "flag"}).deployment == "flag"


def test_pausable_timer_counts_only_running_time() -> None:
    t = PausableTimer(budget_s=10)
    assert t.elapsed_s == 0 and t.remaining_s == 10
    t.resume()
    ran = t.pause()
    frozen = t.elapsed_s
    assert frozen == ran >= 0
    assert t.elapsed_s == frozen  # paused: no time passes for the job
    assert PausableTimer().remaining_s is None


def test_handler_discovery_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "mine.py"
    good.write_text(textwrap.dedent("""
        from prorl_cli.node.handler import AgentHandler
        class Mine(AgentHandler):
            name = "mine"
            async def init(self, ctx): pass
            async def run(self, ctx): pass
            async def eval(self, ctx): pass
    """))
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('boom')\n")
    reg = discover([str(tmp_path)])
    assert "mine" in reg.tasks and "math_agent" in reg.tasks  # the given folder and the built-in handlers
    assert "test" not in reg.tasks and "noop" not in reg.tasks  # the test handlers only when asked for
    assert any("broken.py" in e and "boom" in e for e in reg.errors)
    with pytest.raises(UnknownTask, match="unknown task 'nope'"):
        reg.get("nope")
    assert discover([str(tmp_path)], only=["math_agent"]).tasks == ["math_agent"]
    with pytest.raises(HandlerError, match="unknown task"):
        discover([], only=["does-not-exist"])
    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / "again.py").write_text(good.read_text())
    with_dup = discover([str(tmp_path), str(dup)])
    assert any("defined twice" in e for e in with_dup.errors)


def test_example_config_lists_every_key_at_its_default() -> None:
    import yaml

    from prorl_cli.config import ProrlConfig
    from tests.harness import REPO

    example = yaml.safe_load((REPO / "examples" / "prorl.yaml").read_text())
    defaults = ProrlConfig().to_dict()
    assert config_from_dict(example).to_dict() == defaults
    for section, values in defaults.items():
        if isinstance(values, dict):
            assert set(example[section]) == set(values), f"examples/prorl.yaml: section {section} is stale"
