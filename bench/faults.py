"""Kills each training script with SIGKILL at random moments and checks that nothing is lost.

In a scratch folder set up as a learner's would be (a copy of data/, made by `python data.py`,
and tiny models in checkpoints/pretrain and checkpoints/finetune, so that a run takes seconds),
each of train.py (resumed), finetune.py, dpo.py, ppo.py and grpo.py first runs once to its end,
which times it; then KILLS times it starts afresh and is killed at a moment drawn uniformly
over that time. After each kill:
- every checkpoint under checkpoints/ must load (checkpoints.read_checkpoint: weights_only, checked);
- the scripts that resume (train.py, ppo.py, grpo.py) run with --resume to their end, which must
  succeed, or, for an RL run killed before its first checkpoint, refuse in one line;
- afterwards the checkpoints must load again.
The temporary files that killed saves left behind are counted at the end.

    python bench/faults.py               # 20 kills a script: about 30 minutes on 2 cores
    python bench/faults.py --kills 3
"""
import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

import torch  # noqa: E402

from checkpoints import read_checkpoint, save_checkpoint  # noqa: E402
from devices import machine  # noqa: E402
from files import DATA  # noqa: E402
from model import GPT, TINY, Config  # noqa: E402
from tokenizer import load_tokenizer  # noqa: E402
from train import make_optimizer  # noqa: E402

# Each script with the options of a run of a few seconds; those that resume name how.
SCRIPTS = {
    "train.py": {"run": ["--resume"], "resume": ["--resume"]},
    "finetune.py": {"run": ["--minutes", "0.1"]},
    "dpo.py": {"run": ["--minutes", "0.1"]},
    "ppo.py": {"run": ["--minutes", "0.1"], "resume": ["--minutes", "0.1", "--resume"]},
    "grpo.py": {"run": ["--minutes", "0.1"], "resume": ["--minutes", "0.1", "--resume"]},
}
PRETRAIN_STEPS = 20  # the tiny pretraining run's schedule, a few seconds


def set_up(folder):
    """data/ copied, a tiny pretrained model that train.py --resume continues from step 0, the
    same model as the fine-tuned one, and preference pairs for dpo.py."""
    if not (DATA / "manifest.json").exists():
        raise SystemExit("no data/ to copy: make it with python data.py")
    shutil.copytree(DATA, folder / "data")
    tokenizer = load_tokenizer(folder / "data")
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, **TINY))
    optimizer = make_optimizer(model)
    settings = {"minutes": 60.0, "steps": PRETRAIN_STEPS}
    save_checkpoint(folder / "pristine-pretrain.pt", model, tokenizer,
                    {"script": "train.py", "step": 0, "seconds": 0.0, "settings": settings}, optimizer)
    save_checkpoint(folder / "pristine-finetune.pt", model, tokenizer, {"script": "finetune.py", "step": 0})
    fresh_start(folder, "preferences.py")
    run(folder, "preferences.py", ["--instructions", "32"], check=True)


def run(folder, script, options, check=False):
    done = subprocess.run([sys.executable, str(REPOSITORY / script), *options], cwd=folder,
                          capture_output=True, text=True)
    if check and done.returncode:
        raise SystemExit(f"{script} {' '.join(options)} failed in {folder}:\n{done.stderr[-2000:]}")
    return done


def fresh_start(folder, script):
    """What a new run of the script starts from: its own outputs removed, the tiny pretrained
    and fine-tuned models put back as they were."""
    output = {"train.py": "pretrain"}.get(script, script.removesuffix(".py"))
    shutil.rmtree(folder / "checkpoints" / output, ignore_errors=True)
    for model in ("pretrain", "finetune"):
        if model != output or script == "train.py":
            (folder / "checkpoints" / model).mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / f"pristine-{model}.pt", folder / "checkpoints" / model / "model.pt")


def unloadable(folder):
    """The checkpoints under checkpoints/ that do not load, with the line each gives."""
    failures = []
    for path in sorted((folder / "checkpoints").rglob("*.pt")):
        try:
            read_checkpoint(path)
        except SystemExit as error:
            failures.append(f"{path.relative_to(folder)}: {error}")
    return failures


def kill_at(folder, script, options, seconds):
    process = subprocess.Popen([sys.executable, str(REPOSITORY / script), *options], cwd=folder,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        process.wait(timeout=seconds)
        return False  # it ended before the moment came
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return True


def trial(folder, script, kills, rng):
    """One script: a timed full run, then `kills` runs killed at random moments."""
    options = SCRIPTS[script]
    fresh_start(folder, script)
    started = time.time()
    run(folder, script, options["run"], check=True)
    duration = time.time() - started
    result = {"script": script, "seconds_a_run": round(duration, 1), "kills": 0, "ended_before_kill": 0,
              "checkpoints_checked": 0, "resumed": 0, "nothing_to_resume": 0, "failures": []}
    for _ in range(kills):
        fresh_start(folder, script)
        killed = kill_at(folder, script, options["run"], rng.uniform(0, duration))
        result["kills" if killed else "ended_before_kill"] += 1
        result["checkpoints_checked"] += len(list((folder / "checkpoints").rglob("*.pt")))
        result["failures"] += unloadable(folder)
        if "resume" in options:
            done = run(folder, script, options["resume"])
            lines = done.stderr.strip().splitlines()
            if done.returncode == 0:
                result["resumed"] += 1
            elif len(lines) == 1 and lines[0].startswith("nothing to resume"):
                result["nothing_to_resume"] += 1
            else:
                result["failures"].append(f"{script} --resume failed: {done.stderr.strip()[-300:]}")
            result["failures"] += unloadable(folder)
    result["temporary_files_left"] = len(list((folder / "checkpoints").rglob(".*.tmp")))
    return result


def main():
    parser = argparse.ArgumentParser(description="Kill each training script at random moments; check that nothing is lost.")
    parser.add_argument("--kills", type=int, default=20, help="kills per script (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scripts", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    rng = random.Random(args.seed)
    print(f"machine: {machine()}")
    results = []
    with tempfile.TemporaryDirectory(prefix="faults-") as scratch:
        folder = Path(scratch)
        set_up(folder)
        for script in args.scripts:
            result = trial(folder, script, args.kills, rng)
            results.append(result)
            print(json.dumps(result), flush=True)
    print("\n| script | a run | killed | ended first | checkpoints checked | resumed | nothing yet to resume | failures | temporary files left |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['script']} | {r['seconds_a_run']} s | {r['kills']} | {r['ended_before_kill']} | "
              f"{r['checkpoints_checked']} | {r['resumed']} | {r['nothing_to_resume']} | {len(r['failures'])} | "
              f"{r['temporary_files_left']} |")
    if any(r["failures"] for r in results):
        raise SystemExit("failures:\n" + "\n".join(f for r in results for f in r["failures"]))


if __name__ == "__main__":
    main()
