"""bridge_mr's benchmarks (not installed; run from the repository root), by family:

    __main__.py   `python -m benchmarks`: the suite, its options and its CASES
    harness.py    timing (interleaved repetitions, fresh processes, peak RSS)
    report.py     result rows, targets, JSON and Markdown; plots.py: the PNGs
    environment.py  the machine and the load of other processes
    cases/        the suite's cases, one module per family (`python -m benchmarks --cases ...`)
    workloads/    what the cases time: the rounds and contestants, built from public names
    workers/      processes the cases start (`python -m benchmarks.workers.NAME`)
    studies/      one-off questions, each run alone (`python -m benchmarks.studies.NAME`)
    results/      the last full run and NOTES.md, the log of what was measured and why

The small models (GPT-2, the recurrent models, the zoo) are the tests' own: `tests/helpers/zoo.py`,
shared with the from_torch tests so that a benchmark times what the tests check. Importing this
package puts `tests/` at the end of `sys.path`, so `from helpers import zoo` finds the module
under the name the tests import it by (under pytest, one module for both). It imports torch only.
"""

from __future__ import annotations

import os
import sys

#: The tests' folder, whose `helpers` package holds the zoo.
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")

if TESTS not in sys.path:
    sys.path.append(TESTS)
