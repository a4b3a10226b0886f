"""``search``: question answering over a local corpus with ``search(query, k)`` and ``open(doc_id)``.

Instance (the loader turns NQ / HotpotQA / TriviaQA-style rows into this)::

    {"question": "Who designed the Eiffel Tower's structure?", "answers": ["Maurice Koechlin"],
     "settings": {"corpus": "/data/wiki.jsonl", "top_k": 5},     # optional
     "prompt": [{"role": "user", "content": "..."}]}             # optional: the row's own (tool_format search_r1)

The corpus (JSONL ``{id, title, text}``; default: the shipped
``handlers/data/search_corpus.jsonl``) is indexed with BM25 (``bm25s``) once
per node process and shared by every job on the node
(:mod:`prorl_cli.domains.search_index`); no internet is used. The answer is
the last ``<answer>...</answer>`` (the format Search-R1's prompt asks for, and
a model trained on its rows writes) or the last ``\\boxed{}`` (the shipped
system prompt's) of the final turn, whichever comes later (``\\text{...}`` and
the like unwrapped), else the whole final turn: a row is scored the same
whichever format its source asked for. Reward: SQuAD exact match against any
gold answer; ``output["f1"]`` records token F1.

``tool_format`` (a setting) picks the protocol. ``hermes`` (the default): the
``search``/``open`` tools in the chat template, calls as ``<tool_call>`` JSON,
results as tool turns; an instance's own ``prompt`` is not used (a warning
once per node when it asks for Search-R1's tags: a model trained on such rows
wants ``search_r1``). ``search_r1``: Search-R1's tags, for a model trained
with its recipe: the prompt is the instance's chat ``prompt`` as it is, when
it carries one (the loader keeps a row's; a malformed one fails the job before
INIT, naming the message), else ``search_r1_prompt`` with the question in
place of ``{question}`` (Search-R1's instruction; its data scripts build every
row's prompt so), with no system prompt and no tool schemas; ``<search> q </search>`` ends the
model's output there, the top ``top_k`` passages follow in the same turn as
``\n\n<information>Doc 1(Title: ...) ...</information>\n\n`` and the
model goes on, for up to ``max_turns`` searches; ``<answer>`` ends the rollout
(:class:`~prorl_cli.agent.tools.SearchR1ToolParser`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path
from typing import Any

from prorl_cli.agent.chat import ChatTokens
from prorl_cli.agent.tools import get_tool_parser
from prorl_cli.domains.answers import exact_match, f1_score, final_answer, latex_words
from prorl_cli.domains.prompts import asks_for_search_r1_tags, chat_prompt
from prorl_cli.domains.search_index import (
    BUILDS,
    SearchIndex,
    get_index,
    hits_text,
    search_r1_passages,
)
from prorl_cli.exceptions import DomainError, SettingsError
from prorl_cli.node.handler import AgentHandler, HandlerSettings, JobContext, Tool, final_text

log = logging.getLogger(__name__)
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
#: The protocols ``tool_format`` may name.
TOOL_FORMATS = ("hermes", "search_r1")
#: Search-R1's instruction (its data scripts' ``base`` template), the question in place of ``{question}``.
SEARCH_R1_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search "
    "as many times as your want. If you find no further external knowledge needed, you can directly provide the "
    "answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n")


def gold_answers(instance: dict[str, object]) -> list[str]:
    """``answers`` (a list) or ``answer`` (a string or a list) as a non-empty list of strings."""
    value = instance.get("answers", instance.get("answer"))
    golds = [value] if isinstance(value, str) else value
    if not isinstance(golds, list) or not golds or not all(isinstance(g, str) for g in golds):
        raise DomainError("search: instance needs 'answers' (a list of strings) or 'answer'")
    return golds


async def search(ctx: JobContext, query: str, k: int | None = None) -> str:
    """The best ``k`` (default ``top_k``, at most 20) matches in the job's index."""
    index: SearchIndex = ctx.state["index"]
    ctx.state.setdefault("searches", []).append(str(query))
    k = int(ctx.settings.get("top_k")) if k is None else int(k)
    return hits_text(await asyncio.to_thread(index.search, str(query), min(k, 20)))


async def search_r1_search(ctx: JobContext, query: str) -> str:
    """The best ``top_k`` passages in the job's index as Search-R1 shows them (whole passages, ``Doc i(Title: ...)``)."""
    index: SearchIndex = ctx.state["index"]
    ctx.state.setdefault("searches", []).append(str(query))
    hits = await asyncio.to_thread(index.search, str(query), min(int(ctx.settings.get("top_k")), 20))
    return search_r1_passages([index.open(h.doc_id) for h in hits])


@functools.lru_cache(maxsize=8)
def _chat_without_tools(chat: ChatTokens) -> ChatTokens:
    """The job's tokenizer with no tool schemas: a Search-R1 model was trained on prompts that list none."""
    return ChatTokens(chat.tokenizer)


def search_r1_messages(instance: dict[str, Any], template: str) -> list[dict[str, Any]]:
    """What a Search-R1 model is prompted with: the instance's chat ``prompt`` as it is (the row's own, which
    the loader keeps), else ``template`` around the question. A malformed ``prompt`` raises
    :class:`DomainError` naming the message: the job fails rather than asking in words the row never held."""
    prompt = instance.get("prompt")
    if prompt is not None:
        try:
            return chat_prompt(prompt)
        except DomainError as e:
            raise DomainError(f"search: instance {e}") from e
    return [{"role": "user", "content": template.replace("{question}", str(instance["question"]))}]


