"""Diagnosing Stage1: how far is the student's one-jump flow map from the teacher's own ODE?

    python benchmarks/flowmap_error.py --teacher runs/bench/sft --student runs/bench/stage1 \
        [--samples 16] [--steps 1,2,4] [--ode-steps 200] [--start data|teacher] \
        [--teacher-context full|tf] [--json FILE]

For each pair (t, s) the 1-, 2- and 4-step flow-map samplers use (the grid of
trainer.stages.tf_anyflow.sample_flowmap: sigma_k = S(1 - k/n; shift), the student's own
shift), on held-out clips of the checkpoints' synthetic data (the same generator, frame count
and size, captions included, from `--data-seed`, a seed no config uses), it compares

- the student's map X^S_{t->s}(x_t): for a two-time model one jump, x_t - (t - s) u(x_t, t, s),
  through the forward the student trains and samples with (causal: teacher forcing over
  [clean context | noisy], which equals the sampler's KV-cache forward); for a single-time model
  (an SFT teacher, a Stage2 student) its own Euler ODE with `--student-ode-steps`;
- the teacher's ODE solution X^T_{t->s}(x_t): Euler from t to s with ceil(K (t - s)) steps
  (K = `--ode-steps` over the whole [0, 1]), guided with w = the student's
  `anyflow_fuse_guidance_scale` (what Stage1's target fuses; `--guidance`), and unguided.

Columns (each a per-sample relative error, averaged over the samples):
- `map_w`:  ||X^S - X^T_w|| / ||X^T_w - x_t||       the map against the guided teacher ODE
- `map_1`:  ||X^S - X^T_1|| / ||X^T_1 - x_t||       ... against the unguided teacher ODE
- `diag_w`, `diag_1`: ||u^S(x_t, t, t) - v^T_w(x_t, t)|| / ||v^T_w(x_t, t)|| at the pair's start t:
  the diagonal (s -> t), i.e. the instantaneous velocity, guided and unguided
- `self`:   ||X^S - X^S_ode|| / ||X^S_ode - x_t||   the jump against the student's own diagonal
  velocity integrated with the same Euler steps ("the map is wrong" for its own velocity)
- `ode_w`:  ||X^S_ode - X^T_w|| / ||X^T_w - x_t||   the student's velocity, integrated, against
  the guided teacher ("the velocity is wrong")
- `chunks_w`: `map_w` per causal chunk (a chunk's frames only): how the error grows along the
  clip under teacher forcing.

A small `diag_w` with a large `map_w` and `self` says the map does not follow the student's own
(right) velocity; a large `ode_w` says the velocity itself is off. Noisy inputs: `--start data`
(default) puts x_t on the straight path of the held-out clip, x_t = (1 - t) x0 + t n, the
distribution Stage1 trains on, with the clip itself as the clean teacher-forcing context;
`--start teacher` puts x_t on the guided teacher's own trajectory from the noise n, with the
teacher's sample from n (its ODE to 0) as the context: the states a perfect few-step sampler
would visit. The teacher is bidirectional: `--teacher-context full` (default) integrates the
whole clip, every frame from t to s; `tf` gives it what the causal student sees, per chunk:
the frames before the chunk clean (the context at t = 0), the chunk and those after it moving
from t to s, and reads the chunk.

The models are rebuilt from their checkpoints by trainer.evaluation.inference (EMA weights by
default), sampled in the checkpoint's compute dtype as `relay eval` does. Writes the rows as
JSON (`--json`) and prints a markdown table. A model compared with itself (`--student` the
teacher, same guidance and steps) scores 0 (tests/test_flowmap_error.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/flowmap_error.py`: make the repo importable
    sys.path.insert(0, str(REPO))

DEFAULT_DATA_SEED = 424242  # no config generates data from it (configs use 0-2 and 10-13)


def sampler_pairs(steps_list, shift: float) -> list[dict]:
    """(steps, k, t, s) of every jump of the n-step flow-map samplers, normalised times:
    sample_flowmap's grid sigma_k = S(1 - k/n; shift)."""
    from trainer.diffusion import flow

    pairs = []
    for n in steps_list:
        sigmas = flow.sampling_sigmas(n, shift, dtype=__import__("torch").float64).tolist()
        pairs += [{"steps": n, "k": k, "t": sigmas[k], "s": sigmas[k + 1]} for k in range(n)]
    return pairs


