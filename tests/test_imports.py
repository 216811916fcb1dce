"""The scripts import only from earlier episodes and from the plumbing: a learner reading them
in order never meets a name from a page ahead, and no two files import each other."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The scripts of each episode, in the order of the episodes.
BY_EPISODE = [["data", "tokenizer"], ["model", "train"], ["finetune"], ["sample"], ["evaluate"], ["preferences"],
              ["dpo"], ["ppo"], ["grpo"]]
EPISODES = [name for scripts in BY_EPISODE for name in scripts]
PLUMBING = ["files", "devices", "checkpoints", "kernels", "rl"]
# What each plumbing file may import of the scripts: what it needs to load a model or a seed.
PLUMBING_NEEDS = {"files": set(), "devices": set(), "kernels": set(), "checkpoints": {"model"}, "rl": {"data"}}


def imported(name):
    """The series' own modules that a file imports."""
    tree = ast.parse((ROOT / f"{name}.py").read_text(encoding="utf-8"))
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {module.split(".")[0] for module in modules} & set(EPISODES + PLUMBING)


def test_no_script_imports_a_later_episode():
    for place, scripts in enumerate(BY_EPISODE):
        later = {name for scripts_after in BY_EPISODE[place + 1:] for name in scripts_after}
        for name in scripts:
            assert not imported(name) & later, f"{name}.py imports {sorted(imported(name) & later)}, of later episodes"


def test_the_plumbing_imports_only_what_it_needs_and_nothing_imports_in_a_circle():
    for name in PLUMBING:
        assert imported(name) & set(EPISODES) <= PLUMBING_NEEDS[name], name
    # Follow every file's imports: none leads back to the file.
    for start in EPISODES + PLUMBING:
        seen, todo = set(), list(imported(start))
        while todo:
            name = todo.pop()
            assert name != start, f"{start}.py imports itself through {sorted(seen)}"
            if name not in seen:
                seen.add(name)
                todo += imported(name)
