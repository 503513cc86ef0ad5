"""Processes the cases start (`python -m benchmarks.workers.NAME`), never run by hand:

* `peak_rss`: builds and runs one round, prints its peak resident memory (`harness.peak_rss`);
* `processes`: the torchrun worker of the "processes" case;
* `users`: one alternative of the "users_path" case, serving rounds on request (also in the pfl
  venv, which has neither JAX nor bridge_mr).
"""
