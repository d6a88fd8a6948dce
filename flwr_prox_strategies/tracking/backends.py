"""TensorBoard, MLflow and Weights & Biases as :class:`~.base.Tracker` backends.

Each library is imported in :meth:`~.base.Tracker.open` (with
:class:`~.base.InBackground`, on the tracker's own thread), and a missing one
names the extra that installs it. All three work offline: TensorBoard writes
event files, MLflow a SQLite store, W&B an offline run that ``wandb sync``
uploads later.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._optional import require
from .base import Tracker

#: The W&B project and MLflow experiment of runs outside a sweep.
DEFAULT_PROJECT = "flwr-prox-strategies"
#: MLflow's limits on one ``log_batch`` call (its REST API's).
MLFLOW_BATCH_METRICS = 1000
MLFLOW_BATCH_PARAMS = 100
#: MLflow refuses longer parameter values.
MLFLOW_PARAM_CHARS = 6000


class TensorBoardTracker(Tracker):
    """Write TensorBoard event files to ``log_dir`` (torch's ``SummaryWriter``).

    Metrics are scalars by their names (``central/accuracy``); the parameters
    are the run's hyper-parameters in TensorBoard's HParams tab, with the
    summary metrics beside them, so the jobs of a sweep compare in one table
    (``tensorboard --logdir`` the folder above the jobs' folders). PNG
    artifacts become images.

    Parameters
    ----------
    log_dir : str | Path
        The run's folder of event files.
    """

    name = "tensorboard"
    requires = ("tensorboard", "tensorboard")

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self._params: dict[str, Any] = {}
        self._last: dict[str, float] = {}

    @classmethod
    def in_folder(
        cls, *, folder: str | Path, run_name: str, group: str | None = None
    ) -> TensorBoardTracker:
        """Write to ``<folder>/tensorboard/<run name>/`` (``logger=tensorboard``).

        Parameters
        ----------
        folder : str | Path
            The run's output folder, or the sweep's.
        run_name : str
            The run's sub-folder (``/`` replaced by ``_``).
        group : str | None (default: None)
            Unused: TensorBoard groups runs by their root folder.

        Returns
        -------
        TensorBoardTracker
            The tracker, not yet opened.
        """
        return cls(Path(folder) / "tensorboard" / run_name.replace("/", "_"))

    def open(self) -> None:  # noqa: D102
        require("tensorboard", "tensorboard", "Tracking with TensorBoard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: D102
        self._params.update(params)
        text = "\n".join(f"    {k}: {v}" for k, v in sorted(params.items()))
        self.writer.add_text("config", text)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self._last.update(metrics)
        self.writer.flush()

    def log_artifacts(self, paths: Sequence[Path]) -> None:  # noqa: D102
        for path in paths:
            if Path(path).suffix == ".png" and Path(path).is_file():
                self._image(Path(path))

    def _image(self, path: Path) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(path)[..., :3]  # RGBA to RGB, 0..1
        self.writer.add_image(f"plots/{path.stem}", pixels, dataformats="HWC")

    def close(self, *, failed: bool = False) -> None:  # noqa: D102
        if self.writer is None:
            return
        if self._params:
            from torch.utils.tensorboard.summary import hparams

            summary = {k: v for k, v in self._last.items() if k.startswith("summary/")}
            for item in hparams(self._params, summary):
                self.writer.file_writer.add_summary(item)
        self.writer.add_text("status", "failed" if failed else "finished")
        self.writer.close()

    def where(self) -> str:  # noqa: D102
        return f"tensorboard --logdir {self.log_dir.parent}"


class MLflowTracker(Tracker):
    """Log a run to MLflow through its client (no global active run is used).

    Parameters
    ----------
    tracking_uri : str
        The tracking store: ``sqlite:///<path>`` (a local file) or a server's
        ``http(s)://`` address.
    experiment : str
        The MLflow experiment: every job of a sweep logs a run into the same one.
    run_name : str
        The run's name in the UI.
    artifact_location : str | Path | None (default: None)
        Where a new experiment keeps its artifacts (None: the server's choice;
        give a folder with a local store, or MLflow uses ``./mlruns`` of the
        current folder).
    """

    name = "mlflow"
    requires = ("mlflow", "mlflow")

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        artifact_location: str | Path | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.artifact_location = artifact_location
        self.client: Any = None
        #: The MLflow run's id, once open.
        self.run_id: str | None = None

    @classmethod
    def in_folder(
        cls,
        *,
        folder: str | Path,
        run_name: str,
        group: str | None = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
    ) -> MLflowTracker:
        """Log to a SQLite store ``<folder>/mlflow.db`` by default (``logger=mlflow``).

        Parameters
        ----------
        folder : str | Path
            The run's output folder, or the sweep's: the store and the
            artifacts (``mlartifacts/``) when ``tracking_uri`` is None.
        run_name : str
            The run's name.
        group : str | None (default: None)
            The sweep's name: the MLflow experiment unless ``experiment`` is given.
        tracking_uri : str | None (default: None)
            A tracking server (``http://host:5000``) or another store.
        experiment : str | None (default: None)
            The MLflow experiment (None: ``group``, else ``"flwr-prox-strategies"``).

        Returns
        -------
        MLflowTracker
            The tracker, not yet opened.
        """
        root = Path(folder).resolve()
        return cls(
            tracking_uri=tracking_uri or f"sqlite:///{root / 'mlflow.db'}",
            experiment=experiment or group or DEFAULT_PROJECT,
            run_name=run_name,
            artifact_location=None if tracking_uri else root / "mlartifacts",
        )

    def open(self) -> None:  # noqa: D102
        tracking = require("mlflow.tracking", "mlflow", "Tracking with MLflow")
        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(
                parents=True, exist_ok=True
            )
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = self.artifact_location
            experiment_id = self.client.create_experiment(
                self.experiment,
                artifact_location=None if location is None else Path(location).as_uri(),
            )
        run = self.client.create_run(experiment_id, run_name=self.run_name)
        self.run_id = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: D102
        from mlflow.entities import Param

        items = [
            Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in params.items()
        ]
        for start in range(0, len(items), MLFLOW_BATCH_PARAMS):
            chunk = items[start : start + MLFLOW_BATCH_PARAMS]
            self.client.log_batch(self.run_id, params=chunk)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(items), MLFLOW_BATCH_METRICS):
            chunk = items[start : start + MLFLOW_BATCH_METRICS]
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_artifacts(self, paths: Sequence[Path]) -> None:  # noqa: D102
        for path in paths:
            if Path(path).is_file():
                self.client.log_artifact(self.run_id, str(path))

    def close(self, *, failed: bool = False) -> None:  # noqa: D102
        if self.run_id is not None:
            status = "FAILED" if failed else "FINISHED"
            self.client.set_terminated(self.run_id, status=status)

    def where(self) -> str:  # noqa: D102
        if self.tracking_uri.startswith(("http://", "https://")):
            return f"open {self.tracking_uri}"
        return f"mlflow ui --backend-store-uri {self.tracking_uri}"


class WandbTracker(Tracker):
    """Log a run to Weights & Biases: a new run, or a run the caller started.

    Parameters
    ----------
    run : Any (default: None)
        A run already started (``wandb.init(...)``): metrics go to it and it is
        left open at the end. None: opening the tracker starts one with the
        keywords below, and closing it finishes it.
    project : str (default: "flwr-prox-strategies")
        The W&B project of a new run.
    group : str | None (default: None)
        Its group: every job of a sweep is in the same one.
    run_name : str | None (default: None)
        Its name in the UI.
    mode : str (default: "offline")
        ``"offline"`` (files under ``dir``, uploaded later with ``wandb sync``),
        ``"online"`` or ``"disabled"``.
    dir : str | Path | None (default: None)
        The folder that receives ``wandb/`` (None: the current folder).
    entity : str | None (default: None)
        The W&B team or user (None: the account's default).
    """

    name = "wandb"
    requires = ("wandb", "wandb")

    def __init__(
        self,
        run: Any = None,
        *,
        project: str = DEFAULT_PROJECT,
        group: str | None = None,
        run_name: str | None = None,
        mode: str = "offline",
        dir: str | Path | None = None,  # wandb.init's name
        entity: str | None = None,
    ) -> None:
        self.run = run
        self.owned = run is None
        self.project = project
        self.group = group
        self.run_name = run_name
        self.mode = mode
        self.dir = None if dir is None else Path(dir)
        self.entity = entity

    @classmethod
    def in_folder(
        cls,
        *,
        folder: str | Path,
        run_name: str,
        group: str | None = None,
        project: str = DEFAULT_PROJECT,
        mode: str = "offline",
        entity: str | None = None,
    ) -> WandbTracker:
        """Start a new run with its files in ``<folder>/wandb/`` (``logger=wandb``).

        Parameters
        ----------
        folder : str | Path
            The run's output folder, or the sweep's.
        run_name : str
            The run's name.
        group : str | None (default: None)
            The sweep's name: the W&B group.
        project : str (default: "flwr-prox-strategies")
            The W&B project.
        mode : str (default: "offline")
            ``"offline"`` (upload later: ``wandb sync``), ``"online"``,
            ``"disabled"``.
        entity : str | None (default: None)
            The W&B team or user.

        Returns
        -------
        WandbTracker
            The tracker, not yet opened.
        """
        return cls(
            project=project,
            group=group,
            run_name=run_name,
            mode=mode,
            dir=Path(folder).resolve(),
            entity=entity,
        )

    def open(self) -> None:  # noqa: D102
        if self.run is not None:
            return
        wandb = require("wandb", "wandb", "Tracking with Weights & Biases")
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            group=self.group,
            name=self.run_name,
            mode=self.mode,
            dir=None if self.dir is None else str(self.dir),
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: D102
        self.run.config.update(dict(params), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:  # noqa: D102
        self.run.log(dict(metrics), step=step)

    def log_artifacts(self, paths: Sequence[Path]) -> None:  # noqa: D102
        for path in paths:
            if Path(path).is_file():
                self.run.save(str(path), base_path=str(Path(path).parent), policy="now")

    def close(self, *, failed: bool = False) -> None:  # noqa: D102
        if self.owned and self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)

    def where(self) -> str:  # noqa: D102
        if not self.owned:
            return ""
        if self.run is None:  # not started: every offline run under dir
            folder = self.dir if self.dir is not None else Path()
            offline = self.mode == "offline"
            return f"wandb sync {folder / 'wandb'}/offline-run-*" if offline else ""
        if self.mode == "offline":
            return f"wandb sync {self.run.dir.removesuffix('/files')}"
        return f"open {self.run.url}" if self.run.url else ""


__all__ = ["MLflowTracker", "TensorBoardTracker", "WandbTracker"]
