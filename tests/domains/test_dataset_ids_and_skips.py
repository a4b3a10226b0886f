"""Row ids as sources name them, and ``--skip-bad-rows``.

Rows are written as their public sources publish them (field names and value
types as in the published files; texts shortened). An instance keeps its
source's id as ``id`` (no id is made up for a row without one); a bad row is
skipped only when asked, and the skip is reported with file, line and field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prorl_cli.domains.datasets import SKIPPED_SHOWN, load_instances, load_rows
from prorl_cli.exceptions import DatasetError

SWE_FIXTURES = Path(__file__).parents[1] / "swe" / "fixtures"


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one(tmp_path: Path, task: str, row: dict[str, Any]) -> dict[str, Any]:
    (inst,) = load_instances(task, _jsonl(tmp_path / "rows.jsonl", [row]))
    assert isinstance(inst, dict)
    return inst


# --- ids -----------------------------------------------------------------------------------------------------

MATH_500: dict[str, Any] = {
    "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
    "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... Therefore, the polar coordinates are "
                "$\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
    "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
    "unique_id": "test/precalculus/807.json",
}
LIVECODEBENCH_STDIN: dict[str, Any] = {
    "question_title": "Overall Winner", "question_content": "Takahashi and Aoki played N games. ...",
    "platform": "atcoder", "question_id": "abc301_a", "contest_id": "abc301", "contest_date": "2023-05-13T00:00:00",
    "starter_code": "", "difficulty": "easy",
    "public_test_cases": json.dumps([{"input": "5\nTTAAT\n", "output": "T\n", "testtype": "stdin"}]),
    "private_test_cases": json.dumps([{"input": "1\nA\n", "output": "A\n", "testtype": "stdin"}]),
    "metadata": "{}",
}
APPS: dict[str, Any] = {
    "problem_id": 4000, "question": "Read two integers and print their sum.",
    "solutions": json.dumps(["print(sum(map(int, input().split())))\n"]),
    "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}),
    "difficulty": "introductory", "url": "https://codeforces.com/problemset/problem/1/A", "starter_code": "",
}
CODECONTESTS: dict[str, Any] = {
    "name": "1548_E. Gregor and the Two Painters", "description": "Two painters ...",
    "public_tests": {"input": ["2 2 1\n"], "output": ["2\n"]}, "private_tests": {"input": [], "output": []},
    "generated_tests": {"input": ["3 3 1\n"], "output": ["3\n"]}, "source": 2, "difficulty": 11,
    "solutions": {"language": [3], "solution": ["print(2)\n"]},
    "incorrect_solutions": {"language": [], "solution": []}, "cf_contest_id": 1548, "cf_index": "E",
    "cf_points": 2500.0, "cf_rating": 3400, "cf_tags": ["data structures"], "is_description_translated": False,
    "untranslated_description": "", "time_limit": {"seconds": 2, "nanos": 0}, "memory_limit_bytes": 256000000,
    "input_file": "", "output_file": "",
}
TACO: dict[str, Any] = {
    "question": "Read n and print it.", "solutions": json.dumps(["print(input())\n"]), "starter_code": "",
    "input_output": json.dumps({"inputs": ["5\n"], "outputs": ["5\n"]}), "difficulty": "EASY",
    "raw_tags": "['implementation']", "name": "Echo", "source": "codeforces", "tags": "['Implementation']",
    "skill_types": "[]", "url": "https://codeforces.com/problemset/problem/1/A", "Expected Auxiliary Space": None,
    "time_limit": "1 second", "date": "2010-01-01", "picture_num": "0", "memory_limit": "256 megabytes",
    "Expected Time Complexity": None,
}
HOTPOTQA_JSON: dict[str, Any] = {
    "_id": "5a8b57f25542995d1e6f1371", "answer": "yes",
    "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
    "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
    "context": [["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]]],
    "type": "comparison", "level": "hard",
}
TRIVIAQA: dict[str, Any] = {
    "question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?", "question_id": "tc_33",
    "question_source": "http://www.triviacountry.com/",
    "entity_pages": {"doc_source": [], "filename": [], "title": [], "wiki_context": []},
    "search_results": {"description": [], "filename": [], "rank": [], "title": [], "url": [], "search_context": []},
    "answer": {"aliases": ["Sunset Boulevard", "Sunset Blvd"], "normalized_aliases": ["sunset boulevard", "sunset blvd"],
               "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "",
               "normalized_value": "sunset boulevard", "type": "WikipediaEntity", "value": "Sunset Boulevard"},
}
DAPO: dict[str, Any] = {
    "data_source": "math_dapo",
    "prompt": [{"content": "Solve the following math problem step by step. The last line of your response should be "
                           "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
                           "\n\nWhat is $6 \\times 7$?\n\nRemember to put your answer on its own line after "
                           "\"Answer:\".", "role": "user"}],
    "ability": "MATH", "reward_model": {"ground_truth": "42", "style": "rule-lean"},
    "extra_info": {"index": "a8f7ae5c-1b8e-4c1c-9a35-0c1e2d3f4a5b"},
}
VERL_GSM8K: dict[str, Any] = {
    "data_source": "openai/gsm8k",
    "prompt": [{"content": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                           "May. How many clips did Natalia sell altogether in April and May? Let's think step by "
                           "step and output the final answer after \"####\".", "role": "user"}],
    "ability": "math", "reward_model": {"ground_truth": "72", "style": "rule"},
    "extra_info": {"answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May. ... #### 72", "index": 0,
                   "question": "Natalia sold clips to 48 of her friends in April, ...", "split": "train"},
}
GSM8K: dict[str, Any] = {"question": "Natalia sold clips to 48 of her friends in April, ...",
         "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}


@pytest.mark.parametrize(("task", "row", "want"), [
    ("math", MATH_500, "test/precalculus/807.json"),
    ("math", DAPO, "a8f7ae5c-1b8e-4c1c-9a35-0c1e2d3f4a5b"),
    ("math", VERL_GSM8K, 0),
    ("code", LIVECODEBENCH_STDIN, "abc301_a"),
    ("code", APPS, 4000),
    ("code", CODECONTESTS, "1548_E. Gregor and the Two Painters"),
    ("search", HOTPOTQA_JSON, "5a8b57f25542995d1e6f1371"),
    ("search", TRIVIAQA, "tc_33"),
], ids=["math-500", "dapo-math-17k", "verl-gsm8k", "livecodebench", "apps", "codecontests", "hotpotqa", "triviaqa"])
def test_the_sources_own_id_is_kept_as_id(tmp_path: Path, task: str, row: dict[str, Any], want: object) -> None:
    inst = _one(tmp_path, task, row)
    assert inst["id"] == want and type(inst["id"]) is type(want)


def test_no_id_is_made_up_for_a_row_without_one(tmp_path: Path) -> None:
    assert _one(tmp_path, "math", GSM8K) == {"problem": GSM8K["question"], "answer": "72"}
    # TACO's 'name' is the problem's title: an id only in CodeContests' shape.
    assert "id" not in _one(tmp_path, "code", TACO)
    assert "id" not in _one(tmp_path, "search", {"question": "who?", "answer": ["Ada"]})  # NQ-open


def test_an_explicit_id_is_never_replaced(tmp_path: Path) -> None:
    # A MATH-500 copy that added its own 'id' beside 'unique_id'.
    assert _one(tmp_path, "math", {**MATH_500, "id": "math500-0"})["id"] == "math500-0"
    assert _one(tmp_path, "math", {**DAPO, "id": 7})["id"] == 7
    assert _one(tmp_path, "code", {**CODECONTESTS, "id": "cc-1"})["id"] == "cc-1"
    # HotpotQA as the Hub serves it: 'id'.
    hub = {k: v for k, v in HOTPOTQA_JSON.items() if k != "_id"} | {"id": "5a8b57f25542995d1e6f1371"}
    assert _one(tmp_path, "search", hub)["id"] == "5a8b57f25542995d1e6f1371"
    # A null 'id' (a column another source of a concatenated file has) is no id: the source's own stands in.
    assert _one(tmp_path, "math", {**MATH_500, "id": None})["id"] == "test/precalculus/807.json"
    assert _one(tmp_path, "math", {**GSM8K, "id": None})["id"] is None  # none to stand in: kept as given


def test_ids_from_parquet_keep_their_type(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"  # verl's examples/data_preprocess/gsm8k.py writes this shape
    second = {**VERL_GSM8K, "extra_info": {**VERL_GSM8K["extra_info"], "index": 1}}
    pq.write_table(pa.Table.from_pylist([VERL_GSM8K, second]), path)
    assert [i["id"] for i in load_instances("math", path)] == [0, 1]
    # An integer column with nulls, read back by pandas and written again, holds floats: the integer it was.
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.Table.from_pylist([{**APPS, "problem_id": 4000.0}, {**APPS, "problem_id": None}]), floats)
    first, nulled = load_instances("code", floats)
    assert first["id"] == 4000 and isinstance(first["id"], int)
    assert "id" not in nulled


# --- --skip-bad-rows ------------------------------------------------------------------------------------------

GOOD: dict[str, Any] = {"problem": "What is $1+1$?", "answer": "2", "unique_id": "test/algebra/1.json"}
NUMINA_PROOF: dict[str, Any] = {"problem": "Prove that $\\sqrt{2}$ is irrational.", "solution": "Suppose ...", "answer": "proof",
                "problem_type": "Number Theory", "question_type": "proof", "source": "olympiads",
                "synthetic": False}


def test_bad_rows_stop_the_load_unless_asked(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [GOOD, {"answer": "3"}, GOOD, NUMINA_PROOF, GOOD])
    with pytest.raises(DatasetError, match=r"m\.jsonl:2: missing field 'problem'"):
        load_instances("math", path)
    warnings: list[str] = []
    loaded = load_instances("math", path, warn=warnings.append, skip_bad_rows=True)
    assert loaded == [{"problem": "What is $1+1$?", "answer": "2", "id": "test/algebra/1.json"}] * 3
    (line,) = warnings
    assert line.startswith(f"{path}: skipped 2 bad row(s) of 5 (--skip-bad-rows): ")
    assert f"{path}:2: missing field 'problem'" in line
    assert f"{path}:4: field 'answer' is 'proof'" in line
    assert "more" not in line


def test_rows_keep_their_place_in_the_file_when_bad_rows_are_left_out(tmp_path: Path) -> None:
    from prorl_cli.domains.datasets import load_rows

    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n" + json.dumps({"answer": "3"}) + "\n\n" + json.dumps(GOOD) + "\n")
    assert [row for row, _ in load_rows("math", path, skip_bad_rows=True, warn=lambda line: None)] == [0, 3]


def test_only_the_first_reasons_are_named(tmp_path: Path) -> None:
    bad = [{"problem": f"p{i}"} for i in range(SKIPPED_SHOWN + 3)]
    warnings: list[str] = []
    loaded = load_instances("math", _jsonl(tmp_path / "m.jsonl", [GOOD, *bad]), warn=warnings.append,
                            skip_bad_rows=True)
    assert len(loaded) == 1
    (line,) = warnings
    assert f"skipped {SKIPPED_SHOWN + 3} bad row(s) of {SKIPPED_SHOWN + 4}" in line
    assert line.count("missing field 'answer'") == SKIPPED_SHOWN and line.endswith("; and 3 more")
    assert f"m.jsonl:{SKIPPED_SHOWN + 1}:" in line and f"m.jsonl:{SKIPPED_SHOWN + 2}:" not in line


def test_a_file_of_bad_rows_only_is_still_an_error(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [{"answer": "3"}, NUMINA_PROOF])
    with pytest.raises(DatasetError, match=r"m\.jsonl: every row is bad \(2 skipped by --skip-bad-rows\), e\.g\. "
                                           r".*m\.jsonl:1: missing field 'problem'.*m\.jsonl:2: field 'answer'"):
        load_instances("math", path, skip_bad_rows=True)


def test_lines_that_are_not_json_and_rows_that_are_not_objects_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{\"problem\": \"cut\n[1, 2]\n" + json.dumps(GOOD) + "\n{\"problem\": ")
    warnings: list[str] = []
    assert len(load_instances("math", path, warn=warnings.append, skip_bad_rows=True)) == 2
    (line,) = warnings
    assert "skipped 3 bad row(s) of 5" in line
    assert f"{path}:2: not valid JSON" in line and f"{path}:3: expected a JSON object, got list" in line
    assert f"{path}:5: the last line is cut off" in line
    # JSON Lines under a .json name, as Hub datasets name them.
    hub = tmp_path / "m.json"
    hub.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\nnot json\n")
    assert len(load_instances("math", hub, warn=warnings.append, skip_bad_rows=True)) == 2
    assert f"{hub}:3: not valid JSON" in warnings[-1]


def test_a_bad_first_line_is_skipped_like_any_other(tmp_path: Path) -> None:
    """A JSON Lines file whose first line is mangled is not one document either: the line is left out, and the
    rows after it keep their places in the file."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(GOOD)[:-1] + "\n" + json.dumps(GOOD) + "\nnot json\n" + json.dumps(GOOD) + "\n")
    warnings: list[str] = []
    rows = load_rows("math", path, warn=warnings.append, skip_bad_rows=True)
    assert [row for row, _ in rows] == [1, 3]
    (line,) = warnings
    assert "skipped 2 bad row(s) of 4" in line
    assert f"{path}:1: not valid JSON" in line and f"{path}:3: not valid JSON" in line
    with pytest.raises(DatasetError, match=r"m\.jsonl:1: not valid JSON"):  # unasked, the first bad line stops it
        load_rows("math", path)


