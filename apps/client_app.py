"""The ClientApp `flwr run .` starts: the configured client on this node's partition."""

from flwr_prox_strategies import to_client_app
from flwr_prox_strategies.experiment.server import make_client

app = to_client_app(make_client)
