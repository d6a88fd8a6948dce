"""Reference tables generated at build time, so the pages cannot drift.

Two directives:

``conf-group``
    The configuration reference of ``conf/``. Its argument is a path under
    ``conf/`` without ``.yaml`` (``strategy/feddyn``; ``config`` for
    ``conf/config.yaml``) or a group name alone (``topology``: every option file
    of the group, one section each). It renders the file's header comment, its
    Hydra ``defaults`` list and a table of every key (dotted, as written in an
    override), its default and the YAML comment documenting it. Files that list
    files of their own group in ``defaults`` (``conf/strategy/_base``) show the
    keys they inherit, marked with where each comes from. Values come from
    PyYAML, comments from a line scanner. An unknown path is a build error.

``cli-help``
    The ``--help`` text of a command-line entry point whose parser can be built
    without running it: ``:module:`` names the module, ``:function:`` a function
    returning an ``argparse.ArgumentParser``, or, for a function that parses
    ``argv`` itself, the text it prints for ``--help``.

The YAML files read are dependencies of the page: editing one rebuilds it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"

# Groups whose option files may list files of their own folder in `defaults`
# (inheritance): a strategy's `_base/common`, `_base/sgd`.
_GLOBAL = "_global_"
_SELF = "_self_"


class ConfRefError(Exception):
    """A ``conf-group`` argument names no file or group under ``conf/``."""


# --------------------------------------------------------------- line scanner
@dataclass
class Line:
    """One source line: its indentation, content and comment (``#`` excluded)."""

    indent: int
    content: str  # without the comment, stripped ('' for a comment-only line)
    comment: str | None  # the comment text after '#', one leading space removed
    comment_col: int  # column of '#' (-1: none)

    @property
    def blank(self) -> bool:  # noqa: D102
        return not self.content and self.comment is None

    @property
    def comment_only(self) -> bool:  # noqa: D102
        return not self.content and self.comment is not None


def _split_comment(text: str) -> tuple[str, int]:
    """Return the part before a YAML comment and the column of its '#' (-1)."""
    quote: str | None = None
    for i, char in enumerate(text):
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"" and (i == 0 or text[i - 1] in " \t:[{,-"):
            quote = char
        elif char == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i], i
    return text, -1


def scan_lines(text: str) -> list[Line]:
    """Split a YAML file into lines with their comments."""
    lines = []
    for raw in text.splitlines():
        before, col = _split_comment(raw)
        comment = None
        if col >= 0:
            comment = raw[col + 1 :]
            comment = comment[1:] if comment.startswith(" ") else comment
            comment = comment.rstrip()
        content = before.strip()
        indent = len(before) - len(before.lstrip()) if content else col
        lines.append(Line(indent, content, comment, col))
    return lines


def key_comments(lines: list[Line], header_end: int) -> dict[int, str]:
    """Return, per line number, the comment that documents what starts there.

    A line's comment is the comment lines directly above it (no blank line
    between) plus its own end-of-line comment and that comment's continuation
    lines (comment-only lines below it, indented deeper than the next content
    line). The file's header (lines before ``header_end``) documents no key.
    """
    comments: dict[int, str] = {}
    # The continuation lines, attached to the line whose end comment they extend.
    continued: set[int] = set()
    for number, line in enumerate(lines):
        if not line.content or line.comment is None:
            continue
        parts = [line.comment]
        follow = number + 1
        while follow < len(lines) and lines[follow].comment_only:
            nxt = next((n for n in lines[follow:] if n.content), Line(0, "x", None, -1))
            if lines[follow].comment_col <= nxt.indent:
                break
            parts.append(lines[follow].comment or "")
            continued.add(follow)
            follow += 1
        comments[number] = " ".join(p.strip() for p in parts if p.strip())
    for number, line in enumerate(lines):
        if not line.content:
            continue
        above: list[str] = []
        prev = number - 1
        while prev >= header_end and lines[prev].comment_only and prev not in continued:
            above.insert(0, (lines[prev].comment or "").strip())
            prev -= 1
        if above:
            own = comments.get(number)
            comments[number] = " ".join([*above, *([own] if own else [])])
    return comments


