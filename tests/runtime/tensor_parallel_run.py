"""Serves the same conversations on tiny checkpoints under several parallel layouts, in a process of its own
(`test_tensor_parallel.py` starts it with XLA_FLAGS forcing 8 host devices, which jax reads when it starts).

usage: python tests/runtime/tensor_parallel_run.py WORKDIR CHECKPOINT LAYOUTS [CHECKPOINT LAYOUTS ...]
LAYOUTS: comma-separated tensor parallel sizes, ":ep" for expert parallel, ":ngram" or ":mtp" for speculative
decoding by prompt lookup or the MTP layer (e.g. 1,2,4,8,2:ep); the first is the reference. Prints one JSON line
per layout: its stats' "parallel", the file's load outcome and, per turn, the tokens and cache record (an
AssertionError from a ledger check fails the run); then, for the last layout, whether random weights made on its
mesh equal the one-device ones placed on it (`dummy_init`).

One engine per layout, in order, on one prefix cache file: each loads the file the engine before it saved at its
stop, so the file crosses layouts too. Layout k first resumes conversation C from that file, then serves its turn
set k: two greedy prompts at once (a decode round of two lanes), a follow-up that resumes from the Device cache,
and one that resumes from the Host tier after `demote_device_cache`. The reference serves C's opening (for the
file), then every other layout's turn set and C's resumed prompt without the cache (so its file holds C alone): each
resume is compared with a cold computation. Turn sets share no prefix, so one set's entries never serve another's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from ninfer_jax import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
COLD = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0, prefix_cache=False)
# Snapshot slots for every tap and endpoint a layout's turns make, so the Device turn finds its image on the Device;
# 8 KV pages hold a layout's turns and compile the Host transfers of 1 to 8 pages only; full-width rounds compile one
# decode program, not two (each compile of a sharded program is most of a layout's time)
OPTIONS = {"max_concurrency": 2, "prefill_chunk": 64, "max_model_len": 512, "output_window": 64, "kv_capacity": 512,
           "host_cache_mib": 16, "device_snapshot_slots": 8, "batch_invariant": True, "warmup": False}


class Prompts:
    """Random prompts over a checkpoint's vocabulary, each seed its own."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, n: int, seed: int) -> list[int]:
        return np.random.default_rng(seed).integers(0, self.vocab, n).tolist()


def turn(engine, prompt, sampling=GREEDY) -> dict:
    out = engine.generate(prompt, sampling)
    record = engine.cache_record(out.request_id)
    return {"tokens": list(out.token_ids), "logprobs": [e["logprob"] for e in out.logprobs or ()],
            "cached": record["cached_tokens"],
            "host_bytes": record["restored_host_bytes"]}


def turn_set(engine, prompts: Prompts, k: int, sampling=GREEDY) -> dict:
    a, b = prompts(150, 10 * k + 1), prompts(140, 10 * k + 2)
    first = engine.generate_many([a, b], sampling)
    out = {"first": [list(o.token_ids) for o in first]}
    out["device"] = turn(engine, a + list(first[0].token_ids) + prompts(20, 10 * k + 3), sampling)
    out["demoted"] = engine.demote_device_cache()
    out["host"] = turn(engine, b + list(first[1].token_ids) + prompts(20, 10 * k + 4), sampling)
    return out


def serve(checkpoint: str, cache_file: Path, layouts: list[str], k: int, prompts: Prompts) -> dict:
    """Layout k's engine and turns (k = 0: the reference's)."""
    tp, _, mode = layouts[k].partition(":")
    speculative = mode in ("ngram", "mtp")
    options = dict(OPTIONS, speculative=mode, batch_invariant=False) if speculative else OPTIONS
    engine = Engine.from_pretrained(checkpoint, tensor_parallel_size=int(tp), enable_expert_parallel=mode == "ep",
                                    prefix_cache_file=str(cache_file), **options)
    stats = engine.stats()
    result = {"layout": layouts[k], "parallel": stats["parallel"], "loaded": stats["prefix_cache"]["loaded"]["outcome"]}
    opening = prompts(150, 7)
    resumed = opening + prompts(30, 8)
    if k:
        result["file"] = turn(engine, resumed)
        result["sets"] = {k: turn_set(engine, prompts, k)}
    else:
        engine.generate(opening, GREEDY)
        result["sets"] = {i: turn_set(engine, prompts, i, COLD) for i in range(1, len(layouts))}
        result["file"] = turn(engine, resumed, COLD)
    if speculative:  # the tiny model's greedy output here cycles, so lookup drafts are kept too
        result["repeats"] = turn(engine, resumed, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                                                 prefix_cache=False))  # the next file unchanged
        result["drafted"] = engine.stats()["speculative"]["drafted"]
    engine.check_ledger()
    engine.stop()  # saves the Host tier to the file
    return result


def dummy_init(checkpoint: str, layout: str) -> dict:
    """Whether random weights made shard by shard on the layout's mesh (`ParallelLayout.init_params`, as a
    load_format "dummy" engine makes them) equal the one-device ones placed by `place_params`, leaf by leaf."""
    import jax

    from ninfer_jax.model.loader import load_dummy
    from ninfer_jax.runtime.device.sharding import ParallelLayout

    tp, _, ep = layout.partition(":")
    mesh = ParallelLayout.over(int(tp), expert_parallel=ep == "ep")
    config = str(Path(checkpoint) / "config.json")
    _, made, _ = load_dummy(config, "float32", init=mesh.init_params)
    cfg, canonical, _ = load_dummy(config, "float32")
    placed = mesh.place_params(canonical, cfg)
    pairs = list(zip(jax.tree.leaves(made), jax.tree.leaves(placed)))
    return {"layout": layout, "leaves": len(pairs),
            "equal": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
            "same_shardings": all(a.sharding == b.sharding for a, b in pairs)}


def main(argv: list[str]) -> None:
    workdir, *groups = argv
    for checkpoint, layouts in zip(groups[::2], groups[1::2]):
        prompts = Prompts(json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"])
        cache_file = Path(workdir) / f"{Path(checkpoint).name}.cache"
        layouts = layouts.split(",")
        for k in range(len(layouts)):
            start = time.perf_counter()
            result = serve(checkpoint, cache_file, layouts, k, prompts)
            print(json.dumps({"checkpoint": Path(checkpoint).name, **result,
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)
        print(json.dumps({"checkpoint": Path(checkpoint).name, "dummy_init": dummy_init(checkpoint, layouts[-1])}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
