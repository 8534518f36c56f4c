"""`ninfer-serve`: the OpenAI- and Anthropic-compatible server over one Engine.

    ninfer-serve                       # the built-in tiny checkpoint on http://127.0.0.1:8000
    ninfer-serve /path/to/Qwen3.5-27B --dtype bfloat16 --host-cache-mib 16384 --api-key KEY

The engine's flags come from the option declarations in ninfer_jax.runtime.options (spec §14.2's names where
it has them); unset values are derived by the engine (EngineOptions.resolve) and reported in the startup log.
Conflicting options are refused before anything loads, with exit status 2 (`serve_options`, pure).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from ninfer_jax.compile_cache import add_compile_cache_argument, enable_compile_cache
from ninfer_jax.runtime.options import OptionsError, add_engine_arguments, engine_kwargs_from_args

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
    engine, _ = add_engine_arguments(parser)
    engine.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="compile programs on first use instead of at startup")
    add_compile_cache_argument(engine)
    return parser


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The conflict rules (pure). Raises UsageError naming the options at fault."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UsageError(f"two models given: {args.model} and --model {args.model_flag}")
    model = args.model or args.model_flag
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    try:
        engine = engine_kwargs_from_args(args)
    except OptionsError as error:
        raise UsageError(str(error)) from None
    return ServeOptions(args.host, args.port, args.api_key, {"path": model, **engine, "warmup": args.warmup},
                        args.compile_cache_dir)


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


if __name__ == "__main__":
    sys.exit(main())
