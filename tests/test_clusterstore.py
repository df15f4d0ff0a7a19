"""A cluster pool's pieces that need no Ray: the kernel's store and its threads (nbddp/cluster/groupstore.py,
remote.Streams), the ranks' pipe store (nbddp/rank/pipestore.py), and where a grow's ranks go (reshape.room)."""
import os
import pickle
import select
import threading

import pytest

from nbddp import timeline
from nbddp.cluster import remote
from nbddp.kernel.ranks import failure, groupstore
from nbddp.kernel.ranks.supervisor import Exited, Output, Supervisor
from nbddp.wire import agentmessages, framing

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _still_works(r: int, w: int) -> bool:
    os.write(w, b"x")
    return os.read(r, 1) == b"x"


def _serving_one_rank():
    """LocalStores serving one rank's two pipes: (stores, the rank's request end, the rank's reply end)."""
    stores = groupstore.LocalStores(groupstore.Store())
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    stores.add(req_r, rep_w)
    stores.start()
    return stores, req_w, rep_r


def test_local_stores_close_twice_closes_nothing_that_reused_its_descriptors():
    stores, req_w, rep_r = _serving_one_rank()
    stores.close()
    r, w = os.pipe()  # takes numbers the close just freed
    try:
        stores.close()  # (an interrupt during the health check closes the gang, then the cell's end again)
        assert _still_works(r, w)
    finally:
        for fd in (r, w, req_w, rep_r):
            os.close(fd)


def test_streams_close_twice_closes_nothing_that_reused_its_descriptors():
    sup = Supervisor([])
    streams = remote.Streams(sup, groupstore.Store())
    sup.close()
    streams.close()
    r, w = os.pipe()
    try:
        streams.close()
        assert _still_works(r, w)
    finally:
        os.close(r)
        os.close(w)


def test_a_ranks_store_pipes_are_closed_here_when_it_is_gone():
    stores, req_w, rep_r = _serving_one_rank()
    try:
        os.close(req_w)  # the rank exits: its request pipe's end reaches EOF
        assert select.select([rep_r], [], [], 10)[0], "the reply pipe's kernel end is still open"
        assert os.read(rep_r, 1) == b""
    finally:
        stores.close()
        os.close(rep_r)


def test_an_interrupt_in_a_subscriber_loses_none_of_the_other_events_of_a_batch():
    seen = []

    class Interrupted:  # the relay, say, when Ctrl-C lands while it writes
        def on_Output(self, event):
            seen.append(event.data)
            if len(seen) == 1:
                raise KeyboardInterrupt

    sup = Supervisor([Interrupted()])
    streams = remote.Streams(sup, groupstore.Store())
    link = remote.Link(None, "n1", [1])
    streams.procs[1] = remote.RemoteProc(1, 4242, -1, here=False, link=link)
    try:
        streams.events.put(streams.took(link, [Output(1, "stdout", b"a"), Output(1, "stdout", b"b"),
                                               Output(1, "stdout", b"c")]))
        streams._wake()
        with pytest.raises(KeyboardInterrupt):
            streams.deliver()
        assert select.select([streams.wake_r], [], [], 0)[0], "the rest is due on the loop's next turn"
        streams.deliver()
        assert seen == [b"a", b"b", b"c"]
    finally:
        streams.close()
        sup.close()


