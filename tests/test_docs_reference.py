"""The reference pages (docs/reference/) say what the code does.

* The ``conf-group`` directive's tables (docs/_ext/confref.py) hold every key of
  the YAML files with the default PyYAML reads, and a strategy's table the keys
  Hydra really composes for it (``_base`` inheritance included).
* Every wire key of the code is on the wire-protocol page, and so is every key
  one round of every strategy really puts on the wire (config, records, metrics,
  ``context.state``), each in its algorithm's section when it is the algorithm's.
* Every environment variable the package reads is on the environment page;
  every ``python -m`` entry point and each of its options on the CLI page.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from .helpers import load_script

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "flwr_prox_strategies"
CONF = REPO / "conf"
PAGES = REPO / "docs" / "reference"


def docs_extension(name: str):
    """Import the docs site's extension ``docs/_ext/<name>.py``."""
    return load_script(REPO / "docs" / "_ext" / f"{name}.py")


@pytest.fixture(scope="module")
def confref():
    return docs_extension("confref")


def page(name: str) -> str:
    return (PAGES / name).read_text(encoding="utf-8")


def flatten(data, prefix=()) -> dict[str, object]:
    """Dotted key -> value of every leaf (a block or flow mapping is walked)."""
    out: dict[str, object] = {}
    for key, value in data.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[".".join(path)] = value
    return out


def all_conf_files() -> list[str]:
    return sorted(
        str(p.relative_to(CONF).with_suffix("")) for p in CONF.rglob("*.yaml")
    )


# ------------------------------------------------------------ configuration
@pytest.mark.parametrize("name", all_conf_files())
def test_every_key_of_every_file_is_in_its_table_with_its_default(
    confref, name
) -> None:
    conf = confref.parse_file(name)
    data = yaml.safe_load((CONF / f"{name}.yaml").read_text()) or {}
    data.pop("defaults", None)
    package = conf.effective_package
    expected = {
        (f"{package}.{k}" if package else k): v for k, v in flatten(data).items()
    }
    rows = [r for r in confref.resolve(conf) if r.leaf and r.source == name]
    got: dict[str, object] = {}
    for row in rows:
        value = row.value
        if isinstance(value, dict) and value:  # a flow mapping shown on one line
            got.update(flatten(value, (row.key,)))
        else:
            got[row.key] = value
        # What the table shows reads back as the value.
        assert yaml.safe_load(row.text) == value, (row.key, row.text)
    assert got == expected


def test_comments_are_attached_to_their_keys(confref) -> None:
    config = {r.key: r for r in confref.resolve(confref.parse_file("config"))}
    assert config["num_clients"].comment.startswith("SuperNodes at the start")
    # A trailing comment continued on the lines below, at its own column.
    assert config["num_partitions"].comment.endswith(
        "leaves partitions for clients that join later"
    )
    assert config["train.local_epochs"].comment == ""
    assert config["train"].comment == "local training, shared by every client"
    assert not config["train"].leaf
    fedavg = {r.key: r for r in confref.resolve(confref.parse_file("strategy/fedavg"))}
    # Comment lines above a key belong to it.
    assert fedavg["strategy.mu"].comment.startswith("FedAvg has no proximal term.")
    digits = {r.key: r for r in confref.resolve(confref.parse_file("dataset/digits"))}
    assert digits["dataset.normalize"].comment.startswith("Inputs are standardised")
    assert digits["dataset.stats.standard"].text == "{mean: 0.3054, std: 0.3761}"
    header = confref.parse_file("deploy/peers")
    assert header.package == "_global_"
    assert header.header[0].startswith("This ServerApp is ONE parameter server")


def test_the_defaults_list_is_read_with_its_comments(confref) -> None:
    config = confref.parse_file("config")
    texts = [d.text for d in config.defaults]
    assert texts[:4] == [
        "dataset: digits",
        "partition: dirichlet",
        "model: mlp",
        "strategy: fedprox",
    ]
    assert texts[-1] == "_self_"
    topology = next(d for d in config.defaults if d.text.startswith("topology"))
    assert "P-FedAvg" in topology.comment


