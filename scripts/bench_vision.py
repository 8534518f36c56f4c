"""The serving vision encoder (model/vision.py `encode_padded`) against transformers' Qwen3_5VisionModel, same
random weights, one image per call.

The real tower's shape (transformers' Qwen3_5VisionConfig defaults, the values published for Qwen3.5's
checkpoints; configs/qwen3.5-*.json carry no vision_config: depth 27, hidden 1152, 16 heads, intermediate 4304,
patch 16, temporal patch 2, merge 2, 2304 position embeddings; out_hidden_size 5120 as the 27B's, the 35B-A3B's
2048 changes only the merger's last matmul), bf16. Each square image size is resized by the checkpoint's
processor rules (`image_grid`: min 65536, max 16777216 pixels) to its grid, padded to its bucket
(`patch_buckets` over the engine's patch range: the processor's, capped by the default max_image_tokens), and
encoded with each attention implementation (XLA's, which materialises the logits; cuDNN's flash attention), both
masked by the image's patch count.

Per size and implementation: images/s from host pixels to a finished device output (pad_image, the transfer and
the encoder: what the engine pays; transformers is timed the same way, from host pixels, CUDA synchronised),
images/s of the encoder call alone, the unpadded reference (`vision_forward`, a program per grid), the first
call's seconds (compile + one run, apart from the steady state), and the largest difference of the valid output
rows from transformers' over transformers' largest value (bf16 agreement: below AGREE). At the smallest size,
also `--batch` images in one `encode_padded_batch` call (images/s from host pixels).

    python scripts/bench_vision.py --out docs/benchmarks     # an H200 with CUDA torch: writes vision.{json,md}
    python scripts/bench_vision.py --deadline 400 ...        # no image size (or warm-up) starts after 400 s
    python scripts/bench_vision.py --tiny                    # CPU, a tiny tower, a temporary folder: seconds
    python scripts/bench_vision.py --no-torch ...            # without transformers: ours only
    python scripts/bench_vision.py --warmup ...              # also compile every bucket: the startup cost
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.benchmarks import report
from ninfer_jax.benchmarks.profiling import call_seconds
from ninfer_jax.config import VisionConfig
from ninfer_jax.frontend.image_processing import ImageProcessorConfig, image_grid, normalization_table, pixel_values_of
from ninfer_jax.model.tiny import PREPROCESSOR_FIELDS, random_vision_tensors
from ninfer_jax.model.vision import (
    PREFIX,
    encode_padded,
    encode_padded_batch,
    pad_image,
    padded_compile_count,
    patch_buckets,
    stack_images,
    vision_forward,
    vision_params_from_tensors,
    warmup_padded,
)
from ninfer_jax.model.vision import padded_metadata
from ninfer_jax.runtime.device.buckets import fit
from ninfer_jax.runtime.device.steps import jit_encode_step
from ninfer_jax.runtime.options import EngineOptions

AGREE = 5e-2  # bf16 through 27 blocks: a few bf16 steps of the largest output; a wrong position or mask is O(1)
REAL = {"vcfg": VisionConfig(out_hidden_size=5120), "sizes": [448, 1024, 1344], "dtype": "bfloat16",
        "processor": {}}
TINY = {"vcfg": VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                             num_position_embeddings=64),
        "sizes": [64, 160], "dtype": "float32", "processor": {"size": {"shortest_edge": 32 * 32,
                                                                       "longest_edge": 256 * 256}}}


def processor(vcfg: VisionConfig, overrides: dict) -> ImageProcessorConfig:
    """The checkpoint's preprocessor_config.json (Qwen3.5's released image fields, the tower's patch sizes)."""
    return ImageProcessorConfig.from_dict({**PREPROCESSOR_FIELDS, "patch_size": vcfg.patch_size,
                                           "temporal_patch_size": vcfg.temporal_patch_size,
                                           "merge_size": vcfg.spatial_merge_size, **overrides})


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until done) over `repeats` calls, after one untimed call."""
    return float(np.median(call_seconds(fn, repeats)))


def streamed_seconds(dispatch, wait, repeats: int, batches: int = 3) -> float:
    """Seconds per image of `repeats` images dispatched back to back and waited for once (the median of `batches`
    such streams): the throughput of a stream, where a host's work for one image overlaps the device's work for
    the one before (as the engine dispatches a prompt's images)."""
    wait()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(repeats):
            dispatch()
        wait()
        times.append((time.perf_counter() - start) / repeats)
    return float(np.median(times))


def transformers_tower(vcfg: VisionConfig, tensors, dtype: str):
    """(transformers' tower with the same weights, on CUDA when torch has it; its device), or (None, why not)
    without torch or transformers' Qwen3.5 tower."""
    try:
        import torch
        from transformers.models.qwen3_5.configuration_qwen3_5 import (
            Qwen3_5VisionConfig,
        )
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    except ImportError as e:
        return None, f"no transformers tower ({e})"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fields = {f: getattr(vcfg, f) for f in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                            "out_hidden_size", "patch_size", "temporal_patch_size",
                                            "spatial_merge_size", "num_position_embeddings", "in_channels")}
    config = Qwen3_5VisionConfig(**fields, attn_implementation="sdpa")
    with torch.device(device):  # initialised where it runs: the real tower's CPU init takes long
        model = Qwen3_5VisionModel(config).eval()
    model.load_state_dict({k[len(PREFIX):]: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    return model.to(dtype=getattr(torch, dtype)), device


def run_transformers(hf, device: str, pixels: np.ndarray, grid):
    """(a call from host pixels to a finished output, that output as float32)."""
    import torch

    thw = torch.tensor([grid])

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def dispatch():
        with torch.no_grad():
            out = hf(torch.from_numpy(pixels).to(device), grid_thw=thw.to(device))
        # the merged tokens: pooler_output where the forward returns a model output, else its first value
        if hasattr(out, "pooler_output"):
            out = out.pooler_output
        elif isinstance(out, (tuple, list)):
            out = out[0]
        return out

    def call():
        out = dispatch()
        sync()
        return out

    return call, call().float().cpu().numpy(), (dispatch, sync)


def measure(params, vcfg: VisionConfig, pcfg: ImageProcessorConfig, buckets, size: int, attentions, hf, device,
            repeats: int, batch: int) -> list[dict]:
    """One image size: a row per attention implementation (and `batch` images in one call, when > 1)."""
    grid = image_grid(pcfg, size, size)
    n = grid[1] * grid[2]
    bucket = fit(n, buckets, "an image of {} patches")
    tokens = n // vcfg.spatial_merge_size**2
    pixels = np.random.default_rng(size).uniform(-1, 1, (n, vcfg.patch_dim)).astype(np.float32)
    print(f"{size}x{size}: grid {grid}, {n} patches, bucket {bucket}", flush=True)
    base = {"size": size, "grid": list(grid), "patches": n, "bucket": bucket}

    start = time.perf_counter()
    jax.block_until_ready(vision_forward(params, vcfg, pixels, [grid]))
    base["unpadded_first_call_s"] = time.perf_counter() - start
    unpadded_s = median_seconds(lambda: jax.block_until_ready(vision_forward(params, vcfg, pixels, [grid])), repeats)
    base["unpadded_images_per_s"] = 1 / unpadded_s
    print(f"  unpadded vision_forward: {1 / unpadded_s:.2f} img/s (first call "
          f"{base['unpadded_first_call_s']:.1f} s)", flush=True)

    base["transformers_images_per_s"] = theirs = None
    if hf is not None:
        call, theirs, stream = run_transformers(hf, device, pixels, grid)
        base["transformers_images_per_s"] = 1 / median_seconds(call, repeats)
        base["transformers_streamed_images_per_s"] = 1 / streamed_seconds(*stream, repeats)
        print(f"  transformers: {base['transformers_images_per_s']:.2f} img/s one at a time, "
              f"{base['transformers_streamed_images_per_s']:.2f} streamed", flush=True)

    base["host_prep_ms"] = 1e3 * median_seconds(lambda: jax.block_until_ready(
        jax.device_put(pad_image(vcfg, pixels, grid, bucket))), repeats)
    rows = []
    for attention in attentions:
        row = {**base, "attention": attention}

        def encode(host=None, attention=attention):
            inputs = jax.device_put(pad_image(vcfg, pixels, grid, bucket)) if host is None else host
            return jax.block_until_ready(encode_padded(params, vcfg, *inputs, attention=attention))

        try:
            start = time.perf_counter()
            ours = np.asarray(encode(), np.float32)[:tokens]
            row["first_call_s"] = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 -- cuDNN refuses some shapes and dtypes: report, go on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"  {attention}: {row['error']}", flush=True)
            rows.append(row)
            continue
        row["images_per_s"] = 1 / median_seconds(encode, repeats)
        on_device = jax.device_put(pad_image(vcfg, pixels, grid, bucket))
        row["device_images_per_s"] = 1 / median_seconds(lambda host=on_device: encode(host), repeats)
        if theirs is not None:
            row["rel_diff"] = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            row["agrees"] = row["rel_diff"] < AGREE
            row["speedup"] = row["images_per_s"] / base["transformers_images_per_s"]
        print(f"  padded, {attention}: {row['images_per_s']:.2f} img/s from host, "
              f"{row['device_images_per_s']:.2f} on device (first call {row['first_call_s']:.1f} s)"
              + (f", {row['speedup']:.2f}x transformers, rel. diff {row['rel_diff']:.2g}"
                 + ("" if row["agrees"] else f" -- DISAGREES (> {AGREE})") if theirs is not None else ""),
              flush=True)
        measure_engine_form(params, vcfg, pcfg, row, grid, attention, repeats)
        if batch > 1:
            measure_batch(params, vcfg, row, pixels, grid, ours, batch, repeats)
        rows.append(row)
    return rows


def measure_engine_form(params, vcfg: VisionConfig, pcfg: ImageProcessorConfig, row: dict, grid, attention: str,
                        repeats: int) -> None:
    """The engine's form, into `row`: uint8 patches from the host (an eighth of pixel_values' bytes), normalised on
    the device by the processor's table, the grid's metadata cached, the output scattered into media rows (the
    runner's own jitted step). Checked against `encode_padded` of the same pixels."""
    n, bucket, m = row["patches"], row["bucket"], vcfg.spatial_merge_size
    p, tokens = vcfg.patch_size, row["patches"] // m**2
    patches = np.random.default_rng(n).integers(0, 256, (n, 3, p, p), dtype=np.uint8)
    table = normalization_table(pcfg)
    rows = np.full(bucket // m**2, bucket // m**2, np.int32)
    rows[:tokens] = np.arange(tokens)
    step = jit_encode_step()
    media = [jax.numpy.zeros((bucket // m**2, vcfg.out_hidden_size), params.patch_w.dtype)]

    def dispatch():
        padded = np.zeros((bucket, 3, p, p), np.uint8)
        padded[:n] = patches
        media[0] = step(params, vcfg, attention, media[0], table, padded, *padded_metadata(vcfg, tuple(grid), bucket),
                        rows)

    def encode():
        dispatch()
        return jax.block_until_ready(media[0])

    try:
        ours = np.asarray(encode(), np.float32)[:tokens]
        pixels = pixel_values_of(table, patches, pcfg.temporal_patch_size)
        want = np.asarray(encode_padded(params, vcfg, *pad_image(vcfg, pixels, grid, bucket), attention=attention),
                          np.float32)[:tokens]
    except Exception as e:  # noqa: BLE001 -- as for the padded encoder
        row["engine_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return
    row["engine_equal"] = bool(np.array_equal(ours, want))
    row["engine_images_per_s"] = 1 / median_seconds(encode, repeats)
    row["engine_streamed_images_per_s"] = 1 / streamed_seconds(dispatch, lambda: jax.block_until_ready(media[0]),
                                                                 repeats)
    if row.get("transformers_images_per_s"):
        row["engine_speedup"] = row["engine_images_per_s"] / row["transformers_images_per_s"]
        row["streamed_speedup"] = row["engine_streamed_images_per_s"] / row["transformers_streamed_images_per_s"]
    print(f"  engine form (uint8 from host), {attention}: {row['engine_images_per_s']:.2f} img/s one at a time, "
          f"{row['engine_streamed_images_per_s']:.2f} streamed"
          + (f" ({row['streamed_speedup']:.2f}x transformers streamed)" if "streamed_speedup" in row else "")
          + f", equal to encode_padded: {row['engine_equal']}", flush=True)


def measure_batch(params, vcfg: VisionConfig, row: dict, pixels, grid, single, batch: int, repeats: int) -> None:
    """`batch` copies of the image in one `encode_padded_batch` call, from host pixels, into `row`."""
    bucket, tokens, attention = row["bucket"], len(single), row["attention"]

    def encode():
        images = jax.device_put(stack_images([pad_image(vcfg, pixels, grid, bucket)] * batch))
        return jax.block_until_ready(encode_padded_batch(params, vcfg, *images, attention=attention))

    try:
        out = np.asarray(encode(), np.float32)[:, :tokens]
    except Exception as e:  # noqa: BLE001 -- as for one image
        row["batch_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  batch of {batch}, {attention}: {row['batch_error']}", flush=True)
        return
    row["batch"] = batch
    row["batch_images_per_s"] = batch / median_seconds(encode, repeats)
    row["batch_diff_to_single"] = float(np.abs(out - single).max() / np.abs(single).max())
    print(f"  batch of {batch}, {attention}: {row['batch_images_per_s']:.2f} img/s from host "
          f"(rel. diff to one at a time {row['batch_diff_to_single']:.2g})", flush=True)


def page_lines(meta: dict, vcfg: VisionConfig, dtype: str, buckets, rows: list[dict], hf_note: str) -> list[str]:
    f = report.fmt
    cells = [[f"{r['size']}x{r['size']}", "x".join(map(str, r["grid"][1:])), r["patches"], r["bucket"],
              r["attention"], f(r.get("images_per_s")), f(r.get("device_images_per_s")),
              f(r["unpadded_images_per_s"]), f(r["transformers_images_per_s"]),
              f"{r['speedup']:.2f}x" if r.get("speedup") else "-", f(r.get("rel_diff")),
              f(r.get("batch_images_per_s")), f(r.get("first_call_s")), f(r["host_prep_ms"]),
              f(r.get("engine_images_per_s")),
              f"{r['engine_speedup']:.2f}x" if r.get("engine_speedup") else "-",
              f(r.get("engine_streamed_images_per_s")), f(r.get("transformers_streamed_images_per_s")),
              f"{r['streamed_speedup']:.2f}x" if r.get("streamed_speedup") else "-"] for r in rows]
    lines = report.header(
        "Vision encoder: padded buckets against transformers", meta, f"tower: {vcfg}", f"dtype: {dtype}",
        f"patch buckets: {', '.join(map(str, buckets))}", f"transformers: {hf_note}",
        "one image per call; img/s from host pixels to a finished device output (ours: pad_image, transfer, "
        "encode; transformers: transfer, forward, CUDA sync); 'device' is the encoder call on device inputs; "
        f"rel. diff is max |ours - transformers| / max |transformers| over the valid rows (agree below {AGREE}); "
        f"batched: {next((r['batch'] for r in rows if 'batch' in r), '-')} copies of the image per "
        "`encode_padded_batch` call, from host pixels; engine form: the runner's encode step from uint8 patches on "
        "the host (normalised on the device, grid metadata cached, output scattered into media rows); streamed: "
        "images dispatched back to back and waited for once (the engine dispatches a prompt's images so), "
        "transformers' forwards likewise with one CUDA sync")
    lines += report.table(["image", "grid", "patches", "bucket", "attention", "ours img/s", "ours img/s (device)",
                           "unpadded img/s", "transformers img/s", "speedup", "rel. diff", "batched img/s",
                           "first call s", "host prep ms", "engine form img/s", "engine speedup",
                           "engine streamed img/s", "transformers streamed img/s", "streamed speedup"], cells)
    errors = [f"- {r['size']} {r['attention']} {key}: {r[key]}"
              for r in rows for key in ("error", "batch_error", "engine_error") if key in r]
    return lines + ([""] + errors if errors else [])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="report folder (default: a temporary one)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="a tiny tower in float32 (CPU, seconds)")
    ap.add_argument("--no-torch", action="store_true", help="ours only, without transformers")
    ap.add_argument("--batch", type=int, default=4,
                    help="images per encode_padded_batch call, timed at the smallest size (1: not timed)")
    ap.add_argument("--warmup", action="store_true",
                    help="also time warmup_padded over every bucket (an engine's startup compile)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which no further image size starts (the page keeps those done)")
    ap.add_argument("--attention", default=None,
                    help="comma-separated jax attention implementations (default: xla,cudnn on GPU, xla elsewhere)")
    args = ap.parse_args()
    started = time.perf_counter()
    setup = TINY if args.tiny else REAL
    vcfg, dtype = setup["vcfg"], setup["dtype"]
    gpu = jax.default_backend() == "gpu"
    attentions = (args.attention or ("xla,cudnn" if gpu else "xla")).split(",")
    pcfg = processor(vcfg, setup["processor"])
    patch_area = vcfg.patch_size**2
    # The engine's buckets: images resized to at most the default max_image_tokens
    most = min(pcfg.max_pixels // patch_area, EngineOptions().max_image_tokens * vcfg.spatial_merge_size**2)
    buckets = patch_buckets(vcfg, most, min_patches=pcfg.min_pixels // patch_area)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; buckets {buckets}; drawing weights", flush=True)
    tensors = {k: v.astype(np.float32) for k, v in random_vision_tensors(vcfg, np.random.default_rng(0)).items()}
    params = vision_params_from_tensors(vcfg, lambda name, shape: tensors[name],
                                        lambda a: jnp.asarray(np.ascontiguousarray(a), dtype))
    hf, device = (None, "not run (--no-torch)") if args.no_torch else transformers_tower(vcfg, tensors, dtype)
    if hf is None:
        hf_note, device = device, None
    else:
        import transformers

        hf_note = f"Qwen3_5VisionModel, sdpa, transformers {transformers.__version__}, on {device}"
    print(f"transformers: {hf_note}", flush=True)
    out = args.out or tempfile.mkdtemp(prefix="bench_vision_")
    meta = report.run_meta(transformers=hf_note)
    rows, skipped, warmups = [], [], []

    def write():  # after each step, so a run stopped from outside still leaves its page
        data = {**meta, "vision_config": str(vcfg), "dtype": dtype, "buckets": list(buckets), "rows": rows,
                "skipped_sizes": skipped, "warmup": warmups}
        page = page_lines(meta, vcfg, dtype, buckets, rows, hf_note)
        page += [""] + [f"- skipped (--deadline): {skipped}"] * bool(skipped) + [warmup_line(w) for w in warmups]
        return report.write_report(out, "vision", data, page)

    for size in setup["sizes"]:
        if args.deadline and time.perf_counter() - started > args.deadline:
            skipped.append(size)
            print(f"{size}x{size}: skipped, past the --deadline of {args.deadline:g} s", flush=True)
        else:
            batch = args.batch if size == setup["sizes"][0] else 1  # small images: where one call idles the GPU
            rows += measure(params, vcfg, pcfg, buckets, size, attentions, hf, device, args.repeats, batch)
        path = write()
    # cuDNN's first: XLA's logits of the largest buckets may not fit the GPU
    for attention in sorted(attentions, key=lambda a: a != "cudnn") if args.warmup else ():
        if args.deadline and time.perf_counter() - started > args.deadline:
            print(f"warm-up, {attention}: skipped, past the --deadline", flush=True)
            continue
        warmups.append(warmup(params, vcfg, buckets, attention))
        path = write()
    print(path, flush=True)


def warmup_line(w: dict) -> str:
    if "error" in w:
        return f"- warm-up, {w['attention']}: failed ({w['error']})"
    return f"- warm-up, {w['attention']}: {w['seconds']:.1f} s for the {w['programs']} buckets not compiled above"


def warmup(params, vcfg: VisionConfig, buckets, attention: str) -> dict:
    """Seconds `warmup_padded` takes over every bucket (an engine's startup), less those compiled already."""
    before = padded_compile_count()
    start = time.perf_counter()
    try:
        warmup_padded(params, vcfg, buckets, attention)
    except Exception as e:  # noqa: BLE001 -- XLA's logits of the largest buckets outgrow the GPU: report, go on
        result = {"attention": attention, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"warm-up, {attention}: {result['error']}", flush=True)
        return result
    result = {"attention": attention, "programs": padded_compile_count() - before,
              "seconds": time.perf_counter() - start}
    print(f"warm-up, {attention}: {result['seconds']:.1f} s for {result['programs']} more buckets", flush=True)
    return result


if __name__ == "__main__":
    main()
