"""Tensor and expert parallel of the real Qwen3.5 shapes, read on a CPU before any multi-GPU run: per device, the
weight bytes, one KV page and one state slot, and the collectives XLA puts into a sharded decode round (the
runner's own step, compiled for 8 forced host devices; `ninfer_jax/benchmarks/sharding_report.py`). Nothing is
allocated: the params and pools are shapes. Writes docs/benchmarks/sharding.{json,md} (or --out DIR).

    python scripts/report_sharding.py                      # 27B, 35B-A3B, 122B-A10B, 397B-A17B at TP 1-8, ~5 min
    python scripts/report_sharding.py --models 27b --sizes 1,2 --out /tmp/x
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402

from ninfer_jax.benchmarks import report  # noqa: E402
from ninfer_jax.benchmarks.models import model_config  # noqa: E402
from ninfer_jax.benchmarks.sharding_report import COLLECTIVES, report as sharding_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="27b,35b-a3b,122b-a10b,397b-a17b")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--rows", type=int, default=8, help="the decode round's rows")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    models = {m: model_config(m) for m in args.models.split(",")}
    rows = sharding_rows(models, [int(s) for s in args.sizes.split(",")], [args.rows])
    meta = report.run_meta(device="CPU, 8 forced host devices (shapes only)")
    gib, mib = 2**30, 2**20
    page = report.header(
        "Tensor and expert parallel, per device (read on a CPU)", meta,
        f"a decode round of {args.rows} rows through the runner's jitted step on the mesh (`--tensor-parallel-size`,"
        " `--enable-expert-parallel`), reference kernels, bf16 weights and KV; compiled for CPU host devices, whose "
        "collectives are XLA's partitioner's choices (a GPU compile may fuse or schedule them differently, never "
        "remove them)",
        "weights: every param a device holds, the MTP layer included, bf16 and as Qwen's block-FP8 packs hold them "
        "(projections and experts FP8 with their scales); page: one 64-token KV page of every attention "
        "layer; slot: one GDN state slot (ssm f32 + conv) of every GDN layer",
        "collectives: ops and bytes of their results per round, the whole layer stack (one- and two-period compiles "
        "extrapolated exactly: `sharding_report.decode_collectives`)")
    page += report.table(
        ["model", "TP", "EP", "weights GiB / device", "FP8 weights GiB / device", "page KiB / device",
         "slot MiB / device",
         *[f"{k} ops (MiB)" for k in COLLECTIVES], "compile s"],
        [[r["model"], r["tp"], "yes" if r["ep"] else "", f"{r['weights'] / gib:.1f}", f"{r['weights_fp8'] / gib:.1f}",
          f"{r['page'] / 2**10:.0f}",
          f"{r['slot'] / mib:.1f}",
          *[f"{c['ops']} ({c['bytes'] / mib:.2f})" if (c := r["collectives"].get(k)) else "" for k in COLLECTIVES],
          f"{r['compile_s']:.1f}"] for r in rows])
    print(report.write_report(args.out, "sharding", {**meta, "rows": rows}, page), flush=True)


if __name__ == "__main__":
    main()
