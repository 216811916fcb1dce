"""
Episode 4, sampling: from a prompt to a story, one token at a time, fast.

write() is what every later episode uses to hear from a model: a prompt in, a story out,
with a temperature (1 samples from the model's own distribution; lower is safer and duller;
0 always takes the likeliest token), top-k (sample only among the k likeliest tokens), a
seed, and at most MAX_NEW_TOKENS. A story stops at its first end-of-text, which it keeps:
ending a story is something the model has to learn too.

The model's own generate() (model.py) runs the whole story again for every new token.
generate() here writes fast: the same tokens at temperature 0, and draws from the same
distribution otherwise (with a draw of its own, so a seed gives other stories than there).
The KV cache keeps each layer's keys and values, so a new token costs one position. When a
batch repeats one prompt (a GRPO group), the prompt runs once and its keys and values are
copied to every story. A rollout of many prompts of several lengths (GRPO's 16 instructions,
each 8 times) is one batch too: each prompt runs once, each row then writes at its own
positions, and rows whose story has ended leave the batch. write_stories() writes up to 128
prompts at once this way; the RL episodes write their 128 stories with generate().

A prompt starts with an end-of-text token, as every story did in pretraining, so the model
knows a new story begins. Writing runs in float32 unless the caller asks for bfloat16 with
devices.autocast, as the RL episodes do where it is faster (their update runs in it too).

    python sample.py --words rain cake jump                  (the fine-tuned model)
    python sample.py --model checkpoints/pretrain --prompt "Once upon a time"
"""
import argparse
import math
from itertools import groupby

import torch
import torch.nn.functional as F

import distributed
from checkpoints import CHECKPOINTS, load_checkpoint
from data import WORD, check_seed, instruction
from devices import pick_device
from kernels import cache_block
from tokenizer import encodable, encode_prompt, load_tokenizer

MAX_NEW_TOKENS = 200  # the most tokens a story gets
# The lowest temperature but 0: below it, logits divided by it run to infinity (1e-40 makes
# them all infinite) and the draw lands past the last token. 0 takes the likeliest token.
MIN_TEMPERATURE = 1e-3
BLOCK = 64  # tokens in a block of next_token's running sum: 84 blocks of the series' 5,376


def cut_at_end(tokens, eot):
    """A story's tokens up to and including its first end-of-text."""
    return tokens[: tokens.index(eot) + 1] if eot in tokens else tokens


