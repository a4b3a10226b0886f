"""``search``: question answering over a local corpus with ``search(query, k)`` and ``open(doc_id)``.

Instance (the loader turns NQ / HotpotQA / TriviaQA-style rows into this)::

    {"question": "Who designed the Eiffel Tower's structure?", "answers": ["Maurice Koechlin"],
     "settings": {"corpus": "/data/wiki.jsonl", "top_k": 5}}     # optional

The corpus (JSONL ``{id, title, text}``; default: the shipped
``handlers/data/search_corpus.jsonl``) is indexed with BM25 (``bm25s``) once
per node process and shared by every job on the node
(:mod:`prorl_cli.domains.search_index`); no internet is used. The answer is
the last ``\\boxed{}`` of the final turn, else the whole final turn. Reward:
SQuAD exact match against any gold answer; ``output["f1"]`` records token F1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prorl_cli.agent import Trajectory
from prorl_cli.domains.answers import exact_match, f1_score, last_boxed
from prorl_cli.domains.handler import DomainHandler, final_text
from prorl_cli.domains.search_index import BUILDS, SearchIndex, get_index, hits_text
from prorl_cli.domains.settings import DomainSettings
from prorl_cli.exceptions import DomainError
from prorl_cli.node.handler import JobContext

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "search_corpus.jsonl"
SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the document collection; returns the best matches (id, title, snippet).",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
            "required": ["query"],
        },
    },
}
OPEN_SCHEMA = {
    "type": "function",
    "function": {
        "name": "open",
        "description": "Read a whole document by its id.",
        "parameters": {"type": "object", "properties": {"doc_id": {"type": "string"}}, "required": ["doc_id"]},
    },
}
SYSTEM = (
    "Answer the question using the search tool (and open to read a document). Give a short answer, "
    "the exact words from the documents, in \\boxed{...}."
)


def gold_answers(instance: dict[str, object]) -> list[str]:
    """``answers`` (a list) or ``answer`` (a string or a list) as a non-empty list of strings."""
    value = instance.get("answers", instance.get("answer"))
    golds = [value] if isinstance(value, str) else value
    if not isinstance(golds, list) or not golds or not all(isinstance(g, str) for g in golds):
        raise DomainError("search: instance needs 'answers' (a list of strings) or 'answer'")
    return golds


class SearchHandler(DomainHandler):
    """Retrieval-augmented QA scored by SQuAD exact match."""

    name = "search"
    defaults = DomainSettings(
        max_turns=6, system_prompt=SYSTEM, tools=("search", "open"), image=None,
        init_timeout_s=600.0, run_timeout_s=600.0, eval_timeout_s=30.0, max_tokens=512,
        extra={"corpus": str(DEFAULT_CORPUS), "top_k": 5, "open_max_chars": 4000},
    )
    tool_schemas = {"search": SEARCH_SCHEMA, "open": OPEN_SCHEMA}
    required_fields = ("question",)

    async def setup(self, ctx: JobContext, settings: DomainSettings) -> None:
        gold_answers(ctx.instance)
        await self.load_chat(ctx, settings)
        corpus = str(settings.get("corpus"))
        index, built = await asyncio.to_thread(get_index, corpus)
        ctx.state["index"] = index
        ctx.output["index"] = {
            "corpus": index.source, "docs": len(index.docs), "built_by_this_job": built,
            "build_s": round(index.build_s, 4), "builds_on_node": BUILDS.get(index.source, 0),
        }

    async def act(self, ctx: JobContext, settings: DomainSettings) -> None:
        index: SearchIndex = ctx.state["index"]
        top_k = int(settings.get("top_k"))
        max_chars = int(settings.get("open_max_chars"))
        searches: list[str] = []

        async def search(query: str, k: int = top_k) -> str:
            searches.append(str(query))
            return hits_text(await asyncio.to_thread(index.search, str(query), min(int(k), 20)))

        def open_doc(doc_id: str) -> str:
            doc = index.open(str(doc_id))
            return f"{doc.title}\n\n{doc.text[:max_chars]}"

        await self.agent_loop(ctx, settings, ctx.instance["question"], {"search": search, "open": open_doc})
        ctx.output["searches"] = searches

    async def score(self, ctx: JobContext, settings: DomainSettings) -> None:
        traj = Trajectory.from_dict(ctx.output["trajectory"])
        text = final_text(traj) if traj.stop_reason == "stop" else ""
        answer = last_boxed(text)
        predicted = answer if answer is not None else text.strip()
        golds = gold_answers(ctx.instance)
        ctx.output["predicted"] = predicted
        ctx.output["f1"] = f1_score(predicted, golds)
        ctx.reward = 1.0 if predicted and exact_match(predicted, golds) else 0.0
