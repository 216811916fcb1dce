"""
Episode 2, the model: a GPT in one readable file, and the pieces every later script shares.

Token and position embeddings; pre-norm blocks, each a causal self-attention (torch's
scaled_dot_product_attention) and an MLP, each behind a layer norm and added back to the
stream; dropout; a final layer norm, and an output layer that shares its weights with the
token embedding. The series' model is the Config below: about 14.6M parameters.

Writing a story one token at a time would recompute every earlier position for each new
token. The KV cache keeps each layer's keys and values, so a new token costs one position.
And when a batch repeats one prompt (a GRPO group), the prompt runs once and its keys and
values are copied to every story. A rollout of many prompts of several lengths (GRPO's 16
instructions, each 8 times) is one batch too: each prompt runs once, each row then writes at
its own positions, and rows whose story has ended leave the batch.

Shared by the later scripts: pick_device(), the CHECKPOINTS and RUNS folders,
save_checkpoint() and load_checkpoint(); log_softmax_at(), each target's log-probability
from the logits, which DPO, PPO and GRPO train on. And every layer calls attention():
torch's fused attention, with a faster backward pass where DPO, PPO and GRPO train in
bfloat16 on a CPU (episode 16's step 10).

    python model.py    (prints the series' model and its parameter count)
"""
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from textwrap import shorten

import torch
import torch.nn as nn
import torch.nn.functional as F

from files import atomic
from tokenizer import VOCAB_SIZE

CHECKPOINTS = Path("checkpoints")
RUNS = Path("runs")
# The command that makes each folder of checkpoints, for the error when one is missing.
MADE_BY = {"pretrain": "python train.py", "finetune": "python finetune.py", "dpo": "python dpo.py",
           "ppo": "python ppo.py", "grpo": "python grpo.py"}


@dataclass
class Config:
    vocab_size: int = VOCAB_SIZE
    context: int = 256  # positions: an instruction (about 20 tokens) and a story of 200 fit
    n_layer: int = 7
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.1


TINY = dict(context=256, n_layer=2, n_head=2, n_embd=32)  # for tests: Config(vocab_size=..., **TINY)
BLOCK = 64  # tokens in a block of next_token's running sum: 84 blocks of the series' 5,376


