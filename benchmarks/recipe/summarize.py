"""Summarise a recipe sweep directory: each pretrain's validation direction by step and median
step time, then the `relay eval` scores of every run started from it.

    python benchmarks/recipe/summarize.py /tmp/sw4
"""
import glob
import json
import sys
from pathlib import Path


def main(root: str) -> None:
    for pre in sorted(p for p in Path(root).glob("pre-*") if p.is_dir()):
        name = pre.name[len("pre-"):]
        rows = [json.loads(line) for line in open(pre / "metrics.jsonl")]
        direction = {r["step"]: round(100 * r["val/live/direction_accuracy"])
                     for r in rows if "val/live/direction_accuracy" in r}
        steps = sorted(r["step_time_s"] for r in rows if "step_time_s" in r)
        median = steps[len(steps) // 2] if steps else None
        print(f"{name}: direction by step {direction}, median step {median}")
        for path in sorted(glob.glob(f"{root}/*-{name}*/eval.json")):
            run = Path(path).parent.name
            if run.split("-")[1] != name:
                continue
            scores = json.load(open(path))
            print(f"    {run}: colour {100 * scores['colour_accuracy']:.1f} %, "
                  f"direction {100 * scores['direction_accuracy']:.1f} %")


if __name__ == "__main__":
    main(sys.argv[1])
