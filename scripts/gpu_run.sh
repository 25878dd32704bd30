#!/usr/bin/env bash
# One device call per phase, from the repository root on the GPU machine (carry .device):
#   bash scripts/gpu_run.sh tree    # tree-stage benchmark incl. the Triton kernel   (~2 min)
#   bash scripts/gpu_run.sh e2e     # real-server checks: DDTREE triton / flashinfer / no-overlap + plain (~9 min)
#   bash scripts/gpu_run.sh bench   # serving benchmark on the testbed pair            (~9 min)
#   ARMS=no-spec,dflash,ddtree-b32 bash scripts/gpu_run.sh cost   # cost mode, Qwen3-8B shapes (split arms over calls)
#   bash scripts/gpu_run.sh pair    # two replicas on one GPU (multi-replica path)     (~5 min)
# Results land in $OUT (at most 8 files come back: logs are packed into one tarball).
set -uo pipefail
source scripts/device_env.sh
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
case "${1:-}" in
  tree)  python benchmarks/tree_build.py --out "$OUT/tree_build_h200.json" --iters 100 --heap-reps 3 ;;
  e2e)   python tests/gpu/e2e_server.py --out /tmp/e2e \
             --arms ddtree_triton,ddtree_flashinfer,ddtree_nooverlap,plain_triton
         cp /tmp/e2e/e2e.json "$OUT/"; tar czf "$OUT/e2e_logs.tgz" -C /tmp/e2e . ;;
  bench) python benchmarks/serve_bench.py --config configs/h200_testbed.yaml --out /tmp/bench \
             --concurrency 1,4,16,64
         cp /tmp/bench/results.* /tmp/bench/*.png "$OUT/"; tar czf "$OUT/bench_logs.tgz" -C /tmp/bench logs ;;
  cost)  python benchmarks/serve_bench.py --config configs/h200_cost_qwen3_8b.yaml --out /tmp/cost ${ARMS:+--arms $ARMS}
         cp /tmp/cost/results.* "$OUT/"; tar czf "$OUT/cost_logs.tgz" -C /tmp/cost logs ;;
  pair)  python benchmarks/serve_bench.py --config configs/two_replicas_one_gpu.yaml --out /tmp/pair
         cp /tmp/pair/results.* "$OUT/"; tar czf "$OUT/pair_logs.tgz" -C /tmp/pair logs ;;
  *)     echo "usage: bash scripts/gpu_run.sh tree|e2e|bench|cost|pair" >&2; exit 2 ;;
esac
