"""The failure timeline's deadlines (nbddp/timeline.py) keep the order its docstring relies on, and they live
there alone: no other module defines one of them again."""
import ast
import pathlib

from nbddp import timeline

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEADLINES = [n for n in vars(timeline) if n.endswith("_S")]


def test_the_looks_are_quicker_than_the_graces_they_end():
    assert timeline.MIN_GAP_S < timeline.POLL_S < timeline.PEER_GRACE_S
    assert timeline.POLL_S < timeline.STUCK_S


def test_an_interrupted_rank_answers_before_the_barrier_and_the_regroup_give_up():
    assert timeline.STUCK_S <= timeline.HEALTH_S < timeline.REGROUP_S
    assert timeline.ABORT_AFTER_S <= timeline.HEALTH_S  # an NCCL rank aborts in time to answer


def test_a_node_beats_and_answers_looks_well_before_it_is_taken_as_lost():
    assert timeline.BEAT_S < timeline.SILENT_S and timeline.LOOK_LOST_S < timeline.SILENT_S
    assert timeline.MOVED_S < timeline.MOVE_S


def test_a_pools_ranks_are_asked_to_stop_before_they_are_terminated_and_killed():
    assert timeline.SETTLE_S < timeline.PEER_GRACE_S  # losses that come together are mended together, early
    assert timeline.STOP_S > 0 and timeline.GRACE_S > 0


def test_every_deadline_is_defined_in_the_timeline_only():
    """No module but nbddp/timeline.py assigns one of its names at module level (a copy would drift)."""
    twice = []
    for path in sorted((ROOT / "nbddp").rglob("*.py")):
        if path.name == "timeline.py" and path.parent.name == "nbddp":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            twice += [f"{path.relative_to(ROOT)}:{node.lineno} {t.id}" for t in targets
                      if isinstance(t, ast.Name) and t.id in DEADLINES]
    assert len(DEADLINES) >= 20 and not twice, twice
