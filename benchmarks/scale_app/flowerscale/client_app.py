"""A trivial client that keeps a FedDC-sized state: two model-sized arrays.

When the server sends a ``control`` record with the model (``extra-records=1``
on the server), the reply carries a model-sized ``control`` record too: the
payload of SCAFFOLD's and FedDC's replies.
"""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()
CONTROL = "control"


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Return the model unchanged; read, update and keep two state arrays."""
    arrays = msg.content.array_records["arrays"]
    for name in ("drift", "control"):
        if name in context.state.array_records:
            state = context.state.array_records[name].to_numpy_ndarrays()
            state = [s + 1.0 for s in state]
        else:
            state = [np.zeros_like(a) for a in arrays.to_numpy_ndarrays()]
        context.state[name] = ArrayRecord(state)
    content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})}
    )
    if CONTROL in msg.content.array_records:  # a control change back, as SCAFFOLD
        content[CONTROL] = context.state.array_records["control"]
    return Message(content=content, reply_to=msg)
