#!/usr/bin/env bash
# The GPU checks: run on a machine with a CUDA GPU, from a checkout (prorl from the tree,
# on PYTHONPATH). Prints what it measured; record the figures in docs/benchmarks.md with the
# GPU's name. Nothing in CI needs it.
#
#   scripts/gpu_check.sh --prepare    # here, with a package index: wheels for a GPU machine
#                                     # without one (Python 3.12, x86_64) into .whl/gpu
#   scripts/gpu_check.sh OUT          # there: installs .whl/gpu if present, then
#     1. the transformers engine (a bridge's engine) on CUDA against the CPU, tokens/s;
#     2. examples/train_tiny_grpo.py --short --device auto (the policy trains on the GPU);
#     3. examples/train_trl_grpo.py --short --device auto (TRL on the GPU through rollout_func,
#        weights reloaded into the bridge in place).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-python3}"
if [ "${1:-}" = --prepare ]; then
  # Only what such a machine lacks (it ships torch, transformers, accelerate, pyarrow, ...).
  "$py" -m pip download -q --no-deps -d .whl/gpu --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    pyzmq submitit cloudpickle spython "trl==1.16.0" datasets dill multiprocess xxhash
  ls -la .whl/gpu
  exit 0
fi
out="${1:?usage: scripts/gpu_check.sh OUT | --prepare}"
mkdir -p "$out"
if [ -d .whl/gpu ]; then
  "$py" -m pip install -q --no-index --no-deps --find-links .whl/gpu .whl/gpu/*.whl || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
missing=$("$py" - <<'PY'
import importlib.util
need = ["torch", "transformers", "zmq", "msgpack", "click", "submitit", "spython", "yaml", "rich", "jinja2",
        "trl", "datasets", "pyarrow"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing modules: $missing (carry wheels: scripts/gpu_check.sh --prepare)" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" - "$out" <<'PY'
import asyncio, sys, time
from pathlib import Path
import torch
from prorl_cli.inference.device import resolve_device
from prorl_cli.inference.tiny_model import make_tiny_model
from prorl_cli.inference.transformers_engine import TransformersEngine
from prorl_cli.protocol import SamplingParams

print("gpu_check: torch", torch.__version__, "| auto ->", resolve_device("auto"),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
model = make_tiny_model(Path(sys.argv[1]) / "tiny-model")

async def rate(device: str) -> float:
    engine = TransformersEngine(model, device=device, backend_id=device)
    await engine.start()
    sampling = SamplingParams(max_tokens=128, temperature=1.0, ignore_eos=True, seed=0)
    await engine.generate(list(range(10, 60)), sampling)  # warm-up
    started, tokens = time.perf_counter(), 0
    for i in range(8):
        gen = await engine.generate(list(range(10 + i, 60 + i)), sampling)
        tokens += len(gen.output_ids)
    await engine.close()
    return tokens / (time.perf_counter() - started)

cpu = asyncio.run(rate("cpu"))
print(f"gpu_check: transformers engine, tiny model, 128-token decodes: cpu {cpu:.0f} tok/s")
if torch.cuda.is_available():
    gpu = asyncio.run(rate("cuda"))
    print(f"gpu_check: transformers engine on cuda {gpu:.0f} tok/s ({gpu / cpu:.2f}x the CPU)")
PY
for example in train_tiny_grpo train_trl_grpo; do
  start=$SECONDS
  "$py" "examples/$example.py" --short --device auto --out "$out/$example" 2>&1 | tee "$out/$example.log" \
    | grep -E "training on|held-out reward|reward curve|warm-up:|Error|error" || true
  echo "gpu_check: $example --short: rc ${PIPESTATUS[0]}, $((SECONDS - start)) s"
done