def header_of(lines: list[Line]) -> tuple[list[str], str | None, int]:
    """Return the header comment's lines, the ``@package`` and where it ends.

    The header is the comment block at the top of the file, up to the first
    blank or content line (a comment block followed by a blank line is the
    header too).
    """
    header: list[str] = []
    package = None
    end = 0
    for number, line in enumerate(lines):
        if line.comment_only and line.indent == 0:
            text = line.comment or ""
            match = re.match(r"\s*@package\s+(\S+)", text)
            if match:
                package = match.group(1)
            else:
                header.append(text)
            end = number + 1
            continue
        break
    return header, package, end


# ------------------------------------------------------------------- the file
@dataclass
class Entry:
    """One key of a file: its path there, its value and what documents it."""

    path: tuple[str, ...]
    value: Any  # what PyYAML reads
    text: str  # the value as written (a flow collection on one line included)
    comment: str
    leaf: bool = True


@dataclass
class Default:
    """One entry of a file's Hydra ``defaults`` list."""

    text: str  # as written: `dataset: digits`, `_base/common@strategy.inner`
    comment: str
    value: Any  # what PyYAML reads (a str or a one-key dict)


@dataclass
class ConfFile:
    """A parsed ``conf/`` file."""

    name: str  # path under conf/ without .yaml
    path: Path
    header: list[str]
    package: str | None
    defaults: list[Default]
    entries: list[Entry]
    data: Any = field(repr=False, default=None)

    @property
    def group(self) -> str:
        """Return the config group (``strategy``, ``strategy/_base``; '' at top)."""
        return self.name.rpartition("/")[0]

    @property
    def option(self) -> str:
        """Return the option name (``feddyn``)."""
        return self.name.rpartition("/")[2]

    @property
    def effective_package(self) -> str:
        """Return where the file's keys land ('' for the root)."""
        package = self.package
        if package is None:  # Hydra's default: the group's path
            package = self.group.replace("/", ".") if self.group else _GLOBAL
        return "" if package == _GLOBAL else package


def _value_text(source: str, node: yaml.Node, value: Any) -> str:
    if isinstance(node, yaml.ScalarNode):
        if node.style in ("'", '"'):
            return source[node.start_mark.index : node.end_mark.index]
        return node.value if node.value != "" else "null"
    text = source[node.start_mark.index : node.end_mark.index].strip()
    if "\n" in text or not text:
        text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
        text = text.removesuffix("\n...").strip()
    return text


def _scalar_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _default_text(value: Any) -> str:
    """Return a defaults entry as written (`dataset: digits`, `_base/sgd`)."""
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_scalar_text(v)}" for k, v in value.items())
    return _scalar_text(value)


def parse_file(name: str, conf_dir: Path = CONF_DIR) -> ConfFile:
    """Parse ``conf/<name>.yaml``: header, defaults, every key with its comment."""
    path = conf_dir / f"{name}.yaml"
    source = path.read_text(encoding="utf-8")
    lines = scan_lines(source)
    header, package, header_end = header_of(lines)
    comments = key_comments(lines, header_end)
    data = yaml.safe_load(source) or {}
    root = yaml.compose(source)
    defaults: list[Default] = []
    entries: list[Entry] = []

    def walk(node: yaml.MappingNode, values: dict, prefix: tuple[str, ...]) -> None:
        for key_node, value_node in node.value:
            key = str(key_node.value)
            value = values.get(key_node.value)
            if key == "defaults" and not prefix:
                for item, item_value in zip(value_node.value, value, strict=True):
                    defaults.append(
                        Default(
                            _default_text(item_value),
                            comments.get(item.start_mark.line, ""),
                            item_value,
                        )
                    )
                continue
            path = (*prefix, key)
            comment = comments.get(key_node.start_mark.line, "")
            is_block_map = (
                isinstance(value_node, yaml.MappingNode)
                and not value_node.flow_style
                and value_node.value
            )
            if is_block_map:
                if comment:
                    entries.append(Entry(path, value, "", comment, leaf=False))
                walk(value_node, value, path)
            else:
                text = _value_text(source, value_node, value)
                entries.append(Entry(path, value, text, comment))

    if isinstance(root, yaml.MappingNode):
        walk(root, data, ())
    return ConfFile(name, path, header, package, defaults, entries, data)


