#!/usr/bin/env bash
# The GPU checks and benchmarks, one phase per invocation, from the repository root, in a shell
# whose Python imports torch and SGLang 0.5.17 (scripts/README.md):
#   bash scripts/gpu_run.sh tree      # tree stage incl. the fused Triton builder             (~2 min)
#   bash scripts/gpu_run.sh micro     # dense layers by verify rows, tree build, attention tiles (~5 min)
#   bash scripts/gpu_run.sh kernel    # tree-attention kernel vs float32, verify-attention timings (~5 min)
#   bash scripts/gpu_run.sh e2e       # real-server checks vs plain SGLang (ARMS=..., E2E_ARGS=...) (~8 min)
#   bash scripts/gpu_run.sh features  # grammars, logprobs, mixed batch vs plain SGLang (SECTIONS=...,
#                                     # DDTREE_ENV=SGLANG_DDTREE_GRAMMAR=path,...) (~6 min)
#   bash scripts/gpu_run.sh grammar   # structured output under load, DDTREE grammar methods vs DFLASH
#                                     # and plain (GRAMMAR_ARGS=... for benchmarks/grammar_serve.py)
#   bash scripts/gpu_run.sh rel       # reliability edges vs plain SGLang, 4 servers          (~8 min)
#   bash scripts/gpu_run.sh bench     # serving benchmark on the testbed pair                 (~5 min)
#   ARMS=no-spec,dflash,ddtree-b32 bash scripts/gpu_run.sh cost     # cost mode, Qwen3-8B shapes
#   ARMS=dflash,ddtree-b15 bash scripts/gpu_run.sh profile          # per-step kernel table, 8B shapes
#   CONFIG=configs/testbed_profile.yaml bash scripts/gpu_run.sh profile  # ... on the testbed pair
#   bash scripts/gpu_run.sh pair      # two replicas on one GPU (multi-replica path)           (~5 min)
#   bash scripts/gpu_run.sh evidence  # the next slices of configs/evidence.yaml that lack committed
#                                     # results, within one device call (ONLY=slice,ids to pick)
#   CONFIG=configs/testbed_verdict.yaml CONC=16,32,64 bash scripts/gpu_run.sh auto
#                                     # a serving config, one slice of concurrency levels
# OUT (default /tmp/out) receives the results; server logs are packed into one tarball per
# phase.  LIMIT (seconds) bounds a phase; its servers are stopped when it runs out.
# Only the servers this invocation started are ever stopped (the machine may be shared): every
# launch records its process group in $DDTREE_SERVER_PIDS (ddtree_bench/server.py), and on exit
# the groups still alive there are stopped; servers of other users or runs are left alone.
set -uo pipefail
source scripts/checkout_env.sh || exit 1
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
LIMIT="${LIMIT:-560}"   # seconds; the script stops its servers on SIGTERM
mkdir -p "$OUT"
DDTREE_SERVER_PIDS="$(mktemp "${TMPDIR:-/tmp}/ddtree-servers.XXXXXX")" || exit 1
export DDTREE_SERVER_PIDS
stop_own_servers() {
    [ -f "$DDTREE_SERVER_PIDS" ] || return 0
    python -m ddtree_bench.server stop-recorded "$DDTREE_SERVER_PIDS"
    rm -f "$DDTREE_SERVER_PIDS"
}
trap stop_own_servers EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
# Triton kernels compiled by an earlier run (opt-in): with .tcache/triton_cache.tar.xz present,
# servers skip most of the 1-1.5 min of kernel compilation a fresh machine spends;
# SAVE_TRITON_CACHE=1 writes this run's cache (cubins and metadata only) to
# $OUT/triton_cache.tar.xz.  Triton keys entries by source and target, so a stale archive is
# only slower, never wrong.
TRITON_CACHE="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
if [ -f .tcache/triton_cache.tar.xz ]; then
    mkdir -p "$TRITON_CACHE" && tar -xJf .tcache/triton_cache.tar.xz -C "$TRITON_CACHE" \
        && echo "triton cache: $(find "$TRITON_CACHE" -name '*.cubin' | wc -l) kernels restored"
fi
# FlashInfer compiles its kernels on first use too (about 100 s); its JIT folder is kept the same
# way, as .tcache/flashinfer_cache.tar.xz.
FI_CACHE="$HOME/.cache/flashinfer"
if [ -f .tcache/flashinfer_cache.tar.xz ]; then
    mkdir -p "$FI_CACHE" && tar -xJf .tcache/flashinfer_cache.tar.xz -C "$FI_CACHE" \
        && echo "flashinfer cache: $(find "$FI_CACHE" -name '*.so' | wc -l) modules restored"
