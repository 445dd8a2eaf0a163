#!/usr/bin/env bash
# Installs the built strata into a fresh prefix, builds tests/install/consumer
# against it with find_package(strata), and runs it.
set -euo pipefail
build_dir="$1"; source_dir="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$source_dir/tests/install/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/consumer"
