#!/usr/bin/env bash
# GPU tests and benchmarks from a checkout on a CUDA machine, without installing ttr (run from the
# repository root):
#   bash scripts/device_check.sh tests [PYTEST_ARGS...]   -> pytest -m gpu, log in $OUT/gpu_tests.log
#   bash scripts/device_check.sh bench MODULE [ARGS...]   -> MODULE's main(ARGS), log in $OUT/<module>.log
# Makes `import ttr` resolve to this checkout, and installs the wheels placed in .whl (fla 0.6.0
# for the side-by-side benchmarks, on machines without a package index) into /tmp/site.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ttr_out}
mkdir -p "$OUT" /tmp/ttr_pkg
ln -sfn "$PWD" /tmp/ttr_pkg/ttr
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# .whl/ref: reference packages carried as source (mamba_ssm's Triton kernels, for HF Mamba2)
export PYTHONPATH=/tmp/ttr_pkg:/tmp/site:$PWD/.whl/ref
mode=${1:-tests}; shift || true
case "$mode" in
  tests)
    python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" "$@" 2>&1 | tee -a "$OUT/gpu_tests.log"
    ;;
  bench)
    mod=$1; shift
    # through main() rather than `python -m`, so a module that is also imported by name (as the
    # benchmarks import bench_utils) is loaded once, not a second time as __main__
    python3 -c "import sys; from $mod import main; sys.exit(main(sys.argv[1:]) or 0)" "$@" 2>&1 | tee -a "$OUT/${mod##*.}.log"
    ;;
  *) echo "usage: $0 tests|bench ..." >&2; exit 2 ;;
esac
