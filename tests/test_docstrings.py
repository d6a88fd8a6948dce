"""The public API documents itself: what the API reference is generated from.

For every public name of ``flwr_prox_strategies``, ``flwr_prox_strategies.extend``
and ``flwr_prox_strategies.task``: a docstring (for a constant, the ``#:``
comment or string literal that autodoc reads in the namespace module), and for a
class or function every parameter of its signature named in the docstring's
numpydoc ``Parameters`` section (a class's ``__init__``, without ``self``,
``*args`` and ``**kwargs``), and a ``Returns`` section for a function that
returns something. No docstring or comment of the package cites internal
documents instead of the papers.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

import flwr_prox_strategies

PACKAGE = Path(flwr_prox_strategies.__file__).resolve().parent
NAMESPACES = (
    "flwr_prox_strategies",
    "flwr_prox_strategies.extend",
    "flwr_prox_strategies.testing",
    "flwr_prox_strategies.tracking",
    "flwr_prox_strategies.integrations.lightning",
    "flwr_prox_strategies.integrations.huggingface",
    "flwr_prox_strategies.task",
)
PUBLIC = [
    (namespace, name)
    for namespace in NAMESPACES
    for name in importlib.import_module(namespace).__all__
]
#: A numpydoc section header: a title, then a line of dashes.
HEADER = re.compile(r"^([A-Z][A-Za-z ]+)\n-+$", re.MULTILINE)
#: Citations of internal documents (the random ``seed`` parameter is fine).
INTERNAL = re.compile(r"seed 0\d\d|the seed's|issue \d", re.IGNORECASE)


def documented(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj)


def section(doc: str, title: str) -> str | None:
    """Return the body of the numpydoc section ``title``, or None."""
    text = inspect.cleandoc(doc)
    headers = list(HEADER.finditer(text))
    for header, following in zip(headers, [*headers[1:], None], strict=False):
        if header.group(1) == title:
            end = following.start() if following is not None else len(text)
            return text[header.end() : end]
    return None


def documented_parameters(doc: str) -> set[str]:
    """Names in the Parameters section (``a, b : type`` lines, ``*args``)."""
    body = section(doc, "Parameters") or ""
    names: set[str] = set()
    for line in body.splitlines():
        if line and not line[0].isspace():
            head = line.split(" : ")[0]
            names.update(part.strip().lstrip("*") for part in head.split(","))
    return names


def signature_parameters(obj: object) -> list[str]:
    """The parameters a caller gives: ``__init__``'s for a class, no *args/**kw."""
    try:
        signature = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # an exception class without __init__
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
    ]


def own_docstring(obj: object) -> str:
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__")
        return doc if isinstance(doc, str) else ""
    return getattr(obj, "__doc__", None) or ""


def attribute_docs(module_name: str) -> dict[str, str]:
    """Module-level ``#:`` comments and string literals after assignments."""
    module = importlib.import_module(module_name)
    source = Path(module.__file__ or "").read_text(encoding="utf-8")
    lines = source.splitlines()
    docs: dict[str, str] = {}
    body = ast.parse(source).body
    for node, following in zip(body, [*body[1:], None], strict=True):
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        comment = []
        row = node.lineno - 2
        while row >= 0 and lines[row].lstrip().startswith("#:"):
            comment.insert(0, lines[row].lstrip()[2:].strip())
            row -= 1
        text = " ".join(comment)
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            text = following.value.value
        for name in names:
            docs[name] = text
    return docs


def test_the_three_namespaces_export_something() -> None:
    assert len(PUBLIC) > 60


