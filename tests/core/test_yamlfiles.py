"""prorl's YAML files are read with YAML 1.2's numbers: what people write is what they get."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from prorl_cli import yamlfiles
from prorl_cli.config import load_config
from prorl_cli.planning.workload import Workload


def test_numbers_as_yaml_1_2_reads_them() -> None:
    data = yamlfiles.load("time: 24:00:00\nexp: 1e3\nneg: -2E-5\ndot: 1.5\nint: 30\nhex: 0x10\nlead: 012\n"
                          "inf: .inf\nflag: yes\nword: 1:30.5\n")
    assert data == {"time": "24:00:00", "exp": 1000.0, "neg": -2e-05, "dot": 1.5, "int": 30, "hex": 16,
                    "lead": "012", "inf": math.inf, "flag": True, "word": "1:30.5"}
    assert type(data["exp"]) is float and type(data["int"]) is int


def test_prorl_yaml_and_a_workload_take_exponents(tmp_path: Path) -> None:
    config = tmp_path / "prorl.yaml"
    config.write_text("jobs:\n  timeout_s: 1e3\n")
    assert load_config(config).jobs.timeout_s == 1000.0
    workload = tmp_path / "w.yaml"
    workload.write_text("tool_s: {median: 1e1, sigma: 0}\nturns: 2\n")
    shapes = Workload.from_file(workload, 4, 0).shapes
    assert shapes and all(gap == pytest.approx(10.0) for s in shapes for gap in s.gaps_s)
