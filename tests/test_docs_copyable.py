"""The check that every command on the built site copies as written.

``.ci/run`` runs ``docs/check_copyable.py`` over the built HTML; here, that it
finds what Sphinx's smart quotes did to commands, and nothing on a clean page.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    return load_script(REPO / "docs" / "check_copyable.py")


def test_a_clean_page_has_no_finding(check) -> None:
    page = (
        "<p>FedDyn’s penalty, rounds 2–5.</p>"
        "<pre>tensorboard --logdir outputs</pre>"
        '<table><tr><td><code>pip install -e ".[mlflow]"</code></td></tr></table>'
    )
    assert check.check_page(page) == []


@pytest.mark.parametrize(
    ("page", "finding"),
    [
        (
            "<pre>tensorboard \u2013logdir outputs</pre>",
            "typographic character in code",
        ),
        ("<p><code>pip install \u201cx[y]\u201d</code></p>", "typographic character"),
        ("<td>mlflow ui \u2013backend-store-uri sqlite:///x</td>", "a dash made of"),
        (
            "<td>pip install \u201cflwr-prox-strategies[mlflow]\u201d</td>",
            "curly quote",
        ),
    ],
)
def test_what_smart_quotes_do_to_a_command_is_found(check, page, finding) -> None:
    (found,) = check.check_page(page)
    assert finding in found


def test_the_built_site_is_checked_page_by_page(check, tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text("<pre>flwr run . \u2013\u2013stream</pre>")
    (tmp_path / "b.html").write_text("<pre>flwr run . --stream</pre>")
    assert [line.split(":")[0] for line in check.check_site(tmp_path)] == ["a.html"]
    assert check.main([str(tmp_path)]) == 1
    assert check.main([str(tmp_path / "empty")]) == 1


def _shell(lines: str, language: str = "bash") -> str:
    """A code block as Sphinx renders it (Pygments splits the tokens)."""
    spans = "".join(f'<span class="o">{part}</span>' for part in lines.split("<"))
    return (
        f'<div class="highlight-{language} notranslate"><div class="highlight">'
        f"<pre>{spans}</pre></div></div>"
    )


@pytest.mark.parametrize(
    "command",
    ["kill &lt;pid&gt;", "flwr ls --run-id &lt;run-id&gt; --format json"],
)
def test_a_placeholder_in_a_shell_block_is_found(check, command) -> None:
    (found,) = check.check_page(_shell(command))
    assert "placeholder in a shell command" in found


def test_a_clone_placeholder_with_spaces_is_found(check) -> None:
    page = _shell("git clone &lt;repository URL&gt; flwr-prox-strategies\ncd x")
    (found,) = check.check_page(page)
    assert "git clone" in found


@pytest.mark.parametrize(
    "page",
    [
        _shell('RUN_ID=...  # the id "flwr ls" shows\nflwr stop "$RUN_ID"'),
        _shell("flwr ls  # then flwr stop &lt;run-id&gt;"),  # in a comment
        _shell("sort &lt;in &gt;out"),  # a redirection
        _shell("kill &lt;pid&gt;", language="text"),  # a template, shown as text
        "<pre>kill &lt;pid&gt;</pre>",  # not a shell block
    ],
)
def test_variables_comments_redirections_and_templates_pass(check, page) -> None:
    assert check.check_page(page) == []
