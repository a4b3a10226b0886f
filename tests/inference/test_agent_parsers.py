"""Tool-call parsing of turns as reasoning models write them."""

from __future__ import annotations

from prorl_cli.agent import HermesToolParser

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


def test_call_drafted_while_thinking_is_not_made() -> None:
    p = HermesToolParser()
    turn = ('<think>\nMaybe <tool_call>\n{"name": "rm", "arguments": {"path": "/"}}\n</tool_call>? '
            'No, add instead.\n</think>\n\n' + CALL)
    assert [(c.name, c.arguments) for c in p.parse(turn)] == [("calculator", {"expression": "2+3"})]
    # A thought the template opened in the prompt (only </think> in the output) is skipped alike.
    assert p.parse('draft <tool_call>{"name": "rm", "arguments": {}}</tool_call>\n</think>\n\nno call') == []
    # A turn cut while thinking made no call.
    assert p.parse('<think>\nfirst ' + CALL + ' then') == []
    # Without reasoning, nothing changes, even when a call's arguments hold the tags.
    write = ('<tool_call>\n{"name": "write", "arguments": {"text": "a <think> b </think> c"}}\n</tool_call>')
    assert [c.arguments for c in p.parse("Saving it.\n" + write)] == [{"text": "a <think> b </think> c"}]
    assert [c.name for c in p.parse("sure\n" + CALL + CALL)] == ["calculator", "calculator"]


def test_last_call_without_its_closing_tag_is_made() -> None:
    p = HermesToolParser()
    (call,) = p.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n')
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+3"}, None)
    two = p.parse(CALL + '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}')
    assert [c.arguments for c in two] == [{"expression": "2+3"}, {"expression": "1"}]
    # A call cut short (the turn hit its length) or a tag named in prose is no call.
    assert p.parse('<tool_call>\n{"name": "calculator", "argum') == []
    assert p.parse("I would answer with a <tool_call> block.") == []
    # A closed call that is not JSON is still an error the model is shown.
    (bad,) = p.parse("<tool_call>{not json}</tool_call>")
    assert bad.error is not None and bad.error.startswith("tool call is not valid JSON")