def test_what_a_node_said_before_its_agent_renumbered_its_ranks_reaches_them_under_their_new_numbers():
    """The pool shrank: rank 2 of this node is rank 1 now. What its agent queued before it applied that (rank 2's
    output, its exit: it was killed meanwhile) still says "rank 2", and must reach the rank the kernel now calls
    1 (not be dropped, nor reach another); after the agent's mark, its numbers are the new ones."""
    seen = []

    class Seen:
        def on_Output(self, event):
            seen.append((event.rank, event.data))

        def on_Exited(self, event):
            seen.append((event.rank, event.exit.rank, "exited"))

    sup = Supervisor([Seen()])
    streams = remote.Streams(sup, groupstore.Store())
    link, other = remote.Link(None, "n1", [1, 2]), remote.Link(None, "n2", [3])
    for rank, lk in ((1, link), (2, link), (3, other)):
        streams.add(rank, 4000 + rank, lk)
    try:
        # the kernel renumbers (rank 1 was lost: 2 -> 1 here, 3 -> 2 on the other node) as reshape.renumber does
        link.unmarked.append({2: 1})
        other.unmarked.append({3: 2})
        streams.procs = {1: streams.procs[2], 2: streams.procs[3]}
        for p in streams.procs.values():
            p.rank = {4002: 1, 4003: 2}[p.pid]
        streams.events.put(streams.took(link, [Output(2, "stdout", b"old 2"), Output(1, "stdout", b"lost 1"),
                                               agentmessages.Renumbered(), Output(1, "stdout", b"new 1")]))
        streams.events.put(streams.took(other, [Output(3, "stdout", b"old 3"), Exited(3, failure.RankExit(3, -9)),
                                                agentmessages.Renumbered()]))
        streams.deliver()
        assert seen == [(1, b"old 2"), (1, b"new 1"), (2, b"old 3"), (2, 2, "exited")], seen
        assert not link.unmarked and not other.unmarked
        assert streams.procs[1].exit is None and streams.procs[2].exit.rank == 2
    finally:
        streams.close()
        sup.close()


def test_an_agent_applies_a_signal_sent_before_a_renumbering_to_the_rank_it_was_meant_for():
    """The kernel signals rank 2, then renumbers (rank 1 was lost: 2 -> 1, 3 -> 2): the signal reaches the process
    that was rank 2 when it was sent, not the one called 2 after; the stream marks the renumbering after it."""
    from types import SimpleNamespace

    from nbddp.cluster.agent import HANDLERS, Agent

    got = []

    def proc(rank, pid):
        p = SimpleNamespace(rank=rank, pid=pid, exit=None, stop_sent=False)
        p.signal = lambda sig, group: got.append((p.pid, sig))
        return p

    agent = Agent()
    os.set_blocking(agent.wake_r, False)  # (as the supervisor's watch sets it)
    procs = [proc(2, 4002), proc(3, 4003)]
    agent.sup = SimpleNamespace(procs=procs, live=lambda: [p for p in agent.sup.procs if p.exit is None])
    agent.logs = SimpleNamespace(renumber=lambda paths: None)
    agent.run_dir = SimpleNamespace(log=lambda rank: f"rank{rank}.log")
    HANDLERS[agentmessages.Signal](agent, agentmessages.Signal(2, 10, False))
    renumbering = threading.Thread(target=HANDLERS[agentmessages.Renumber],
                                   args=(agent, agentmessages.Renumber({2: 1, 3: 2})), daemon=True)
    renumbering.start()
    while agent.calls.qsize() < 2:  # (the renumbering queued after the signal, as the kernel's calls came)
        threading.Event().wait(0.01)
    agent._wake()
    renumbering.join(10)
    assert got == [(4002, 10)], got
    assert [(p.pid, p.rank) for p in agent.sup.procs] == [(4002, 1), (4003, 2)]
    assert agent.queue == [agentmessages.Renumbered()]