class Model:
    """One loaded checkpoint and the calls the comparison makes on it."""

    def __init__(self, loaded, device):
        import torch

        self.loaded = loaded
        self.model = loaded.model
        self.args = loaded.args
        self.device = torch.device(device)
        geometry = self.model.geometry
        self.chunk = geometry.causal_chunk_frames
        self.two_time = bool(geometry.two_time)
        self.dtype = next(self.model.parameters()).dtype

    def captions(self, prompts):
        text, mask = self.loaded.text_encoder.encode(list(prompts))
        null_text, null_mask = self.loaded.text_encoder.null_embedding()
        return (text.to(self.device), mask.to(self.device), null_text.to(self.device),
                null_mask.to(self.device))

    def autocast(self):
        from trainer.stages.base import autocast_context

        return autocast_context(self.device, self.args.get("dtype", "auto"))

    def velocity(self, x, t_frames, r_frames, context, caption, guidance: float):
        """The prediction for latents x [B, C, T, H, W] at raw per-frame times t_frames [B, T]
        (r_frames: the second time of a two-time model, or None), guided u + w (c - u).
        A causal model runs its teacher-forcing forward with `context` as the clean half (each
        chunk sees the clean chunks before it); a bidirectional one its plain forward."""
        from trainer.diffusion import flow

        text, mask, null_text, null_mask = caption
        to = self.dtype
        if self.chunk is not None:
            def call(y, t, txt, msk, clean, r=None):
                return self.model.forward_teacher_forcing(y.to(to), clean.to(to), t, txt, msk,
                                                          r=r)

            kw = {"clean": context}
        else:
            def call(y, t, txt, msk, r=None):
                return self.model(y.to(to), t, txt, msk, r=r)

            kw = {}
        if r_frames is not None:
            kw["r"] = r_frames
        with self.autocast():
            out = flow.guided(call, x, t_frames, text, mask, null_text, null_mask, guidance, **kw)
        return out.to(x.dtype)


def _times(sigma: float, like, clean: int = 0):
    """Raw per-frame times [B, T] at noise level sigma, the first `clean` frames at 0."""
    import torch

    from trainer.diffusion.flow import NUM_TRAIN_TIMESTEPS

    b, frames = like.shape[0], like.shape[2]
    t = torch.full((b, frames), sigma * NUM_TRAIN_TIMESTEPS, dtype=like.dtype, device=like.device)
    t[:, :clean] = 0.0
    return t


def euler_steps(t: float, s: float, ode_steps: int) -> int:
    """Euler steps of an interval [s, t] at `ode_steps` over the whole [0, 1]."""
    return max(1, math.ceil(ode_steps * (t - s) - 1e-9))


def ode(model: Model, x, t: float, s: float, steps: int, context, caption, guidance: float,
        clean: int = 0):
    """Euler from noise level t to s in `steps` uniform steps with the model's (guided) diagonal
    velocity (a two-time model at r = t); the first `clean` frames are the context's, at t = 0."""
    import torch

    sigmas = torch.linspace(t, s, steps + 1, dtype=torch.float64).tolist()
    x = x.clone()
    if clean:
        x[:, :, :clean] = context[:, :, :clean]
    for a, b in zip(sigmas[:-1], sigmas[1:]):
        times = _times(a, x, clean)
        v = model.velocity(x, times, times if model.two_time else None, context, caption,
                           guidance)
        x = x + (b - a) * v
        if clean:
            x[:, :, :clean] = context[:, :, :clean]
    return x


def reference(model: Model, x, t, s, steps, context, caption, guidance, how: str, chunk):
    """A bidirectional (or causal) model's ODE solution from t to s: the whole clip (`full`), or
    per chunk with the frames before it clean (`tf`), each chunk read from its own run."""
    if how == "full" or model.chunk is not None or chunk is None:
        # A causal model's teacher-forcing forward already gives each chunk the clean chunks
        # before it, so all chunks move at once.
        return ode(model, x, t, s, steps, context, caption, guidance)
    out = x.clone()
    for start in range(0, x.shape[2], chunk):
        done = ode(model, x, t, s, steps, context, caption, guidance, clean=start)
        out[:, :, start:start + chunk] = done[:, :, start:start + chunk]
    return out


def jump(model: Model, x, t: float, s: float, context, caption, guidance: float):
    """A two-time model's one flow-map jump X_{t->s}(x) = x - (t - s) u(x, t, s)."""
    u = model.velocity(x, _times(t, x), _times(s, x), context, caption, guidance)
    return x - (t - s) * u


def relative(a, b, x, frames=None):
    """Per-sample ||a - b|| / ||b - x|| over all elements (or the frames slice): [B]."""
    if frames is not None:
        a, b, x = a[:, :, frames], b[:, :, frames], x[:, :, frames]
    num = (a - b).flatten(1).norm(dim=1)
    den = (b - x).flatten(1).norm(dim=1).clamp_min(1e-12)
    return num / den


