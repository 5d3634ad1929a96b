#!/usr/bin/env bash
# Run shardkit's tests against one torch release in a throw-away virtual environment.
#
#   tools/torch_matrix.sh VERSION [PYTEST ARGS...]
#
# VERSION is a torch release (2.11.0). With no pytest arguments the whole suite runs. The venv lives outside the
# repository, in ${TORCH_MATRIX_ROOT:-/tmp/shardkit-torch-matrix}/torch-VERSION, and is reused by later runs.
# Releases other than the CPU file on this machine come from PyPI as CUDA builds (several GB with their nvidia
# libraries): this script is for people and sessions, never for CI.
#
# Output: pytest's own output, then one line "torch-matrix VERSION rc=N" and a log under the venv folder.
# Environment: TORCH_MATRIX_ROOT (venv parent), TORCH_MATRIX_NICE (niceness, default 19, so it yields the CPU),
# TORCH_MATRIX_TIMEOUT (seconds for pytest, default 7200), PYTHON (interpreter that builds the venv, default python3).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 TORCH_VERSION [PYTEST ARGS...]" >&2
  exit 2
fi
version=$1; shift
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${TORCH_MATRIX_ROOT:-/tmp/shardkit-torch-matrix}
venv="$root/torch-$version"
nice_level=${TORCH_MATRIX_NICE:-19}
py=${PYTHON:-python3}
mkdir -p "$root"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')"; then
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # A machine-wide pip configuration may cap torch with a constraint file; the version asked for here is explicit,
  # so this venv's installs read no configuration file (a local wheel folder is still searched when there is one).
  export PIP_CONFIG_FILE=/dev/null
  if [ -d /opt/wheels ]; then export PIP_FIND_LINKS=/opt/wheels; fi
  nice -n "$nice_level" "$venv/bin/python" -m pip install -q "torch==$version"
  # The project's other dependencies; torch is already there, so nothing here may replace it.
  nice -n "$nice_level" "$venv/bin/python" -m pip install -q "torch==$version" "tqdm>=4.60" "safetensors>=0.4" \
    "pytest>=7" "pytest-timeout>=2.1" "lightning>=2.0" "transformers>=4.40" "matplotlib>=3.5" numpy
fi
"$venv/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda build', torch.version.cuda)"
log="$venv/pytest-$(date +%Y%m%d-%H%M%S).log"
if [ $# -eq 0 ]; then set -- tests; fi
set +e
# src/ on the path rather than an install: the venv can test any checkout without rebuilding.
( cd "$repo" && PYTHONPATH="$repo/src" timeout "${TORCH_MATRIX_TIMEOUT:-7200}" nice -n "$nice_level" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" ) 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
echo "torch-matrix $version rc=$rc log=$log"
exit "$rc"
