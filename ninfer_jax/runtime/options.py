"""Every engine and prefix-cache option, declared once and resolved once (spec §14.2).

Each `EngineOptions` field carries its declaration, an `Option`: type, default (or the rule that derives it),
bounds or choices, help and command-line flag. `EngineOptions.resolve` checks values against those declarations
and derives what is unset; `add_engine_arguments` and `engine_kwargs_from_args` build ninfer-serve's and
ninfer-generate's engine flags from them, so help, bounds and conflicts cannot differ between the three.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from ninfer_jax.prefix_cache.hashing import BLOCK_TOKENS
from ninfer_jax.prefix_cache.options import (DEFAULT_HOST_CACHE_BYTES, PrefixCacheOptions, default_max_new_taps,
                                             default_snapshot_slots, default_tap_ladder_tokens,
                                             default_tap_min_gap_tokens, tap_spacing_problem)
from ninfer_jax.runtime.device.buckets import FIRST_LANES, FIRST_PASS_TOKENS

__all__ = [
    "AUTO_LANE_KV_TOKENS", "CPU_CONCURRENCY", "DENSE_MIXED_TOKENS", "DENSE_PREFILL_CHUNK", "HOST_CACHE_CAP_MIB",
    "HOST_CACHE_SHARE", "MAX_COMPILE_THREADS", "MAX_CONCURRENCY", "MAX_DEFAULT_MODEL_LEN", "MOE_IDLE_PREFILL_CHUNK",
    "MOE_MIXED_TOKENS", "MOE_PREFILL_CHUNK", "OPTIONS", "EngineOptions", "Option", "OptionsError",
    "add_engine_arguments", "auto_host_cache_mib", "default_max_new_taps", "default_snapshot_slots",
    "engine_kwargs_from_args", "flag_words", "snapshot_slots",
]


def snapshot_slots(lanes: int, host_tier: bool, no_prefix_reuse: bool) -> int:
    """device_snapshot_slots when unset: the cache's rule (`default_snapshot_slots`), or 1 with the cache off, where
    nothing is ever snapshotted (the index keeps one slot; C + 2 would hold 257 unused slots at 256 lanes)."""
    return 1 if no_prefix_reuse else default_snapshot_slots(lanes, host_tier)


class OptionsError(ValueError):
    """Conflicting or invalid engine options; the message names the option."""


# A dense model's projections reach the matmul rate at 2048 rows per pass. An MoE layer reads every expert's
# weights once per pass, so a longer pass reads them fewer times per token (docs/benchmarks/prefill_profile.md).
DENSE_PREFILL_CHUNK = 2048
MOE_PREFILL_CHUNK = 8192
# While no lane decodes nobody waits on a prefill pass, so an MoE model takes longer ones and reads its experts'
# weights fewer times still. A dense model gains less than two more compiled programs cost, so its idle pass stays
# its prefill chunk (docs/benchmarks/prefill_profile.md).
MOE_IDLE_PREFILL_CHUNK = 32768
# A pass that rides in one step with the running lanes' decode round (mixed_prefill_tokens) lengthens every running
# request's token by its own compute: a dense model's 256 tokens cost about what a wide round does. A round of an MoE
# model already reads most experts' weights, which a longer pass then shares: at 64 lanes of the 35B-A3B, 512 tokens
# keep TPOT p99 within 2x of decoding alone where 1024 do not (docs/benchmarks/arrivals.md).
DENSE_MIXED_TOKENS = 256
MOE_MIXED_TOKENS = 512
MAX_DEFAULT_MODEL_LEN = 32768  # the default context: the model's limit, at most this
MAX_CONCURRENCY = 256  # vLLM's and SGLang's default running sequences; a decode round's weights serve them all
CPU_CONCURRENCY = 4  # max_concurrency auto where the device reports no memory (a CPU)
# max_concurrency auto on a GPU gives each lane room for this much context in the KV pool (max_model_len if
# shorter): lanes share the pool, so one long prompt still fits while the others are short.
AUTO_LANE_KV_TOKENS = 8192
# host_cache_mib auto: this share of the memory available at startup, at most HOST_CACHE_CAP_MIB. The rest stays to
# the process (weights on their way to the device, the tokenizer's threads) and to other processes; the cap keeps
# the page-locking of the tier at startup short.
HOST_CACHE_SHARE = 0.25
HOST_CACHE_CAP_MIB = 64 << 10
MAX_SPECULATIVE_TOKENS = 4
DEFAULT_SPECULATIVE_TOKENS = 3
# compile_threads auto: one per CPU core, at most this many. Not measured past 2 cores yet (docs/engine_notes.md
# "Compiling"); each compile also holds its own scratch and autotuning buffers on the device.
MAX_COMPILE_THREADS = 8
# The KV storage profiles of pallas_kernels.kv_quant (spec §3.1), named here so the options stay free of jax
KV_DTYPES = ("auto", "bfloat16", "int8", "fp8", "k8v4", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option's declaration. A default of None means `EngineOptions.resolve` derives it (`rule` says how)."""

    kind: type  # int, float, str, bool or Path
    default: Any
    help: str  # plain words first, spec terms after
    flag: str | None = None  # the command lines' flag (spec §14.2's name where it has one); None: library only
    vllm_flag: str | None = None  # vLLM's flag for the same setting, taken too, so its command lines carry over
    choices: tuple = ()
    minimum: int | None = None
    maximum: int | float | None = None
    above: float | None = None  # an exclusive lower bound
    multiple_of: int | None = None
    auto: bool = False  # "auto" is a value too
    rule: str | None = None  # the derived default, in words
    cache: bool = False  # a prefix-cache setting: listed with the cache's flags, refused with no_prefix_reuse
    cli_default: str | None = None  # the command lines' default where the library's differs
    metavar: str | None = None
    name: str = ""  # the EngineOptions field (filled in from it)

    def allowed(self) -> str:
        """The values it takes, in words."""
        if self.choices:
            words = [repr(c) for c in self.choices]
            return f"{', '.join(words[:-1])} or {words[-1]}"
        if self.kind is bool:
            return "True or False"
        if self.kind is Path:
            return "a file path"
        if self.multiple_of:
            text = f"a positive multiple of {self.multiple_of}"
        elif self.above is not None:
            text = f"in ({self.above:g}, {self.maximum:g}]"
        elif self.maximum is not None:
            text = f"in {self.minimum}..{self.maximum}"
        elif self.minimum == 1:
            text = "a positive integer"
        else:
            text = f">= {self.minimum}"
        return f"'auto' or {text}" if self.auto else text

    def problem(self, value: Any) -> str | None:
        """Why `value` is not one this option takes (None: it is)."""
        if (value is None and self.default is None) or (self.auto and value == "auto"):
            return None
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is Path:
            ok = isinstance(value, (str, os.PathLike))
        elif self.kind is str:
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, (int, float) if self.kind is float else int) and not isinstance(value, bool)
        ok = ok and (not self.choices or value in self.choices)
        ok = ok and (self.minimum is None or value >= self.minimum)
        ok = ok and (self.maximum is None or value <= self.maximum)
        ok = ok and (self.above is None or value > self.above)
        ok = ok and (not self.multiple_of or value % self.multiple_of == 0)
        return None if ok else f"must be {self.allowed()}, got {value!r}"

    def help_text(self) -> str:
        """The command lines' help: the declaration's words and its default."""
        text = self.help
        if self.maximum is not None and self.minimum is not None:
            text += f", {self.minimum}..{self.maximum}"
        if self.multiple_of:
            text += f", a multiple of {self.multiple_of}"
        default = ("on" if self.default else None) if self.kind is bool \
            else self.cli_default or self.rule or self.default
        text = text if default is None else f"{text}; default {default}"
        return text if self.vllm_flag is None else f"{text} (vLLM's {self.vllm_flag} too)"