def test_a_store_wait_pending_across_a_renumbering_is_answered_to_the_process_that_asked():
    """Rank 2 of a node waits on the kernel's store for a key; the pool shrinks (2 -> 1, 3 -> 2) before the key is
    set. The reply goes to the process that asked, now rank 1, not to the one that took the number 2."""
    from types import SimpleNamespace

    from nbddp.cluster import agent as agent_mod

    agent = agent_mod.Agent()
    agent._reset("pool-1")
    pipes = {pid: (os.pipe(), os.pipe()) for pid in (4002, 4003)}  # pid -> ((req_r, req_w), (rep_r, rep_w))
    agent.sup = SimpleNamespace(procs=[SimpleNamespace(rank=2, pid=4002, exit=None),
                                       SimpleNamespace(rank=3, pid=4003, exit=None)],
                                unwatch=lambda fd: None)
    agent.logs = SimpleNamespace(renumber=lambda paths: None)
    agent.run_dir = SimpleNamespace(log=lambda rank: f"rank{rank}.log")
    for rank, pid in ((2, 4002), (3, 4003)):
        (req_r, _), (_, rep_w) = pipes[pid]
        agent.cmd[rank] = os.pipe()[1]
        agent.replies[pid] = rep_w
        agent.requests[req_r] = (pid, agent_mod.Reader())
    store = groupstore.Store()
    link = SimpleNamespace(control=lambda call: agent_mod.HANDLERS[type(call)](agent, call))
    streams = remote.Streams(Supervisor([]), store)
    try:
        (req_r, req_w), (rep_r, _) = pipes[4002]
        os.write(req_w, framing.encode((7, "wait", (["late"],))))
        agent._store_request(req_r)
        assert streams.took(link, agent.queue) == [] and not select.select([rep_r], [], [], 0)[0]
        agent_mod._moved(agent, {2: 1, 3: 2})  # the renumbering, before the key is set
        store.handle((8, "set", ("late", b"v")), lambda frame: None)
        assert [r for r, _ in framing.Reader().feed(os.read(rep_r, 1 << 16))] == [(7, True, None)]
        assert not select.select([pipes[4003][1][0]], [], [], 0)[0], "the reply reached the new rank 2"
    finally:
        streams.close()
        for fd in [fd for (a, b) in pipes.values() for fd in (*a, *b)] + list(agent.cmd.values()):
            try:
                os.close(fd)
            except OSError:
                pass


def test_a_pipe_to_a_rank_that_ended_stays_open_until_the_next_call_so_a_write_under_way_reaches_no_new_rank():
    """Rank 2 ended: the supervisor's thread lets go of its command and store reply pipes (a renumbering) while a
    Ray thread may be writing to one. Closed there, the number could be taken by the next pipe opened (a new rank's)
    and that write reach it. They are closed by the kernel's next call, under ``order``, where no write is under
    way."""
    from types import SimpleNamespace

    from nbddp.cluster import agent as agent_mod

    agent = agent_mod.Agent()
    agent._reset("pool-1")
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    agent.cmd[2], agent.replies[4002] = cmd_w, rep_w
    agent.sup = SimpleNamespace(procs=[SimpleNamespace(rank=2, pid=4002, exit=0)])
    agent.logs = SimpleNamespace(renumber=lambda paths: None)
    agent.run_dir = SimpleNamespace(log=lambda rank: f"rank{rank}.log")
    opened = []
    try:
        agent_mod._moved(agent, {})  # (on the supervisor's thread) rank 2 is forgotten
        assert agent.cmd == {} and agent.replies == {}
        opened = [*os.pipe(), *os.pipe()]  # a new rank's pipes
        assert not {cmd_w, rep_w} & set(opened), "a pipe number let go of was reused while a write may be under way"
        agent_mod.write_all(rep_w, b"late reply")  # the write that was under way: to the old rank's pipe
        assert os.read(rep_r, 64) == b"late reply"
        # the kernel's next call
        agent.control(pickle.dumps(agentmessages.AgentCall("pool-1", 1, agentmessages.Command(b"frame", [2]))))
        for fd in (cmd_w, rep_w):
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        for fd in (cmd_r, rep_r, *opened, *agent.retired):
            os.close(fd)