class KVCache:
    """Each layer's keys and values for the positions written so far. `filled` counts those
    positions: one number when every row's prompt has one length, or a tensor with a count
    for each row when a batch holds prompts of several lengths (see gather)."""

    def __init__(self, config, length):
        self.n_layer, self.length, self.filled = config.n_layer, length, 0
        self.keys = self.values = None  # made at the first call, on the layers' device

    def add(self, layer, k, v):
        """Stores new keys and values; returns the layer's keys and values so far, and which of
        them each row may see (None: all of them)."""
        if torch.is_tensor(self.filled):
            return self.add_per_row(layer, k, v)
        batch, heads, new, head_size = k.shape
        if self.keys is None:
            shape = (self.n_layer, batch, heads, self.length, head_size)
            # In the precision the layers give them: bfloat16 under its autocast, where each new
            # token's attention reads the whole cache, so half the bytes is a faster step.
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        end = self.filled + new
        self.keys[layer, :, :, self.filled:end] = k
        self.values[layer, :, :, self.filled:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end], None

    def add_per_row(self, layer, k, v):
        # One new token per row, each at its row's own next position; a row sees only the
        # positions it has filled, not the slots a shorter prompt left empty.
        rows = torch.arange(k.size(0), device=k.device)
        self.keys[layer, rows, :, self.filled] = k[:, :, 0]
        self.values[layer, rows, :, self.filled] = v[:, :, 0]
        end = int(self.filled.max()) + 1
        visible = torch.arange(end, device=k.device) <= self.filled[:, None]
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end], visible[:, None, None, :]

    def repeat(self, copies):
        """A cache of one prompt becomes a cache of `copies` identical rows."""
        self.keys = self.keys.repeat(1, copies, 1, 1, 1)
        self.values = self.values.repeat(1, copies, 1, 1, 1)

    def gather(self, caches, rows):
        """Fills this cache with the caches of several prompts (one row each, or one row per
        copy), each copied to its number of rows; each row keeps its own count of positions."""
        first = caches[0].keys
        shape = (self.n_layer, sum(rows), first.size(2), self.length, first.size(4))
        self.keys, self.values = first.new_zeros(shape), first.new_zeros(shape)
        start = 0
        for cache, count in zip(caches, rows):
            self.keys[:, start:start + count, :, :cache.filled] = cache.keys[:, :, :, :cache.filled]
            self.values[:, start:start + count, :, :cache.filled] = cache.values[:, :, :, :cache.filled]
            start += count
        self.filled = torch.tensor([c.filled for c, count in zip(caches, rows) for _ in range(count)],
                                   device=first.device)

    def keep(self, rows):
        """Only these rows (a mask) from now on: the others have ended their stories."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        if torch.is_tensor(self.filled):
            self.filled = self.filled[rows]


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.proj_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None, layer=0):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        visible = None
        if cache is not None:
            # Either the whole prompt from position 0, or one new token that may see all before it.
            assert T == 1 or (not torch.is_tensor(cache.filled) and cache.filled == 0), \
                "the cache takes a prompt first, then one token at a time"
            k, v, visible = cache.add(layer, k, v)
        # Many tokens each see those before them; one new token sees its row's cached positions.
        y = attention(q, k, v, visible, dropout=self.dropout if self.training else 0.0, causal=T > 1)
        return self.proj_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.down = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attention = SelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache=None, layer=0):
        x = x + self.attention(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.context, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: one matrix reads and writes tokens
        self.apply(self.init_weights)
        # GPT-2's scaling: each block adds to the stream twice, so its output layers start smaller.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def parameter_count(self):
        return sum(p.numel() for p in self.parameters())  # the tied matrix counts once

    def forward(self, tokens, targets=None, cache=None, hidden=False):
        """Logits for every position, and the mean next-token loss where targets are given
        (-1 marks a target to skip). With hidden=True, the logits and the final layer norm's
        output instead: the channels the output layer reads, which PPO's critic reads too."""
        B, T = tokens.shape
        start = cache.filled if cache is not None else 0
        # Each row's positions: from 0 for a prompt, or past the row's own prompt for a new token.
        positions = torch.arange(T, device=tokens.device) + torch.as_tensor(start, device=tokens.device).view(-1, 1)
        if int(positions.max()) >= self.config.context:
            raise ValueError(f"{int(positions.max()) + 1} positions is more than the model's context "
                             f"of {self.config.context}")
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.filled += T  # every layer wrote its keys and values at the same positions
        x = self.ln(x)
        logits = self.head(x)
        if hidden:
            return logits, x
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature=1.0, top_k=None, stop=None, generator=None):
        """Writes up to max_new_tokens after each row of prompts, every row at once: prompts is
        a (B, T) tensor of prompts of one length, or a list of such tensors of several lengths
        (a GRPO rollout: each instruction stacked eight times). Temperature 0 takes the
        likeliest token. A row that writes `stop` writes only `stop` after it, and writing
        ends early once every row has stopped. Returns each prompt with what was written after
        it, as it came: a (B, T + tokens written) tensor, or a list of them."""
        groups = prompts if isinstance(prompts, list) else [prompts]
        assert max_new_tokens >= 1, "write at least one token"
        logits, cache = self.prefill(groups, max_new_tokens)
        written = self.write(logits, cache, max_new_tokens, temperature, top_k, stop, generator)
        outs = [torch.cat([group, new], dim=1) for group, new in zip(groups, written.split([len(g) for g in groups]))]
        return outs if isinstance(prompts, list) else outs[0]

    def prefill(self, groups, max_new_tokens):
        """Runs the prompts through the model, filling a cache; returns each row's next-token
        logits and the cache."""
        caches, logits = [], []
        for group in groups:
            # A group that repeats one prompt runs it once, with a batch of one; its keys and
            # values are then copied to every row, and its next-token logits serve every row.
            shared = len(group) > 1 and bool((group == group[:1]).all())
            cache = KVCache(self.config, group.size(1) + max_new_tokens)
            out, _ = self(group[:1] if shared else group, cache=cache)
            caches.append(cache)
            logits.append(out[:, -1].expand(len(group), -1))
        if len(groups) == 1:
            if shared:
                cache.repeat(len(group))
            return logits[0], cache
        # Prompts of several lengths: one cache for all the rows, each counting its own positions.
        cache = KVCache(self.config, max(c.length for c in caches))
        cache.gather(caches, [len(group) for group in groups])
        return torch.cat(logits), cache

    def write(self, logits, cache, max_new_tokens, temperature, top_k, stop, generator):
        """The tokens written after each row's prompt, one step for every row at a time:
        (rows, tokens written)."""
        rows = logits.size(0)
        written = torch.full((rows, max_new_tokens), 0 if stop is None else stop, device=logits.device)
        writing = torch.arange(rows, device=logits.device)  # the rows in the batch, by their place in written
        ended = torch.zeros(rows, dtype=torch.bool, device=logits.device)
        for step in range(max_new_tokens):
            token = next_token(logits, temperature, top_k, generator)
            if stop is not None:
                token = torch.where(ended, stop, token)
                ended |= token == stop
            written[writing, step] = token
            if step + 1 == max_new_tokens or bool(ended.all()):
                break
            # Rows that have ended leave the batch once they are a quarter of it, so they stop
            # costing a step each; not one at a time, as each leaving copies the cache.
            if int(ended.sum()) * 4 >= len(ended):
                going = ~ended
                writing, token, ended = writing[going], token[going], ended[going]
                cache.keep(going)
            logits, _ = self(token[:, None], cache=cache)
            logits = logits[:, -1]
        return written[:, :step + 1]


