"""`ninfer-serve`: the OpenAI- and Anthropic-compatible server over one Engine.

    ninfer-serve                       # the built-in tiny checkpoint on http://127.0.0.1:8000
    ninfer-serve /path/to/Qwen3.5-27B --dtype bfloat16 --host-cache-mib 16384 --api-key KEY

The options are spec §14.2's surface where it applies. Unset prefix-cache values are derived by the
engine from the rest (EngineOptions.resolve) and reported in the startup log. Conflicting options
are refused before anything loads, with exit status 2 (`serve_options` holds those rules, pure).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from ninfer_jax.compile_cache import add_compile_cache_argument, enable_compile_cache
from ninfer_jax.runtime.options import IDLE_PREFILL_CHUNK_HELP, PREFILL_ATTENTION_HELP, PREFILL_CHUNK_HELP

MAX_CONCURRENCY = 8  # spec scope: max_concurrency 1..8

# flag -> Engine option, for the prefix-cache options --no-prefix-reuse excludes.
CACHE_FLAGS = {
    "--host-cache-mib": "host_cache_mib",
    "--device-snapshot-slots": "device_snapshot_slots",
    "--cache-taps-per-request": "max_new_taps",
    "--cache-tap-ladder": "tap_ladder_tokens",
    "--cache-tap-min-gap": "tap_min_gap_tokens",
    "--prefix-cache-file": "prefix_cache_file",
}

log = logging.getLogger("ninfer_jax.server")


class UsageError(ValueError):
    """Options that cannot be served together; the message names them."""


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    api_key: str | None
    engine: dict[str, Any]  # keyword arguments of Engine.from_pretrained
    compile_cache: str | None = None  # jax's persistent compilation cache folder (None: off)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer-serve", description="OpenAI- and Anthropic-compatible server for Qwen3.5 hybrid models.")
    parser.add_argument("model", nargs="?", help="checkpoint directory (default: the built-in tiny checkpoint)")
    parser.add_argument("--model", dest="model_flag", metavar="PATH", help="the same as the positional MODEL")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", help="require this key: `Authorization: Bearer KEY` or `x-api-key: KEY`")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="weights and KV (auto: float32 on CPU, bfloat16 on GPU)")
    engine.add_argument("--max-concurrency", type=int, default=4, help=f"lanes, 1..{MAX_CONCURRENCY} (default 4)")
    engine.add_argument("--prefill-chunk", type=_positive, help=PREFILL_CHUNK_HELP)
    engine.add_argument("--idle-prefill-chunk", type=_positive, help=IDLE_PREFILL_CHUNK_HELP)
    engine.add_argument("--kv-capacity", default="auto", type=_kv_capacity,
                        help="KV pool in tokens, or auto: the device memory left (default auto)")
    engine.add_argument("--max-model-len", type=_positive, help="context length (default min(config, 32768))")
    engine.add_argument("--concurrent-prefill", action="store_true",
                        help="admit a request while another prefills (needed for in-flight coalescing)")
    engine.add_argument("--batch-invariant", action="store_true",
                        help="decode every round at full width, so outputs never depend on other requests "
                             "(slower at low concurrency)")
    engine.add_argument("--kernels", default="auto", choices=["auto", "pallas", "reference"],
                        help="hot operations: Pallas kernels or the jnp references (auto: pallas on a GPU)")
    engine.add_argument("--prefill-attention", default="auto", choices=["auto", "pallas", "cudnn"],
                        help=PREFILL_ATTENTION_HELP)
    engine.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="compile programs on first use instead of at startup")
    add_compile_cache_argument(engine)
    cache = parser.add_argument_group("hybrid prefix cache (spec §14.2; unset values are derived)")
    cache.add_argument("--no-prefix-reuse", action="store_true", help="disable the prefix cache")
    cache.add_argument("--host-cache-mib", type=_non_negative,
                       help="Host tier budget in MiB (default 8192; 0: Device only)")
    cache.add_argument("--device-snapshot-slots", type=_positive,
                       help="snapshot slots (default C+1 with a Host tier, C+2 without)")
    cache.add_argument("--cache-taps-per-request", type=_non_negative,
                       help="new taps kept per request (default 8 with a Host tier, 2 without)")
    cache.add_argument("--cache-tap-ladder", type=_positive, help="ladder spacing G (default max(4096, 2*chunk))")
    cache.add_argument("--cache-tap-min-gap", type=_positive, help="ladder minimum gap (default max(1024, chunk))")
    cache.add_argument("--prefix-cache-file",
                       help="save the Host tier here at an orderly stop and load it at the next start (spec §5.5)")
    return parser


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The conflict rules (pure). Raises UsageError naming the options at fault."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UsageError(f"two models given: {args.model} and --model {args.model_flag}")
    model = args.model or args.model_flag
    if not 1 <= args.max_concurrency <= MAX_CONCURRENCY:
        raise UsageError(f"--max-concurrency must be in 1..{MAX_CONCURRENCY}, got {args.max_concurrency}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    given = {flag: getattr(args, _dest(flag)) for flag in CACHE_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None}
    if args.no_prefix_reuse and given:
        raise UsageError(f"--no-prefix-reuse conflicts with {', '.join(given)}: there is no cache to configure")
    prefix_file = None
    if args.prefix_cache_file is not None:
        if args.host_cache_mib == 0:
            raise UsageError("--prefix-cache-file needs a Host tier; it conflicts with --host-cache-mib 0")
        path = Path(args.prefix_cache_file).expanduser().resolve()
        if path.is_dir():
            raise UsageError(f"--prefix-cache-file {path} is a directory; name a file")
        if not path.parent.is_dir():
            raise UsageError(f"--prefix-cache-file {path}: the directory {path.parent} does not exist")
        prefix_file = str(path)
    engine: dict[str, Any] = {"path": model, "dtype": args.dtype, "max_concurrency": args.max_concurrency,
                              "kv_capacity": args.kv_capacity, "no_prefix_reuse": args.no_prefix_reuse,
                              "warmup": args.warmup}
    for key, value in (("prefill_chunk", args.prefill_chunk), ("idle_prefill_chunk", args.idle_prefill_chunk),
                       ("max_model_len", args.max_model_len)):
        if value is not None:
            engine[key] = value
    if args.concurrent_prefill:
        engine["concurrent_prefill"] = True
    if args.batch_invariant:
        engine["batch_invariant"] = True
    if args.prefill_attention == "cudnn" and args.kernels == "reference":
        raise UsageError("--prefill-attention cudnn runs with the Pallas kernels; "
                         "it conflicts with --kernels reference")
    if args.kernels != "auto":
        engine["kernels"] = args.kernels
    if args.prefill_attention != "auto":
        engine["prefill_attention"] = args.prefill_attention
    for flag, value in given.items():
        engine[CACHE_FLAGS[flag]] = value
    if prefix_file is not None:
        engine["prefix_cache_file"] = prefix_file
    return ServeOptions(args.host, args.port, args.api_key, engine, args.compile_cache_dir)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = serve_options(args)
    except UsageError as error:
        parser.error(str(error))  # exits 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s | %(message)s")

    from ninfer_jax import Engine

    from .app import create_app
    from .serving import OrderlyServer, server_config

    try:
        enable_compile_cache(options.compile_cache)
        engine = Engine.from_pretrained(**options.engine)
    except ValueError as error:  # options the engine refuses, a checkpoint it cannot serve
        log.error("cannot start | %s", error)
        return 2
    app = create_app(engine, api_key=options.api_key)
    stats = engine.stats()
    log.info("serving | http://%s:%d | model %s | max_model_len %d | kv pages %s | api key %s",
             options.host, options.port, engine.model_name, engine.max_model_len,
             stats.get("pages", {}).get("capacity", "?"), "required" if options.api_key else "off")
    server = OrderlyServer(server_config(app, options.host, options.port), app.state.context)
    try:
        server.run()
    finally:
        if not app.state.context.stopping:  # the server never started (e.g. the port was taken)
            engine.stop()
    return 0


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _kv_capacity(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _positive(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive token count, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
