"""The cases of `python -m benchmarks`: one module per case family, each a `run(ctx)` (or a few)
that returns a `report.CaseResult`. `benchmarks/__main__.py` names them (`CASES`).
"""
