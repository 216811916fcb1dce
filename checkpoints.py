"""
What a run keeps: the folders it writes to (checkpoints/ and runs/), the settings it ran
with, and its checkpoints, saved whole or not at all and loaded safely. Plumbing that every
training script imports; a learner may skip it.
"""
import math
import time
from dataclasses import asdict
from pathlib import Path
from textwrap import shorten

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

import distributed
from files import atomic
from model import GPT, Config

CHECKPOINTS = Path("checkpoints")
RUNS = Path("runs")
# The command that makes each folder of checkpoints, for the error when one is missing.
MADE_BY = {"pretrain": "python train.py", "finetune": "python finetune.py", "dpo": "python dpo.py",
           "ppo": "python ppo.py", "grpo": "python grpo.py"}
NAMED_BY_OPTIONS = ("finetune", "dpo")  # the scripts whose run folders add the options they differ by
# The kinds of constant a run's settings record: exactly these (a numpy number is a float too,
# but a checkpoint holding one would not load with weights_only=True).
SETTING = (bool, int, float, str)


def run_settings(args, constants, **more):
    """The settings a run prints, logs and saves with its checkpoints, from one source: the
    script's constants (its module's upper-case names that hold a number, a string, or a tuple
    of those: its own and those it imports), then its options, then `more`; lower-cased, so
    BATCH is batch. An option overrides the constant of its name (--lr over LR). An option
    without a bound (math.inf: --rollouts not given) is recorded as None, as JSON, which the
    settings are printed and logged in, has no infinity."""
    recorded = {name.lower(): value for name, value in constants.items()
                if name.isupper() and (type(value) in SETTING or
                                       (type(value) is tuple and all(type(v) in SETTING for v in value)))}
    options = {name: None if value == math.inf else value for name, value in vars(args).items()}
    return {**recorded, **options, **more}


def run_writer(run, resumed):
    """The run's TensorBoard writer; under torchrun, rank 0's, the others' writing nothing. A
    new run moves the event files an earlier run left in its folder into a folder of their own
    within it, earlier-<when that run last wrote>: TensorBoard shows it as a run of its own,
    and no curve joins the two runs' points. A resumed run writes on beside its own."""
    if not distributed.is_main():
        return distributed.NoWriter()
    earlier = list(Path(run).glob("events.out.tfevents.*"))
    if earlier and not resumed:
        last_written = time.localtime(max(path.stat().st_mtime for path in earlier))
        kept = Path(run) / time.strftime("earlier-%Y-%m-%d-%H%M%S", last_written)
        try:
            kept.mkdir(exist_ok=True)
            for path in earlier:
                path.rename(kept / path.name)
        except OSError as error:  # a file still open elsewhere (TensorBoard, on Windows)
            raise SystemExit(f"cannot move the earlier run's TensorBoard log in {run} into {kept.name} "
                             f"({error.strerror}); close what holds it open, or delete it, then run again")
        print(f"a new run in {run}: the earlier run's TensorBoard log moved to {kept}")
    return SummaryWriter(run)


def logged(run, tag):
    """A run's TensorBoard points of one tag, {step: value}, from its folder's own event files
    (not those of an earlier run, moved into a folder within it): of each step, the point
    written last, as a run that went on from a checkpoint writes its steps again."""
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars(tag) if tag in events.Tags()["scalars"] else []
    return {point.step: point.value for point in sorted(points, key=lambda point: point.wall_time)}


def checkpoint_file(path):
    """A folder means the final model in it, model.pt; a file (a .pt, or any file there is) is itself."""
    path = Path(path)
    return path if path.suffix == ".pt" or path.is_file() else path / "model.pt"


def save_checkpoint(path, model, tokenizer, made_by, optimizer=None, **state):
    """Weights, config, the tokenizer they were trained with, and what made them
    (script, step, settings), written to a temporary file and then renamed. An optimizer's
    state and any further `state` (an RL run's critic, its random state) are for resuming."""
    stop_if_diverged(model, path)
    checkpoint = {"model": model.state_dict(), "config": asdict(model.config),
                  "tokenizer": tokenizer.fingerprint(), "made_by": made_by, **state}
    if optimizer is not None:
        checkpoint["optimizer"] = optimizer.state_dict()
    # Through a file of ours: torch then lets a full disk's OSError through, which atomic() words.
    with atomic(checkpoint_file(path)) as tmp, open(tmp, "wb") as file:
        torch.save(checkpoint, file)


def stop_if_diverged(model, path):
    """Stops a run whose weights went to nan or inf (a learning rate too high, most often)
    before it measures or saves them: their stories are noise, or none at all (torch's draw
    refuses such probabilities), and saved at `path` they would replace the last good model."""
    if not finite(model.state_dict()):
        raise SystemExit(f"the model's weights are no longer finite numbers (nan or inf): the run diverged, and "
                         f"stops before it writes {checkpoint_file(path)}; start it again, with a lower --lr where "
                         "the script takes one")


