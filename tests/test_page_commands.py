"""The pages' commands are found, and every run a page shows says what it gives.

``benchmarks/readme_commands.py`` runs the commands; here, without running
them, every ``flwr run`` / ``python -m flwr_prox_strategies`` command of the
README and the docs carries an ``# expect:`` line that parses (or says why it
is not run here), so no page can show a run whose result nobody checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return load_script(REPO / "benchmarks" / "readme_commands.py")


def test_every_run_on_a_page_has_a_readable_expectation(script) -> None:
    found = script.commands(script.pages())
    runnable = [c for c in found if c.runnable and not c.is_tests]
    assert len(runnable) >= 8
    for command in runnable:
        assert command.expect, f"{command.where}: no '# expect:' line"
        script.checks(command.expect)  # raises on a key it does not know


def test_a_command_on_two_pages_runs_once(script, tmp_path: Path) -> None:
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    run = "flwr run . --stream --run-config \"overrides='strategy=fedavg'\""
    first.write_text(f"```bash\n# expect: rounds 3, time ~5 s\n{run}\n```\n")
    second.write_text(
        "text\n\n```bash\n# expect: rounds 3, time ~5 s\n"
        f"{run}\n# not run here: needs a federation named mine\nflwr run . mine\n```\n"
    )
    found = script.commands([first, second])
    assert [c.number for c in found] == [1, 2]
    assert found[0].also_at == [f"{second}:5"]
    assert found[0].runnable and not found[1].runnable
    assert found[1].not_run == "needs a federation named mine"


def test_one_command_cannot_promise_two_things(script, tmp_path: Path) -> None:
    run = "python -m flwr_prox_strategies.experiment -m seed=0,1"
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text(f"```bash\n# expect: jobs 2\n{run}\n```\n")
    second.write_text(f"```bash\n# expect: jobs 3\n{run}\n```\n")
    with pytest.raises(ValueError, match="one command, one expectation"):
        script.commands([first, second])


def test_an_install_or_an_export_does_not_make_another_run(
    script, tmp_path: Path
) -> None:
    run = 'flwr run . --stream --federation-config "num-supernodes=20"'
    page = tmp_path / "a.md"
    page.write_text(
        "```bash\n# expect: rounds 30\n"
        f'pip install -e ".[experiment]" && FLWR_X=1 {run}\n```\n\n'
        f"```bash\nexport FLWR_X=1   # why\n# expect: rounds 30\n{run}\n```\n\n"
        f"```bash\n# expect: rounds 30\nFLWR_X=1 {run}\n```\n\n"
        f"```bash\n# expect: rounds 30\n{run}\n```\n"
    )
    found = script.commands([page])
    assert len(found) == 2  # the last one runs without FLWR_X
    assert len(found[0].also_at) == 2


def test_every_run_in_an_example_readme_has_a_readable_expectation(script) -> None:
    """The examples' READMEs promise what their runs show, in the same format.

    They are not run by ``benchmarks/readme_commands.py`` (their commands run
    from the example's folder); their system tests run them.
    """
    readmes = sorted((REPO / "examples").glob("*/README.md"))
    assert len(readmes) >= 2
    found = script.commands(readmes)
    runnable = [c for c in found if c.runnable and not c.is_tests]
    assert runnable
    for command in runnable:
        assert command.expect, f"{command.where}: no '# expect:' line"
        script.checks(command.expect)
