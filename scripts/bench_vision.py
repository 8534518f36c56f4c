"""Benchmark the vision tower (model/vision.py) against transformers' Qwen3_5VisionModel, same random weights.

The real tower's shape (transformers' Qwen3_5VisionConfig defaults: depth 27, hidden 1152, 16 heads, patch 16,
merge 2; out_hidden_size 5120 as the 27B's), bf16. For each image size, `--images` images per call; reports
images/s of ours (jitted, compiled before timing) and of transformers (sdpa, torch on the same GPU), and the
largest difference of the two outputs over transformers' largest value (rel. diff).

  python scripts/bench_vision.py --out docs/benchmarks            # a GPU with CUDA torch: writes vision.{json,md}
  python scripts/bench_vision.py --smoke --out /tmp/vision        # CPU, tiny tower: checks the script
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import numpy as np

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.profiling import call_seconds
from ninfer_jax.config import VisionConfig
from ninfer_jax.model.tiny import random_vision_tensors
from ninfer_jax.model.vision import (
    PREFIX,
    vision_forward,
    vision_params_from_tensors,
)

REAL = {"vcfg": VisionConfig(out_hidden_size=5120), "sizes": [448, 1024, 1344], "dtype": "bfloat16"}
SMOKE = {"vcfg": VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                              num_position_embeddings=64), "sizes": [64, 128], "dtype": "float32"}


def random_tensors(vcfg: VisionConfig) -> dict[str, np.ndarray]:
    """Checkpoint-layout random weights (the built-in checkpoint's draw), float32."""
    return {k: v.astype(np.float32) for k, v in random_vision_tensors(vcfg, np.random.default_rng(0)).items()}


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until done) over `repeats` calls, after one untimed call."""
    return float(np.median(call_seconds(fn, repeats)))


def transformers_tower(vcfg: VisionConfig, tensors, dtype: str):
    """transformers' tower with the same weights, on CUDA when torch has it; None without transformers."""
    try:
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import (
            Qwen3_5VisionConfig,
            Qwen3_5VisionModel,
        )
    except ImportError:
        return None, None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fields = {f: getattr(vcfg, f) for f in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                            "out_hidden_size", "patch_size", "temporal_patch_size",
                                            "spatial_merge_size", "num_position_embeddings", "in_channels")}
    config = Qwen3_5VisionConfig(**fields, attn_implementation="sdpa")
    model = Qwen3_5VisionModel(config).eval()
    model.load_state_dict({k[len(PREFIX):]: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    return model.to(device=device, dtype=getattr(torch, dtype)), device


def measure(params, vcfg: VisionConfig, hf, device, size: int, images: int, repeats: int) -> dict:
    """One image size: images/s of ours and of transformers (None without it), and their relative difference."""
    g = size // vcfg.patch_size
    grid = [(1, g, g)] * images
    pixels = np.random.default_rng(1).uniform(-1, 1, (g * g * images, vcfg.patch_dim)).astype(np.float32)
    ours_s = timed(lambda: jax.block_until_ready(vision_forward(params, vcfg, pixels, grid)), repeats)
    ours = np.asarray(vision_forward(params, vcfg, pixels, grid), np.float32)
    row = {"size": size, "patches_per_image": g * g, "images_per_call": images,
           "ours_images_per_s": images / ours_s, "transformers_images_per_s": None, "rel_diff": None}
    if hf is None:
        return row
    import torch

    x, thw = torch.from_numpy(pixels).to(device), torch.tensor(grid, device=device)

    def run_hf():
        with torch.no_grad():
            out = hf(x, grid_thw=thw).pooler_output
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    row["transformers_images_per_s"] = images / timed(run_hf, repeats)
    theirs = run_hf().float().cpu().numpy()
    row["rel_diff"] = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(report.DOCS))
    ap.add_argument("--images", type=int, default=4, help="images per call")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    setup = SMOKE if args.smoke else REAL
    vcfg, dtype = setup["vcfg"], setup["dtype"]
    tensors = random_tensors(vcfg)
    np_dtype = jax.numpy.dtype(dtype)
    params = vision_params_from_tensors(vcfg, lambda name, shape: tensors[name],
                                        lambda a: jax.numpy.asarray(np.ascontiguousarray(a), np_dtype))
    hf, device = transformers_tower(vcfg, tensors, dtype)
    rows = []
    for size in setup["sizes"]:
        rows.append(measure(params, vcfg, hf, device, size, args.images, args.repeats))
        print(rows[-1], flush=True)
    meta = report.run_meta(transformers_device=device)
    cells = [[r["size"], r["patches_per_image"], r["images_per_call"], report.fmt(r["ours_images_per_s"]),
              report.fmt(r["transformers_images_per_s"]),
              report.fmt(r["ours_images_per_s"] / r["transformers_images_per_s"]) if r["transformers_images_per_s"]
              else "-", report.fmt(r["rel_diff"])] for r in rows]
    page = report.header("Vision tower", meta, f"tower: {vcfg}", f"dtype: {dtype}")
    page += report.table(["image (px)", "patches", "images/call", "ours img/s", "transformers img/s", "speedup",
                          "rel. diff"], cells)
    path = report.write_report(args.out, "vision", {**meta, "vision_config": str(vcfg), "dtype": dtype,
                                                    "rows": rows}, page)
    print(path)


if __name__ == "__main__":
    main()
