"""Property tests: the engine never raises on arbitrary observations and is deterministic."""

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.engine import EngineState, builtin_rules_dir, evaluate, load_rules, tick
from agent.model import GpuRef, Observation, Signal, frozen_attrs

RULES = load_rules(builtin_rules_dir())
attr_values = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.text(max_size=8), st.booleans())
observations = st.builds(
    Observation,
    signal=st.sampled_from(list(Signal)),
    value=st.one_of(st.integers(-10, 2**20), st.floats(allow_nan=True, allow_infinity=True)),
    at=st.floats(0, 1e6),
    source=st.sampled_from(["kmsg", "nvml", "dcgm"]),
    gpu=st.one_of(st.none(), st.builds(GpuRef, index=st.integers(0, 7), uuid=st.sampled_from(["", "GPU-a", "GPU-b"]),
                                       pci_bus_id=st.sampled_from(["", "0000:18:00.0"]),
                                       model=st.sampled_from(["", "NVIDIA A100-SXM4-80GB"]))),
    attrs=st.dictionaries(st.sampled_from(["slowdown_c", "shutdown_c", "recovery_action", "caused_by", "workload",
                                           "decoded_action", "counter", "limit_w", "severity", "boot_id", "dbe"]),
                          attr_values, max_size=4).map(frozen_attrs),
    count=st.integers(1, 1000),
)


def _replay(sequence):
    state = EngineState()
    out = []
    for o in sorted(sequence, key=lambda x: x.at):
        out.extend(evaluate(o, state, o.at, rules=RULES))
        out.extend(tick(state, o.at, rules=RULES))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(observations, max_size=40))
def test_the_engine_never_raises_on_arbitrary_observations(sequence):
    _replay(sequence)


@settings(max_examples=100, deadline=None)
@given(st.lists(observations, max_size=30))
def test_the_engine_is_deterministic(sequence):
    """The same observations give the same verdicts (compared as text: a NaN reading is never == itself)."""
    assert repr(_replay(sequence)) == repr(_replay(sequence))