def test_an_agents_look_at_its_ranks_is_one_call_per_node_reaches_each_rank_and_one_older_than_a_signal_is_not_used():
    """kernel/cells/grace.py asks a remote rank how it is (``RemoteProc.look``): one call asks the node's agent for
    all its ranks, and none more while it is unanswered (however many of its ranks are looked at); the agent looks
    at its live ranks on the supervisor's thread and streams the answer; the kernel keeps each on its rank, under
    the number the kernel gives it now (a renumbering the agent has not marked yet: its 2 is the kernel's 1, its 3
    the kernel's 0). An answer to an ask made before a rank's last signal says nothing of what came after it: not
    used, and a fresh ask goes at once."""
    import signal
    from types import SimpleNamespace

    from nbddp.cluster.agent import HANDLERS, Agent
    from nbddp.hw import procwait

    agent = Agent()
    os.set_blocking(agent.wake_r, False)
    mine = [SimpleNamespace(rank=r, pid=os.getpid(), exit=None, look=lambda: procwait.look(os.getpid()))
            for r in (2, 3)]
    agent.sup = SimpleNamespace(procs=mine, live=lambda: mine)
    asked = []
    link = remote.Link(None, "n1", [1, 0])
    link.control = asked.append
    sup = Supervisor([])
    streams = remote.Streams(sup, groupstore.Store())
    link.unmarked.append({2: 1, 3: 0})

    def answered(ask):
        HANDLERS[agentmessages.LookAtRanks](agent, agentmessages.LookAtRanks(ask))
        agent._wake()
        streams.events.put(streams.took(link, agent.queue))
        agent.queue = []
        streams.deliver()

    try:
        one, zero = streams.add(1, 4002, link), streams.add(0, 4003, link)
        assert one.look() is None and zero.look() is None and one.look() is None, "nothing yet"
        assert asked == [agentmessages.LookAtRanks(1)], "one ask for the node's ranks while it is unanswered"
        answered(1)
        assert isinstance(one.look(), procwait.Look) and not one.looked[1].on_futex  # (this thread runs)
        assert isinstance(zero.look(), procwait.Look) and asked == [agentmessages.LookAtRanks(1),
                                                                    agentmessages.LookAtRanks(2)]
        one.signal(signal.SIGUSR2, group=False)
        assert asked[-1] == agentmessages.Signal(1, int(signal.SIGUSR2), False)
        assert one.look() is None, "the answer to an ask before the signal"
        assert asked[-1] == agentmessages.LookAtRanks(3), \
            "asked again at once: the one in flight was asked before the signal"
        answered(2)
        assert one.look() is None and isinstance(zero.look(), procwait.Look), "2 was asked before 1's signal"
        answered(3)
        assert isinstance(one.look(), procwait.Look) and link.looks_answered == 3
        assert asked[-1] == agentmessages.LookAtRanks(4)
        zero.look()
        assert asked[-1] == agentmessages.LookAtRanks(4), "unanswered: not asked again"
        link.looks_at -= timeline.LOOK_LOST_S  # unanswered that long: taken as lost, asked again
        zero.look()
        assert asked[-1] == agentmessages.LookAtRanks(5)
    finally:
        streams.close()
        sup.close()
        for fd in (agent.wake_r, agent.wake_w):
            os.close(fd)


def test_a_grow_reuses_an_emptied_node_only_where_its_bundle_holds_the_chunk(monkeypatch):
    """--devices 2: a node a short last chunk made holds 1 rank's bundle. Emptied by a shrink, it takes a chunk of
    1 again, never one of 2 (its GPUs would not be there): that chunk goes to the full emptied node or a new one."""
    from types import SimpleNamespace

    from nbddp.cluster import placement, reshape

    def emptied(node, slots):
        link = remote.Link(None, node, [])
        link.slots, link.lost, link.clean = slots, "finished", True
        return link

    short, full = emptied("short", 1), emptied("full", 2)
    reserved = []

    def room(ray, index, used, bundle, within):
        reserved.append(bundle)
        return SimpleNamespace(node_id=f"new{index}"), object(), 0

    monkeypatch.setattr(placement, "room", room)
    gang = SimpleNamespace(links=[short, full], per_node=2, placed=[SimpleNamespace(node_id="k")], extra_pgs=[],
                           plan=SimpleNamespace(accelerator="cuda"), ray=None,
                           sup=SimpleNamespace(wait=lambda *a, **kw: None))
    assert reshape.room(gang, 3) == [full, short], "2 ranks onto the full node, the last 1 onto the short one"
    where = reshape.room(gang, 4)
    assert where[0] is full and where[1][0].node_id == "new1" and reserved == [{"GPU": 2}], \
        "the short node cannot take a chunk of 2: a new node is reserved for it"


def test_a_wake_nobody_drains_yet_never_blocks_the_stream_reader_or_the_agent():
    from nbddp.cluster.agent import HANDLERS, Agent

    sup = Supervisor([])
    streams = remote.Streams(sup, groupstore.Store())
    agent = Agent()

    def many():
        for _ in range(100_000):  # > 64 KiB of wakes while the kernel's main thread is elsewhere
            streams._wake()
            HANDLERS[agentmessages.Signal](agent, agentmessages.Signal(1, 0, False))

    t = threading.Thread(target=many, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), "a wake blocked on a full pipe (the node's store requests would stop being served)"
    finally:
        streams.close()
        sup.close()


