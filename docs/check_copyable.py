"""Check the built site: no command a reader copies holds a typographic character.

Sphinx's "smart quotes" turn ``--`` into an en dash and ``"`` into curly
quotes in text (the pack turns them off, ``smartquotes = False`` in
``conf.py``); a command that went through them fails when pasted into a shell.
This reads every page of the built HTML and reports:

* in code (``<pre>``, ``<code>``, ``<kbd>``): any en or em dash or curly quote;
* anywhere else: an en or em dash right before a word (``–logdir``, a mangled
  ``--logdir``), and a curly double quote in a table cell that holds a
  command (``pip``, ``python``, ``flwr``, ``mlflow``, ``tensorboard`` ...);
* in a shell block (``bash``, ``sh``, ``shell``, ``console``), a placeholder
  in angle brackets outside a comment (``kill <pid>``): pasted, the shell
  reads it as a redirection. Write a variable set on a line of its own
  (``RUN_ID=...``), or show a template as ``text``.

Usage: ``python docs/check_copyable.py docs/_build/html`` (exit status 1 and
one line per finding when something is wrong). ``.ci/run`` runs it after the
documentation build.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

TYPOGRAPHIC = "\u2013\u2014\u201c\u201d\u2018\u2019"
_MANGLED_OPTION = re.compile(r"(?:^|[\s(])[\u2013\u2014][A-Za-z]")
_COMMAND = re.compile(
    r"\b(pip|python|flwr|flower-\w+|mlflow|tensorboard|wandb|git|export|bash)\b"
)
_CODE = {"pre", "code", "kbd", "samp"}
_SHELL_BLOCKS = (
    "highlight-bash",
    "highlight-sh",
    "highlight-shell",
    "highlight-console",
)
# <run-id>, <repository URL>; not a redirection such as `sort <in >out`.
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w .-]*[\w.]>")
_COMMENT = re.compile(r"(?:^|\s)#.*$")
_CELLS = {"td", "th"}


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code_depth = 0
        self.divs: list[bool] = []  # open <div>s: is it a shell block?
        self.shell_text: list[str] | None = None  # a shell block's <pre> text
        self.cells: list[list[str]] = []
        self.findings: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _CODE:
            self.code_depth += 1
        if tag in _CELLS:
            self.cells.append([])
        if tag == "div":
            classes = (dict(attrs).get("class") or "").split()
            self.divs.append(any(c in _SHELL_BLOCKS for c in classes))
        if tag == "pre" and any(self.divs):
            self.shell_text = []

    def handle_endtag(self, tag: str) -> None:
        if tag in _CODE and self.code_depth:
            self.code_depth -= 1
        if tag == "div" and self.divs:
            self.divs.pop()
        if tag == "pre" and self.shell_text is not None:
            for line in "".join(self.shell_text).splitlines():
                command = _COMMENT.sub("", line)
                if _PLACEHOLDER.search(command):
                    self.findings.append(
                        f"placeholder in a shell command: {line.strip()[:80]!r}"
                    )
            self.shell_text = None
        if tag in _CELLS and self.cells:
            text = "".join(self.cells.pop())
            if _COMMAND.search(text) and any(c in text for c in "\u201c\u201d"):
                self.findings.append(f"curly quote in a command: {text.strip()[:80]!r}")

    def handle_data(self, data: str) -> None:
        if self.shell_text is not None:
            self.shell_text.append(data)
        for cell in self.cells:
            cell.append(data)
        shown = repr(data.strip()[:80])
        if self.code_depth and any(c in data for c in TYPOGRAPHIC):
            self.findings.append(f"typographic character in code: {shown}")
        elif _MANGLED_OPTION.search(data):
            self.findings.append(f"a dash made of '--': {shown}")


def check_page(html: str) -> list[str]:
    """Return what a reader would copy wrongly from one page.

    Parameters
    ----------
    html : str
        The page's HTML.

    Returns
    -------
    list[str]
        One line per finding (empty when every command copies as written).
    """
    page = _Page()
    page.feed(html)
    page.close()
    return page.findings


def check_site(root: Path) -> list[str]:
    """Return the findings of every page under ``root`` (``<page>: <finding>``).

    Parameters
    ----------
    root : Path
        The built HTML (``docs/_build/html``).

    Returns
    -------
    list[str]
        One line per finding.
    """
    found = []
    for path in sorted(root.rglob("*.html")):
        if "_static" in path.parts or "_modules" in path.parts:
            continue
        for finding in check_page(path.read_text(encoding="utf-8")):
            found.append(f"{path.relative_to(root)}: {finding}")
    return found


def main(argv: list[str]) -> int:
    """Check the site built at ``argv[0]``; print the findings; 1 if any."""
    root = Path(argv[0] if argv else "docs/_build/html")
    pages = list(root.rglob("*.html"))
    if not pages:
        print(f"{root}: no built page to check", file=sys.stderr)
        return 1
    findings = check_site(root)
    for line in findings:
        print(line)
    print(f"{len(pages)} pages checked, {len(findings)} commands that would not copy")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
