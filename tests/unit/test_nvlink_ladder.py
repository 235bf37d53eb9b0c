"""An NVLink down, or never trained, climbs NVIDIA's ladder: drain and reset, reboot, replacement (issue 41 row 6)."""

from agent.model import Action, Signal, StepKind
from tests.conftest import obs
from tests.unit.test_reset_verification import CLEAN, Resets, pipeline

DOWN = {"was_up": 1, "links": "3"}
UNTRAINED = {"was_up": 0, "links": "none", "untrained": 6, "expected": 18, "expected_from": "model", "active": 12,
             "untrained_links": "12,13,14,15,16,17"}


def link_down(p, at, **attrs):
    """The NVML source's reading of link 3 down, held for the rule's sustain."""
    outcome = None
    for t in (at, at + 30.0, at + 61.0):
        outcome = p.handle(obs(Signal.NVLINK_DOWN, 1, t, **(attrs or DOWN)), t)
    return outcome


def steps(outcome):
    return [a.step.kind for a in outcome.actions]


def test_a_link_down_on_an_idle_gpu_is_reset_not_left_tainted(shipped_rules):
    """NVIDIA's nvlink_active: drain, then reset the GPU; the taint alone would wait for a human for ever."""
    p = pipeline(shipped_rules)
    raised = link_down(p, 1.0)
    assert [(v.rule_id, v.action) for v in raised.verdicts] == [("nvlink-link-down", Action.RESET_GPU)]
    assert StepKind.RESET_GPU in steps(p.tick(80.0))


def test_a_reset_that_does_not_bring_the_link_back_asks_for_a_reboot(shipped_rules):
    """The clean poll that verifies a reset reads every link up; a link still down leaves it unverified."""
    p = pipeline(shipped_rules, reset_verify_seconds=60.0)
    link_down(p, 1.0)
    p.tick(80.0)
    p.handle(obs(Signal.GPU_POLLED, 1, 90.0, **{**CLEAN, "links_down": 1}), 90.0)
    outcome = p.tick(150.0)
    assert [v.rule_id for v in outcome.verdicts] == ["gpu-reset-failed"]
    assert p.node.reboot_requested


def test_a_link_down_again_after_two_verified_recoveries_is_a_replacement(shipped_rules):
    """The third time, after two resets that verified, the GPU's links are not going to stay up: replace it."""
    p = pipeline(shipped_rules)
    actions = []
    for at in (1.0, 1001.0, 2001.0):
        raised = link_down(p, at)
        actions += [v.action for v in raised.verdicts if v.rule_id == "nvlink-link-down"]
        p.tick(at + 80.0)
        p.handle(obs(Signal.GPU_POLLED, 1, at + 90.0, **CLEAN), at + 90.0)
    assert actions == [Action.RESET_GPU, Action.RESET_GPU, Action.REPLACE_GPU]


def test_links_that_never_trained_climb_the_same_ladder(shipped_rules):
    """12 of the 18 links an H100 should have, held five minutes: drain and reset like a link gone down."""
    p = pipeline(shipped_rules, Resets(reset_works=False))
    verdicts = []
    for t in (1.0, 150.0, 302.0):
        verdicts += p.handle(obs(Signal.NVLINK_DOWN, 6, t, **UNTRAINED), t).verdicts
    assert [(v.rule_id, v.action) for v in verdicts] == [("nvlink-links-untrained", Action.RESET_GPU)]
    assert "12 of the 18" in verdicts[0].summary
    p.tick(330.0)
    assert p.node.reboot_requested  # the reset failed: the ladder's next rung


def test_a_moment_of_untrained_links_after_boot_is_no_fault(shipped_rules):
    """Links train a moment after the driver loads and Fabric Manager configures them."""
    p = pipeline(shipped_rules)
    verdicts = p.handle(obs(Signal.NVLINK_DOWN, 6, 1.0, **UNTRAINED), 1.0).verdicts
    verdicts += p.handle(obs(Signal.NVLINK_DOWN, 0, 60.0, was_up=0, links="none"), 60.0).verdicts
    verdicts += p.handle(obs(Signal.NVLINK_DOWN, 0, 400.0, was_up=0, links="none"), 400.0).verdicts
    assert verdicts == []
