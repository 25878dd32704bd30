"""`ddtree-bench` from a checkout without installing the package's entry points (the GPU
machine's scripts call it so); the same arguments, see `ddtree-bench --help`.
"""

import sys

from ddtree_bench.run import main

if __name__ == "__main__":
    sys.exit(main())
