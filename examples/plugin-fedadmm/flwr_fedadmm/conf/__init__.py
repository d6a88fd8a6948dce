"""FedADMM's Hydra tree: ``strategy/fedadmm.yaml``, joined to the pack's search path."""
