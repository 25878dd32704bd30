"""Which tree budget the batch-aware chooser picks per batch size at Qwen3-8B shapes, and the
projected DDTREE / DFLASH ratio (measured step times x published accept lengths: a projection).

    python benchmarks/project_budget.py --cost benchmarks/results/h200_cost_qwen3_8b_2026-12-02/results.json \
        --out benchmarks/results/budget_projection_qwen3_8b.md
    D=benchmarks/results/h200_cost_kernel_2026-12-04_run6
    python benchmarks/project_budget.py --cost $D/results_b15.json $D/results_b32.json \
        $D/results_wide.json --variant kernel \
        --out benchmarks/results/budget_projection_qwen3_8b_kernel_2026-12-04.md
"""

import sys

from ddtree_bench.projection import main

if __name__ == "__main__":
    sys.exit(main())
