"""EngineOptions: every engine setting, validated, with unset values derived as spec §14.2 says."""

from __future__ import annotations

import dataclasses
from pathlib import Path


class OptionsError(ValueError):
    """Conflicting or invalid engine options; the message names the option."""


def default_snapshot_slots(max_concurrency: int, host_tier: bool) -> int:
    """D, the Device snapshot slots, when unset: C + 1 with a Host tier, C + 2 without (spec §14.2)."""
    return max_concurrency + (1 if host_tier else 2)


def default_max_new_taps(host_tier: bool) -> int:
    """Taps planned per request when unset: 8 with a Host tier, 2 without (spec §14.2)."""
    return 8 if host_tier else 2


# A dense model's projections reach the matmul rate at 2048 rows (a 27B 32k prefill was no faster at 8192,
# docs/benchmarks/prefill_profile.md). An MoE layer reads every expert's weights once per pass: at 2048 tokens the
# 35B-A3B routes 64 rows to each of 256 experts and its expert kernels are bound by those reads (1.6 GB per
# layer); 8192 tokens route 256 rows each. A cold 32k prefill of the 35B-A3B: 32058 tok/s at 2048, 38793 at 4096,
# 42162 at 8192 (docs/benchmarks/prefill_profile.md, session 13).
DENSE_PREFILL_CHUNK = 2048
MOE_PREFILL_CHUNK = 8192
# While no lane decodes, nobody waits on a prefill pass, and an MoE model's longer passes read each expert's weights
# fewer times: a lone cold 32k prompt of the 35B-A3B ran 49033 tok/s in passes of 8192, 52153 in 16384 and 54114 in
# one of 32768 (docs/benchmarks/prefill_profile.md, session 15). A dense model gained 1-3% from 2048 to 8192, less
# than two more compiled programs cost, so its idle pass stays its prefill_chunk.
MOE_IDLE_PREFILL_CHUNK = 32768

# The command lines' help for the options they share (ninfer-serve, ninfer-generate)
PREFILL_CHUNK_HELP = (f"tokens per prefill pass (default {DENSE_PREFILL_CHUNK}, "
                      f"or {MOE_PREFILL_CHUNK} for an MoE model)")
IDLE_PREFILL_CHUNK_HELP = (f"tokens per prefill pass while no lane decodes, a multiple of 64 and at least the "
                           f"prefill chunk (default {MOE_IDLE_PREFILL_CHUNK} for an MoE model, else the prefill "
                           f"chunk: no longer passes)")
