"""Train a plan of tiny-config runs in parallel, score each with `relay eval`, summarise.

    python benchmarks/tiny_sweep.py PLAN.json --out DIR [--jobs 8] [--device cpu|cuda]
                                    [--cores-per-job 2] [--threads 2]

How the embedded default's step counts and batch sizes were chosen (docs/training.md). A plan
is a list of runs; a run is one `trainer/train.py` invocation of a shipped config with
overrides, optionally warm-started from other runs of the plan:

    {"runs": [
      {"name": "pre-b16", "config": "config/tiny/pretrain.yaml",
       "set": {"train_batch_size": 16, "max_steps": 1200, "save_interval": 100}},
      {"name": "sft-b16-700", "config": "config/tiny/sft.yaml", "set": {"max_steps": 100},
       "from": {"pretrained_transformer_path": "pre-b16/checkpoint-700"},
       "eval": {"steps": 30, "guidance": 4}}]}

"from" values name another run (its output_dir, i.e. its newest checkpoint) or one of its
checkpoints; a run starts when every run it reads from has finished. Every run gets its own
output_dir under --out and data under --out/data (shared by runs of the same dataset). With
--device cpu each job is pinned to its own --cores-per-job cores, so parallel jobs do not
share cores (they still share caches and memory bandwidth: see the summary's load figures).

The summary (DIR/summary.json, and a table on stdout) has, per run: wall time, steps, median
step time, the last validation scores, and the eval scores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_plan(path: str) -> list[dict]:
    """The plan's runs, checked: unique names, known sources, no cycles (raises SystemExit)."""
    runs = json.loads(Path(path).read_text())["runs"]
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"{path}: run names repeat")
    for run in runs:
        for source in run.get("from", {}).values():
            if source.split("/")[0] not in names:
                raise SystemExit(f"{path}: run {run['name']} reads from unknown run {source}")
    return runs


def depends_on(run: dict) -> set[str]:
    return {source.split("/")[0] for source in run.get("from", {}).values()}


def train_argv(run: dict, out: Path) -> list[str]:
    """train.py's command line: the config, its overrides, this plan's directories."""
    argv = [sys.executable, str(ROOT / "trainer" / "train.py"), "--config",
            str(ROOT / run["config"]), "--output_dir", str(out / run["name"])]
    # Runs of configs that share a dataset (the same data_path) share its cache here too.
    data = run.get("data") or Path(yaml.safe_load((ROOT / run["config"]).read_text())
                                    ["data"]["data_path"]).name
    argv += ["--data_path", str(out / "data" / data)]
    for key, value in {**run.get("set", {}),
                       **{k: str(out / v) for k, v in run.get("from", {}).items()}}.items():
        argv += [f"--{key}", json.dumps(value) if isinstance(value, list) else str(value)]
    return argv


def eval_argv(run: dict, out: Path) -> list[str]:
    spec = run["eval"]
    return [sys.executable, "-m", "launcher.cli", "eval", "--checkpoint", str(out / run["name"]),
            "--steps", str(spec["steps"]), "--guidance", str(spec["guidance"]),
            "--out", str(out / run["name"] / "eval.json")]


def run_one(run: dict, out: Path, env: dict, cores: list[int] | None) -> dict:
    """Train, then evaluate; returns the run's figures."""
    def pin():
        if cores:
            os.sched_setaffinity(0, cores)

    log = open(out / f"{run['name']}.log", "w")
    t0 = time.monotonic()
    code = subprocess.run(train_argv(run, out), cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, preexec_fn=pin).returncode
    result = {"name": run["name"], "code": code, "train_wall_s": time.monotonic() - t0,
              "cores": cores, **read_metrics(out / run["name"])}
    if code == 0 and run.get("eval"):
        t1 = time.monotonic()
        ecode = subprocess.run(eval_argv(run, out), cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, preexec_fn=pin).returncode
        result["eval_wall_s"] = time.monotonic() - t1
        if ecode == 0:
            report = json.loads((out / run["name"] / "eval.json").read_text())
            result["eval"] = {k: report[k] for k in ("colour_accuracy", "direction_accuracy",
                                                     "steps", "guidance", "weights")}
    log.close()
    return result


def read_metrics(run_dir: Path) -> dict:
    """Step count, median step time and every validation score of a run's metrics.jsonl."""
    try:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if line.strip()]
    except OSError:
        return {}
    times = [r["step_time_s"] for r in records if "step_time_s" in r]
    validations = [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith("val/")}}
                   for r in records if any(k.startswith("val/") for k in r)]
    return {"steps": records[-1]["step"] if records else 0,
            "median_step_s": statistics.median(times[len(times) // 5:]) if times else None,
            "validations": validations}


def run_plan(runs: list[dict], out: Path, jobs: int, env: dict, cores_per_job: int | None,
             deadline: float) -> list[dict]:
    """Every run, each once its sources are done, at most `jobs` at a time, in plan order;
    none starts after `deadline` (time.monotonic()), so a time-boxed sweep ends with results."""
    done: dict[str, dict] = {}
    pending = list(runs)
    free_slots = list(range(jobs))
    running = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            ready = [r for r in pending if depends_on(r) <= set(done)]
            for run in ready:
                if not free_slots:
                    break
                if time.monotonic() > deadline:
                    done[run["name"]] = {"name": run["name"], "code": "not started"}
                    pending.remove(run)
                    continue
                if any(done[d]["code"] != 0 for d in depends_on(run)):
                    done[run["name"]] = {"name": run["name"], "code": "skipped"}
                    pending.remove(run)
                    continue
                slot = free_slots.pop(0)
                cores = (list(range(slot * cores_per_job, (slot + 1) * cores_per_job))
                         if cores_per_job else None)
                run_env = {**env, **({"OMP_NUM_THREADS": str(run["threads"])}
                                     if "threads" in run else {})}
                running[pool.submit(run_one, run, out, run_env, cores)] = (run, slot)
                pending.remove(run)
            if not running:
                continue
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                run, slot = running.pop(future)
                done[run["name"]] = future.result()
                free_slots.append(slot)
                print(json.dumps(done[run["name"]]), flush=True)
    return [done[r["name"]] for r in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cores-per-job", type=int, default=None,
                        help="pin each job to its own cores (cpu: default 2; cuda: none)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per job (default: --cores-per-job, or 1 on cuda); "
                             "a run's own \"threads\" wins")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no run after this many seconds")
    ns = parser.parse_args(argv)
    runs = load_plan(ns.plan)
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cores = ns.cores_per_job if ns.cores_per_job is not None else (2 if ns.device == "cpu" else None)
    threads = ns.threads or cores or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    if ns.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    load_before = os.getloadavg()
    t0 = time.monotonic()
    results = run_plan(runs, out, ns.jobs, env, cores, t0 + ns.budget_s)
    summary = {"plan": ns.plan, "device": ns.device, "jobs": ns.jobs, "cores_per_job": cores,
               "threads": threads, "wall_s": time.monotonic() - t0, "load_before": load_before,
               "load_after": os.getloadavg(), "cpus": os.cpu_count(), "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for r in results:
        ev = r.get("eval") or {}
        score = f"{ev['colour_accuracy']:.0%}/{ev['direction_accuracy']:.0%}" if ev else "-"
        step = f"{r['median_step_s']:.3f}" if r.get("median_step_s") else "-"
        print(f"{r['name']:<28} code {r.get('code')!s:<7} steps {r.get('steps', '-')!s:<5} "
              f"step_s {step:<6} train {r.get('train_wall_s', 0):6.1f}s  eval {score}")
    return 0 if all(r.get("code") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
