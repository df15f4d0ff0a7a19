"""Entry point of a spawned rank: ``python -m nbddp._spawn SPEC JOB`` with fd 1/2/3 set by the parent."""
import sys

from nbddp import results, worker


def main() -> None:
    code = 70
    try:
        with open(sys.argv[1], "rb") as f:
            spec = results.loads(f.read())
        worker._tie_to_parent(spec.parent_pid)
        with open(sys.argv[2], "rb") as f:
            job = results.loads(f.read())
        code = worker.run_rank(spec, job, result_fd=3)
    finally:
        worker._leave(code)


if __name__ == "__main__":
    main()
