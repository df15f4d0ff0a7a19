"""nbddp.launch and nbddp.environment from a plain script, the same machinery as the magic."""
import subprocess
import sys
import textwrap

import pytest

from nbddp.ipy import session

pytestmark = pytest.mark.timeout(120)


def run_script(code: str, timeout=90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_launch_returns_every_ranks_value_from_a_script():
    p = run_script("""
        import torch, torch.distributed as dist, nbddp
        def work(scale):
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            print('partial', dist.get_rank())
            return {'rank': dist.get_rank(), 'sum': t.item() * scale}
        if __name__ == '__main__':
            print(nbddp.launch(work, 10, devices=2))
            print(nbddp.environment().session)
    """)
    assert p.returncode == 0, p.stderr
    assert "[{'rank': 0, 'sum': 30.0}, {'rank': 1, 'sum': 30.0}]" in p.stdout
    assert "[rank0]:partial 0" in p.stdout and "[rank1]:partial 1" in p.stdout
    assert p.stdout.strip().endswith("script")


def test_launch_raises_rank_failure_naming_the_rank():
    p = run_script("""
        import os, nbddp
        def work():
            if os.environ['RANK'] == '1':
                raise KeyError('missing shard')
            return 0
        try:
            nbddp.launch(work, devices=2)
        except nbddp.RankFailure as e:
            print('rank', e.rank, 'cause', e.cause)
    """)
    assert "rank 1 cause KeyError: 'missing shard'" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_peer_waiting_for_the_failed_rank_is_stopped_by_nbddp_however_late_the_kernel_reads_the_failure(start_method):
    """The failed rank keeps its connections until the kernel stops every rank: a kernel slow to read its report
    (a loaded machine: CI's once) still finds rank 0 waiting in its collective, not failed by a closed connection."""
    p = run_script(f"""
        import time, torch, torch.distributed as dist, nbddp
        from nbddp.kernel.cells import engine
        from nbddp.wire import messages
        seen = engine.CellRun.on_Message
        def late(self, event):
            if isinstance(event.record, messages.Error):
                time.sleep(1.0)  # rank 0's collective would fail in this time if rank 1 had left
            seen(self, event)
        engine.CellRun.on_Message = late
        def work():
            if dist.get_rank() == 1:
                raise ValueError('bad batch on rank 1')
            dist.all_reduce(torch.ones(1))
        if __name__ == '__main__':
            try:
                nbddp.launch(work, devices=2, start_method={start_method!r})
            except nbddp.RankFailure as e:
                print(e)
    """)
    assert "rank 1 failed: ValueError: bad batch on rank 1" in p.stdout, p.stdout + p.stderr
    assert "rank 0: stopped by nbddp after rank 1 failed" in p.stdout, p.stdout + p.stderr


def test_launch_with_spawn_ships_the_function_by_value():
    p = run_script("""
        import nbddp
        def work(x):
            import os
            return (os.environ['RANK'], x)
        print(nbddp.launch(work, 'hi', devices=2, start_method='spawn'))
    """)
    assert p.returncode == 0, p.stderr
    assert "[('0', 'hi'), ('1', 'hi')]" in p.stdout


@pytest.mark.parametrize(
    "env, modules, shell, kind",
    [
        ({}, {"google.colab": 1}, object(), "colab"),
        ({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, {}, object(), "kaggle"),
        ({"VSCODE_PID": "1"}, {}, type("S", (), {"kernel": object()})(), "vscode"),
        ({}, {}, type("S", (), {"kernel": object()})(), "jupyter"),
        ({}, {}, type("S", (), {"kernel": None})(), "ipython-terminal"),
    ],
)
@pytest.mark.unit
def test_session_kinds(env, modules, shell, kind):
    assert session.session_kind(env=env, modules=modules, shell=shell) == kind
