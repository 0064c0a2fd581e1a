#!/usr/bin/env bash
# GPU tests and benchmarks from a checkout on a CUDA machine, without installing ttr (run from the
# repository root):
#   bash scripts/device_check.sh tests [PYTEST_ARGS...]   -> pytest -m gpu, log in $OUT/gpu_tests.log
#   bash scripts/device_check.sh bench MODULE [ARGS...]   -> MODULE's main(ARGS), log in $OUT/<module>.log
# TIME_LIMIT=SECONDS ends the command by SIGINT at that time, sent to pytest (or the module) itself,
# so pytest still prints its summary with the names of the tests that failed so far (a `timeout`
# around this script would stop the shell and the log would end without it); the exit status is
# then 124, else the command's own. pytest runs quiet unless PYTEST_ARGS ask for -v.
# Makes `import ttr` resolve to this checkout, and installs the wheels placed in .whl (fla 0.6.0
# for the side-by-side benchmarks, on machines without a package index) into /tmp/site.
set -u
TIME_LIMIT=${TIME_LIMIT:-}
if [ -n "$TIME_LIMIT" ] && ! [[ "$TIME_LIMIT" =~ ^[1-9][0-9]*$ ]]; then
  echo "device_check.sh: TIME_LIMIT must be a whole number of seconds, got '$TIME_LIMIT'" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ttr_out}
mkdir -p "$OUT" /tmp/ttr_pkg
ln -sfn "$PWD" /tmp/ttr_pkg/ttr
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# .whl/ref: reference packages carried as source (mamba_ssm's Triton kernels, for HF Mamba2)
export PYTHONPATH=/tmp/ttr_pkg:/tmp/site:$PWD/.whl/ref
limited() {
  if [ -n "$TIME_LIMIT" ]; then timeout -s INT --kill-after=30 "$TIME_LIMIT" "$@"; else "$@"; fi
}
mode=${1:-tests}; shift || true
case "$mode" in
  tests)
    quiet=-q
    for a in "$@"; do case "$a" in -v|-vv|-vvv|--verbose) quiet="" ;; esac; done
    # $quiet is one word or none
    # shellcheck disable=SC2086
    limited python3 -m pytest -m gpu $quiet -p no:cacheprovider -o addopts="-ra" "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
    exit "${PIPESTATUS[0]}"
    ;;
  bench)
    mod=$1; shift
    # through main() rather than `python -m`, so a module that is also imported by name (as the
    # benchmarks import bench_utils) is loaded once, not a second time as __main__
    limited python3 -c "import sys; from $mod import main; sys.exit(main(sys.argv[1:]) or 0)" "$@" 2>&1 | tee -a "$OUT/${mod##*.}.log"
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "usage: $0 tests|bench ..." >&2; exit 2 ;;
esac
