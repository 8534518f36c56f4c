"""`compiling.AheadOfTime`: a recorded sequence of jitted calls compiles each program once on its pool, the replay
compiles nothing, a compile that failed beside others is tried once more alone, and a replay that strays from the
recording is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.runtime.device.compiling import AheadOfTime


def _step(x, state):
    return (x * state).sum(), state + x


def _scale(total, factor):
    return total * factor


def _sequence(step, scale, state):
    """A step that donates its state and a program reading the step's output, each called twice."""
    total, state = step(np.ones(4, np.float32), state)
    scale(total, np.float32(2))
    total, state = step(np.ones(4, np.float32), state)
    return scale(total, np.float32(3)), state


def test_the_replay_runs_programs_compiled_once_on_the_pool():
    step = jax.jit(_step, donate_argnums=(1,))
    scale = jax.jit(_scale)
    compiled = []

    def heard(event, seconds, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration" and fun_name in ("jit(_step)", "jit(_scale)"):
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        with AheadOfTime(2) as ahead:
            total, state = _sequence(ahead.lowering("step", step), ahead.lowering("scale", scale), jnp.zeros(4))
            assert (total.shape, state.shape) == ((), (4,))  # shapes only: nothing ran
            assert ahead.programs == 2
            total, state = _sequence(ahead.waiting("step", step), ahead.waiting("scale", scale), jnp.zeros(4))
            ahead.check_replayed()
    finally:
        jax.monitoring.unregister_event_duration_listener(heard)
    assert float(total) == 3 * 4 and np.array_equal(state, np.full(4, 2, np.float32))
    assert sorted(compiled) == ["jit(_scale)", "jit(_step)"]
    assert step._cache_size() == scale._cache_size() == 1


class _Flaky:
    """A jitted function whose lowerings' compiles fail the first `failures` times, as XLA's autotuner did."""

    def __init__(self, fn, failures: int):
        self.fn, self.failures, self.compiles = fn, failures, 0

    def lower(self, *args):
        flaky, lowered = self, self.fn.lower(*args)

        class Lowered:
            _lowering, out_info = lowered._lowering, lowered.out_info

            def compile(self):
                flaky.compiles += 1
                if flaky.compiles <= flaky.failures:
                    raise jax.errors.JaxRuntimeError("INTERNAL: All configs failed during profiling")
                return lowered.compile()

        return Lowered()

    def __call__(self, *args):
        return self.fn(*args)


def test_a_compile_that_failed_beside_others_is_compiled_again_alone(caplog):
    step = _Flaky(jax.jit(_step), failures=1)
    scale = jax.jit(_scale)
    with AheadOfTime(2) as ahead:
        _sequence(ahead.lowering("step", step), ahead.lowering("scale", scale), jnp.zeros(4))
        total, _ = _sequence(ahead.waiting("step", step), ahead.waiting("scale", scale), jnp.zeros(4))
        ahead.check_replayed()
    assert float(total) == 3 * 4 and step.compiles == 2
    assert "a compile failed beside others (INTERNAL: All configs failed during profiling)" in caplog.text


@pytest.mark.parametrize("threads, failures", [(2, 2), (1, 1)])
def test_a_compile_that_fails_again_or_alone_ends_the_replay(threads, failures):
    step = _Flaky(jax.jit(_step), failures)
    with AheadOfTime(threads) as ahead:
        ahead.lowering("step", step)(np.ones(4, np.float32), jnp.zeros(4))
        with pytest.raises(jax.errors.JaxRuntimeError, match="All configs failed"):
            ahead.waiting("step", step)(np.ones(4, np.float32), jnp.zeros(4))
    assert step.compiles == failures


def test_a_replay_that_strays_from_the_recording_is_refused():
    step, scale = jax.jit(_step), jax.jit(_scale)
    with AheadOfTime(1) as ahead:
        _sequence(ahead.lowering("step", step), ahead.lowering("scale", scale), jnp.zeros(4))
        with pytest.raises(RuntimeError, match="called scale where the recorded one called step"):
            ahead.waiting("scale", scale)(np.float32(1), np.float32(2))
        ahead.waiting("step", step)(np.ones(4, np.float32), jnp.zeros(4))
        with pytest.raises(RuntimeError, match="made 1 of the 4 recorded calls"):
            ahead.check_replayed()
