"""``background.Turns`` without a kernel: the notebook's cells and the background thread's starts take
turns (the rules in kernel/cells/background.py's docstring), each test a few threads and an Event."""
import threading
import time

import pytest

from nbddp.kernel.cells.background import Turns

pytestmark = pytest.mark.unit  # starts no kernel, forks no rank (README's fast command)

WAIT_S = 5.0  # what a step that must happen gets; one that must not is given BLOCKED_S to show it does not
BLOCKED_S = 0.2


def _thread(fn, *args) -> tuple[threading.Thread, threading.Event]:
    """``fn`` on a thread of its own; the Event is set once it returned."""
    done = threading.Event()

    def run():
        fn(*args)
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_a_start_with_no_notebook_cell_running_holds_at_once_and_says_nothing():
    turns, said = Turns(), []
    turns.hold(lambda: said.append(1))
    assert said == []
    turns.release()


def test_a_start_waits_for_the_running_cell_and_says_so_once():
    turns, said = Turns(), []
    turns.cell_begins()
    _, held = _thread(turns.hold, lambda: said.append("waiting"))
    assert not held.wait(BLOCKED_S), "the start began beside a running notebook cell"
    assert said == ["waiting"]
    turns.cell_ends()
    assert held.wait(WAIT_S)
    assert said == ["waiting"]
    turns.release()


def test_nested_cells_count_each_the_start_waits_for_the_outer_to_end():
    turns = Turns()
    turns.cell_begins()
    turns.cell_begins()  # a run_cell inside a cell
    _, held = _thread(turns.hold, lambda: None)
    turns.cell_ends()
    assert not held.wait(BLOCKED_S)
    turns.cell_ends()
    assert held.wait(WAIT_S)
    turns.release()


def test_no_notebook_cell_begins_while_a_start_is_held_until_it_is_released():
    turns = Turns()
    turns.hold(lambda: None)
    _, begun = _thread(turns.cell_begins)
    assert not begun.wait(BLOCKED_S), "a notebook cell began in the middle of a background start"
    turns.release()
    assert begun.wait(WAIT_S)
    turns.cell_ends()


def test_aside_lets_a_start_through_while_the_cell_waits_and_comes_back_only_once_it_is_released():
    turns, said = Turns(), []
    turns.cell_begins()
    back = threading.Event()
    holding = threading.Event()
    release = threading.Event()

    def waiting_cell():  # the notebook's thread waiting for background work inside a cell (``%ddp wait``)
        with turns.aside():
            holding.wait(WAIT_S)
        back.set()

    def start():
        turns.hold(lambda: said.append("waiting"))  # (no notebook cell counts while it waits aside)
        holding.set()
        release.wait(WAIT_S)
        turns.release()

    cell, _ = _thread(waiting_cell)
    starter, _ = _thread(start)
    assert holding.wait(WAIT_S), "the start did not get through while the cell waited aside"
    assert said == []
    assert not back.wait(BLOCKED_S), "the cell went on in the middle of a background start"
    release.set()
    assert back.wait(WAIT_S)
    cell.join(WAIT_S)
    starter.join(WAIT_S)
    # the cell counts again: the next start waits for it
    _, held = _thread(turns.hold, lambda: None)
    assert not held.wait(BLOCKED_S)
    turns.cell_ends()
    assert held.wait(WAIT_S)
    turns.release()


def test_a_cell_end_never_counts_below_none_and_a_release_without_a_hold_changes_nothing():
    turns = Turns()
    turns.cell_ends()  # (post_run_cell of a cell whose pre_run_cell came before the extension loaded)
    turns.release()
    start = time.monotonic()
    turns.hold(lambda: pytest.fail("no cell runs"))
    assert time.monotonic() - start < WAIT_S
    turns.release()
    turns.cell_begins()
    turns.cell_ends()