def _option(kind: type, default: Any, help: str, **declaration) -> Any:
    """An EngineOptions field with its declaration."""
    return dataclasses.field(default=default, metadata={"option": Option(kind, default, help, **declaration)})


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine settings, one declared option per field. `resolve()` returns a copy with every derived value."""

    dtype: str = _option(
        str, "bfloat16", "weights and KV cache precision; auto: float32 on a CPU, bfloat16 on a GPU",
        flag="--dtype", choices=("bfloat16", "float32"), cli_default="auto")
    max_concurrency: int | str = _option(
        int, "auto", "requests decoded together (lanes, spec C)", flag="--max-concurrency", minimum=1,
        maximum=MAX_CONCURRENCY, auto=True, vllm_flag="--max-num-seqs",
        rule=f"auto: on a GPU the most lanes (at most {MAX_CONCURRENCY}) whose state slots (C + D) and "
             f"{AUTO_LANE_KV_TOKENS} KV tokens each (max_model_len if shorter) fit the memory left after the "
             f"weights and the longest prefill pass; {CPU_CONCURRENCY} on a CPU")
    scheduling_policy: str = _option(
        str, "fcfs", "the order in which waiting requests get a lane: fcfs (arrival) or priority (each request's "
        "priority, lower first, arrival breaking ties, as vLLM's; a running request is never preempted for one)",
        flag="--scheduling-policy", choices=("fcfs", "priority"))
    prefill_chunk: int | None = _option(
        int, None, "prompt tokens per prefill pass; a longer pass keeps running requests' decode waiting longer",
        flag="--prefill-chunk", minimum=64, multiple_of=64,
        rule=f"{DENSE_PREFILL_CHUNK}, or {MOE_PREFILL_CHUNK} for a model with routed experts")
    idle_prefill_chunk: int | None = _option(
        int, None, "prompt tokens per prefill pass while no request decodes (a prompt takes this or its half), "
        "at least the prefill chunk", flag="--idle-prefill-chunk", minimum=64, multiple_of=64,
        rule=f"{MOE_IDLE_PREFILL_CHUNK} for a model with routed experts, else the prefill chunk")
    mixed_prefill_tokens: int | str = _option(
        int, "auto", "prompt tokens a prefill pass takes while requests decode, run in one step with their decode "
        "round so the round's weight reads carry it (chunked prefill); 0: passes of the prefill chunk and rounds "
        "as separate steps", flag="--mixed-prefill-tokens", minimum=0, multiple_of=64, auto=True,
        rule=f"auto: on a GPU {DENSE_MIXED_TOKENS}, or {MOE_MIXED_TOKENS} for a model with routed experts (at most "
             f"the prefill chunk); 0 on a CPU, with speculative decoding and with batch_invariant")
    kv_capacity: int | str = _option(
        int, "auto", "KV cache size in tokens; auto: the device memory left after the weights",
        flag="--kv-capacity", minimum=1, auto=True, metavar="TOKENS")
    kv_dtype: str = _option(
        str, "auto", "KV cache storage (spec §3.1): the activations' dtype (auto), bfloat16, or quantized: int8 "
        "(INT8, a scale per 64 values), fp8 (FP8-E4M3, a scale per 256), k8v4 (FP8 keys, NVFP4 values), nvfp4 "
        "(e2m1, an FP8 scale per 16)", flag="--kv-dtype", choices=KV_DTYPES, vllm_flag="--kv-cache-dtype")
    generation_config: str = _option(
        str, "auto", "default sampling of requests that leave it unset: auto (the checkpoint's generation_config.json: "
        "its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens, as vLLM takes them), none "
        "(vLLM's own defaults), or a generation_config.json file or its folder", flag="--generation-config",
        metavar="auto|none|PATH")
    chat_template: str | None = _option(
        str, None, "a Jinja chat template that renders conversations instead of the checkpoint's (its "
        "chat_template.jinja or tokenizer_config.json's): a file, or the template itself when no such file exists "
        "and it holds Jinja tags, as vLLM's --chat-template; the output is still read as Qwen3.5's (think blocks, "
        "XML tool calls)", flag="--chat-template", metavar="FILE|TEMPLATE")
    load_format: str = _option(
        str, "auto", "how the weights load: auto (the checkpoint's safetensors) or dummy (random weights at the shapes "
        "of the checkpoint's config.json, or of a config .json file given as the checkpoint: benchmarks at real "
        "shapes without the weights, as vLLM's --load-format dummy)", flag="--load-format", choices=("auto", "dummy"))
    max_model_len: int | None = _option(
        int, None, "longest prompt plus completion, in tokens (context length)", flag="--max-model-len",
        minimum=2, rule=f"the model's limit, at most {MAX_DEFAULT_MODEL_LEN}")
    kernels: str = _option(
        str, "auto", "hot operations as Pallas kernels or as the jnp references; auto: pallas on a GPU",
        flag="--kernels", choices=("auto", "reference", "pallas"))
    # cuDNN was measured faster on a Hopper GPU only (docs/benchmarks/prefill_profile.md); other GPUs were not
    # measured, so "auto" keeps them on the Pallas kernel.
    prefill_attention: str = _option(
        str, "auto", "prefill attention with the Pallas kernels: the paged Pallas kernel, or gathered keys through "
        "cuDNN flash attention (GPU, bf16); auto: cudnn on a Hopper GPU, where it was measured faster",
        flag="--prefill-attention", choices=("auto", "pallas", "cudnn"))
    # Weight-only keeps the products within bf16 rounding of the dequantized weights; the packs' own scheme
    # quantizes activations too, which made the 27B's projections 1.4x faster at 8 rows and 1.3-1.7x at 2048-8192
    # (docs/kernels_notes.md).
    fp8_activations: str = _option(
        str, "weight-only", "with a block-FP8 checkpoint, what the projections multiply: bf16 activations with the "
        "FP8 weights, or dynamic: activations quantized to FP8 per token and 128-group (the packs' "
        "activation_scheme) for FP8 x FP8 products where the kernels measured faster: decode rounds of 2-32 lanes, "
        "MoE experts routed up to MoeConfig.fp8_dynamic_rows_per_expert rows a expert, and on a Hopper GPU wider "
        "rounds and prefill, MoE experts too (about 0.026 relative error per projection; docs/kernels_notes.md, "
        "\"FP8 weights\")",
        flag="--fp8-activations",
        choices=("weight-only", "dynamic"))
    speculative: str | None = _option(
        str, None, "speculative decoding: ngram (drafts from the longest earlier match of the last tokens in the "
        "prompt and output, prompt lookup) or mtp (drafts chained from the checkpoint's multi-token-prediction "
        "layer), verified exactly by the model", flag="--speculative",
        choices=("ngram", "mtp"))
    num_speculative_tokens: int | None = _option(
        int, None, "draft tokens per lane and round", flag="--num-speculative-tokens", minimum=1,
        maximum=MAX_SPECULATIVE_TOKENS, rule="3 with speculative decoding")
    adaptive_speculation: str = _option(
        str, "auto", "decode plainly while verify rounds measure slower than plain ones, per round width, and try "
        "speculation again after a run of plain rounds", flag="--adaptive-speculation", choices=("auto", "on", "off"),
        rule="auto: on with a GPU; off on a CPU, where the rounds' kinds then follow from the requests alone")
    prompt_lookup_max: int = _option(
        int, 4, "longest n-gram that prompt lookup matches", flag="--prompt-lookup-max", minimum=1, maximum=16)
    prompt_lookup_min: int = _option(
        int, 2, "shortest n-gram that prompt lookup matches", flag="--prompt-lookup-min", minimum=1, maximum=16)
    max_image_tokens: int = _option(
        int, 2048, "most placeholder tokens one image takes: a larger image is resized down to fit (as the image "
        "processor's max_pixels does); bounds the vision encoder's compiled sizes", flag="--max-image-tokens",
        minimum=4)
    vision_cache_tokens: int | str = _option(
        int, "auto", "image encoder outputs kept on the device, in tokens: a repeated image is encoded once",
        flag="--vision-cache-tokens", minimum=4, auto=True,
        rule="auto: the prefill chunk + 4 x max_image_tokens; at least the prefill chunk + 2 x max_image_tokens "
             "(the images one prefill pass reads)")
    interpret: bool = _option(bool, False, "run the Pallas kernels in interpret mode (CPU tests)")
    output_window: int = _option(
        int, 512, "completion tokens whose KV pages a request reserves ahead (bounded completion, spec §9.5)",
        minimum=1)
    memory_fraction: float = _option(
        float, 0.9, "share of the free device memory that KV capacity auto may take", above=0, maximum=1)
    compile_threads: int | str = _option(
        int, "auto", "programs the warm-up compiles at once (it runs them one at a time afterwards)",
        flag="--compile-threads", minimum=1, auto=True,
        rule=f"auto: one per CPU core the process may use, at most {MAX_COMPILE_THREADS}")
    # A step lowered from shapes is found by the call with the runner's arrays only where those are uncommitted, as
    # they are on one device: on a mesh the background's programs would compile again on the engine's thread.
    background_compile: str = _option(
        str, "auto", "serve once the programs every request needs are compiled (passes of "
        f"{FIRST_PASS_TOKENS} tokens, rounds of {FIRST_LANES} lanes, no mixed steps) and compile the rest on "
        "background threads, which the steps use once all of it is compiled", flag="--background-compile",
        choices=("auto", "on", "off"), rule="auto: on with one GPU (its full warm-up takes minutes), off elsewhere")
    prompt_logprobs: bool = _option(
        bool, True, "compile the programs that give prompt logprobs (SamplingParams.prompt_logprobs, the server's "
        "prompt_logprobs and echo: one a prefill pass size); off: requests asking for them are refused",
        flag="--prompt-logprobs")
    # A decode round otherwise runs its active lanes padded to a power of two, and the kernels' reduction order
    # depends on that row count.
    batch_invariant: bool = _option(
        bool, False, "decode every round at full width, so a request's tokens never depend on what else runs "
        "(slower at low concurrency)", flag="--batch-invariant")
    seed: int = _option(
        int, 0, "seed of the draws of requests that give no seed: each takes the next 32 bits of a generator seeded "
        "with it, so the same requests in the same order sample the same tokens", flag="--seed", minimum=0)
    # Each mixer and FFN runs per device under shard_map (model/spmd.py); the Pallas kernels would run there as on
    # one device, but no multi-GPU machine has checked them yet, so only the jnp reference kernels run sharded.
    tensor_parallel_size: int = _option(
        int, 1, "devices the model is split across (tensor parallel: heads, MLP columns and the vocabulary split "
        "over a mesh of the first N devices), a power of two; runs the reference kernels",
        flag="--tensor-parallel-size", minimum=1)
    enable_expert_parallel: bool = _option(
        bool, False, "with tensor parallel, split the routed experts across the devices instead of each expert's "
        "columns (expert parallel)", flag="--enable-expert-parallel")
    no_prefix_reuse: bool = _option(bool, False, "turn the prefix cache off", flag="--no-prefix-reuse", cache=True)
    host_cache_mib: int | str = _option(
        int, "auto", "host memory for the prefix cache in MiB (the Host tier, spec §5.4); 0: device memory only",
        flag="--host-cache-mib", minimum=0, cache=True, auto=True,
        rule=f"auto: {HOST_CACHE_SHARE:g} x the memory available at startup, at most {HOST_CACHE_CAP_MIB} "
             f"({DEFAULT_HOST_CACHE_BYTES >> 20} where the machine does not say)")
    device_snapshot_slots: int | None = _option(
        int, None, "device slots for saved conversation states (snapshot slots, spec D)",
        flag="--device-snapshot-slots", minimum=1, cache=True,
        rule="lanes + 1 with host memory, lanes + 2 without (C+1 / C+2); 1 with no_prefix_reuse")
    max_new_taps: int | None = _option(
        int, None, "conversation states saved per request (taps)", flag="--cache-taps-per-request", minimum=0,
        cache=True, rule="8 with host memory, 2 without")
    tap_ladder_tokens: int | None = _option(
        int, None, "spacing of the states saved along a long prompt (tap ladder, spec G)",
        flag="--cache-tap-ladder", minimum=BLOCK_TOKENS, cache=True, rule="max(4096, 2 x prefill chunk)")
    tap_min_gap_tokens: int | None = _option(
        int, None, "least distance between two states saved along a prompt (tap ladder minimum gap)",
        flag="--cache-tap-min-gap", minimum=BLOCK_TOKENS, cache=True, rule="max(1024, prefill chunk)")
    prefix_cache_file: str | None = _option(
        Path, None, "save the host prefix cache here at an orderly stop and load it at the next start (spec §5.5)",
        flag="--prefix-cache-file", cache=True, metavar="FILE")
    concurrent_prefill: bool = _option(
        bool, True, "a request whose prompt shares a prefix with one prefilling waits for that prefix instead of "
        "computing it again (in-flight coalescing, spec §12.2)", flag="--concurrent-prefill", cache=True)
    cache_policy: str = _option(
        str, "hpc", "prefix cache policy: hpc (the spec's) or align (vLLM's, for comparison only)",
        choices=("hpc", "align"), cache=True)

    def resolve(self, config_max_positions: int, backend: str | None = "cpu", *, moe: bool = False,
                hopper: bool = True, auto_lanes: int | None = None, available_memory: int | None = None,
                quantized: bool = False, cpu_cores: int | None = None, devices: int | None = None
                ) -> "EngineOptions":
        """Checks every value and fills every derived one. Pure: the device's backend ("gpu" or other; None: not
        known, its rules skipped), whether the model routes to experts, whether a GPU is a Hopper, what
        max_concurrency auto comes to (`startup.auto_lanes` on a GPU; None: CPU_CONCURRENCY), the host memory
        available in bytes (None: not known), whether the checkpoint's weights are block-FP8, the CPU cores the
        process may use (None: not known, one) and the devices it sees (None: not known) are arguments."""
        self.check_conflicts(backend)
        if self.fp8_activations == "dynamic" and not quantized:
            raise OptionsError("fp8_activations 'dynamic' needs a block-FP8 checkpoint; this one's weights are "
                               "unquantized")
        lanes = self.max_concurrency if self.max_concurrency != "auto" else auto_lanes or CPU_CONCURRENCY
        chunk = self.prefill_chunk or (MOE_PREFILL_CHUNK if moe else DENSE_PREFILL_CHUNK)
        idle = self.idle_prefill_chunk or (max(chunk, MOE_IDLE_PREFILL_CHUNK) if moe else chunk)
        _check_idle_chunk(idle, chunk)
        max_len = self.max_model_len or min(config_max_positions, MAX_DEFAULT_MODEL_LEN)
        if not 2 <= max_len <= config_max_positions:
            raise OptionsError(f"max_model_len must be in 2..{config_max_positions}, got {max_len}")
        host_mib = self.host_cache_mib if self.host_cache_mib != "auto" else auto_host_cache_mib(available_memory)
        # §14.2: a Host tier is present when its budget is nonzero (and the cache is on).
        host = host_mib > 0 and not self.no_prefix_reuse
        kernels = self.kernels if self.kernels != "auto" else "pallas" if backend == "gpu" else "reference"
        self._check_parallel(kernels, devices)
        longest = -(-max_len // 64) * 64  # no pass outgrows the context (the idle one stays >= prefill_chunk)
        attention = self.prefill_attention
        if attention == "auto":
            attention = "cudnn" if hopper and self.cudnn_conflict(backend) is None else "pallas"
        mixed = self.mixed_prefill_tokens
        if mixed == "auto":
            mixed = 0 if backend != "gpu" or self.speculative or self.batch_invariant \
                else MOE_MIXED_TOKENS if moe else DENSE_MIXED_TOKENS
        pass_images = min(chunk, longest) + 2 * self.max_image_tokens  # a pass can cut an image at both ends
        vision_rows = self.vision_cache_tokens if self.vision_cache_tokens != "auto" \
            else pass_images + 2 * self.max_image_tokens
        if vision_rows < pass_images:
            raise OptionsError(f"vision_cache_tokens must be at least the prefill chunk + 2 x max_image_tokens "
                               f"({pass_images}), got {vision_rows}")
        return dataclasses.replace(
            self,
            max_concurrency=lanes,
            num_speculative_tokens=self.num_speculative_tokens or (DEFAULT_SPECULATIVE_TOKENS
                                                                   if self.speculative else None),
            adaptive_speculation=self.adaptive_speculation if self.adaptive_speculation != "auto"
            else "on" if backend == "gpu" and self.speculative else "off",
            host_cache_mib=host_mib,
            background_compile=self.background_compile if self.background_compile != "auto"
            else "on" if backend == "gpu" and self.tensor_parallel_size == 1 else "off",
            compile_threads=self.compile_threads if self.compile_threads != "auto"
            else max(1, min(cpu_cores or 1, MAX_COMPILE_THREADS)),
            kernels=kernels,
            prefill_attention=attention,
            max_model_len=max_len,
            vision_cache_tokens=vision_rows,
            prefill_chunk=min(chunk, longest),
            idle_prefill_chunk=min(idle, longest),
            mixed_prefill_tokens=min(mixed, chunk, longest),
            device_snapshot_slots=self.device_snapshot_slots if self.device_snapshot_slots is not None
            else snapshot_slots(lanes, host, self.no_prefix_reuse),
            max_new_taps=self.max_new_taps if self.max_new_taps is not None else default_max_new_taps(host),
            tap_ladder_tokens=self.tap_ladder_tokens or default_tap_ladder_tokens(chunk),
            tap_min_gap_tokens=self.tap_min_gap_tokens or default_tap_min_gap_tokens(chunk),
        )

    def check_conflicts(self, backend: str | None = None) -> None:
        """Refuses what `resolve` refuses on any model: each value against its declaration, and the options that
        cannot go together as given (backend None: the device's rules skipped). The command lines call it
        before anything loads."""
        for option in OPTIONS.values():
            problem = option.problem(getattr(self, option.name))
            if problem:
                raise OptionsError(f"{option.name} {problem}")
        if self.no_prefix_reuse:  # a cache switch (coalescing) means nothing without a cache, on or off
            given = [o.name for o in OPTIONS.values()
                     if o.cache and o.kind is not bool and getattr(self, o.name) != o.default]
            if given:
                raise OptionsError(f"no_prefix_reuse conflicts with {', '.join(given)}: there is no prefix cache "
                                   f"to configure")
        if self.background_compile == "on" and self.tensor_parallel_size > 1:
            raise OptionsError("background_compile 'on' conflicts with tensor_parallel_size > 1: on a mesh the "
                               "programs compiled in the background would compile again when first used")
        if self.prefix_cache_file is not None:
            if self.host_cache_mib == 0:
                raise OptionsError("prefix_cache_file needs a Host tier; it conflicts with host_cache_mib 0")
            path = Path(self.prefix_cache_file)
            if path.is_dir():
                raise OptionsError(f"prefix_cache_file {path} is a directory; name a file")
            if not path.resolve().parent.is_dir():
                raise OptionsError(f"prefix_cache_file {path}: the directory {path.resolve().parent} does not "
                                   f"exist")
        if self.generation_config not in ("auto", "none") and not Path(self.generation_config).exists():
            raise OptionsError(f"generation_config {self.generation_config}: no such file or folder (auto, none or "
                               f"a path)")
        self._check_speculative()
        self._check_parallel(self.kernels)
        if self.fp8_activations == "dynamic" and self.kernels == "reference":
            raise OptionsError("fp8_activations 'dynamic' runs in the Pallas decode kernels; it conflicts with "
                               "kernels 'reference'")
        cudnn = self.cudnn_conflict(backend)
        if self.prefill_attention == "cudnn" and cudnn:
            raise OptionsError(cudnn)
        if self.prefill_chunk is not None and self.idle_prefill_chunk is not None:
            _check_idle_chunk(self.idle_prefill_chunk, self.prefill_chunk)
        if self.tap_ladder_tokens is not None and self.tap_min_gap_tokens is not None:
            spacing = tap_spacing_problem(self.tap_ladder_tokens, self.tap_min_gap_tokens)
            if spacing:
                raise OptionsError(spacing)

    def _check_parallel(self, kernels: str, devices: int | None = None) -> None:
        """The mesh's size against the devices (None: not known) and the kernels, and expert parallel against it."""
        tp = self.tensor_parallel_size
        if tp & (tp - 1):
            raise OptionsError(f"tensor_parallel_size must be a power of two, got {tp}")
        if devices is not None and tp > devices:
            raise OptionsError(f"tensor_parallel_size {tp} exceeds the {devices} device(s) this process sees")
        if tp > 1 and kernels == "pallas":
            raise OptionsError(f"tensor_parallel_size {tp} runs the jnp reference kernels only (the Pallas kernels "
                               f"per device are not checked on several GPUs yet); it conflicts with kernels 'pallas' "
                               f"(the default on a GPU): pass kernels 'reference'")
        if self.enable_expert_parallel and tp == 1:
            raise OptionsError("enable_expert_parallel splits the experts across the tensor parallel devices; it "
                               "needs tensor_parallel_size > 1")

    def _check_speculative(self) -> None:
        if self.mixed_prefill_tokens not in ("auto", 0):
            if self.speculative is not None:
                raise OptionsError(f"mixed_prefill_tokens {self.mixed_prefill_tokens} conflicts with speculative: "
                                   f"verify rounds run apart from prefill passes; leave it auto or 0")
            if self.batch_invariant:
                raise OptionsError(f"mixed_prefill_tokens {self.mixed_prefill_tokens} conflicts with "
                                   f"batch_invariant: a lane's rows would share a step with another's prompt")
        if self.speculative is None:
            if self.num_speculative_tokens is not None:
                raise OptionsError("num_speculative_tokens needs speculative decoding; set speculative")
            if self.adaptive_speculation == "on":
                raise OptionsError("adaptive_speculation 'on' needs speculative decoding; set speculative")
            return
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise OptionsError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                               f"({self.prompt_lookup_max})")
        if self.batch_invariant:
            raise OptionsError("speculative decoding conflicts with batch_invariant: a verify round's rows are "
                               "not a plain round's")

    def cudnn_conflict(self, backend: str | None) -> str | None:
        """Why the cuDNN prefill attention cannot run with these options on `backend` (None: it can; a backend of
        None is not checked): it needs the Pallas kernels (not the references, not interpret mode), a GPU and
        bf16."""
        if self.kernels == "reference" or self.interpret:
            return ("prefill_attention 'cudnn' runs on the GPU with kernels 'pallas'; it conflicts with "
                    + ("interpret" if self.interpret else "kernels 'reference'"))
        if backend is not None and backend != "gpu":
            return f"prefill_attention 'cudnn' needs a GPU (backend {backend})"
        if self.dtype != "bfloat16":
            return f"prefill_attention 'cudnn' runs bf16 attention; it conflicts with dtype {self.dtype!r}"
        return None

    def prefix_cache_options(self) -> PrefixCacheOptions:
        """The prefix index's options from these resolved ones (a Host budget only with the cache on); derives
        nothing."""
        unset = [n for n in ("device_snapshot_slots", "max_new_taps", "tap_ladder_tokens", "tap_min_gap_tokens")
                 if getattr(self, n) is None]
        if unset:
            raise OptionsError(f"prefix_cache_options needs resolved options ({', '.join(unset)} unset): "
                               f"call resolve() first")
        try:
            return PrefixCacheOptions(
                host_cache_bytes=0 if self.no_prefix_reuse else self.host_cache_mib << 20,
                device_snapshot_slots=self.device_snapshot_slots, max_new_taps=self.max_new_taps,
                tap_ladder_tokens=self.tap_ladder_tokens, tap_min_gap_tokens=self.tap_min_gap_tokens)
        except ValueError as error:
            raise OptionsError(str(error)) from None

    def summary(self) -> str:
        """One line with every effective value, for the startup log."""
        return " | ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


