"""deployments.released at its edges: a tombstone refuses within kept_s of its release,
that instant included, and an ended request's refuses every call until then."""

from deployments.released import Released


def test_a_tombstone_refuses_up_to_kept_s_inclusive():
    now = [0.0]
    released = Released(kept_s=10.0, capacity=4, clock=lambda: now[0])
    released.add("a")
    released.add("b", ended=True)
    now[0] = 10.0  # exactly kept_s after the release: still within it
    assert released.refuses("a") and not released.refuses("a")
    assert released.refuses("b") and released.refuses("b") and len(released) == 1
    now[0] = 10.25
    assert not released.refuses("b") and len(released) == 0
