"""The entry points' claim on the GPU's memory (`ninfer_jax/device_memory.py`): most of it unless the user said."""

import os

from ninfer_jax.device_memory import CLAIM, ENV, claim_device_memory


def test_jax_may_take_most_of_the_gpu_unless_the_user_set_a_fraction(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert claim_device_memory() == CLAIM == 0.95
    assert os.environ[ENV] == "0.95"
    monkeypatch.setenv(ENV, "0.5")
    assert claim_device_memory() == 0.5 and os.environ[ENV] == "0.5"