def held_out(args, count: int, seed: int):
    """`count` clips [B, C, T, H, W] and their captions from the run's synthetic generator."""
    import numpy as np
    import torch

    from trainer.data.synthetic import make_sample

    if args.get("vae_path"):
        raise SystemExit("flowmap_error: the checkpoint trained through a VAE; this diagnostic "
                         "renders its held-out clips as pixels (identity-VAE synthetic data).")
    generator = args.get("synthetic_generator", "shapes")
    clips, captions = [], []
    for i in range(count):
        spec, latent = make_sample(generator, seed, i, num_frames=args["synthetic_num_frames"],
                                   height=args["synthetic_height"],
                                   width=args["synthetic_width"])
        clips.append(np.asarray(latent, dtype=np.float32))
        captions.append(spec.caption)
    return torch.from_numpy(np.stack(clips)), captions


def measure(ns: argparse.Namespace) -> dict:
    import torch

    from trainer.evaluation.inference import load_model_for_inference
    from trainer.stages.registry import sampling_plan

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    teacher = Model(load_model_for_inference(ns.teacher, ns.weights, device=device), device)
    student = Model(load_model_for_inference(ns.student, ns.weights, device=device), device)
    for name, m in (("teacher", teacher), ("student", student)):
        if m.args.get("synthetic_seed") == ns.data_seed:
            raise SystemExit(f"flowmap_error: --data-seed {ns.data_seed} is the {name}'s training "
                             f"seed; pick another for held-out clips.")
    plan = sampling_plan(student.args)
    shift = plan.shift if ns.shift is None else ns.shift
    if ns.guidance is not None:
        w = ns.guidance
    elif student.args.get("stage") == "tf_anyflow":
        w = float(student.args["anyflow_fuse_guidance_scale"])
    else:
        w = float(plan.guidance)
    student_w = float(plan.guidance) if ns.student_guidance is None else ns.student_guidance
    student_ode_steps = ns.student_ode_steps or ns.ode_steps
    chunk = student.chunk or teacher.chunk

    x0, prompts = held_out(teacher.args, ns.samples, ns.data_seed)
    if tuple(x0.shape[1:]) != tuple(teacher.loaded.latent_shape):
        raise SystemExit(f"flowmap_error: held-out clips {tuple(x0.shape[1:])} are not the "
                         f"teacher's latents {tuple(teacher.loaded.latent_shape)}")
    x0 = x0.to(device)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(ns.seed)).to(device)
    t_caption, s_caption = teacher.captions(prompts), student.captions(prompts)

    pairs = sampler_pairs(ns.steps, shift)
    started = time.perf_counter()
    with torch.no_grad():
        if ns.start == "teacher":
            context = ode(teacher, noise, 1.0, 0.0, ns.ode_steps, None, t_caption, w)
        else:
            context = x0
        rows = []
        for pair in pairs:
            t, s = pair["t"], pair["s"]
            if ns.start == "teacher":
                x_t = (noise if t >= 1.0 else
                       ode(teacher, noise, 1.0, t, euler_steps(1.0, t, ns.ode_steps), None,
                           t_caption, w))
            else:
                x_t = (1 - t) * x0 + t * noise
            k_teacher = euler_steps(t, s, ns.ode_steps)
            ref_w = reference(teacher, x_t, t, s, k_teacher, context, t_caption, w,
                              ns.teacher_context, chunk)
            ref_1 = reference(teacher, x_t, t, s, k_teacher, context, t_caption, 1.0,
                              ns.teacher_context, chunk)
            k_student = euler_steps(t, s, student_ode_steps)
            student_ode = reference(student, x_t, t, s, k_student, context, s_caption,
                                    student_w, ns.teacher_context, chunk)
            mapped = (jump(student, x_t, t, s, context, s_caption, student_w)
                      if student.two_time else student_ode)
            # The diagonal: instantaneous velocities at the pair's start (r = t).
            times = _times(t, x_t)
            v_s = student.velocity(x_t, times, times if student.two_time else None, context,
                                   s_caption, student_w)
            diag_w = reference(teacher, x_t, t, t - 1e-3, 1, context, t_caption, w,
                               ns.teacher_context, chunk)
            diag_1 = reference(teacher, x_t, t, t - 1e-3, 1, context, t_caption, 1.0,
                               ns.teacher_context, chunk)
            v_w, v_1 = (x_t - diag_w) / 1e-3, (x_t - diag_1) / 1e-3
            zero = torch.zeros_like(x_t)
            frames = x_t.shape[2]
            chunks = ([slice(a, min(a + chunk, frames)) for a in range(0, frames, chunk)]
                      if chunk else [slice(0, frames)])
            row = {**pair, "teacher_euler_steps": k_teacher,
                   "student": "jump" if student.two_time else f"euler {k_student}",
                   "map_w": relative(mapped, ref_w, x_t).mean().item(),
                   "map_1": relative(mapped, ref_1, x_t).mean().item(),
                   "diag_w": relative(v_s, v_w, zero).mean().item(),
                   "diag_1": relative(v_s, v_1, zero).mean().item(),
                   "self": relative(mapped, student_ode, x_t).mean().item(),
                   "ode_w": relative(student_ode, ref_w, x_t).mean().item(),
                   "chunks_w": [relative(mapped, ref_w, x_t, c).mean().item() for c in chunks]}
            rows.append(row)
            if ns.verbose:
                print(json.dumps(row), flush=True)
    keys = ("map_w", "map_1", "diag_w", "diag_1", "self", "ode_w")
    means = {}
    for n in ns.steps:
        picked = [r for r in rows if r["steps"] == n]
        means[str(n)] = {k: sum(r[k] for r in picked) / len(picked) for k in keys}
    means["all"] = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "teacher": str(teacher.loaded.checkpoint), "teacher_weights": teacher.loaded.weights,
            "student": str(student.loaded.checkpoint), "student_weights": student.loaded.weights,
            "student_two_time": student.two_time, "chunk_frames": chunk,
            "guidance": w, "student_guidance": student_w, "shift": shift,
            "ode_steps": ns.ode_steps, "student_ode_steps": student_ode_steps,
            "start": ns.start, "teacher_context": ns.teacher_context,
            "samples": ns.samples, "data_seed": ns.data_seed, "seed": ns.seed,
            "device": device, "seconds": time.perf_counter() - started,
            "rows": rows, "means": means}


