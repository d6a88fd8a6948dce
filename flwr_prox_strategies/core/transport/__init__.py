"""Messages on the wire and the grids that carry them.

:mod:`.keys` (the kebab-case wire keys), :mod:`.records` (Flower records to and
from numpy, array layouts), :mod:`.grid` (a view of a grid limited to a group of
nodes), :mod:`.inprocess` (a grid that runs a ``ClientApp`` in this process),
:mod:`.flower` (Flower internals that moved between releases), and the
secure-aggregation pieces: :mod:`.secagg` (the wire and the arithmetic),
:mod:`.secagg_node` (the node's stage handlers, which
:class:`~flwr_prox_strategies.SecAggPlusMod` runs), :mod:`.shamir` (secret
sharing with error-correcting recovery) and :mod:`.signing` (signatures for the
active-adversary setting).
"""
