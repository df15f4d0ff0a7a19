"""Background cells (``%%ddp --bg``): a cell that runs in the ranks while the notebook goes on.

The cell is sent, and the notebook cell returns once its ranks have it (the kernel's main thread waits
those milliseconds, so the ranks see the notebook as it is, as a blocking cell's do); the one cell engine
then supervises it on the background thread, its views publishing into the background cell's output
(``output.Detached``: the background cell's request is their parent, so a front end that keeps listening
to a cell after it returned, as JupyterLab does, shows them live) and kept for ``%ddp attach``.

The rules, in one place:
- never two cells in the ranks at once: one background thread runs the cells sent with ``--bg`` in order
  (a second one queues, one-shot or a pool's, and says so); a blocking ``%%ddp`` cell,
  ``%ddp who/diff/debug/stop/restart`` wait for the background work first and say so
  (``Background.before_foreground``; an interrupt stops the waiting, not the training);
- never beside notebook code: a queued cell starts its ranks (the fork, the OpenMP pause, the notebook's
  names read and sent) only while the notebook runs no cell, and a notebook cell begins only once such a
  start is over (``Turns``: the one lock between the notebook's cells and the background thread's starts;
  a cell waiting for the notebook says so in its output). The cell sent first starts at once: the cell that
  sent it waits, running no notebook code, until its ranks have it;
- results land on the kernel's main thread, between cells (``Background.land``: the next cell's
  ``pre_run_cell``, ``%ddp wait``, a waiting cell), never in the middle of another cell's run; a notebook
  cell that reads a name a background cell will bring back waits for it first (``WaitForNames``, an AST
  transformer: the same notebook gives the same results headless);
- Jupyter's interrupt reaches the main thread only (ranks ignore SIGINT): interrupting another cell never
  touches background ranks; ``%ddp interrupt`` interrupts the background cell as Jupyter's interrupt does a
  blocking one (``Supervisor.interrupt``), and cancels the cells queued behind it;
- a failure is reported in the background cell's own output as a blocking cell reports it, and said once
  more in the next cell (or ``%ddp wait``).
"""
from __future__ import annotations

import ast
import collections
import contextlib
import enum
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

from ...errors import NbddpError, interrupt
from ...views import output
from ..ranks import starters

if TYPE_CHECKING:
    from ..ranks.gang import Gang
    from ..ranks.supervisor import Supervisor

KEPT_JOBS = 16  # ended background cells remembered (%ddp status, %ddp attach)


class BackgroundFailed(NbddpError):
    """A background cell that ``%ddp wait`` (or a cell waiting for its names) waited for failed."""


class StillRunning(NbddpError):
    """``%ddp wait --timeout S``: background work still runs after S seconds (it goes on)."""


class State(enum.Enum):
    """A background cell's life: queued, then running, then ok, failed or interrupted; or cancelled while
    queued (``%ddp interrupt``). Only the background thread moves a job on, but for a queued one's
    cancelling; the notebook's thread reads it (``%ddp status``, ``attach``, ``interrupt``)."""

    QUEUED = "queued"
    RUNNING = "running"
    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"

    def __str__(self) -> str:  # as %ddp status and %ddp attach say it
        return self.value


Work = Callable[[Callable[["Gang"], None]], list]  # work(on_start) -> each rank's Result
Deliver = Callable[[list], None]  # deliver(each rank's Result): the cell's --out/--gather names, in the notebook


