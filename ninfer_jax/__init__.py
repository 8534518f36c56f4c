"""ninfer-jax: a prefix-reusing inference engine for Qwen3.5 hybrid models, in JAX and Pallas.

    from ninfer_jax import Engine, SamplingParams
    engine = Engine.from_pretrained()          # the built-in tiny checkpoint
    print(engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0)).text)
"""

import warnings

# Pallas on GPU lowers through Triton in jax 0.10-0.12, which warns that backend is deprecated.
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

_EXPORTS = {
    "Engine": "ninfer_jax.runtime.engine",
    "EngineStoppedError": "ninfer_jax.runtime.request",
    "InvalidRequestError": "ninfer_jax.runtime.request",
    "PromptTooLongError": "ninfer_jax.runtime.request",
    "RequestOutput": "ninfer_jax.runtime.request",
    "StreamEvent": "ninfer_jax.runtime.request",
    "SamplingParams": "ninfer_jax.runtime.sampling",
}


def __getattr__(name):
    # Lazy: `import ninfer_jax.prefix_cache` (pure Python) must not load jax through this package.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ninfer_jax' has no attribute {name!r}")


__all__ = ["Engine", "EngineStoppedError", "InvalidRequestError", "PromptTooLongError", "RequestOutput",
           "SamplingParams", "StreamEvent"]