def _answered(store, op, *args):
    """Store.handle's answer to one request, None while it waits."""
    got = []
    store.handle((1, op, args), got.append)
    return framing.Reader().feed(got[0])[0][0][1:] if got else None


def test_the_store_answers_as_torch_expects_and_a_wait_once_its_keys_are_set():
    store = groupstore.Store()
    assert _answered(store, "add", "n", 2) == (True, 2)
    assert _answered(store, "add", "n", 3) == (True, 5)
    assert _answered(store, "compare_set", "k", b"", b"first") == (True, b"first")  # missing, expected empty: set
    assert _answered(store, "compare_set", "k", b"other", b"second") == (True, b"first")  # mismatch: the current
    waiting = []
    store.handle((7, "wait", (["late"],)), waiting.append)
    assert not waiting, "answered before its key was set"
    store.handle((8, "set", ("late", b"v")), lambda frame: None)
    assert [r for r, _ in framing.Reader().feed(waiting[0])] == [(7, True, None)]
    ok, why = _answered(store, "no_such_op")
    assert not ok and "AttributeError" in why


def test_a_pipe_store_call_times_out_and_its_late_reply_is_dropped():
    from nbddp.rank import pipestore

    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    store = pipestore.connect(req_w, rep_r, 0.2)
    try:
        with pytest.raises(Exception, match="timed out after 0.2 s"):
            store.get("k")  # nobody answers
        os.write(rep_w, framing.encode((1, True, b"late")) + framing.encode((2, True, 5)))
        assert store.add("n", 5) == 5, "the timed-out get's reply was taken for the add's"
        asked = [r for r, _ in framing.Reader().feed(os.read(req_r, 1 << 16))]
        assert [(rid, op) for rid, op, _ in asked] == [(1, "get"), (2, "add")]
    finally:
        for fd in (req_r, req_w, rep_r, rep_w):
            os.close(fd)


def test_a_cluster_pools_dashboard_samples_only_this_machines_gpus(tmp_path, monkeypatch):
    """Ranks on node 0 use GPUs 4 and 5 here; node 1's ranks see theirs as 0 and 1: not this machine's."""
    from nbddp.cluster.clustergang import ClusterGang
    from nbddp.kernel import devices, options
    from nbddp.views.poolview import PoolView

    monkeypatch.setenv("NBDDP_RUNS_DIR", str(tmp_path))
    gang = ClusterGang(options.config({"cluster": "ray", "nodes": 2}), devices.Plan("cuda", "nccl", (4, 5)),
                       view_for=lambda plan, run_dir: PoolView(plan, run_dir, shown=False))
    try:
        assert sorted(gang.view.monitor.gpus) == [4, 5]
        assert gang.view.plan.device_ids == (4, 5, 0, 1)  # the device column still names each rank's own
        assert gang.view._device(2, 0) == "cuda:0"
    finally:
        gang.local.close()
        gang.close()


def test_an_agent_applies_its_pools_calls_in_order_and_ignores_the_last_pools():
    from nbddp.cluster.agent import Agent

    agent = Agent()  # (kept between pools: each pool's calls carry its id)
    agent._reset("pool-1")
    cmd_r, agent.cmd[1] = os.pipe()  # rank 1's command pipe
    os.set_blocking(cmd_r, False)

    def call(pool, seq, frame):
        agent.control(pickle.dumps(agentmessages.AgentCall(pool, seq, agentmessages.Command(frame, [1]))))

    def written():
        try:
            return os.read(cmd_r, 1 << 16)
        except BlockingIOError:
            return b""

    try:
        call("pool-1", 2, b"second")  # came before the first: waits for it
        call("pool-0", 1, b"stale")  # the last pool's, late: ignored
        assert written() == b""
        call("pool-1", 1, b"first")
        assert written() == b"firstsecond"
    finally:
        for fd in (cmd_r, agent.cmd[1], agent.wake_r, agent.wake_w):
            os.close(fd)
