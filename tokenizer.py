"""
Episode 1, tokens: a byte-level BPE, trained from scratch on the train stories.

Text becomes UTF-8 bytes (256 starting tokens, so any text can be written), and training
merges the most frequent pair of neighbouring tokens into a new token, again and again,
until the vocabulary holds VOCAB_SIZE tokens. The last token is <|endoftext|>, which
separates stories and is never produced by encoding plain text: a story that happens to
contain the string "<|endoftext|>" is encoded as its letters, so encode and decode round-trip
any text exactly.

As in GPT-2, text is first split into chunks (a word with its leading space, a run of digits,
of punctuation, of spaces) and merges never cross a chunk's edge, so " kite" gets one token
while "kite." needs two. GPT-2's pattern needs the third-party `regex` module for \\p{L};
ours says the same with the standard library's `re` ([^\\W\\d_] is "a letter").

This file is a library: data.py trains it on data/train.txt and writes the token files
with write_tokens(), and every later script loads it with load_tokenizer(). To see how a
text splits into tokens, once data.py has run:

    python tokenizer.py "Once upon a time, a kite flew over the river."
"""
import hashlib
import heapq
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from files import DATA, atomic, require

VOCAB_SIZE = 5376  # 256 bytes, 5119 merges, and <|endoftext|>
END_OF_TEXT = "<|endoftext|>"
# A chunk: a contraction, a word with its leading space, digits, other symbols, or spaces.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
CHUNK = re.compile(PATTERN)


class Tokenizer:
    def __init__(self, merges):
        # merges[i] is the pair of tokens that became token 256 + i
        self.merges = [tuple(pair) for pair in merges]
        self.rank = {pair: i for i, pair in enumerate(self.merges)}
        self.pieces = [bytes([b]) for b in range(256)]
        for left, right in self.merges:
            self.pieces.append(self.pieces[left] + self.pieces[right])
        self.eot = len(self.pieces)  # the end-of-text token comes last
        self.vocab_size = self.eot + 1
        self.cache = {}  # chunk -> tokens; stories reuse a few thousand words again and again

    def __len__(self):
        return self.vocab_size

    def encode(self, text):
        tokens = []
        for chunk in CHUNK.findall(text):
            if chunk not in self.cache:
                self.cache[chunk] = self.encode_chunk(chunk.encode("utf-8"))
            tokens.extend(self.cache[chunk])
        return tokens

    def encode_chunk(self, data):
        tokens = list(data)
        # Apply merges in the order training learned them: the lowest-ranked pair first.
        while len(tokens) > 1:
            pair = min(zip(tokens, tokens[1:]), key=lambda p: self.rank.get(p, len(self.rank)))
            if pair not in self.rank:
                break
            tokens = merge(tokens, pair, 256 + self.rank[pair])
        return tokens

    def decode(self, tokens):
        eot = END_OF_TEXT.encode("utf-8")
        data = b"".join(eot if t == self.eot else self.pieces[t] for t in tokens)
        # A sampled story can stop in the middle of a character's bytes; show those as U+FFFD.
        return data.decode("utf-8", errors="replace")

    def save(self, path):
        readable = [piece.decode("utf-8", errors="backslashreplace") for piece in self.pieces]
        data = {
            "vocab_size": self.vocab_size,
            "end_of_text": self.eot,
            "pattern": PATTERN,
            "merges": [list(pair) for pair in self.merges],
            "tokens": readable + [END_OF_TEXT],  # for people; loading reads only the merges
        }
        path.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path):
        if path.is_dir():  # data.py could not write the file there either
            raise SystemExit(f"{path} is a folder, not a tokenizer file; move it away, then run python data.py again")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            merges = data["merges"]
            valid = all(len(pair) == 2 and all(type(t) is int and 0 <= t < 256 + i for t in pair)
                        for i, pair in enumerate(merges))
        except (ValueError, KeyError, TypeError) as error:
            raise SystemExit(f"{path} is not a tokenizer file ({error}); run python data.py again")
        if not valid or data.get("pattern") != PATTERN or data.get("vocab_size") != len(merges) + 257:
            raise SystemExit(f"{path} is damaged or from another tokenizer; run python data.py again")
        return cls(merges)

    def fingerprint(self):
        """A short name for these merges, saved with each checkpoint: a model only works with its own tokenizer."""
        return hashlib.sha256(json.dumps(self.merges).encode()).hexdigest()[:16]


