"""A long prefix restored from the Host tier against recomputing it, one process per model
(`ninfer_jax.benchmarks.restore`). Writes prefix_cache_restore.{json,md}.

    python scripts/bench_prefix_cache_restore.py --out docs/benchmarks      # 27B and 35B-A3B, 100k tokens
    python scripts/bench_prefix_cache_restore.py --smoke                    # tiny model, CPU, a temporary folder
"""

import sys

from ninfer_jax.benchmarks.restore import main

if __name__ == "__main__":
    sys.exit(main())