@pytest.mark.parametrize(("namespace", "name"), PUBLIC, ids=lambda v: str(v))
def test_every_public_name_has_a_docstring(namespace: str, name: str) -> None:
    obj = getattr(importlib.import_module(namespace), name)
    if documented(obj):
        doc = own_docstring(obj)
    else:  # a constant: autodoc reads the comment in the namespace module
        doc = attribute_docs(namespace).get(name, "")
    assert len(doc.strip()) > 20, f"{namespace}.{name} has no docstring"
    assert not INTERNAL.search(doc), f"{namespace}.{name} cites an internal document"


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        (ns, n)
        for ns, n in PUBLIC
        if documented(getattr(importlib.import_module(ns), n))
    ],
    ids=lambda v: str(v),
)
def test_every_parameter_is_documented(namespace: str, name: str) -> None:
    obj = getattr(importlib.import_module(namespace), name)
    wanted = signature_parameters(obj)
    have = documented_parameters(own_docstring(obj))
    missing = [p for p in wanted if p not in have]
    assert not missing, (
        f"{namespace}.{name}: parameters {missing} are not in its docstring's "
        "Parameters section"
    )


@pytest.mark.parametrize(
    ("namespace", "name"),
    [
        (ns, n)
        for ns, n in PUBLIC
        if inspect.isfunction(getattr(importlib.import_module(ns), n))
    ],
    ids=lambda v: str(v),
)
def test_every_function_documents_what_it_returns(namespace: str, name: str) -> None:
    obj = getattr(importlib.import_module(namespace), name)
    if inspect.signature(obj).return_annotation in (None, "None"):
        return
    assert section(own_docstring(obj), "Returns"), f"{namespace}.{name}: no Returns"


def test_the_parser_reads_numpydoc_sections() -> None:
    doc = """Summary.

    Parameters
    ----------
    a, b : int (default: 0)
        Two numbers.
    *args, **kwargs
        The rest.

    Returns
    -------
    int
        Their sum.
    """
    assert documented_parameters(doc) == {"a", "b", "args", "kwargs"}
    assert "Their sum." in (section(doc, "Returns") or "")
    assert section(doc, "Raises") is None


def test_the_api_reference_has_an_entry_for_every_public_name() -> None:
    """docs/reference/api/ documents each name under its namespace."""
    folder = PACKAGE.parent / "docs" / "reference" / "api"
    page = "\n".join(p.read_text() for p in sorted(folder.glob("*.md")))
    entries: set[tuple[str, str]] = set()
    module = ""
    for line in page.splitlines():
        if match := re.match(r"\.\. currentmodule:: (\S+)", line.strip()):
            module = match.group(1)
        elif match := re.match(
            r"\.\. (?:auto(?:class|function|exception|data)|py:\w+):: (\w+)",
            line.strip(),
        ):
            entries.add((module, match.group(1)))
    missing = [f"{ns}.{name}" for ns, name in PUBLIC if (ns, name) not in entries]
    assert not missing, f"docs/reference/api/ has no entry for {missing}"


def package_texts() -> list[tuple[str, int, str]]:
    """Every docstring and comment of the package: (file, line, text)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                found.append((where, node.lineno, node.value.value))
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found.append((where, token.start[0], token.string))
    return found


def test_no_docstring_or_comment_cites_internal_documents() -> None:
    cited = [
        f"{where}:{line}: {INTERNAL.search(text).group(0)!r}"  # type: ignore[union-attr]
        for where, line, text in package_texts()
        if INTERNAL.search(text)
    ]
    assert not cited, "cite the papers instead:\n" + "\n".join(cited)


#: A numpydoc entry line: ``name``, ``a, b`` or ``*args``, then `` : type``.
ENTRY = re.compile(r"^\*{0,2}[A-Za-z_]\w*(, \*{0,2}[A-Za-z_]\w*)*( : .+)?$")


@pytest.mark.parametrize(("namespace", "name"), PUBLIC)
def test_every_section_entry_is_a_name(namespace: str, name: str) -> None:
    """A paragraph left after a Parameters or Attributes section renders as
    bogus entries (its first line in bold, as if it named an attribute)."""
    obj = getattr(importlib.import_module(namespace), name)
    if not documented(obj) or not obj.__doc__:
        return
    for title in ("Parameters", "Attributes", "Other Parameters"):
        body = section(obj.__doc__, title) or ""
        bogus = [
            line
            for line in body.splitlines()
            if line and not line[0].isspace() and not ENTRY.match(line)
        ]
        assert not bogus, f"{namespace}.{name}: {title} entries {bogus}"
