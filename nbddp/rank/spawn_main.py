"""Entry point of a spawned rank: ``python -m nbddp.rank.spawn_main SPEC JOB`` with fd 1/2/3 set by the parent
(fd 3: the rank's channel)."""
import sys

from nbddp.rank import stdio, worker
from nbddp.wire import framing, values


def main() -> None:
    code = 70
    chan = framing.Writer(3, stdio.marks)
    try:
        with open(sys.argv[1], "rb") as f:
            spec = values.loads(f.read())
        worker.tie_to_parent(spec.parent_pid)

        def load_job():
            with open(sys.argv[2], "rb") as f:
                return values.loads(f.read())

        code = worker.run_rank(spec, load_job, chan)
    except BaseException as e:  # noqa: BLE001 - reading the spec failed: still reported
        worker.report(chan, "start", e)
    finally:
        worker.leave(code)


if __name__ == "__main__":
    main()
