"""Wire keys shared by every strategy and client of the pack (kebab-case).

Algorithm-specific keys live next to their algorithm (e.g. ``proximal-mu`` in
:mod:`flwr_prox_strategies.algorithms.fedprox`).
"""

SERVER_ROUND_KEY = "server-round"
LOCAL_EPOCHS_KEY = "local-epochs"
# When present, the client runs exactly this many mini-batch steps (cycling
# through its data as often as needed) instead of ``local-epochs`` epochs.
LOCAL_STEPS_KEY = "local-steps"
NUM_EXAMPLES_KEY = "num-examples"
# When True in the train config, the client also returns the full gradient of its
# local loss at the received model, in an ArrayRecord named GRADIENT_RECORD.
REPORT_GRADIENT_KEY = "report-gradient"
GRADIENT_RECORD = "gradient"
# Multiplies the client's learning rate this round (per-round decay).
LR_SCALE_KEY = "lr-scale"
# Two-phase commit of client state (stateful algorithms): the server tells each
# node the last round in which one of its replies was aggregated; a client keeps
# the state of a round as pending until the server confirms that round.
ACCEPTED_ROUND_KEY = "accepted-round"
ACCEPTED_KEYS_KEY = "accepted-keys"
ACCEPTED_ROUNDS_KEY = "accepted-rounds"
CLIENT_KEY_METRIC = "client-key"
# Stateful clients report the round their committed state comes from (-1: none),
# so the server can tell a client that lost its state, or holds another run's or
# another round's, from one in step with what the server committed.
STATE_ROUND_METRIC = "state-round"
# A stateful client also reports how many of its state records its rule saved
# outside the two-phase commit this round (ClientState.set instead of
# set_pending): their state-round says -1 although they hold state.
STATE_OUTSIDE_COMMIT_METRIC = "state-outside-commit"
# Every rule's reply counts the local optimiser steps (measured), and of them
# the steps whose term was lost before the update (a backward pass after it,
# the gradients cleared or replaced) or never added.
LOCAL_STEPS_METRIC = "local-steps"
TERM_LOST_METRIC = "term-lost-steps"
TERM_MISSING_METRIC = "term-missing-steps"
# The server asks a client whose state it cannot use to start afresh.
RESET_STATE_KEY = "reset-state"
RESET_KEYS_KEY = "reset-keys"
# Identifies the run (kept across a resume): a stateful client ignores saved state
# stamped with another run's tag, so a dead run's state_dir is never reused.
RUN_TAG_KEY = "run-tag"
# An error reply whose reason starts with this (the client's exception name) comes
# from a client whose privacy budget is spent: absent from now on, not failed.
BUDGET_EXHAUSTED_REASON = "PrivacyBudgetExhausted"


def node_key(node_id: int) -> int:
    """Return a node id made exact as a float metric (Flower's ids are 64-bit)."""
    return int(node_id) % (1 << 52)


#: The ConfigRecord a secure-aggregation (SecAgg+) message carries: its stage
#: and values. A train message without it passes the client mod untouched.
SECAGG_RECORD = "secagg-plus"
#: What a ClientApp without the secure-aggregation mod is told to add.
MISSING_MOD_HINT = (
    "add the pack's mod to the ClientApp: ClientApp(..., mods=[SecAggPlusMod()]) "
    "(from flwr_prox_strategies import SecAggPlusMod)"
)
