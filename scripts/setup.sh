#!/usr/bin/env bash
# Create a virtual environment and install mmrl with the extras the tests and demo need.
# Usage: bash scripts/setup.sh [dev|newest|<extras>]
#   dev (default): .venv, Python 3.12, lerobot 0.6.1's stack (torch 2.11, transformers 5.5), every domain.
#   newest:        .venv-newest, Python 3.11, the newest stack (scripts/stacks/newest.txt), every
#                  domain but the robot ones (lerobot pins an older torch).
#   other extras:  .venv with those extras, e.g. 'vision,video'.
set -euo pipefail
cd "$(dirname "$0")/.."
LANE="${1:-dev}"
VENV=.venv PY_MINOR=12 EXTRAS="$LANE" CONSTRAINTS=()
if [ "$LANE" = newest ]; then
  # Python 3.11: this machine's registry has torch 2.14.1 for it on local disk.
  VENV=.venv-newest PY_MINOR=11 CONSTRAINTS=(-c scripts/stacks/newest.txt)
fi
find_python() {
  for c in "python3.$PY_MINOR" $HOME/.pyenv/versions/3.$PY_MINOR.*/bin/python3.$PY_MINOR; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; assert sys.version_info[:2] == (3, $PY_MINOR)" 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}
if [ ! -x $VENV/bin/python ] || ! $VENV/bin/python -c "import sys; assert sys.version_info[:2] == (3, $PY_MINOR)" 2>/dev/null; then
  PY=$(find_python) || { echo "the '$LANE' lane needs Python 3.$PY_MINOR; install it, e.g. 'pyenv install 3.$PY_MINOR'" >&2; exit 1; }
  rm -rf $VENV
  "$PY" -m venv $VENV
fi
# pip's and setuptools' chatter (an editable-install notice, registry mirror warnings) goes to a
# log; it is shown only if the install fails.
log=$VENV/install.log
if ! { $VENV/bin/python -m pip install -q --upgrade pip && $VENV/bin/python -m pip install -q "${CONSTRAINTS[@]}" -e ".[${EXTRAS}]"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup: pip install failed (log above, kept in $log)" >&2
  exit 1
fi
$VENV/bin/python -c "import mmrl, torch, transformers; print('mmrl ready: torch', torch.__version__, 'transformers', transformers.__version__)"
