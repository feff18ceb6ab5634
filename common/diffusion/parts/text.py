"""The text part: a prompt's encoder, its wire tensors, and its conditioning as the transformer takes it.

A prompt travels as wire tensors (:attr:`TextPart.fields`); the denoise worker turns them into a
:data:`Conditioning` (:meth:`TextPart.conditioning`), and the rows of a forward stack their distinct texts
(:meth:`TextPart.stack`). :class:`TextPart` maps wire fields to the transformer's keywords; :class:`PaddedText`
zero-pads one sequence to the request's length; :class:`MaskedText` pads texts of different lengths in one
forward and gives the transformer a mask over the padding; :class:`PaddedMaskedText` pads each text to the
request's length and always gives the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

import torch

from common.protocol.tensor_field import FLOAT_DTYPES, TensorField, prompt_tensor

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

HIDDEN = "encoder_hidden_states"  # the text sequence every transformer takes under this name
# A CLIP text encoder's pooled projection [P], one per prompt, for a transformer that takes it beside the sequence.
POOLED_PROMPT_EMBEDS = prompt_tensor("pooled_prompt_embeds", FLOAT_DTYPES, 1)


@dataclass(frozen=True, eq=False)  # identity: the same object on two rows is one text (see rows.Rows.of)
class TextCond:
    """One text's conditioning as the transformer takes it: its keyword -> a [1, ...] tensor."""

    tensors: dict[str, torch.Tensor]


# A single tensor means encoder_hidden_states alone (a transformer whose only text input is the sequence).
Conditioning = Union[torch.Tensor, TextCond]


def text_kwargs(cond: Conditioning) -> dict[str, torch.Tensor]:
    return {HIDDEN: cond} if isinstance(cond, torch.Tensor) else cond.tensors


def cond_to(cond: Conditioning, device, dtype: torch.dtype) -> Conditioning:
    """``cond`` on ``device`` in ``dtype`` (a new object when anything moves)."""
    if isinstance(cond, torch.Tensor):
        return cond.to(device, dtype)
    return TextCond({k: v.to(device, dtype) for k, v in cond.tensors.items()})


# (info, dtype, device) -> an object whose wire_tensors(prompts, max_sequence_length) gives each prompt's
# wire tensors {field.name: tensor} (one encoder call for them all).
EncoderLoader = Callable[["ModelFacts", torch.dtype, Any], Any]
# (info, transformer, max_sequence_length, generator, device, dtype) -> a random conditioning of the right shapes.
ExampleText = Callable[["ModelFacts", torch.nn.Module, int, torch.Generator, Any, torch.dtype], Conditioning]


