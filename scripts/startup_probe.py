"""Startup of `ninfer-serve`, cold then warm: starts the server (jax's compile cache empty or not, as it finds it),
times /health/ready and the first served completion (16 tokens in, 1 out), stops it, starts it again (now warm),
times the same, then waits for the background compile to end and prints how long it took. Each server's log goes to
--logs. With --then, a serving benchmark against the warm server before it stops; last, the programs the warm server
compiled on its engine thread (0: no request waited on a compile).

    JAX_COMPILATION_CACHE_DIR=/tmp/xla python scripts/startup_probe.py --logs OUT -- \\
        configs/qwen3.5-35b-a3b.json --load-format dummy --max-concurrency 256 --max-model-len 4096
    python scripts/startup_probe.py --logs OUT --then "--workloads fixed --concurrency 64 256 --per-client 1" -- ...
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ninfer_jax.benchmarks import serving
from ninfer_jax.server.subprocess_server import ServerProcess


def start(args: list[str], log: Path) -> ServerProcess:
    began = time.perf_counter()
    server = ServerProcess(args, log_file=log).__enter__()
    ready = time.perf_counter() - began
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    level = asyncio.run(serving.run_level(server.url, model, [serving.BenchRequest(list(range(1000, 1016)), 1)], 1))
    print(f"{log.stem} | ready {ready:.1f} s | first completion {time.perf_counter() - began:.1f} s | "
          f"errors {level['errors']}", flush=True)
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", type=Path, required=True, help="folder for cold.log and warm.log")
    parser.add_argument("--then", help="load_test.py --serving arguments to run against the warm server")
    parser.add_argument("server_args", nargs="*", help="ninfer-serve arguments (after --)")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    start(args.server_args, args.logs / "cold.log").stop()
    server = start(args.server_args, args.logs / "warm.log")
    try:
        began = time.perf_counter()
        while "ninfer_engine_compiling_in_background 1.0" in httpx.get(f"{server.url}/metrics", timeout=300).text:
            time.sleep(1)
        print(f"warm | every program compiled {time.perf_counter() - began:.1f} s after the first completion",
              flush=True)
        if args.then:
            subprocess.run([sys.executable, "scripts/load_test.py", "--serving", "--url", server.url,
                            *shlex.split(args.then), "--out", str(args.logs)], check=True)
        compiles = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                    if line.startswith("ninfer_engine_compiles_since_warmup")]
        print(f"warm | {compiles[0] if compiles else 'no compile count'} (programs a request waited on)", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
