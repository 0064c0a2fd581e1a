#!/usr/bin/env bash
# The benchmarks at the presets' shapes on a lent GPU, within a time budget (run from the repository
# root, with fla 0.6.0's wheels in .whl; scripts/device_check.sh installs them and points `ttr` at
# this checkout):
#   bash scripts/device_bench.sh                    kernels at the 1.3B presets' shapes, then every 1.3B
#                                                   preset end to end next to its reference
#   PARTS=model PRESETS=gla-1.3b bash scripts/device_bench.sh
# Parts (PARTS, comma-separated, in this order): kernels (ttr bench --shapes preset), uniform (ttr bench
# --shapes uniform: H=16, K=V=128), model (bench_model), decode (bench_model --decode, gated_deltanet-1.3b).
# Settings: BUDGET_S (seconds for everything, default 510: fits 9 minutes with the start-up), KERNELS_S
# (the kernels' share, default 180), ROUNDS (3: the kernel rows' turns of ttr and its reference; a row
# without a reference is timed once), PRESETS,
# SEQLENS, BATCH (8), SEQ_LEN (4096), STEPS (4), WARMUP (1),
# REFERENCES (1), ISOLATE (0; 1: each model in its own process), LIFT_FLA_GUARD (1: fla 0.6.0's gated
# backward runs on Hopper with Triton < 3.7.1 for timing only, fla issue #640, and the tables say so),
# DRY_RUN (1: print the commands only). Each part stops starting rows when its share is spent and lists
# the rest as skipped. Writes $OUT/{kernels,uniform,model,decode}.{md,json} and the logs; with references,
# the kernel parts first time ttr alone into $OUT/{kernels,uniform}-ttr.{md,json} (a third of their share).
set -u
OUT=${OUT:-/tmp/ttr_out}
PARTS=${PARTS:-kernels,model}
BUDGET_S=${BUDGET_S:-510}
KERNELS_S=${KERNELS_S:-180}
ROUNDS=${ROUNDS:-3}
PRESETS=${PRESETS:-}
SEQLENS=${SEQLENS:-2048,4096,8192,16384}
BATCH=${BATCH:-8} SEQ_LEN=${SEQ_LEN:-4096} STEPS=${STEPS:-4} WARMUP=${WARMUP:-1}
REFERENCES=${REFERENCES:-1} ISOLATE=${ISOLATE:-0} LIFT_FLA_GUARD=${LIFT_FLA_GUARD:-1} DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
start=$(date +%s)
# a dry run plans every part as if the ones before took no time, so its shares do not depend on when
# a clock second ticks
now() { if [ "$DRY_RUN" = 1 ]; then echo "$start"; else date +%s; fi; }
left() { echo $((BUDGET_S - ($(now) - start))); }
for part in ${PARTS//,/ }; do
  case "$part" in kernels|uniform|model|decode) ;; *) echo "PARTS: unknown part '$part' (kernels, uniform, model, decode)" >&2; exit 2 ;; esac
done

# every value below is one word, so the option strings are expanded unquoted on purpose
guard=""; [ "$LIFT_FLA_GUARD" = 1 ] && [ "$REFERENCES" = 1 ] && guard=--lift-fla-guard
presets=""; [ -n "$PRESETS" ] && presets="--presets $PRESETS"

# part NAME SECONDS MODULE ARGS...: MODULE's main(ARGS) under a hard limit of SECONDS (the script's own
# --time-budget ends it earlier, with its table written)
part() {
  local name=$1 secs=$2 module=$3
  shift 3
  if [ "$secs" -le 10 ]; then
    echo "== $name: skipped, the budget is spent" | tee -a "$OUT/device_bench.log"
    return 0
  fi
  echo "== $name (${secs} s): $module $*" | tee -a "$OUT/device_bench.log"
  [ "$DRY_RUN" = 1 ] && return 0
  OUT="$OUT" timeout --kill-after=15 "$secs" bash scripts/device_check.sh bench "$module" "$@"
  echo "== $name: exit $?, $(( $(date +%s) - start )) s since the start" | tee -a "$OUT/device_bench.log"
}

for p in ${PARTS//,/ }; do
  case "$p" in
    kernels|uniform)
      secs=$(left); [ "$secs" -gt "$KERNELS_S" ] && secs=$KERNELS_S
      shapes=preset; [ "$p" = uniform ] && shapes=uniform
      if [ "$REFERENCES" = 1 ]; then
        # ttr's rows alone first (seconds): the references' compile and autotune (fla's: minutes)
        # must not leave a cut budget without ttr's numbers
        ttr_secs=$((secs / 3))
        # shellcheck disable=SC2086
        part "$p-ttr" "$ttr_secs" ttr.scripts.bench_kernels --shapes $shapes $presets --seqlens "$SEQLENS" \
          --no-reference --time-budget $((ttr_secs - 20)) --out "$OUT/$p-ttr.md" --json "$OUT/$p-ttr.json"
        secs=$((secs - ttr_secs))
      fi
      refs=""; [ "$REFERENCES" = 1 ] || refs=--no-reference
      # shellcheck disable=SC2086
      part "$p" "$secs" ttr.scripts.bench_kernels --shapes $shapes $presets --seqlens "$SEQLENS" $refs $guard \
        --rounds "$ROUNDS" --time-budget $((secs - 30)) --out "$OUT/$p.md" --json "$OUT/$p.json"
      ;;
    model)
      secs=$(left)
      refs=--references; [ "$REFERENCES" = 1 ] || refs=--no-references
      iso=""; [ "$ISOLATE" = 1 ] && iso=--isolate
      # shellcheck disable=SC2086
      part model "$secs" ttr.scripts.bench_model $presets $refs $iso $guard --batch "$BATCH" --seq-len "$SEQ_LEN" \
        --steps "$STEPS" --warmup "$WARMUP" --time-budget $((secs - 60)) --out "$OUT/model.md" --json "$OUT/model.json"
      ;;
    decode)
      part decode "$(left)" ttr.scripts.bench_model --presets "${PRESETS:-gated_deltanet-1.3b}" --no-train --decode \
        --gen-len 256 --out "$OUT/decode.md" --json "$OUT/decode.json"
      ;;
  esac
done
for f in kernels-ttr kernels uniform-ttr uniform model decode; do
  [ -f "$OUT/$f.md" ] && { echo; cat "$OUT/$f.md"; }
done
exit 0