class Job:
    """One background cell. ``work(on_start)`` runs it on the background thread and returns each rank's
    Result (raising as a blocking cell would); ``deliver(per_rank)`` brings its --out/--gather names into
    the notebook, on the main thread; ``observer``: its view (a rank's progress for ``%ddp status``).
    ``sender_waits``: the cell that sent it waits until its ranks have it (nothing was running or queued):
    it starts at once, and a refusal before its ranks had it is raised in that cell, as a blocking one's.

    Its state (``State``), when it began and ended, what it brought back and the handshake of an
    interrupt with its ranks' supervisor change under the job's one lock: two threads share it."""

    def __init__(self, number: int, label: str, work: Work, deliver: Deliver, names: tuple,
                 place: output.Detached, observer: object = None):
        self.number, self.label, self.work, self.deliver = number, label, work, deliver
        self.names, self.place, self.observer = names, place, observer
        self.sender_waits = False
        self.tag = ""  # told apart from another background cell of the same number (nbval runs cells unnumbered)
        self.submitted = time.monotonic()
        self.started = threading.Event()  # the ranks have it (or it ended)
        self.done = threading.Event()
        # the notebook's thread's alone: its results delivered or its failure said; its failure raised by a
        # waiter (%ddp wait, a cell that needed its names), once
        self.landed = False
        self.raised = False
        self._lock = threading.Lock()
        self._state = State.QUEUED
        self._began: float | None = None
        self._ended: float | None = None
        self._results: list | None = None
        self._error: BaseException | None = None
        self._sup: Supervisor | None = None  # its ranks' supervisor, once they have the cell
        self._interrupt_asked = False

    # -- what the notebook's thread reads ------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def results(self) -> list | None:
        return self._results

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def name(self) -> str:
        return f"[{self.number}{self.tag}]"

    @property
    def failed(self) -> bool:
        return self._state in (State.FAILED, State.INTERRUPTED)

    @property
    def reached_ranks(self) -> bool:
        """Its ranks had the cell (``on_start``)."""
        with self._lock:
            return self._sup is not None

    @property
    def refused(self) -> bool:
        """It ended with an error before its ranks had the cell (a pool that ended, a devices check)."""
        return self.failed and not self.reached_ranks

    # -- its life: the background thread's, but for cancel -----------------------------------------
    def begin(self) -> None:
        with self._lock:
            assert self._state is State.QUEUED, self._state
            self._state, self._began = State.RUNNING, time.monotonic()

    def cancel(self) -> None:
        """Cancelled while queued (its thread never takes it)."""
        with self._lock:
            assert self._state is State.QUEUED, self._state
            self._state, self._ended = State.CANCELLED, time.monotonic()

    def end(self, results: list | None, error: BaseException | None) -> None:
        """Its work returned ``results``, or raised ``error`` (an interrupt, or any failure)."""
        with self._lock:
            assert self._state is State.RUNNING, self._state
            if error is None:
                self._state, self._results = State.OK, results
            else:
                self._state = State.INTERRUPTED if isinstance(error, KeyboardInterrupt) else State.FAILED
                self._error = error
            self._ended = time.monotonic()

    def on_start(self, gang: Gang) -> None:
        """The engine's: the ranks have the cell; an interrupt asked meanwhile reaches it now."""
        with self._lock:
            self._sup = sup = gang.sup
            asked = self._interrupt_asked
        self.started.set()
        if asked:
            sup.interrupt()

    def interrupt(self) -> None:
        """Its ranks interrupted: now if they have the cell, else as they get it (``on_start``)."""
        with self._lock:
            self._interrupt_asked = True
            sup = self._sup
        if sup is not None:
            sup.interrupt()

    @property
    def fate(self) -> str:
        """What its end said of the pool (the last line of its error naming the pool), or ''."""
        lines = [ln.strip() for ln in str(self.error or "").splitlines() if "pool" in ln.lower()]
        return lines[-1] if lines else ""

    def progress(self) -> str:
        """``rank 0 45%, rank 1 44%`` from its view's last tqdm states ('' when none drew a bar)."""
        got = getattr(self.observer, "progress", None) or {}
        return ", ".join(f"rank {r} {f:.0%}" for r, f in sorted(got.items()))

    def describe(self) -> str:
        now = time.monotonic()
        with self._lock:
            state, began, ended = self._state, self._began, self._ended
        if state is State.QUEUED:
            return f"{self.name} queued {now - self.submitted:.0f} s · {self.label}"
        took = (ended or now) - (began or now)
        bar = self.progress()
        return f"{self.name} {state} {took:.1f} s · {self.label}" + (f" · {bar}" if bar else "")


class Turns:
    """The notebook's cells and the background thread's starts take turns. ``cell_begins``/``cell_ends``
    (IPython's pre_run_cell and post_run_cell, on the notebook's thread) count the notebook's running cells;
    ``hold`` (the background thread, before a queued cell starts its ranks) waits until none runs and keeps
    the next from beginning until ``release`` (its ranks have the cell). ``aside``: the notebook's thread
    waits for background work inside a cell, running no notebook code meanwhile."""

    def __init__(self):
        self._cv = threading.Condition()
        self._cells = 0  # notebook cells running (nested run_cell calls count each)
        self._starting = False

    def cell_begins(self, info=None) -> None:
        with self._cv:
            while self._starting:
                self._cv.wait()
            self._cells += 1

    def cell_ends(self, result=None) -> None:
        with self._cv:
            self._cells = max(0, self._cells - 1)
            self._cv.notify_all()

    @contextlib.contextmanager
    def aside(self):
        with self._cv:
            self._cells -= 1
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                while self._starting:
                    self._cv.wait()
                self._cells += 1

    def hold(self, say) -> None:
        """Until no notebook cell runs (``say()`` once, if one does); then no cell begins until ``release``."""
        with self._cv:
            if self._cells > 0:
                say()
            while self._cells > 0:
                self._cv.wait()
            self._starting = True

    def release(self) -> None:
        with self._cv:
            if self._starting:
                self._starting = False
                self._cv.notify_all()