@pytest.mark.parametrize(
    "strategy", sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))
)
def test_a_strategy_table_has_the_keys_hydra_composes(confref, strategy) -> None:
    """The ``_base`` inheritance resolved by the directive is Hydra's."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[f"strategy={strategy}"])
    composed = OmegaConf.to_container(cfg, resolve=False)
    expected = {
        k: v
        for k, v in flatten(composed).items()
        if k.startswith(("strategy.", "client."))
    }
    rows = confref.resolve(confref.parse_file(f"strategy/{strategy}"))
    got = {r.key: r.value for r in rows if r.leaf}
    assert got == expected
    sources = {r.source for r in rows}
    assert sources <= {
        f"strategy/{strategy}",
        "strategy/_base/common",
        "strategy/_base/sgd",
    }


def test_an_unknown_group_is_an_error_naming_the_path(confref) -> None:
    with pytest.raises(confref.ConfRefError, match="conf/strategy/nosuch"):
        confref.find("strategy/nosuch")
    with pytest.raises(confref.ConfRefError, match="conf/nosuchgroup"):
        confref.find("nosuchgroup")
    assert confref.find("config") == ["config"]
    assert confref.find("topology") == [
        f"topology/{p.stem}" for p in sorted((CONF / "topology").glob("*.yaml"))
    ]


def test_the_configuration_page_shows_every_group(confref) -> None:
    text = page("configuration.md")
    shown = set(re.findall(r"```\{conf-group\} (\S+)", text))
    groups = {
        p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_")
    }
    # conf/hydra/ sets Hydra's own logging (Flower's lines printed once), no
    # key, and holds the pack's sweeper, shown with the launcher settings.
    assert shown == (groups - {"hydra"}) | {"config", "hydra/sweeper/search"}


def test_the_run_config_table_is_pyprojects(confref) -> None:
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"][
        "app"
    ]["config"]
    rows = confref.run_config_rows()
    assert {key: value for key, value, _ in rows} == declared
    assert all(comment for _, _, comment in rows)


# ------------------------------------------------------------ wire protocol
def string_constants(path: Path) -> dict[str, str]:
    """Module-level ``NAME = "value"`` constants of one file."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            found[node.targets[0].id] = node.value.value
    return found


KEBAB = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")
# Where the wire keys and context.state names are defined.
WIRE_FILES = [
    PACKAGE / "core" / "transport" / "keys.py",
    PACKAGE / "core" / "client" / "rule.py",
    PACKAGE / "core" / "client" / "client.py",
    PACKAGE / "core" / "contract" / "ledger.py",
    PACKAGE / "core" / "privacy" / "uploads.py",
    PACKAGE / "core" / "client" / "dp.py",
    PACKAGE / "core" / "client" / "state.py",
    *sorted((PACKAGE / "algorithms").glob("*.py")),
]
# String constants of those files that are not keys of messages or state.
NOT_WIRE = {
    "NUMPY_STYPE",  # an ArrayRecord's stype
    "SERVICE",
    "TOKEN_METADATA",  # P-FedAvg's server-to-server gRPC (both ends the pack's)
}


def wire_constants() -> dict[str, str]:
    found = {}
    for path in WIRE_FILES:
        for name, value in string_constants(path).items():
            if name in NOT_WIRE:
                continue
            value = value.removeprefix("scalar:").rstrip(":")
            if KEBAB.fullmatch(value) or name.endswith("_REASON"):
                found[f"{path.stem}.{name}"] = value
    return found


def test_the_wire_constants_are_found() -> None:
    values = set(wire_constants().values())
    # A few of each kind: config, record, metric, state, commit, reason.
    assert {
        "proximal-mu",
        "feddyn-alpha",
        "control-delta",
        "client-key",
        "accepted-keys",
        "scaffold-control",
        "dp-epsilon-total",
        "PrivacyBudgetExhausted",
        "pending",
    } <= values
    assert len(values) >= 70