def finite(weights):
    """Whether every floating-point weight is a finite number."""
    return all(torch.isfinite(w).all() for w in weights.values() if torch.is_tensor(w) and w.is_floating_point())


def read_checkpoint(path):
    """The checkpoint's contents, loaded with weights_only=True: tensors and plain values,
    never code. Missing, damaged or foreign files stop with one line."""
    file = checkpoint_file(path)
    command = made_with(file)
    if not file.exists():
        raise SystemExit(f"no checkpoint at {file}: make it with {command}")
    try:
        checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several kinds for a damaged or unsafe file
        raise SystemExit(f"{file} is not a checkpoint that loads safely ({type(error).__name__}); "
                         f"make it again with {command}")
    if not isinstance(checkpoint, dict) or not {"model", "config", "tokenizer", "made_by"} <= checkpoint.keys() \
            or not isinstance(checkpoint["config"], dict) or not isinstance(checkpoint["made_by"], dict):
        raise SystemExit(f"{file} is not a checkpoint of this series; make it again with {command}")
    return checkpoint


def made_with(file):
    """The command that makes a checkpoint, for the errors that name it."""
    # The folder under checkpoints/ says which script makes it: checkpoints/grpo/kl-0/... is
    # grpo.py's; finetune.py and dpo.py name a run's folder after the options it differs by
    # (checkpoints/dpo-seed-2/, finetune-plain-0.5/). The path's last checkpoints/ is the
    # project's own, wherever the project lies (as evaluate.saved_name reads it).
    folders = file.parts[:-1]
    found = [i for i, name in enumerate(folders[:-1]) if name == CHECKPOINTS.name]
    script_folder = folders[found[-1] + 1] if found else ""
    script, _, options = script_folder.partition("-")
    if script not in MADE_BY or (options and script not in NAMED_BY_OPTIONS):
        return "the script that writes it"
    return MADE_BY[script] + (f" with the options its folder's name gives ({script_folder})" if options else "")


def load_checkpoint(path, device="cpu", tokenizer=None, quiet=False):
    """The model in a checkpoint, on `device`; with a tokenizer, refuses a model trained with
    another one (its tokens would mean other things), and any model whose context is not the
    series' (pretraining's windows, fine-tuning's examples and evaluation all take 256 tokens)."""
    return model_from(read_checkpoint(path), path, device, tokenizer, quiet)


def model_from(checkpoint, path, device="cpu", tokenizer=None, quiet=False, advice=None):
    """load_checkpoint's model from a checkpoint read_checkpoint(path) has read already, for a
    script that needs more of the file than the model: the file is read once. `advice` ends
    each refusal in place of the command that makes the file (a resumed run's: start afresh)."""
    file = checkpoint_file(path)
    if tokenizer is not None and checkpoint["tokenizer"] != tokenizer.fingerprint():
        raise SystemExit(f"{file} was trained with another tokenizer than data/tokenizer.json; "
                         f"{advice or 'train it again, or prepare the data it was trained on'}")
    advice = advice or f"make it again with {made_with(file)}"
    try:
        model = GPT(Config(**checkpoint["config"]))
        model.load_state_dict(checkpoint["model"])
    except (TypeError, ValueError, RuntimeError) as error:
        lines = str(error).strip().splitlines()
        reason = lines[1] if len(lines) > 1 else lines[0]  # the first line only names the class
        # One short line: a list of missing weights runs to kilobytes.
        raise SystemExit(f"{file} does not match the model it describes ({shorten(reason, 150, placeholder=' ...')}); "
                         f"{advice}")
    if not finite(checkpoint["model"]):
        raise SystemExit(f"{file} holds weights that are not finite numbers (nan or inf); {advice}")
    if model.config.context != Config.context:
        raise SystemExit(f"{file} has a context of {model.config.context} tokens, where the series' scripts take "
                         f"{Config.context}; {advice}")
    # A model of another vocabulary would write tokens the tokenizer cannot read, or be given ones it has no
    # embedding for.
    if tokenizer is not None and model.config.vocab_size != tokenizer.vocab_size:
        raise SystemExit(f"{file} has a vocabulary of {model.config.vocab_size} tokens, where data/tokenizer.json "
                         f"has {tokenizer.vocab_size}; {advice}")
    if not quiet:
        made_by = checkpoint["made_by"]
        when = f"rollout {made_by['rollout']}" if "rollout" in made_by else f"step {made_by.get('step', '?')}"
        print(f"model: {model.parameter_count() / 1e6:.2f}M parameters, {file} ({made_by.get('script', '?')}, {when})")
    return model.to(device)


def must_load(path, what, load, advice, why="damaged"):
    """Runs load(), which loads a part of the checkpoint at path (an optimizer's state, a
    random state): one line ending on `advice`, not a traceback, when that part does not fit
    this run."""
    try:
        load()
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise SystemExit(f"{path} holds {what} that does not fit this run ({why}: {type(error).__name__}); {advice}")
