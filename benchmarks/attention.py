"""Attention layer benchmark: DIFF (each backend) vs its parameter-matched baseline (SDPA).

Usage: python benchmarks/attention.py [--seq-lens 256 512 1024] [--dim 512] [--heads 4]
       [--repeats 10] [--json out.json]
Same as `difftx bench`. Prints a markdown table; ratios are measured side by side in one run.
"""

import sys

from difftx.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
