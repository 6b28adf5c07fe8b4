#!/usr/bin/env bash
# Create .venv with Python 3.12 and install mmrl with the extras the tests and demo need.
# Usage: bash scripts/setup.sh [extras]   (default extras: dev)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev}"
find_python() {
  for c in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | tail -n 1 || true)
    if [ -n "$v" ]; then echo "$(pyenv root)/versions/$v/bin/python3.12"; return 0; fi
  fi
  return 1
}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  PY=$(find_python) || { echo "mmrl needs Python 3.12 (lerobot 0.6.1 requires it); install it, e.g. 'pyenv install 3.12'" >&2; exit 1; }
  rm -rf .venv
  "$PY" -m venv .venv
fi
# pip's and setuptools' chatter (an editable-install notice, registry mirror warnings) goes to a
# log; it is shown only if the install fails.
log=.venv/install.log
if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[${EXTRAS}]"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "setup: pip install failed (log above, kept in $log)" >&2
  exit 1
fi
.venv/bin/python -c "import mmrl, torch, transformers; print('mmrl ready: torch', torch.__version__, 'transformers', transformers.__version__)"
