"""Issue 12 point 4 through a real kernel: the pool's own dashboard, live over the pool's life."""
import queue
import re
import time

import pytest

pytestmark = pytest.mark.timeout(240)


def pool_display(res) -> str:
    ids = [d.get("transient", {}).get("display_id", "") for d in res.displays]
    ours = [i for i in ids if i.startswith("nbddp-pool-")]
    assert ours, f"no pool dashboard among {ids}"
    return ours[-1]


def wait_update(k, display_id: str, predicate, timeout: float = 20, on_text=None) -> str:
    """Read the kernel's iopub until an update of ``display_id`` satisfies ``predicate`` (any cell's)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            msg = k.kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        content = msg["content"]
        if msg["msg_type"] in ("display_data", "update_display_data") and \
                content.get("transient", {}).get("display_id") == display_id:
            text = content["data"]["text/plain"]
            seen.append(text)
            if predicate(text):
                return text
    raise AssertionError(f"no update of {display_id} matched within {timeout} s; last: {seen[-1:]}")


def own_line(res) -> str:
    """A pool cell's own line, as it was drawn last."""
    return [d for d in res.displays
            if d.get("transient", {}).get("display_id", "").startswith("nbddp-line-")][-1]["data"]["text/plain"]


def test_the_pool_dashboard_follows_ranks_cells_and_memory_over_the_pools_life(clean_kernel):
    k = clean_kernel
    start = k.ok("%ddp start --devices 2")
    did = pool_display(start)
    first = next(d for d in start.displays if d["transient"]["display_id"] == did)["data"]
    assert "<table" in first["text/html"] and "idle" in first["text/plain"] and "0 cells run" in first["text/plain"]
    try:
        # a long cell: the dashboard shows every rank busy with it, while it runs
        busy = []
        long_cell = k.execute("%%ddp\nimport time\nbig = torch.ones(64 * 2**20 // 4)  # 64 MiB per rank\n"
                              "time.sleep(2.5)\n")

        def watch(kind, content):
            if kind == "update_display_data" and content["transient"]["display_id"] == did:
                busy.append(content["data"]["text/plain"])

        long_res = k.collect(long_cell, timeout=60, on_message=watch)
        assert any("busy: Cell In[" in t for t in busy), busy
        # the cell itself gets no dashboard, only its one line: its place as the cell begins, live from the first
        # tick (a 2.5 s cell), ending as the final line in the same output (the start cell's view has the detail)
        own = [d for d in long_res.displays if d.get("transient", {}).get("display_id") != did]
        assert len({d["transient"]["display_id"] for d in own}) == 1, own
        assert own[0]["data"]["text/plain"] == "nbddp pool · cell on ranks 0-1 · running", own
        ticked = re.fullmatch(r"nbddp pool · cell on ranks 0-1 · (\d+\.\d) s · running", own[1]["data"]["text/plain"])
        ended = re.fullmatch(r"nbddp pool · cell on ranks 0-1 · (\d+\.\d) s · ok", own[-1]["data"]["text/plain"])
        # (the cell's own time: at a tick while it runs, and its whole 2.5 s and more once over, however loaded the
        # machine; a README-suite run in three workers on 2 cores read 3.2 s)
        assert ticked and ended and float(ticked[1]) <= float(ended[1]) and 2.5 <= float(ended[1]) < 10, own
        # between cells, on the kernel's own loop: the cell is listed, the ranks idle, their memory grew
        after = wait_update(k, did, lambda t: "1 cell run" in t and "busy" not in t)
        assert "Cell In[" in after and " · ok" in after
        life = [line for line in after.splitlines() if line.startswith(("0 ", "1 "))]
        assert len(life) == 2 and all(re.search(r"iB–[\d.]+ [MG]iB$", line) for line in life), after
        top = [float(n) * (1024 if unit == "GiB" else 1)
               for n, unit in (line.rsplit("–", 1)[1].split() for line in life)]
        assert all(t >= 64 for t in top), f"the 64 MiB each rank allocated shows in its history: {after}"
        # a quick cell adds a line too; a failed one says so
        kinds = []
        quick = k.collect(k.execute("%%ddp\nprint(rank)\nrank + 40\n"), on_message=lambda kind, _: kinds.append(kind))
        # the line's place first, above the ranks' text (queued on ipykernel's IO thread, in order), Out[] last
        shown = [m for m in kinds if m in ("stream", "display_data", "execute_result")]
        assert shown[0] == "display_data" and shown.count("display_data") == 1 and shown[-1] == "execute_result", kinds
        assert quick.result == "40", quick
        line = own_line(quick)
        assert re.fullmatch(r"nbddp pool · cell on ranks 0-1 · [\d.]+ ms · ok", line), quick.displays
        assert sorted(quick.stdout.splitlines()) == ["[rank0]:0", "[rank1]:1"]
        failed = k.run("%%ddp\nraise ValueError('boom')\n")
        assert own_line(failed).endswith(
            "· failed: rank 0 ValueError, rank 1 ValueError"), failed.displays
        after = wait_update(k, did, lambda t: "3 cells run" in t)
        assert after.count(" · ok") == 2 and " · failed" in after, after
        # %ddp status shows the same live output again
        assert pool_display(k.ok("%ddp status")) == did
    finally:
        stop = k.ok("%ddp stop")
    final = [d["data"]["text/plain"] for d in stop.displays if d.get("transient", {}).get("display_id") == did]
    assert final and re.search(r"· stopped · was up \d+ s · 3 cells run", final[-1]), stop.displays
    assert re.search(r"^0\s+\d+\s+cpu\s+stopped\s+\S+ [\d.]+ [KMG]iB–[\d.]+ [KMG]iB$", final[-1],
                     re.MULTILINE), final[-1]  # no memory now
    assert "idle" not in final[-1] and "RSS  " not in final[-1]


