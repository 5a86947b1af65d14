#!/usr/bin/env bash
# Everything that needs CUDA, in one run (issue 13): see benchmarks/gpu_check.py for the sections and
# their step counts. Without a CUDA device it prints one SKIP line per section and exits 0.
#   bash benchmarks/gpu_check.sh [--only fp16,bf16,fsdp,overhead,scale] [--device cuda|cpu]
# PYTHON picks the interpreter (default: python3 of the active environment).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
