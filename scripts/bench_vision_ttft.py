"""TTFT of an agent turn with four images (spec §13.3 Vision): resumed from the prefix cache, against the same
prompt recomputed with its images' encoder outputs still on the device, and recomputed with every image encoded.

The engine at a real text shape (--model, random bf16 weights) with the real vision tower's shape (random, out
hidden = the model's), the Qwen3.5 processor's rules (each square image of --image pixels resized by them). Turn 1:
a system preamble, four screenshots and a question; turn 2 appends its answer and a follow-up. Turn 2's TTFT:
  * resumed: a cache-on request (its hit reaches past the images: no encoding, only the new tokens);
  * recomputed, encoder cache warm: the same prompt with prefix_cache off (the images' rows are still held);
  * recomputed, encoding: the same prompt with four new images of the same size (every image encoded).
One warm-up conversation of other images runs first, so every program has compiled (reported apart).

    python scripts/bench_vision_ttft.py --model 27b --out docs/benchmarks
    python scripts/bench_vision_ttft.py --tiny                          # CPU: the tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import numpy as np

from ninfer_jax import SamplingParams
from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.models import model_config, tiny_checkpoint_config
from ninfer_jax.config import VisionConfig
from ninfer_jax.frontend import VisionFrontend
from ninfer_jax.frontend.image_processing import ImageProcessorConfig
from ninfer_jax.frontend.prepared_prompt import prepare_tokens
from ninfer_jax.model.tiny import PREPROCESSOR_FIELDS, random_vision_tensors
from ninfer_jax.model.vision import vision_params_from_tensors

PAD = 248056  # <|image_pad|> in Qwen3.5's vocabulary


def vision_engine(args):
    """An Engine on random weights with a random vision tower, and its frontend."""
    from ninfer_jax import Engine
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime.options import EngineOptions

    if args.tiny:
        cfg = tiny_checkpoint_config()
        vcfg = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                            out_hidden_size=cfg.hidden_size, num_position_embeddings=64)
        dtype, options = jax.numpy.float32, dict(dtype="float32", kernels="reference", max_model_len=4096)
    else:
        cfg = model_config(args.model)
        vcfg = VisionConfig(out_hidden_size=cfg.hidden_size)
        dtype, options = jax.numpy.bfloat16, dict(dtype="bfloat16", kernels="pallas", max_model_len=32768)
    params = random_params(cfg, seed=0, dtype=dtype)
    tensors = random_vision_tensors(vcfg, np.random.default_rng(0))
    vparams = vision_params_from_tensors(vcfg, lambda name, shape: tensors[name].astype(np.float32),
                                         lambda a: jax.numpy.asarray(a, dtype))
    fields = {**PREPROCESSOR_FIELDS, "patch_size": vcfg.patch_size, "merge_size": vcfg.spatial_merge_size,
              "temporal_patch_size": vcfg.temporal_patch_size}
    frontend = VisionFrontend(ImageProcessorConfig.from_dict(fields), PAD)
    opts = EngineOptions(max_concurrency=2, max_image_tokens=args.max_image_tokens, **options)
    # Programs compile on first use, in the warm-up conversation (timed apart): a full warmup compiles every
    # bucket, minutes at the 27B shape, and this run needs a few
    engine = Engine(cfg, params, opts, model_name=args.model, warmup=False, vision=(vcfg, vparams, frontend))
    return engine, vcfg


def screenshots(seed: int, count: int, side: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(count)]


def conversation(seed: int, args):
    """(turn 1's prompt parts, turn 2's) as token lists and images, for prepare_tokens."""
    rng = np.random.default_rng(seed)

    def text(n):
        return rng.integers(1000, 100000, n).tolist()

    images = screenshots(seed, args.images, args.image)
    first = [text(args.preamble)]
    for image in images:
        first += [text(8), image]
    first.append(text(200))
    return first, images, text


def prompt(engine, parts):
    ids = [t for p in parts for t in (p if isinstance(p, list) else [PAD])]
    return prepare_tokens(ids, images=[p for p in parts if not isinstance(p, list)], vision=engine.vision)


def ttft(engine, p, sampling) -> float:
    """Seconds from the request's arrival to its first token (the engine's own metric)."""
    return engine.generate(p, sampling).metrics.ttft_s


def run(args) -> dict:
    engine, vcfg = vision_engine(args)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    answer = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = {}
    try:
        for label, seed in (("warm-up", 1), ("timed", 2)):
            parts, images, text = conversation(seed, args)
            first = prompt(engine, parts)
            start = time.perf_counter()
            out = engine.generate(first, answer)
            turn1 = time.perf_counter() - start
            second = parts[:-1] + [parts[-1] + list(out.token_ids) + text(args.follow_up)]
            p2 = prompt(engine, second)
            resumed = ttft(engine, p2, one)
            warm = ttft(engine, p2, dataclasses.replace(one, prefix_cache=False))
            new_images = iter(screenshots(seed + 100, args.images, args.image))
            fresh = [p if isinstance(p, list) else next(new_images) for p in second]
            encoding = ttft(engine, prompt(engine, fresh), dataclasses.replace(one, prefix_cache=False))
            rows[label] = {"turn1_s": turn1, "prompt_tokens": p2.num_tokens,
                           "image_tokens": sum(im.length for im in p2.media.images),
                           "grid": list(p2.media.images[0].grid), "resumed_s": resumed,
                           "recomputed_encoder_cached_s": warm, "recomputed_encoding_s": encoding}
            print(f"[ttft] {label}: {rows[label]}", flush=True)
        rows["vision_stats"] = engine.stats()["vision"]
    finally:
        engine.stop()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="27b")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--image", type=int, default=1024, help="each square image's side in pixels")
    ap.add_argument("--preamble", type=int, default=2000, help="system tokens before the images")
    ap.add_argument("--follow-up", type=int, default=100, help="turn 2's new user tokens")
    ap.add_argument("--max-image-tokens", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="the tiny shapes on CPU (seconds)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.model, args.image, args.preamble, args.max_image_tokens = "tiny", 256, 100, 96
    data = {**report.run_meta(), "args": vars(args), **run(args)}
    t = data["timed"]
    lines = report.header(
        "TTFT of a turn with images: resumed from the cache against recomputed", data,
        f"{args.model} text shape, random bf16 weights; the real vision tower's shape, random; {args.images} images "
        f"of {args.image} x {args.image} pixels (grid {t['grid']}, {t['image_tokens']} image tokens), a "
        f"{args.preamble}-token preamble; turn 2 of {t['prompt_tokens']} tokens",
        f"compile: programs compile on first use, in a warm-up conversation of other images (its first turn took "
        f"{report.fmt(data['warm-up']['turn1_s'])} s, the timed one's {report.fmt(data['timed']['turn1_s'])} s)")
    lines += report.table(["turn 2", "TTFT s", "vs resumed"], [
        ["resumed from the prefix cache", report.fmt(t["resumed_s"]), "1.00x"],
        ["recomputed, images' encoder outputs held", report.fmt(t["recomputed_encoder_cached_s"]),
         f"{t['recomputed_encoder_cached_s'] / t['resumed_s']:.1f}x"],
        ["recomputed, images encoded", report.fmt(t["recomputed_encoding_s"]),
         f"{t['recomputed_encoding_s'] / t['resumed_s']:.1f}x"],
    ])
    out = args.out or tempfile.mkdtemp(prefix="vision-ttft-")
    print("report:", report.write_report(out, "vision_ttft", data, lines))


if __name__ == "__main__":
    main()