# ----------------------------------------------------------------- resolution
@dataclass
class Row:
    """One key of the table: full dotted key, default, where it comes from."""

    key: str
    text: str
    value: Any
    comment: str
    source: str  # the file it comes from (path under conf/ without .yaml)
    overrides: list[tuple[str, str]] = field(default_factory=list)  # (source, text)
    leaf: bool = True


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def inherited(conf: ConfFile, conf_dir: Path = CONF_DIR) -> list[tuple[ConfFile, str]]:
    """Return the files ``conf`` inherits (same-folder defaults) and their package.

    ``_base/common`` in ``conf/strategy/feddyn.yaml`` is
    ``conf/strategy/_base/common.yaml``; ``_base/common@strategy.inner`` puts its
    keys under ``strategy.inner``. Group selections (``dataset: digits``) and
    ``override`` entries are not inheritance: they are listed, not merged.
    """
    found = []
    for default in conf.defaults:
        if not isinstance(default.value, str) or default.value == _SELF:
            continue
        target, _, package = default.value.partition("@")
        if target.startswith("/"):
            continue
        name = f"{conf.group}/{target}" if conf.group else target
        if not (conf_dir / f"{name}.yaml").is_file():
            raise ConfRefError(
                f"{conf.name}: defaults entry {default.text!r} names no "
                f"conf/{name}.yaml"
            )
        base = parse_file(name, conf_dir)
        if package:
            package = _join(conf.effective_package, package)
        else:
            package = base.effective_package
        found.append((base, package))
    return found


def resolve(conf: ConfFile, conf_dir: Path = CONF_DIR) -> list[Row]:
    """Return the keys the file really has: its own, then those it inherits."""
    rows: dict[str, Row] = {}
    own_package = conf.effective_package
    for base, package in inherited(conf, conf_dir):
        for entry in base.entries:
            key = _join(package, *entry.path)
            rows[key] = Row(
                key, entry.text, entry.value, entry.comment, base.name, [], entry.leaf
            )
    own: dict[str, Row] = {}
    for entry in conf.entries:
        key = _join(own_package, *entry.path)
        row = Row(
            key, entry.text, entry.value, entry.comment, conf.name, [], entry.leaf
        )
        previous = rows.pop(key, None)
        if previous is not None:
            row.overrides.append((previous.source, previous.text))
            row.comment = row.comment or previous.comment
        own[key] = row
    return [*own.values(), *rows.values()]


