"""The token-exact agent loop (token-in/token-out) and the trajectory record."""

from prorl_cli.agent.chat import ChatTemplateError, ChatTokens
from prorl_cli.agent.loop import (
    FROM_CONTEXT,
    JOB_RECORDER,
    GenerateFn,
    Recorder,
    TokenSession,
    ToolFn,
    call_tool,
    run_tool_agent,
    tool_functions,
)
from prorl_cli.agent.tools import (
    HermesToolParser,
    InlineToolParser,
    SearchR1ToolParser,
    Tool,
    ToolCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
)
from prorl_cli.agent.trajectory import (
    TRAJECTORY_FORMAT,
    ModelCall,
    Trajectory,
    read_jsonl,
    write_jsonl,
    write_parquet,
)

__all__ = [
    "FROM_CONTEXT",
    "JOB_RECORDER",
    "TRAJECTORY_FORMAT",
    "ChatTemplateError",
    "ChatTokens",
    "GenerateFn",
    "HermesToolParser",
    "InlineToolParser",
    "ModelCall",
    "Recorder",
    "SearchR1ToolParser",
    "TokenSession",
    "Tool",
    "ToolCall",
    "ToolFn",
    "ToolParser",
    "Trajectory",
    "call_tool",
    "get_tool_parser",
    "read_jsonl",
    "register_tool_parser",
    "run_tool_agent",
    "tool_functions",
    "write_jsonl",
    "write_parquet",
]
