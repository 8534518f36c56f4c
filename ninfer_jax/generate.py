"""`ninfer-generate` / `python -m ninfer_jax.generate`: run prompts through the engine and print the results.

With no arguments it runs two chat prompts on the built-in tiny checkpoint (random weights: the text is
noise, the numbers are real). The engine flags are ninfer-serve's, from the same option declarations.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.compile_cache import add_compile_cache_argument, enable_compile_cache
from ninfer_jax.device_memory import claim_device_memory
from ninfer_jax.frontend import prepare_chat
from ninfer_jax.frontend.image_processing import ImageError, decode_image
from ninfer_jax.runtime.options import OptionsError, add_engine_arguments, engine_kwargs_from_args

DEFAULT_PROMPTS = ["What is a hybrid prefix cache?", "Write a haiku about GPUs."]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-generate", description=__doc__)
    p.add_argument("prompts", nargs="*", help="prompts (default: two demo questions)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in tiny Qwen3.5)")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image file every prompt shows before its text (repeatable; a model with a vision tower)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    engine, _ = add_engine_arguments(p)
    add_compile_cache_argument(engine)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = engine_kwargs_from_args(args)
    except OptionsError as error:
        parser.error(str(error))  # exits 2, before anything loads
    images = []
    for name in args.image:  # refused before anything loads
        try:
            data = Path(name).read_bytes()
            decode_image(data)
        except (OSError, ImageError) as error:
            parser.error(f"--image {name}: {error}")
        images.append({"type": "image", "image": data})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s | %(message)s")
    claim_device_memory()
    enable_compile_cache(args.compile_cache_dir)
    engine = Engine.from_pretrained(args.model, **options)
    try:
        prompts = args.prompts or DEFAULT_PROMPTS
        if images and (args.raw or engine.tokenizer is None):
            parser.error("--image needs the chat template (not --raw) and a tokenizer")
        if not args.raw and engine.tokenizer is not None:
            turns = [[{"role": "user", "content": images + [{"type": "text", "text": p}]}] for p in prompts]
            prompts = [prepare_chat(engine.tokenizer, turn, enable_thinking=False, vision=engine.vision)
                       for turn in turns]
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k)  # seeds drawn from the engine's --seed
        start = time.perf_counter()
        outputs = engine.generate_many(prompts, sampling)
        wall = time.perf_counter() - start
        for i, out in enumerate(outputs):
            print(f"--- request {i}: {out.usage.prompt_tokens} prompt tokens, {out.usage.completion_tokens} "
                  f"generated, finish={out.finish_reason}, ttft={out.metrics.ttft_s * 1e3:.1f} ms, "
                  f"latency={out.metrics.latency_s * 1e3:.1f} ms")
            print(out.text if engine.tokenizer is not None else list(out.token_ids))
        generated = sum(o.usage.completion_tokens for o in outputs)
        print(f"--- {len(outputs)} requests in {wall:.2f} s, {generated / wall:.1f} generated tokens/s")
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
