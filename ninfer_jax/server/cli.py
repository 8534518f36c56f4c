"""`ninfer-serve`: the OpenAI- and Anthropic-compatible server over one Engine.

    ninfer-serve                       # the built-in tiny checkpoint on http://127.0.0.1:8000
    ninfer-serve /path/to/Qwen3.5-27B --dtype bfloat16 --host-cache-mib 16384 --api-key KEY

The engine's flags come from the option declarations in ninfer_jax.runtime.options (spec §14.2's names where
it has them); unset values are derived by the engine (EngineOptions.resolve) and reported in the startup log.
Conflicting options are refused before anything loads, with exit status 2 (`serve_options`, pure). vLLM's flags for
the same settings are taken too (--max-num-seqs, --kv-cache-dtype, --gpu-memory-utilization, ...), and its parser
flags where they name what this server does (Qwen3.5's tool calls and think blocks), so a vLLM command line carries
over; any other value of them is refused.

The server listens at once and builds the engine in a thread: /health answers from the start, /health/ready
says 503 with the startup's stage until the engine serves, and generation answers 503 with Retry-After until
then. An engine that cannot be built (a bad checkpoint, options it refuses) ends the process with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from typing import Any

from ninfer_jax.compile_cache import add_compile_cache_argument, enable_compile_cache
from ninfer_jax.device_memory import CLAIM, ENV, claim_device_memory
from ninfer_jax.runtime.options import OptionsError, add_engine_arguments, engine_kwargs_from_args

from .images import ImageOptions
from .limits import CHARS_PER_TOKEN, MIN_DEFAULT_WAITING, WAITING_PER_LANE, Limits

log = logging.getLogger("ninfer_jax.server")


# vLLM's parsers of the formats this server reads: Qwen3.5's XML tool calls and its <think> blocks
VLLM_TOOL_CALL_PARSERS = ("qwen3_coder", "qwen3_xml")
VLLM_REASONING_PARSERS = ("qwen3", "deepseek_r1")


class UsageError(ValueError):
    """Options that cannot be served together; the message names them."""


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    api_key: str | None
    engine: dict[str, Any]  # keyword arguments of Engine.from_pretrained
    compile_cache: str | None = None  # jax's persistent compilation cache folder (None: off)
    limits: Limits = Limits()
    images: ImageOptions = dataclasses.field(default_factory=ImageOptions)
    allowed_origins: tuple[str, ...] = ()  # CORS: web origins that may call the API (none: browsers may not)
    default_thinking: bool = True  # whether OpenAI-protocol requests think when they do not say
    served_model_names: tuple[str, ...] = ()  # the names requests may give (none: the checkpoint's)
    memory_fraction: float = CLAIM  # the share of each GPU jax may take (device_memory.py)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer-serve", description="OpenAI- and Anthropic-compatible server for Qwen3.5 hybrid models.")
    parser.add_argument("model", nargs="?", help="checkpoint directory, or a Hugging Face repo id (ORG/NAME) in the "
                        "local Hugging Face cache (downloaded into it when huggingface_hub is installed), or with "
                        "--load-format dummy a config .json (default: the built-in tiny checkpoint)")
    parser.add_argument("--model", dest="model_flag", metavar="PATH", help="the same as the positional MODEL")
    parser.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                        help="the model names requests may give; responses report the first (default: the "
                             "checkpoint's repo id, or its folder's name)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    server.add_argument("--port", type=int, default=8000, help="TCP port; default 8000")
    server.add_argument("--api-key", help="require this key: `Authorization: Bearer KEY` or `x-api-key: KEY`")
    server.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="web origins (https://app.example) whose pages may call the API from a browser (CORS); "
                             "'*' for any; default none")
    server.add_argument("--default-thinking", choices=["on", "off"], default="on",
                        help="whether the model thinks before answering when an OpenAI request does not say "
                             "(chat_template_kwargs.enable_thinking, reasoning_effort); 'off' for clients that drop "
                             "reasoning_content (LangChain, litellm); default on")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="default info")
    limits = parser.add_argument_group("request limits (checked before any work; a request over one gets a 4xx "
                                       "naming the flag)")
    default = Limits()
    limits.add_argument("--max-request-bytes", type=int, default=default.max_request_bytes, metavar="N",
                        help="largest request body, refused (413) while it is read; default 33554432 (32 MiB: a "
                             "262k-token context is 1-3 MiB of JSON; images come inline as base64)")
    limits.add_argument("--max-prompt-chars", type=int, metavar="N",
                        help="most characters of text in a request, checked before tokenizing; default "
                             f"{CHARS_PER_TOKEN} per token of --max-model-len")
    for flag, field, what in (("--max-json-depth", "max_json_depth", "deepest nesting of the JSON body"),
                              ("--max-prompts", "max_prompts", "prompts in one /v1/completions request"),
                              ("--max-stop-strings", "max_stop_strings", "stop strings in one request"),
                              ("--max-stop-chars", "max_stop_chars", "characters in one stop string"),
                              ("--max-tools", "max_tools", "tools in one request"),
                              ("--max-n", "max_n", "samples of one prompt (the request's n)")):
        value = getattr(default, field)
        limits.add_argument(flag, type=int, default=value, metavar="N", help=f"{what}; default {value}")
    images = parser.add_argument_group("images (image parts of chat requests; a bad image gets a 400 naming it)")
    default_images = ImageOptions()
    images.add_argument("--allow-image-urls", action="store_true",
                        help="fetch http(s) image URLs; off by default (only inline data: URLs and base64), as the "
                             "server would fetch from any address it reaches on a client's word")
    images.add_argument("--image-fetch-timeout-s", type=float, default=default_images.image_fetch_timeout_s,
                        metavar="S", help="seconds one image URL's fetch may take, connection to last byte; default "
                                      f"{default_images.image_fetch_timeout_s:g}")
    images.add_argument("--max-image-bytes", type=int, default=default_images.max_image_bytes, metavar="N",
                        help="largest encoded image, inline or fetched; default "
                             f"{default_images.max_image_bytes} (20 MiB, OpenAI's bound)")
    images.add_argument("--max-images-per-prompt", type=int, default=default_images.max_images_per_prompt,
                        metavar="N", help=f"images in one request; default {default_images.max_images_per_prompt}")
    server.add_argument("--max-waiting-requests", type=int, metavar="N",
                        help="requests that may wait for a lane; past them the server answers 503 with Retry-After; "
                             f"default {WAITING_PER_LANE} per lane (--max-concurrency), at least {MIN_DEFAULT_WAITING}")
    engine, _ = add_engine_arguments(parser)
    engine.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="compile programs on first use instead of at startup")
    add_compile_cache_argument(engine)
    vllm = parser.add_argument_group("vLLM's flags (so its command lines carry over; each does what it does there)")
    vllm.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                      help=f"the share of each GPU's memory jax may take (${ENV}); default {CLAIM}")
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                      help="on by default; --no-enable-prefix-caching is --no-prefix-reuse")
    vllm.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="always on: tool calls are parsed whenever a request gives tools")
    vllm.add_argument("--tool-call-parser", choices=VLLM_TOOL_CALL_PARSERS,
                      help="the parsers of Qwen3.5's XML tool calls, the format this server parses")
    vllm.add_argument("--reasoning-parser", choices=VLLM_REASONING_PARSERS,
                      help="the parsers of Qwen3.5's <think> blocks, as this server splits them off")
    vllm.add_argument("--trust-remote-code", action="store_true", help="no effect: no checkpoint code is run")
    return parser


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The conflict rules (pure). Raises UsageError naming the options at fault."""
    if args.model and args.model_flag and args.model != args.model_flag:
        raise UsageError(f"two models given: {args.model} and --model {args.model_flag}")
    model = args.model or args.model_flag
    if args.served_model_name and model is None:  # `--served-model-name NAME PATH` takes PATH for a name
        raise UsageError("--served-model-name without a model: give the checkpoint before it, or with --model")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    limits = Limits(**{field: getattr(args, field) for field in Limits.__dataclass_fields__})
    for field, value in vars(limits).items():
        if value is not None and value < 1:
            raise UsageError(f"--{field.replace('_', '-')} must be at least 1, got {value}")
    images = ImageOptions(**{field: getattr(args, field) for field in ImageOptions.__dataclass_fields__})
    for field in ("max_image_bytes", "max_images_per_prompt"):
        if getattr(images, field) < 1:
            raise UsageError(f"--{field.replace('_', '-')} must be at least 1, got {getattr(images, field)}")
    if not 0 < images.image_fetch_timeout_s < math.inf:
        raise UsageError(f"--image-fetch-timeout-s must be a positive number, got {images.image_fetch_timeout_s}")
    if args.enable_prefix_caching is False:
        args.no_prefix_reuse = True
    elif args.enable_prefix_caching and args.no_prefix_reuse:
        raise UsageError("--enable-prefix-caching and --no-prefix-reuse: give one")
    fraction = CLAIM if args.gpu_memory_utilization is None else args.gpu_memory_utilization
    if not 0 < fraction <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    given = os.environ.get(ENV)
    if args.gpu_memory_utilization is not None and given is not None and _number(given) != fraction:
        raise UsageError(f"--gpu-memory-utilization {fraction} and {ENV}={given}: give one")
    try:
        engine = engine_kwargs_from_args(args)
    except OptionsError as error:
        raise UsageError(str(error)) from None
    return ServeOptions(args.host, args.port, args.api_key, {"path": model, **engine, "warmup": args.warmup},
                        args.compile_cache_dir, limits, images, tuple(args.allowed_origins),
                        args.default_thinking == "on", tuple(args.served_model_name), fraction)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = serve_options(args)
    except UsageError as error:
        parser.error(str(error))  # exits 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s | %(message)s")
    # jax reports each accelerator plugin it does not find ("Unable to initialize backend 'tpu'") at INFO; on a
    # machine without one those lines read as failures.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    claim_device_memory(options.memory_fraction)  # before the build thread starts jax's backend

    from .app import create_app
    from .readiness import build_in_background
    from .serving import OrderlyServer, server_config

    app = create_app(api_key=options.api_key, limits=options.limits, images=options.images,
                     allowed_origins=options.allowed_origins, default_thinking=options.default_thinking,
                     served_model_names=options.served_model_names)
    ctx = app.state.context
    server = OrderlyServer(server_config(app, options.host, options.port), ctx)

    def build(progress):
        enable_compile_cache(options.compile_cache)
        from ninfer_jax import Engine

        return Engine.from_pretrained(**options.engine, progress=progress)

    def ready(engine) -> None:
        ctx.attach(engine)
        pages = engine.published_stats().get("pages", {}).get("capacity", "?")
        log.info("serving | http://%s:%d | model %s | max_model_len %d | kv pages %s | api key %s",
                 options.host, options.port, ctx.model_name, engine.max_model_len, pages,
                 "required" if options.api_key else "off")
        if ctx.stopping:  # the orderly stop began while it was built
            engine.stop()

    def failed(message: str) -> None:
        server.should_exit = True

    builds = []

    def listening() -> None:
        log.info("listening | http://%s:%d | loading the model; /health/ready answers 200 once it serves",
                 options.host, options.port)
        builds.append(build_in_background(build, ctx.startup, ready, failed))

    server.on_listening = listening
    server.run()
    status = 2 if ctx.startup.error is not None else 0
    if builds and builds[0].is_alive():
        # Stopped while loading or compiling: jax's threads cannot be torn down mid-compile at interpreter exit.
        log.info("stopped during startup | the engine's build is abandoned")
        logging.shutdown()
        os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
