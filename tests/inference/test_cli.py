"""``prorl dev tiny-model`` and ``prorl serve inference`` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def prorl(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "prorl_cli", "--home", str(home), *args],
                         capture_output=True, text=True, timeout=300)
    out.stderr = " ".join(out.stderr.split())  # the console wraps long lines
    return out


def test_dev_tiny_model_makes_a_loadable_model(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'prorl[cpu]')")
    out = prorl("dev", "tiny-model", str(tmp_path / "tiny"), home=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tiny model written to" in out.stdout
    cfg = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["hidden_size"] // cfg["num_attention_heads"] >= 64
    from prorl_cli.agent import ChatTokens

    chat = ChatTokens.from_pretrained(tmp_path / "tiny")
    text = "def having(x):\n    return x  # ünïcödé"
    assert chat.decode(chat.encode(text)) == text
    assert chat.turn_suffix == "<|im_end|>\n"
    assert chat.decode(chat.initial_prompt([{"role": "user", "content": "hi"}])).endswith("<|im_start|>assistant\n")


def test_serve_inference_bad_arguments_are_named(tmp_path: Path) -> None:
    out = prorl("serve", "inference", home=tmp_path)
    assert out.returncode != 0 and "give --model DIR" in out.stderr
    out = prorl("serve", "inference", "--model", str(tmp_path / "nope"), home=tmp_path)
    assert out.returncode != 0
    assert "no such directory" in out.stderr or "vllm is not installed" in out.stderr
    out = prorl("serve", "inference", "--engine", "transformers", "--model", str(tmp_path / "nope"), home=tmp_path)
    assert out.returncode != 0 and "not a model directory" in out.stderr
    (tmp_path / "config.json").write_text("{}")  # the model's file given for its folder
    out = prorl("serve", "inference", "--engine", "transformers", "--model", str(tmp_path / "config.json"), home=tmp_path)
    assert out.returncode != 0 and "config.json: a file, not a model directory" in out.stderr, out.stderr
    out = prorl("serve", "inference", "--attach", "http://127.0.0.1:1/v1", "--", "--dtype", "x", home=tmp_path)
    assert out.returncode != 0 and "vLLM flags" in out.stderr
