"""``prorl swe validate``'s outputs: ``clean.jsonl``, ``report.json`` and ``report.html``.

- ``clean.jsonl``: the rows that passed, as prorl reads them (every field
  kept, test lists as lists), flaky ids removed or the row dropped by policy;
- ``report.json``: the counts per class and, per instance, its class, the
  reason, the flaky ids, the tests behind the class, every run (job id,
  state, why it was not evaluated, stage seconds, failing tests) and what
  became of the row; instances with no result yet are ``pending``;
- ``report.html``: the same as one self-contained table (no script, opens offline).
"""

from __future__ import annotations

import html
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prorl_cli.swe.validation import CLASSES, ENV_BROKEN, VALID, Verdict

PENDING = "pending"
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f4f4f4}.bad{color:#b00}.ok{color:#070}.warn{color:#a60}code{font-size:90%}"""


@dataclass
class ValidationSummary:
    """What one validation pass found: counts per class, rows written, and where."""

    counts: dict[str, int]
    clean_rows: int
    pending: list[str]
    report: Path
    clean: Path
    html: Path


def write_outputs(out: Path, dataset: Path, instance_ids: list[str], verdicts: dict[str, Verdict],
                  clean_rows: list[dict[str, Any]], runs: int, policy: str) -> ValidationSummary:
    """Write clean.jsonl, report.json and report.html under ``out``; instances without a verdict are pending."""
    out.mkdir(parents=True, exist_ok=True)
    clean = out / "clean.jsonl"
    tmp = clean.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in clean_rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(clean)
    pending = [i for i in instance_ids if i not in verdicts]
    counts = {c: sum(v.status == c for v in verdicts.values()) for c in CLASSES}
    counts[PENDING] = len(pending)
    doc = {
        "dataset": str(dataset), "instances": len(instance_ids), "gold_runs": runs, "flaky_policy": policy,
        "counts": counts, "clean_rows": len(clean_rows), "clean": str(clean),
        "not_evaluated": sorted(i for i, v in verdicts.items() if not v.evaluated),
        "pending": pending,
        "results": [verdicts[i].to_dict() for i in instance_ids if i in verdicts],
    }
    report = out / "report.json"
    report.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    page = out / "report.html"
    page.write_text(render_html(dataset, instance_ids, verdicts, counts, runs, len(clean_rows)), encoding="utf-8")
    return ValidationSummary(counts, len(clean_rows), pending, report, clean, page)


def render_html(dataset: Path, instance_ids: list[str], verdicts: dict[str, Verdict], counts: dict[str, int],
                runs: int, clean_rows: int) -> str:
    """One page: the counts, then a row per instance (class, reason, flaky ids, runs, clean.jsonl)."""
    e = html.escape
    title = f"prorl swe validate: {dataset.name}"
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>",
             f"<p>{len(instance_ids)} instance(s), {runs} gold run(s) each and one with the test patch alone; "
             f"{clean_rows} row(s) in clean.jsonl · made {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
             "<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in counts) + "</tr><tr>"
             + "".join(f"<td>{n}</td>" for n in counts.values()) + "</tr></table>",
             "<table><tr><th>instance</th><th>class</th><th>reason</th><th>flaky ids</th><th>runs</th>"
             "<th>clean.jsonl</th></tr>"]
    for iid in instance_ids:
        v = verdicts.get(iid)
        if v is None:
            parts.append(f"<tr><td>{e(iid)}</td><td class='warn'>{PENDING}</td><td></td><td></td><td></td><td></td></tr>")
            continue
        css = "ok" if v.status == VALID else "bad" if v.status == ENV_BROKEN else "warn"
        run_cells = "<br>".join(
            e(f"{r['kind']}{r['k'] if r['kind'] == 'gold' else ''}: {r['state']}"
              + ("" if r["evaluated"] else f" (not evaluated: {r['problem'][:200]})")
              + (f", failing {len(r['failed_tests'])}" if r["failed_tests"] else "")) for r in v.runs)
        flaky = "<br>".join(f"<code>{e(t)}</code>" for t in v.flaky)
        parts.append(f"<tr><td>{e(iid)}</td><td class='{css}'>{e(v.status)}</td><td>{e(v.reason)}</td>"
                     f"<td>{flaky}</td><td>{run_cells}</td><td>{e(v.clean)}</td></tr>")
    parts.append("</table></body></html>")
    return "".join(parts)
