"""P-FedAvg between real Flower deployments: the servers' exchange and the launcher.

* :mod:`.exchange`: what each parameter server's ServerApp
  (:class:`~flwr_prox_strategies.PFedAvgServer`) runs to trade models with its
  graph neighbours over gRPC;
* :mod:`.security`: the mutual TLS and token of those links;
* :mod:`.launcher`: ``python -m flwr_prox_strategies.pfedavg_deploy``, which
  starts one SuperLink, its SuperNodes and one ServerApp per server on this
  machine, reads the servers' models each round and writes the run's folder.

Importing the package imports neither: the strategy needs the exchange only,
and the exchange knows nothing of the launcher or the experiment.
"""
