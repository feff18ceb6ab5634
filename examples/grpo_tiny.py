"""A complete Flow-GRPO-style loop against a running engine, on a tiny model (Wan's by default).

    python examples/grpo_tiny.py --launch            # starts its own engine on a free port
    python examples/grpo_tiny.py --url http://127.0.0.1:8000 --work-dir DIR
    python examples/grpo_tiny.py --launch --lora     # train a LoRA adapter instead of the full transformer
    python examples/grpo_tiny.py --launch --model tiny-sd3 [--lora]   # an SD3 text-to-image model
    python examples/grpo_tiny.py --launch --model tiny-flux [--lora]  # FLUX.1 with Flow-GRPO's FLUX settings
    python examples/grpo_tiny.py --launch --colocate  # trainer and engine take turns on one device

``--model`` (with ``--launch``): a built-in model or a model directory (default ``tiny``). Steps, SDE
window, guidance, noise level and learning rate left out follow the served model's family
(:data:`FAMILY_SETTINGS`): for Wan 6 steps, the SDE on steps 1 and 2, guidance 4.0, noise level 0.7; for
SD3 Flow-GRPO's SD3.5 recipe scaled down: the model's own size, steps and max_sequence_length (tiny-sd3:
64x64, 4 steps, 32 tokens), guidance 4.5, noise level 0.7, the SDE on early steps (1 and 2), groups of
``--group``; for FLUX Flow-GRPO's FLUX.1-dev recipe: 6 steps, noise level 0.9, embedded guidance 3.5, the
model's own size. Requests never name ``num_frames``: each model answers its default (one frame for images).

With ``--url``, the engine must have been started with ``--weight-root DIR`` (weight
updates are refused otherwise) and DIR given here as ``--work-dir``; a key in
``DISAGG_ADMIN_KEY`` (else ``DISAGG_API_KEY``) is sent as the bearer token.

Each iteration: groups of n rollouts per prompt (SDE on a window of steps, with
log-probs and trajectories), a toy reward from the outputs, group-normalised
advantages, a clipped policy-gradient step on the trainer's own copy of the
transformer (log-probs recomputed with the same function the engine used),
save, push to the engine, check the checksum, and check that the engine's
log-probs for a fixed request now equal the trainer's new policy's.

With ``--colocate`` trainer and engine share one device and take turns: after the rollouts the engine
releases its weights (the transformer's dropped, level 2; the text encoder's and VAE's to host memory, level
1), the trainer trains, then pushes the new transformer from memory into the sleeping engine (shared memory,
no file) and resumes every component. The engine needs ``--weight-sync-from-memory`` (``--launch`` adds it).

With ``--lora`` the transformer's base weights stay frozen and a peft LoRA on the
trainer's copy trains instead (``rl.lora``): the adapter is pushed to the engine from
memory before the first rollouts and after every update (``--lora-sync disk``: saved
as diffusers' LoRA file below the work dir and loaded by path), rollouts name it with
``lora_name``, and the check compares the engine's log-probs under the adapter with
the trainer's. The engine's base weights are never touched.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from rl import TrainerPolicy, Trajectory, save_weights, state_dict_checksum  # noqa: E402
from router.client import EngineClient  # noqa: E402

PROMPTS = ["a fox at dawn", "a red kite over the sea", "two cats on a sofa", "a lighthouse in fog"]

# Per family (the binding's short name), what a flag left out means; steps and guidance None: the model's
# default. lr: full fine-tuning's, lora_lr: with --lora.
FAMILY_SETTINGS = {
    # Wan's tiny video model: 6 steps, the SDE on steps 1 and 2, CFG 4.0.
    "wan": dict(steps=6, window=[1, 2], guidance=4.0, noise_level=0.7, lr=3e-3, lora_lr=2e-2),
    # Flow-GRPO's SD3.5 recipe (guidance 4.5, noise level 0.7, an SDE window on the early steps), scaled down:
    # the model's own steps, size and max_sequence_length (tiny-sd3: 4 steps at 64x64). Full fine-tuning at
    # 3e-3 left the second inner step 90% clipped (ratio 0.35) on tiny-sd3; 1e-3 keeps it near the trust region.
    "sd3": dict(steps=None, window=[1, 2], guidance=4.5, noise_level=0.7, lr=1e-3, lora_lr=2e-2),
    # Flow-GRPO's FLUX.1-dev recipe (6 steps, noise level 0.9, embedded guidance 3.5, no true CFG), at the
    # model's own size and max_sequence_length (tiny-flux: 64x64, 32 tokens).
    "flux": dict(steps=6, window=[1, 2], guidance=3.5, noise_level=0.9, lr=1e-3, lora_lr=2e-2),
    # Z-Image: the model's steps and guidance (tiny-z-image: 4 steps, guidance 5.0). Full fine-tuning at 1e-3 left
    # the first batch's second inner step 69% clipped (ratio 0.72) and the reward falling, at 3e-4 it rose for four
    # iterations and fell back; 1.5e-4 keeps every step unclipped.
    "z-image": dict(steps=None, window=[1, 2], guidance=None, noise_level=0.7, lr=1.5e-4, lora_lr=2e-2),
}
# Another family: its model's defaults, the SDE on early steps.
OTHER_FAMILY = dict(steps=None, window=[1, 2], guidance=None, noise_level=0.7, lr=1e-3, lora_lr=2e-2)


def family_settings(args, policy: TrainerPolicy) -> None:
    """Fill the flags left out (None) from the served model's family and defaults."""
    settings = FAMILY_SETTINGS.get(policy.family.family, OTHER_FAMILY)
    defaults = policy.info.defaults
    for key, default_key in (("steps", "num_inference_steps"), ("guidance", "guidance_scale")):
        if getattr(args, key) is None:
            setattr(args, key, settings[key] if settings[key] is not None else defaults[default_key])
    for key in ("window", "noise_level"):
        if getattr(args, key) is None:
            setattr(args, key, settings[key])
    if args.lr is None:
        args.lr = settings["lora_lr" if args.lora else "lr"]


