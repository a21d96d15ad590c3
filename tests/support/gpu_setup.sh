#!/usr/bin/env bash
# Makes this checkout importable as metrale.* by another python (the GPU
# machine's, which has torch and transformers but no network), installing
# nothing into that python: what it lacks of the packages below comes from
# the wheels `make gpu-wheels` put in WHEELS, installed into SITE; and
# SITE/metrale/{cli,engine,lookup} link to the sources, the package-dir
# mapping of pyproject.toml. Then: PYTHONPATH=SITE PYTHON -m tests.support.gpu_check.
#
# usage: tests/support/gpu_setup.sh [PYTHON [WHEELS [SITE]]]
set -euo pipefail

PYTHON=${1:-python3}
WHEELS=${2:-build/gpu-wheels}
SITE=$(mkdir -p "${3:-build/gpu-site}" && cd "${3:-build/gpu-site}" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# import name:distribution, for what metrale's engine, CLI and tests import
# beyond torch and transformers (make gpu-wheels brings the first three).
NEEDED="llguidance:llguidance orjson:orjson gguf:gguf jinja2:jinja2 safetensors:safetensors
tokenizers:tokenizers numpy:numpy huggingface_hub:huggingface_hub typer:typer rich:rich yaml:pyyaml"

for module in torch transformers; do
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        echo "gpu_setup: $PYTHON cannot import $module; it must come with the machine" >&2
        exit 1
    fi
done

missing=()
for pair in $NEEDED; do
    if ! PYTHONPATH="$SITE" "$PYTHON" -c "import ${pair%%:*}" 2>/dev/null; then
        missing+=("${pair##*:}")
    fi
done
if ((${#missing[@]})); then
    echo "gpu_setup: installing ${missing[*]} from $WHEELS into $SITE"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --find-links "$WHEELS" --target "$SITE" "${missing[@]}"
fi

mkdir -p "$SITE/metrale"
for part in cli engine lookup; do
    ln -sfn "$ROOT/$part" "$SITE/metrale/$part"
done
PYTHONPATH="$SITE" "$PYTHON" -c "import metrale.engine.engine, metrale.cli.main"
echo "gpu_setup: metrale imports from $SITE ($("$PYTHON" --version))"