def find(argument: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """Return the file names (under conf/, no .yaml) an argument stands for."""
    argument = argument.strip().strip("/").removesuffix(".yaml")
    if not argument or ".." in argument.split("/"):
        raise ConfRefError(f"conf-group: {argument!r} is not a path under conf/")
    if (conf_dir / f"{argument}.yaml").is_file():
        return [argument]
    folder = conf_dir / argument
    if folder.is_dir():
        names = sorted(p.stem for p in folder.glob("*.yaml"))
        if names:
            return [f"{argument}/{n}" for n in names]
    groups = sorted(
        p.name for p in conf_dir.iterdir() if p.is_dir() and not p.name.startswith("_")
    )
    raise ConfRefError(
        f"conf-group: no conf/{argument}.yaml and no option files in "
        f"conf/{argument}/ (groups: {', '.join(groups)}; files: config)"
    )


def selection(conf: ConfFile) -> str | None:
    """Return the override that selects this option (``strategy=feddyn``)."""
    if not conf.group or conf.group.split("/")[0].startswith("_"):
        return None
    if "/_" in f"/{conf.group}":
        return None
    prefix = "+" if conf.group == "experiment" else ""
    return f"{prefix}{conf.group}={conf.option}"


# ------------------------------------------------------- pyproject run config
PYPROJECT = ROOT / "pyproject.toml"
RUN_CONFIG_TABLE = ("tool", "flwr", "app", "config")


def run_config_rows(pyproject: Path = PYPROJECT) -> list[tuple[str, Any, str]]:
    """Return ``[tool.flwr.app.config]``: (key, default, comment) per key.

    A key's comment is the comment block directly above it; a key right below
    another one without a comment of its own shares that key's comment.
    """
    import tomllib

    text = pyproject.read_text(encoding="utf-8")
    table: Any = tomllib.loads(text)
    for part in RUN_CONFIG_TABLE:
        table = table[part]
    header = "[" + ".".join(RUN_CONFIG_TABLE) + "]"
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == header)
    rows: list[tuple[str, Any, str]] = []
    block: list[str] = []
    previous = ""
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if stripped.startswith("["):
            break
        if stripped.startswith("#"):
            block.append(stripped[1:].strip())
            continue
        match = re.match(r"([A-Za-z0-9_-]+)\s*=", stripped)
        if match and match.group(1) in table:
            comment = " ".join(block) if block else previous
            rows.append((match.group(1), table[match.group(1)], comment))
            previous = comment
        else:
            previous = ""
        block = []
    return rows


