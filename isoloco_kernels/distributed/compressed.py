"""The compressed owner route's arithmetic and state-dict entry, under the names MergeLoCo's one-process
simulation (optim/compressed.py) and MergeLoCo import them by.

They are `ShardedIsoLoCo(compress=...)`'s own functions, defined beside its compressed exchange in sharded.py
(so the step runs in one module): the simulation calls the very code the ranks run, and the two agree bit for
bit. docs/compression.md has the contract.
"""

from __future__ import annotations

from .sharded import (
    UPDATE_STREAM,
    apply_update,
    attach,
    check_entry,
    encode_delta,
    layout,
    load_entry,
    owner_inputs,
    owner_step,
    spec_fields,
    state_entry,
    stream_spec,
    update_sizes,
    wire_bytes,
    write,
)

__all__ = [
    "UPDATE_STREAM",
    "apply_update",
    "attach",
    "check_entry",
    "encode_delta",
    "layout",
    "load_entry",
    "owner_inputs",
    "owner_step",
    "spec_fields",
    "state_entry",
    "stream_spec",
    "update_sizes",
    "wire_bytes",
    "write",
]
