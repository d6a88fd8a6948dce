"""Privacy around the other rooms: the Laplace upload mod, Flower's central DP.

:mod:`.uploads` (the Laplace ClientApp mod: noise on any client's upload) and
:mod:`.central` (Flower's fixed-clipping wrappers around the pack's strategies).
Sample-level DP-SGD is part of the client's training (:mod:`..client.dp`); what
a private reply reports, and the server's epsilon ledger, is part of the
contract (:mod:`..contract.ledger`).
"""