def test_every_wire_constant_is_on_the_wire_protocol_page() -> None:
    text = page("wire-protocol.md")
    missing = {
        name: value
        for name, value in wire_constants().items()
        if value not in {"arrays", "config", "metrics"}
        and f"`{value}" not in text
        and f"`scalar:{value}" not in text
    }
    assert not missing, f"wire keys missing from wire-protocol.md: {missing}"


def sections(text: str) -> dict[str, str]:
    """Markdown ``###`` section title -> its text."""
    out: dict[str, str] = {}
    title = ""
    for line in text.splitlines():
        if line.startswith("### "):
            title = line[4:].strip()
        out[title] = out.get(title, "") + line + "\n"
    return out


N = 3


def capture(strategy, client_cls, client_kwargs=None, rounds=2):
    """Run ``rounds`` rounds in this process; return what crossed the wire."""
    import torch
    from flwr.app import ArrayRecord
    from torch.utils.data import DataLoader, TensorDataset

    from flwr_prox_strategies import to_client_app
    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

    def loader(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(12, 4, generator=g)
        return DataLoader(
            TensorDataset(x, torch.randint(0, 3, (12,), generator=g)), batch_size=4
        )

    def client_fn(context):
        pid = int(context.node_config["partition-id"])
        torch.manual_seed(0)
        return client_cls(
            torch.nn.Linear(4, 3),
            loader(pid),
            loader(pid),
            learning_rate=0.05,
            **(client_kwargs or {}),
        )

    app = to_client_app(client_fn)
    seen: dict[str, set[str]] = defaultdict(set)
    errors: list[str] = []

    def recorded(message, context):
        kind = message.metadata.message_type.split(".")[0]
        content = message.content
        for record in content.config_records.values():
            seen["config"] |= set(record.keys())
        seen["arrays"] |= set(content.array_records) - {"arrays"}
        reply = app(message, context)
        if reply.has_error():
            errors.append(reply.error.reason)
            return reply
        seen["arrays"] |= set(reply.content.array_records) - {"arrays"}
        for name, record in reply.content.metric_records.items():
            if kind == "query":  # the node's own node_config entries
                seen["records"].add(name)
            else:
                seen["metrics"] |= set(record.keys())
        seen["state"] |= set(context.state.array_records)
        return reply

    grid = InProcessGrid(recorded, num_nodes=N)
    torch.manual_seed(0)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(torch.nn.Linear(4, 3).state_dict()),
        num_rounds=rounds,
    )
    assert not errors, errors
    return seen