@dataclass(frozen=True, kw_only=True)
class TextPart:
    """Wire fields -> transformer keywords, each a [1, ...] tensor of the prompt's wire tensor."""

    fields: tuple[TensorField, ...]  # a prompt's wire tensors, each with its negative twin (TensorField.negative)
    keywords: tuple[str, ...]  # the transformer's keyword for each of ``fields``
    load_encoder: EncoderLoader
    example: ExampleText  # compile warm-ups
    # The transformer takes a mask over a text's padding tokens that leaves each row's output what it is alone,
    # so texts of different lengths share a forward; else a text's length is part of what it says (padding
    # tokens are attended) and rows share a forward only with texts of the same shapes (:meth:`key`).
    masks_padding: bool = False

    def negatives(self) -> dict[str, str]:
        """Each of a prompt's wire tensors -> the same tensor of the negative prompt (classifier-free guidance)."""
        return {f.name: f.negative.name for f in self.fields}

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> Conditioning:
        """A prompt's wire tensors (cond names) as the transformer takes them, on the wire's device and dtype."""
        return TextCond({k: wire[f.name][None] for f, k in zip(self.fields, self.keywords)})

    def fixed_length(self, info: "ModelFacts") -> int | None:
        """The only text length this model directory's transformer takes (None: any within the limit)."""
        return None

    def stack(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Distinct texts' keyword tensors ([1, ...] each) as one [U, ...] tensor per keyword."""
        return {k: torch.cat([t[k] for t in texts]) for k in texts[0]}

    def padded_to(self, texts: dict[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
        """A forward's stacked texts (:meth:`stack`) for a worker that splits the sequence over ``multiple``
        ranks: padded to a multiple of it where the transformer masks padding (as a longer batch mate's
        padding would be); else as they are (the denoise worker refuses lengths that do not divide)."""
        return texts

    def key(self, texts: list[Conditioning]) -> tuple:
        """What a request's texts (its prompt's and negative prompt's conditioning) must have in common with
        those of the other requests of a forward: each keyword's shape, unless the transformer masks padding."""
        if self.masks_padding:
            return ()
        return tuple(sorted({(k, tuple(v.shape[1:])) for t in texts for k, v in text_kwargs(t).items()}))


@dataclass(frozen=True, kw_only=True)
class PaddedText(TextPart):
    """One trimmed sequence [L, D] on the wire, zero-padded to the request's ``max_sequence_length`` (the
    padding attended): the transformer's ``encoder_hidden_states`` alone."""

    keywords: tuple[str, ...] = (HIDDEN,)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> Conditioning:
        return pad_embeddings(wire[self.fields[0].name], max_sequence_length)


def pad_embeddings(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """[L, D] -> [1, length, D], zero-padded after the real tokens."""
    out = embeds.new_zeros((1, length, embeds.shape[-1]))
    out[0, : embeds.shape[0]] = embeds
    return out


@dataclass(frozen=True, kw_only=True)
class MaskedText(TextPart):
    """Texts of their own lengths, zero-padded in a forward of several with a mask (``mask``: its keyword) the
    transformer honours; a forward of texts of one length gets no mask (what a pipeline passes for one)."""

    mask: str = "encoder_hidden_states_mask"
    masks_padding: bool = True

    def stack(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        embeds = [t[HIDDEN] for t in texts]
        longest = max(e.shape[1] for e in embeds)
        if all(e.shape[1] == longest for e in embeds):
            return {HIDDEN: torch.cat(embeds)}
        padded = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e in embeds])
        mask = torch.zeros(len(embeds), longest, dtype=torch.int64, device=padded.device)
        for i, e in enumerate(embeds):
            mask[i, : e.shape[1]] = 1
        return {HIDDEN: padded, self.mask: mask}

    def padded_to(self, texts, multiple):
        hidden = texts[HIDDEN]
        extra = -hidden.shape[1] % multiple
        if not extra:
            return texts
        mask = texts.get(self.mask)
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.int64, device=hidden.device)
        pad = torch.nn.functional.pad
        return {**texts, HIDDEN: pad(hidden, (0, 0, 0, extra)), self.mask: pad(mask, (0, extra))}


@dataclass(frozen=True, kw_only=True)
class PaddedMaskedText(MaskedText):
    """One trimmed sequence [L, D] on the wire, zero-padded to the request's ``max_sequence_length`` with a mask
    (1: a real token) the transformer always takes, as a pipeline that pads every prompt to its budget and
    passes the attention mask; texts of other budgets share a forward padded (and masked) to the longest."""

    keywords: tuple[str, ...] = (HIDDEN,)

    def conditioning(self, wire: dict[str, torch.Tensor], max_sequence_length: int) -> Conditioning:
        embeds = wire[self.fields[0].name]
        mask = embeds.new_zeros((1, max_sequence_length))
        mask[0, : embeds.shape[0]] = 1
        return TextCond({HIDDEN: pad_embeddings(embeds, max_sequence_length), self.mask: mask})

    def stack(self, texts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(t[HIDDEN].shape[1] for t in texts)
        pad = torch.nn.functional.pad
        return {HIDDEN: torch.cat([pad(t[HIDDEN], (0, 0, 0, longest - t[HIDDEN].shape[1])) for t in texts]),
                self.mask: torch.cat([pad(t[self.mask], (0, longest - t[self.mask].shape[1])) for t in texts])}
