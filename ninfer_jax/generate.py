"""`ninfer-generate` / `python -m ninfer_jax.generate`: run prompts through the engine and print the results.

With no arguments it runs two chat prompts on the built-in tiny checkpoint (random weights: the text is
noise, the numbers are real).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.compile_cache import add_compile_cache_argument, enable_compile_cache
from ninfer_jax.frontend import prepare_chat
from ninfer_jax.runtime.options import IDLE_PREFILL_CHUNK_HELP, PREFILL_ATTENTION_HELP, PREFILL_CHUNK_HELP

DEFAULT_PROMPTS = ["What is a hybrid prefix cache?", "Write a haiku about GPUs."]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-generate", description=__doc__)
    p.add_argument("prompts", nargs="*", help="prompts (default: two demo questions)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: built-in tiny Qwen3.5)")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=None, help=PREFILL_CHUNK_HELP)
    p.add_argument("--idle-prefill-chunk", type=int, default=None, help=IDLE_PREFILL_CHUNK_HELP)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-capacity", default="auto", help="'auto' or a token count")
    p.add_argument("--kernels", default="auto", choices=["auto", "reference", "pallas"],
                   help="Pallas kernels or the jnp references (auto: pallas on a GPU)")
    p.add_argument("--prefill-attention", default="auto", choices=["auto", "pallas", "cudnn"],
                   help=PREFILL_ATTENTION_HELP)
    add_compile_cache_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s | %(message)s")
    kv = args.kv_capacity if args.kv_capacity == "auto" else int(args.kv_capacity)
    enable_compile_cache(args.compile_cache_dir)
    engine = Engine.from_pretrained(
        args.model, dtype=args.dtype, max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk,
        kv_capacity=kv, max_model_len=args.max_model_len, kernels=args.kernels,
        prefill_attention=args.prefill_attention, idle_prefill_chunk=args.idle_prefill_chunk,
    )
    try:
        prompts = args.prompts or DEFAULT_PROMPTS
        if not args.raw and engine.tokenizer is not None:
            prompts = [prepare_chat(engine.tokenizer, [{"role": "user", "content": p}], enable_thinking=False)
                       for p in prompts]
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed)
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
