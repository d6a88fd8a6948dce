"""Privacy: sample-level DP-SGD on clients, upload noise, Flower's central DP.

:mod:`.dp` (DP-SGD through opacus, its accountant and budget), :mod:`.uploads`
(the Laplace ClientApp mod and the server's epsilon ledger) and :mod:`.central`
(Flower's fixed-clipping wrappers around the pack's strategies).
"""