def toml_text(value: Any) -> str:
    """Return a TOML scalar as written (`""`, `0`, `true`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace('"', '\\"') + '"'
    return str(value)


# -------------------------------------------------------------- the directive
def parameter_text(target: str, name: str) -> str | None:
    """Return what the docstring of ``target`` says of its parameter ``name``.

    ``target`` is a ``_target_`` (a class or a function, dotted); the text is
    its numpydoc ``Parameters`` entry, with literals in single backticks and
    cross-references as literals, or None when it documents no such entry.
    """
    from flwr_prox_strategies.core.docstrings import plain_roles, sections

    module, _, attribute = target.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    # A class's own docstring, then its bases' (the keywords it passes on); a
    # classmethod target's class.
    owner = getattr(obj, "__self__", None)
    candidates = [obj, *(getattr(obj, "__mro__", ())[1:]), owner]
    for candidate in candidates:
        body = sections(getattr(candidate, "__doc__", None))[1].get("Parameters", "")
        text = _entry(body, name)
        if text:
            text = re.sub(r":math:`([^`$]+)`", r"$\1$", plain_roles(text))
            return re.sub(r"``([^`]+)``", r"`\1`", text)
    return None


_NO_DEFAULT = object()


def python_default(target: str, name: str) -> Any:
    """Return the default of keyword ``name`` of ``target`` in Python.

    ``target`` is a ``_target_``; a class's keyword passed on through
    ``**kwargs`` is looked up in its bases' ``__init__``. Returns ``_NO_DEFAULT``
    when the target cannot be imported or has no such keyword with a default.
    """
    module, _, attribute = target.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError):
        return _NO_DEFAULT
    callables = (
        [klass.__init__ for klass in obj.__mro__] if isinstance(obj, type) else [obj]
    )
    for function in callables:
        try:
            parameter = inspect.signature(function).parameters.get(name)
        except (TypeError, ValueError):
            continue
        if parameter is not None:
            if parameter.default is inspect.Parameter.empty:
                return _NO_DEFAULT
            return parameter.default
    return _NO_DEFAULT


def differs_from_python(value: Any, default: Any) -> bool:
    """Whether a Hydra default differs from the Python one (interpolations do)."""
    if default is _NO_DEFAULT:
        return False
    if isinstance(value, str) and "${" in value:
        return True
    if isinstance(default, tuple):  # YAML has lists only
        default = list(default)
    if isinstance(default, bool) or isinstance(value, bool):
        return value is not default
    return bool(value != default)


def _entry(body: str, name: str) -> str | None:
    """Return the description of ``name`` in a numpydoc Parameters body."""
    lines = body.splitlines()
    for index, line in enumerate(lines):
        if line[:1].isspace() or not line.strip():
            continue
        names = [n.strip().lstrip("*") for n in line.split(" : ")[0].split(",")]
        if name in names:
            described = []
            for following in lines[index + 1 :]:
                if following.strip() and not following[:1].isspace():
                    break
                described.append(following.strip())
            text = " ".join(part for part in described if part)
            return text or None
    return None


def _setup_sphinx(app: Any) -> dict[str, Any]:
    from docutils import nodes
    from docutils.parsers.rst import directives
    from sphinx import addnodes
    from sphinx.errors import ExtensionError
    from sphinx.util.docutils import SphinxDirective

    def inline(text: str) -> list[nodes.Node]:
        """Text with `backticks` as literals and $...$ (a docstring's math) as math."""
        out: list[nodes.Node] = []
        for i, part in enumerate(re.split(r"`([^`]+)`", text)):
            if not part:
                continue
            if i % 2:
                out.append(nodes.literal(part, part))
                continue
            for j, piece in enumerate(re.split(r"\$([^$`]+)\$", part)):
                if piece:
                    out.append(nodes.math(piece, piece) if j % 2 else nodes.Text(piece))
        return out

    def paragraph(text: str) -> nodes.paragraph:
        para = nodes.paragraph()
        para += inline(text)
        return para

    def header_nodes(lines: list[str]) -> list[nodes.Node]:
        """Paragraphs; lines indented in the comment become a literal block."""
        out: list[nodes.Node] = []
        prose: list[str] = []
        code: list[str] = []

        def flush() -> None:
            if prose:
                out.append(paragraph(" ".join(s.strip() for s in prose)))
                prose.clear()
            if code:
                text = "\n".join(code)
                out.append(nodes.literal_block(text, text))
                code.clear()

        for line in lines:
            if line.startswith("  "):
                if prose:
                    flush()
                code.append(line[2:])
            elif not line.strip():
                flush()
            else:
                if code:
                    flush()
                prose.append(line)
        flush()
        return out

    def table(rows: list[Row], conf: ConfFile) -> nodes.table:
        targets = {
            r.key.removesuffix("._target_"): str(r.value)
            for r in rows
            if r.key.endswith("._target_") and isinstance(r.value, str)
        }
        with_source = any(r.source != conf.name or r.overrides for r in rows)
        headers = ["Key", "Default", *(["From"] if with_source else []), "Meaning"]
        widths = [26, 18, *([14] if with_source else []), 42]
        tbl = nodes.table(classes=["conf-table", "colwidths-given"])
        group = nodes.tgroup(cols=len(headers))
        tbl += group
        for width in widths:
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        hrow = nodes.row()
        for title in headers:
            hrow += nodes.entry("", nodes.paragraph(text=title))
        head += hrow
        body = nodes.tbody()
        group += body
        for row in rows:
            trow = nodes.row(ids=[nodes.make_id(f"conf-{conf.name}-{row.key}")])
            trow += nodes.entry(
                "", nodes.paragraph("", "", nodes.literal(row.key, row.key))
            )
            value = nodes.paragraph()
            parent, _, name = row.key.rpartition(".")
            if row.leaf:
                value += nodes.literal(row.text, row.text)
                target = targets.get(parent)
                default = python_default(target, name) if target else _NO_DEFAULT
                if differs_from_python(row.value, default):
                    # `${num_clients}` says where its value comes from; a
                    # literal that differs from Python's must say why.
                    interpolation = re.fullmatch(r"\$\{[^}]+\}", str(row.value))
                    if not row.comment and not interpolation:
                        raise ConfRefError(
                            f"conf/{row.source}.yaml: {row.key} defaults to "
                            f"{row.text} here and to {default!r} in Python: say "
                            "why in a comment above the key"
                        )
                    value += nodes.Text(" (Python: ")
                    python = repr(default)
                    value += nodes.literal(python, python)
                    value += nodes.Text(")")
            trow += nodes.entry("", value)
            if with_source:
                source = nodes.paragraph()
                if row.source == conf.name:
                    source += nodes.Text("this file")
                else:
                    source += nodes.literal(row.source, row.source)
                for where, text in row.overrides:
                    source += nodes.Text(" (overrides ")
                    source += nodes.literal(where, where)
                    source += nodes.Text("'s ")
                    source += nodes.literal(text, text)
                    source += nodes.Text(")")
                trow += nodes.entry("", source)
            meaning = paragraph(row.comment)
            if not row.comment and row.leaf and not name.startswith("_"):
                target = targets.get(parent)
                if target:
                    documented = parameter_text(target, name)
                    if documented:
                        meaning += inline(documented)
                        meaning += nodes.Text(" (")
                        meaning += target_xref(target)
                        meaning += nodes.Text(")")
                    else:
                        meaning += nodes.Text("Keyword argument ")
                        meaning += nodes.literal(name, name)
                        meaning += nodes.Text(" of ")
                        meaning += target_xref(target)
                        meaning += nodes.Text(".")
            trow += nodes.entry("", meaning)
            body += trow
        return tbl

    def target_xref(target: str) -> nodes.Node:
        """Link to the API page of a `_target_` (plain text if not documented)."""
        short = target.rpartition(".")[2]
        xref = addnodes.pending_xref(
            "",
            refdomain="py",
            reftype="obj",
            reftarget=target,
            refexplicit=False,
            refwarn=False,
            confref_optional=True,
        )
        xref += nodes.literal(short, short)
        return xref

    class ConfGroup(SphinxDirective):
        """``conf-group PATH``: the keys, defaults and comments of conf/PATH."""

        required_arguments = 1
        optional_arguments = 0
        has_content = False
        option_spec: ClassVar[dict[str, Any]] = {"no-header": directives.flag}

        def file_nodes(self, name: str) -> list[nodes.Node]:
            conf = parse_file(name)
            self.env.note_dependency(str(conf.path))
            for base, _ in inherited(conf):
                self.env.note_dependency(str(base.path))
            out: list[nodes.Node] = []
            if "no-header" not in self.options:
                out += header_nodes(conf.header)
            select = selection(conf)
            facts = nodes.paragraph()
            if select:
                facts += nodes.Text("Select with ")
                facts += nodes.literal(select, select)
                facts += nodes.Text(". ")
            facts += nodes.Text("File: ")
            rel = f"conf/{name}.yaml"
            facts += nodes.literal(rel, rel)
            facts += nodes.Text(".")
            out.append(facts)
            if conf.defaults:
                out.append(paragraph("Its `defaults` list:"))
                items = nodes.bullet_list()
                for default in conf.defaults:
                    item = nodes.paragraph()
                    item += nodes.literal(default.text, default.text)
                    if default.comment:
                        item += nodes.Text(": ")
                        item += inline(default.comment)
                    items += nodes.list_item("", item)
                out.append(items)
            rows = resolve(conf)
            if rows:
                built = table(rows, conf)
                if "(Python: " in built.astext():
                    out.append(
                        paragraph(
                            "Where the Hydra default is not the Python default, "
                            "the Python one follows in brackets; the Meaning "
                            "column says why, or the default is another key's "
                            "value (`${...}`) so that one setting drives both."
                        )
                    )
                out.append(built)
            return out

        def run(self) -> list[nodes.Node]:
            try:
                names = find(self.arguments[0])
                if (
                    len(names) == 1
                    and (CONF_DIR / f"{self.arguments[0]}.yaml").is_file()
                ):
                    return self.file_nodes(names[0])
                sections: list[nodes.Node] = []
                for name in names:
                    conf_title = selection(parse_file(name)) or name
                    section = nodes.section(ids=[nodes.make_id(f"conf-{name}")])
                    section += nodes.title(
                        conf_title, "", nodes.literal(conf_title, conf_title)
                    )
                    section += self.file_nodes(name)
                    sections.append(section)
                return sections
            except (ConfRefError, OSError, yaml.YAMLError) as err:
                location = self.get_location()
                raise ExtensionError(f"{location}: {err}", modname=__name__) from err

    class CliHelp(SphinxDirective):
        """``cli-help``: the ``--help`` text of an entry point, as a literal block."""

        required_arguments = 0
        has_content = False
        option_spec: ClassVar[dict[str, Any]] = {
            "module": directives.unchanged_required,
            "function": directives.unchanged_required,
        }

        def run(self) -> list[nodes.Node]:
            try:
                text = cli_help(self.options["module"], self.options["function"])
            except Exception as err:
                raise ExtensionError(
                    f"{self.get_location()}: cli-help: {err!r}", modname=__name__
                ) from err
            module = importlib.import_module(self.options["module"])
            if getattr(module, "__file__", None):
                self.env.note_dependency(str(module.__file__))
            block = nodes.literal_block(text, text, language="text")
            return [block]

    class RunConfig(SphinxDirective):
        """``run-config``: the keys of pyproject's ``[tool.flwr.app.config]``."""

        has_content = False

        def run(self) -> list[nodes.Node]:
            self.env.note_dependency(str(PYPROJECT))
            tbl = nodes.table(classes=["conf-table", "colwidths-given"])
            group = nodes.tgroup(cols=3)
            tbl += group
            for width in (20, 15, 65):
                group += nodes.colspec(colwidth=width)
            head = nodes.thead()
            group += head
            hrow = nodes.row()
            for title in ("Key", "Default", "Meaning"):
                hrow += nodes.entry("", nodes.paragraph(text=title))
            head += hrow
            body = nodes.tbody()
            group += body
            for key, value, comment in run_config_rows():
                trow = nodes.row(ids=[nodes.make_id(f"run-config-{key}")])
                trow += nodes.entry(
                    "", nodes.paragraph("", "", nodes.literal(key, key))
                )
                text = toml_text(value)
                trow += nodes.entry(
                    "", nodes.paragraph("", "", nodes.literal(text, text))
                )
                trow += nodes.entry("", paragraph(comment))
                body += trow
            return [tbl]

    def optional_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
        """Leave a `_target_` the API pages do not document as plain text."""
        if node.get("confref_optional"):
            return contnode
        return None

    app.connect("missing-reference", optional_reference, priority=900)
    app.add_directive("run-config", RunConfig)
    app.add_directive("conf-group", ConfGroup)
    app.add_directive("cli-help", CliHelp)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}


def cli_help(module_name: str, function: str) -> str:
    """Return the ``--help`` text of ``module.function``.

    ``function`` returns an ``argparse.ArgumentParser`` (its ``format_help()``),
    or takes ``argv`` and parses it (its output for ``["--help"]``).
    """
    import argparse
    import os

    module = importlib.import_module(module_name)
    func = getattr(module, function)
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal: fix the width
    try:
        if not inspect.signature(func).parameters:
            parser = func()
            if not isinstance(parser, argparse.ArgumentParser):
                raise TypeError(f"{module_name}.{function}() returned {parser!r}")
            return parser.format_help()
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            func(["--help"])
        return out.getvalue()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def setup(app: Any) -> dict[str, Any]:
    """Register the directives."""
    return _setup_sphinx(app)
