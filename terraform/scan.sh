#!/usr/bin/env bash
# Scan this terraform module with checkov, offline, from a virtualenv of its own (checkov is not
# one of the project's dependencies: it pins versions of libraries the project also uses).
#
#   terraform/scan.sh            # creates the virtualenv on first use, then scans
#
# The virtualenv is $HETEROPLANE_CHECKOV_VENV, by default ~/.cache/heteroplane/checkov-venv
# ($XDG_CACHE_HOME is honoured). --skip-download: no policies or metadata are fetched, so the
# scan runs without a network once checkov is installed. Every check either passes or is
# suppressed in the code with a reason (#checkov:skip=CKV_...:why); a failed check fails this
# script (exit status 1).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
venv="${HETEROPLANE_CHECKOV_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/heteroplane/checkov-venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/checkov" ]; then
  echo "installing checkov into $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet 'checkov>=3.2,<4'
fi

exec "$venv/bin/checkov" --directory "$here" --skip-download --quiet --compact "$@"
