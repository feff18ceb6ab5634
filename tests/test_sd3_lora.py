"""LoRA on SD3 (``tiny-sd3``): parity with diffusers' StableDiffusion3Pipeline + load_lora_weights + set_adapters,
mixed adapters in one batched forward, the trainer's adapter (rl.lora) saved in diffusers' SD3 format and
recomputed, adapters from memory, and one engine (real processes, loopback) serving adapters from disk and memory.

The in-process tests run the engine's own code as its stages do: the SD3 text encoder
(``common/families/sd3/text.py``), the denoise worker's text table, :class:`DenoiseTask`, ``Policy.batched_velocity``
and ``advance_all`` (``denoise_worker/stage.py``'s step), and the SD3 decoder. Adapters are read with
``common.diffusion.lora_format`` and built with ``common.diffusion.lora.build_adapter``, as the denoise worker's
adapter table does. The adapters are written by diffusers' and peft's own savers (tests/lora_fixtures.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import lora_fixtures as lf
from conftest import solo_then_concurrent
from common.diffusion.lora import build_adapter
from common.diffusion.lora_format import METADATA_KEY, LoraConfig, lora_sha256, parse_state, read_lora
from common.diffusion.policy import ModelInput, Policy
from common.diffusion.weight_storage import settle
from common.families import read_model
from common.builtin import ensure_builtin
from common.families.sd3.binding import SD3
from common.families.wan.binding import WAN
from common.protocol.messages import (
    LOG_PROBS,
    TRAJECTORY_LATENTS,
    TRAJECTORY_SIGMAS,
    TRAJECTORY_TIMESTEPS,
    GenerationParams,
    RolloutParams,
)
from denoise_worker.task import DenoiseTask
from denoise_worker.denoiser import Denoiser
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

PARITY_TOL = 1e-4  # against diffusers, fp32
BATCH_TOL = 1e-5  # a request in a mixed batch against the same request alone
RECOMPUTE_TOL = 1e-5  # the trainer's (peft) log-probs against the engine's rollout
MAX_RANK = 64
MAX_BATCH = 16
RANK, ALPHA = 4, 8.0  # the trainer's adapter: alpha != rank, so alpha / r = 2 must reach the engine
STRENGTH = 0.1  # the fixtures' factor scale: a clear but moderate change of the tiny model's output
# The peft folder's modules: one attention projection per stream, feed-forwards of both streams, the AdaLN
# modulations, the pooled-text embedder and the modules outside the blocks (every Linear sees the batch first).
PEFT_TARGETS = ["attn.to_q", "attn.add_v_proj", "ff.net.2", "ff_context.net.0.proj", "norm1.linear",
                "text_embedder.linear_1", "context_embedder", "proj_out"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# The largest difference each kind of comparison measured in this run (printed at the module's end, with -s).
MEASURED: dict[str, float] = {}


def _note(what: str, diff: float) -> float:
    MEASURED[what] = max(MEASURED.get(what, 0.0), diff)
    return diff


def _within(what: str, diff: float, tol: float) -> bool:
    return _note(what, diff) <= tol


def _rounding_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The max difference relative to the values' scale where it exceeds 1: the tiny SD3's latents reach about
    10, and float32 rounding of another batch composition moves them by about 1e-6 of that (~1e-5 absolute)."""
    return _max_diff(a, b) / max(1.0, b.float().abs().max().item())


# --- the engine's stages, in this process ----------------------------------------------------------------------