def test_a_file_that_is_not_json_at_all_is_not_skipped_row_by_row(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("problem,answer\n1+1?,2\n")  # a CSV file
    with pytest.raises(DatasetError, match=r"m\.jsonl:1: not valid JSON"):
        load_instances("math", path, skip_bad_rows=True)
    pretty = tmp_path / "pretty.txt"  # one pretty-printed row is still read as one document
    pretty.write_text(json.dumps(GOOD, indent=2))
    assert len(load_instances("math", pretty, skip_bad_rows=True)) == 1


def test_bad_parquet_rows_are_skipped_by_row_number(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "s.parquet"
    rows = [{"question": "q1", "golden_answers": ["a"]}, {"question": "q2", "golden_answers": None},
            {"question": "q3", "golden_answers": ["c"]}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    warnings: list[str] = []
    assert [i["question"] for i in load_instances("search", path, warn=warnings.append, skip_bad_rows=True)] == ["q1", "q3"]
    assert f"{path} row 2: missing field 'answers'" in warnings[0]


def test_bad_swe_rows_are_skipped_and_left_out_of_the_field_report(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in (SWE_FIXTURES / "swe_rebench.jsonl").read_text().splitlines()]
    broken = {k: v for k, v in rows[0].items() if k != "base_commit"}
    path = _jsonl(tmp_path / "swe.jsonl", [rows[0], broken, rows[1]])
    warnings: list[str] = []
    loaded = load_instances("swe", path, warn=warnings.append, skip_bad_rows=True)
    assert [r["instance_id"] for r in loaded] == [rows[0]["instance_id"], rows[1]["instance_id"]]
    assert warnings[-1].startswith(f"{path}: skipped 1 bad row(s) of 3")
    assert f"{path}:2: missing field 'base_commit'" in warnings[-1]
    environment = next(w for w in warnings if "field 'environment'" in w)
    assert "(2 of 2 row(s)" in environment  # the skipped row is not one of the rows counted


def test_skip_bad_rows_is_for_the_domain_tasks(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"--skip-bad-rows applies to the domain tasks .* not to 'test'"):
        load_instances("test", _jsonl(tmp_path / "t.jsonl", [{"echo": 1}]), skip_bad_rows=True)


def _prorl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PRORL_HOME": str(home), "COLUMNS": "200"}
    env.pop("PRORL_CONFIG", None)
    env.pop("PRORL_DEPLOYMENT", None)
    return subprocess.run([sys.executable, "-m", "prorl_cli", *args], env=env, cwd=home.parent,
                          capture_output=True, text=True, timeout=120)


def test_the_cli_flag_reports_the_skipped_rows_before_it_connects(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    tasks = _jsonl(tmp_path / "m.jsonl", [GOOD, {"answer": "3"}, GOOD])
    for command in (["submit", str(tasks), "--task", "math"],
                    ["sample", str(tasks), "--task", "math", "--group-size", "2", "--target-groups", "1"]):
        # Without the flag: the first bad row stops it, named.
        r = _prorl(home, "-d", "nodeploy", *command)
        assert r.returncode == 1 and "m.jsonl:2: missing field 'problem'" in r.stderr, r.stderr
        assert "skipped" not in r.stderr
        # With it: the rows are loaded and the skip said; then the missing deployment stops it.
        r = _prorl(home, "-d", "nodeploy", *command, "--skip-bad-rows")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        warning = next(line for line in r.stderr.splitlines() if line.startswith("warning:"))
        assert "skipped 1 bad row(s) of 3 (--skip-bad-rows)" in warning and "m.jsonl:2: missing field 'problem'" in warning
        assert "nodeploy" in r.stderr.splitlines()[-1]
    every = _jsonl(tmp_path / "bad.jsonl", [{"answer": "3"}])
    r = _prorl(home, "-d", "nodeploy", "submit", str(every), "--task", "math", "--skip-bad-rows")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 1 and "every row is bad" in errors[0], r.stderr
    assert "--skip-bad-rows" in _prorl(home, "submit", "--help").stdout
