import json
import random
from collections import Counter

import numpy as np
import pytest

import tokenizer as bpe

STORIES = ["Once upon a time, a little girl named Lily found a kite by the river.",
           "Tom liked cake. He ate the cake in the rain, and then he jumped!"] * 20


def random_text(rng, length):
    """Any Unicode scalar value but surrogates, which UTF-8 cannot hold, weighted toward the
    first planes, with runs of spaces and newlines mixed in."""
    chars = []
    for _ in range(length):
        kind = rng.random()
        if kind < 0.2:
            chars.append(rng.choice(" \n\t  "))
        elif kind < 0.5:
            chars.append(chr(rng.randrange(32, 127)))
        else:
            code = rng.randrange(0x110000 if kind > 0.9 else 0x3000)
            chars.append(chr(code) if not 0xD800 <= code < 0xE000 else "x")
    return "".join(chars)


@pytest.fixture(scope="module")
def tokenizer():
    return bpe.train(STORIES, vocab_size=300, progress=False)


def test_random_unicode_round_trips_exactly(tokenizer):
    rng = random.Random(1)
    for _ in range(300):
        text = random_text(rng, rng.randrange(0, 80))
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_run_of_spaces_leaves_its_last_to_the_word_after_it():
    # As GPT-2's pattern chunks text: " kite" (a word with its space) whatever comes before it,
    # so a word is one token after one space or several.
    assert bpe.CHUNK.findall("a  kite\n\nOnce") == ["a", " ", " kite", "\n", "\n", "Once"]


def test_training_learns_merges_that_shorten_the_stories(tokenizer):
    assert len(tokenizer) == 300 and tokenizer.eot == 299
    text = STORIES[0]
    assert len(tokenizer.encode(text)) < 0.6 * len(text.encode("utf-8"))


def test_with_merges_to_spare_every_trained_chunk_is_one_token():
    tokenizer = bpe.train(STORIES, vocab_size=1000, progress=False)
    assert len(tokenizer) < 1000  # training stops when no pair is left to merge
    for text in STORIES[:2]:
        assert len(tokenizer.encode(text)) == len(bpe.CHUNK.findall(text))


def test_end_of_text_is_special_and_plain_text_never_makes_it(tokenizer):
    tokens = tokenizer.encode("a story<|endoftext|>another")
    assert tokenizer.eot not in tokens
    assert tokenizer.decode([tokenizer.eot]) == "<|endoftext|>"


