"""A GRPO group in process (tests/family_harness.py engines), shared by the families' feature tests: encoded once
by the encoder worker's stage, and ``share_prefix`` branches each equal to its sample run alone."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from common.protocol.messages import IMAGE, PROTOCOL_VERSION, TRAJECTORY_LATENTS, EncodeRequest, Route
from family_harness import max_diff


def encode_group(eng, p, image=None) -> list:
    """Runs the group ``p`` (n > 1) through the encoder worker's stage: one text encode (prompt and negative in
    one call) and, with an image, one image encode whose tensors are the in-process engine's. Returns the text
    encoder's calls."""
    from test_edit_rollouts import _encoder_stage, _spy

    stage = _encoder_stage(eng)
    text_calls, image_calls = [], []
    _spy(stage.text_encoder, "wire_tensors", text_calls)
    if image is not None:
        _spy(stage.images, "wire_tensors", image_calls)
    pixels = {} if image is None else {IMAGE.name: torch.from_numpy(np.asarray(image).copy())}
    msg = EncodeRequest(v=PROTOCOL_VERSION, request_id="group", route=Route(encoder=0, denoise=0, decode=0), params=p)
    (fwd,) = stage.process_batch([(msg, pixels)])
    assert len(text_calls) == 1 and len(image_calls) == (image is not None)  # one encode for the n samples
    if image is not None:
        want = eng.image_wire(p, image)
        assert all(torch.equal(fwd.tensors[k], want[k]) for k in want)
    return text_calls


def branch_diffs(eng, p, window: list[int], image=None) -> dict[str, float]:
    """The group ``p`` (``share_prefix`` over SDE ``window``) run at once: one prefix up to the window's first
    step, then a branch per sample. Returns, per sample, how far its trajectory, latents and every log-prob
    (``log_probs`` and any per stream) are from the same sample run alone (its seed, the group's initial noise)."""
    group = eng.run(p, image=image)
    ex = group.extras()
    traj = ex[TRAJECTORY_LATENTS.name]
    k = window[0]
    assert torch.equal(traj[1, : k + 1], traj[0, : k + 1])  # one prefix, then a branch per sample
    assert max_diff(traj[1, k + 1], traj[0, k + 1]) > 1e-3
    diffs = {}
    for i in range(p.n):
        alone = eng.run(msgspec.structs.replace(p, seed=p.seed + i, n=1, rollout=msgspec.structs.replace(
            p.rollout, share_prefix=False, initial_noise_seed=p.seed)), image=image)
        ax = alone.extras()
        diffs[f"trajectory[{i}]"] = max_diff(traj[i], ax[TRAJECTORY_LATENTS.name][0])
        diffs[f"latents[{i}]"] = max_diff(group.latents[i], alone.latents[0])
        diffs.update({f"{name}[{i}]": max_diff(ex[name][i], ax[name][0]) for name in ex if name.startswith("log_probs")})
    return diffs
