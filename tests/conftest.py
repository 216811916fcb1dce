"""Small corpora made by the tests themselves: no test reads the network or ../shared."""
import gzip
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NOUNS = """kite river cake rain frog boat tree ball star moon apple hat bird fish dog cat sun
flower garden box train book bear duck horse shoe lamp drum bell cloud snow leaf stone
shell nest egg cup sock car bike rock pond hill forest door window chair bed spoon
bucket carrot cookie honey jar kitten puppy rabbit turtle wagon whistle""".split()
# Many names, so that each is in few stories: only their capital keeps them from being asked for.
NAMES = """Lily Tom Ben Sue Mia Max Timmy Sarah Daisy Lucy Anna Jack Sam Zoe Leo Ella Finn Rosa Ivy
Noah Ruby Owen Maya Eli Nora Kai Lena Theo Ada Hugo Iris Otto Vera Milo Jade Axel Luna Ezra Cleo Jonah""".split()


def pytest_configure(config):
    config.addinivalue_line("markers", "measures_bf16_speed: the test times the CPU's bf16 products itself")


@pytest.fixture(autouse=True)
def fp32_on_every_cpu(request, monkeypatch):
    """A script run without --precision picks it from how much faster the CPU multiplies bf16
    than fp32 (devices.bf16_speedup_on_cpu): bf16 on some machines, fp32 on others, and four
    seconds of products at each start. Every test's CPU is one where fp32 is picked, the same
    on every machine, but for the tests that time the products themselves."""
    import devices

    if request.node.get_closest_marker("measures_bf16_speed") is None:
        monkeypatch.setattr(devices, "bf16_speedup_on_cpu", lambda: 1.0)


@pytest.fixture(autouse=True)
def cpu_on_every_machine(monkeypatch):
    """A script run without --device takes the machine's GPU, CUDA's or Apple's MPS
    (devices.pick_device), where the tests' exact comparisons could come out otherwise: every
    test runs as on a machine without one, the same on every machine. (A test about GPUs
    makes one up itself.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # and for the processes a test starts


def make_story(rng):
    name = rng.choice(NAMES)
    a, b, c, d, e = rng.sample(NOUNS, 5)
    # "Instead", "Suddenly": capitalised words whose tails must never be taken for words.
    return (f"Once upon a time, {name} found a {a} near the {b}. {name} was happy.\n"
            f"Suddenly {name} saw a {c} and a {d}. Instead of the {e}, {name} didn't look. The end.")


def write_corpus(path, stories):
    text = "".join(f"{s}\n<|endoftext|>\n" for s in stories)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")


@pytest.fixture
def corpus(tmp_path):
    """A folder laid out like ../shared/data/tinystories: train (.gz), valid, and a lowercased file."""
    rng = random.Random(0)
    folder = tmp_path / "source"
    folder.mkdir()
    train = [make_story(rng) for _ in range(400)]
    valid = [make_story(rng) for _ in range(120)] + [train[0]]  # one valid story is also in train
    write_corpus(folder / "stories-train.txt.gz", train)
    write_corpus(folder / "stories-valid.txt", valid)
    write_corpus(folder / "stories-train-lowercase.txt", [s.lower() for s in train[:50]])
    return folder


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A folder prepared as a learner's would be, with data/ from a small corpus (a tokenizer
    of 400 tokens) and a tiny fine-tuned model in checkpoints/finetune. Tests that run a
    script's main() change into it."""
    import torch

    import data
    from checkpoints import save_checkpoint
    from model import GPT, TINY, Config
    from tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("workspace")
    rng = random.Random(1)
    source = root / "source"
    source.mkdir()
    write_corpus(source / "train.txt", [make_story(rng) for _ in range(1200)])  # a quarter for fine-tuning
    write_corpus(source / "valid.txt", [make_story(rng) for _ in range(120)])
    data.prepare(data.local_files(source), root / "data", vocab_size=400, heldout=root / "heldout.json")
    tokenizer = load_tokenizer(root / "data")
    torch.manual_seed(0)
    model = GPT(Config(vocab_size=tokenizer.vocab_size, **TINY))
    save_checkpoint(root / "checkpoints" / "finetune", model, tokenizer, {"script": "conftest", "step": 0})
    return root


@pytest.fixture
def workspace_tokenizer(workspace):
    from tokenizer import load_tokenizer

    return load_tokenizer(workspace / "data")


@pytest.fixture
def workspace_model(workspace, workspace_tokenizer):
    from checkpoints import load_checkpoint

    return load_checkpoint(workspace / "checkpoints" / "finetune", tokenizer=workspace_tokenizer, quiet=True).eval()


@pytest.fixture
def run_main(workspace, monkeypatch):
    """Runs a script's main() in the workspace, as `python script.py ARGS` would."""
    def run(script, *args):
        monkeypatch.chdir(workspace)
        monkeypatch.setattr(sys, "argv", [script.__name__ + ".py", *args])
        script.main()
    return run


@pytest.fixture(scope="session")
def small_tokenizer():
    """A tokenizer of 300 tokens, trained on one sentence."""
    import tokenizer as bpe

    return bpe.train(["Once upon a time a kite flew over the river. The end."] * 5, vocab_size=300, progress=False)


@pytest.fixture
def small_model(small_tokenizer):
    """A tiny GPT (model.TINY) for the small tokenizer, in evaluation mode."""
    import torch

    from model import GPT, TINY, Config

    torch.manual_seed(0)
    return GPT(Config(vocab_size=small_tokenizer.vocab_size, **TINY)).eval()


def always_writes(model, token):
    """Makes a model's logits the same at every position, `token`'s the highest: the final
    layer norm then outputs its bias alone, and the bias points at that token's embedding."""
    import torch

    with torch.no_grad():
        model.ln.weight.zero_()
        model.token_embedding.weight[token] *= 50
        model.ln.bias.copy_(model.token_embedding.weight[token])
    return model


def share_of_letters(text, words):
    """An easy reward for a tiny model: the share of the story's characters that are letters."""
    return sum(c.isalpha() for c in text) / max(len(text), 1)


def at_most_8_tokens(write):
    """write (a script's demo story), 8 tokens long whatever length it is asked for."""
    def shorter(*args, max_new_tokens=None, **options):
        return write(*args, max_new_tokens=8, **options)
    return shorter


def make_quick(setattr, script):
    """Short stories and held-out stories, and an easy reward, for ppo or grpo: with --lr 3e-3,
    a run of a tiny model in seconds. Each evaluation writes for 8 held-out instructions, not
    50, and a demo story of 8 tokens. setattr: monkeypatch's in a test, Python's own in the
    processes torchrun starts (tests/launch.py)."""
    import dpo
    import evaluate

    setattr(script, "words_used", share_of_letters)
    setattr(script, "MAX_NEW_TOKENS", 16)
    setattr(evaluate, "MAX_NEW_TOKENS", 16)
    setattr(script, "load_instructions", lambda: evaluate.load_instructions()[:8])
    setattr(dpo, "write", at_most_8_tokens(dpo.write))


@pytest.fixture
def quick(monkeypatch):
    """make_quick for a test: quick(ppo) or quick(grpo)."""
    return lambda script: make_quick(monkeypatch.setattr, script)


def log_points(folder, tag, values):
    """A run's TensorBoard log in folder: values under tag, at steps 1, 2, ..."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(folder) as writer:
        for step, value in enumerate(values, start=1):
            writer.add_scalar(tag, value, step)
