"""SWE rows as each project ships them (tests/swe/fixtures: real field names, invented content) become one instance.

Every fixture file holds rows in its source's exact shape: SWE-bench Verified
(JSONL) and Lite (a JSON array), SWE-Gym, SWE-smith, SWE-rebench (an
``install_config`` object and one as a JSON string), nebius SWE-bench-extra
(JSONL here, Parquet with its int64 version and timestamp in a test below) and
swebench's task rows. Checked: the mapping to prorl's fields, nothing
dropped, every field prorl cannot use reported once per dataset naming the
field and the source, and prose never left where anything runs it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.datasets import FORMATS, load_instances
from prorl_cli.exceptions import DatasetError
from prorl_cli.swe.sources import detect_source, reads_as_prose, shell_problem
from prorl_cli.swe.testplan import plan_tests

FIXTURES = Path(__file__).with_name("fixtures")
NEW, OLD = "tests/test_core.py::test_new", "tests/test_core.py::test_old"


def _load(name: str, fmt: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    warnings: list[str] = []
    rows = load_instances("swe", FIXTURES / name, fmt, warn=warnings.append)
    json.dumps(rows)  # the instances travel as JSON
    return rows, warnings


def _raw(name: str) -> list[dict[str, Any]]:
    text = (FIXTURES / name).read_text()
    return json.loads(text) if name.endswith(".json") else [json.loads(line) for line in text.splitlines()]


def _fields(warnings: list[str]) -> list[str]:
    return [w.split("field ", 1)[1].split(" ", 1)[0].strip("'") for w in warnings]


@pytest.mark.parametrize("name", ["swe_bench_verified.jsonl", "swe_bench_lite.json"])
def test_swe_bench_verified_and_lite(name: str) -> None:
    rows, warnings = _load(name)
    first = rows[0]
    assert [r["dataset_source"] for r in rows] == ["swe-bench", "swe-bench"]
    assert first["FAIL_TO_PASS"] == [NEW] and first["PASS_TO_PASS"] == [OLD] and rows[1]["PASS_TO_PASS"] == []
    assert first["version"] == "3.0" and first["hints_text"] == "Look at core.f."
    for raw, row in zip(_raw(name), rows, strict=True):  # nothing dropped
        assert set(raw) <= set(row)
    # environment_setup_commit shapes SWE-bench's environment and prorl does not use it: said once, for 2 rows.
    assert len(warnings) == 1 and "SWE-bench" in warnings[0] and "'environment_setup_commit' (2 of 2 row(s)" in warnings[0]
    assert name in warnings[0]  # names the dataset file
    plan = plan_tests(first, {}, first["FAIL_TO_PASS"], first["PASS_TO_PASS"])
    assert plan.test_files == ["tests/test_core.py"] and plan.source == "default"


def test_swe_gym_rows_need_no_mapping_and_warn_nothing() -> None:
    rows, warnings = _load("swe_gym.jsonl")
    assert warnings == []
    (row,) = rows
    assert row["dataset_source"] == "swe-gym" and row["FAIL_TO_PASS"] == [NEW] and row["version"] == "0.4"


def test_swe_smith_rows_get_an_empty_test_patch_the_image_and_a_reversed_gold_patch() -> None:
    rows, warnings = _load("swe_smith.jsonl")
    assert warnings == []
    first = rows[0]
    assert first["dataset_source"] == "swe-smith" and first["test_patch"] == ""
    assert first["image"] == first["image_name"] == "jyangballin/swesmith.x86_64.acme_1776_widgets.1a2b3c4d"
    assert first["patch_reverse"] is True  # SWE-smith's patch introduces the bug; swe_oracle applies it reversed
    assert rows[1]["problem_statement"] == ""
    plan = plan_tests(first, {}, first["FAIL_TO_PASS"], first["PASS_TO_PASS"])
    assert plan.test_files == ["tests/test_core.py"]  # the files come from the test ids


def test_swe_rebench_install_config_requirements_and_what_prorl_cannot_use() -> None:
    rows, warnings = _load("swe_rebench.jsonl")
    dict_row, string_row = rows
    assert dict_row["dataset_source"] == string_row["dataset_source"] == "swe-rebench"
    assert dict_row["image"] == "swerebench/sweb.eval.x86_64.sprocket_1776_sprocket-12"  # from docker_image
    assert dict_row["install_config"]["install"] == "pip install -e ."  # shell: left for build-images
    assert dict_row["requirements"].startswith("attrs==23.1.0") and dict_row["FAIL_TO_FAIL"] == []
    assert "log_parser" not in dict_row  # parse_log_pytest: graded by exact node ids instead
    # install_config as a JSON string: an object; a test_cmd list runs its first commands as setup steps.
    config = string_row["install_config"]
    assert config["test_cmd"] == "pytest -rA"
    assert string_row["eval_commands"] == ["export LANG=C.UTF-8", "export SPROCKET_TEST=1"]
    # Prose in install_config.install is never run: moved to not_run, out of the image build.
    assert "install" not in config
    assert string_row["not_run"] == {"install_config.install": ["Install the package in development mode (see CONTRIBUTING)"]}
    plan = plan_tests(string_row, {}, string_row["FAIL_TO_PASS"], string_row["PASS_TO_PASS"])
    assert plan.source == "instance install_config.test_cmd" and plan.eval_commands == string_row["eval_commands"]

    fields = _fields(warnings)
    assert sorted(fields) == sorted(["install_config.python", "install_config.reqs_path", "environment_setup_commit",
                                     "environment", "install_config.packages", "install_config.env_yml_path",
                                     "install_config.install"])
    assert all(w.split(": ", 1)[1].startswith("SWE-rebench rows: field") for w in warnings)
    environment = next(w for w in warnings if "field 'environment'" in w)
    assert "(2 of 2 row(s)" in environment and "conda" in environment and "kept in the instance" in environment
    prose = next(w for w in warnings if "install_config.install" in w)
    assert "sprocket__sprocket-13" in prose and "never run" in prose


def test_nebius_swe_bench_extra_from_parquet_with_int_version_and_timestamps(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (raw,) = _raw("nebius_swe_bench_extra.jsonl")
    raw["created_at"] = dt.datetime(2024, 2, 3, 4, 5, 6, tzinfo=dt.UTC)  # timestamp[ns, tz=UTC], as shipped
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([raw]), path)
    warnings: list[str] = []
    (row,) = load_instances("swe", path, warn=warnings.append)
    json.dumps(row)
    assert row["dataset_source"] == "nebius" and row["version"] == "2"  # int64 -> the repo_images key's text
    assert row["created_at"].startswith("2024-02-03T04:05:06")
    assert row["meta"] == {"failed_lite_validators": [], "has_test_patch": True, "is_lite": True}
    assert _fields(warnings) == ["environment_setup_commit"] and "nebius SWE-bench-extra" in warnings[0]
    rows, _ = _load("nebius_swe_bench_extra.jsonl")
    assert rows[0]["version"] == "2"


def test_swebench_task_rows_keep_their_eval_script_parser_and_image() -> None:
    (row,), warnings = _load("swebench_task.jsonl")
    assert warnings == [] and row["dataset_source"] == "swebench-task"
    plan = plan_tests(row, {}, row["FAIL_TO_PASS"], row["PASS_TO_PASS"])
    assert plan.source == "instance eval_script" and plan.applies_test_patch
    assert plan.log_parser == "parse_log_pytest" and row["image"].startswith("swebench/sweb.eval")


def test_unknown_fields_are_kept_and_reported_once_per_dataset(tmp_path: Path) -> None:
    rows = [{**r, "my_label": i, "source_url": "https://example.invalid"} for i, r in enumerate(_raw("swe_gym.jsonl") * 3)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    warnings: list[str] = []
    out = load_instances("swe", path, warn=warnings.append)
    assert [r["my_label"] for r in out] == [0, 1, 2]
    assert sorted(_fields(warnings)) == ["my_label", "source_url"]
    assert all("(3 of 3 row(s)" in w and "SWE-Gym rows" in w for w in warnings)


def test_a_prose_install_field_is_never_left_to_run(tmp_path: Path) -> None:
    (row,) = _raw("swe_gym.jsonl")
    rows = [{**row, "install": "Install with pip (needs numpy >= 1.20), then run the test suite."},
            {**row, "instance_id": "gizmo__gizmo-8", "install": ["pip install -e .", "Run the installer as root first"]},
            {**row, "instance_id": "gizmo__gizmo-9", "install": "pip install -e ."}]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    warnings: list[str] = []
    first, second, third = load_instances("swe", path, warn=warnings.append)
    assert "install" not in first and first["not_run"] == {"install": [rows[0]["install"]]}
    assert second["install"] == ["pip install -e ."] and second["not_run"] == {"install": ["Run the installer as root first"]}
    assert third["install"] == ["pip install -e ."] and "not_run" not in third
    (line,) = warnings  # one line for the field, however many rows
    assert "field 'install' (2 of 3 row(s)" in line and "never run" in line and "gizmo__gizmo-7" in line
    plan = plan_tests(first, {}, first["FAIL_TO_PASS"], first["PASS_TO_PASS"])
    assert plan.install == []


def test_shell_problem_and_prose() -> None:
    assert shell_problem("pip install -e . && python -m pytest --version") is None
    assert shell_problem("source /opt/miniconda3/bin/activate; conda activate testbed") is None
    problem = shell_problem("Install it (see README)")
    assert problem is not None and "syntax error" in problem
    assert reads_as_prose("Install the package with pip") and shell_problem("Install the package with pip")
    assert not reads_as_prose("Rscript -e 'install.packages(1)'") and not reads_as_prose("make test")
    assert not reads_as_prose("tox")


def test_format_names_a_source_and_auto_tells_them_apart(tmp_path: Path) -> None:
    assert FORMATS["swe"][0] == "auto" and "swe-smith" in FORMATS["swe"] and "swe-rebench" in FORMATS["swe"]
    expected = {"swe_bench_verified.jsonl": "swe-bench", "swe_gym.jsonl": "swe-gym", "swe_smith.jsonl": "swe-smith",
                "swe_rebench.jsonl": "swe-rebench", "nebius_swe_bench_extra.jsonl": "nebius",
                "swebench_task.jsonl": "swebench-task"}
    for name, source in expected.items():
        assert {detect_source(r) for r in _raw(name)} == {source}, name
    # A SWE-smith row named so: no test_patch is needed, and the gold patch is reversed.
    rows, _ = _load("swe_smith.jsonl", "swe-smith")
    assert rows[0]["patch_reverse"] is True
    with pytest.raises(DatasetError, match="--format 'smith' does not apply"):
        load_instances("swe", FIXTURES / "swe_smith.jsonl", "smith")
    # Without the SWE-smith rule a row lacking test_patch is an error naming the file, line and field.
    with pytest.raises(DatasetError, match=r"swe_smith\.jsonl:1: missing field 'test_patch'"):
        load_instances("swe", FIXTURES / "swe_smith.jsonl", "swe-gym")


def test_null_and_mistyped_fields_as_concatenated_datasets_and_parquet_give_them(tmp_path: Path) -> None:
    """A SWE-smith row beside SWE-Gym rows (HF concatenate_datasets, a Parquet file) has test_patch: null: it
    is the SWE-smith row's absent test patch, not the patch text "None"; a null or mistyped field that an
    instance needs is refused naming the row and the field."""
    smith = _raw("swe_smith.jsonl")[0]
    gym = _raw("swe_gym.jsonl")[0]
    columns = sorted(set(smith) | set(gym))
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({k: r.get(k) for k in columns}) + "\n" for r in (gym, smith)))
    rows = load_instances("swe", mixed, None)
    assert [r["dataset_source"] for r in rows] == ["swe-gym", "swe-smith"]
    assert rows[1]["test_patch"] == "" and rows[1]["patch_reverse"] is True
    assert rows[0]["image_name"] is None, "other nulls are kept as they are"
    for field, value, says in [("base_commit", None, "missing field 'base_commit' (null)"),
                               ("test_patch", None, "missing field 'test_patch' (null)"),
                               ("base_commit", 7, "field 'base_commit' must be a string, got int 7"),
                               ("problem_statement", ["a"], "field 'problem_statement' must be a string, got list"),
                               ("instance_id", " ", "field 'instance_id' is empty"),
                               ("version", 0.20, "field 'version' is the number 0.2; a version is text")]:
        bad = tmp_path / f"bad_{field}.jsonl"
        bad.write_text(json.dumps({**gym, field: value}) + "\n")
        with pytest.raises(DatasetError) as refused:
            load_instances("swe", bad, None)
        assert says in str(refused.value) and f"{bad.name}:1" in str(refused.value), str(refused.value)


def test_test_lists_written_as_python_writes_them_are_read_and_bad_ones_say_what_they_hold(tmp_path: Path) -> None:
    """str(list) or a CSV round trip gives "['a', 'b']": read as the list it is (literals only); a list of
    something else says what it found."""
    gym = _raw("swe_gym.jsonl")[0]
    python_way = tmp_path / "python_way.jsonl"
    python_way.write_text(json.dumps({**gym, "FAIL_TO_PASS": str([NEW, "tests/t.py::test_x[it's]"])}) + "\n")
    (row,) = load_instances("swe", python_way, None)
    assert row["FAIL_TO_PASS"] == [NEW, "tests/t.py::test_x[it's]"]
    for value, says in [(json.dumps(json.dumps([NEW])), "got str"), ([NEW, None], "got a list holding ['NoneType']"),
                        ("[__import__('os').getpid()]", "is a string but not JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({**gym, "FAIL_TO_PASS": value}) + "\n")
        with pytest.raises(DatasetError, match=re.escape(says)):
            load_instances("swe", bad, None)
