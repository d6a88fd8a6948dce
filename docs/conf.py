"""Sphinx configuration of the flwr-prox-strategies documentation.

Build: ``python -m sphinx -W -n -b html docs docs/_build/html`` (warnings are
errors, cross-references are checked). Flower's own documentation uses the same
stack: Sphinx, MyST Markdown, autodoc/autosummary with numpydoc-style docstrings.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

import flwr_prox_strategies  # noqa: E402

project = "flwr-prox-strategies"
author = "The flwr-prox-strategies authors"
copyright = "2026, the flwr-prox-strategies authors"
release = flwr_prox_strategies.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    # MathJax served with the site, so equations render without a network.
    "sphinx-mathjax-offline",
    "confref",
    "packagemap",
    "attrtable",
    "repofiles",
]

# Commands must copy as written: no "--" turned into an en dash, no curly quotes
# (the configuration tables render YAML comments as text, not code).
smartquotes = False

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

# Docstrings are numpydoc-style; napoleon reads them.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_attr_annotations = True
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}

# Cross-references to this package are checked (nitpicky); those into other
# projects (Flower, torch, numpy, ...) are not: their inventories need a network.
nitpicky = True
_EXTERNAL_MODULES = [
    "flwr",
    "torch",
    "numpy",
    "np",
    "opacus",
    "cvxpy",
    "hydra",
    "omegaconf",
    "datasets",
    "lightning",
    "pytorch_lightning",
    "transformers",
    "collections",
    "typing",
    "pathlib",
    "logging",
    "dataclasses",
    "enum",
    "abc",
    "concurrent",
    "os",
    "json",
    "numpy.typing",
    "npt",
]
_BUILTIN_AND_TYPING = [
    "int",
    "float",
    "str",
    "bool",
    "bytes",
    "None",
    "dict",
    "list",
    "tuple",
    "set",
    "object",
    "type",
    "Any",
    "Callable",
    "Iterable",
    "Iterator",
    "Sequence",
    "Mapping",
    "Path",
    "NDArray",
    "ArrayLike",
    "Literal",
    "Optional",
    "Union",
    "Exception",
    "ValueError",
    "TypeError",
    "RuntimeError",
    "KeyError",
    "FileNotFoundError",
    "optional",
    "callable",
    "array_like",
    "ndarray",
    "default",
    "of",
    "or",
]
_FLOWER_AND_TORCH_CLASSES = [
    "ArrayRecord",
    "MetricRecord",
    "ConfigRecord",
    "RecordDict",
    "Message",
    "Context",
    "Grid",
    "Result",
    "Strategy",
    "ClientApp",
    "ServerApp",
    "NumPyClient",
    "Module",
    "DataLoader",
    "Tensor",
    "Optimizer",
    "Parameter",
    "Generator",
    "Array",
    "NDArrays",
    "UserConfig",
    "Scalar",
    "ConfigRecordValues",
    "MetricRecordValues",
    "DictConfig",
]


def _any_of(names: list[str]) -> str:
    return "(" + "|".join(name.replace(".", r"\.") for name in names) + ")"


nitpick_ignore_regex = [
    (r"py:.*", _any_of(_EXTERNAL_MODULES) + r"(\..*)?"),
    (r"py:.*", _any_of(_BUILTIN_AND_TYPING)),
    # numpydoc type fields: "float | None (default: None)" give a "default: None" token.
    (r"py:class", r"default:? .+"),
    (r"py:class", _any_of(_FLOWER_AND_TORCH_CLASSES)),
]

html_theme = "furo"
html_title = "flwr-prox-strategies"
html_static_path = ["_static"]
html_css_files = ["tables.css"]
copybutton_prompt_text = r"\$ "
copybutton_prompt_is_regexp = True


def _public_bases(app, name, obj, options, bases):
    """Leave internal bases out of "Bases:" (their members are shown on the class).

    Internal means the pack's own classes that are neither exported by the
    package nor by ``flwr_prox_strategies.extend``: the mixins of ``core`` and
    shared bases such as P-FedAvg's two servers' ``GraphServers``.
    """
    import flwr_prox_strategies
    import flwr_prox_strategies.extend

    public = {
        *flwr_prox_strategies.__all__,
        *flwr_prox_strategies.extend.__all__,
    }
    bases[:] = [
        base
        for base in bases
        if not getattr(base, "__module__", "").startswith("flwr_prox_strategies.")
        or (
            not base.__module__.startswith("flwr_prox_strategies.core.")
            and base.__name__ in public
        )
    ]


def setup(app):
    """Connect the handlers above."""
    app.connect("autodoc-process-bases", _public_bases)