class Background:
    """The kernel's background work: its cells in order on one thread (a thread for the kernel's life, so
    ranks it forks, whose parent-death signal follows the thread that forked them, live as long as their
    cell), and what became of them."""

    def __init__(self, shell):
        self.shell = shell
        self.turns = Turns()  # the notebook's cells and the queued cells' starts, one at a time
        self.jobs: list[Job] = []  # in the order sent: those still to run or land, and the last KEPT_JOBS ended
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        # as a job's failure lands: its cell failed after all (%ddp_export)
        self.on_failed: Callable[[Job], None] | None = None

    # -- the notebook's side (main thread) ---------------------------------------------------------
    def active(self) -> list[Job]:
        return [j for j in self.jobs if not j.done.is_set()]

    def submit(self, job: Job, sent: str = "background cell {name} sent: the notebook is free") -> None:
        """Send ``job``: it starts now (the main thread waits until its ranks have it) or queues. ``sent``: what is
        said of it (``{name}``: its name)."""
        ahead = self.active()
        job.sender_waits = not ahead
        same = sum(j.number == job.number for j in self.jobs)
        job.tag = "abcdefghijklmnopqrstuvwxyz"[same % 26] if same else ""
        print(f"nbddp: {sent.format(name=job.name)}. Its output keeps arriving here; %ddp status, %ddp attach "
              "(elsewhere, after a reload), %ddp wait, %ddp interrupt.", file=sys.stderr)
        sys.stderr.flush()  # (above the cell's own output, which its thread sends)
        with self._cv:
            self.jobs.append(job)
            ended = [j for j in self.jobs if j.done.is_set() and j.landed]
            for old in ended[:max(0, len(ended) - KEPT_JOBS)]:
                self.jobs.remove(old)
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="nbddp-background", daemon=True)
                self._thread.start()
            self._cv.notify()
        if ahead:
            print(f"nbddp: {job.name} queued behind background cell {', '.join(j.name for j in ahead)}: it starts "
                  "when that ends (%ddp status shows the work, %ddp interrupt stops it)", file=sys.stderr)
            return
        try:
            job.started.wait()
        except KeyboardInterrupt:
            raise interrupt(f"interrupted while background cell {job.name} was being sent: it goes on in the "
                            "background; %ddp interrupt stops it, %ddp status shows it.") from None
        if job.done.is_set() and job.refused:
            # refused before its ranks had it (a pool that ended, a devices check): raised here, as a blocking
            # cell raises it; nothing runs
            job.landed = True
            raise job.error

    def before_foreground(self, what: str) -> None:
        """``what`` (a blocking %%ddp cell, %ddp who, ...) runs in the ranks once the background work ended:
        it waits, saying so; the background's results land first."""
        ahead = self.active()
        if ahead:
            self._wait(ahead, None, f"{what} did not run",
                       f"nbddp: {what} waits for background cell {', '.join(j.name for j in ahead)} to end "
                       "(an interrupt stops the waiting, not the training; %ddp interrupt stops it)")
        self.land()

    def wait(self, timeout: float | None = None) -> None:
        """``%ddp wait``: until every background cell ended; their results land; a failure is raised."""
        jobs = self.active()
        if jobs:
            self._wait(jobs, timeout, "%ddp wait stopped waiting",
                       f"nbddp: waiting for background cell {', '.join(j.name for j in jobs)} (an interrupt stops "
                       "the waiting, not the training)")
        for line in self.land(quiet_failures=True):
            print(line, file=sys.stderr)
        self._raise_failed(self.jobs, "")

    def wait_for_names(self, names) -> None:
        """A notebook cell reads ``names``, which background cells will bring back: it waits for them."""
        jobs = [j for j in self.active() if set(j.names) & set(names)]
        if jobs:
            wanted = sorted(set(names) & {n for j in jobs for n in j.names})
            self._wait(jobs, None, "the cell did not run",
                       f"nbddp: this cell reads {', '.join(wanted)}, which background cell "
                       f"{', '.join(j.name for j in jobs)} brings back: waiting for it (an interrupt stops the "
                       "waiting, not the training)")
        self.land()
        self._raise_failed([j for j in self.jobs if set(j.names) & set(names)],
                           f"\n{', '.join(sorted(names))} did not arrive; the cell did not run.")

    def _raise_failed(self, jobs, then: str) -> None:
        """A failure among ``jobs`` that no waiter raised yet is raised (once), however often it was said: a
        headless run (nbclient, papermill) must fail there, whatever cells ran in between."""
        failed = [j for j in jobs if j.failed and not j.raised]
        for job in failed:
            job.raised = True
        if failed:
            raise BackgroundFailed(_failure_summary(failed) + then)

    def pending_names(self) -> set[str]:
        """Names background cells still running (or queued) will bring back, and those of a failed one no
        waiter raised yet (a cell that reads one fails rather than read an older value)."""
        return {n for j in self.jobs if not j.done.is_set() or (j.failed and not j.raised) for n in j.names}

    def land(self, quiet_failures: bool = False) -> list[str]:
        """Ended cells' results into the notebook, and their failures said once (printed here, on the main
        thread, between cells); ``quiet_failures``: the lines returned instead (``%ddp wait`` raises them)."""
        said = []
        for job in [j for j in self.jobs if j.state not in (State.QUEUED, State.RUNNING) and not j.landed]:
            job.landed = True
            if job.failed and self.on_failed is not None:
                self.on_failed(job)
            if job.state is State.OK:
                try:
                    job.deliver(job.results)
                    if job.names:
                        said.append(f"nbddp: background cell {job.name} ended: {', '.join(job.names)} "
                                    "arrived in the notebook")
                except NbddpError as e:
                    said.append(f"nbddp: background cell {job.name}: {e}")
            elif job.failed and not quiet_failures:
                said.append(_failure_summary([job]))
        if not quiet_failures:
            for line in said:
                print(line, file=sys.stderr)
        return said

    def interrupt(self) -> Job | None:
        """``%ddp interrupt``: the running background cell interrupted, the cells queued behind it cancelled;
        the running one, or None."""
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        for job in queued:
            job.cancel()
            job.place.write("stderr", "nbddp: cancelled by %ddp interrupt before it started; nothing ran.\n")
            job.place.flush()
            job.started.set()
            job.done.set()
        running = next((j for j in self.jobs if j.state is State.RUNNING), None)
        if running is not None:
            running.interrupt()
        return running

    def attach(self, parent: dict) -> Job | None:
        """``%ddp attach``: the running background cell (else the last one) shown in the asking cell."""
        job = next((j for j in reversed(self.jobs) if j.state is State.RUNNING), None) or (
            next((j for j in reversed(self.jobs) if j.state is not State.QUEUED), None))
        if job is not None:
            job.place.attach(parent)
        return job

    def status(self) -> list[str]:
        return [j.describe() for j in self.jobs]

    def _wait(self, jobs: list[Job], timeout: float | None, stopped: str, say: str) -> None:
        """Until ``jobs`` ended (``say`` said first); an interrupt, even while saying it, stops the waiting."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            print(say, file=sys.stderr)
            sys.stderr.flush()
            for job in jobs:
                left = None if end is None else max(0.0, end - time.monotonic())
                with self.turns.aside():  # (a cell queued behind the one awaited may start meanwhile)
                    finished = job.done.wait(left)
                if not finished:
                    raise StillRunning(f"still running after {timeout:g} s: "
                                       f"{'; '.join(j.describe() for j in jobs if not j.done.is_set())}.\n"
                                       "The training goes on: %ddp wait again, %ddp status to look, %ddp attach to "
                                       "watch it here, %ddp interrupt to stop it.")
        except KeyboardInterrupt:
            running = [j.name for j in jobs if not j.done.is_set()]
            raise interrupt(f"{stopped}: the interrupt stopped the waiting. Background cell {', '.join(running)} "
                            "goes on in its ranks; %ddp interrupt stops it, %ddp status shows it.") from None

    # -- the background thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
                job.begin()  # (under the queue's lock: %ddp interrupt, which empties the queue, finds it running)
            self._run(job)

    def _run(self, job: Job) -> None:
        # the notebook's thread waits at most SWITCH_S for the interpreter lock while this one runs a cell
        with output.routed(job.place), starters.SWITCH_INTERVAL.lowered(SWITCH_S):
            results, error = None, None
            try:
                if not job.sender_waits:  # queued: its ranks start between notebook cells
                    self.turns.hold(lambda: job.place.write(
                        "stderr", f"nbddp: {job.name} starts when the notebook's running cell ends (a queued "
                        "cell starts its ranks between notebook cells)\n"))
                results = job.work(self._started(job))
            except BaseException as e:  # noqa: BLE001 - reported in its cell, said again in the next one
                error = e  # (an interrupt too: Job.end tells them apart)
            finally:
                self.turns.release()
                job.end(results, error)  # ended before its failure shows: a cell run once it shows says it (land)
                if error is not None:
                    self._report(job, error)
                job.place.flush()
                job.started.set()
                job.done.set()

    def _started(self, job: Job):
        def on_start(gang) -> None:
            self.turns.release()  # the ranks have the cell: the notebook may go on
            job.on_start(gang)

        return on_start

    def _report(self, job: Job, err: BaseException) -> None:
        """The failure in the background cell's output, as a blocking cell shows it (a refusal before the
        ranks had the cell is raised by the cell that sent it instead)."""
        if job.sender_waits and not job.reached_ranks:
            return
        render = getattr(err, "_render_traceback_", None)
        if render is not None:
            lines = render()
        else:
            try:
                lines = self.shell.InteractiveTB.structured_traceback(type(err), err, err.__traceback__)
            except Exception:  # noqa: BLE001 - a plain line still says what happened
                lines = [f"{type(err).__name__}: {err}"]
        job.place.error(type(err).__name__, str(err).split("\n", 1)[0], list(lines))


# the interpreter's thread switch interval while a background cell runs (CPython's: 5 ms): at 5 ms, a
# notebook cell's reply waited up to that each time the background thread was busy (a trivial background
# cell's round trip was 1.5x a blocking one's). Ranks start with the kernel's own (starters.SwitchInterval).
SWITCH_S = 0.0005


def _failure_summary(jobs: list[Job]) -> str:
    parts = []
    for job in jobs:
        first = str(job.error or "").strip().partition("\n")[0]
        fate = f"\n  {job.fate}" if job.fate and job.fate != first.strip() else ""  # what became of the pool
        parts.append(f"nbddp: background cell {job.name} {job.state}: {first}{fate}"
                     "\n  (its own output has the whole report; %ddp attach shows it again)")
    return "\n".join(parts)


class WaitForNames(ast.NodeTransformer):
    """An AST transformer: a notebook cell that reads a name a background cell will bring back first waits
    for that cell (a call put before its first statement, on that statement's line: tracebacks keep the
    cell's line numbers). Costs a cell nothing while no background cell has names to bring back.

    The call reaches its function as an object, bound in the notebook's namespace under ``NAME`` as IPython
    binds its own (hidden from ``%who``), and bound again whenever a call is put (``%reset`` clears it):
    no module path travels in the cell's code as text."""

    NAME = "_nbddp_wait_for_names"

    def __init__(self, background: Background, shell):
        self.background, self.shell = background, shell
        self._wait = background.wait_for_names

    @classmethod
    def remove(cls, shell) -> None:
        """The transformers taken off ``shell`` (``%unload_ext``, ``%reload_ext``), and the name they bound."""
        shell.ast_transformers[:] = [t for t in shell.ast_transformers if not isinstance(t, cls)]
        shell.user_ns.pop(cls.NAME, None)
        getattr(shell, "user_ns_hidden", {}).pop(cls.NAME, None)

    def visit_Module(self, node: ast.Module) -> ast.Module:
        pending = self.background.pending_names()
        if not pending or not node.body:
            return node
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        wanted = sorted(read & pending)
        if not wanted:
            return node
        at = next((i for i, st in enumerate(node.body)  # after `from __future__ import ...`, which come first
                   if not (isinstance(st, ast.ImportFrom) and st.module == "__future__")), len(node.body))
        line = node.body[min(at, len(node.body) - 1)].lineno
        self.shell.push({self.NAME: self._wait}, interactive=False)
        call = ast.Expr(ast.Call(ast.Name(self.NAME, ast.Load()), [ast.Constant(tuple(wanted))], []))
        for sub in ast.walk(call):
            if isinstance(sub, (ast.stmt, ast.expr)):
                sub.lineno = sub.end_lineno = line
                sub.col_offset, sub.end_col_offset = 0, 0
        node.body.insert(at, call)
        return node