#: Whether this process has said that the hermes format leaves rows' Search-R1 prompts unused.
_WARNED_UNUSED_PROMPT = False


def _warn_unused_search_r1_prompt(ctx: JobContext) -> None:
    """Say once per node process that a row's own Search-R1 prompt goes unused under the hermes format.

    The hermes format asks the question with the task's system prompt and tool schemas; a row's prompt
    asking for ``<search>``/``<answer>`` tags would contradict them (those tags are not read as calls
    there), so it is left out, and a model trained on such rows is likely meant for ``tool_format: search_r1``.
    """
    global _WARNED_UNUSED_PROMPT
    if _WARNED_UNUSED_PROMPT or not asks_for_search_r1_tags(ctx.instance.get("prompt")):
        return
    _WARNED_UNUSED_PROMPT = True
    log.warning("search: job %s's instance carries its own prompt asking for Search-R1's <search>/<answer> "
                "tags; tool_format hermes asks the question with the task's system prompt and tools instead, and "
                "reads no <search> tags (said once per node). Set tool_format: search_r1 (handlers.search in "
                "prorl.yaml, or the instance's settings) to prompt with the row's own.", ctx.job_id)


def open_doc(ctx: JobContext, doc_id: str) -> str:
    """A whole document (cut at ``open_max_chars``)."""
    doc = ctx.state["index"].open(str(doc_id))
    return f"{doc.title}\n\n{doc.text[: int(ctx.settings.get('open_max_chars'))]}"


class SearchHandler(AgentHandler):
    """Retrieval-augmented QA scored by SQuAD exact match."""

    name = "search"
    defaults = HandlerSettings(
        max_turns=6, system_prompt=SYSTEM, tools=("search", "open"), image=None,
        init_timeout_s=600.0, run_timeout_s=600.0, eval_timeout_s=30.0, max_tokens=512,
        extra={"corpus": str(DEFAULT_CORPUS), "top_k": 5, "open_max_chars": 4000, "tool_format": "hermes",
               "search_r1_prompt": SEARCH_R1_PROMPT},
    )
    tools = (Tool("search", SEARCH_SCHEMA, search, context=True), Tool("open", OPEN_SCHEMA, open_doc, context=True))
    required_fields = ("question",)

    def check_instance(self, ctx: JobContext) -> None:
        """The base checks, then this task's own settings: a known ``tool_format``, a usable ``search_r1_prompt``."""
        super().check_instance(ctx)
        tool_format = ctx.settings.get("tool_format")
        if tool_format not in TOOL_FORMATS:
            raise SettingsError(f"search: setting tool_format is {tool_format!r}; choose from {list(TOOL_FORMATS)}")
        if tool_format == "search_r1" and "{question}" not in ctx.settings.get("search_r1_prompt"):
            raise SettingsError("search: setting search_r1_prompt must hold {question}, where the question goes")
        if tool_format == "search_r1":
            search_r1_messages(ctx.instance, ctx.settings.get("search_r1_prompt"))  # a malformed prompt fails here

    async def init(self, ctx: JobContext) -> None:
        ctx.output["domain"] = self.name
        gold_answers(ctx.instance)
        corpus = str(ctx.settings.get("corpus"))
        index, built = await asyncio.to_thread(get_index, corpus)
        ctx.state["index"] = index
        ctx.output["index"] = {
            "corpus": index.source, "docs": len(index.docs), "built_by_this_job": built,
            "build_s": round(index.build_s, 4), "builds_on_node": BUILDS.get(index.source, 0),
        }

    async def run(self, ctx: JobContext) -> None:
        ctx.output["searches"] = ctx.state.setdefault("searches", [])  # kept current, so a cut-short RUN has them
        if ctx.settings.get("tool_format") == "search_r1":
            await self._run_search_r1(ctx)
        else:
            _warn_unused_search_r1_prompt(ctx)
            await ctx.agent(ctx.instance["question"])

    async def _run_search_r1(self, ctx: JobContext) -> None:
        """The tool loop in Search-R1's protocol, on the tokenizer without tool schemas."""
        settings = ctx.settings
        # max_turns counts searches, as Search-R1's does: the call after the last search may still answer.
        await ctx.agent(messages=search_r1_messages(ctx.instance, settings.get("search_r1_prompt")),
                        tools={"search": functools.partial(search_r1_search, ctx)}, max_turns=settings.max_turns + 1,
                        parser=get_tool_parser("search_r1"), chat=_chat_without_tools(await ctx.chat()))

    async def eval(self, ctx: JobContext) -> None:
        traj = ctx.trajectory
        text = final_text(traj) if traj.stop_reason == "stop" else ""
        answer = final_answer(text)  # <answer> tags (Search-R1) or \boxed{}, the later one
        # A boxed answer often wraps its words in \text{...}: scored as "textparis", it would never match "Paris".
        predicted = latex_words(answer) if answer is not None else text.strip()
        golds = gold_answers(ctx.instance)
        ctx.output["predicted"] = predicted
        ctx.output["f1"] = f1_score(predicted, golds)
        ctx.reward = 1.0 if predicted and exact_match(predicted, golds) else 0.0
