"""FedNova's Hydra tree: ``strategy/fednova.yaml``, joined to the pack's search path."""
