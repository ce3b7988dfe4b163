"""Runs one rank of a multi-process test job as ``python <argv>`` would (a script path, ``-m module`` or
``-c code``), then leaves without the interpreter's C++ teardown.

Why: DeepSpeed's CPU communication op (``deepspeed_shm_comm_op``) can leave a thread joinable at exit, and the
rank then aborts after its work has passed ("terminate called without an active exception", exit -6): a flaky
exit code, not a test result. Here the rank's own exit status is kept (0, its ``sys.exit`` code, or 1 with the
traceback for an uncaught exception), its ``atexit`` handlers run, the process group is destroyed, the output is
flushed, and the process ends with ``os._exit`` (a ``KeyboardInterrupt`` is re-raised untouched)."""
from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback


def _run(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # not this file's folder: the rank's own sys.path[0], as python sets it
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    """Run the rank (``argv``: the command line after ``python``, default ours) and end the process."""
    code = _run(sys.argv[1:] if argv is None else argv)
    atexit._run_exitfuncs()
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the job's result is decided; a failed teardown does not change it
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
