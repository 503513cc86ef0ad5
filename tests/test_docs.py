"""The README is a front page, its links and the docs' links lead somewhere, and the code blocks
of the README, docs/strategies.md and docs/primitives.md run as written (the FedAvg block gets
the `batches` it describes). The other pages' blocks run in their packages' tests
(algorithms, beam, data, xla: `test_docs_*.py`) and in tests/torch_fn (docs/from_torch.md)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.docs import ROOT, block, python_blocks

#: The pages whose relative links are checked.
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.fixture(autouse=True)
def _float32_default_promotion():
    # Documented code is user code: it runs with JAX's default (standard) dtype promotion.
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move sections into docs/"


def _anchors(page: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_lead_to_files(page: str) -> None:
    text = re.sub(r"```.*?```", "", (ROOT / page).read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = ((ROOT / page).parent / path).resolve() if path else ROOT / page
        if not resolved.exists() or (
            anchor
            and resolved.suffix == ".md"
            and anchor not in _anchors(str(resolved.relative_to(ROOT)))
        ):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"


def test_from_torch_quickstart_runs_and_trains():
    namespace: dict = {}
    quickstart = block("README.md", "bridge_mr.from_torch(client_loss, mutable=0)")
    exec(compile(quickstart, "README from_torch quickstart", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert all(p.grad is not None for p in namespace["model"].parameters())
    assert namespace["model"][1].running_mean.abs().sum() > 0  # the running statistics moved


def test_the_readme_has_one_python_block() -> None:
    assert len(python_blocks("README.md")) == 1  # the rest live in docs/, run from there


def test_jax_quickstart_and_fedavg_blocks_run():
    quickstart = block("docs/strategies.md", "def client_loss", "optimizer.step()")
    fedavg = block("docs/strategies.md", "def local_sgd")
    namespace: dict = {}
    exec(compile(quickstart, "docs/strategies.md quickstart", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert all(p.grad is not None for p in namespace["model"].parameters())
    namespace["batches"] = {
        "x": torch.randn(16, 10, 32, 64),
        "y": torch.eye(10)[torch.randint(10, (16, 10, 32))],
    }
    before = namespace["model"].weight.detach().clone()
    exec(compile(fedavg, "docs/strategies.md FedAvg", "exec"), namespace)
    assert not torch.equal(before, namespace["model"].weight.detach())


def test_retrace_block_sees_the_new_learning_rate():
    import jax
    import jax.numpy as jnp

    import bridge_mr

    namespace: dict = {"jax": jax, "jnp": jnp, "torch": torch, "bridge_mr": bridge_mr}
    retrace = block("docs/strategies.md", "class Trainer")
    exec(compile(retrace, "docs/strategies.md retrace example", "exec"), namespace)
    torch.testing.assert_close(namespace["second"], namespace["first"] / 10)


def test_jax_block_runs(capsys):
    primitives = block("docs/primitives.md", "def fedavg_delta")
    exec(compile(primitives, "docs/primitives.md JAX example", "exec"), {})
    assert "Array" in capsys.readouterr().out


def test_symbolic_block_runs_for_several_client_counts(capsys):
    import jax
    import jax.numpy as jnp

    import bridge_mr

    namespace: dict = {"jax": jax, "jnp": jnp, "bridge_mr": bridge_mr}
    symbolic = block("docs/primitives.md", "symbolic_shape")
    exec(compile(symbolic, "docs/primitives.md symbolic example", "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines  # One line per client count, both the same mean update.
    for line in lines:
        values = [float(v) for v in line.strip("[]").split()]
        assert values == pytest.approx([-0.1] * 3), line


def _jax_quickstart() -> dict:
    namespace: dict = {}
    quickstart = block("docs/strategies.md", "def client_loss", "optimizer.step()")
    exec(compile(quickstart.replace("range(100)", "range(1)"), "quickstart", "exec"), namespace)
    return namespace


def test_streaming_block_equals_one_weighted_mean():
    import bridge_mr

    namespace = _jax_quickstart()
    params = dict(namespace["model"].named_parameters())
    chunks = [
        {
            "x": torch.randn(c, 32, 64),
            "y": torch.eye(10)[torch.randint(10, (c, 32))],
            "w": torch.rand(c) + 0.5,
        }
        for c in (4, 4, 3)
    ]
    whole = {key: torch.cat([c[key] for c in chunks]) for key in ("x", "y", "w")}
    clients = {"x": whole["x"], "y": whole["y"]}
    expected = torch.autograd.grad(
        bridge_mr.map_reduce(
            namespace["client_loss"], params, clients, reduce="weighted_mean", weights=whole["w"]
        ),
        list(params.values()),
    )
    for p in params.values():
        p.grad = None  # the quickstart's last step left its gradients
    namespace.update(params=params, loader=chunks, optimizer=_Recorder())
    stream = block("docs/strategies.md", "for chunk in loader")
    exec(compile(stream, "docs/strategies.md streaming", "exec"), namespace)
    for p, grad in zip(params.values(), expected, strict=True):
        torch.testing.assert_close(p.grad, grad, rtol=1e-5, atol=1e-6)


class _Recorder:
    """An optimizer that leaves the parameters and their gradients alone, for the test to read."""

    def zero_grad(self) -> None:
        pass

    def step(self) -> None:
        pass


def test_dlpack_counting_block_counts_no_copies():
    namespace = _jax_quickstart()
    namespace["params"] = dict(namespace["model"].named_parameters())
    counting = block("docs/primitives.md", "count_conversions")
    exec(compile(counting, "docs/primitives.md count_conversions", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