fi
save_triton_cache() {
    [ "${SAVE_TRITON_CACHE:-0}" = 1 ] || return 0
    [ -d "$TRITON_CACHE" ] && (cd "$TRITON_CACHE" && find . -type f \( -name '*.cubin' -o -name '*.json' \) \
        | tar -cJf "$OUT/triton_cache.tar.xz" -T -) && ls -l "$OUT/triton_cache.tar.xz"
    [ -d "$FI_CACHE" ] && (cd "$FI_CACHE" && find . -type f -name '*.so' \
        | tar -cJf "$OUT/flashinfer_cache.tar.xz" -T -) && ls -l "$OUT/flashinfer_cache.tar.xz"
    return 0
}
pack() { [ -d "$1/logs" ] && tar czf "$1/logs.tgz" -C "$1" logs && rm -rf "$1/logs"; }
rc=  # a phase's exit status: its check's or benchmark's, never the log packing's
case "${1:-}" in
  tree)  timeout "$LIMIT" python benchmarks/tree_build.py --out "$OUT/tree_build_h200.json" \
             --batches 1,8,32,64 --budgets 16,32,64,128,256 --iters 100 --heap-reps 2 ;;
  kernel) timeout 180 python tests/tree_attention_interpret_check.py --device cuda 2>&1 | tail -5
         timeout 360 python benchmarks/verify_attention.py --out "$OUT/verify_attention.json" | tail -24 ;;
  micro) timeout 120 python benchmarks/verify_gemm.py --out "$OUT/verify_gemm.json" | tail -20
         timeout 200 python benchmarks/tree_build.py --out "$OUT/tree_build_h200.json" \
             --batches 1,8,32,64 --budgets 16,32,64,128,256 --iters 50 --heap-reps 1 | tail -24
         timeout 250 python benchmarks/verify_attention.py --out "$OUT/verify_attention.json" | tail -24 ;;
  e2e)   timeout "$LIMIT" python tests/gpu/e2e_server.py --out "$OUT/e2e" ${E2E_ARGS:-} \
             --arms ${ARMS:-ddtree_triton,ddtree_b15auto,ddtree_single,ddtree_flashinfer,plain_triton,plain_flashinfer}; rc=$?
         mkdir -p "$OUT/e2e/logs" && mv "$OUT"/e2e/server_*.log "$OUT/e2e/logs/" 2>/dev/null; pack "$OUT/e2e" ;;
  features) timeout "$LIMIT" python tests/gpu/features.py --out "$OUT/features" ${SECTIONS:+--sections $SECTIONS} \
             ${DDTREE_ENV:+--ddtree-env $DDTREE_ENV}; rc=$?
         mkdir -p "$OUT/features/logs" && mv "$OUT"/features/server_*.log "$OUT/features/logs/" 2>/dev/null; pack "$OUT/features" ;;
  grammar) timeout "$LIMIT" python benchmarks/grammar_serve.py --out "$OUT/grammar" ${GRAMMAR_ARGS:-}; rc=$?
         pack "$OUT/grammar" ;;
  rel)   timeout "$LIMIT" python tests/gpu/reliability.py --out "$OUT/rel" ${PHASES:+--phases $PHASES}; rc=$?
         mkdir -p "$OUT/rel/logs" && mv "$OUT"/rel/server_*.log "$OUT/rel/logs/" 2>/dev/null; pack "$OUT/rel" ;;
  bench) timeout "$LIMIT" python benchmarks/serve_bench.py --config configs/h200_testbed.yaml --out "$OUT/bench"; rc=$?
         pack "$OUT/bench" ;;
  cost)  timeout "$LIMIT" python benchmarks/serve_bench.py --config ${CONFIG:-configs/h200_cost_qwen3_8b.yaml} \
             --out "$OUT/cost" ${ARMS:+--arms $ARMS}; rc=$?
         pack "$OUT/cost" ;;
  profile) timeout "$LIMIT" python benchmarks/serve_bench.py --config ${CONFIG:-configs/h200_profile_qwen3_8b.yaml} \
             --out "$OUT/profile" ${ARMS:+--arms $ARMS}; rc=$?
         rm -rf "$OUT/profile/traces"; pack "$OUT/profile" ;;
  auto)  timeout "$LIMIT" python benchmarks/serve_bench.py --config ${CONFIG:-configs/testbed_verdict.yaml} \
             --out "$OUT/auto" ${ARMS:+--arms $ARMS} ${CONC:+--concurrency $CONC} \
             ${GRAPH_BS:+--cuda-graph-max-bs $GRAPH_BS}; rc=$?
         pack "$OUT/auto" ;;
  evidence) timeout "$LIMIT" python benchmarks/evidence.py run --out "$OUT" \
             --seconds "${EVIDENCE_SECONDS:-520}" ${ONLY:+--only $ONLY} ;;
  pair)  timeout "$LIMIT" python benchmarks/serve_bench.py --config configs/two_replicas_one_gpu.yaml --out "$OUT/pair"; rc=$?
         pack "$OUT/pair" ;;
  *)     echo "usage: bash scripts/gpu_run.sh micro|tree|kernel|e2e|features|grammar|rel|bench|cost|profile|auto|evidence|pair" >&2; exit 2 ;;
esac
last=$?
rc=${rc:-$last}
save_triton_cache
exit $rc
