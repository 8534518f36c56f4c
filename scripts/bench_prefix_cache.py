"""The hybrid prefix cache on a multi-turn agentic trace: HPC against no reuse and vLLM's "align" mode
(`ninfer_jax.benchmarks.prefix_cache`). Writes prefix_cache.json (every request), prefix_cache.md and
prefix_cache_ttft.png; --host-heavy writes prefix_cache_host.json and its section of prefix_cache.md.

    python scripts/bench_prefix_cache.py --tokenizer .device_carry/qwen35-tokenizer --out docs/benchmarks
    python scripts/bench_prefix_cache.py --host-heavy --tokenizer .device_carry/qwen35-tokenizer --out docs/benchmarks
    python scripts/bench_prefix_cache.py --smoke                      # tiny model, CPU, a temporary folder
"""

import sys

from ninfer_jax.benchmarks.prefix_cache import main

if __name__ == "__main__":
    sys.exit(main())
