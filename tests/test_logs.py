"""Run directories: the log directory an error names survives other kernels' runs (issue 10, point 6).

Two real kernels share one runs directory, each keeping only 2 runs of its own; what each prunes is
read from the directory itself."""
import os
import re

import pytest

from kernel import Kernel

pytestmark = pytest.mark.timeout(240)

FAIL = "%%ddp --devices 2\nraise ValueError('logged')\n"
OK = "%%ddp --devices 2\nprint('fine')\n"


def _log_dir(res) -> str:
    m = re.search(r"Every rank's full output: (\S+)", res.error_text)
    assert m, res.error_text
    return m.group(1)


def test_an_errors_log_directory_outlives_other_kernels_runs(tmp_path):
    env = {"NBDDP_RUNS_DIR": str(tmp_path), "NBDDP_KEEP_RUNS": "2"}
    with Kernel(env=env) as a:
        a.ok("%load_ext nbddp\nimport torch")
        failed = _log_dir(a.run(FAIL, timeout=90))
        assert os.path.isfile(os.path.join(failed, "rank0.log"))

        with Kernel(env=env) as b:
            b.ok("%load_ext nbddp\nimport torch")
            for _ in range(4):  # twice what a kernel keeps: b prunes only its own runs
                b.ok(OK, timeout=90)
            assert os.path.isdir(failed), "another kernel's runs removed the log directory an error named"
            b_runs = [n for n in os.listdir(tmp_path) if f"-{b.pid}-" in n]
            assert len(b_runs) == 2, b_runs

            for _ in range(2):  # a's own newer runs do prune it: a kernel keeps its newest 2
                a.ok(OK, timeout=90)
            assert not os.path.exists(failed)
            assert sorted(n for n in os.listdir(tmp_path) if f"-{b.pid}-" in n) == sorted(b_runs), \
                "a kernel removed runs of another kernel that is still alive"

            b_pid = b.pid
        a.ok("import os\nos.environ['NBDDP_KEEP_DAYS'] = '1'")  # b's runs are minutes old: still kept
        a.ok(OK, timeout=90)
        assert len([n for n in os.listdir(tmp_path) if f"-{b_pid}-" in n]) == 2
        a.ok("os.environ['NBDDP_KEEP_DAYS'] = '0'")  # now older than the limit, and b is gone
        a.ok(OK, timeout=90)
        assert not [n for n in os.listdir(tmp_path) if f"-{b_pid}-" in n]
