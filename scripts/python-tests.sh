#!/usr/bin/env bash
# The Python producer library's tests (clients/python), against the real `draftpipe` binary: a venv under
# target/ with numpy, pytest, torch and transformers from PyPI (torch from PyPI is the CUDA build, ~5.6 GB;
# it is installed once per venv and reused), the package installed from the tree, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet numpy pytest torch transformers
"$venv/bin/pip" install --quiet ./clients/python

cargo build --quiet --bin draftpipe
export DRAFTPIPE_BIN="$PWD/target/debug/draftpipe"

status=0
(cd clients/python && "../../$venv/bin/python" -m pytest -q) || status=$?
if [ "$status" -eq 5 ]; then
    echo "python-tests: pytest collected no tests in clients/python/tests (exit 5): they were not found" >&2
    exit 1
fi
exit "$status"
