"""What a reply and a server rule may be: the terms both sides of a round keep.

What a valid reply is (:mod:`.validation`), what a private reply reports
(:mod:`.ledger`), the state a strategy declares (:mod:`.fields`) and its rule
reads read-only (:mod:`.frozen`), the words for steps that lacked a rule's
term (:mod:`.steps`). Knows Flower's records, neither side's code.
"""
