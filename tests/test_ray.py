"""Issue 24 through a real kernel: a pool across the nodes of a Ray cluster. The cluster is several raylets
on this one host (ray.cluster_utils.Cluster), shared by the module; ranks are CPU gloo ranks."""
import os
import re
import signal
import time

import psutil
import pytest

from helpers import POOL
from kernel import Kernel, said

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'nbddp[ray]'")
from ray.cluster_utils import Cluster  # noqa: E402 - only where Ray is installed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(runs_dir):
    """Three raylets on this host: the head (the kernel's node) and two more, one CPU each. After runs_dir:
    the raylets, and so the agents, inherit NBDDP_RUNS_DIR (their run directories go there)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    extra = [c.add_node(num_cpus=1), c.add_node(num_cpus=1)]
    c.wait_for_nodes()
    yield c, extra
    c.shutdown()


@pytest.fixture(scope="module")
def rk(cluster, runs_dir):
    """A kernel connected to the cluster, nbddp loaded."""
    c, _ = cluster
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok(f"%load_ext nbddp\nimport torch, os, sys\nimport ray\nray.init(address={c.address!r}, "
             "logging_level='ERROR', log_to_driver=False)\nNone")
        yield k


def ranks_alive(pids) -> list:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def wait_gone(pids, within: float = 20.0) -> list:
    end = time.monotonic() + within
    while ranks_alive(pids) and time.monotonic() < end:
        time.sleep(0.1)
    return ranks_alive(pids)


@pytest.fixture
def pool(rk):
    """A 2-node pool, one rank per node; stopped after the test, its ranks checked gone by pid."""
    res = rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    assert "pool of 2 rank(s) on cpu/gloo ready" in res.stdout, res.stdout + res.stderr
    rk.ok("%%ddp --gather pid\npid = os.getpid()\n")
    pids = rk.value("pid")
    yield rk, pids
    rk.run("%ddp stop", timeout=60)
    assert not wait_gone(pids), "a rank outlived its pool"


def test_cells_keep_state_all_reduce_spans_nodes_and_output_keeps_each_ranks_order(pool):
    k, pids = pool
    assert pids[0] in [p.pid for p in k.process().children()], "rank 0 is forked from the kernel"
    assert pids[1] not in [p.pid for p in k.process().children(recursive=True)], "rank 1 is the agent's"
    k.ok("%%ddp\nimport torch.distributed as dist\nt = torch.ones(3) * (rank + 1)\n")
    res = k.ok("%%ddp --gather where total\nwhere = (os.environ['NODE_RANK'], os.environ['LOCAL_RANK'], "
               "os.environ['GROUP_RANK'], os.environ['LOCAL_WORLD_SIZE'], local_rank, world_size)\n"
               "dist.all_reduce(t)\ntotal = t.tolist()\nfor i in range(200):\n    print(f'line {i}')\n"
               "import sys\nprint('to stderr', file=sys.stderr)\nrank * 10\n")
    assert k.value("where") == [("0", "0", "0", "1", 0, 2), ("1", "0", "1", "1", 0, 2)]
    assert k.value("total") == [[3.0] * 3] * 2
    assert res.result == "0", "the last expression comes from rank 0"
    for r in (0, 1):  # each rank's lines whole, prefixed, in its own order
        mine = [int(m) for m in re.findall(rf"^\[rank(?:{r}|0-1)\]:line (\d+)$", res.stdout, re.MULTILINE)]
        assert mine == list(range(200)), (r, mine[:5])
        assert said(res.stderr, r, "to stderr"), res.stderr
    status = k.ok("%ddp status").displays[-1]["data"]["text/plain"]  # the pool's dashboard: each rank's node
    assert re.search(r"^0\s+\d+\s+cpu node 0 \(\S+\)\s+idle", status, re.MULTILINE), status
    assert re.search(r"^1\s+-\s+cpu node 1 \(\S+\)\s+idle", status, re.MULTILINE), status


def test_a_large_answer_and_much_output_from_the_other_node_arrive_whole(pool):
    k, _ = pool  # a cell's answer over Ray's inline limit (100 KB) comes back through Ray's object store
    res = k.ok("%%ddp --gather blob --max-lines 30000\nfor i in range(20000):\n    print(f'{rank} line {i}')\n"
               "blob = bytes(2_000_000 + rank)\n", timeout=120)
    assert k.value("[len(b) for b in blob]") == [2_000_000, 2_000_001]
    for rank in (0, 1):
        assert [int(line.split()[-1]) for line in res.stdout.splitlines() if line.startswith(f"[rank{rank}]:")] \
            == list(range(20000)), f"rank {rank}'s lines, whole and in order"


def test_a_notebook_name_reaches_the_other_node_and_a_rebound_one_is_sent_again(pool):
    k, _ = pool
    k.ok("lr = 0.5\ndef scaled(x):\n    return x * lr\n")  # new since the pool started
    res = k.ok("%%ddp --gather seen\nseen = (scaled(2), lr)\n")
    assert k.value("seen") == [(1.0, 0.5)] * 2, res.stderr
    k.ok("lr = 0.25")
    res = k.ok("%%ddp --gather seen\nseen = (scaled(2), lr)\n")
    assert "sent lr (float" in res.stderr, res.stderr
    assert k.value("seen") == [(0.5, 0.25)] * 2
    k.ok("%%ddp\nlr = lr * (rank + 2)\n")  # the ranks' own value stays theirs, on every node
    k.ok("%%ddp --gather mine\nmine = lr\n")
    assert k.value("mine") == [0.5, 0.75]


def test_a_shared_twin_reaches_every_node_once_and_reads_as_the_list(rk):
    rk.ok("import nbddp\nrows = nbddp.shared([{'label': i % 7} for i in range(10_000)])", timeout=60)
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        res = rk.ok("%%ddp --gather n_read\nn_read = sum(r['label'] for r in rows[rank::world_size])\n")
        assert sum(rk.value("n_read")) == sum(i % 7 for i in range(10_000)), res.stderr
        assert re.search(r"sent rows \(nbddp.wire.shared.SharedSequence, [\d.]+ (B|KiB|MiB)\) to the other nodes' "
                         r"ranks, once", res.stderr), res.stderr
        again = rk.ok("%%ddp --gather n_read\nn_read = len(rows)\n")
        assert "sent" not in again.stderr and rk.value("n_read") == [10_000, 10_000], "once per node, never per cell"
    finally:
        rk.ok("%ddp stop", timeout=60)
        rk.ok("del rows, n_read")


def test_a_name_the_notebook_had_before_the_pool_started_reaches_the_other_node(rk):
    rk.ok("before = {'a': torch.arange(4)}")
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        res = rk.ok("%%ddp --gather got\ngot = before['a'].sum().item()\n")
        assert rk.value("got") == [6, 6]
        assert re.search(r"nbddp: sent before \(dict, \d+ B\) to the other nodes' ranks, once", res.stderr), res.stderr
        again = rk.ok("%%ddp --gather got\ngot = before['a'].sum().item()\n")
        assert "sent" not in again.stderr, "sent once"
    finally:
        rk.ok("%ddp stop", timeout=60)


def test_a_ranks_cell_leaves_the_values_owed_to_the_other_nodes_ranks_they_get_them_still(rk):
    rk.ok("owed = {'a': torch.arange(5)}")  # the notebook had it at the start: only node 0 shares it
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        res = rk.ok("%%ddp --ranks 0\nfirst = owed['a'].sum().item()\n")
        assert "sent owed (dict" in res.stderr, res.stderr
        res = rk.run("%%ddp --gather got\ngot = owed['a'].sum().item()\n", timeout=60)
        assert res.error is None, res.error_text  # (rank 1 had a NameError: its copy went with --ranks 0's cell only)
        assert rk.value("got") == [10, 10]
    finally:
        rk.ok("%ddp stop", timeout=60)


def test_a_name_that_could_not_be_pickled_is_sent_once_it_can_be(rk):
    rk.ok("import threading\nheld = {'n': 3, 'lock': threading.Lock()}")
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        res = rk.run("%%ddp\nprint(held['n'])\n", timeout=60)
        assert "`held` must be sent to the pool's ranks on the other nodes" in res.error_text, res.error_text
        rk.ok("del held['lock']")  # changed in place: not rebound, so only the missing-name rule sends it
        res = rk.run("%%ddp --gather got\ngot = held['n']\n", timeout=60)
        assert res.error is None, res.error_text  # (rank 1 had a NameError: the failed pickle had marked it sent)
        assert rk.value("got") == [3, 3]
    finally:
        rk.ok("%ddp stop", timeout=60)


def test_input_on_the_other_nodes_rank_is_asked_in_the_notebook(pool):
    k, _ = pool
    res = k.converse("%%ddp --gather got\ngot = input('name? ') if rank == 1 else None\nprint('got', got)\n",
                     lambda prompt: "ada", timeout=60)
    assert res.error is None, res.error_text
    assert res.prompts == ["[rank1] name? "], res.prompts
    assert said(res.stdout, 1, "got ada"), res.stdout
    assert k.value("got") == [None, "ada"]


def test_an_exception_on_the_other_node_names_rank_and_node_and_the_pool_lives(pool):
    k, _ = pool
    k.ok("%%ddp\nkept = rank + 40\n")
    res = k.run("%%ddp\nif rank == 1:\n    raise ValueError('bad shard')\n", timeout=60)
    assert res.error and res.error["ename"] == "RankFailure"
    text = res.error_text
    assert re.search(r"rank 1 on node 1 \(\S+, ray [0-9a-f]{8}\) failed: ValueError: bad shard", text), text
    assert "The pool and its state survived" in text, text
    k.ok("%%ddp --gather kept2\nkept2 = kept\n")
    assert k.value("kept2") == [40, 41]


def test_an_interrupt_reaches_the_other_nodes_rank_and_the_pool_lives(pool):
    k, pids = pool
    res = k.interrupt_when("%%ddp\nimport time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.01)\n",
                           "up", 2, timeout=60)
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    assert "every rank stopped its cell; the pool and its state survived" in res.error_text, res.error_text
    assert re.search(r"ranks 0-1 were at Cell In\[\d+\], line 5.*time\.sleep", res.error_text), res.error_text
    k.ok("%%ddp --gather back\nback = rank\n")
    assert k.value("back") == [0, 1]
    assert not [p for p in pids if p not in ranks_alive(pids)], "the same ranks live on"


@pytest.mark.parametrize("stuck", [0, 1], ids=["kernels-node-stuck", "other-node-stuck"])
def test_an_interrupt_frees_a_rank_stuck_in_a_collective_across_nodes_and_the_pool_lives(pool, stuck):
    k, _ = pool
    k.ok("%%ddp\nkept = rank + 100\n")
    res = k.interrupt_when(f"%%ddp\nimport time, torch.distributed as dist\nprint('up', flush=True)\n"
                           f"if rank == {stuck}:\n    dist.barrier()\nelse:\n    while True:\n        "
                           "time.sleep(0.01)\n",
                           "up", 2, timeout=60)
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    assert f"its process group was made anew to free rank(s) {stuck} from a collective" in res.error_text, \
        res.error_text
    k.ok("%%ddp --gather kept\nt = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == 2\n")
    assert k.value("kept") == [100, 101]


def test_a_rank_blocked_on_the_other_node_is_freed_without_waiting_out_the_graces(pool):
    """Rank 0 (the kernel's node) raises while rank 1 waits for it in an all_reduce on the other node: its agent
    looks at it for the kernel (blocked: asleep on a futex, running nothing), and the cell ends long before the
    60 s its graces are set to here (a failed peer's, an interrupt's across nodes; the probe of a rank left alone
    in a collective set as long)."""
    k, pids = pool
    k.ok("from nbddp import timeline\n"
         "_graces = timeline.PEER_GRACE_S, timeline.HEALTH_S, timeline.ALONE_S\n"
         "timeline.PEER_GRACE_S = timeline.HEALTH_S = timeline.ALONE_S = 30.0")
    try:
        t0 = time.monotonic()
        res = k.run("%%ddp\nimport torch, torch.distributed as dist\nif rank == 0:\n    raise ValueError('bad batch')\n"
                    "t = torch.ones(1)\ndist.all_reduce(t)\n", timeout=90)
        took = time.monotonic() - t0
    finally:
        k.ok("timeline.PEER_GRACE_S, timeline.HEALTH_S, timeline.ALONE_S = _graces")
    text = res.error_text
    assert took < 20, (took, text)
    assert re.search(r"rank 0 on node 0 \(.*\) failed: ValueError: bad batch", text), text
    assert "rank(s) 1 waited" in text, text
    k.ok("%%ddp --gather s\nt = torch.ones(1)\ndist.all_reduce(t)\ns = t.item()\n")
    assert k.value("s") == [2.0, 2.0]
    assert not [p for p in pids if p not in ranks_alive(pids)], "the same ranks live on"


def test_a_display_is_rich_from_every_node(pool):
    """Another node's ranks run outside any IPython shell (as spawned ranks do): they get a quiet shell of
    their own, so display() sends the rich bundle, in order with the rank's text."""
    k, _ = pool
    res = k.ok("%%ddp\nfrom IPython.display import HTML, display\nprint('before', flush=True)\n"
               "display(HTML(f'<b>from rank {rank}</b>'))\nprint('after')\n", timeout=60)
    html = [d["data"].get("text/html", "") for d in res.displays]
    assert any("<b>from rank 0</b>" in h for h in html) and any("<b>from rank 1</b>" in h for h in html), html
    assert "HTML object" not in res.stdout, res.stdout
    # rank 1's own lines, alone or merged with rank 0's alike ("[rank0-1]:after"), in its order
    lines = [line.split("]:", 1)[1] for line in res.stdout.splitlines() if said(line, 1, line.split("]:", 1)[-1])]
    assert lines[-2:] == [" display", "after"], res.stdout


def test_who_diff_and_restart_on_a_pool_across_nodes(pool):
    k, _ = pool
    k.ok("%%ddp\nw = torch.zeros(3 + rank)\nsteps = 5\n")
    who = k.ok("%ddp who", timeout=60).shown
    rows = {line.split()[0]: line for line in who.splitlines()[2:]}
    assert "≠ rank 0: (3,) float32 cpu; rank 1: (4,) float32 cpu" in rows["w"], who
    assert rows["steps"].split()[1:] == ["int", "5"], who
    same = k.ok("%ddp diff {'a': torch.ones(2)}", timeout=60).shown
    assert "2 ranks: all" in same and "agree" in same, same
    res = k.ok("%ddp restart", timeout=120)
    assert "pool of 2 rank(s) on cpu/gloo ready" in res.stdout, res.stdout + res.stderr
    k.ok("%%ddp --gather node\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
         "node = (os.environ['NODE_RANK'], t.item(), 'w' in globals())\n")
    assert k.value("node") == [("0", 2.0, False), ("1", 2.0, False)], "a fresh pool across the same nodes"


def test_a_later_pool_uses_the_agent_kept_from_the_last_one_placed_on_its_node(rk):
    def agent():  # the agent of the other node's rank
        rk.ok("%%ddp --gather pid\npid = os.getpid()\n")
        return psutil.Process(rk.value("pid")[1]).parent().pid

    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        first = agent()
        for _ in range(3):  # 2 nodes of 3 raylets: left to chance, node 1 would land on the kept agent's 1 in 2
            rk.ok("%ddp stop", timeout=60)
            assert ranks_alive([first]) and not psutil.Process(first).children(), "the agent is kept, idle"
            rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
            assert agent() == first, "the later pool went to the kept agent's node and its ranks were its forks"
    finally:
        rk.run("%ddp stop", timeout=60)


def test_agents_prestarted_after_ray_init_are_the_first_pools(rk):
    rk.ok("from nbddp.cluster import placement\nplacement.release_agents()")
    assert rk.value("placement.prestart()") == 2, "one on each raylet but the kernel's"
    assert rk.value("placement.prestart()") == 0, "started once"
    agents = rk.value("sorted(ray.get([a.where.remote() for a in placement.KEPT.values()], timeout=120), "
                      "key=lambda w: w['pid'])")
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        rk.ok("%%ddp --gather pid\npid = os.getpid()\n")
        assert psutil.Process(rk.value("pid")[1]).parent().pid in [w["pid"] for w in agents]
    finally:
        rk.run("%ddp stop", timeout=60)


def test_timeout_brings_the_other_nodes_stack_back_and_the_pool_lives(pool):
    k, _ = pool
    res = k.run("%%ddp --timeout 2\nimport time\ndef wait_here():\n    while True:\n        time.sleep(0.01)\n"
                "wait_here()\n", timeout=60)
    assert "--timeout 2s expired" in res.error_text, res.error_text
    assert "ranks 0-1 were here:" in res.error_text and "wait_here" in res.error_text, res.error_text
    assert "The pool and its state survived" in res.error_text
    assert said(k.ok("%%ddp\nprint('ok')\n").stdout, 1, "ok")


def healed_after_agent_lost(k, pids, stopped_at=None) -> str:
    """Once the pool's loss of node 1's agent is said and mended (no cell run): its line; a cell then runs on
    both ranks, rank 1 a new process forked by a new agent, the old one and its rank gone."""
    old_agent = psutil.Process(pids[1]).ppid()
    end = time.monotonic() + 60
    while not k.value(f"bool({POOL}.losses.history) and not {POOL}.losses.pending") and time.monotonic() < end:
        time.sleep(0.1)
    at, line, alive = k.value(f"({POOL}.losses.history[-1].at, {POOL}.losses.history[-1].line(), {POOL}.alive)")
    if stopped_at is not None:
        assert at - stopped_at < 8, f"known {at - stopped_at:.1f} s after the node stopped answering"
    assert alive, k.value(f"{POOL}.gang.why")
    res = k.ok("%%ddp --gather pid\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
               "pid = os.getpid()\n", timeout=120)
    assert "healed the pool in" in res.stderr and "a new rank 1" in res.stderr, res.stderr
    new = k.value("pid")
    assert new[0] == pids[0] and new[1] != pids[1]
    assert psutil.Process(new[1]).ppid() != old_agent, "a new agent forked the new rank 1"
    assert not wait_gone([old_agent, pids[1]]), "the lost agent was ended, and its rank with it"
    pids.extend(new)  # (the fixture checks every one gone after %ddp stop)
    return line


def test_a_dead_agent_is_said_and_a_new_one_starts_its_ranks_anew(pool):
    """Issue 55: an agent killed (its node alive): the loss named with its node, with no cell run; a new agent
    on that node starts rank 1 anew in the group's next generation, the pool goes on."""
    k, pids = pool
    psutil.Process(pids[1]).parent().kill()  # the agent forked rank 1
    line = healed_after_agent_lost(k, pids)
    assert re.search(r"rank 1 lost while idle: .*node 1 \(.*\) lost \(rank 1\): ActorDiedError", line), line


def test_a_node_that_stops_answering_is_known_in_seconds_with_no_cell_run_and_is_healed(pool):
    """Issue 55: a node whose agent hangs ends no stream, and Ray says nothing of it for long; nbddp's own beat
    (one per second from each agent) knows it after 5 s of silence, with no cell run, and says it in the pool's
    view. The hung agent is ended (its rank with it), a new one starts rank 1 anew, the pool goes on."""
    k, pids = pool
    agent = psutil.Process(pids[1]).ppid()  # the agent forked rank 1
    try:
        stopped_at = time.time()
        os.kill(agent, signal.SIGSTOP)  # as a hung machine: alive, silent
        line = healed_after_agent_lost(k, pids, stopped_at)
        assert re.search(r"rank 1 lost while idle: .*node 1 \(.*\) lost \(rank 1\): no word from its agent for "
                         r"\d+ s", line), line
        status = k.ok("%ddp status").displays[-1]["data"]["text/plain"]
        assert "no word from its agent" in status and "healed the pool in" in status, status
    finally:
        if psutil.pid_exists(agent):
            os.kill(agent, signal.SIGKILL)


def test_a_call_the_agent_cannot_apply_is_said_and_a_new_agent_takes_over(pool):
    k, pids = pool
    # a message the agent has no handler for (one of its own, sent the wrong way): as a store reply or command it
    # fails to apply
    k.ok(f"from nbddp.wire import agentmessages\n{POOL}.gang.links[0].control(agentmessages.Renumbered())")
    line = healed_after_agent_lost(k, pids)
    assert re.search(r"node 1 \(.*\) lost \(rank 1\): its agent could not apply the kernel's 'Renumbered': "
                     r"not a call it knows", line), line


PLACEMENT_GROUPS = "sorted({g['state'] for g in ray.util.placement_group_table().values()})"


@pytest.mark.parametrize("victim", [1, 0], ids=["the-other-node", "the-kernels-node"])
def test_a_rank_killed_in_a_collective_fails_the_cell_naming_rank_and_node_and_is_replaced(pool, victim):
    """Issue 55: the cell fails naming the rank and its node; a new rank starts on that node (forked by its
    agent, or from the kernel on the kernel's node) in the group's next generation, and the pool goes on."""
    k, pids = pool
    res = k.run(f"%%ddp\nimport signal\nimport torch.distributed as dist\nif rank == {victim}:\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\ndist.all_reduce(torch.ones(1))\n", timeout=60)
    text = res.error_text
    assert re.search(rf"rank {victim} on node {victim} \(\S+, ray [0-9a-f]{{8}}\) failed: killed by SIGKILL",
                     text), text
    assert "healed the pool in" in text and f"a new rank {victim}" in text, text
    k.ok("%%ddp --gather pid where\nimport torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
         "dist.all_reduce(t)\npid = os.getpid()\n"
         "where = (rank, os.environ['NODE_RANK'], t.item())\n", timeout=120)
    new = k.value("pid")
    assert k.value("where") == [(0, "0", 3.0), (1, "1", 3.0)]
    assert new[1 - victim] == pids[1 - victim] and new[victim] != pids[victim], (pids, new)
    pids.extend(new)  # (the fixture checks every one gone after %ddp stop)


def test_a_pool_across_nodes_heals_a_lost_rank_from_a_peer_over_the_group(rk):
    """Issue 55 on Ray: a rank of another node killed while idle is said at once and replaced on its node; the
    state two survivors agree on reaches it from a peer over the new process group (never through the kernel's
    machine), DDP made anew; rank-specific names are listed; the notebook's names reach it with the next cell."""
    rk.ok("nb_value = 41")
    rk.ok("%ddp start --cluster ray --nodes 3 --devices 1", timeout=120)
    pids = []
    try:
        rk.ok("%%ddp --gather pid\nimport torch.distributed as dist\n"
              "from torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
              "model = DDP(torch.nn.Linear(4, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "data = torch.arange(100_000.)\nmine = rank * 10\nseen = nb_value\npid = os.getpid()\n", timeout=120)
        pids = rk.value("pid")
        agent = psutil.Process(pids[2]).ppid()
        os.kill(pids[2], signal.SIGKILL)
        end = time.monotonic() + 60
        while not rk.value(f"bool({POOL}.losses.history) and not {POOL}.losses.pending") and time.monotonic() < end:
            time.sleep(0.1)
        status = rk.ok("%ddp status")
        status = status.displays[-1]["data"]["text/plain"] if status.displays else status.stdout
        assert "rank 2 lost while idle: killed by SIGKILL" in status and "healed the pool in" in status, status
        res = rk.ok("%%ddp --gather have pid\nopt.zero_grad()\nmodel(torch.ones(8, 4)).pow(2).mean().backward()\n"
                    "opt.step()\nhave = (model.module.weight.tolist(), data.sum().item(), 'mine' in globals(), "
                    "nb_value, os.environ['NODE_RANK'])\npid = os.getpid()\n", timeout=120)
        assert "took" in res.stderr and "from rank 0" in res.stderr and "mine (Cell In[" in res.stderr, res.stderr
        assert "made anew on the new process group: model (DistributedDataParallel)" in res.stderr, res.stderr
        have = rk.value("have")
        assert all(h[0] == have[0][0] for h in have), f"the replicas trained on together: {have}"
        assert [h[1:] for h in have] == [(4999949824.0, r != 2, 41, str(r)) for r in range(3)], have
        new = rk.value("pid")
        assert new[:2] == pids[:2] and new[2] != pids[2]
        assert psutil.Process(new[2]).ppid() == agent, "the new rank 2 was forked by node 2's agent"
        pids = pids + new[2:]
        os.kill(new[2], signal.SIGKILL)  # again: the agent kept its stream open, and no stale kill of its own
        end = time.monotonic() + 60
        while rk.value(f"len({POOL}.losses.history) < 2 or bool({POOL}.losses.pending)") and time.monotonic() < end:
            time.sleep(0.1)
        rk.ok("%%ddp --gather pid\npid = os.getpid()\n", timeout=120)
        again = rk.value("pid")
        assert again[:2] == pids[:2] and again[2] not in pids and psutil.Process(again[2]).ppid() == agent
        pids = pids + again[2:]
    finally:
        rk.run("%ddp stop", timeout=60)
    assert not wait_gone(pids), "no rank is left on any node"


PLACE = ("%%ddp --gather where pid\nimport torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
         "dist.all_reduce(t)\nwhere = (rank, world_size, local_rank, *(os.environ[k] for k in ('RANK', 'WORLD_SIZE', "
         "'LOCAL_RANK', 'NODE_RANK', 'GROUP_WORLD_SIZE')), t.item())\npid = os.getpid()\n")


BUILT = ("%%ddp --gather pid\nfrom torch.nn.parallel import DistributedDataParallel as DDP\ntorch.manual_seed(0)\n"
         "model = DDP(torch.nn.Linear(4, 1))\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "data = torch.arange(100_000.)\nmine = rank * 10\npid = os.getpid()\n")


def one_per_node(world: int) -> list:
    """PLACE's answer on a pool of ``world`` ranks, one on each node."""
    w = str(world)
    return [(r, world, 0, str(r), w, "0", str(r), w, world * (world + 1) / 2) for r in range(world)]


def wait_mended(rk, losses: int) -> None:
    end = time.monotonic() + 60
    while (rk.value(f"len({POOL}.losses.history) < {losses} or bool({POOL}.losses.pending)")
           and time.monotonic() < end):
        time.sleep(0.1)


def test_a_pool_across_nodes_shrinks_renumbering_its_ranks_on_every_node(rk):
    """Issue 55, --on-loss shrink on Ray: the survivors renumbered in order on every node (rank, world_size,
    torchrun's variables, each rank's place on its node and its node's among those left), a new group, DDP made
    anew; the kernel's node may be left with no rank at all, and the pool goes on from the others."""
    rk.ok("%ddp start --cluster ray --nodes 3 --devices 1 --on-loss shrink", timeout=120)
    pids = []
    try:
        rk.ok(BUILT, timeout=120)
        pids = rk.value("pid")
        os.kill(pids[1], signal.SIGKILL)  # node 1's only rank: that node is left with none
        wait_mended(rk, 1)
        res = rk.ok(PLACE + "opt.zero_grad()\nmodel(torch.ones(8, 4)).pow(2).mean().backward()\nopt.step()\n",
                    timeout=120)
        assert rk.value("where") == one_per_node(2)
        assert rk.value("pid") == [pids[0], pids[2]], "the survivors themselves go on"
        assert "shrank the pool in" in res.stderr and "(2→1)" in res.stderr, res.stderr
        assert "made anew on the new process group: model (DistributedDataParallel)" in res.stderr, res.stderr
        assert "mine (Cell In[" in res.stderr, "a name made from the old rank is listed: " + res.stderr
        rk.ok("%%ddp --gather w\nw = model.module.weight.tolist()\n")
        assert rk.value("w")[0] == rk.value("w")[1], "the replicas trained on together"
        os.kill(pids[0], signal.SIGKILL)  # the kernel's node's rank: the pool goes on on node 2 alone
        wait_mended(rk, 2)
        rk.ok(PLACE, timeout=120)
        assert rk.value("where") == one_per_node(1)
        assert rk.value("pid") == [pids[2]]
        status = rk.ok("%ddp status")
        status = status.displays[-1]["data"]["text/plain"] if status.displays else status.stdout
        assert "rank 0 lost while idle: killed by SIGKILL" in status and "shrank the pool in" in status, status
    finally:
        rk.run("%ddp stop", timeout=60)
    assert not wait_gone(pids), "no rank is left on any node"


def test_a_pool_across_nodes_grows_onto_a_node_it_did_not_use_and_shrinks_back(rk):
    """Issue 55, %ddp resize on Ray: a new node's agent forks the new rank, which takes the names the ranks agree on
    from rank 0 over the new group (its node cannot map this machine's memory), DDP made anew, every rank told
    the new world (WORLD_SIZE, GROUP_WORLD_SIZE); with no node left to grow onto, nothing changes; shrunk
    back, the highest rank leaves; grown again, onto the node the pool still holds, by its agent there; and
    the pool still heals a lost rank."""
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    pids = []
    try:
        rk.ok(BUILT, timeout=120)
        pids = rk.value("pid")
        res = rk.ok("%ddp resize 3", timeout=120)
        out = res.stdout + res.stderr
        assert "resized the pool from 2 to 3 ranks" in out and "took" in out and "from rank 0" in out, out
        assert "made anew on the new process group: model (DistributedDataParallel)" in out, out
        assert "mine (Cell In[" in out, "a name made from rank is listed, not copied: " + out
        rk.ok(PLACE + "opt.zero_grad()\nmodel(torch.ones(8, 4)).pow(2).mean().backward()\nopt.step()\n"
              "have = (model.module.weight.tolist(), data.sum().item(), 'mine' in globals())\n", timeout=120)
        assert rk.value("where") == one_per_node(3)
        new = rk.value("pid")
        assert new[:2] == pids[:2] and new[2] not in pids
        pids.append(new[2])
        rk.ok("%%ddp --gather have\nhave = (model.module.weight.tolist(), data.sum().item(), 'mine' in globals())\n")
        have = rk.value("have")
        assert all(h[0] == have[0][0] for h in have), f"the replicas trained on together: {have}"
        assert [h[1:] for h in have] == [(4999949824.0, True), (4999949824.0, True), (4999949824.0, False)], have
        labels = {rk.value(f"{POOL}.gang.node_of({r})") for r in range(3)}
        assert len(labels) == 3, f"each rank on a node of its own: {labels}"
        res = rk.run("%ddp resize 4", timeout=60)  # the cluster has 3 raylets, each used
        assert "Ray found 0 node(s) the pool does not use" in res.stdout + res.error_text and "Nothing changed" in \
            res.stdout + res.error_text, res
        rk.ok(PLACE, timeout=120)
        assert rk.value("pid") == pids[:3], "a resize that could not grow changed nothing"
        agent = psutil.Process(pids[2]).ppid()
        res = rk.ok("%ddp resize 2", timeout=120)
        assert "resized the pool from 3 to 2 ranks" in res.stdout + res.stderr, res
        assert not wait_gone(pids[2:]), "the highest rank left"
        rk.ok(PLACE, timeout=120)
        assert rk.value("where") == one_per_node(2)
        res = rk.ok("%ddp resize 3", timeout=120)  # back onto the node the pool still holds, by its agent there
        assert "resized the pool from 2 to 3 ranks" in res.stdout + res.stderr, res
        rk.ok(PLACE, timeout=120)
        assert rk.value("where") == one_per_node(3)
        again = rk.value("pid")
        assert again[:2] == pids[:2] and psutil.Process(again[2]).ppid() == agent, "node 2's agent forked it"
        pids.append(again[2])
        os.kill(pids[1], signal.SIGKILL)  # healed after the resizes: node 1's agent forks the replacement
        wait_mended(rk, 1)
        rk.ok(PLACE, timeout=120)
        assert rk.value("where") == one_per_node(3)
        pids += rk.value("pid")
    finally:
        rk.run("%ddp stop", timeout=60)
    assert not wait_gone(pids), "no rank is left on any node"
    assert rk.value(PLACEMENT_GROUPS) in (["REMOVED"], []), "no placement group outlived the pool"


def test_an_interrupt_while_the_group_is_placed_or_the_pool_torn_down_leaves_no_rank_nor_group(rk):
    rk.ok("import signal\nfrom nbddp.kernel.ranks import groupstore\n_wait, _close = ray.wait, "
          "groupstore.LocalStores.close\n"
          "def interrupted(f):\n    def call(*a, **k):\n        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, now\n"
          "        return f(*a, **k)\n    return call\n")
    rk.ok("ray.wait = interrupted(_wait)")  # while Ray places the pool's group
    try:
        res = rk.run("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    finally:
        rk.ok("ray.wait = _wait")
    assert res.error and res.error["ename"] == "KeyboardInterrupt", res
    assert rk.value(PLACEMENT_GROUPS) == ["REMOVED"], "the placement group outlived the interrupted start"
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    rk.ok("%%ddp --gather pid\npid = os.getpid()\n")
    pids = rk.value("pid")
    agent = psutil.Process(pids[1]).parent().pid
    rk.ok("groupstore.LocalStores.close = interrupted(_close)")  # while the teardown joins the store's thread
    try:
        rk.run("%ddp stop", timeout=60)
    finally:
        rk.ok("groupstore.LocalStores.close = _close")
    assert not wait_gone(pids), "a rank outlived the interrupted teardown"
    assert not ranks_alive([agent]) or not psutil.Process(agent).children(), "the agent kept a rank"
    assert rk.value(PLACEMENT_GROUPS) == ["REMOVED"], "the placement group outlived the interrupted teardown"


def test_stop_and_a_failed_start_leave_no_rank_nor_group_the_agents_kept_idle_until_released(rk, runs_dir):
    rk.ok("from nbddp.cluster import placement\n_agents, made = placement.agents, []\n"
          "def recorded(*a, **k):  # each agent and its process, as the pool found or made them\n"
          "    actors = _agents(*a, **k)\n"
          "    made.extend((x, ray.get(x.where.remote(), timeout=60)['pid']) for x in actors)\n"
          "    return actors\n"
          "def agents_alive():\n    alive = 0\n    for x, _ in made:\n        try:\n"
          "            ray.get(x.where.remote(), timeout=30)\n            alive += 1\n"
          "        except ray.exceptions.RayActorError:\n            pass\n    return alive\n"
          "placement.agents = recorded\n")
    try:
        rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
        rk.ok("%%ddp\nprint('up')\n")
        rk.ok("%ddp stop", timeout=60)
        kept = rk.value("made[0][1]")
        assert ranks_alive([kept]) and not psutil.Process(kept).children(), "the agent is kept, idle, rankless"
        assert rk.value(PLACEMENT_GROUPS) == ["REMOVED"], "a placement group outlived its pool"
        rk.ok("os.environ['NBDDP_IFNAME'] = 'nbddp-none0'")  # no such interface: gloo fails, the start fails
        res = rk.run("%ddp start --cluster ray --nodes 2 --devices 1", timeout=180)
        assert "Unable to find address for: nbddp-none0" in res.error_text, res.error_text
    finally:
        rk.ok("placement.agents = _agents\nos.environ.pop('NBDDP_IFNAME', None)")
    pids = rk.value("[pid for _, pid in made]")
    assert len(pids) == 2, pids
    assert all(not psutil.Process(p).children() for p in ranks_alive(pids)), "an agent kept a rank"
    assert rk.value(PLACEMENT_GROUPS) == ["REMOVED"], "a placement group outlived its pool"
    assert rk.value("placement.release_agents()") >= 1
    assert not wait_gone(pids), "a released agent's process lives on"
    assert rk.value("agents_alive()") == 0, "a released Agent actor lives on"
    agents_runs = [d for d in runs_dir.iterdir() if (d / "rank1.log").exists() and not (d / "rank0.log").exists()]
    assert agents_runs, "the agents' run directories go where NBDDP_RUNS_DIR says (the raylets inherit it)"


def test_collective_traffic_goes_on_the_nodes_interface_or_the_one_the_user_names(rk):
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        rk.ok("%%ddp --gather ifname\nifname = os.environ['GLOO_SOCKET_IFNAME']\n")
        default = rk.value("ifname")
        ip = rk.value("ray.util.get_node_ip_address()")  # (127.0.0.1 where Ray found no other)
        carries = [n for n, addrs in psutil.net_if_addrs().items() if any(a.address == ip for a in addrs)]
        assert default[0] == default[1] in carries, (default, ip, carries)  # the interface of the node's Ray address
    finally:
        rk.ok("%ddp stop", timeout=60)
    rk.ok("os.environ['NBDDP_IFNAME'] = 'lo'")
    try:
        rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
        rk.ok("%%ddp --gather ifname\nimport torch.distributed as dist\ndist.all_reduce(torch.ones(1))\n"
              "ifname = os.environ['GLOO_SOCKET_IFNAME']\n")
        assert rk.value("ifname") == ["lo", "lo"]
    finally:
        rk.ok("%ddp stop", timeout=60)
        rk.ok("del os.environ['NBDDP_IFNAME']")


def test_no_interface_for_the_nodes_ray_address_is_refused_naming_nbddp_ifname(rk):
    rk.ok("from nbddp.cluster import netif\n_ifname_for = netif.ifname_for\n"
          "netif.ifname_for = lambda ip: None")  # as where Ray's address is a NAT'd or a DNS name's
    try:
        res = rk.run("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    finally:
        rk.ok("netif.ifname_for = _ifname_for")
    text = res.error_text
    assert re.search(r"the kernel's node \(node 0\): its Ray address \S+ is on none of its network interfaces",
                     text), text
    assert "NBDDP_IFNAME" in text and "Nothing ran" in text, text
    assert rk.value(PLACEMENT_GROUPS) == ["REMOVED"], "the refused start left its placement group"


def test_the_python_api_runs_a_function_on_every_node(rk):
    res = rk.ok("import nbddp, torch.distributed as dist\ndef total(x):\n    t = torch.ones(1) * x * (dist.get_rank() "
                "+ 1)\n"
                "    dist.all_reduce(t)\n    return t.item(), os.environ['NODE_RANK']\n"
                "with nbddp.Pool(cluster='ray', nodes=2, devices=1) as p:\n    print(p.run(total, 2))\n", timeout=120)
    assert "[(6.0, '0'), (6.0, '1')]" in res.stdout, res.stdout + res.stderr


def test_refusals_say_why(rk):
    res = rk.run("%ddp start --cluster ray:ray://10.0.0.1:10001 --nodes 2")
    assert "ray://" in res.error_text and "Nothing ran" in res.error_text, res.error_text
    res = rk.run("%%ddp --cluster ray --nodes 2\nprint('x')\n")
    assert "%ddp start --cluster ray --nodes N" in res.error_text and "x" not in res.stdout, res.error_text
    res = rk.run("%ddp start --cluster ray --nodes 9 --devices 1", timeout=60)
    assert "--nodes 9: the Ray cluster has 3 node(s) alive" in res.error_text, res.error_text
    res = rk.run("%ddp start --cluster ray:10.255.255.1:6379 --nodes 2 --devices 1", timeout=60)  # not ours
    assert re.search(r"already connected to the Ray cluster at \S+:\d+", res.error_text), res.error_text
    joined = rk.value("ray.get_runtime_context().gcs_address")
    rk.ok(f"%ddp start --cluster ray:{joined} --nodes 2 --devices 1", timeout=120)  # the one it is connected to
    rk.ok("%ddp stop", timeout=60)
    rk.ok("os.environ['RAY_ADDRESS'] = 'ray://10.0.0.1:10001'")
    try:
        res = rk.run("%ddp start --cluster ray --nodes 2 --devices 1")
    finally:
        rk.ok("del os.environ['RAY_ADDRESS']")
    assert "ray://10.0.0.1:10001: a Ray Client connection (ray://) cannot host a pool" in res.error_text, res.error_text


def raylet_of(rk, extra, rank: int):
    """The raylet (of ``extra``) that hosts the pool's ``rank``."""
    label = rk.value(f"{POOL}.gang.node_of({rank})")
    host = next((n for n in extra if f"ray {n.node_id[:8]})" in label), None)
    assert host is not None, (label, [n.node_id for n in extra])
    return host


def stop_and_restore(rk, c, extra, victim) -> None:
    """Whatever a test that removed a raylet did, the next test finds no pool and three raylets."""
    rk.run("%ddp stop", timeout=60)
    if victim is not None:
        extra.remove(victim)
        extra.append(c.add_node(num_cpus=1))
        c.wait_for_nodes()


def test_a_node_removed_with_no_other_node_to_take_its_ranks_shrinks_the_pool_naming_the_node(cluster, rk):
    """Every raylet holds a rank of the pool: Ray has nowhere to move the lost node's bundle, so its rank cannot
    be started anew, and the pool goes on without it (shrunk), saying why."""
    c, extra = cluster
    victim = None
    rk.ok("%ddp start --cluster ray --nodes 3 --devices 1", timeout=120)
    try:
        rk.ok("%%ddp --gather pid node\npid = os.getpid()\nnode = os.environ['NODE_RANK']\n")
        pids = rk.value("pid")
        host = raylet_of(rk, extra, 2)
        res_id = rk.execute("%%ddp\nimport time\nprint('running', flush=True)\nwhile True:\n    time.sleep(0.05)\n")
        rk.follow(res_id, until=lambda r: "running" in r.stdout)  # the node removed during the cell, not before
        t0 = time.monotonic()
        c.remove_node(host)
        victim = host
        res = rk.collect(res_id, timeout=60)
        took = time.monotonic() - t0
        text = res.error_text + res.stderr
        assert re.search(r"rank 2 on node 2 \(.*\) failed: NodeLost: node 2 \(.*\) lost \(rank 2\)", text), text
        assert "could not heal the pool: no new rank 2 could start (node 2" in text, text
        assert "Ray found no other node with the room for its rank(s) within 10 s); it shrank instead" in text, text
        assert took < 25, f"the cell ended {took:.1f} s after the node was removed (10 s of them waiting for room)"
        rk.ok(PLACE, timeout=120)
        assert rk.value("where") == one_per_node(2)
        assert rk.value("pid") == pids[:2] and not wait_gone(pids[2:]), "the survivors go on, node 2's rank gone"
    finally:
        stop_and_restore(rk, c, extra, victim)
    assert not wait_gone(pids), "no rank is left on any node"


def test_a_node_removed_while_idle_has_its_rank_started_on_a_node_with_room(cluster, rk):
    """Issue 55: a pool on 2 of the 3 raylets; the node of rank 1 removed while no cell runs. Ray moves its
    bundle to the third raylet, a new agent there starts rank 1 in the group's next generation, and the pool
    goes on, rank 1 on its new node."""
    c, extra = cluster
    victim = None
    rk.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
    try:
        rk.ok("%%ddp --gather pid\npid = os.getpid()\n")
        pids = rk.value("pid")
        host = raylet_of(rk, extra, 1)
        spare = next(n for n in extra if n is not host)
        c.remove_node(host)
        victim = host
        end = time.monotonic() + 60
        while not rk.value(f"bool({POOL}.losses.history) and not {POOL}.losses.pending") and time.monotonic() < end:
            time.sleep(0.1)
        assert rk.value(f"{POOL}.alive"), rk.value(f"{POOL}.gang.why")
        res = rk.ok("%%ddp --gather where\nimport torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
                    "dist.all_reduce(t)\nwhere = (os.environ['NODE_RANK'], t.item())\n", timeout=120)
        assert "healed the pool in" in res.stderr and "a new rank 1" in res.stderr, res.stderr
        assert rk.value("where") == [("0", 3.0), ("1", 3.0)]
        moved = rk.value(f"{POOL}.gang.node_of(1)")
        assert f"ray {spare.node_id[:8]})" in moved, moved
    finally:
        stop_and_restore(rk, c, extra, victim)
    assert not wait_gone(pids), "no rank is left on any node"


def test_kernel_death_leaves_no_rank_on_any_node(cluster, runs_dir):
    c, _ = cluster
    with Kernel(env={"NBDDP_RUNS_DIR": str(runs_dir)}) as k:
        k.ok(f"%load_ext nbddp\nimport os\nimport ray\nray.init(address={c.address!r}, logging_level='ERROR', "
             "log_to_driver=False)\nNone")
        k.ok("%ddp start --cluster ray --nodes 2 --devices 1", timeout=120)
        k.ok("%%ddp --gather pid\npid = os.getpid()\n")
        pids = k.value("pid")
        assert len(ranks_alive(pids)) == 2
        agent = psutil.Process(pids[1]).parent().pid  # kept between pools, but not beyond its kernel
        os.kill(k.pid, signal.SIGKILL)
        assert not wait_gone(pids, 30), "a rank outlived the kernel"
        assert not wait_gone([agent], 30), "the agent outlived the kernel"


def test_a_pool_across_nodes_whose_kernel_node_ranks_start_from_the_forkserver(rk):
    """The kernel's node's ranks from nbddp's forkserver (as when the kernel holds CUDA), the other node's from its
    agent: one process group, notebook values on both, a tensor made after the start pickled to the other node."""
    k = rk
    res = k.ok("%ddp start --cluster ray --nodes 2 --devices 1 --start-method forkserver", timeout=180)
    assert "pool of 2 rank(s) on cpu/gloo ready" in res.stdout, res.stdout + res.stderr
    try:
        server = next(p for p in k.process().children() if p.name() == "nbddp-forksrv")
        k.ok("W = torch.full((2**17,), 3.0)  # 512 KiB: through shared memory on this node only\nstep = 2\n")
        res = k.ok("%%ddp --gather seen\nimport torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                   "seen = (float(W.sum()) * step, t.item(), os.getppid())\n", timeout=120)
        seen = k.value("seen")
        assert [s[:2] for s in seen] == [(3.0 * 2**17 * 2, 2.0)] * 2, (seen, res.stderr)
        assert seen[0][2] == server.pid and seen[1][2] != server.pid  # rank 0 the server's child, rank 1 the agent's
    finally:
        k.run("%ddp stop", timeout=60)
