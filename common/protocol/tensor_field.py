"""One tensor a message kind may carry (its contract): the codec checks every received descriptor against it."""

from __future__ import annotations

from dataclasses import dataclass

# dtype names (common.protocol.codec.DTYPES) by class, for the tensor contracts (common/protocol/messages.py).
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})


@dataclass(frozen=True)
class TensorField:
    """One tensor a message kind may carry: its name, dtype class and rank. The codec checks
    every received descriptor against its kind's fields before it opens any tensor."""

    name: str
    dtypes: frozenset[str]
    rank: int | tuple[int, ...]  # several: the families differ (videos [.., F', H', W'], images [.., H', W'])
    required: bool = True
    prefix: bool = False  # a family of tensors: every name that starts with ``name`` (each optional)

    def names(self, tensor: str) -> bool:
        return tensor.startswith(self.name) and len(tensor) > len(self.name) if self.prefix else tensor == self.name

    def problem(self, dtype: str, shape: list[int]) -> str | None:
        if dtype not in self.dtypes:
            return f"dtype {dtype} is not one of {sorted(self.dtypes)}"
        ranks = self.rank if isinstance(self.rank, tuple) else (self.rank,)
        if len(shape) not in ranks:
            return f"rank {len(shape)} is not {' or '.join(map(str, ranks))}"
        return None
