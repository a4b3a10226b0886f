"""The CPU reference engine: a ``transformers`` model generating in-process.

For laptops and tests (``prorl serve inference --engine transformers``);
production uses vLLM. It implements the same contract with real log-probs:
each sampled token's log-probability under the unmodified model
distribution (what vLLM returns by default), while sampling itself applies
temperature, top-k and top-p; stop strings end a call at the token that
completes one (the output decoded after every token with the model
directory's tokenizer). Calls run one at a time on a worker thread so
the event loop (heartbeats, other requests) stays responsive; a cancelled
call stops before its next token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path
from typing import Any

from prorl_cli.exceptions import ContextLengthExceeded, InferenceError, context_length_message
from prorl_cli.inference.contract import Engine, Generation, refuse_structured, stop_matcher
from prorl_cli.protocol import SamplingParams

log = logging.getLogger(__name__)
#: Files that hold a tokenizer's vocabulary (fast, SentencePiece, BPE, WordPiece, Mistral's tekken).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


class TransformersEngine(Engine):
    """A local Hugging Face causal LM run in-process with torch (``device``: ``auto`` takes the GPU if any)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_model_len: int | None = None,
        dtype: str = "float32",
        backend_id: str | None = None,
        device: str = "auto",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model = str(model_dir)
        self.max_model_len = max_model_len or 0
        self.dtype = dtype
        self.backend_id = backend_id
        #: As asked (``auto``, ``cpu``, ``cuda:0``); resolved to a real device when the model loads.
        self.device = device
        self._model: Any = None
        self._eos_ids: set[int] = set()
        #: The model's tokenizer, loaded by the first call with stop strings (only they need the output's text),
        #: from the directory the engine started on: checkpoints loaded later need not hold one.
        self._tokenizer: Any = None
        self._tokenizer_dir = self.model_dir
        # One thread: torch already uses every core for one forward pass.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prorl-transformers")

    async def start(self) -> None:
        if self._model is None:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._load)

    def _load(self) -> None:
        try:  # imported here so that a missing extra is named before anything loads
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as e:
            raise InferenceError(f"the transformers engine needs torch: install prorl[cpu] ({e})") from e
        _require_model_dir(self.model_dir)
        from prorl_cli.inference.device import resolve_device

        self.device = resolve_device(self.device)
        model = self._pretrained(self.model_dir)
        model = model.to(self.device)
        model.eval()
        log.info("loaded %s on %s", self.model_dir, self.device)
        cfg = model.config
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.max_model_len = min(self.max_model_len, limit) if self.max_model_len and limit else (self.max_model_len or limit)
        eos: Any = getattr(model.generation_config, "eos_token_id", None) or getattr(cfg, "eos_token_id", None)
        self._eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._model = model

    async def reload(self, checkpoint: str, policy_version: int) -> None:
        """Load ``checkpoint``'s weights into the live model (same architecture and shapes, strict)."""
        await self.start()
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load_state, Path(checkpoint))

    def _pretrained(self, directory: Path) -> Any:
        """The model in ``directory``; :class:`InferenceError` when the checkpoint lacks weights the model has.

        ``from_pretrained`` fills weights missing from a checkpoint (a torn or partial save) with random
        values and only logs a table: served, they would be a random model's tokens and log-probs.
        """
        import torch
        from transformers import AutoModelForCausalLM

        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=getattr(torch, self.dtype), output_loading_info=True)
        model, info = loaded
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise InferenceError(f"{directory}: the checkpoint lacks {len(missing)} of the model's weights "
                                 f"(a torn or partial save?): {', '.join(missing[:5])}")
        return model

    def _load_state(self, checkpoint: Path) -> None:
        import torch

        _require_model_dir(checkpoint)
        incoming = self._pretrained(checkpoint).state_dict()
        # Checked before copying anything: load_state_dict copies every weight that fits before it raises
        # on those that do not, which would leave the old and new weights mixed, served as the old version.
        current = self._model.state_dict()
        problems = [f"missing {k}" for k in sorted(current.keys() - incoming.keys())]
        problems += [f"unexpected {k}" for k in sorted(incoming.keys() - current.keys())]
        problems += [f"{k}: shape {tuple(incoming[k].shape)}, served {tuple(current[k].shape)}"
                     for k in sorted(current.keys() & incoming.keys()) if incoming[k].shape != current[k].shape]
        if problems:
            raise InferenceError(f"{checkpoint}: its weights do not fit the served model {self.model} "
                                 f"(the served weights are unchanged): {'; '.join(problems[:5])}"
                                 + (f" ({len(problems) - 5} more)" if len(problems) > 5 else ""))
        with torch.no_grad():
            self._model.load_state_dict(incoming, strict=True)
        self.model_dir = checkpoint

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generation:
        if not prompt_ids:
            raise InferenceError("generate needs at least one prompt token")
        refuse_structured("transformers engine", sampling)
        await self.start()
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthExceeded(context_length_message(len(prompt_ids), self.max_model_len))
        vocab = int(self._model.config.vocab_size)
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InferenceError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        loop = asyncio.get_running_loop()
        started, cancelled = threading.Event(), threading.Event()
        try:
            return await loop.run_in_executor(self._pool, self._generate, list(prompt_ids), sampling, started, cancelled)
        except asyncio.CancelledError:
            cancelled.set()  # the decode loop checks it before every token
            if not started.is_set():
                log.info("generation cancelled before it started")
            raise

    def _generate(
        self, prompt_ids: list[int], sampling: SamplingParams, started: threading.Event, cancelled: threading.Event
    ) -> Generation:
        import torch

        started.set()
        gen = torch.Generator()
        gen.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        stop_ids = set(sampling.stop_token_ids) if sampling.ignore_eos else self._eos_ids | set(sampling.stop_token_ids)
        match = stop_matcher(self._decoder(), sampling.stop) if sampling.stop else None
        stop_string: str | None = None
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        out_ids: list[int] = []
        logprobs: list[float] = []
        k = sampling.top_logprobs or 0
        top: list[list[tuple[int, float]]] | None = [] if k else None
        finish = "length"
        with torch.inference_mode():
            result = self._model(input_ids=torch.tensor([prompt_ids], device=self.device), use_cache=True)
            for _ in range(budget):
                if cancelled.is_set():
                    log.info("generation cancelled after %d of at most %d tokens", len(out_ids), budget)
                    finish = "abort"
                    break
                logits = result.logits[0, -1].float().cpu()  # sampled on the CPU: one seeded generator anywhere
                raw = torch.log_softmax(logits, dim=-1)
                token = self._sample(logits, sampling, gen)
                out_ids.append(token)
                logprobs.append(float(raw[token]))
                if top is not None:
                    values, indices = torch.topk(raw, min(k, raw.numel()))
                    top.append(list(zip(indices.tolist(), values.tolist(), strict=True)))
                if match is not None:
                    # The output's last ids decoded together: a byte-level token need not decode alone.
                    stop_string = match(out_ids)
                    if stop_string is not None:
                        finish = "stop"
                        break
                if token in stop_ids:
                    finish = "stop"
                    break
                result = self._model(
                    input_ids=torch.tensor([[token]], device=self.device), past_key_values=result.past_key_values,
                    use_cache=True,
                )
        return Generation(out_ids, logprobs, finish, self.backend_id, top_logprobs=top, stop_string=stop_string)

    def _decoder(self) -> Any:
        """``decode(ids) -> text`` with special tokens kept (as vLLM matches stop strings when asked to keep them):
        the model directory's tokenizer, loaded once; :class:`InferenceError` when it has none."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            where = self._tokenizer_dir
            need = f"sampling.stop needs the model's tokenizer to read the output's text, and {where} holds none"
            # Checked first: from a directory without them, transformers builds a tokenizer with no vocabulary,
            # which decodes every id to nothing, so no string would ever stop a call.
            if not any((where / name).is_file() for name in _TOKENIZER_FILES):
                raise InferenceError(f"{need} (no {', '.join(_TOKENIZER_FILES)})")
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
            except (OSError, ValueError) as e:
                raise InferenceError(f"{need} that loads ({type(e).__name__}: {e})") from e
        tokenizer = self._tokenizer
        return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False))

    @staticmethod
    def _sample(logits: Any, sampling: SamplingParams, gen: Any) -> int:
        import torch

        if sampling.temperature == 0:
            return int(torch.argmax(logits))
        scaled = logits / sampling.temperature
        if sampling.top_k > 0:
            kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # Drop tokens once the mass before them already reaches top_p (always keep the first).
            drop = cum - torch.softmax(sorted_logits, dim=-1) >= sampling.top_p
            scaled = scaled.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _require_model_dir(path: Path) -> None:
    """Refuse a path that holds no model, saying what it is instead (a file given for its folder reads as such)."""
    if path.is_file():
        raise InferenceError(f"{path}: a file, not a model directory: give the folder that holds config.json and "
                             "the weights")
    if not (path / "config.json").is_file():
        raise InferenceError(f"{path}: not a model directory (no config.json)")