def test_pool_cells_looped_in_one_notebook_cell_show_their_lines_while_it_runs(clean_kernel):
    """A pool cell's line waits on ipykernel's IO thread for the kernel's next message (views/iopub.py):
    a loop of pool cells in one notebook cell has none for a while, and the IO thread's tick sends the
    lines, in order, long before the notebook cell ends; the tick stops when idle and starts again."""
    k = clean_kernel
    k.ok("%ddp start --devices 2\nimport nbddp.views.iopub as iopub\niopub.IDLE_S = 0.5")
    try:
        for rounds in (3, 2):  # the second loop comes after the tick stopped (idle 2 s > IDLE_S)
            got = []
            cell = k.execute(f"import time\nfor i in range({rounds}):\n"
                             f"    get_ipython().run_cell_magic('ddp', '', 'x = rank + ' + str(i) + ';')\n"
                             f"time.sleep(2)")

            # each line's final state (its place, reserved as its cell began, filled)
            def watch(kind, content, got=got):
                if kind == "update_display_data" and content["data"]["text/plain"].startswith("nbddp pool · "):
                    got.append(time.monotonic())

            res = k.collect(cell, timeout=60, on_message=watch)
            done = time.monotonic()
            assert res.status == "ok" and len(got) == rounds, res
            lines = [d["data"]["text/plain"] for d in res.displays
                     if d["transient"].get("display_id", "").startswith("nbddp-line-")
                     and "· running" not in d["data"]["text/plain"]]
            assert len(lines) == rounds and all(re.fullmatch(r"nbddp pool · cell on ranks 0-1 · [\d.]+ ms · ok", t)
                                                for t in lines), res.displays
            assert done - got[-1] > 1.0, \
                f"the lines came with the cell's end, not while it ran ({done - got[-1]:.2f} s)"
        # idle past IDLE_S: the tick stops, every line sent (waited for, with a deadline)
        deadline, state = time.monotonic() + 20, None
        while time.monotonic() < deadline:
            state = k.value("[(l.ticking, l.queued - l.done) for l in iopub._LATER.values()]")
            if state == [(False, 0)]:
                break
            time.sleep(0.1)
        assert state == [(False, 0)], f"the tick still runs, or lines wait: {state}"
    finally:
        k.ok("%ddp stop")