PREFILL_ATTENTION_HELP = ("prefill attention with the Pallas kernels: the paged Pallas kernel, or gathered keys "
                          "through cuDNN flash attention (GPU, bf16); auto: cudnn on a Hopper GPU, where it was "
                          "measured faster")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine settings. `resolve()` returns a copy with every derived value filled in."""

    dtype: str = "bfloat16"
    max_concurrency: int = 4  # C: lanes, each with an active state slot
    # Tokens per prefill pass; None: DENSE_PREFILL_CHUNK, or MOE_PREFILL_CHUNK for a model with routed experts.
    # A longer pass keeps the running lanes' decode waiting longer (one 8192-token pass of the 35B-A3B takes
    # about 0.2 s on an H200, one of 2048 about 0.065 s).
    prefill_chunk: int | None = None
    # Tokens per prefill pass while no lane decodes (no decode waits on it); a prompt takes this or its half where
    # either fits. None: MOE_IDLE_PREFILL_CHUNK for a model with routed experts, prefill_chunk (off) otherwise.
    idle_prefill_chunk: int | None = None
    kv_capacity: int | str = "auto"  # tokens, or "auto": the device memory left after weights
    max_model_len: int | None = None  # default: min(config max positions, 32768)
    kernels: str = "auto"  # "pallas", "reference" (jnp), or "auto": pallas on a GPU, reference elsewhere
    # Prefill attention with kernels "pallas": "pallas" (the paged Pallas kernel), "cudnn" (gathered keys through
    # cuDNN flash attention; GPU, bf16) or "auto": cudnn on a Hopper GPU with bf16, else pallas. On the H200 cuDNN
    # made a cold 32k prefill 11% faster on the 35B-A3B (chunk 8192) and 4-6% on the 27B
    # (docs/benchmarks/prefill_profile.md); other GPUs were not measured, so they keep the Pallas kernel.
    prefill_attention: str = "auto"
    interpret: bool = False  # Pallas interpret mode (CPU tests)
    output_window: int = 512  # tokens of decode pages reserved ahead (bounded completion, spec §9.5)
    memory_fraction: float = 0.9  # of free device memory that "auto" KV capacity may take
    # Every decode round runs all max_concurrency rows, so a request's tokens never depend on what else runs (a
    # round otherwise runs its active lanes padded to a power of two, and the kernels' reduction order depends on
    # the row count). Costs speed at low concurrency: one 35B-A3B lane computes 8 rows.
    batch_invariant: bool = False
    # Hybrid prefix cache (spec §14.2); None = derived.
    no_prefix_reuse: bool = False
    host_cache_mib: int = 8192  # the Host slab pool (spec §5.4); 0 = Device only
    device_snapshot_slots: int | None = None
    max_new_taps: int | None = None
    tap_ladder_tokens: int | None = None
    tap_min_gap_tokens: int | None = None
    prefix_cache_file: str | None = None
    concurrent_prefill: bool = False
    cache_policy: str = "hpc"  # "hpc" (the spec) or "align" (vLLM's mode, for comparison only)

    CACHE_OPTIONS = (
        "device_snapshot_slots", "max_new_taps", "tap_ladder_tokens", "tap_min_gap_tokens",
        "prefix_cache_file", "concurrent_prefill",
    )

    def resolve(self, config_max_positions: int, backend: str = "cpu", *, moe: bool = False,
                hopper: bool = True) -> "EngineOptions":
        """Validates and fills every derived value (pure: the device's backend, "gpu" or other, whether the model
        routes to experts and whether a GPU is a Hopper are arguments)."""
        if self.dtype not in ("bfloat16", "float32"):
            raise OptionsError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if not 1 <= self.max_concurrency <= 64:
            raise OptionsError(f"max_concurrency must be in 1..64, got {self.max_concurrency}")
        chunk = self.prefill_chunk
        if chunk is None:
            chunk = MOE_PREFILL_CHUNK if moe else DENSE_PREFILL_CHUNK
        elif not isinstance(chunk, int) or chunk < 64 or chunk % 64:
            raise OptionsError(f"prefill_chunk must be a positive multiple of 64, got {chunk!r}")
        idle = self.idle_prefill_chunk
        if idle is None:
            idle = max(chunk, MOE_IDLE_PREFILL_CHUNK) if moe else chunk
        elif not isinstance(idle, int) or idle % 64 or idle < chunk:
            raise OptionsError(f"idle_prefill_chunk must be a multiple of 64 and at least prefill_chunk ({chunk}), "
                               f"got {idle!r}")
        if self.kernels not in ("auto", "reference", "pallas"):
            raise OptionsError(f"kernels must be 'auto', 'reference' or 'pallas', got {self.kernels!r}")
        if self.prefill_attention not in ("auto", "pallas", "cudnn"):
            raise OptionsError(f"prefill_attention must be 'auto', 'pallas' or 'cudnn', got {self.prefill_attention!r}")
        cudnn_conflict = self._cudnn_conflict(backend)
        if self.prefill_attention == "cudnn" and cudnn_conflict:
            raise OptionsError(cudnn_conflict)
        if not (self.kv_capacity == "auto" or (isinstance(self.kv_capacity, int) and self.kv_capacity > 0)):
            raise OptionsError(f"kv_capacity must be 'auto' or a positive token count, got {self.kv_capacity!r}")
        if self.host_cache_mib < 0:
            raise OptionsError(f"host_cache_mib must be >= 0, got {self.host_cache_mib}")
        if not 0 < self.memory_fraction <= 1:
            raise OptionsError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.cache_policy not in ("hpc", "align"):
            raise OptionsError(f"cache_policy must be 'hpc' or 'align', got {self.cache_policy!r}")
        if self.no_prefix_reuse:
            given = [n for n in self.CACHE_OPTIONS if getattr(self, n) not in (None, False)]
            given += ["cache_policy"] if self.cache_policy != "hpc" else []
            if given:
                raise OptionsError(f"no_prefix_reuse conflicts with prefix-cache option(s): {', '.join(given)}")
        if self.prefix_cache_file is not None:
            path = Path(self.prefix_cache_file)
            if self.host_cache_mib == 0:
                raise OptionsError("prefix_cache_file needs a Host tier; it conflicts with host_cache_mib 0")
            if path.is_dir():
                raise OptionsError(f"prefix_cache_file {path} is a directory")
            if not path.resolve().parent.is_dir():
                raise OptionsError(f"prefix_cache_file {path}: parent directory does not exist")
        max_len = self.max_model_len or min(config_max_positions, 32768)
        if max_len < 2 or max_len > config_max_positions:
            raise OptionsError(f"max_model_len must be in 2..{config_max_positions}, got {max_len}")
        # §14.2: a Host tier is present when its budget is nonzero (and the cache is on).
        c, host = self.max_concurrency, self.host_cache_mib > 0 and not self.no_prefix_reuse
        kernels = self.kernels if self.kernels != "auto" else "pallas" if backend == "gpu" else "reference"
        longest = -(-max_len // 64) * 64  # no pass outgrows the context (the idle one stays >= prefill_chunk)
        attention = self.prefill_attention
        if attention == "auto":
            attention = "cudnn" if hopper and cudnn_conflict is None else "pallas"
        return dataclasses.replace(
            self,
            kernels=kernels,
            prefill_attention=attention,
            max_model_len=max_len,
            prefill_chunk=min(chunk, longest),
            idle_prefill_chunk=min(idle, longest),
            device_snapshot_slots=self.device_snapshot_slots if self.device_snapshot_slots is not None
            else default_snapshot_slots(c, host),
            max_new_taps=self.max_new_taps if self.max_new_taps is not None else default_max_new_taps(host),
            tap_ladder_tokens=self.tap_ladder_tokens or max(4096, 2 * chunk),
            tap_min_gap_tokens=self.tap_min_gap_tokens or max(1024, chunk),
        )

    def _cudnn_conflict(self, backend: str) -> str | None:
        """Why the cuDNN prefill attention cannot run with these options on `backend` (None: it can): it needs the
        Pallas kernels (not the references, not interpret mode), a GPU and bf16."""
        if self.kernels == "reference" or self.interpret:
            return ("prefill_attention 'cudnn' runs on the GPU with kernels 'pallas'; it conflicts with "
                    + ("interpret" if self.interpret else "kernels 'reference'"))
        if backend != "gpu":
            return f"prefill_attention 'cudnn' needs a GPU (backend {backend})"
        if self.dtype != "bfloat16":
            return f"prefill_attention 'cudnn' runs bf16 attention; it conflicts with dtype {self.dtype!r}"
        return None

    def summary(self) -> str:
        """One line with every effective value, for the startup log."""
        return " | ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