# Every declaration by option name, in field order.
OPTIONS: dict[str, Option] = {f.name: dataclasses.replace(f.metadata["option"], name=f.name)
                              for f in dataclasses.fields(EngineOptions)}


def auto_host_cache_mib(available_memory: int | None) -> int:
    """host_cache_mib auto for `available_memory` bytes (None: not known)."""
    if available_memory is None:
        return DEFAULT_HOST_CACHE_BYTES >> 20
    return min(HOST_CACHE_CAP_MIB, int(available_memory * HOST_CACHE_SHARE) >> 20)


def _check_idle_chunk(idle: int, chunk: int) -> None:
    """A pass while nobody waits is never shorter than one while a decode waits."""
    if idle < chunk:
        raise OptionsError(f"idle_prefill_chunk must be at least prefill_chunk ({chunk}), got {idle}")


# An option's name as a whole word, not inside a path or a longer name.
_FLAGGED_NAME = re.compile(r"(?<![\w/.-])(" + "|".join(n for n, o in OPTIONS.items() if o.flag) + r")(?![\w/.-])")


def flag_words(message: str) -> str:
    """`message` with each option name written as its flag, for the command lines."""
    return _FLAGGED_NAME.sub(lambda match: OPTIONS[match.group(1)].flag, message)


def add_engine_arguments(parser: argparse.ArgumentParser) -> tuple[Any, Any]:
    """Adds every declared flag to `parser` in an "engine" and a "prefix cache" group, and returns the two groups
    (a command line adds its own engine flags beside them). Unset flags are None: `engine_kwargs_from_args`
    passes on only what was given."""
    engine = parser.add_argument_group("engine")
    cache = parser.add_argument_group("hybrid prefix cache (spec §14.2; unset values are derived)")
    for option in OPTIONS.values():
        if option.flag is None:
            continue
        group = cache if option.cache else engine
        # vLLM's name is a flag of its own, so an error names the flag the command line gave
        for flag in (option.flag,) if option.vllm_flag is None else (option.flag, option.vllm_flag):
            shown = option.help_text() if flag == option.flag else argparse.SUPPRESS
            if option.kind is bool:  # one that is on by default is turned off with --no-<flag>
                group.add_argument(flag, dest=option.name, default=None, help=shown,
                                   action=argparse.BooleanOptionalAction if option.default else "store_true")
            elif option.choices:
                choices = option.choices if option.cli_default in (None, *option.choices) \
                    else (option.cli_default, *option.choices)
                group.add_argument(flag, dest=option.name, choices=choices, default=None, help=shown)
            else:
                group.add_argument(flag, dest=option.name, type=_from_text(option), default=None,
                                   metavar=option.metavar or "N", help=shown)
    return engine, cache


def _from_text(option: Option):
    """The argparse type of a flag: parses the text and refuses, by the declaration, a value the option never
    takes."""
    def parse(text: str) -> Any:
        if option.auto and text == "auto":
            return text
        if option.kind is Path:
            return str(Path(text).expanduser().resolve())
        try:
            value = option.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {option.allowed()}, got {text!r}") from None
        problem = option.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value
    return parse


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine.from_pretrained keywords given on a command line built with `add_engine_arguments`, checked
    against `EngineOptions.check_conflicts`. Raises OptionsError naming the flags at fault."""
    kwargs = {o.name: getattr(args, o.name) for o in OPTIONS.values()
              if o.flag is not None and getattr(args, o.name, None) is not None}
    # A command-line default the library does not take (dtype auto) is settled by Engine.from_pretrained.
    settled = {k: v for k, v in kwargs.items() if v != OPTIONS[k].cli_default}
    try:
        EngineOptions(**settled).check_conflicts()
    except OptionsError as error:
        raise OptionsError(flag_words(str(error))) from None
    return kwargs
