#!/usr/bin/env bash
# The C API from an installed strata, as an outside C project uses it:
# installs the build into a fresh prefix; builds examples/embed with
# find_package(strata) (CMake, a C-only project) and with pkg-config (its
# Makefile); runs the example alone and under `strata run -n 2` (ZeRO-3, NVMe
# offload; each run exits non-zero unless its loss fell) and checks that both
# give the same losses; resumes the example from a checkpoint (30 steps, saved,
# then on to 40, alone and on two ranks) and checks that the resumed losses are
# exactly the uninterrupted run's; builds tests/install/capi_errors.c with
# pkg-config and runs it alone and on two ranks, and tests/install/capi_hooks.c
# (the 0.3 additions) likewise. Prints "embed: ok" at the end.
set -euo pipefail
build_dir="$1"; source_dir="$2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
prefix="$work/prefix"
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
strata="$prefix/bin/strata"
pc_file="$(find "$prefix" -name strata.pc -path '*/pkgconfig/*' | head -n 1)"
[ -n "$pc_file" ] || { echo "embed_test: strata.pc was not installed" >&2; exit 1; }
export PKG_CONFIG_PATH="$(dirname "$pc_file")"
[ -f "$prefix/include/strata/runtime/capi/strata.h" ] || { echo "embed_test: strata.h was not installed" >&2; exit 1; }

echo "== examples/embed with find_package(strata)"
cmake -S "$source_dir/examples/embed" -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$work/cmake" >/dev/null

echo "== examples/embed with pkg-config ($(pkg-config --modversion strata))"
mkdir -p "$work/pc"
make -s -C "$source_dir/examples/embed" OUT="$work/pc" CFLAGS="-O2 -Werror" >/dev/null

echo "== one rank (CMake build)"
"$work/cmake/embed_mlp" 40 | tee "$work/alone.txt"
echo "== two ranks (CMake build)"
"$strata" run -n 2 -- "$work/cmake/embed_mlp" 40 | tee "$work/two.txt"
echo "== one rank (pkg-config build)"
"$work/pc/embed_mlp" 40 | tee "$work/pc.txt"
# N ranks sum to the one-rank gradient: the loss curves agree (up to the order of float sums).
losses() { sed -n 's/.*step \+\([0-9]\+\) \+loss \([0-9.]\+\).*/\1 \2/p' "$1"; }
paste <(losses "$work/alone.txt") <(losses "$work/two.txt") <(losses "$work/pc.txt") | awk '
  { n++; for (i = 4; i <= 6; i += 2) if (($i - $2) > 2e-3 * $2 || ($2 - $i) > 2e-3 * $2) { bad = 1; print "differs: " $0 } }
  END { if (n < 4 || bad) { print "embed_test: loss curves differ or are missing (" n " steps)"; exit 1 } }'

# Resuming from a checkpoint continues the run exactly: steps 31..40 print the
# losses of the uninterrupted run, digit for digit, and the final fc2.bias[0]
# (9 significant digits) is the same (same number of ranks).
echo "== resume from a checkpoint: 30 steps, saved, then on to 40 (one rank, then two)"
"$work/cmake/embed_mlp" 30 "$work/ckpt1" >/dev/null
"$work/cmake/embed_mlp" 40 "$work/ckpt1" | tee "$work/resumed1.txt"
"$strata" run -n 2 -- "$work/cmake/embed_mlp" 30 "$work/ckpt2" >/dev/null
"$strata" run -n 2 -- "$work/cmake/embed_mlp" 40 "$work/ckpt2" | tee "$work/resumed2.txt"
grep -q "resumed from $work/ckpt1 at step 30" "$work/resumed1.txt"
grep -q "resumed from $work/ckpt2 at step 30" "$work/resumed2.txt"
final() { sed -n 's/.*fc2\.bias\[0\] = \([-0-9.e]\+\).*/\1/p' "$1"; }
for pair in "alone resumed1" "two resumed2"; do
  set -- $pair
  want="$(losses "$work/$1.txt" | awk '$1 > 30'; final "$work/$1.txt")"
  got="$(losses "$work/$2.txt"; final "$work/$2.txt")"
  if [ "$(printf '%s\n' "$got" | wc -l)" -lt 3 ] || [ "$want" != "$got" ]; then
    echo "embed_test: the resumed run ($2) differs from the uninterrupted one ($1):"; echo "$want"; echo "--"; echo "$got"
    exit 1
  fi
done
[ -f "$work/ckpt1/step_00000040/manifest.json" ] || { echo "embed_test: no checkpoint of step 40" >&2; exit 1; }

echo "== C API contract (pkg-config build), one rank and two"
cc -std=c99 -Wall -Wextra -Wpedantic -Werror $(pkg-config --cflags strata) -o "$work/capi_errors" \
  "$source_dir/tests/install/capi_errors.c" $(pkg-config --libs strata) \
  -Wl,-rpath,"$(pkg-config --variable=libdir strata)" -lm
"$work/capi_errors"
"$strata" run -n 2 -- "$work/capi_errors"
echo "== the 0.3 hooks (any-order release, freeze, decay, device grads, clipping, evaluation), one rank and two"
cc -std=c99 -Wall -Wextra -Wpedantic -Werror $(pkg-config --cflags strata) -o "$work/capi_hooks" \
  "$source_dir/tests/install/capi_hooks.c" $(pkg-config --libs strata) \
  -Wl,-rpath,"$(pkg-config --variable=libdir strata)" -lm
"$work/capi_hooks"
"$strata" run -n 2 -- "$work/capi_hooks"
echo "embed: ok"
