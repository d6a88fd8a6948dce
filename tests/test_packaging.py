"""Import light: the base import leaves logging alone; optional parts name their extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from torch import nn

from flwr_prox_strategies import DPSGD, make_private_model
from flwr_prox_strategies._optional import require, require_installed
from flwr_prox_strategies.ops.topology import adjacency, mixing_matrix

HEAVY = (
    "opacus",
    "cvxpy",
    "hydra",
    "omegaconf",
    "matplotlib",
    "sklearn",
    "datasets",
    "flwr_datasets",
    "pandas",
    "scipy",
    "ray",
)


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fail on error)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_leaves_logging_alone_and_imports_nothing_optional() -> None:
    out = run_python(
        f"""
        import logging, sys
        before = list(logging.getLogger().handlers)
        level = logging.getLogger().level
        import flwr_prox_strategies
        import flwr_prox_strategies.task
        import flwr_prox_strategies.ops.topology
        import flwr_prox_strategies.algorithms.pfedavg
        assert logging.getLogger().handlers == before, logging.getLogger().handlers
        assert logging.getLogger().level == level
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
        """
    )
    assert out.strip() == "[]"


def test_dp_settings_build_without_opacus_and_using_them_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opacus", None)  # "not installed"
    dp = DPSGD(noise_multiplier=1.0, clipping_norm=1.0)
    model = nn.Linear(3, 2)
    assert make_private_model(model, None) is model
    with pytest.raises(ImportError, match=r'pip install "flwr-prox-strategies\[dp\]"'):
        make_private_model(model, dp)


def test_sdp_mixing_without_cvxpy_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cvxpy", None)
    ring = adjacency("ring", 6)
    assert np.allclose(mixing_matrix(ring, "metropolis").sum(axis=1), 1.0)
    with pytest.raises(ImportError, match=r"cvxpy.*flwr-prox-strategies\[sdp\]"):
        mixing_matrix(ring, "sdp")


def test_experiment_layer_without_hydra_names_the_extra() -> None:
    out = run_python(
        """
        import sys
        sys.modules["hydra"] = None
        try:
            import flwr_prox_strategies.experiment.config
        except ImportError as err:
            print(err)
        """
    )
    assert "hydra-core" in out
    assert 'pip install "flwr-prox-strategies[experiment]"' in out


def test_require_passes_on_an_import_error_from_inside_an_installed_package(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import not_there_at_all\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        require("brokenpkg", "dp", "a feature")
    assert info.value.name == "not_there_at_all"  # the real cause, not "install dp"
    with pytest.raises(ImportError, match=r"flwr-prox-strategies\[sdp\]"):
        require("surely_not_a_module_xyz", "sdp", "a feature")
    require_installed(("brokenpkg",), "dp", "a feature")  # installed: no error
    with pytest.raises(ImportError, match="surely_not_a_module_xyz"):
        require_installed(("surely_not_a_module_xyz",), "sdp", "a feature")
