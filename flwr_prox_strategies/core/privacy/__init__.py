"""Privacy around the other rooms: the Laplace upload mod, Flower's central DP.

:mod:`.uploads` (the ClientApp mods: Laplace noise on any client's upload, and
the clipping central DP asks the clients for), :mod:`.central` (Flower's
fixed-clipping wrappers around the pack's strategies) and the server half of
secure aggregation: :mod:`.secagg` (the wrapper and its round),
:mod:`.secagg_exchange` (the key exchange) and :mod:`.secagg_unmask` (the sums
unmasked).
Sample-level DP-SGD is part of the client's training (:mod:`..client.dp`); what
a private reply reports, and the server's epsilon ledger, is part of the
contract (:mod:`..contract.ledger`).
"""
