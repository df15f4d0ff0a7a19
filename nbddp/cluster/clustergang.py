"""In the kernel: a pool's gang across the nodes of a Ray cluster (``%ddp start --cluster ray --nodes N``).

Node 0 is the kernel's: its ranks 0..D-1 are forked from the kernel as in any pool (copy-on-write). Each
other node's ranks are forked by its agent (agent.py). To the rest of nbddp it is a ``Gang``: the same
supervisor (remote ranks are ``remote.RemoteProc``s fed by their agents' streams), the same commands
(a remote node's go through its agent, one copy of the cell per node), the same close.

The process group meets on the kernel's store (kernel/ranks/groupstore.py) over pipes: no store port is opened.
Notebook values: the kernel's node shares the notebook copy-on-write; the other nodes start with nothing
of it, so a name a cell reads that the notebook had when the pool started is sent to them by value once
(which: the pool's ``sending.RankNames``; carried here: ``owe``), and a name the notebook rebinds later is
sent to every node as in any pool.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import time

from .. import timeline
from ..errors import UsageError
from ..kernel.ranks import groupstore, rendezvous, starters
from ..kernel.ranks.gang import Gang, ReplaceFailed
from ..rank.worker import RankSpec
from ..wire import agentmessages, framing, messages
from . import netif, placement, relocate, remote, reshape

KEEP_S = 2.0  # how long the close waits for a kept agent's stream to end (its ranks have exited)


class ClusterGang(Gang):
    spans_machines = True

    def __init__(self, config, plan, *, view_for=None):
        if plan.accelerator == "cuda":  # another node's ranks see the GPUs Ray gave its agent as 0..D-1
            others = tuple(range(plan.world_size))
        else:
            others = plan.device_ids
        self.per_node, self.nodes = plan.world_size, config.nodes
        super().__init__(config, dataclasses.replace(plan, device_ids=plan.device_ids + others * (config.nodes - 1)),
                         persistent=True, view_for=view_for and self._view_here(view_for))
        self.extra: dict[str, bytes] = {}  # what the other nodes' ranks lack (owe), sent with the next cell
        self.given: set[int] = set()  # the remote ranks that had ``extra`` already (an Update to --ranks' others)
        self.store = groupstore.Store()
        self.local = groupstore.LocalStores(self.store)
        self.links: list[remote.Link] = []
        self.streams: remote.Streams | None = None
        self.pg = self.ray = None
        self.extra_pgs: list = []  # a lost node's ranks placed anew outside the pool's group (relocate)
        self.actors: list = []
        self.closed = False
        self.reported: set[int] = set()  # the other nodes' ranks whose end their agent reported (close)

    def node_of(self, rank: int) -> str:
        """The name of the node ``rank`` runs on (its Membership's placement)."""
        return self.members.nodes.get(rank, "")

    def news_fds(self) -> list[int]:
        """The nodes' streams' wake pipe: a rank or node lost, a silent node among them (remote.Streams)."""
        return [self.streams.wake_r] if self.streams is not None and self.streams.wake_r >= 0 else []

    def _view_here(self, view_for):
        """The pool's dashboard, its GPU monitor on this machine's GPUs only: another node's ranks' device
        ids name that node's GPUs, and sampled here they would show the kernel's GPUs 0..D-1 as theirs."""
        def view(plan, run_dir):
            here = plan.device_ids[:self.per_node] + (None,) * (plan.world_size - self.per_node)
            shown = view_for(dataclasses.replace(plan, device_ids=here), run_dir)
            shown.plan = plan  # its device column: each rank's own device
            return shown

        return view

    # -- start -------------------------------------------------------------------------------------------
    def start(self, job_for, deadline: float | None = None) -> None:
        config, D = self.config, self.per_node
        self.started = True
        self.ray = ray = placement.connect(config.cluster)
        self.pg, nodes = placement.reserve(ray, config.nodes, D, self.plan.accelerator)
        user_if = os.environ.get("NBDDP_IFNAME")
        ifname = user_if or netif.ifname_for(nodes[0].ip)
        if not ifname and config.nodes > 1:  # gloo would advertise whatever the host name resolves to
            raise UsageError(placement.no_interface(nodes[0].ip, "the kernel's node (node 0)"))
        ifname = ifname or rendezvous.loopback_ifname()
        self.actors = placement.agents(ray, self.pg, nodes, D, self.plan.accelerator)
        self.placed, self.user_if = nodes, user_if  # (a lost node's ranks started elsewhere: relocate)
        run_id, port = self.run_dir.run_id, rendezvous.free_port()
        specs = [self._spec(r, nodes, run_id, port) for r in range(self.world_size)]
        self.specs = {spec.rank: spec for spec in specs}
        wheres = [a.where.remote() for a in self.actors]
        streams = [a.events.options(num_returns="streaming").remote(run_id, specs[n.index * D:(n.index + 1) * D],
                                                                   user_if)
                   for a, n in zip(self.actors, nodes[1:])]  # each begins with its ranks' pids
        self.members.place(range(D), nodes[0].label)
        self._fork_local(job_for, specs[:D], ifname, deadline)
        self.streams = remote.Streams(self.sup, self.store)
        no_interface = []  # nodes whose Ray address is on none of their interfaces (NBDDP_IFNAME unset)
        try:
            for n, where in zip(nodes[1:], ray.get(wheres, timeout=placement.START_S)):
                n.host = where["host"]
                if not (user_if or where["ifname"]):
                    no_interface.append(n)
            pids_per_node = []
            for gen in streams:
                ready, _ = ray.wait([gen], timeout=placement.START_S)
                if not ready:
                    raise TimeoutError(f"no answer within {placement.START_S:g} s")
                pids_per_node.append(pickle.loads(ray.get(next(gen))))
        except Exception as e:  # noqa: BLE001 - Ray's errors are many: said
            raise UsageError(f"the agents on the other nodes did not start their ranks: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}\nIs nbddp installed on every node, with "
                             "the same Python, torch and Ray? Nothing is left running.") from None
        if no_interface:  # their ranks' gloo would advertise whatever their host name resolves to
            n = no_interface[0]
            raise UsageError(placement.no_interface(n.ip, f"node {n.label}"))
        for actor, n, pids, gen in zip(self.actors, nodes[1:], pids_per_node, streams):
            ranks = sorted(pids)
            link = remote.Link(actor, n.label, ranks, run_id)
            self.links.append(link)
            self.members.place(ranks, n.label)
            for r in ranks:
                self.streams.add(r, pids[r], link)
            self.streams.follow(link, gen)
        if self.view is not None:  # the dashboard's device column names each rank's node
            self.view.nodes = {r: f"node {n.index} ({n.host or n.ip})" for n in nodes
                               for r in range(n.index * D, (n.index + 1) * D)}

    def _spec(self, rank: int, nodes, run_id: str, port: int) -> RankSpec:
        D, node = self.per_node, rank // self.per_node
        env = rendezvous.torchrun_env(rank=rank, world_size=self.world_size, run_id=run_id, master_port=port,
                                      threads=self.config.threads, ifname="")
        env.pop("GLOO_SOCKET_IFNAME")  # the node's own interface (its agent's, or the kernel's)
        env.update(reshape.node_place(rank, self.world_size, rank % D, D, node, self.nodes), MASTER_ADDR=nodes[0].ip)
        return starters.rank_spec(self.plan, self.config, rank, env)

    # a pool across nodes grown (--devices ranks on each node it did not use) or renumbered, its tables following
    # the ranks' moves (on_Moved): reshape.py
    place, room, grow, renumber, on_Moved = reshape.place, reshape.room, reshape.grow, reshape.renumber, reshape.moved

    def _fork_local(self, job_for, specs, ifname: str, deadline) -> None:
        """The kernel's node's ranks, forked from the kernel as in any pool (from its forkserver where the
        kernel holds CUDA), each with its store pipes."""
        pipes = {s.rank: os.pipe() for s in specs}
        self.cmd_fds = {r: w for r, (_, w) in pipes.items()}
        self._starter = starters.starter_for(self.plan)(self.run_dir)

        def env(spec):
            return starters.nccl_env(dict(spec.env, GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname),
                                     spec.backend, ifname)

        def forked(proc):
            proc.node = self.node_of(proc.rank)  # its exit names node 0 as the others' name theirs

        prepare = starters.store_pipes(self.local, env, forked)
        self._job_for, self._prepare = job_for, prepare  # (a replacement for a lost rank here: Gang.replace)
        try:
            self._starter.ready(self.config)
            starters.fork_specs(self.sup, self._starter, job_for(pipes), specs, deadline, prepare)
        finally:
            for read, _ in pipes.values():
                os.close(read)
            self.local.start()

    def replace(self, rank: int) -> None:
        """As any gang's for the kernel's node's ranks; another node's rank is forked anew by that node's agent
        (same spec, the group's generation now), or, that agent lost, with the rest of its node's ranks by a new
        one (relocate.lost_node)."""
        if rank in self.cmd_fds:  # (the kernel's node's)
            super().replace(rank)
            return
        link = next(link for link in self.links if rank in link.ranks)
        old = self.streams.procs.get(rank)
        if old is not None and old.exit is None:
            return  # (started anew with its node's other ranks: relocate)
        if link.lost:
            relocate.lost_node(self, link)
            return
        self.forget_ended([rank])
        link.control(agentmessages.ForkAgain(starters.again(self.specs[rank], self.generation)))
        end = time.monotonic() + placement.START_S
        self.sup.wait(None, until=lambda: self.streams.procs.get(rank) is not old or bool(link.lost)
                      or time.monotonic() >= end, wake_at=end)
        if self.streams.procs.get(rank) is old:
            raise ReplaceFailed(f"node {link.node}'s agent did not start a new rank {rank}: "
                               + (link.lost or f"no answer within {placement.START_S:g} s"))

    # -- commands -------------------------------------------------------------------------------------------
    def owe(self, values: dict[str, bytes]) -> None:
        """Notebook values the other nodes' ranks lack (name -> pickled: ``sending.RankNames`` decides
        which), sent with the next cell or update to each other node's rank, once."""
        self.extra.update(values)

    def command(self, cmd, ranks=None) -> None:
        """As any gang's; the values ``owe`` holds go with the next cell or update to each
        other node's rank that has not had them, and a cell's ranks left out (``--ranks``) get them in
        an ``Update`` of their own: each remote rank gets them once, whichever ranks run the cell."""
        wanted = set(range(self.world_size) if ranks is None else ranks)
        carries = isinstance(cmd, (messages.RunCell, messages.Update))
        for link in self.links:
            sends: dict[str, list[int]] = {}  # what each of the node's ranks gets: the command, with the values or not
            for r in link.ranks:
                owed = carries and bool(self.extra) and r not in self.given
                if r in wanted:
                    sends.setdefault("with" if owed else "plain", []).append(r)
                elif owed and isinstance(cmd, messages.RunCell):
                    sends.setdefault("update", []).append(r)
            for kind, mine in sends.items():
                out = messages.Update({}) if kind == "update" else cmd
                if kind != "plain":
                    out = dataclasses.replace(out, updates={**self.extra, **out.updates})
                    self.given.update(mine)
                link.control(agentmessages.Command(framing.encode(out), mine))
        # the kernel's node's ranks after: the other nodes' are the farther, their command goes first
        super().command(cmd, ranks=[r for r in sorted(wanted) if r in self.cmd_fds])
        if isinstance(cmd, messages.RunCell):  # every remote rank has had them now
            self.extra, self.given = {}, set()

    # -- end ----------------------------------------------------------------------------------------------------
    def close(self, why: str = "torn down", *, as_said: bool = False) -> None:
        """Once: a second call (an interrupt during the health check closes, then the cell's end) does nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stop_remote()
        finally:
            try:
                super().close(why, as_said=as_said)
            finally:
                with starters.sigint_deferred() as interrupted:  # an interrupt must not leave agents or the group
                    self._release()
                    interrupted.clear()  # (what it asks for is this very teardown)

    def _stop_remote(self) -> None:
        """The agents stop their ranks; bounded: a hung agent is killed after."""
        if self.sup is None or self.streams is None:
            return
        remote_procs = [p for p in self.sup.procs if not p.here]
        if any(p.exit is None for p in remote_procs):
            end = time.monotonic() + timeline.GRACE_S + timeline.STOP_S
            self.sup.stop_all()
            try:
                self.sup.wait(None,
                              until=lambda: all(p.exit is not None for p in remote_procs) or time.monotonic() >= end,
                              wake_at=end)
            except KeyboardInterrupt:
                pass
        # (a lost one's: None)
        self.reported = {p.rank for p in remote_procs if p.exit is not None and p.exit.code is not None}
        for link in self.links:
            link.control(agentmessages.Finish())  # (a node whose ranks were lost keeps its stream open until told)
            link.lost = link.lost or "closed"
        for p in remote_procs:
            if p.exit is None:
                self.sup.ended(p, remote.lost_exit(p.rank, f"node {p.node} did not report its end"))

    def _release(self) -> None:
        """The agents killed first (their ranks die with them), but for the ones kept for the next pool
        (placement.agents) whose ranks all reported their end and whose stream ended after its last batch;
        the placement group removed, then the threads' descriptors closed once the threads have ended."""
        keep = []
        if self.streams is not None:
            keep = [link for link in self.links if placement.is_kept(link.actor) and set(link.ranks) <= self.reported]
            if keep:
                self.streams.join(KEEP_S)  # their streams end right after their ranks' exits
            keep = [link.actor for link in keep if link.clean]
        if self.ray is not None:
            for actor in self.actors:
                if not any(actor is a for a in keep):
                    placement.forget(actor, self.ray)
        for pg in (self.pg, *self.extra_pgs):
            if pg is not None:
                placement.release(pg)
        self.actors, self.pg, self.extra_pgs = [], None, []
        self.local.close()
        if self.streams is not None:
            self.streams.close()  # once its readers ended (a killed agent's stream ends at once)
