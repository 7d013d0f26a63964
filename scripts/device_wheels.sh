#!/usr/bin/env bash
# Download, on a machine with the package index, the wheels that scripts/device_check.sh installs on a
# GPU machine that has Python 3.12 and torch but no Megatron and no network. They go to .whl/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
py=${PYTHON:-.venv/bin/python}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
  -r requirements/bridge-0.6.2.txt einops==0.8.2 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 tqdm==4.70.1 \
  safetensors==0.8.0 tokenizers==0.22.2 huggingface_hub==1.33.0 regex==2026.11.19 rich==15.0.0 \
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 hf-xet==1.8.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 \
  anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1 typer==0.29.2 shellingham==1.5.4 click==8.5.1 annotated-doc==0.0.7
ls -la .whl