class Stages:
    """The encoder, denoise and decode workers' code on one tiny-sd3 directory, without processes."""

    def __init__(self, model_dir: Path):
        self.info = read_model(model_dir)
        self.family = self.info.family
        self.device = torch.device("cpu")
        self.policy = Policy.load(self.info, torch.float32, self.device)
        self.text_encoder = self.family.text.load_encoder(self.info, torch.float32, self.device)
        self.decoder = self.family.decoder.load(self.info, torch.float32, self.device)
        self.forwards: list[list] = []  # per forward of the last run: each row's (adapter name, scale) or None

    def adapter(self, name: str, parsed, version: int = 1):
        """As the denoise worker's AdapterTable installs one: checked against the transformer, then covered."""
        adapter = build_adapter(name, version, parsed, self.policy.experts, MAX_RANK)
        self.policy.cover(adapter)
        return adapter

    def params(self, **over) -> GenerationParams:
        d = self.info.defaults
        fields = dict(prompt="a fox at dawn", negative_prompt="blurry", height=d["height"], width=d["width"],
                      num_frames=1, num_inference_steps=d["num_inference_steps"],
                      guidance_scale=d["guidance_scale"], seed=1, max_sequence_length=d["max_sequence_length"])
        fields.update(over)
        return GenerationParams(**fields)

    def _wire(self, params: list[GenerationParams]) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
        """Every distinct prompt and negative prompt in one encoder call per token budget (the encoder worker)."""
        texts = set()
        for p in params:
            texts.add((p.prompt, p.max_sequence_length))
            if self.info.family.guidance.uses_cfg(p):
                texts.add((p.negative_prompt, p.max_sequence_length))
        out = {}
        for budget in sorted({n for _, n in texts}):
            keys = sorted(t for t in texts if t[1] == budget)
            for key, wire in zip(keys, self.text_encoder.wire_tensors([t for t, _ in keys], budget)):
                out[key] = {name: t.clone() for name, t in wire.items()}
        return out

    @torch.no_grad()
    def run(self, jobs: list[tuple[GenerationParams, tuple | None]]) -> list[DenoiseTask]:
        """Denoise ``(params, (adapter, scale) or None)`` jobs together on the denoise worker's
        :class:`Denoiser` (its batch choice, forwards of at most MAX_BATCH samples). Returns the finished tasks,
        in job order."""
        wire = self._wire([p for p, _ in jobs])
        denoiser = Denoiser(self.policy, self.device, MAX_BATCH)
        self.forwards = []
        denoiser.observe = lambda inputs: self.forwards.append(
            [None if x.lora is None else (x.lora[0].name, x.lora[1]) for x in inputs for _ in range(x.n)])
        tasks = []
        for i, (p, lora) in enumerate(jobs):
            tensors = dict(wire[(p.prompt, p.max_sequence_length)])
            if self.info.family.guidance.uses_cfg(p):
                tensors.update({self.family.text.negatives()[k]: t for k, t in wire[(p.negative_prompt,
                                                                           p.max_sequence_length)].items()})
            tasks.append(denoiser.add(str(i), denoiser.task(p, tensors, lora=lora)).task)
        while denoiser.requests:
            left = denoiser.step()
            assert all(out.error is None for out in left), [out.error for out in left]
        return tasks

    def one(self, params: GenerationParams, lora=None) -> DenoiseTask:
        return self.run([(params, lora)])[0]

    def decode(self, task: DenoiseTask) -> torch.Tensor:
        """The decode worker's frames [n, 1, H, W, 3]."""
        return self.decoder.decode(task.latents)


def _request(p: GenerationParams) -> dict:
    """The request's fields as diffusers' pipeline (and the engine's HTTP API) takes them."""
    return dict(prompt=p.prompt, negative_prompt=p.negative_prompt, seed=p.seed, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                max_sequence_length=p.max_sequence_length)


def _trajectory(task: DenoiseTask, i: int = 0) -> Trajectory:
    x = task.extras()
    return Trajectory(x[TRAJECTORY_LATENTS.name][i], x[TRAJECTORY_TIMESTEPS.name], x[TRAJECTORY_SIGMAS.name])


ROLLOUT = RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True)