def merge(tokens, pair, new_token):
    out, i = [], 0
    while i < len(tokens):
        if i + 1 < len(tokens) and (tokens[i], tokens[i + 1]) == pair:
            out.append(new_token)
            i += 2
        else:
            out.append(tokens[i])
            i += 1
    return out


def train(texts, vocab_size=VOCAB_SIZE, progress=True):
    """Learns vocab_size - 257 merges from an iterable of texts (the stories)."""
    # Merges never cross a chunk's edge, so each distinct chunk is trained on once, with its count.
    counts = Counter()
    for text in texts:
        counts.update(CHUNK.findall(text))
    words = [list(chunk.encode("utf-8")) for chunk in counts]
    weights = list(counts.values())

    # How often each pair of neighbours occurs, and in which words: a merge only touches those.
    pair_counts = Counter()
    words_with = defaultdict(set)
    for w, (word, weight) in enumerate(zip(words, weights)):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += weight
            words_with[pair].add(w)
    # A heap finds the most frequent pair fast; entries whose count has changed since are skipped.
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)

    merges = []
    while len(merges) < vocab_size - 257 and heap:
        negative_count, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative_count or negative_count == 0:
            continue
        new_token = 256 + len(merges)
        merges.append(pair)
        changed = set()
        for w in words_with.pop(pair):
            old = words[w]
            new = merge(old, pair, new_token)
            if len(new) == len(old):
                continue  # an out-of-date entry: an earlier merge took this pair away
            for p in zip(old, old[1:]):
                pair_counts[p] -= weights[w]
                changed.add(p)
            for p in zip(new, new[1:]):
                pair_counts[p] += weights[w]
                words_with[p].add(w)
                changed.add(p)
            words[w] = new
        del pair_counts[pair]
        for p in changed - {pair}:
            heapq.heappush(heap, (-pair_counts[p], p))
        if progress and len(merges) % 500 == 0:
            print(f"\r  {len(merges)} merges", end="", flush=True)
    if progress:
        print(f"\r  {len(merges)} merges")
    return Tokenizer(merges)


def first_megabytes(texts, megabytes):
    budget = megabytes * 1_000_000
    for text in texts:
        budget -= len(text.encode("utf-8"))
        if budget < 0:
            return
        yield text


# ---------------------------------------------------------------- the data folder's tokenizer and token files

def load_tokenizer(folder=DATA):
    path = Path(folder) / "tokenizer.json"
    require(path)
    return Tokenizer.load(path)


def encodable(text):
    """Whether text has UTF-8 bytes to encode: bytes a terminal or a JSON file could not
    decode reach Python as lone surrogates, which have none."""
    return not any("\ud800" <= char <= "\udfff" for char in text)


def encode_prompt(tokenizer, prompt):
    """A prompt's tokens as a model is given them to write after: an end-of-text first, as in
    the token files every story came right after one, so the model knows a new story begins."""
    return [tokenizer.eot] + tokenizer.encode(prompt)


def write_tokens(stories, bin_path, tokenizer):
    """Step 4 of data.py: every story, an end-of-text before it, as uint16 tokens in one flat
    file, which train.py reads as a numpy memmap without loading it."""
    count = 0
    with atomic(bin_path) as tmp, open(tmp, "wb") as file:
        buffer = []
        for story in stories:
            buffer.append(tokenizer.eot)
            buffer.extend(tokenizer.encode(story))
            if len(buffer) > 1 << 20:
                np.array(buffer, dtype=np.uint16).tofile(file)
                count += len(buffer)
                buffer = []
        np.array(buffer, dtype=np.uint16).tofile(file)
        count += len(buffer)
    return count


if __name__ == "__main__":
    tokenizer = load_tokenizer()
    text = " ".join(sys.argv[1:]) or "Once upon a time, a kite flew over the river."
    tokens = tokenizer.encode(text)
    print(f"{len(text)} characters, {len(tokens)} tokens:")
    print(" | ".join(tokenizer.decode([t]) for t in tokens))
