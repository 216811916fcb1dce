"""Pretraining, PPO and GRPO on several processes: torchrun with two processes on the CPU
(gloo), against one process on the same examples. torchrun runs tests/launch.py, which
patches a script as the tests patch it in one process (the tiny model, short stories), then
runs its main()."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import devices
import distributed
import dpo
import evaluate
import finetune
import grpo
import launch
import ppo
import preferences
import sample
import train
from checkpoints import read_checkpoint
from model import GPT, TINY, Config

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
OPTIONS = ["--device", "cpu", "--precision", "fp32"]


@pytest.fixture(autouse=True)
def one_thread():
    """Each test's own runs on one thread, as torchrun gives each of its processes: tiny passes
    on two threads of a busy 2-core CPU ran up to 7 times as slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def learner(workspace, folder):
    """A learner's folder of its own: the workspace's data and fine-tuned model, nothing else."""
    shutil.copytree(workspace / "data", folder / "data")
    shutil.copytree(workspace / "checkpoints" / "finetune", folder / "checkpoints" / "finetune")
    return folder


def in_one_process(folder, monkeypatch, script, *args, **environment):
    """`python tests/launch.py SCRIPT ARGS`, in this process: patched the same way."""
    launch.patch(monkeypatch.setattr, environment)
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *args, *OPTIONS])
    script.main()


def torchrun(folder, processes, script, *args, wait=True, **environment):
    """`torchrun --standalone --nproc_per_node N tests/launch.py SCRIPT ARGS` in folder; each
    checkpoint saved is written down in saves.txt with its rank, and each process leaves its
    weights in rank-N.pt at the end."""
    command = [*TORCHRUN, "--nproc_per_node", str(processes), str(Path(launch.__file__)), script, *args, *OPTIONS]
    environment = {**os.environ, "SAVES": str(folder / "saves.txt"), "RANKS": str(folder), **environment}
    if not wait:
        errors = open(folder / "errors.txt", "w")
        return subprocess.Popen(command, cwd=folder, env=environment, stdout=subprocess.DEVNULL, stderr=errors)
    return subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=300)


def succeeded(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def assert_same_model(got, expected):
    """The same weights, up to the order of float additions, which Adam's steps (each about the
    learning rate, whatever the gradient's size) grow to a few millionths: 7e-6 after GRPO's
    16 steps at 3e-3. (Optimizer states, where a test has them, are checked more closely.)"""
    assert got.keys() == expected.keys()  # the model's own names: no "module." of DDP's wrapper
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=2e-5, msg=name)


def assert_the_ranks_agree(folder, processes=2):
    """Each process ended with the weights and optimizer of the others: they never parted ways."""
    ranks = [torch.load(folder / f"rank-{rank}.pt", weights_only=True) for rank in range(processes)]
    for rank in ranks[1:]:
        for name, weights in ranks[0]["model"].items():
            assert torch.equal(rank["model"][name], weights), name
        for number, state in ranks[0]["optimizer"]["state"].items():
            assert all(torch.equal(rank["optimizer"]["state"][number][key], value) for key, value in state.items())


def saved_by(folder):
    """The checkpoints each rank saved: {rank: [file names]}."""
    saves = {}
    for line in (folder / "saves.txt").read_text().splitlines():
        rank, name = re.fullmatch(r"rank (\d+) saved \.(.+)\.\d+\.tmp", line).groups()
        saves.setdefault(int(rank), []).append(name)
    return saves


def test_pretraining_on_two_processes_takes_one_process_s_steps(workspace, tmp_path, monkeypatch, capsys):
    one, two = learner(workspace, tmp_path / "one"), learner(workspace, tmp_path / "two")
    in_one_process(one, monkeypatch, train, "--steps", "10")
    expected_out = capsys.readouterr().out
    # Two processes, each taking its 8 windows of the batch 3 at a time (gradient accumulation).
    out = succeeded(torchrun(two, 2, "train", "--steps", "10", "--micro-batch", "3"))
    expected, got = read_checkpoint(one / "checkpoints" / "pretrain"), read_checkpoint(two / "checkpoints" / "pretrain")
    assert_same_model(got["model"], expected["model"])
    for number, state in expected["optimizer"]["state"].items():  # the gradients' scale too, which Adam's step hides
        torch.testing.assert_close(got["optimizer"]["state"][number]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-7)
    assert got["made_by"]["settings"]["processes"] == 2 and expected["made_by"]["settings"]["processes"] == 1
    assert_the_ranks_agree(two)
    # Rank 0 alone saves, logs to TensorBoard and prints.
    assert saved_by(two) == {0: ["model.pt"]}
    assert len(list((two / "runs" / "pretrain").iterdir())) == 1
    assert out.count("step 10: valid loss") == 1 and out.count("model: ") == 1
    # The loss logged is the whole batch's, gathered from the processes.
    loss = re.compile(r"step 10: loss ([0-9.]+)")
    assert float(loss.search(out)[1]) == pytest.approx(float(loss.search(expected_out)[1]), abs=2e-3)


