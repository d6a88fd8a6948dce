"""What a reply and a server rule may be: the checks between clients and the rule.

A reply is screened against what was sent (:mod:`.screening`, :mod:`.validation`),
its values kept out of the model when they are not finite (:mod:`.finite`); a
rule reads its declared state read-only (:mod:`.frozen`) and returns what the
strategy declared (:mod:`.fields`). Knows Flower's records, not the round.
"""
