"""The benchmark models: the real Qwen3.5 shapes with random weights, and the built-in tiny checkpoint for
`--smoke` runs on a CPU."""

from __future__ import annotations

import dataclasses
import time

from ninfer_jax.benchmarks.report import ROOT

# Benchmark name -> configs/<file>.json
MODELS = {"27b": "qwen3.5-27b", "35b-a3b": "qwen3.5-35b-a3b", "122b-a10b": "qwen3.5-122b-a10b",
          "397b-a17b": "qwen3.5-397b-a17b", "tiny-dense": "tiny-dense", "tiny-moe": "tiny-moe"}


def model_config(name: str):
    """The ModelConfig of a benchmark model (`MODELS`)."""
    from ninfer_jax.config import ModelConfig

    return ModelConfig.from_file(ROOT / "configs" / f"{MODELS[name]}.json")


# Weight formats of the benchmark engines: random bf16, block-FP8 as Qwen's packs, and block-FP8 with dynamic
# FP8 activations (fp8_activations="dynamic")
WEIGHTS = ("bf16", "fp8", "fp8-dynamic")


def pack_config(cfg, weights: str):
    """`cfg` as the config.json of a `weights` pack says: FP8 packs carry a quantization_config."""
    from ninfer_jax.config import QuantizationConfig

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    return cfg if weights == "bf16" else dataclasses.replace(cfg, quantization=QuantizationConfig())


def weight_bytes(cfg, weights: str) -> int:
    """Device bytes of random `weights` params at `cfg`'s shapes (FP8 block scales included), without making them."""
    import jax

    from ninfer_jax.model.random_init import random_params

    made = pack_config(cfg, weights)
    shapes = jax.eval_shape(lambda: random_params(made, fp8=weights != "bf16"))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def weight_options(weights: str) -> dict:
    """The engine options a `WEIGHTS` format runs with: fp8-dynamic quantizes the activations too."""
    return {"fp8_activations": "dynamic"} if weights == "fp8-dynamic" else {}


def random_engine(name: str, *, kernels: str = "pallas", warmup: bool = False, tokenizer=None, weights: str = "bf16",
                  **options):
    """An Engine on random weights at the shapes of `name` in one of `WEIGHTS` formats. On a CPU the Pallas kernels
    run in interpret mode (a smoke run). Returns (engine, seconds to make the weights)."""
    import jax

    from ninfer_jax import Engine
    from ninfer_jax.model.random_init import random_params
    from ninfer_jax.runtime import startup
    from ninfer_jax.runtime.options import EngineOptions

    cfg = pack_config(model_config(name), weights)
    start = time.perf_counter()
    params = random_params(cfg, seed=0, fp8=weights != "bf16")
    jax.block_until_ready(params)
    init_s = time.perf_counter() - start
    interpret = kernels == "pallas" and jax.default_backend() == "cpu"
    opts = EngineOptions(**{"dtype": "bfloat16", "kernels": kernels, "interpret": interpret,
                            **weight_options(weights), **options})
    params = startup.kernel_params(params, opts, cfg)
    return Engine(cfg, params, opts, tokenizer=tokenizer, model_name=name, warmup=warmup), init_s


def tiny_engine(*, warmup: bool = False, **options):
    """The built-in tiny checkpoint (random weights, the real tokenizer) on the jnp reference kernels."""
    from ninfer_jax import Engine

    return Engine.from_pretrained(None, kernels="reference", warmup=warmup, **options)


def tiny_checkpoint_config():
    """The ModelConfig of the built-in tiny checkpoint (written on first use)."""
    from ninfer_jax.config import ModelConfig
    from ninfer_jax.model.tiny import default_checkpoint

    return ModelConfig.from_file(default_checkpoint() / "config.json")


@dataclasses.dataclass(frozen=True)
class WeightParts:
    """Parameter counts of a text model's parts as the benchmarks count them: the projections of the mixers and
    FFNs, the routed experts, the embedding and the lm_head. Norms, convolutions and routers (under 1% of the
    active bytes) are left out."""

    mixers: int  # every layer's attention or GDN projections
    attention: int  # one full-attention layer's projections
    ffn: int  # per layer: the dense MLP, or the shared expert of a layer with routed experts
    expert: int  # one routed expert (0 for a dense model)
    num_experts: int
    experts_per_token: int
    layers: int
    vocab_rows: int  # vocab x hidden: the embedding, and the lm_head again unless tied
    hidden: int
    tied: bool

    @property
    def active(self) -> int:
        """Parameters a token multiplies by: the embedding is a lookup, the lm_head a matmul."""
        return self.mixers + self.layers * (self.ffn + self.experts_per_token * self.expert) + self.vocab_rows


def weight_parts(cfg) -> WeightParts:
    """The WeightParts of a text model's config."""
    h = cfg.hidden_size
    attn = h * (cfg.num_attention_heads * 2 * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim) \
        + cfg.num_attention_heads * cfg.head_dim * h
    gdn = h * (cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads) + cfg.value_dim * h
    moe = cfg.is_moe
    return WeightParts(
        mixers=len(cfg.attn_layers) * attn + len(cfg.gdn_layers) * gdn, attention=attn,
        ffn=3 * h * (cfg.shared_expert_intermediate_size if moe else cfg.intermediate_size),
        expert=3 * h * cfg.moe_intermediate_size if moe else 0, num_experts=cfg.num_experts if moe else 0,
        experts_per_token=cfg.num_experts_per_tok if moe else 0, layers=cfg.num_layers,
        vocab_rows=cfg.vocab_size * h, hidden=h, tied=cfg.tie_word_embeddings)


def param_counts(cfg, fp8: bool = False) -> tuple[int, int, int]:
    """(total params, active params per token, active weight bytes per decode token at 1 lane): bf16 weights, or with
    fp8 the linears the FP8 packs quantize at one byte (their block scales add 1/4096 and are left out)."""
    w = weight_parts(cfg)
    total = w.mixers + w.layers * (w.ffn + w.num_experts * w.expert) + w.vocab_rows * (1 if w.tied else 2)
    active = w.active
    return total, active, 2 * active - (active - w.vocab_rows - gdn_ab_params(cfg) if fp8 else 0)


def gdn_ab_params(cfg) -> int:
    """The GDN b and a projections' params: they (and the lm_head, embeddings and norms) stay bf16 in the FP8 packs."""
    return len(cfg.gdn_layers) * 2 * cfg.linear_num_value_heads * cfg.hidden_size


def best_seconds(fn, *args, batches: int = 3, calls: int = 10) -> float:
    """Seconds per call of a jitted `fn`: the best of `batches` batches of `calls` back-to-back calls (a ceiling
    is the best the device does; one batch can read a quarter low)."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def measure_ceilings(n: int = 8192, copy_gib: float = 2) -> tuple[float, float]:
    """(bf16 n^3 matmul TFLOP/s, `measure_copy_tbps(copy_gib)`)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    tflops = 2 * n**3 / best_seconds(jax.jit(lambda x, y: x @ y), a, b) / 1e12
    return tflops, measure_copy_tbps(copy_gib)


def measure_copy_tbps(gib: float = 2) -> float:
    """The device copy rate in TB/s (bytes read + written) of a `gib` GiB bf16 array, the best of a few batches:
    the one copy ceiling every benchmark's bandwidth share is taken against."""
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(2), (max(1, round(gib * 512)), 1024, 1024), jnp.bfloat16)
    return 2 * x.nbytes / best_seconds(jax.jit(lambda v: v * jnp.bfloat16(1.0001)), x) / 1e12
