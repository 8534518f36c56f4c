"""Qwen3.5 dense and MoE, written as pure functions of a params pytree (see qwen3_5.py)."""

from ninfer_jax.config import ConfigError, ModelConfig
from ninfer_jax.model.loader import CheckpointError, load_checkpoint
from ninfer_jax.model.ops import KernelConfig
from ninfer_jax.model.params import Params
from ninfer_jax.model.qwen3_5 import decode, forward, logits, prefill
from ninfer_jax.model.state import DeviceState, init_device_state

__all__ = [
    "CheckpointError", "ConfigError", "DeviceState", "KernelConfig", "ModelConfig", "Params", "decode",
    "forward", "init_device_state", "load_checkpoint", "logits", "prefill",
]
