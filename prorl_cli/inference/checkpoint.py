"""What a checkpoint directory holds, from its safetensors headers alone (no weight is read).

An in-place reload compares the checkpoint it is given with the one being
served before the engine reads any weight: vLLM's ``reload_weights`` loads
whatever a checkpoint has and keeps the old values of every weight it lacks
(it only logs them), so a torn or partial save would be served as a mix of
old and new weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from prorl_cli.exceptions import InferenceError

#: Longest safetensors header read (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in the ``*.safetensors`` files of ``directory``; ``None`` when it has none
    (a checkpoint in another format, which this module cannot read cheaply).

    Raises :class:`InferenceError` naming a file whose header cannot be read.
    """
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= MAX_HEADER_BYTES:
                    raise ValueError(f"header length {size}")
                header = json.loads(f.read(size))
            for name, meta in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(int(n) for n in meta["shape"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InferenceError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return shapes


def reload_problems(served: dict[str, tuple[int, ...]] | None, incoming: dict[str, tuple[int, ...]] | None) -> list[str]:
    """Why a checkpoint of ``incoming`` tensors (:func:`tensor_shapes`) cannot replace ``served`` whole: tensors
    it lacks, or has in another shape ([] when it can, or when either is unknown and cannot be compared)."""
    if served is None or incoming is None:
        return []
    problems = [f"missing {name}" for name in sorted(served.keys() - incoming.keys())]
    problems += [f"{name}: shape {incoming[name]}, served {served[name]}"
                 for name in sorted(served.keys() & incoming.keys()) if incoming[name] != served[name]]
    return problems
