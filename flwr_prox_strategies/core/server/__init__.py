"""The server's round: the validated strategy base and the parts it holds.

:mod:`.strategy` (the base every strategy inherits) runs a round and delegates
each job to a part: which nodes train (:mod:`.sampling`), K, the number of all
clients (:mod:`.population`), the two-phase commit of client state
(:mod:`.commit`), the checkpoint (:mod:`.resume`), the run's summary
(:mod:`.summary`), the round's metrics (:mod:`.metrics`), one message per node
(:mod:`.messages`) and how a run ends (:mod:`.outcome`).
"""
