"""Flower internals whose module moved between the flwr releases the pack supports.

``Run`` and ``KEY_CLIPPING_NORM`` moved to ``flwr.supercore`` in flwr 1.32;
``TaskIdentity`` (which hand-built ``Message`` objects need) came in flwr 1.38;
``ErrorCode.MOD_FAILED_PRECONDITION`` (6) in flwr 1.22.
"""

from __future__ import annotations

from flwr.common.constant import ErrorCode

try:  # flwr >= 1.32
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
    from flwr.supercore.run import Run
except ImportError:  # flwr < 1.32
    from flwr.common.differential_privacy_constants import (  # type: ignore[no-redef]
        KEY_CLIPPING_NORM,
    )
    from flwr.common.typing import (  # type: ignore[attr-defined,no-redef,assignment]
        Run,
    )

__all__ = [
    "KEY_CLIPPING_NORM",
    "MOD_FAILED_PRECONDITION",
    "Run",
    "set_task_identity",
]

# flwr < 1.22 has no name for the code its later releases give a failed precondition.
MOD_FAILED_PRECONDITION: int = getattr(ErrorCode, "MOD_FAILED_PRECONDITION", 6)


def set_task_identity(run_id: int, node_id: int = 0, task_id: int = 0) -> None:
    """Set the identity that a ``Message`` built in this process is stamped with."""
    try:  # flwr >= 1.38
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # flwr < 1.38: a Message built here needs no task identity
        return
    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = task_id