def markdown(found: dict) -> str:
    lines = [f"Flow-map error of {found['student']} ({found['student_weights']}) against the "
             f"teacher {found['teacher']} ({found['teacher_weights']}): guidance w = "
             f"{found['guidance']:g}, {found['ode_steps']} Euler steps over [0, 1], shift "
             f"{found['shift']:g}, start {found['start']}, teacher context "
             f"{found['teacher_context']}, {found['samples']} held-out clips.", "",
             "| steps | k | t | s | map_w | map_1 | diag_w | diag_1 | self | ode_w | "
             "map_w per chunk |", "|" + " --- |" * 11]
    for r in found["rows"]:
        per = " / ".join(f"{v:.3f}" for v in r["chunks_w"])
        lines.append(f"| {r['steps']} | {r['k']} | {r['t']:.3f} | {r['s']:.3f} | "
                     f"{r['map_w']:.3f} | {r['map_1']:.3f} | {r['diag_w']:.3f} | "
                     f"{r['diag_1']:.3f} | {r['self']:.3f} | {r['ode_w']:.3f} | {per} |")
    for n, m in found["means"].items():
        label = "mean, all pairs" if n == "all" else f"mean, {n} steps"
        lines.append(f"| {label} | | | | {m['map_w']:.3f} | {m['map_1']:.3f} | "
                     f"{m['diag_w']:.3f} | {m['diag_1']:.3f} | {m['self']:.3f} | "
                     f"{m['ode_w']:.3f} | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True, help="the SFT run's output_dir (or checkpoint)")
    parser.add_argument("--student", required=True,
                        help="the Stage1 run's output_dir (or checkpoint); any checkpoint works")
    parser.add_argument("--weights", default="auto", choices=("auto", "ema", "live"))
    parser.add_argument("--samples", type=int, default=16, help="held-out clips")
    parser.add_argument("--data-seed", type=int, default=DEFAULT_DATA_SEED,
                        help="the held-out clips' generator seed (refused if a run trained on it)")
    parser.add_argument("--seed", type=int, default=0, help="the noise's seed")
    parser.add_argument("--steps", type=lambda v: [int(x) for x in v.split(",")],
                        default=[1, 2, 4], help="the flow-map samplers whose pairs are measured")
    parser.add_argument("--shift", type=float, default=None,
                        help="the samplers' grid shift (default: the student's sampling shift)")
    parser.add_argument("--ode-steps", type=int, default=200,
                        help="the teacher's Euler steps over the whole [0, 1]")
    parser.add_argument("--student-ode-steps", type=int, default=0,
                        help="the same for the student's own ODE (default: --ode-steps)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="the teacher's guidance (default: the student's fused scale)")
    parser.add_argument("--student-guidance", type=float, default=None,
                        help="the student's guidance (default: its sampler's, 1 when fused)")
    parser.add_argument("--start", choices=("data", "teacher"), default="data")
    parser.add_argument("--teacher-context", choices=("full", "tf"), default="full")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--json", default=None, help="write the rows and means here")
    parser.add_argument("--verbose", action="store_true", help="print each row as it is done")
    ns = parser.parse_args(argv)
    found = measure(ns)
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(found, indent=2) + "\n")
    print(markdown(found), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