# --- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This process's tiny matmuls on one thread: on a busy CPU, OpenMP's threads wait on each other far longer
    than the work takes (the engine's workers size their own threads). Prints what was measured, at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print("\nmax differences measured:", {k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})


@pytest.fixture(scope="module")
def sd3_dir() -> Path:
    return ensure_builtin("tiny-sd3")


@pytest.fixture(scope="module")
def stages(sd3_dir) -> Stages:
    return Stages(sd3_dir)


@pytest.fixture(scope="module")
def made(sd3_dir, lora_root) -> dict[str, lf.Adapter]:
    d = lora_root / "test_sd3_lora"
    return {
        # diffusers' StableDiffusion3Pipeline.save_lora_weights, with metadata: rank 4, alpha 8 (scale 2),
        # Flow-GRPO's SD3 targets
        "a": lf.make_sd3_diffusers_lora(sd3_dir, d / "a", 4, 8, seed=1, strength=STRENGTH),
        # without metadata: alpha = rank, as diffusers assumes
        "a0": lf.make_sd3_diffusers_lora(sd3_dir, d / "a0", 4, 8, seed=2, with_metadata=False, strength=STRENGTH),
        # a peft folder (PeftModel.save_pretrained on SD3Transformer2DModel): rank 6, alpha 12, other modules
        "p": lf.make_sd3_peft_lora(sd3_dir, d / "p", 6, 12, PEFT_TARGETS, seed=3, strength=STRENGTH),
    }


@pytest.fixture(scope="module")
def served(stages, made, lora_root) -> dict:
    """Each made adapter read and built by the engine's code."""
    return {name: stages.adapter(name, read_lora(str(a.path), [str(lora_root)])) for name, a in made.items()}


@pytest.fixture(scope="module")
def trained(sd3_dir, lora_root):
    """The trainer's adapter: rl.add_lora on a TrainerPolicy (the family's default targets), seeded factors,
    then rl.save_lora (StableDiffusion3Pipeline's format)."""
    from rl.lora import add_lora, save_lora

    policy = TrainerPolicy(sd3_dir)
    add_lora(policy, RANK, ALPHA, seed=0)
    lf.randomise_lora(policy.transformer, seed=7, strength=STRENGTH)
    path = save_lora(policy, lora_root / "test_sd3_lora" / "trained")
    return policy, path


# --- (a) parity with diffusers ----------------------------------------------------------------------------------


def _keys_and_header(file: Path) -> tuple[list[str], dict]:
    with safe_open(str(file), framework="pt") as f:
        return list(f.keys()), f.metadata() or {}


def test_sd3_adapter_files_are_diffusers_format(made):
    for name, has_metadata in (("a", True), ("a0", False)):
        keys, header = _keys_and_header(made[name].path / lf.DIFFUSERS_FILE)
        assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
        assert "transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight" in keys
        assert all(k.startswith("transformer.transformer_blocks.") for k in keys)
        assert (METADATA_KEY in header) == has_metadata
    meta = json.loads(_keys_and_header(made["a"].path / lf.DIFFUSERS_FILE)[1][METADATA_KEY])
    assert (meta["transformer.r"], meta["transformer.lora_alpha"]) == (4, 8)
    assert set(meta["transformer.target_modules"]) == set(lf.SD3_ATTN)
    assert (made["p"].path / "adapter_config.json").is_file()
    assert "transformer_blocks.0.norm1.linear.lora_A.weight" in made["p"].state_dict


PARITY = [("a", 1.0, {}), ("a", 0.5, {"seed": 2}), ("a0", 1.0, {"seed": 3}), ("p", 1.0, {"seed": 4}),
          ("p", 0.5, {"seed": 5}), ("p", 0.5, {"seed": 6, "guidance_scale": 1.0})]


@pytest.mark.parametrize("name,scale,over", PARITY,
                         ids=["file-s1", "file-s0.5", "file-no-metadata", "peft-s1", "peft-s0.5", "peft-s0.5-no-cfg"])
def test_engine_lora_matches_diffusers(sd3_dir, stages, made, served, lora_root, name, scale, over):
    p = stages.params(**over)
    task = stages.one(p, (served[name], scale))
    latents, frames = task.latents[0], stages.decode(task)[0]
    path = lf.diffusers_twin(made["p"], lora_root / "test_sd3_lora" / "p-twin") if name == "p" else made[name].path
    ref_latents = lf.sd3_lora_output(sd3_dir, [(path, name, scale)], **_request(p), output_type="latent")
    ref_frames = lf.sd3_lora_output(sd3_dir, [(path, name, scale)], **_request(p), output_type="np")
    assert _within("(a) engine vs diffusers, latents", _max_diff(latents, ref_latents), PARITY_TOL)
    assert _within("(a) engine vs diffusers, frames", _max_diff(frames, ref_frames), PARITY_TOL)
    assert _max_diff(latents, stages.one(p).latents[0]) > 1e-2  # the adapter matters


def test_scale_zero_and_no_adapter_are_the_base_model(sd3_dir, stages, served):
    p = stages.params(seed=8)
    base = stages.one(p).latents[0]
    assert _within("(a) scale 0 vs no adapter", _max_diff(stages.one(p, (served["a"], 0.0)).latents[0], base),
                   BATCH_TOL)
    ref = lf.sd3_lora_output(sd3_dir, [], **_request(p), output_type="latent")
    assert _within("(a) engine vs diffusers, latents", _max_diff(base, ref), PARITY_TOL)


# --- (b) mixed adapters in one forward --------------------------------------------------------------------------


def test_mixed_adapters_in_one_forward_equal_their_solo_runs(stages, served):
    a, a0, pf = served["a"], served["a0"], served["p"]
    plan = [  # (adapter and scale, request fields): other prompts, seeds, guidance, steps, n and an SDE rollout
        ((a, 1.0), dict(prompt="mix 0", seed=10)),
        (None, dict(prompt="mix 1", seed=11, guidance_scale=6.0)),
        ((pf, 0.5), dict(prompt="mix 0", seed=12, num_inference_steps=6)),
        ((a, 0.7), dict(prompt="mix 2", seed=13, guidance_scale=1.0)),
        ((a0, 1.2), dict(prompt="mix 1", seed=14, n=2)),
        (None, dict(prompt="mix 2", seed=15, guidance_scale=1.0, num_inference_steps=3)),
        ((pf, 1.0), dict(prompt="mix 0", seed=16, rollout=ROLLOUT)),
    ]
    jobs = [(stages.params(**over), lora) for lora, over in plan]
    solo = [stages.one(p, lora) for p, lora in jobs]
    mixed = stages.run(jobs)
    rows = [Counter(r) for r in stages.forwards]
    assert sum(rows[0].values()) == sum(p.n for p, _ in jobs)  # every sample in the first forward ...
    assert max(len(c) for c in rows) >= 4  # ... with different adapters, scales and none in one forward
    for (p, lora), s, m in zip(jobs, solo, mixed):
        assert _within("(b) mixed vs solo, latents (relative)", _rounding_gap(m.latents, s.latents), BATCH_TOL), \
            (p.prompt, p.seed)
        _note("(b) mixed vs solo, latents (absolute)", _max_diff(m.latents, s.latents))
        if p.rollout is not None:
            assert s.record.log_prob_steps == m.record.log_prob_steps
            assert _within("(b) mixed vs solo, log-probs (relative)",
                           _rounding_gap(m.extras()[LOG_PROBS.name], s.extras()[LOG_PROBS.name]), BATCH_TOL)
    for (p, lora), s in zip(jobs, solo):  # and the adapters matter
        if lora is not None and lora[1] != 0:
            assert _max_diff(s.latents, stages.one(p).latents) > 1e-2


# --- (c) the trainer's adapter ----------------------------------------------------------------------------------


def test_trainer_default_targets_and_saved_format(trained):
    from rl.lora import DEFAULT_TARGETS, lora_config

    policy, path = trained
    cfg = lora_config(policy)
    assert set(cfg.target_modules) == set(SD3.transformer.lora_targets) == set(lf.SD3_ATTN)
    assert WAN.transformer.lora_targets == DEFAULT_TARGETS == ("to_q", "to_k", "to_v", "to_out.0")  # Wan's: unchanged
    assert path.name == lf.DIFFUSERS_FILE
    keys, header = _keys_and_header(path)
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in keys
    assert "transformer.transformer_blocks.1.attn.add_q_proj.lora_B.weight" in keys
    assert all(k.startswith("transformer.") for k in keys)
    # The last block's text stream is pre-only: no to_add_out there, as peft found the modules.
    n_modules = len({k.rsplit(".lora_", 1)[0] for k in keys})
    assert n_modules == sum(1 for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A"))
    meta = json.loads(header[METADATA_KEY])
    assert (meta["transformer.r"], meta["transformer.lora_alpha"]) == (RANK, ALPHA)


def test_saved_adapter_loads_into_diffusers_sd3_pipeline(sd3_dir, trained):
    """StableDiffusion3Pipeline.load_lora_weights reads the file back as the same adapter (rank, alpha, values)."""
    from rl.lora import set_lora_scale

    policy, path = trained
    g = torch.Generator().manual_seed(0)
    c = policy.transformer.config
    inputs = dict(hidden_states=torch.randn(1, 16, 8, 8, generator=g), timestep=torch.tensor([700.0]),
                  encoder_hidden_states=torch.randn(1, 20, c.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g), return_dict=False)
    pipe = lf.sd3_pipe(sd3_dir)
    pipe.load_lora_weights(str(path.parent), adapter_name="trained")
    settle(pipe.transformer)  # laid out as the trainer's copy: kernels round by alignment, not by bytes alone
    try:
        cfg = pipe.transformer.peft_config["trained"]
        assert (cfg.r, cfg.lora_alpha) == (RANK, ALPHA)
        with torch.no_grad():
            for scale in (1.0, 0.5):
                set_lora_scale(policy, scale)
                pipe.set_adapters(["trained"], [scale])
                assert _within("(c) diffusers-loaded file vs trainer, transformer output",
                               _max_diff(pipe.transformer(**inputs)[0], policy.transformer(**inputs)[0]), 1e-6)
    finally:
        set_lora_scale(policy, 1.0)
        pipe.unload_lora_weights()


def test_trainer_recomputes_a_rollout_made_with_its_saved_adapter(stages, trained, lora_root):
    from rl.lora import set_lora_scale

    policy, path = trained
    adapter = stages.adapter("trained", read_lora(str(path.parent), [str(lora_root)]))
    p = stages.params(seed=21, num_inference_steps=5, rollout=ROLLOUT)
    base = stages.one(p)
    try:
        for scale in (1.0, 0.5):
            task = stages.one(p, (adapter, scale))
            assert _max_diff(task.latents, base.latents) > 1e-2
            traj, steps = _trajectory(task), task.record.log_prob_steps
            assert steps == list(range(p.num_inference_steps))
            set_lora_scale(policy, scale)
            with torch.no_grad():
                mine = policy.log_probs(traj, steps, p)
                # the guided velocity itself at every step: peft's layers against the engine's hooks
                cond, uncond = policy.embeddings(p)
                for i in steps:
                    x = traj.latents[i : i + 1]
                    v_trainer = policy.velocity(x, traj.timesteps[i], cond, uncond, p)
                    v_engine = stages.policy.velocity(ModelInput(x, traj.timesteps[i], task.cond, task.uncond,
                                                                 p.guidance_scale, lora=(adapter, scale)))
                    assert _within("(c) trainer vs engine, guided velocity", _max_diff(v_trainer, v_engine),
                                   RECOMPUTE_TOL)
            engine = task.extras()[LOG_PROBS.name][0]
            assert _within("(c) trainer recompute vs rollout, log-probs", _max_diff(mine, engine), RECOMPUTE_TOL), \
                scale
        set_lora_scale(policy, 0.0)  # the trainer's base model computes another policy
        with torch.no_grad():
            assert _max_diff(policy.log_probs(traj, steps, p), engine) > 1e-3
    finally:
        set_lora_scale(policy, 1.0)


# --- (d) an adapter from memory ---------------------------------------------------------------------------------


def test_adapter_from_memory_equals_the_file(stages, trained, lora_root):
    from rl.lora import lora_sha256 as trainer_sha256
    from rl.lora import lora_state_dict

    policy, path = trained
    state = lora_state_dict(policy)
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in state
    memory = parse_state(state, LoraConfig(r=RANK, lora_alpha=ALPHA))
    disk = read_lora(str(path.parent), [str(lora_root)])
    assert memory.keys() == disk.keys() == {"transformer"}
    mods_m, mods_d = memory["transformer"].modules, disk["transformer"].modules
    assert mods_m.keys() == mods_d.keys() and len(mods_m) > 0
    for mod in mods_m:
        (am, bm, sm), (ad, bd, sd) = mods_m[mod], mods_d[mod]
        assert torch.equal(am, ad) and torch.equal(bm, bd) and sm == sd == ALPHA / RANK, mod
    assert lora_sha256(memory) == lora_sha256(disk) == trainer_sha256(policy)
    from_memory, from_disk = stages.adapter("mem", memory), stages.adapter("disk", disk)
    assert from_memory.sha256 == from_disk.sha256
    p = stages.params(seed=31)
    assert torch.equal(stages.one(p, (from_memory, 0.8)).latents, stages.one(p, (from_disk, 0.8)).latents)


# --- an engine: adapters from disk and memory, concurrent requests ----------------------------------------------


@pytest.fixture(scope="module")
def client(engine_factory, lora_root):
    eng = engine_factory("tiny-sd3", extra=["--weight-root", str(lora_root)])
    with EngineClient(eng.url) as c:
        yield c


def test_engine_serves_sd3_adapters_from_disk_and_memory_concurrently(sd3_dir, client, stages, made, trained):
    from rl.lora import lora_state_dict, push_lora

    policy, trained_path = trained
    health = client.health()
    assert health["family"] == "sd3", health
    disk = client.load_lora_adapter("A", str(made["a"].path))
    assert disk["rank"] == 4 and disk["experts"] == ["transformer"], disk
    mem = push_lora(client, policy, "B")  # the trainer's tensors over HTTP
    in_process_b = stages.adapter("B", parse_state(lora_state_dict(policy), LoraConfig(r=RANK, lora_alpha=ALPHA)))
    assert mem["rank"] == RANK and mem["sha256"] == in_process_b.sha256, mem
    steps = 10  # long enough for the concurrent requests to meet in the denoise worker's forwards
    plan = [("A", 1.0, "frames", 1), ("B", 1.0, "latent", 2), (None, None, "frames", 3), ("A", 0.6, "latent", 4),
            ("B", 0.5, "frames", 5), (None, None, "latent", 6)]
    reqs = []
    for name, scale, output_type, seed in plan:
        p = stages.params(seed=seed, num_inference_steps=steps, prompt=f"a kite {seed % 3}")
        body = {**_request(p), "output_type": output_type}
        if name is not None:
            body.update(lora_name=name, lora_scale=scale)
        reqs.append(("/generate", body))
    solo, mixed = solo_then_concurrent(client, reqs)
    count = Counter(body.get("lora_name") for _, body in reqs)
    shared = any(m["batch"] > count[body.get("lora_name")] for (_, body), m in zip(reqs, mixed))
    for (name, scale, output_type, seed), (_, body), s, m in zip(plan, reqs, solo, mixed):
        assert s["lora_name"] == m["lora_name"] == name
        assert _within("(4) engine concurrent vs solo (relative)", _rounding_gap(m["output"], s["output"]),
                       BATCH_TOL), (name, scale)
        p = stages.params(seed=seed, num_inference_steps=steps, prompt=body["prompt"])
        kind = "np" if output_type == "frames" else "latent"
        if name == "B":  # from memory: the in-process engine's result with the same tensors
            task = stages.one(p, (in_process_b, scale))
            want = stages.decode(task)[0] if output_type == "frames" else task.latents[0]
            assert _within(f"(4) engine vs in-process, {output_type}", _max_diff(m["output"], want), PARITY_TOL), \
                (name, scale, output_type)
        # diffusers' own: the disk adapter's file, the trainer's tensors as rl.save_lora wrote them, or none
        adapters = {"A": [(made["a"].path, "A", scale)], "B": [(trained_path.parent, "B", scale)], None: []}[name]
        want = lf.sd3_lora_output(sd3_dir, adapters, **_request(p), output_type=kind)
        assert _within(f"(4) engine vs diffusers, {output_type}", _max_diff(m["output"], want), PARITY_TOL), \
            (name, scale, output_type)
    assert shared, [m["batch"] for m in mixed]  # requests with different adapters (and none) shared forwards

    # A rollout with the adapter from memory: the trainer recomputes its log-probs.
    p = stages.params(seed=9, num_inference_steps=5)
    s = client.rollout(**_request(p), lora_name="B", sde_type="sde", noise_level=0.7, return_trajectory=True,
                       output_type="latent")["samples"][0]
    assert s["lora_name"] == "B" and s["lora_version"] == mem["lora_version"]
    with torch.no_grad():
        mine = policy.log_probs(Trajectory.from_sample(s), s["log_prob_steps"], p)
    assert _within("(4) trainer recompute vs engine rollout, log-probs", _max_diff(mine, s["log_probs"]),
                   RECOMPUTE_TOL)
    for name in ("A", "B"):
        client.unload_lora_adapter(name)
    assert not [a for a in client.lora_adapters() if a.get("lora_name") in ("A", "B")]
