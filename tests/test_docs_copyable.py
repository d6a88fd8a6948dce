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