def test_a_pool_cells_line_is_queued_on_this_ipykernels_io_thread_or_sent_the_ordinary_way(clean_kernel):
    """views/iopub.py's one use of ipykernel's private IOPubThread internals (``queue_without_wake``) works
    on the ipykernel installed (CI runs this on 7.x and on the hosted stacks' 6.17): the call is made on the
    IO thread. Where it cannot be (no IOPubThread to queue on, or ``QUEUED`` off) nothing is queued and a
    pool cell's line is sent the ordinary way: the same outputs, the place then its final line."""
    k = clean_kernel
    k.ok("%ddp start --devices 2\nimport threading\nimport nbddp.views.iopub as iopub")
    try:
        k.ok("sent, ev = [], threading.Event()\n"
             "queued = iopub.queue_without_wake(get_ipython().display_pub.pub_socket,\n"
             "                                  lambda sock: (sent.append(threading.current_thread().name), "
             "ev.set()))\n"
             "ev.wait(5)")
        assert k.value("queued") is True, "the line cannot be queued on this ipykernel's IO thread"
        assert k.value("sent") and k.value("sent[0] != threading.main_thread().name"), k.value("sent")
        assert k.value("iopub.queue_without_wake(object(), lambda sock: None)") is False
        shown = {}
        for queued in (True, False, True):
            k.ok(f"iopub.QUEUED = {queued}")
            res = k.ok("%%ddp\nx = rank")
            lines = [re.sub(r"[\d.]+ ms", "T ms", d["data"]["text/plain"]) for d in res.displays
                     if d.get("transient", {}).get("display_id", "").startswith("nbddp-line-")]
            assert lines == ["nbddp pool · cell on ranks 0-1 · running",
                             "nbddp pool · cell on ranks 0-1 · T ms · ok"], \
                (queued, res.displays)
            shown.setdefault(queued, lines)
        assert shown[True] == shown[False]
    finally:
        k.ok("iopub.QUEUED = True")
        k.ok("%ddp stop")


def test_a_rank_that_dies_between_cells_shows_on_the_dashboard_before_the_next_cell(clean_kernel):
    import os
    import signal

    from helpers import pool_pids

    k = clean_kernel
    did = pool_display(k.ok("%ddp start --devices 2"))
    try:
        victim = pool_pids(k)[1]
        os.kill(victim, signal.SIGKILL)
        text = wait_update(k, did, lambda t: re.search(rf"^\d\s+{victim}\s+cpu\s+dead", t, re.MULTILINE) is not None)
        assert re.search(r"^\d\s+\d+\s+cpu\s+idle", text, re.MULTILINE), "the other rank is still idle"
    finally:
        k.ok("%ddp stop")


@pytest.mark.unit
def test_the_pool_views_words_and_scales_are_honest(tmp_path):
    from types import SimpleNamespace

    from nbddp.kernel import devices
    from nbddp.views import poolview
    from nbddp.views.monitor import uptime

    assert [uptime(s) for s in (5, 80, 7500)] == ["5 s", "1 min 20 s", "2 h 5 min"]
    life = poolview.LifeSeries()
    for v in (1000, 1010, 1030):  # a 3 % change
        life.add(v * 2**20)
    drawn = poolview.PoolView._life(life)
    assert set(drawn.split()[0]) <= set("▂▃▄▅▆▇") and drawn.endswith(" 1000 MiB–1.0 GiB"), \
        f"a 3 % change is not full scale, nor a solid block: {drawn}"
    flat = poolview.LifeSeries()
    for _ in range(3):
        flat.add(500 * 2**20)
    assert set(poolview.PoolView._life(flat).split()[0]) in ({"▄"}, {"▅"}), "flat memory: a flat line mid-height"
    assert poolview.PoolView._life(flat).html.count("border-top:2px") == poolview.SPARK_WIDTH
    widths = set()
    for n in (1, 3, 39, 40, 41, 100, 511, 513, 5000):  # a young pool to an old one: one width
        series = poolview.LifeSeries()
        for i in range(n):
            series.add((100 + i % 7) * 2**20)
        cell = poolview.PoolView._life(series)
        widths.add((len(cell.split()[0]), re.search(r"width:(\d+)px;height:14px", cell.html).group(1)))
    assert widths == {(poolview.SPARK_WIDTH, str(poolview.SPARK_WIDTH * poolview.LINE_STEP_PX))}, widths
    view = poolview.PoolView(devices.Plan("cpu", "gloo", (None, None)), SimpleNamespace(path=tmp_path), shown=False)
    view.cell_began("Cell In[2]")
    view.cell_ended("ok")
    assert "· 1 cell run" in view.title() and "· up 0 s ·" in view.title()
    view.finish("ended: rank 1 exited (killed by SIGKILL)")
    assert "ended: rank 1 exited" in view.title() and "was up" in view.title()
    assert all(row[3] == "ended" for row in view.rows()[1:])
