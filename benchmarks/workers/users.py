"""One alternative of the "users_path" case in a process of its own, serving rounds on request.

    python -m benchmarks.workers.users '{"alternative": ..., "config": {...}, "save": PATH}'

Started fresh by the case (through `harness.peak_rss`'s launcher, so that its peak RSS is its
own), it builds the round (`workloads.users`), runs the first round timed (trace and compile
included), saves the parameters after it to `save` (an .npz, for the numerical agreement), and
answers on stdout with one JSON line per event:

    {"event": "ready", "import_rss_mb", "build_s", "first_s", "first_cpu_s", "cpu_total_s"}
    stdin "round"  -> {"event": "round", "seconds", "cpu_s"}    (one more round, synced)
    stdin "quit"   -> {"event": "done", "peak_rss_mb"}

`cpu_s` is this process's CPU time during the round, which the case takes out of the machine's
busy time to tell the load of the other processes. Runs in the pfl venv too: it imports
numpy, torch and the round's libraries only. Exits non-zero (the error on stderr) if the round
cannot be built or fails.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str]) -> int:
    """Serves the spec in argv[0]; returns the exit status."""
    spec = json.loads(argv[0])
    import numpy as np
    import torch

    from .. import harness
    from ..workloads import users

    if spec["alternative"].startswith("bridge_mr"):
        import jax  # noqa: F401  (part of the import baseline, as torch is)

        import bridge_mr  # noqa: F401
    import_rss = _max_rss_mb()
    cfg = users.UserConfig(**spec["config"])
    build_s, round_fn = harness.time_once(lambda: users.build(spec["alternative"], cfg))
    cpu = _cpu_s()
    first_s, params = harness.time_once(round_fn)
    first_cpu = _cpu_s() - cpu
    np.savez(spec["save"], *[torch.as_tensor(p).detach().numpy() for p in params])
    _say(
        event="ready",
        import_rss_mb=import_rss,
        build_s=build_s,
        first_s=first_s,
        first_cpu_s=first_cpu,
        cpu_total_s=_cpu_s(),
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "round":
            cpu = _cpu_s()
            seconds, _ = harness.time_once(round_fn)
            _say(event="round", seconds=seconds, cpu_s=_cpu_s() - cpu)
        elif command == "quit":
            break
        else:
            print(f"users_worker: unknown command {command!r}", file=sys.stderr)
            return 2
    _say(event="done", peak_rss_mb=_max_rss_mb())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
