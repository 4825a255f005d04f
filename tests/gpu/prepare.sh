#!/usr/bin/env bash
# Packs, here, what tests/gpu/validate.py needs on the GPU machine that `device` lends (torch and
# transformers there, no registry, no network): the project's pinned packages it lacks as wheels,
# and the embedded model's GGUF file in parts that fit one call each beside the working tree, all
# under tests/gpu/carry/ (ignored by git). It ends by printing the device calls to make, in order.
#
#   tests/gpu/prepare.sh                       # wheels and the embedded model
#   tests/gpu/prepare.sh --no-model            # wheels only: tiny models and a SmolLM2-shaped random one
#   tests/gpu/prepare.sh --without transformers,tokenizers   # use the machine's own versions
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" tests/gpu/pack.py "$@"
