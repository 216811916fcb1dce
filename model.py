"""
Episode 2, the model: a GPT in one readable file.

Token and position embeddings; pre-norm blocks, each a causal self-attention and an MLP,
each behind a layer norm and added back to the stream; dropout; a final layer norm, and an
output layer that shares its weights with the token embedding. The series' model is the
Config below: about 14.6M parameters. generate() writes after a prompt the plain way, the
whole sequence through the model again for each new token; episode 4 (sample.py) writes fast,
from the same distribution, with a cache of each layer's keys and values, which forward() takes.

    python model.py    (prints the series' model and its parameter count)
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import attention
from tokenizer import VOCAB_SIZE


@dataclass
class Config:
    vocab_size: int = VOCAB_SIZE
    context: int = 256  # positions: an instruction (about 20 tokens) and a story of 200 fit
    n_layer: int = 7
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.1


TINY = dict(context=256, n_layer=2, n_head=2, n_embd=32)  # for tests: Config(vocab_size=..., **TINY)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        # Each head takes an equal share of the embedding's channels.
        if config.n_head < 1 or config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} does not split into {config.n_head} heads")
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
            # Writing with a cache (sample.py): the keys and values of every position so far
            # (in blocks of positions on most CPUs), and which of them each row may see.
            k, v, visible = cache.add(layer, k, v)
        # Each position sees those before it: torch's fused attention (kernels.py: with a
        # faster backward pass where DPO, PPO and GRPO train in bfloat16 on a CPU, and by
        # hand for a new token over the cache's blocks on most CPUs).
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
        output instead: the channels the output layer reads, which PPO's critic reads too.
        With a cache (sample.py's KVCache), the tokens come after the positions it holds, and
        each layer keeps its keys and values there."""
        B, T = tokens.shape
        start = cache.filled if cache is not None else 0
        # Each row's positions: from 0, or past the positions the cache holds for that row.
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
    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None, stop=None, generator=None):
        """Writes up to max_new_tokens after each row of tokens (B, T), the plain way: the
        whole sequence goes through the model again for each new token. Temperature 0 takes
        the likeliest token; top_k draws among the k likeliest only. A row that writes `stop`
        writes only `stop` after it, and writing ends once every row has. Returns the rows
        with what was written after them."""
        ended = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
        for _ in range(max_new_tokens):
            # The last context positions, should the sequence grow longer than the model sees.
            logits, _ = self(tokens[:, -self.config.context:])
            logits = logits[:, -1].float()
            if temperature == 0:
                token = logits.argmax(dim=-1)
            else:
                logits = logits / temperature
                if top_k:
                    kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth_best, float("-inf"))
                token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator).squeeze(1)
            if stop is not None:
                token = torch.where(ended, stop, token)
                ended |= token == stop
            tokens = torch.cat([tokens, token[:, None]], dim=1)
            if bool(ended.all()):
                break
        return tokens


if __name__ == "__main__":
    model = GPT(Config())
    print(model)
    print(f"{model.parameter_count():,} parameters")
