"""A cluster pool's exchange with its agents (nbddp/wire/agentmessages.py): every message travels whole through a
pickle, the agent has a handler for each of the kernel's calls and refuses any other message by its type's name on
its stream, and the kernel's reader sends each thing a stream says where it belongs. No Ray, no rank."""
import dataclasses
import os
import pickle

import pytest

from nbddp.cluster import agent as agent_mod
from nbddp.cluster import remote
from nbddp.kernel.ranks import groupstore
from nbddp.kernel.ranks.supervisor import Output, Supervisor
from nbddp.wire import agentmessages, framing

SAMPLES = [
    agentmessages.Command(framing.encode(("run", 1)), [0, 2]),
    agentmessages.StoreReply(4242, b"reply"),
    agentmessages.Signal(1, 10, True),
    agentmessages.LookAtRanks(3),
    agentmessages.Renumber({2: 1, 3: 2}),
    agentmessages.ForkAgain({"rank": 1, "generation": 2}),
    agentmessages.Finish(),
    agentmessages.StoreRequest(4242, (7, "wait", (["k"],))),
    agentmessages.CallFailed("its agent could not apply the kernel's 'Command': OSError: gone"),
    agentmessages.RankForked(1, 4243),
    agentmessages.Renumbered(),
    agentmessages.Looked(3, {1: None, 2: None}),
]


def test_every_message_each_way_has_a_sample_here():
    assert {type(m) for m in SAMPLES} == {*agentmessages.KERNEL_CALLS, *agentmessages.AGENT_SENDS}
    assert not set(agentmessages.KERNEL_CALLS) & set(agentmessages.AGENT_SENDS)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_message_round_trips_through_pickle_in_its_envelope(message):
    assert dataclasses.is_dataclass(message) and type(message).__dataclass_params__.frozen
    assert pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)) == message
    sent = pickle.loads(pickle.dumps(agentmessages.AgentCall("pool-1", 7, message)))
    assert (sent.pool, sent.seq, sent.call) == ("pool-1", 7, message)


def test_the_agent_has_one_handler_for_each_of_the_kernels_calls_and_none_for_its_own_words():
    assert set(agent_mod.HANDLERS) == set(agentmessages.KERNEL_CALLS)
    assert not set(agent_mod.HANDLERS) & set(agentmessages.AGENT_SENDS)


@pytest.fixture
def agent(monkeypatch):
    """An agent as Ray makes one, less the imports it warms for its ranks (torch...): no Ray actor, no rank."""
    from nbddp.kernel.ranks import warm
    from nbddp.rank import worker

    monkeypatch.setattr(worker, "warm_start", lambda outside_shell=False: None)
    monkeypatch.setattr(warm, "start", lambda: None)
    agent = agent_mod.Agent()
    agent._reset("pool-1")
    yield agent
    for fd in (agent.wake_r, agent.wake_w, *agent.retired):
        os.close(fd)


def _control(agent, seq, message, pool="pool-1"):
    agent.control(pickle.dumps(agentmessages.AgentCall(pool, seq, message)))


def test_a_message_the_agent_does_not_know_is_refused_by_its_name_on_the_stream_and_the_next_is_applied(agent):
    agent.waiting = True
    _control(agent, 1, agentmessages.Renumbered())  # (one of the agent's own, sent the wrong way)
    assert agent.queue == [agentmessages.CallFailed(
        "its agent could not apply the kernel's 'Renumbered': not a call it knows")]
    assert os.read(agent.wake_r, 64), "the stream's thread was woken to say it"
    _control(agent, 2, "no_such_op")
    assert agent.queue[-1] == agentmessages.CallFailed(
        "its agent could not apply the kernel's 'str': not a call it knows")
    _control(agent, 3, agentmessages.Finish())  # the sequence goes on
    assert agent.applied == 3 and not agent.waiting and len(agent.queue) == 2


def test_a_call_the_agent_fails_to_apply_is_said_by_its_old_name(agent):
    _control(agent, 1, agentmessages.Command(b"frame", None))
    assert agent.queue == [agentmessages.CallFailed(
        "its agent could not apply the kernel's 'command': TypeError: 'NoneType' object is not iterable")]


def test_an_agent_applies_the_calls_in_sequence_order_and_ignores_another_pools(agent):
    cmd_r, agent.cmd[1] = os.pipe()
    try:
        _control(agent, 2, agentmessages.Command(b"second", [1]))
        _control(agent, 1, agentmessages.Command(b"stale", [1]), pool="pool-0")
        _control(agent, 1, agentmessages.Command(b"first", [1]))
        assert os.read(cmd_r, 64) == b"firstsecond" and agent.applied == 2
    finally:
        os.close(cmd_r)
        os.close(agent.cmd[1])


def test_the_kernels_reader_answers_store_requests_by_pid_and_queues_the_rest_by_type():
    sup = Supervisor([])
    streams = remote.Streams(sup, groupstore.Store())
    sent = []
    link = remote.Link(None, "n1", [1])
    link.control = sent.append
    try:
        event = Output(1, "stdout", b"a")
        rest = streams.took(link, [
            agentmessages.StoreRequest(4242, (7, "add", ("n", 2))), event, agentmessages.Renumbered(),
            agentmessages.CallFailed("its agent could not apply the kernel's 'Signal': OSError: x")])
        assert sent == [agentmessages.StoreReply(4242, framing.encode((7, True, 2)))]
        assert rest == [(link, event), (link, agentmessages.Renumbered()),
                        (link, remote.StreamEnded("its agent could not apply the kernel's 'Signal': OSError: x"))]
        assert link.broken and link.lost.endswith("OSError: x")
        # each thing the main thread is handed, bar a rank's event, has its handler there
        assert set(remote.APPLY) == {*agentmessages.AGENT_SENDS, remote.StreamEnded} - {
            agentmessages.StoreRequest, agentmessages.CallFailed}
    finally:
        streams.close()
        sup.close()
