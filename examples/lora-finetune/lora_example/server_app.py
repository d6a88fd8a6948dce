"""lora_example: the ServerApp. The strategy holds the adapters, never the model."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_prox_strategies import FedProx, Scaffold, federated_part
from lora_example.task import model_of

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Federate the adapters for ``num-server-rounds`` rounds; save them."""
    config = context.run_config
    model = model_of(config)
    part = federated_part(model)
    adapters = ArrayRecord(part.state_dict())
    whole = sum(p.numel() for p in model.parameters())
    sent = sum(a.numpy().size for a in adapters.values())
    print(
        f"Federating {len(adapters)} adapter tensors ({sent} values) of a model "
        f"of {whole} values: {sent / whole:.2%} of it per message"
    )
    if config["algorithm"] == "scaffold":
        strategy = Scaffold(fraction_evaluate=0.0)
    else:
        strategy = FedProx(
            proximal_mu=float(config["proximal-mu"]), fraction_evaluate=0.0
        )
    result = strategy.start(
        grid=grid, initial_arrays=adapters, num_rounds=int(config["num-server-rounds"])
    )
    torch.save(result.arrays.to_torch_state_dict(), str(config["output-path"]))
    print(f"Saved the final adapters to {config['output-path']}")
