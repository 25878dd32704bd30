"""DDTREE vs DFLASH vs no speculation in the real SGLang server, on one GPU or many.

    python benchmarks/serve_bench.py --config configs/h200_testbed.yaml --dry-run
    python benchmarks/serve_bench.py --config configs/h200_testbed.yaml --out benchmarks/results/h200_testbed

The logic lives in ddtree_sglang.bench.run (installed with the package); see its docstring.
"""

import sys

from ddtree_sglang.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
