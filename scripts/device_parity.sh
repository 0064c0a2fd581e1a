#!/usr/bin/env bash
# Quality parity on a lent GPU (run through the device tool from the repository root, with the
# fla wheels in .whl): encodes the data once, then trains every FAMILY.IMPL named in $RUNS as
# concurrent processes on the one GPU (the losses do not depend on the sharing; the tokens/s they
# print then do, so the parity table leaves them out).
#   RUNS="gated_deltanet.ttr gated_deltanet.reference" bash scripts/device_parity.sh [bench_parity args...]
# PARITY_SITE=DIR puts DIR first on the runs' path (another Triton for the reference, say).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ttr_out}
mkdir -p /tmp/ttr_pkg "$OUT/parity"
ln -sfn "$PWD" /tmp/ttr_pkg/ttr
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
# .whl/ref: reference packages carried as source (the Triton kernels of mamba_ssm, for HF Mamba2)
export PYTHONPATH=${PARITY_SITE:+$PARITY_SITE:}/tmp/ttr_pkg:/tmp/site:$PWD/.whl/ref
bench() { python3 -W ignore -m ttr.scripts.bench_parity --out "$OUT/parity" --data-cache /tmp/parity.npz "$@"; }
bench --prepare-only "$@" 2>&1 | tail -3
# FAMILY.IMPL@SEED draws that run's initial weights with SEED (--init-seed; the data order stays;
# it writes FAMILY.IMPL.initSEED.json)
for run in $RUNS; do
  f=${run%%.*} i=${run#*.} seed=()
  if [[ $i == *@* ]]; then seed=(--init-seed "${i#*@}"); i=${i%@*}; fi
  (bench --families "$f" --impls "$i" "${seed[@]}" "$@" 2>&1 | grep --line-buffered -v Writing | sed -u "s/^/[$run] /" >>"$OUT/train.log") &
done
# OP_ERRORS="delta_net gla": the op's bf16 error on the inputs of a model trained 100 steps, ttr's and fla's
for family in ${OP_ERRORS:-}; do
  (bench --op-errors 100 --families "$family" "$@" 2>&1 | grep --line-buffered -v Writing | sed -u "s/^/[op-errors] /" >>"$OUT/train.log") &
done
wait
grep -E "step (5|10)00|gradient check|op-errors|Error" "$OUT/train.log" | tail -40
bench --report "$OUT/parity"
