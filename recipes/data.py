"""Training data for the recipes: a synthetic passkey-retrieval task (a key hidden at a random depth
in filler text, asked for at the end) and a jsonl/text loader; documents are packed to ``seq_len``
with position_ids restarting at every document. Sample ``i`` depends only on (seed, i), so the
order is deterministic and resumable from a sample index, and dp ranks take disjoint samples."""

from __future__ import annotations

import json
import random

import torch

__all__ = ["ByteTokenizer", "PackedStream", "passkey_document"]

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


class ByteTokenizer:
    """UTF-8 bytes as token ids (for models built from a config, with no tokenizer to load)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode()]


def passkey_document(index: int, seed: int, approx_tokens: int, encode) -> list[int]:
    """Filler with 'The pass key is N. Remember it.' at a random depth, then the question and answer."""
    rnd = random.Random(seed * 1_000_003 + index)
    key = rnd.randint(10000, 99999)
    filler = encode(FILLER)
    reps = max(1, approx_tokens // max(1, len(filler)))
    depth = rnd.randint(0, reps)
    ids: list[int] = []
    for i in range(reps + 1):
        if i == depth:
            ids += encode(f" The pass key is {key}. Remember it. {key} is the pass key. ")
        ids += filler
    return ids + encode(f" What is the pass key? The pass key is {key}.")


class PackedStream:
    """Packs documents ``doc(i)`` (i = rank, rank + dp, ...) into rows of ``seq_len`` tokens with
    restarting position_ids; ``position`` (the next sample index) is the resume state."""

    def __init__(self, make_doc, seq_len: int, dp_rank: int, dp_size: int, position: int = 0) -> None:
        self.make_doc, self.seq_len = make_doc, seq_len
        self.dp_rank, self.dp_size, self.position = dp_rank, dp_size, position

    def next_batch(self) -> dict:
        ids: list[int] = []
        pos: list[int] = []
        while len(ids) < self.seq_len:
            doc = self.make_doc(self.position * self.dp_size + self.dp_rank)[: self.seq_len - len(ids)]
            self.position += 1
            ids += doc
            pos += list(range(len(doc)))
        return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos])}


def jsonl_documents(path: str, encode, field: str = "text", text: bool = False):
    """``make_doc`` over a jsonl file (one document a line, text in ``field``) or, with ``text``, a
    plain text file (documents separated by blank lines), cycling."""
    with open(path) as f:
        if text:
            docs = [encode(doc.strip()) for doc in f.read().split("\n\n") if doc.strip()]
        else:
            docs = [encode(json.loads(line)[field]) for line in f if line.strip()]
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return lambda i: docs[i % len(docs)]
