"""One tensor a message kind may carry (its contract): the codec checks every received descriptor against it."""

from __future__ import annotations

from dataclasses import dataclass

# dtype names (common.protocol.codec.DTYPES) by class, for the tensor contracts (common/protocol/messages.py).
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8"})


@dataclass(frozen=True)
class TensorField:
    """One tensor a message kind may carry: its name, dtype class and rank. The codec checks
    every received descriptor against its kind's fields before it opens any tensor.

    A family's own tensor (its binding's declaration, common/protocol/contracts.py) also says which stage makes
    it and which reads it (``"router"``: the request's sender, or its answer's reader): it rides the message
    kinds between the two. A prompt's tensor names its negative prompt's twin (classifier-free guidance)."""

    name: str
    dtypes: frozenset[str]
    rank: int | tuple[int, ...]  # several: the families differ (videos [.., F', H', W'], images [.., H', W'])
    required: bool = True
    prefix: bool = False  # a family of tensors: every name that starts with ``name`` (each optional)
    made_by: str = ""  # a stage role, or "router"
    read_by: str = ""
    negative: TensorField | None = None

    def names(self, tensor: str) -> bool:
        return tensor.startswith(self.name) and len(tensor) > len(self.name) if self.prefix else tensor == self.name

    def problem(self, dtype: str, shape: list[int]) -> str | None:
        if dtype not in self.dtypes:
            return f"dtype {dtype} is not one of {sorted(self.dtypes)}"
        ranks = self.rank if isinstance(self.rank, tuple) else (self.rank,)
        if len(shape) not in ranks:
            return f"rank {len(shape)} is not {' or '.join(map(str, ranks))}"
        return None


def prompt_tensor(name: str, dtypes: frozenset[str], rank: int, required: bool = False) -> TensorField:
    """A prompt's tensor, made by the encoder worker for the denoise worker, with the same tensor of the negative
    prompt (``negative_<name>``, sent when the request runs classifier-free guidance)."""
    negative = TensorField(f"negative_{name}", dtypes, rank, required=False, made_by="encoder", read_by="denoise")
    return TensorField(name, dtypes, rank, required=required, made_by="encoder", read_by="denoise",
                       negative=negative)


def image_tensor(name: str, dtypes: frozenset[str], rank: int) -> TensorField:
    """What the encoder worker's image side makes of a request's images for the denoise worker."""
    return TensorField(name, dtypes, rank, required=False, made_by="encoder", read_by="denoise")