def test_a_grpo_rollout_on_two_processes_updates_the_policy_as_one_process_does(workspace, tmp_path, monkeypatch,
                                                                                capsys):
    one, two = learner(workspace, tmp_path / "one"), learner(workspace, tmp_path / "two")
    # The same stories in both runs: each group's drawn with a seed of its instruction's, whoever writes it.
    in_one_process(one, monkeypatch, grpo, "--rollouts", "1", "--lr", "3e-3", STORIES_BY_PROMPT="1")
    expected_out = capsys.readouterr().out
    out = succeeded(torchrun(two, 2, "grpo", "--rollouts", "1", "--lr", "3e-3", STORIES_BY_PROMPT="1"))
    folder = Path("checkpoints") / "grpo" / "kl-0.05-lr-0.003"
    assert_same_model(read_checkpoint(two / folder)["model"], read_checkpoint(one / folder)["model"])
    assert_the_ranks_agree(two)
    # The figures of the whole rollout, gathered from both processes: the reward, the KL, the ties.
    line = re.compile(r"rollout 1: reward .* tied groups")
    assert line.findall(out) == line.findall(expected_out) and len(line.findall(out)) == 1
    assert saved_by(two) == {0: ["rollout-0.pt", "rollout-1.pt", "model.pt"]}
    assert len(list((two / "runs" / folder.relative_to("checkpoints")).iterdir())) == 1


