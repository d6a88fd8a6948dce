"""The server's round: the validated strategy base and the parts it holds.

:mod:`.strategy` (the base every strategy inherits) runs a round; what an
algorithm declares and overrides is in :mod:`.hooks`. Each job is a part with
its own state: which nodes train (:mod:`.sampling`), N, the number of all
clients (:mod:`.population`), the replies a round may use and the rule re-run
until its model is finite (:mod:`.screening`; what it says of a client rule not
applied, :mod:`.rule_report`), the two-phase commit of client state
(:mod:`.commit`), rounds in a row not aggregated (:mod:`.outcome`), federated
evaluation (:mod:`.evaluation`); and the round's pieces (:mod:`.pieces`), its
metrics (:mod:`.metrics`), the checkpoint (:mod:`.resume`), and the base's
keywords: documented, checked and summarised (:mod:`.options`).
"""
