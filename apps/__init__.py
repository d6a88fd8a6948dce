"""The ServerApp and ClientApp that `flwr run .` starts."""