def wire_cases():
    import flwr_prox_strategies as fps

    # Federated evaluation only where an algorithm adds to it (APFL) and once.
    quiet = {"min_available_nodes": N, "fraction_evaluate": 0.0}
    base = {**quiet, "min_train_nodes": N}
    sampled = quiet
    evaluated = {
        "min_available_nodes": N,
        "min_train_nodes": N,
        "min_evaluate_nodes": N,
    }
    return {
        # case: (section of the page, strategy, client, client kwargs)
        "fedavg": ("FedAvg", lambda: fps.FedAvg(**evaluated), fps.FedAvgClient, {}),
        "fedavg-options": (
            "FedAvg",
            lambda: fps.FedAvg(
                local_epochs=2,
                lr_decay=0.9,
                monitor_dissimilarity=True,
                drop_percent=0.5,
                **base,
            ),
            fps.FedAvgClient,
            {},
        ),
        "fedprox": (
            "FedProx",
            lambda: fps.FedProx(mu=0.1, local_epochs=3, **base),
            fps.FedProxClient,
            {"gamma": 0.99},
        ),
        "feddyn": (
            "FedDyn",
            lambda: fps.FedDyn(
                alpha=0.1, num_clients=N, track_all_clients=True, **base
            ),
            fps.FedDynClient,
            {},
        ),
        "scaffold": (
            "SCAFFOLD",
            lambda: fps.Scaffold(num_clients=N, **base),
            fps.ScaffoldClient,
            {},
        ),
        "feddc": (
            "FedDC",
            lambda: fps.FedDC(num_clients=N, **base),
            fps.FedDCClient,
            {},
        ),
        "feddc-paper": (
            "FedDC",
            lambda: fps.FedDC(num_clients=N, correction="paper", **base),
            fps.FedDCClient,
            {},
        ),
        "apfl": (
            "APFL",
            lambda: fps.APFL(
                lr_schedule="decay",
                strong_convexity=1.0,
                adaptive_alpha=True,
                **evaluated,
            ),
            fps.APFLClient,
            {},
        ),
        "fedepm": (
            "FedEPM",
            lambda: fps.FedEPM(num_clients=N, rho=1.0, **sampled),
            fps.FedEPMClient,
            {},
        ),
        "sfedprox": (
            "SFedAvg and SFedProx",
            lambda: fps.SFedProx(num_clients=N, rho=1.0, **sampled),
            fps.SFedProxClient,
            {},
        ),
        "pfedavg": (
            "P-FedAvg",
            lambda: fps.PFedAvg(
                servers=2,
                topology="ring",
                inner=lambda: fps.FedAvg(
                    min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0
                ),
            ),
            fps.FedAvgClient,
            {},
        ),
    }


@pytest.fixture(scope="module")
def wire():
    return {
        case: (section, capture(make(), client, kwargs))
        for case, (section, make, client, kwargs) in wire_cases().items()
    }


# The two-phase commit's keys (its own section, shared by the stateful strategies).
COMMIT = {
    "run-tag",
    "accepted-round",
    "state-round",
    "scalar:pending-round",
    "scalar:committed-round",
}


def documented(key: str, text: str) -> bool:
    """`key` (or `<prefix>-*` covering it) is written as code on the page."""
    if f"`{key}`" in text or f"`scalar:{key}`" in text:
        return True
    if key.startswith("pending:"):
        return "`pending:<name>`" in text
    if key.startswith("scalar:"):
        return f"`{key}`" in text
    return any(
        key.startswith(prefix + "-") for prefix in re.findall(r"`([a-z-]+)-\*`", text)
    )


@pytest.mark.long
def test_every_key_on_the_wire_is_on_the_page(wire) -> None:
    text = page("wire-protocol.md")
    by_section = sections(text)
    common = "".join(
        body
        for title, body in by_section.items()
        if title
        in {
            "Train config (server → client)",
            "Train reply metrics (client → server)",
            "Evaluate",
            "",
        }
    )
    baseline = set().union(*wire["fedavg"][1].values())
    for case, (section, seen) in wire.items():
        assert section in by_section, f"no section '### {section}'"
        own = by_section[section] + common
        for kind, keys in seen.items():
            for key in sorted(keys):
                assert documented(key, text), f"{case}: {kind} '{key}' not on the page"
                if key in baseline or key.startswith("pending:") or key in COMMIT:
                    continue  # every strategy's, or the two-phase commit's
                assert documented(key, own), (
                    f"{case}: {kind} '{key}' is not in the '### {section}' section "
                    "(nor among the keys every strategy uses)"
                )


