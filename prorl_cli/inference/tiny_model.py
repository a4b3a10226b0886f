"""``prorl dev tiny-model``: a small random Qwen2 model and a local BPE tokenizer.

Everything is made offline from text already on the machine (the Python
standard library's sources), so the quickstart and the tests never download
weights. The model is randomly initialised: its outputs are gibberish, but
its log-probs are real and vLLM and transformers both load it like any
Qwen2 checkpoint. Any local Hugging Face model directory works in its place.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Qwen2.5-style ChatML template with Hermes tool calls: tools are listed in the
# system turn, assistant tool calls render as <tool_call>{json}</tool_call>, and
# consecutive tool results are grouped into one user turn of <tool_response>s.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call return <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'user' or message['role'] == 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set fn = tc['function'] if tc.get('function') else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tool-call markers are ordinary added tokens in Qwen2.5; the tiny model does the same.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def _corpus(max_files: int) -> Iterator[str]:
    """Local training text: the standard library's own sources (always present)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    files += sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))
    for path in files[:max_files]:
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def make_tiny_model(
    directory: str | Path,
    *,
    vocab_size: int = 4096,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    max_files: int = 200,
) -> Path:
    """Write a random Qwen2 model and a byte-level BPE tokenizer into ``directory``.

    ``hidden_size / num_heads`` must be at least 64 (vLLM's CPU attention
    refuses smaller heads). Takes a few seconds; returns the directory.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    head_dim = hidden_size // num_heads
    if head_dim < 64:
        raise ValueError(f"head_dim {head_dim} < 64: vLLM's CPU backend needs hidden_size/num_heads >= 64")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(max_files), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.add_tokens(ADDED_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = max_position_embeddings
    tok.save_pretrained(str(out))

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=int(tok.convert_tokens_to_ids("<|endoftext|>")),  # type: ignore[arg-type]
        eos_token_id=int(tok.convert_tokens_to_ids("<|im_end|>")),  # type: ignore[arg-type]
        dtype="bfloat16",
    )
    model: Any = Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    return out
