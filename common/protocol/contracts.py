"""The tensor contracts of one served family: what each message kind may carry for it.

Every kind declares the tensors all families share (``carries``, :mod:`common.protocol.messages`). A family's
binding declares its own (``Binding.wire_tensors``: its prompt tensors, their negative twins, its image side's),
each with the stage that makes it and the stage that reads it; a family tensor rides every kind on the way
between the two. The codec checks a received message against its receiver's contract: a worker's own family's,
the router's served family's (:data:`SHARED` where no family is known: the shared tensors alone).
"""

from __future__ import annotations

from common.protocol.tensor_field import TensorField

# Where each stage sits on a request's way: the router sends the request (0) and reads the answer (4).
MADE_AT = {"router": 0, "encoder": 1, "denoise": 2, "decode": 3}
READ_AT = {"encoder": 1, "denoise": 2, "decode": 3, "router": 4}


class WireContract:
    """The message kinds' contracts with ``own`` (a family's tensors) beside the shared ones."""

    def __init__(self, own: tuple[TensorField, ...] = ()):
        for f in own:
            if f.made_by not in MADE_AT or f.read_by not in READ_AT or READ_AT[f.read_by] <= MADE_AT[f.made_by]:
                raise ValueError(f"tensor {f.name!r}: made by {f.made_by!r} and read by {f.read_by!r} is no way "
                                 f"along the stages (makers {sorted(MADE_AT)}, readers {sorted(READ_AT)})")
        names = [f.name for f in own]
        if len(set(names)) != len(names):
            raise ValueError(f"tensors declared twice: {sorted({n for n in names if names.count(n) > 1})}")
        self.own = tuple(own)
        self._of: dict[type, dict[str, TensorField]] = {}

    def of(self, kind: type) -> dict[str, TensorField]:
        """Every tensor a message of ``kind`` may carry: the shared ones, and the family's whose way passes the
        kind's receiver (``kind.receiver``)."""
        contract = self._of.get(kind)
        if contract is None:
            contract = dict(kind.contract())
            at = READ_AT.get(getattr(kind, "receiver", None) or "")
            for f in self.own:
                if at is not None and MADE_AT[f.made_by] < at <= READ_AT[f.read_by]:
                    contract.setdefault(f.name, f)  # a shared tensor keeps the shared declaration
            self._of[kind] = contract
        return contract


SHARED = WireContract()