# ---------------------------------------------------------------- environment
def environment_variables() -> set[str]:
    """Every environment variable the package reads or sets."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        # As string literals: os.environ.get("X"), X_ENV = "X", env["X"] = ...
        found |= set(
            re.findall(r"[\"']((?:FLWR|RAY|XDG)_[A-Z_]+)[\"']", path.read_text())
        )
    return found


def test_every_environment_variable_is_on_the_page() -> None:
    variables = environment_variables()
    assert {
        "FLWR_PROX_DATA_DIR",
        "FLWR_PROX_CACHE_DIR",
        "FLWR_PROX_OUTPUT_ROOT",
        "FLWR_PROX_APP_DIR",
        "FLWR_PROX_ALLOWED_TARGETS",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION",
        "FLWR_HOME",
        "RAY_TMPDIR",
    } <= variables
    text = page("environment.md")
    missing = sorted(v for v in variables if f"`{v}`" not in text)
    assert not missing, f"not on environment.md: {missing}"


# ------------------------------------------------------------------------ CLI
def entry_modules() -> list[str]:
    """Every ``python -m`` entry point of the package."""
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if path.name == "__main__.py":
            modules.append(".".join(path.parent.relative_to(REPO).parts))
        elif 'if __name__ == "__main__":' in text:
            modules.append(".".join(path.with_suffix("").relative_to(REPO).parts))
    return modules


def test_every_entry_point_is_on_the_cli_page() -> None:
    import tomllib

    modules = entry_modules()
    assert "flwr_prox_strategies.experiment" in modules
    text = page("cli.md")
    for module in modules:
        assert f"`python -m {module}`" in text, module
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get(
        "scripts", {}
    )
    for script in scripts:
        assert f"`{script}`" in text, script


def test_every_option_of_the_parsers_is_explained(confref) -> None:
    """Each option of a parser-based entry point has a row of its own."""
    import argparse

    from flwr_prox_strategies.topology.__main__ import build_parser

    text = page("cli.md")
    parsers = {"topology": build_parser()}
    captured: dict[str, argparse.ArgumentParser] = {}
    original = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        captured["parser"] = self
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        from flwr_prox_strategies.pfedavg_deploy.launcher import parse_args

        with pytest.raises(SystemExit):
            parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    parsers["pfedavg_deploy"] = captured["parser"]
    for name, parser in parsers.items():
        section = text.split(f"## `python -m flwr_prox_strategies.{name}`")[1]
        section = section.split("\n## ")[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option in {"-h", "--help"}:
                    continue
                assert f"`{option}`" in section, f"{name}: {option} not explained"


def test_the_cli_help_is_the_parsers(confref) -> None:
    from flwr_prox_strategies.topology.__main__ import build_parser

    assert "--max-clients" in confref.cli_help(
        "flwr_prox_strategies.topology.__main__", "build_parser"
    )
    assert build_parser().prog == "python -m flwr_prox_strategies.topology"
    deploy = confref.cli_help(
        "flwr_prox_strategies.pfedavg_deploy.launcher", "parse_args"
    )
    assert deploy.startswith("usage: python -m flwr_prox_strategies.pfedavg_deploy")
    assert "--restart-after" in deploy


def test_the_weighting_table_matches_each_strategys_default() -> None:
    """The defaults page's weighting table names every strategy with its default."""
    import flwr_prox_strategies as pack
    from flwr_prox_strategies.algorithms import ALGORITHMS

    page = (REPO / "docs" / "reference" / "flower-differences.md").read_text()
    page = page.split("## Weighting of the replies")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| `([\w-]+)` \|", page, flags=re.MULTILINE)
    table = dict(rows)
    expected = {
        algorithm.strategy.__name__
        for algorithm in ALGORITHMS.values()
        if algorithm.client is not None
    }
    assert set(table) == expected
    for name, weighting in table.items():
        assert getattr(pack, name)().weighting == weighting, name


