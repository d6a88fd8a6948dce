"""The ClientApp `flwr run .` starts: the configured client on this node's partition."""

from flwr_prox_strategies import to_client_app
from flwr_prox_strategies.core.central import clip_when_asked
from flwr_prox_strategies.experiment.server import make_client

# clip_when_asked: clients clip their update when a central-DP run asks them to.
app = to_client_app(make_client, mods=[clip_when_asked])
