"""Per family (one tiny built-in per pipeline), each stage's outputs at 2, 3 and 4 torch threads against 1: the
largest absolute difference (0: the same bits). Components as the workers lay them out (settle_held), computed at
the given count (what ``--cpu-numerics threaded`` does; "invariant" computes at one): text encode, the image side
(80x120 and 130x70 pictures), one step's forward alone and batched with a second request, the decode.

    .venv/bin/python bench/thread_invariance.py [BUILTIN ...]
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import msgspec
import torch
from common.builtin import ensure_builtin
from common.diffusion import text_roles
from denoise_worker.forward import step_velocities
from family_builtins import tiny_per_pipeline
from family_harness import InProcess, gradient_picture

THREADS = (1, 2, 3, 4)

def flat(x):
    if isinstance(x, torch.Tensor): return [x]
    if isinstance(x, dict): return [t for k in sorted(x) for t in flat(x[k])]
    if isinstance(x, (list, tuple)): return [t for v in x for t in flat(v)]
    if hasattr(x, "frames"): return flat([x.frames, x.audio])
    return []

def sweep(fn):
    outs = []
    for t in THREADS:
        torch.set_num_threads(t)
        outs.append(flat(fn()))
    torch.set_num_threads(1)
    return [max(((a.float() - b.float()).abs().max().item() if a.numel() else 0.0) for a, b in zip(outs[0], o)) for o in outs[1:]]

def fmt(d): return " ".join("0" if x == 0 else f"{x:.1e}" for x in d)

def measure(name, path, sizes=((80, 120), (130, 70))):
    torch.set_num_threads(1)
    eng = InProcess(path)
    fam = eng.family
    p = eng.params()
    rows = {}
    texts = [(p.prompt, False), ("blurry, low quality", True)]
    takes = fam.condition.image_input(eng.info)
    n_img = fam.condition.images_allowed(eng.info)
    pics = [gradient_picture(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    seen = [[pics[0]]] * 2 if (takes and fam.condition.text_sees_images()) else None
    rows["text"] = sweep(lambda: text_roles.encode(eng.encoder, texts, p.max_sequence_length, seen))
    if takes:
        for (h, w), pic in zip(sizes, pics):
            rows[f"image {h}x{w}"] = sweep(lambda: eng.image_wire(p, pic if n_img == 1 else [pic]))
    image = pics[0] if takes else None
    if image is not None and n_img > 1: image = [image]
    torch.set_num_threads(1)
    t1 = eng.task(p, image=image)
    t2 = eng.task(msgspec.structs.replace(p, seed=7), image=image)
    before = lambda xs: None
    rows["forward alone"] = sweep(lambda: [g.velocity for g in step_velocities(eng.policy, [t1], 8, before)])
    rows["forward batch2"] = sweep(lambda: [g.velocity for g in step_velocities(eng.policy, [t1, t2], 8, before)])
    lat = t1.latents
    rows["decode"] = sweep(lambda: eng.decoded(lat, p))
    for k, v in rows.items():
        print(f"| {name} | {k} | {' | '.join(fmt(v).split())} |", flush=True)

if __name__ == "__main__":
    want = sys.argv[1:] 
    print("| built-in | stage | 2 threads | 3 threads | 4 threads |\n|---|---|---|---|---|")
    todo = tiny_per_pipeline()
    for pipe, b in todo.items():
        if want and b not in want and pipe not in want: continue
        t0 = time.time()
        measure(b, ensure_builtin(b))
        print(f"<!-- {b} {time.time() - t0:.1f}s -->", flush=True)