def process_tree(pid):
    """pid and every process it started, and theirs (Linux: from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        if parent == pid:
            children.append(int(stat.parent.name))
    return [pid] + [p for child in children for p in process_tree(child)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds torchrun's processes in /proc")
def test_a_killed_torchrun_run_of_ppo_resumes_and_ends_as_one_process_does(workspace, tmp_path, monkeypatch):
    one, two = learner(workspace, tmp_path / "one"), learner(workspace, tmp_path / "two")
    checkpoints = Path("checkpoints") / "ppo" / "kl-0.05"
    run = torchrun(two, 2, "ppo", "--minutes", "5", wait=False, EVAL_EVERY="1", STORIES_BY_PROMPT="1")
    deadline = time.time() + 120
    while not (two / checkpoints / "rollout-1.pt").exists():
        assert run.poll() is None, (two / "errors.txt").read_text()[-3000:]
        assert time.time() < deadline, "no rollout-1.pt after 120 s"
        time.sleep(0.05)
    # torchrun starts each process in a session of its own: kill them all, not torchrun's group alone.
    for pid in process_tree(run.pid):
        os.kill(pid, signal.SIGKILL)
    run.wait()
    last = max(int(p.stem.split("-")[1]) for p in (two / checkpoints).glob("rollout-*.pt"))
    out = succeeded(torchrun(two, 2, "ppo", "--resume", "--rollouts", str(last + 1), EVAL_EVERY="1",
                             STORIES_BY_PROMPT="1"))
    assert f"rollout {last}, " in out and out.count("resuming") == 1
    assert re.findall(r"rollout (\d+): reward", out) == [str(last + 1)]
    # Both processes took up the checkpoint (weights, critic, optimizer, random state) and went
    # on together, to the model that one process makes in one go.
    assert_the_ranks_agree(two)
    assert set(saved_by(two)) == {0}
    in_one_process(one, monkeypatch, ppo, "--rollouts", str(last + 1), EVAL_EVERY="1", STORIES_BY_PROMPT="1")
    expected, got = read_checkpoint(one / checkpoints / f"rollout-{last + 1}.pt"), read_checkpoint(two / checkpoints)
    assert got["made_by"]["rollout"] == last + 1
    assert_same_model(got["model"], expected["model"])
    assert_same_model(read_checkpoint(two / checkpoints / f"rollout-{last + 1}.pt")["critic"], expected["critic"])


def test_three_processes_are_refused_in_one_line_as_they_cannot_share_16_instructions(workspace, tmp_path,
                                                                                      monkeypatch):
    # As torchrun --nproc_per_node 3 starts the processes: the first says why, the others stop without a word.
    folder = learner(workspace, tmp_path)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    for rank, said in (("0", "3 processes can't take equal shares of the 16 instructions of a rollout: "
                                "run 1, 2, 4, 8 or 16 of them"), ("1", 1)):
        for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stopped:
            in_one_process(folder, monkeypatch, grpo, "--rollouts", "1")
        assert stopped.value.code == said
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "checkpoints" / "grpo").exists()


@pytest.mark.parametrize("script, folder", [(train, "pretrain"), (finetune, "finetune")])
def test_pretraining_and_fine_tuning_refuse_three_processes_before_they_make_a_folder(script, folder, workspace,
                                                                                      tmp_path, monkeypatch):
    learner(workspace, tmp_path)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    what = "windows" if script is train else "examples"
    with pytest.raises(SystemExit, match=f"^3 processes can't take equal shares of the 16 {what} of a batch: "
                                         "run 1, 2, 4, 8 or 16 of them$"):
        in_one_process(tmp_path, monkeypatch, script, "--steps", "1")
    assert not (tmp_path / "runs").exists()  # check_writable makes its folders: it did not run
    assert (tmp_path / "checkpoints" / folder).exists() == (folder == "finetune")  # the fine-tuned model, copied


# Each process would do all of the script's work, and write its results again.
@pytest.mark.parametrize("script, args, writes", [
    (dpo, ["--steps", "1"], ["runs", "checkpoints/dpo"]),
    (evaluate, ["checkpoints/finetune"], ["runs"]),
    (preferences, ["--instructions", "1"], ["data/preferences.json"]),
    (sample, ["--words", "rain", "cake", "jump"], []),
], ids=["dpo", "evaluate", "preferences", "sample"])
def test_a_script_of_one_process_refuses_torchrun_before_it_writes_anything(script, args, writes, workspace, tmp_path,
                                                                           monkeypatch, capsys):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(learner(workspace, tmp_path))
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *args, "--device", "cpu"])
    with pytest.raises(SystemExit, match=rf"^{script.__name__}.py runs in one process: python {script.__name__}.py "
                                         r"\(torchrun takes train.py, finetune.py, ppo.py and grpo.py\)$"):
        script.main()
    assert not [path for path in writes if (tmp_path / path).exists()]
    assert capsys.readouterr().out == ""  # not a story, nor a setting


def test_a_missing_backend_is_refused_in_one_line(workspace, tmp_path, monkeypatch):
    # As torchrun starts the first of two processes, with a build of torch that has no gloo.
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        in_one_process(learner(workspace, tmp_path), monkeypatch, grpo, "--rollouts", "1")
    assert stopped.value.code == ("torchrun on cpu: this build of torch has no gloo backend to join the processes; "
                                  "run one process (python grpo.py)")
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("micro_batch", [None, 3])
def test_the_processes_take_each_row_once_and_their_shares_make_the_batch_s_mean(monkeypatch, micro_batch):
    # A fine-tuning batch: stories of many lengths, so the processes hold different numbers of
    # targets, and a mean over each one's would weigh the short stories' tokens more.
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(16, 30, generator=g)
    counted = (torch.arange(30) < torch.randint(2, 30, (16, 1), generator=g)).float()
    whole = (losses * counted).sum() / counted.sum()
    for processes in (1, 2, 4):
        rows, total = [], 0.0
        for rank in range(processes):
            monkeypatch.setattr(distributed, "world", lambda: processes)
            monkeypatch.setattr(distributed, "rank", lambda: rank)
            for piece, share, _ in distributed.pieces(torch.nn.Linear(1, 1), counted, micro_batch):
                rows += range(16)[piece]
                total += (losses[piece] * counted[piece]).sum() / counted[piece].sum() * share
        assert rows == list(range(16))
        # What DDP makes of them: the mean of the processes' gradients, here of their losses.
        assert total / processes == pytest.approx(whole.item(), rel=1e-6)


def test_the_processes_rows_one_after_another_are_each_row_once_in_order(monkeypatch):
    assert distributed.my_rows(7) == slice(0, 7)  # one process: all the rows
    # Counts the processes do not divide, and counts below their number (some processes take none).
    for processes in (1, 2, 3, 4, 8):
        monkeypatch.setattr(distributed, "world", lambda: processes)
        for count in (0, 1, 2, 3, 5, 7, 16, 17):
            rows, sizes = [], []
            for rank in range(processes):
                monkeypatch.setattr(distributed, "rank", lambda: rank)
                mine = range(count)[distributed.my_rows(count)]
                rows += mine
                sizes.append(len(mine))
            assert rows == list(range(count)), (processes, count)
            assert max(sizes) - min(sizes) <= 1, (processes, count)  # equal shares, as near as rows allow


def test_each_process_draws_with_a_seed_of_its_own_and_rank_0_with_the_run_s(monkeypatch):
    seeds = []
    for rank in range(4):
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        seeds.append(distributed.seed(5))
    assert seeds[0] == 5 and len(set(seeds)) == 4


def test_micro_batches_make_the_step_of_the_whole_batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 50, (16, 24), generator=g), torch.randint(0, 50, (16, 24), generator=g)
    y[:, :5] = -1  # prompts and padding, of many lengths
    y[torch.arange(24) > torch.randint(6, 24, (16, 1), generator=g)] = -1
    weights = 1 + 9 * (torch.rand(16, 24, generator=g) < 0.1).float()  # first uses counted 10 times
    for step, extra in ((train.train_step, ()), (finetune.weighted_step, (weights,))):
        models = []
        for micro_batch in (None, 3):
            torch.manual_seed(0)
            model = GPT(Config(vocab_size=50, **TINY)).eval()  # no dropout
            optimizer = train.make_optimizer(model)
            loss = step(model, optimizer, x, y, *extra, "cpu", "fp32", 1e-3, micro_batch)
            models.append((loss, model.state_dict(), optimizer.state_dict()["state"]))
        (whole, expected, adam), (pieces, got, adam_pieces) = models
        assert pieces == pytest.approx(whole, rel=1e-5)
        assert_same_model(got, expected)
        for number, state in adam.items():
            torch.testing.assert_close(adam_pieces[number]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-7)


def test_each_run_seed_and_rank_draw_their_own_seed(monkeypatch):
    seeds = set()
    for rank in range(4):
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        seeds |= {distributed.seed(number) for number in range(4)}
    assert len(seeds) == 16  # no two (run seed, rank) alike: seed 0's rank 1 is not seed 1's rank 0


def exchange(rank, world, folder):
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    # Rank 0's CPU times bf16 clearly faster, rank 1's not (timed alone, it would pick fp32).
    devices.bf16_speedup_on_cpu = lambda: 2.0 if rank == 0 else 1.0
    try:
        result = {
            "tensor": distributed.gather(torch.tensor([[rank, 0], [rank, 1]])).tolist(),
            "list": distributed.gather([f"{rank}a", f"{rank}b"]),
            "mean": distributed.mean(2.0 * rank + 1),  # 1 and 3
            "seconds": distributed.seconds_since(time.time() - (100 if rank == 0 else 0)),  # rank 0 began 100 s ago
            "precision": devices.default_precision(torch.device("cpu")),
        }
        (folder / f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_processes_gather_in_rank_order_average_and_take_rank_0_s_clock_and_precision(tmp_path):
    mp.spawn(exchange, args=(2, tmp_path), nprocs=2)  # gloo, as torchrun on the CPU; about 3 s
    for rank in range(2):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert got["tensor"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert got["list"] == ["0a", "0b", "1a", "1b"]
        assert got["mean"] == 2.0
        assert 100 <= got["seconds"] < 130
        assert got["precision"] == "bf16"


def torchrun_on_gpus(monkeypatch, rank, local_rank, world, per_machine, gpus):
    """The environment torchrun gives a process, on a machine of `gpus` GPUs (NCCL there too)."""
    for name, value in {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world,
                        "LOCAL_WORLD_SIZE": per_machine}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(distributed, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


def test_more_processes_than_the_machine_has_gpus_are_refused_in_one_line(monkeypatch):
    # torchrun --nproc_per_node 4 on a machine of 3 GPUs: one GPU each is one too few, refused
    # before any process takes a GPU, not when two of them share one.
    torchrun_on_gpus(monkeypatch, rank=0, local_rank=0, world=4, per_machine=4, gpus=3)
    with pytest.raises(SystemExit) as stopped:
        distributed.setup("cuda", 16, "instructions")
    assert stopped.value.code == ("4 processes on this machine, one GPU each, and it has 3: "
                                  "use --nproc_per_node 3 or fewer")
    assert not torch.distributed.is_initialized()


def test_what_rank_0_alone_runs_the_other_processes_wait_for(monkeypatch):
    # Rank 0 saves a checkpoint the others may read next: each process, rank 0 too, waits at a
    # barrier after it, and only rank 0 runs it.
    ran, waited = [], []
    monkeypatch.setattr(distributed, "barrier", lambda: waited.append(distributed.rank()))
    save = distributed.on_rank_0(lambda path: ran.append(path) or path)
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        assert save("rollout-7.pt") == ("rollout-7.pt" if rank == 0 else None)
    assert ran == ["rollout-7.pt"] and waited == [0, 1]


def test_a_process_takes_the_gpu_of_its_place_on_its_own_machine(monkeypatch):
    # The second of two machines of 4 GPUs: the process of rank 5 is its machine's second, on
    # cuda:1 (its machine has no cuda:5).
    torchrun_on_gpus(monkeypatch, rank=5, local_rank=1, world=8, per_machine=4, gpus=4)
    joined = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: joined.append(device))
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kwargs: joined.append(kwargs))
    assert distributed.setup("cuda", 16, "instructions") == torch.device("cuda", 1)
    assert joined == [torch.device("cuda", 1), {"device_id": torch.device("cuda", 1)}]


def test_the_first_process_of_each_machine_says_why_the_run_is_refused(monkeypatch):
    # On the second machine, rank 4 is the first process: torchrun shows its line, so it says why.
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: None)
    for rank, local_rank, code in (("4", "0", "why"), ("5", "1", 1)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as stopped:
            distributed.refuse("why")
        assert stopped.value.code == code


def test_torchrun_on_apple_s_gpu_is_refused_in_one_line_before_the_processes_join(monkeypatch):
    # torch has no backend to join processes on mps: gloo there would fail later, with a traceback.
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(distributed, "pick_device", lambda name: torch.device("mps"))
    joined = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kwargs: joined.append(backend))
    with pytest.raises(SystemExit) as stopped:
        distributed.setup("mps", 16, "windows of a batch")
    assert stopped.value.code == ("torchrun on mps: torch has no backend to join processes on Apple's GPUs; run one "
                                  "process (python train.py), or several on the CPU (--device cpu)")
    assert joined == []


def test_a_device_the_machine_lacks_is_said_once_by_the_first_process_of_the_machine(monkeypatch):
    # --device cuda on a machine without one: each process finds it so, and torchrun would show
    # the same line once per process, if each said it.
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: None)

    def no_cuda(name):
        raise SystemExit("--device cuda: this machine (or its build of torch) has no cuda")

    monkeypatch.setattr(distributed, "pick_device", no_cuda)
    for local_rank, code in (("0", "--device cuda: this machine (or its build of torch) has no cuda"), ("1", 1)):
        for name, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": "2",
                            "LOCAL_WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stopped:
            distributed.setup("cuda", 16, "instructions")
        assert stopped.value.code == code


def test_the_processes_of_every_machine_together_must_split_the_batch(monkeypatch):
    # Three machines of two processes: two divide 16, six do not, and each process would take
    # 2 or 3 rows, which gather() can't join. Refused before any process joins the others.
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    joined = []  # a join that went ahead would wait for five more processes: recorded, not made
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kwargs: joined.append(backend))
    with pytest.raises(SystemExit, match="^6 processes can't take equal shares of the 16 instructions"):
        distributed.setup("cpu", 16, "instructions")
    assert joined == []


def test_two_processes_wait_for_each_other_at_a_barrier(monkeypatch):
    # Rank 1 must not read a checkpoint, or go on, before rank 0 has saved it: two processes are
    # enough to need the barrier. One process has no group to wait in.
    waited = []
    monkeypatch.setattr(torch.distributed, "barrier", lambda: waited.append(distributed.world()))
    for processes in (1, 2, 4):
        monkeypatch.setattr(distributed, "world", lambda: processes)
        distributed.barrier()
    assert waited == [2, 4]


def test_a_rank_alone_in_the_environment_is_not_taken_for_torchrun(monkeypatch):
    # torchrun sets RANK and WORLD_SIZE together: a RANK left in a learner's shell by another
    # tool must not make python train.py read a WORLD_SIZE that is not there.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not distributed.under_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.under_torchrun()
