#!/usr/bin/env bash
# Train several testbed candidates side by side in one run (the models are tiny, so
# one GPU runs them together), sharing one tokenizer and token cache so they are comparable:
#
#   VARIANTS="a:--target-layers 4 --draft-layers 1 --taps 1,2;b:--target-layers 3 --draft-layers 2 --taps 0,1" \
#   COMMON="--corpus all --gen-seqs 16384 --gen-batch 2048 --drafter-batch 128" \
#   bash scripts/gpu_train.sh
#
# Flags that must hold for every candidate and the shared tokenizer (--corpus, --init-from) go
# in COMMON.  Each candidate's log is written straight to $OUT/<name>.log (so a run cut short
# still returns it) and its exported testbed/ to $OUT/<name>.tgz.  Evaluate a
# candidate afterwards with scripts/eval_testbed.py (the reference loop runs on CPU too).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
LIMIT="${LIMIT:-560}"   # seconds for the whole call; candidates are stopped before it ends
WORK="${WORK:-/tmp/testbed_runs}"
COMMON="${COMMON:-}"
: "${VARIANTS:?set VARIANTS to 'name:flags;name:flags'}"
start=$(date +%s)
mkdir -p "$OUT" "$WORK/shared"
# shellcheck disable=SC2086
python scripts/train_testbed.py --work "$WORK/shared/work" --out "$WORK/shared/tb" --tokenize-only \
    $COMMON > "$OUT/tokenize.log" 2>&1 || { tail -n 20 "$OUT/tokenize.log"; exit 1; }
IFS=';' read -ra specs <<< "$VARIANTS"
names=()
for spec in "${specs[@]}"; do
    name="${spec%%:*}"; flags="${spec#*:}"
    left=$(( LIMIT - 25 - ($(date +%s) - start) ))
    if (( left < 60 )); then   # later candidates would have even less: start none of them
        echo "gpu_train.sh: ${left}s of LIMIT=${LIMIT} left, $name and later candidates not started; raise LIMIT" >&2
        break
    fi
    names+=("$name")
    mkdir -p "$WORK/$name/work" "$WORK/$name/tb/target"
    cp "$WORK/shared/work/tokens.pt" "$WORK/$name/work/"
    cp "$WORK"/shared/tb/target/* "$WORK/$name/tb/target/"
    # shellcheck disable=SC2086
    timeout "$left" python scripts/train_testbed.py --work "$WORK/$name/work" --out "$WORK/$name/tb" \
        $COMMON $flags --finish-by $(( start + LIMIT - 25 )) > "$OUT/$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
    tar czf "$OUT/$name.tgz" -C "$WORK/$name" tb
    echo "== $name: $(grep -E 'held-out loss|top-1 accuracy by position|exported|Error' "$OUT/$name.log" | tr '\n' ' ')"
done