def sampling_logits(logits, temperature, top_k):
    """The logits a token is drawn from: divided by the temperature, and all but the k
    likeliest tokens ruled out when top_k is given."""
    logits = logits.float() / temperature
    if top_k:
        kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[..., [-1]]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return logits


def next_token(logits, temperature, top_k, generator):
    """One token for each row of logits: the likeliest at temperature 0, else a draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = sampling_logits(logits, temperature, top_k)
    # Inverse-CDF sampling: draw a uniform number and take the token where it falls in the
    # running sum of the probabilities. It samples from the same distribution as
    # torch.multinomial with one random number per row, where multinomial draws noise for
    # every one of the 5,376 tokens. The running sum is in float64 (but for Apple's MPS, which
    # has none), so that rounding moves no token's share, and in two steps, as a sum that runs
    # along 5,376 numbers is the slowest part of a step: over blocks of BLOCK tokens, to find
    # the block the draw falls in, then along that block alone.
    precise = torch.float32 if logits.device.type == "mps" else torch.float64
    rows, vocab = logits.shape
    probs = F.pad(F.softmax(logits, dim=-1), (0, -vocab % BLOCK)).to(precise).view(rows, -1, BLOCK)
    by_block = probs.sum(dim=-1).cumsum(dim=-1)
    uniform = torch.rand(rows, 1, generator=generator, device=logits.device, dtype=precise)
    draw = uniform * by_block[:, -1:]  # scaled by the whole sum, which rounding leaves a hair off 1
    block = torch.searchsorted(by_block, draw, right=True).clamp(max=by_block.size(1) - 1)
    before = F.pad(by_block, (1, 0)).gather(1, block)  # the sum of the blocks before it
    within = probs[torch.arange(rows, device=logits.device), block.squeeze(1)].cumsum(dim=-1)
    place = torch.searchsorted(within, draw - before, right=True).clamp(max=BLOCK - 1)
    # Rounding can leave a draw a hair past its block's sum: it then takes the block's last token.
    return (block * BLOCK + place).squeeze(1).clamp(max=vocab - 1)


# ---------------------------------------------------------------- log-probabilities

CACHE_ROWS = 32  # rows of logits log_softmax_at takes at a time on a CPU: 32 x 5,376 float32 numbers, 688 KB


def log_softmax_at(logits, targets):
    """log_softmax(logits)[target] for each row's target index, in float32 (float64 for
    float64 logits), with its gradient: F.log_softmax(logits.float(), -1).gather(...) without
    the float32 copy of every logit it makes, and keeps for its backward pass (for a GRPO
    minibatch, 16 x 224 x 5,376 numbers, 77 MB, written and read several times). On a CPU it
    takes CACHE_ROWS rows at a time, few enough that they stay in the cache (a GPU takes all
    the rows at once, in float32); the backward pass works each row's softmax out again from
    the logits."""
    return LogSoftmaxAt.apply(logits, targets)


class LogSoftmaxAt(torch.autograd.Function):
    """log_softmax_at's forward and backward passes."""

    @staticmethod
    def forward(ctx, logits, targets):
        flat, flat_targets = logits.flatten(0, -2), targets.reshape(-1, 1)
        precise = torch.promote_types(logits.dtype, torch.float32)
        # log p(t) = logit_t - log sum_j e^logit_j: the row's log-sum, and its target's logit.
        log_sums = torch.empty(len(flat), dtype=precise, device=logits.device)
        picked = torch.empty_like(log_sums)
        for rows in row_slices(flat):
            chunk = flat[rows].to(precise)
            log_sums[rows] = torch.logsumexp(chunk, dim=-1)
            picked[rows] = chunk.gather(1, flat_targets[rows]).squeeze(1)
        ctx.save_for_backward(logits, targets, log_sums)
        return (picked - log_sums).view(targets.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable  # a gradient of the gradient would need the log-sums' own
    def backward(ctx, grad):
        # d log p(t) / d logit_j = [j = t] - softmax_j: the softmax again, from the logits and the row's log-sum.
        logits, targets, log_sums = ctx.saved_tensors
        flat, flat_targets = logits.flatten(0, -2), targets.reshape(-1, 1)
        flat_grad = grad.reshape(-1, 1).to(log_sums.dtype)
        grad_logits = torch.empty_like(flat)  # in the logits' precision, as their own gradient would be
        for rows in row_slices(flat):
            softmax = (flat[rows].to(log_sums.dtype) - log_sums[rows, None]).exp_()
            grad_logits[rows] = softmax.mul_(-flat_grad[rows]).scatter_add_(1, flat_targets[rows], flat_grad[rows])
        return grad_logits.view_as(logits), None


def row_slices(flat):
    """Slices of CACHE_ROWS rows on a CPU; one slice of them all on a GPU, where each slice is a kernel launch."""
    step = CACHE_ROWS if flat.device.type == "cpu" else max(1, len(flat))
    return [slice(start, start + step) for start in range(0, len(flat), step)]


# ---------------------------------------------------------------- attention

# The CPU kernel that scaled_dot_product_attention calls, forward and backward: torch's private
# operators, so a build may lack them (torch's versions can rename them); attention() then
# takes the public function.
FLOAT32_BACKWARD = all(hasattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"))


def attention(q, k, v, visible, dropout, causal):
    """torch's scaled_dot_product_attention. For a bfloat16 pass on a CPU that is going to be
    trained through (the updates of DPO, PPO and GRPO: causal, no dropout, no mask), the same
    forward pass, and the backward pass in float32, which torch's CPU kernel computes faster
    than in bfloat16 (episode 16's step 10 measures it)."""
    if (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.requires_grad and causal and visible is None
            and dropout == 0 and FLOAT32_BACKWARD):
        return CausalAttentionFloat32Backward.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, is_causal=causal)


class CausalAttentionFloat32Backward(torch.autograd.Function):
    """Causal attention whose forward pass is scaled_dot_product_attention's on a CPU, to the
    last bit, and whose backward pass runs in float32 (float64 for float64 inputs), from the
    same saved tensors: the inputs, the output and each query's log-sum of exponentials."""

    @staticmethod
    def forward(ctx, q, k, v):
        # The kernel itself, as the public function drops what it returns beside the output:
        # each query's log-sum of exponentials, which the backward pass needs.
        out, log_sums = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, log_sums)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # the kernel's backward pass has no gradient of its own
    def backward(ctx, grad):
        q, k, v, out, log_sums = ctx.saved_tensors
        precise = torch.promote_types(q.dtype, torch.float32)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.to(precise) for t in (grad, q, k, v, out)), log_sums, dropout_p=0.0, is_causal=True)
        # Each gradient in its input's precision, as torch's own backward pass gives them.
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


