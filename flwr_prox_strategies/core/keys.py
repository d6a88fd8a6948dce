"""Wire keys shared by every strategy and client of the pack (kebab-case).

Algorithm-specific keys live next to their algorithm (e.g. ``proximal-mu`` in
:mod:`flwr_prox_strategies.algorithms.fedprox`).
"""

SERVER_ROUND_KEY = "server-round"
LOCAL_EPOCHS_KEY = "local-epochs"
NUM_EXAMPLES_KEY = "num-examples"
# When True in the train config, the client also returns the full gradient of its
# local loss at the received model, in an ArrayRecord named GRADIENT_RECORD.
REPORT_GRADIENT_KEY = "report-gradient"
GRADIENT_RECORD = "gradient"
# Multiplies the client's learning rate this round (per-round decay).
LR_SCALE_KEY = "lr-scale"
