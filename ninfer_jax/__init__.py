"""ninfer-jax: a prefix-reusing inference engine for Qwen3.5 hybrid models, in JAX and Pallas.

    from ninfer_jax import Engine, SamplingParams
    engine = Engine.from_pretrained()          # the built-in tiny checkpoint
    print(engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0)).text)
"""

import warnings

# Pallas on GPU lowers through Triton in jax 0.10-0.12, which warns that backend is deprecated.
warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")

from ninfer_jax.runtime.engine import Engine  # noqa: E402
from ninfer_jax.runtime.request import (  # noqa: E402
    EngineStoppedError, InvalidRequestError, PromptTooLongError, RequestOutput, StreamEvent,
)
from ninfer_jax.runtime.sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "EngineStoppedError", "InvalidRequestError", "PromptTooLongError", "RequestOutput",
           "SamplingParams", "StreamEvent"]