# ---------------------------------------------------------------- devices and precision

def pick_device(name=None):
    """The GPU when there is one (CUDA, then Apple's MPS), else the CPU; --device overrides."""
    if name:
        return chosen_device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def chosen_device(name):
    """The device named by --device, refused in one line when the series doesn't run on it
    (torch knows others: xpu, meta...) or this machine has no such device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise SystemExit(f"--device {name}: not a device the series runs on; use cpu, cuda or mps")
    available = {"cpu": lambda: True, "mps": torch.backends.mps.is_available,
                 "cuda": lambda: (device.index or 0) < torch.cuda.device_count()}
    if not available[device.type]():
        raise SystemExit(f"--device {name}: this machine (or its build of torch) has no {name}")
    return device


def autocast(device, precision):
    """Matrix products in bfloat16 where asked, weights and their updates in float32."""
    if precision == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


def default_precision(device):
    """bf16 on CUDA GPUs that have it and on CPUs that multiply bf16 matrices clearly faster
    than fp32 (this one: 2.1 to 2.5 times; many laptops' CPUs: slower); fp32 elsewhere, Apple's
    MPS included. --precision overrides it."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    if device.type == "cpu":
        return "bf16" if bf16_speedup_on_cpu() > 1.5 else "fp32"
    return "fp32"


def bf16_speedup_on_cpu(size=512, repeats=8):
    """How many times faster this CPU multiplies bf16 matrices than fp32 ones."""
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)
        a @ a  # warm up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ a
        seconds[dtype] = time.perf_counter() - start
    return seconds[torch.float32] / seconds[torch.bfloat16]


