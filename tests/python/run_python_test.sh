#!/usr/bin/env bash
# Runs tests/python/test_engine.py against an installed strata: installs the
# build into a fresh prefix and imports the binding from there (PYTHONPATH =
# <prefix>/<libdir>/strata/python, which finds the library beside it), alone
# and under `strata run -n 2`. Needs numpy (Debian's python3-numpy; scripts/setup
# installs it): the first of /usr/bin/python3, python3 that imports it runs.
set -euo pipefail
build_dir="$1"; source_dir="$2"
python=""
for candidate in /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import numpy" 2>/dev/null; then
    python="$candidate"; break
  fi
done
[ -n "$python" ] || { echo "run_python_test: no python3 with numpy; run scripts/setup (python3-numpy)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
package="$(find "$work/prefix" -path '*/strata/python/strata/__init__.py' | head -n 1)"
[ -n "$package" ] || { echo "run_python_test: the Python package was not installed" >&2; exit 1; }
export PYTHONPATH="$(dirname "$(dirname "$package")")"
unset STRATA_LIBRARY STRATA_PREFIX
export PYTHONDONTWRITEBYTECODE=1
echo "== one rank"
"$python" "$source_dir/tests/python/test_engine.py"
echo "== two ranks"
"$work/prefix/bin/strata" run -n 2 -- "$python" "$source_dir/tests/python/test_engine.py"
