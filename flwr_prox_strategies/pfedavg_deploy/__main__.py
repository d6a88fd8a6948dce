"""``python -m flwr_prox_strategies.pfedavg_deploy``: see :mod:`.launcher`."""

import sys

from .launcher import main

sys.exit(main())
