"""The Python snippets of the README and the documentation site run as written.

Every fenced ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` is
executed alone, in a fresh namespace, from the repository root: a snippet a
user pastes must not fail on a renamed keyword or a missing import. Fragments
that cannot run alone (they need a Flower ``Grid``, a user's model, or minutes)
are written with MyST's ```` ```{code-block} python ```` directive instead, which
renders the same and is not executed here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> *)```python[ \t]*$")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """The ```` ```python ```` blocks of ``page``: (first line number, code)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        index += 1
        if not opening:
            continue
        indent = len(opening["indent"])
        start, body = index + 1, []
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index][indent:])
            index += 1
        index += 1
        blocks.append((start, "\n".join(body) + "\n"))
    return blocks


SNIPPETS = [
    pytest.param(code, id=f"{page.relative_to(REPO)}:{line}")
    for page in _pages()
    if "_build" not in page.parts
    for line, code in python_blocks(page)
]


def test_the_pages_have_snippets() -> None:
    # The collection itself must not silently find nothing.
    assert len(SNIPPETS) >= 3, [p.id for p in SNIPPETS]


def test_only_python_fences_are_taken(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n```bash\nls\n```\n"
        "\n```{code-block} python\ngrid.run()\n```\n"
    )
    assert python_blocks(page) == [(4, "x = 1\n")]


@pytest.mark.parametrize("code", SNIPPETS)
def test_snippet_runs(code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(code, "<snippet>", "exec"), namespace)


def test_the_readmes_drop_in_app_trains_under_its_strategy() -> None:
    # Defining the apps is not enough: the README's ClientApp, driven through
    # the real ClientApp machinery, applies FedDyn's rule in every reply.
    import torch
    from flwr.app import ArrayRecord

    from flwr_prox_strategies import FedDyn
    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

    [(_, code)] = [
        block for block in python_blocks(REPO / "README.md") if "FedDynRule" in block[1]
    ]
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(code, "<README>", "exec"), namespace)
    grid = InProcessGrid(namespace["client"], num_nodes=4)
    result = FedDyn(alpha=0.01, fraction_train=0.5, seed=0).start(
        grid=grid,
        initial_arrays=ArrayRecord(torch.nn.Linear(64, 10).state_dict()),
        num_rounds=2,
    )
    for metrics in result.train_metrics_clientapp.values():
        # every local step held FedDyn's term (a sample-weighted mean of counts)
        assert metrics["feddyn-applied"] == metrics["local-steps"] > 0
        assert metrics["term-lost-steps"] == metrics["term-missing-steps"] == 0
        assert metrics["replies-valid"] == 2 and metrics["replies-rejected"] == 0


def test_the_lightning_snippet_trains_under_fedprox() -> None:
    # The training-frameworks page's Lightning ClientApp, run as a federation:
    # FedProx's term reached every one of the Trainer's optimiser steps.
    import torch
    from flwr.app import ArrayRecord

    from flwr_prox_strategies import FedProx
    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

    pytest.importorskip("lightning")
    page = REPO / "docs" / "howto" / "training-frameworks.md"
    [(_, code)] = [b for b in python_blocks(page) if "RuleCallback" in b[1]]
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    exec(compile(code, "<training-frameworks>", "exec"), namespace)
    grid = InProcessGrid(namespace["client"], num_nodes=2)
    initial = namespace["LitRegression"]().state_dict()  # type: ignore[operator]
    result = FedProx(mu=0.5, fraction_evaluate=0.0).start(
        grid=grid, initial_arrays=ArrayRecord(initial), num_rounds=2
    )
    for metrics in result.train_metrics_clientapp.values():
        assert metrics["proximal-mu-applied"] == metrics["local-steps"] == 4
        assert metrics["replies-valid"] == 2
    moved = result.arrays.to_torch_state_dict()
    assert any(not torch.equal(moved[k], initial[k]) for k in initial)