def write_stories(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=None, seed=0,
                  batch=128):
    """One story per prompt (texts), as lists of tokens cut after their first end-of-text.
    The stories are written `batch` at a time, in one pass whatever their prompts' lengths,
    and a prompt repeated one after another runs once for all its copies. With a seed, the
    same prompts give the same stories."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    stories = []
    was_training = model.training
    model.eval()  # no dropout while writing
    for start in range(0, len(encoded), batch):
        # Copies of one prompt, one after another, make a group: a (copies, length) tensor.
        groups = [torch.tensor(list(copies), device=device) for _, copies in groupby(encoded[start:start + batch])]
        outs = generate(model, groups, max_new_tokens, temperature, top_k, stop=tokenizer.eot, generator=generator)
        for group, out in zip(groups, outs):
            stories += [cut_at_end(row, tokenizer.eot) for row in out[:, group.size(1):].tolist()]
    model.train(was_training)
    return stories


def write(model, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=None, seed=0):
    """The story a model writes after a prompt, as text; it ends with <|endoftext|> if the model ended it."""
    (story,) = write_stories(model, tokenizer, [prompt], max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(story)


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=None, stop=None, generator=None):
    """Writes as model.generate does, fast: up to max_new_tokens after each row of prompts, every
    row at once. prompts is a (B, T) tensor of prompts of one length, or a list of such
    tensors of several lengths (a GRPO rollout: each instruction stacked eight times).
    Temperature 0 takes the likeliest token. A row that writes `stop` writes only `stop`
    after it, and writing ends early once every row has stopped. Returns each prompt with
    what was written after it, as it came: a (B, T + tokens written) tensor, or a list of them."""
    groups = prompts if isinstance(prompts, list) else [prompts]
    assert max_new_tokens >= 1, "write at least one token"
    logits, cache = prefill(model, groups, max_new_tokens)
    written = write_after(model, logits, cache, max_new_tokens, temperature, top_k, stop, generator)
    outs = [torch.cat([group, new], dim=1) for group, new in zip(groups, written.split([len(g) for g in groups]))]
    return outs if isinstance(prompts, list) else outs[0]


def prefill(model, groups, max_new_tokens):
    """Runs the prompts through the model, filling a cache; returns each row's next-token
    logits and the cache."""
    caches, logits = [], []
    for group in groups:
        # A group that repeats one prompt runs it once, with a batch of one; its keys and
        # values are then copied to every row, and its next-token logits serve every row.
        shared = len(group) > 1 and bool((group == group[:1]).all())
        cache = KVCache(model.config, group.size(1) + max_new_tokens)
        out, _ = model(group[:1] if shared else group, cache=cache)
        caches.append(cache)
        logits.append(out[:, -1].expand(len(group), -1))
    if len(groups) == 1:
        if shared:
            cache.repeat(len(group))
        return logits[0], cache
    # Several groups: one cache for all the rows, each counting its own positions where the
    # prompts' lengths differ.
    cache = KVCache(model.config, max(c.length for c in caches))
    cache.gather(caches, [len(group) for group in groups])
    return torch.cat(logits), cache


def write_after(model, logits, cache, max_new_tokens, temperature, top_k, stop, generator):
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
        logits, _ = model(token[:, None], cache=cache)
        logits = logits[:, -1]
    return written[:, :step + 1]


class KVCache:
    """Each layer's keys and values for the positions written so far, kept in blocks of
    positions (kernels.cache_block: 32 on a CPU without AMX, where a new token's attention
    reads them a block at a time; elsewhere one block of the whole context). `filled` counts
    the positions: one number when every row's prompt has one length, or a tensor with a count
    for each row when a batch holds prompts of several lengths (see gather)."""

    def __init__(self, config, length):
        self.n_layer, self.context, self.length, self.filled = config.n_layer, config.context, length, 0
        self.keys = self.values = None  # made at the first call, on the layers' device
        self.step = None  # where a step's token goes and what it reads (this_step), at its first layer

    def add(self, layer, k, v):
        """Stores new keys and values; returns the layer's keys and values so far, and which of
        them each row may see (None: all of them)."""
        # Either a whole prompt from position 0, or one new token that may see all before it.
        assert k.size(2) == 1 or (not torch.is_tensor(self.filled) and self.filled == 0), \
            "the cache takes a prompt first, then one token at a time"
        if self.keys is None:
            self.make(k.size(0), k.size(1), k.size(3), k.dtype, k.device)
        if k.size(2) > 1:
            self.write_prompt(layer, k, v)
            return k, v, None  # a prompt: its own keys and values are all the cache holds
        # One new token a row, each at its row's own next position. Where that is, which of the
        # cache's positions a layer reads and which of them each row sees are the same in every
        # layer: worked out once a step, at its first layer.
        if layer == 0:
            self.step = self.this_step(k.size(0), k.device)
        rows, block, slot, read, visible = self.step
        self.keys[layer, block, rows, :, slot] = k[:, :, 0]
        self.values[layer, block, rows, :, slot] = v[:, :, 0]
        return self.keys[(layer, *read)], self.values[(layer, *read)], visible

    def make(self, rows, heads, channels, dtype, device):
        """Room for `length` positions of each row's keys and of its values, in the layers'
        precision, in blocks: (layers, blocks, rows, heads, positions of a block, channels).
        Where the cache is in blocks, read by hand, each block's keys lie in memory channel by
        channel (the keys are a transposed view): the product of a query with a block's keys
        multiplies by them in that order, and torch's CPU products read a matrix fastest as it
        lies (on a 2-core EPYC in float32, the attention takes about a fifth less time than
        over keys position by position; episode 16's speed page has the figures)."""
        self.block = cache_block(device, self.context)
        blocks = -(-self.length // self.block)
        # Zeros, not empty memory: a block's slots not yet written are read too, with weight 0,
        # and 0 times a stray NaN would be NaN (once rows have left, keep() leaves other rows'
        # keys and values there, finite too).
        size = (self.n_layer, blocks, rows, heads, self.block, channels)
        self.values = torch.zeros(size, dtype=dtype, device=device)
        if self.block == self.context:  # one block: torch's fused kernel reads the keys as they are
            self.keys = torch.zeros(size, dtype=dtype, device=device)
        else:
            self.keys = torch.zeros(size[:-2] + (channels, self.block), dtype=dtype, device=device).transpose(-2, -1)

    def write_prompt(self, layer, k, v):
        # A prompt's positions from 0, a block at a time.
        for block, start in enumerate(range(0, k.size(2), self.block)):
            count = min(self.block, k.size(2) - start)
            self.keys[layer, block, :, :, :count] = k[:, :, start:start + count]
            self.values[layer, block, :, :, :count] = v[:, :, start:start + count]

    def this_step(self, batch, device):
        """Where this step's token goes in each row (its block, and its slot in the block; the
        token is at the row's position `filled`), the index of what each layer reads, and which
        of those positions each row may see (None: all): its own, up to this token."""
        # Each row at its own position (a block, and a slot in it), or every row at one.
        rows = torch.arange(batch, device=device) if torch.is_tensor(self.filled) else slice(None)
        block, slot = self.filled // self.block, self.filled % self.block
        end = int(self.filled.max() if torch.is_tensor(self.filled) else self.filled) + 1
        if self.block == self.context:  # one block, its positions so far: torch's fused kernel reads them
            read, length = (0, slice(None), slice(None), slice(None, end)), end
        else:  # every block that holds a position so far, each whole
            blocks = -(-end // self.block)
            read, length = (slice(None, blocks),), blocks * self.block
        visible = None
        if length != end or torch.is_tensor(self.filled):
            # Not the slots a shorter prompt left empty, nor those not yet written.
            filled = torch.as_tensor(self.filled, device=device).reshape(-1, 1)
            visible = (torch.arange(length, device=device) <= filled)[:, None, None, :]
        return rows, block, slot, read, visible

    def repeat(self, copies):
        """A cache of one prompt becomes a cache of `copies` identical rows, laid out as make() lays them."""
        keys, values = self.keys, self.values
        self.make(copies, keys.size(3), keys.size(5), keys.dtype, keys.device)
        self.keys.copy_(keys)  # the one row to every row
        self.values.copy_(values)

    def gather(self, caches, rows):
        """Fills this cache with the caches of several prompts (one row each, or one row per
        copy), each copied to its number of rows; each row keeps its own count of positions,
        or, where the prompts have one length, all rows one count."""
        first = caches[0].keys
        self.make(sum(rows), first.size(3), first.size(5), first.dtype, first.device)
        start = 0
        for cache, count in zip(caches, rows):
            blocks = -(-cache.filled // self.block)
            self.keys[:, :blocks, start:start + count] = cache.keys[:, :blocks]
            self.values[:, :blocks, start:start + count] = cache.values[:, :blocks]
            start += count
        # One count where every prompt has one length (most of GRPO's rollouts): each step then
        # writes every row's token at one place, and no row needs a mask of its own.
        counts = [c.filled for c, count in zip(caches, rows) for _ in range(count)]
        self.filled = counts[0] if len(set(counts)) == 1 else torch.tensor(counts, device=first.device)

    def keep(self, rows):
        """Only these rows (a mask) from now on: the others have ended their stories. The rows
        that stay move, in their own memory, to where a cache of fewer rows keeps them, so that
        a layer's blocks stay one dense tensor, which a new token's attention reads without
        copying it; a new cache would copy every slot into fresh memory the system must first
        hand over. Only the blocks written so far move."""
        kept = rows.nonzero().squeeze(1)
        end = int(self.filled.max()) if torch.is_tensor(self.filled) else self.filled
        written = -(-end // self.block)
        self.keys, self.values = (self.narrowed(cache, kept, written) for cache in (self.keys, self.values))
        if torch.is_tensor(self.filled):
            self.filled = self.filled[rows]

    @staticmethod
    def narrowed(cache, kept, written):
        # The cache as it lies in memory: keys in blocks are a transposed view.
        transposed = not cache.is_contiguous()
        memory = cache.transpose(-2, -1) if transposed else cache
        # Each (layer, block) in the order they lie in memory: its kept rows, gathered first,
        # go where the smaller cache has them, at or before where they were, over nothing
        # that is still to be read.
        n_layer, blocks, rows = memory.shape[:3]
        size = (n_layer, blocks, len(kept)) + memory.shape[3:]
        by_row = memory.view(n_layer * blocks, rows, -1)
        smaller = memory.view(-1)[:math.prod(size)].view(n_layer * blocks, len(kept), -1)
        for at in range(n_layer * blocks):
            if at % blocks < written:
                smaller[at] = by_row[at, kept]
        smaller = smaller.view(size)
        return smaller.transpose(-2, -1) if transposed else smaller


def sampling_logits(logits, temperature, top_k):
    """The logits a token is drawn from: divided by the temperature, and all but the k
    likeliest tokens ruled out when top_k is given."""
    # At temperature 1 the division would only copy them.
    logits = logits.float() if temperature == 1 else logits.float() / temperature
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
    probs = F.softmax(logits, dim=-1).to(precise)
    if vocab % BLOCK:  # the last block filled up with tokens of probability 0
        probs = F.pad(probs, (0, -vocab % BLOCK))
    probs = probs.view(rows, -1, BLOCK)
    by_block = probs.sum(dim=-1).cumsum(dim=-1)
    uniform = torch.rand(rows, 1, generator=generator, device=logits.device, dtype=precise)
    draw = uniform * by_block[:, -1:]  # scaled by the whole sum, which rounding leaves a hair off 1
    block = torch.searchsorted(by_block, draw, right=True).clamp(max=by_block.size(1) - 1)
    before = F.pad(by_block, (1, 0)).gather(1, block)  # the sum of the blocks before it
    within = probs[torch.arange(rows, device=logits.device), block.squeeze(1)].cumsum(dim=-1)
    place = torch.searchsorted(within, draw - before, right=True)
    # The block's sum and its running sum add in other orders, so a draw at the very top of a
    # block can land a hair past the running sum: it then takes the last token the running sum
    # grew by, not one that top-k, or the padding of the last block, ruled out.
    last_drawable = (within < within[:, -1:]).sum(dim=-1, keepdim=True)
    return (block * BLOCK + torch.minimum(place, last_drawable)).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description="Write a story with a trained model.")
    parser.add_argument("--model", default=str(CHECKPOINTS / "finetune"), help="a checkpoint folder or file")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--words", nargs=3, metavar="WORD", help="three words to ask for")
    group.add_argument("--prompt", default="Once upon a time", help="any text to continue (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=MAX_NEW_TOKENS, help="the most new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu, cuda or mps (default: the fastest there is)")
    args = parser.parse_args()
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature < math.inf):
        parser.error(f"--temperature must be 0 (the likeliest token) or at least {MIN_TEMPERATURE:g}")
    if (args.top_k is not None and args.top_k < 1) or args.tokens < 1:
        parser.error("--top-k and --tokens must be at least 1")
    check_seed(parser, args.seed)
    if not encodable(args.prompt):
        parser.error("--prompt: the text holds bytes that are not UTF-8; write it in UTF-8")
    if args.words and not all(WORD.fullmatch(word) for word in args.words):
        parser.error("--words: three lowercase words, letters only (as the reward reads them)")
    distributed.one_process()

    tokenizer = load_tokenizer()
    model = load_checkpoint(args.model, pick_device(args.device), tokenizer)
    prompt = instruction(args.words) if args.words else args.prompt  # "" too: a story from nothing
    # The last position's logits give the first token, so a prompt that fills the context still gets one.
    room = model.config.context - len(encode_prompt(tokenizer, prompt)) + 1
    if room < 1:
        parser.error(f"the prompt is longer than the model's context of {model.config.context} tokens")
    print(prompt + write(model, tokenizer, prompt, min(args.tokens, room), args.temperature, args.top_k, args.seed))


if __name__ == "__main__":
    main()
