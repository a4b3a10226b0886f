"""Task domains: per-stage time split and rollouts/s with scripted model turns; search index build and query cost.

Part 1, per domain (math, code, swe, search): ``--jobs`` rollouts whose model
turns are scripted (a real inference bridge serving predetermined token ids,
``prorl_cli/testing/scripted_engine.py``) through a real broker and node with
Apptainer sandboxes on the domain test image. Printed: mean in-stage seconds
of INIT / RUN / EVAL, mean queue seconds (submit-to-result wall time minus
in-stage time), and rollouts/s, for prorl's concurrent stage pools against
the baseline of one job at a time (pools of 1, as a blocking per-rollout
service would run them).

Part 2: the BM25 search index at 10k and 100k synthetic documents: build
time (what every job would pay if each built its own index, the baseline)
and per-query latency of the shared index.

    python benchmarks/domains.py [--jobs 8] [--docs 10000 100000] [--queries 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from prorl_cli.domains.search_index import Document, SearchIndex
from prorl_cli.domains.tinyrepo import make_tinyrepo
from prorl_cli.testing import Deployment
from prorl_cli.testing.scripted import TEST_IMAGES as IMAGES
from prorl_cli.testing.scripted import ScriptedStack, turn

FIX = ("editor", {"command": "str_replace", "path": "/testbed/tinycalc/stats.py", "old_str": "(len(xs) - 1)", "new_str": "len(xs)"})


def domain_jobs(tmp: Path, n: int) -> dict[str, tuple[list[tuple[str, list[str]]], list[Any]]]:
    """Per domain: the script entries and ``n`` instances (each a full, successful rollout)."""
    repo = make_tinyrepo(tmp / "tinycalc")
    swe = {**repo.instance, "repo_path": str(repo.path)}
    return {
        "math": ([("B-math", [turn("", ("python", {"code": "391"})), "\\boxed{391}"])],
                 [{"problem": f"B-math {i}: 17*23", "answer": "391"} for i in range(n)]),
        "code": ([("B-code", ["```python\nprint(sum(map(int, input().split())))\n```"])],
                 [{"question": f"B-code {i}", "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]}
                  for i in range(n)]),
        "swe": ([("[B-swe", [turn("", FIX), "Done."])],
                [{**swe, "problem_statement": f"[B-swe {i}] {swe['problem_statement']}"} for i in range(n)]),
        "search": ([("B-search", [turn("", ("search", {"query": "who created python"})), "\\boxed{Guido van Rossum}"])],
                   [{"question": f"B-search {i}: who created Python?", "answers": ["Guido van Rossum"]} for i in range(n)]),
    }


def run_domains(tmp: Path, tiny_model: Path, n: int, pools: int) -> dict[str, dict[str, float]]:
    image = str(IMAGES / "domains.sif")
    config = {
        "sandbox": {"runtime": "apptainer", "image": image, "local_dir": str(tmp / f"sb{pools}")},
        "inference": {"tokenizer": str(tiny_model)},
        "jobs": {"timeout_s": 600.0},
        "node": {"n_init": pools, "n_run": pools, "n_eval": pools},
        "domains": {d: {"image": image} for d in ("math", "code", "swe")},
    }
    jobs = domain_jobs(tmp / f"jobs{pools}", n)
    out: dict[str, dict[str, float]] = {}
    d = Deployment(tmp / f"home{pools}", "bench", config=config)
    try:
        d.start_broker()
        d.start_node("n1")
        stack = ScriptedStack(d, tiny_model, tmp / f"script{pools}.json")
        for entries, _ in jobs.values():
            for match, turns in entries:
                stack.add(match, *turns)
        stack.start_model()
        client = d.client
        for domain, (_, instances) in jobs.items():
            started = time.monotonic()
            ids = client.submit(domain, instances, timeout_s=600)
            finished: dict[str, float] = {}
            results = []
            for r in client.as_completed(ids):
                finished[r.job_id] = time.monotonic() - started
                results.append(r)
            wall_s = time.monotonic() - started
            bad = [r for r in results if r.state != "done" or r.reward != 1.0]
            if bad:
                raise SystemExit(f"{domain}: {len(bad)} rollout(s) did not succeed: {bad[0]}")
            out[domain] = {
                **{f"{s}_s": statistics.mean(r.stage_s.get(s, 0.0) for r in results) for s in ("init", "run", "eval")},
                "queue_s": statistics.mean(finished[r.job_id] - r.active_s for r in results),
                "rollouts_per_s": len(results) / wall_s,
            }
    finally:
        d.close()
    return out


WORDS = [f"w{i}" for i in range(20000)]


def synthetic_docs(n: int, rng: random.Random) -> list[Document]:
    return [Document(str(i), f"doc {i}", " ".join(rng.choices(WORDS, k=60))) for i in range(n)]


def run_index(sizes: list[int], queries: int) -> list[dict[str, float]]:
    rng = random.Random(0)
    rows = []
    for n in sizes:
        docs = synthetic_docs(n, rng)
        cpu = time.process_time()
        index = SearchIndex(docs, f"synthetic-{n}")
        build_cpu_s = time.process_time() - cpu
        qs = [" ".join(rng.choices(WORDS, k=4)) for _ in range(queries)]
        lat = []
        for q in qs:
            t = time.perf_counter()
            index.search(q, 5)
            lat.append(time.perf_counter() - t)
        lat.sort()
        rows.append({"docs": n, "build_s": index.build_s, "build_cpu_s": build_cpu_s, "query_p50_ms": 1000 * lat[len(lat) // 2],
                     "query_p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=8, help="rollouts per domain")
    ap.add_argument("--docs", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--skip-domains", action="store_true", help="only the search index part")
    args = ap.parse_args()
    if not args.skip_domains:
        from prorl_cli.inference.tiny_model import make_tiny_model

        with tempfile.TemporaryDirectory(prefix="prorl-bench-domains-") as t:
            tmp = Path(t)
            tiny = make_tiny_model(tmp / "tiny")
            prorl = run_domains(tmp, tiny, args.jobs, pools=8)
            serial = run_domains(tmp, tiny, args.jobs, pools=1)
        print(f"\n## domains: {args.jobs} scripted rollouts each (Apptainer sandboxes)\n")
        print("| domain | INIT s | RUN s | EVAL s | queue s | rollouts/s (pools of 8) | rollouts/s (one at a time) | speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for domain, row in prorl.items():
            base = serial[domain]["rollouts_per_s"]
            print(f"| {domain} | {row['init_s']:.2f} | {row['run_s']:.2f} | {row['eval_s']:.2f} | {row['queue_s']:.2f} "
                  f"| {row['rollouts_per_s']:.2f} | {base:.2f} | {row['rollouts_per_s'] / base:.1f}x |")
    print(f"\n## search index (bm25s), {args.queries} queries of 4 words, top 5\n")
    print("| docs | build s wall (paid per job if each job built its own) | build CPU s | query p50 ms | query p99 ms |")
    print("|---|---|---|---|---|")
    for row in run_index(args.docs, args.queries):
        print(f"| {row['docs']} | {row['build_s']:.2f} | {row['build_cpu_s']:.2f} | {row['query_p50_ms']:.2f} | {row['query_p99_ms']:.2f} |")


if __name__ == "__main__":
    main()
