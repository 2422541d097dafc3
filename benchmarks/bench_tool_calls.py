"""What running a tool call costs besides the tool: the ToolBox's pool against the alternatives.

    python benchmarks/bench_tool_calls.py --calls 2000 --repeat 7

A ``ToolBox`` runs each call on a thread of its ``WorkerPool`` (``rlhf_pipeline/agents/workers.py``),
which gives up on a hung call and starts a new thread in its slot. Timed here, per call of a tool
that returns at once, one call at a time (a turn's calls then wait for each other's overhead only):

* ``ToolBox.run``: the whole path (binding the arguments, the pool, the answer as text, counting);
* ``WorkerPool``: submit and wait for the result;
* ``ThreadPoolExecutor``: the same on the standard pool the ToolBox used before (it cannot give
  a hung call's slot to a new thread);
* ``fork per call``: a child process per call (``os.fork``, the result back through a pipe), which
  could be killed at its timeout; measured in this process as it is (torch imported, as in a
  collector), since what a fork costs grows with the memory the parent maps.

The cases run in alternation (A B C D A B C D ...) so each sees the same moments of a shared
machine; the table gives the fastest and the median of ``--repeat`` runs, in microseconds per call.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def echo(x: int) -> int:
    """Returns its argument.

    Args:
        x: the number
    """
    return x


def per_call(run_one, calls: int) -> float:
    started = time.perf_counter()
    for k in range(calls):
        run_one(k)
    return (time.perf_counter() - started) / calls * 1e6


def fork_call(k: int) -> int:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the call, its result, gone
        os.close(read)
        os.write(write, pickle.dumps(echo(k)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        result = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed run (fork: a tenth of them)")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    import torch  # noqa: F401  (a collector's process: what a fork copies)

    from rlhf_pipeline.agents.environment import ToolCall
    from rlhf_pipeline.agents.tools import ToolBox
    from rlhf_pipeline.agents.workers import WorkerPool

    box, pool, standard = ToolBox([echo]), WorkerPool(4), ThreadPoolExecutor(4)
    cases = {
        "ToolBox.run": (lambda k: box.run([ToolCall("echo", {"x": k}, "")]), args.calls),
        "WorkerPool": (lambda k: pool.submit(echo, k).result(), args.calls),
        "ThreadPoolExecutor": (lambda k: standard.submit(echo, k).result(), args.calls),
        "fork per call": (fork_call, max(1, args.calls // 10)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):
        for name, (run_one, calls) in cases.items():
            times[name].append(per_call(run_one, calls))
    box.close()
    pool.shutdown()
    standard.shutdown()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.repeat} runs each")
    print("| case | best µs/call | median µs/call |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {min(values):.1f} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