def test_saved_tokenizer_loads_to_the_same_tokens(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = bpe.Tokenizer.load(tmp_path / "tokenizer.json")
    text = "Lily and Tom ate the cake by the river, 123 times!"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.fingerprint() == tokenizer.fingerprint()
    readable = json.loads((tmp_path / "tokenizer.json").read_text())["tokens"]
    assert " the" in readable


def test_damaged_tokenizer_file_is_refused(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    data = json.loads(path.read_text())
    for damage in ([999, 1], [111.0, 110]):  # a merge of a token that does not exist yet; of a number that is no token
        data["merges"][3] = damage
        path.write_text(json.dumps(data))
        with pytest.raises(SystemExit, match="damaged"):
            bpe.Tokenizer.load(path)
    # Whole merges, but another split of the text, or a count of tokens that is not theirs.
    whole = json.loads(path.read_text())
    whole["merges"] = [list(pair) for pair in tokenizer.merges]
    for other in ({"pattern": r"\S+"}, {"vocab_size": whole["vocab_size"] + 1}):
        path.write_text(json.dumps({**whole, **other}))
        with pytest.raises(SystemExit, match="damaged or from another tokenizer"):
            bpe.Tokenizer.load(path)
    # A file cut short, and JSON that holds no merges.
    for not_a_tokenizer in (json.dumps(whole)[:100], "[]", '{"merges": 5}'):
        path.write_text(not_a_tokenizer)
        with pytest.raises(SystemExit, match="not a tokenizer file"):
            bpe.Tokenizer.load(path)
    # A folder under the file's name.
    path.unlink()
    path.mkdir()
    with pytest.raises(SystemExit, match="tokenizer.json is a folder, not a tokenizer file; move it away"):
        bpe.Tokenizer.load(path)


def test_a_chunk_takes_its_merges_in_the_order_training_learned_them():
    # b+c was learned first (token 256), then a+b (257): "abc" is a, then bc; taking the
    # leftmost known pair first would make ab, then c.
    bc_first = bpe.Tokenizer([(ord("b"), ord("c")), (ord("a"), ord("b"))])
    assert bc_first.encode_chunk(b"abc") == [ord("a"), 256]
    # And a merge of merges: ab (256), then ab+c (257), but bc (258) comes too late for "abc".
    merges_of_merges = bpe.Tokenizer([(ord("a"), ord("b")), (256, ord("c")), (ord("b"), ord("c"))])
    assert merges_of_merges.encode_chunk(b"abcbc") == [257, 258]


def naive_training(texts, vocab_size):
    """BPE the slow way: at each merge, every pair of neighbours counted again from scratch,
    the most frequent merged (the smallest pair among ties, as the heap breaks them)."""
    words = Counter()
    for text in texts:
        words.update(tuple(chunk.encode("utf-8")) for chunk in bpe.CHUNK.findall(text))
    merges = []
    while len(merges) < vocab_size - 257:
        counts = Counter()
        for word, weight in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += weight
        if not counts:
            break
        most = max(counts.values())
        pair = min(p for p, count in counts.items() if count == most)
        merges.append(pair)
        words = Counter({merged(word, pair, 255 + len(merges)): weight for word, weight in words.items()})
    return merges


def merged(word, pair, token):
    """word with each occurrence of pair, left to right, replaced by token."""
    out, i = [], 0
    while i < len(word):
        if word[i:i + 2] == pair:
            out.append(token)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def test_training_learns_the_merges_of_a_naive_bpe_that_recounts_every_pair():
    rng = random.Random(0)
    # Varied text, so that merges take pairs from each other and counts fall as well as rise.
    texts = [" ".join(rng.choice(["banana", "bandana", "cabana", "nab", "ban", "anna", "ab", "aba"])
                      for _ in range(rng.randrange(3, 12))) for _ in range(200)]
    assert bpe.train(texts, vocab_size=330, progress=False).merges == naive_training(texts, vocab_size=330)
    assert bpe.train(STORIES, vocab_size=400, progress=False).merges == naive_training(STORIES, vocab_size=400)


def test_training_is_deterministic():
    a = bpe.train(STORIES, vocab_size=280, progress=False)
    b = bpe.train(list(reversed(STORIES)), vocab_size=280, progress=False)
    assert a.merges == b.merges


def test_tokenizer_learns_from_the_first_megabytes_only():
    texts = ["a" * 400_000, "b" * 400_000, "c" * 400_000]
    assert list(bpe.first_megabytes(iter(texts), 1)) == texts[:2]


def test_missing_tokenizer_names_the_command(tmp_path):
    with pytest.raises(SystemExit, match="python data.py"):
        bpe.load_tokenizer(tmp_path)


def test_token_files_longer_than_the_write_buffer_hold_each_token_once(tmp_path):
    tokenizer = bpe.Tokenizer([])  # bytes only: a token a character
    stories = ["a" * 400_000, "b" * 400_000, "c" * 400_000]  # 1.2 million tokens, over the buffer's 2**20
    count = bpe.write_tokens(stories, tmp_path / "train.bin", tokenizer)
    tokens = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert count == len(tokens) == 1_200_003
    assert tokenizer.decode(tokens.tolist()) == "".join(bpe.END_OF_TEXT + s for s in stories)


def test_a_merge_of_the_token_it_makes_is_refused(tmp_path):
    tokenizer = bpe.train(["Once upon a time a kite flew over the river."] * 5, vocab_size=280, progress=False)
    tokenizer.save(tmp_path / "tokenizer.json")
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    saved["merges"][3] = [259, 1]  # token 259 is the one this merge makes
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="damaged"):
        bpe.Tokenizer.load(tmp_path / "tokenizer.json")


def test_a_story_cut_inside_a_character_shows_the_replacement_character():
    tokenizer = bpe.Tokenizer([])
    assert tokenizer.decode(list("café".encode())[:-1]) == "caf\ufffd"