def toy_reward(latents: torch.Tensor) -> float:
    """Brightness-like score: the mean of the first latent channel (the policy learns to raise it)."""
    return latents[0].mean().item()


def sync_lora(client: EngineClient, policy: TrainerPolicy, args, work: Path, tag: str) -> dict:
    """Hand the trainer's adapter to the engine under ``args.lora_name``; a new load makes a new version."""
    from rl.lora import push_lora, save_lora

    if args.lora_sync == "memory":
        return push_lora(client, policy, args.lora_name)
    save_lora(policy, work / f"lora-{tag}")
    return client.load_lora_adapter(args.lora_name, str(work / f"lora-{tag}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--launch", action="store_true", help="start an engine for the run")
    ap.add_argument("--model", default="tiny",
                    help="with --launch: the model to serve, a built-in name (tiny, tiny-sd3, ...) or a directory")
    ap.add_argument("--work-dir", default=None,
                    help="where the trainer saves weights: the engine's --weight-root (default: a fresh temp dir)")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="rollouts per prompt")
    ap.add_argument("--steps", type=int, default=None, help="default: the family's (Wan 6; SD3 the model's)")
    ap.add_argument("--window", type=int, nargs="+", default=None, help="SDE step indices (default: 1 2)")
    ap.add_argument("--lr", type=float, default=None,
                    help="default: the family's (Wan 3e-3, SD3 1e-3; with --lora 2e-2)")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--inner-steps", type=int, default=2, help="policy updates per batch of rollouts")
    ap.add_argument("--guidance", type=float, default=None, help="default: the family's (Wan 4.0, SD3 4.5)")
    ap.add_argument("--noise-level", type=float, default=None, help="the SDE's noise level (default 0.7)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of the full transformer")
    ap.add_argument("--lora-rank", type=int, default=4)
    ap.add_argument("--lora-alpha", type=float, default=None, help="default: the rank")
    ap.add_argument("--lora-name", default="grpo-tiny", help="the adapter's name on the engine")
    ap.add_argument("--lora-sync", choices=["memory", "disk"], default="memory",
                    help="push the adapter's tensors, or save it below the work dir and load it by path")
    ap.add_argument("--colocate", action="store_true",
                    help="trainer and engine on one device: the engine sleeps while the trainer trains")
    args = ap.parse_args()
    if args.colocate and args.lora:
        ap.error("--colocate trains the full transformer: leave out --lora")

    import transformers

    transformers.utils.logging.disable_progress_bar()
    # The engine reads pushed weights only below its --weight-root: the trainer saves there.
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="grpo-tiny-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = None
    if args.launch:
        engine = EngineProcess(args.model, extra=["--weight-root", str(work), "--weight-sync-from-memory"])
        args.url = engine.url
    client = EngineClient(args.url, api_key=os.environ.get("DISAGG_ADMIN_KEY") or os.environ.get("DISAGG_API_KEY"))
    try:
        model_dir = client.health()["model"]
        policy = TrainerPolicy(model_dir)
        family_settings(args, policy)
        rollout_kw = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, sde_step_indices=args.window,
                          return_trajectory=True, noise_level=args.noise_level)
        base_sum = state_dict_checksum(policy.transformer)
        assert client.weights_checksum()["sha256"] == base_sum, "start from the same weights"
        if args.lora:
            from rl.lora import add_lora, lora_parameters

            add_lora(policy, args.lora_rank, args.lora_alpha, seed=args.seed)
            optim = torch.optim.Adam(lora_parameters(policy), lr=args.lr)
            res = sync_lora(client, policy, args, work, "init")  # lora_B = 0: the base model, under a name
            rollout_kw["lora_name"] = args.lora_name
            print(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha or args.lora_rank}: "
                  f"{sum(p.numel() for p in lora_parameters(policy))} trainable parameters, "
                  f"'{args.lora_name}' version {res['lora_version']} on the engine")
        else:
            optim = torch.optim.Adam(policy.transformer.parameters(), lr=args.lr)
        # Each prompt's params as the engine makes them from the rollouts' fields, its text embedded once.
        params = {p: policy.params(p, **rollout_kw) for p in PROMPTS}
        embeds = {p: policy.embeddings(params[p]) for p in PROMPTS}

        print(f"{'iter':>4} {'reward':>8} {'r_std':>7} {'loss':>9} {'ratio':>6} {'clip%':>5} "
              f"{'sync_s':>6} {'ver':>3} {'sum_ok':>6} {'|engine-trainer|':>16}")
        for it in range(args.iterations):
            # 1. Rollouts: a group per prompt, seeds unique per iteration.
            batch = []
            for k, prompt in enumerate(PROMPTS):
                seed = args.seed + 1000 * it + 100 * k
                out = client.rollout(prompt, n=args.group, seed=seed, **rollout_kw)
                rewards = torch.tensor([toy_reward(s["output"]) for s in out["samples"]])
                adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                for s, a, r in zip(out["samples"], adv, rewards):
                    batch.append((prompt, s, a.item(), r.item()))
            if args.colocate:  # the device is the trainer's until the push: the transformer's weights dropped
                client.release_memory_occupation(["transformer"], level=2)
                client.release_memory_occupation(["text_encoder", "vae"], level=1)
            # 2. Clipped policy steps on the trainer's copy (the first is on-policy: ratio 1).
            for _ in range(args.inner_steps):
                optim.zero_grad()
                losses, ratios, clipped = [], [], 0
                for prompt, s, adv, _ in batch:
                    new_lp = policy.log_probs(Trajectory.from_sample(s), s["log_prob_steps"], params[prompt],
                                              embeddings=embeds[prompt])
                    ratio = torch.exp(new_lp - s["log_probs"])
                    clipped_obj = torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * adv
                    loss = -torch.minimum(ratio * adv, clipped_obj).mean() / len(batch)
                    loss.backward()
                    losses.append(loss.item() * len(batch))
                    ratios.append(ratio.detach())
                    clipped += int(((ratio - 1).abs() > args.clip).sum())
                optim.step()
            # 3. Save, push, verify.
            t0 = time.perf_counter()
            if args.lora:
                res = sync_lora(client, policy, args, work, f"iter{it}")
                sync_s = time.perf_counter() - t0
                version = res["lora_version"]
                # The engine lists the new version with the trainer's own digest; its base weights are untouched.
                from rl.lora import lora_sha256

                ok = any(a["lora_name"] == args.lora_name and a["lora_version"] == version
                         and a["sha256"] == lora_sha256(policy) for a in client.lora_adapters())
                ok = ok and client.weights_checksum()["sha256"] == base_sum
            else:
                if args.colocate:  # into the sleeping engine from memory, then every component wakes
                    res = client.update_weights_from_tensors(policy.transformer.state_dict())
                    client.resume_memory_occupation()
                else:
                    path = work / f"iter{it}.safetensors"
                    save_weights(policy.transformer, path)
                    res = client.update_weights_from_disk(path)
                sync_s = time.perf_counter() - t0
                version = res["weight_version"]
                ok = res["sha256"] == state_dict_checksum(policy.transformer) == client.weights_checksum()["sha256"]
            probe = client.rollout(PROMPTS[0], seed=123456, **rollout_kw)["samples"][0]
            if args.lora:
                ok = ok and probe["lora_name"] == args.lora_name and probe["lora_version"] == version
            with torch.no_grad():
                mine = policy.log_probs(Trajectory.from_sample(probe), probe["log_prob_steps"], params[PROMPTS[0]],
                                        embeddings=embeds[PROMPTS[0]])
            gap = (mine - probe["log_probs"]).abs().max().item()
            rewards = torch.tensor([b[3] for b in batch])
            r = torch.cat(ratios)
            print(f"{it:>4} {rewards.mean():>8.4f} {rewards.std():>7.4f} {sum(losses) / len(losses):>9.5f} "
                  f"{r.mean():>6.3f} {100 * clipped / r.numel():>5.1f} {sync_s:>6.3f} {version:>3} "
                  f"{str(ok):>6} {gap:>16.2e}", flush=True)
            if not ok or gap > 1e-5:
                raise SystemExit("engine and trainer disagree after the weight sync")
    finally:
        client.close()
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    main()