# ---------------------------------------------------------------- checkpoints

def checkpoint_file(path):
    """A folder means the final model in it, model.pt; a file is itself."""
    path = Path(path)
    return path if path.suffix == ".pt" else path / "model.pt"


def save_checkpoint(path, model, tokenizer, made_by, optimizer=None, **state):
    """Weights, config, the tokenizer they were trained with, and what made them
    (script, step, settings), written to a temporary file and then renamed. An optimizer's
    state and any further `state` (an RL run's critic, its random state) are for resuming."""
    checkpoint = {"model": model.state_dict(), "config": asdict(model.config),
                  "tokenizer": tokenizer.fingerprint(), "made_by": made_by, **state}
    if optimizer is not None:
        checkpoint["optimizer"] = optimizer.state_dict()
    # Through a file of ours: torch then lets a full disk's OSError through, which atomic() words.
    with atomic(checkpoint_file(path)) as tmp, open(tmp, "wb") as file:
        torch.save(checkpoint, file)


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
    if not isinstance(checkpoint, dict) or not {"model", "config", "tokenizer", "made_by"} <= checkpoint.keys():
        raise SystemExit(f"{file} is not a checkpoint of this series; make it again with {command}")
    return checkpoint


def made_with(file):
    """The command that makes a checkpoint, for the errors that name it."""
    # The folder under checkpoints/ says which script makes it: checkpoints/grpo/kl-0/... is grpo.py's.
    folders = file.parts[:-1]
    script_folder = folders[folders.index(CHECKPOINTS.name) + 1] if CHECKPOINTS.name in folders[:-1] else None
    return MADE_BY.get(script_folder, "the script that writes it")


def load_checkpoint(path, device="cpu", tokenizer=None, quiet=False):
    """The model in a checkpoint, on `device`; with a tokenizer, refuses a model trained with
    another one (its tokens would mean other things), and any model whose context is not the
    series' (pretraining's windows, fine-tuning's examples and evaluation all take 256 tokens)."""
    checkpoint = read_checkpoint(path)
    file = checkpoint_file(path)
    if tokenizer is not None and checkpoint["tokenizer"] != tokenizer.fingerprint():
        raise SystemExit(f"{file} was trained with another tokenizer than data/tokenizer.json; "
                         "train it again, or prepare the data it was trained on")
    try:
        model = GPT(Config(**checkpoint["config"]))
        model.load_state_dict(checkpoint["model"])
    except (TypeError, RuntimeError) as error:
        lines = str(error).strip().splitlines()
        reason = lines[1] if len(lines) > 1 else lines[0]  # the first line only names the class
        # One short line: a list of missing weights runs to kilobytes.
        raise SystemExit(f"{file} does not match the model it describes ({shorten(reason, 150, placeholder=' ...')}); "
                         f"make it again with {made_with(file)}")
    if model.config.context != Config.context:
        raise SystemExit(f"{file} has a context of {model.config.context} tokens, where the series' scripts take "
                         f"{Config.context}; make it again with {made_with(file)}")
    if not quiet:
        made_by = checkpoint["made_by"]
        when = f"rollout {made_by['rollout']}" if "rollout" in made_by else f"step {made_by.get('step', '?')}"
        print(f"model: {model.parameter_count() / 1e6:.2f}M parameters, {file} ({made_by.get('script', '?')}, {when})")
    return model.to(device)


if __name__ == "__main__":
    model = GPT(Config())
    print(model)
    print(f"{model.parameter_count():,} parameters")
