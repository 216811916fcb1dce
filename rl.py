"""
What PPO (episode 8) and GRPO (episode 16) do around their update, in one place, so that
each script reads as its algorithm: the options and the run's folder, the figures logged
under TRL's names, the checkpoint saved at each evaluation with what --resume needs, the
resume itself, and the end of a run. A learner reading ppo.py or grpo.py can skip it.

Both scripts import from here; neither imports the other's loop. grpo.py takes from ppo.py
what the GRPO episode names (CLIP, EPOCHS, LR, MINIBATCH, pack() and token_logprobs()), and
gives PPO's constants to what here needs them: rl_parser(description, LR), run_name(args,
LR), clip_stats(..., CLIP). The evaluation is DPO's (dpo.evaluate), counted in rollouts.
"""
import argparse
import copy
import math
import re
import time

import torch

import distributed
from checkpoints import CHECKPOINTS, checkpoint_file, model_from, must_load, read_checkpoint, save_checkpoint
from data import SEED, check_seed

EVAL_EVERY = 10  # rollouts
AFRESH = "start the run without --resume"  # the advice of every line that refuses a resume


def rl_parser(description, lr):
    """The options of ppo.py and grpo.py; --lr defaults to lr, PPO's learning rate for both."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--minutes", type=float, default=10, help="training time (default 10)")
    parser.add_argument("--kl", type=float, default=0.05, help="the KL penalty's weight (default 0.05)")
    parser.add_argument("--lr", type=float, default=lr, help=f"the learning rate (default {lr:g}, PPO's); "
                        "another one gets its own folder")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED}; another seed gets its own folder")
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], help="default: bf16 where it is faster")
    parser.add_argument("--rollouts", type=int, default=math.inf, help="stop after this many rollouts, if sooner")
    parser.add_argument("--resume", action="store_true", help="go on from the run's last rollout checkpoint")
    return parser


def parse_rl_args(parser):
    args = parser.parse_args()
    if not 0 < args.minutes < math.inf:
        parser.error("--minutes must be a positive number")
    if not 0 <= args.kl < math.inf:
        parser.error("--kl must be a number, 0 or more")
    if not 0 < args.lr < math.inf:
        parser.error("--lr must be a positive number")
    if args.rollouts < 1:
        parser.error("--rollouts must be at least 1")
    check_seed(parser, args.seed)
    return args


def run_name(args, lr):
    """The run's folder, named after its KL weight: kl-0.05, kl-0; kl-0.05-seed-2 for another
    seed, kl-0.05-lr-1e-05 for a learning rate other than lr (PPO's)."""
    return (f"kl-{args.kl:g}" + (f"-lr-{args.lr:g}" if args.lr != lr else "")
            + (f"-seed-{args.seed}" if args.seed != SEED else ""))


def clip_stats(ratio, advantages, mask, clip):
    """Where the clip binds, as shares of the story tokens, by TRL's names: from below (the
    ratio under 1 - clip with a negative advantage) and from above (over 1 + clip, positive).
    A ratio outside the band whose advantage points back inside is not clipped."""
    low = masked_mean(((ratio < 1 - clip) & (advantages < 0)).float(), mask)
    high = masked_mean(((ratio > 1 + clip) & (advantages > 0)).float(), mask)
    return {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio/region": low + high}


def rollout_stats(stories, old, mask, eot):
    """What TRL logs of the stories: their mean length, the share cut at the token limit, and
    the policy's entropy per token, estimated as the mean of -log p over the tokens it drew
    (at temperature 1 with no top-k, that mean estimates the entropy without bias)."""
    return {"completions/mean_length": float(mask.sum(dim=1).mean()),
            "completions/clipped_ratio": sum(eot not in story for story in stories) / len(stories),
            "entropy": masked_mean(-old, mask)}


def masked_mean(values, mask):
    return float((values * mask).sum() / mask.sum())


def log_rollout(writer, rollout, logged, line):
    """A rollout's figures, under rollout/ in TensorBoard, and its line in the log."""
    for key, value in logged.items():
        writer.add_scalar(f"rollout/{key}", value, rollout)
    print(f"rollout {rollout}: {line}", flush=True)


def save_rollout(folder, rollout, seconds, policy, tokenizer, optimizer, rng, settings, **state):
    """A checkpoint named after the rollout, with all a resumed run needs: the optimizer, the
    random state, the rollouts and seconds so far (and PPO's critic)."""
    made_by = {"script": settings["script"], "rollout": rollout, "seconds": seconds, "settings": settings}
    save_checkpoint(folder / f"rollout-{rollout}.pt", policy, tokenizer, made_by, optimizer,
                    numpy_random=rng.bit_generator.state, torch_random=torch.get_rng_state(), **state)
    if rollout == 0:
        # A new run's first checkpoint (a resumed run saves no rollout 0): an earlier run's later
        # ones, left in the folder, would be what a --resume went on from. They go only now, so
        # a new run stopped before it saved anything leaves the earlier run whole.
        earlier = [path for path in rollout_checkpoints(folder) if path.stem != "rollout-0"]
        for checkpoint in earlier:
            checkpoint.unlink()
        if earlier:
            print(f"a new run in {folder}: the earlier run's later rollout checkpoints removed ({len(earlier)})")


def rollout_checkpoints(folder):
    """The run's rollout-N.pt files, by N (rollout-10 after rollout-9); other files, a copy of
    one under another name, are not the run's."""
    saved = [path for path in folder.glob("rollout-*.pt") if re.fullmatch(r"rollout-\d+", path.stem)]
    return sorted(saved, key=lambda path: int(path.stem.removeprefix("rollout-")))


def resume(folder, policy, optimizer, rng, tokenizer, **modules):
    """Loads the run's last rollout checkpoint into policy, optimizer, random state and any
    further modules it holds by name (PPO's critic); returns the checkpoint, whose made_by
    holds the rollouts and seconds so far. Under torchrun every process loads the same one,
    and goes on drawing what the others draw."""
    saved = rollout_checkpoints(folder)
    if not saved:
        raise SystemExit(f"nothing to resume in {folder}: no rollout-N.pt there; {AFRESH}")
    # The reference the KL is measured from is the fine-tuned model as it is now: made again
    # since the run began (its first checkpoint, rollout 0), it is not the one the run started from.
    reference = checkpoint_file(CHECKPOINTS / "finetune")
    if reference.exists() and reference.stat().st_mtime > saved[0].stat().st_mtime:
        raise SystemExit(f"{reference} was made again after {saved[0]} was saved, so the run would go on against "
                         f"another reference; {AFRESH}")
    checkpoint = read_checkpoint(saved[-1])
    # Everything checked before the policy takes any weight: what only a rollout checkpoint holds
    # (the optimizer, the random states, the further modules), and weights made with this
    # tokenizer (the model this run starts from was made with it), fitting their config and the
    # model the run starts from.
    missing = [key for key in ("optimizer", "numpy_random", "torch_random", *modules) if key not in checkpoint]
    if missing:
        raise SystemExit(f"{saved[-1]} is not a rollout checkpoint of this script (no {', '.join(missing)}); {AFRESH}")
    # Where the run stood: its rollouts, its seconds, and the settings it started with.
    made_by = checkpoint["made_by"]
    if not (isinstance(made_by.get("rollout"), int) and isinstance(made_by.get("seconds"), (int, float))
            and isinstance(made_by.get("settings"), dict)):
        raise SystemExit(f"{saved[-1]} does not say its rollout, seconds and settings; {AFRESH}")
    resumed = model_from(checkpoint, saved[-1], tokenizer=tokenizer, quiet=True, advice=AFRESH)
    if resumed.config != policy.config:
        raise SystemExit(f"{saved[-1]} holds a model of another shape than the one this run starts from; {AFRESH}")
    # The random states and the further modules, each loaded into a copy first; the optimizer's
    # state, loaded as it is. A damaged one, or an optimizer of other weights (PPO's, with its
    # critic, in a GRPO run's folder), is refused in one line.
    numpy_copy = copy.deepcopy(rng).bit_generator
    must_load(saved[-1], "a NumPy random state", lambda: setattr(numpy_copy, "state", checkpoint["numpy_random"]),
              AFRESH)
    must_load(saved[-1], "a torch random state", lambda: torch.Generator().set_state(checkpoint["torch_random"]),
              AFRESH)
    for name, module in modules.items():
        must_load(saved[-1], f"a {name}", lambda: copy.deepcopy(module).load_state_dict(checkpoint[name]), AFRESH)
    must_load(saved[-1], "an optimizer state", lambda: optimizer.load_state_dict(checkpoint["optimizer"]), AFRESH,
              why="damaged, or another script's")
    policy.load_state_dict(resumed.state_dict())
    for name, module in modules.items():
        module.load_state_dict(checkpoint[name])
    rng.bit_generator.state = checkpoint["numpy_random"]
    torch.set_rng_state(checkpoint["torch_random"])
    print(f"resuming {saved[-1]}: rollout {made_by['rollout']}, {made_by['seconds'] / 60:.1f} minutes so far")
    return checkpoint


def finish(folder, rollout, start, policy, tokenizer, settings, writer, evaluate_and_save):
    """The end of a run: the final model measured (if the last rollout wasn't), the writer
    closed, and the model saved in the run's folder (by rank 0 alone, under torchrun)."""
    # A run resumed after it had ended measured its last rollout then, and saved its checkpoint.
    measured = (folder / f"rollout-{rollout}.pt").exists()
    distributed.barrier()  # under torchrun, every process has looked before rank 0 may save it
    if rollout % EVAL_EVERY and not measured:
        evaluate_and_save()
    writer.close()
    seconds = time.time() - start
    made_by = {"script": settings["script"], "rollout": rollout, "seconds": seconds, "settings": settings}
    if distributed.is_main():
        save_checkpoint(folder, policy, tokenizer, made_by)
    distributed.end()
    print(f"done: {rollout} rollouts, {seconds / 60:.1f} minutes; the model is in {folder}/model.pt")
