"""Suite-wide settings.

Under pytest-xdist every worker gets one torch thread: two workers with two
threads each on a 2-core machine fight over the cores.
"""

from __future__ import annotations

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