def test_every_pack_metric_key_is_documented() -> None:
    """Every key the base adds to a round's metrics is on the metrics page."""
    from flwr_prox_strategies.core.contract.ledger import privacy_metrics
    from flwr_prox_strategies.core.server import metrics
    from flwr_prox_strategies.core.server.rule_report import declared_rules

    page = (REPO / "docs" / "reference" / "metrics.md").read_text()
    counts = metrics.round_counts(
        [], failed=0, rejected=0, absent=0, capped=0, bytes_sent=0
    )
    privacy = {
        **privacy_metrics({1: 1.0}, per_client=True),
        **privacy_metrics({1: 1.0}, per_client=False),
    }
    keys = {*counts, *privacy, "replies-rule-missing", "replies-term-incomplete"}
    keys.add("dp-clients-retired")
    keys |= {"eval-client-keys", "dissimilarity-b", "grad-sq-norm-global"}
    keys |= metrics.rule_bookkeeping() - set().union(*declared_rules().values())
    missing = sorted(key for key in keys if f"`{key}`" not in page)
    assert not missing


def test_a_hydra_default_that_is_not_pythons_says_why(confref) -> None:
    """The option tables show Python's default beside Hydra's where they differ,
    and a literal that differs must carry the comment saying why (the build
    fails otherwise)."""
    assert confref.python_default("flwr_prox_strategies.FedDyn", "min_train_nodes") == 2
    assert confref.python_default("flwr_prox_strategies.FedDyn", "nosuch") is (
        confref._NO_DEFAULT
    )
    assert confref.differs_from_python(1, 2)
    assert confref.differs_from_python("${num_clients}", None)
    assert not confref.differs_from_python([200, 200], (200, 200))
    assert confref.differs_from_python(True, 1)  # a flag is not a count
    missing = []
    for name in all_conf_files():
        rows = confref.resolve(confref.parse_file(name))
        targets = {
            r.key.removesuffix("._target_"): str(r.value)
            for r in rows
            if r.key.endswith("._target_") and isinstance(r.value, str)
        }
        for row in rows:
            parent, _, key = row.key.rpartition(".")
            if not (row.leaf and parent in targets):
                continue
            default = confref.python_default(targets[parent], key)
            literal = "${" not in str(row.value)
            differs = confref.differs_from_python(row.value, default)
            if differs and literal and not row.comment:
                missing.append((name, row.key))
    assert not missing
    common = {
        r.key: r for r in confref.resolve(confref.parse_file("strategy/_base/sgd"))
    }
    assert "Flower's 2" in common["strategy.min_train_nodes"].comment


@pytest.fixture(scope="module")
def repofiles():
    return docs_extension("repofiles")


def test_a_cited_script_or_test_links_to_its_section(repofiles) -> None:
    files = repofiles.documented_files()
    examples = repofiles.example_pages()
    assert files["benchmarks/privacy.py"] == "benchmarks/scripts"
    assert files["tests/system/test_faults.py"] == "reference/tests"
    assert repofiles.link_target(
        "python benchmarks/privacy.py --rounds 30", files, examples
    ) == (
        "benchmarks/scripts",
        "file-benchmarks-privacy-py",
    )
    assert repofiles.link_target("examples/plugin-fedadmm/", files, examples) == (
        "examples/plugin-fedadmm",
        "",
    )
    assert (
        repofiles.link_target(
            "benchmarks/results/privacy/privacy.csv", files, examples
        )[0]
        == "benchmarks/index"
    )
    # A file of an example's own tests is not the pack's.
    assert repofiles.link_target(
        "examples/plugin-fednova/tests/test_fednova.py", files, examples
    ) == ("examples/plugin-fednova", "")
    assert repofiles.link_target("my_tests/test_x.py", files, examples) == ("", "")


def test_every_script_and_test_file_a_page_cites_exists(repofiles) -> None:
    """A mention of a file that was renamed or removed would link nowhere."""
    files = repofiles.documented_files()
    cited = set()
    for path in (REPO / "docs").rglob("*.md"):
        if "_build" in path.parts:
            continue
        for match in re.finditer(r"`([^`\n]+)`", path.read_text(encoding="utf-8")):
            found = repofiles._FILE.search(match.group(1))
            if found and "<" not in found.group(1):
                cited.add((path.relative_to(REPO).as_posix(), found.group(1)))
    missing = sorted((page, f) for page, f in cited if f not in files)
    assert cited and not missing
