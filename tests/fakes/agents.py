"""Agent programs for harness tests: what a user's unmodified agent looks like to the gateway."""

from __future__ import annotations

#: A plain agent (standard library only), as a harness ``command``: chat completions with a bash tool until a
#: turn calls no tool; it prints each reply and each command's output, and exits with ``$AGENT_EXIT`` (default 0).
AGENT = r"""python3 - {task_file} <<'PRORL_AGENT'
import json, os, subprocess, sys, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": open(sys.argv[1]).read()}]
for step in range(8):
    req = urllib.request.Request(base + "/chat/completions", headers={"Content-Type": "application/json",
        "Authorization": "Bearer " + key}, data=json.dumps({"model": "prorl", "messages": messages,
        "tools": tools}).encode())
    msg = json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]
    messages.append(msg)
    print("assistant:", msg.get("content"), flush=True)
    if not msg.get("tool_calls"):
        break
    for tc in msg["tool_calls"]:
        cmd = json.loads(tc["function"]["arguments"])["command"]
        out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
        print("ran:", cmd, "->", out.strip(), flush=True)
        messages.append({"role": "tool", "tool_call_id": tc["id"], "content": out})
sys.exit(int(os.environ.get("AGENT_EXIT", "0")))
PRORL_AGENT"""
