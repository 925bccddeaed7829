"""What word_lm.py and its torchrun twin share: the corpus, the model, batching, evaluation, the final line.

Ported from pytorch/examples' word_language_model (data.py, model.py and the helpers of main.py;
BSD-3-Clause): the same ``Dictionary``/``Corpus`` tokenisation (words plus ``<eos>`` per line), the
same ``RNNModel`` (embedding, dropout, a multi-layer LSTM, dropout, a linear decoder, log-softmax),
``batchify``/``get_batch`` along the sequence dimension and ``repackage_hidden``. What differs: the
corpus is not Wikitext-2 but a small text generated here, deterministically from a seed, by a
bigram grammar (no download; a few thousand words), and each rank trains on its own contiguous
share of the training text (the data-parallel form); validation and test text are whole on every
rank, so every rank computes the same validation loss.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a bird", "the teacher", "our team", "she", "he"]
VERBS = ["sees", "likes", "finds", "carries", "follows", "watches", "paints", "remembers"]
OBJECTS = ["the ball", "a tree", "the river", "some bread", "the house", "a letter", "the moon", "it"]
TAILS = ["today", "again", "slowly", "at night", "in the park", "with care", "", ""]


def synthetic_text(lines: int, seed: int) -> list[str]:
    """``lines`` sentences drawn from a small grammar with a private generator (never the global one)."""
    gen = torch.Generator().manual_seed(seed)

    def pick(words: list[str]) -> str:
        return words[int(torch.randint(len(words), (1,), generator=gen))]

    return [" ".join(w for w in (pick(SUBJECTS), pick(VERBS), pick(OBJECTS), pick(TAILS)) if w) + " ." for _ in range(lines)]


class Dictionary:
    def __init__(self) -> None:
        self.word2idx: dict[str, int] = {}
        self.idx2word: list[str] = []

    def add_word(self, word: str) -> int:
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self) -> int:
        return len(self.idx2word)


class Corpus:
    """Train, validation and test token streams (int64) of the generated text."""

    def __init__(self, seed: int, train_lines: int = 200, eval_lines: int = 60) -> None:
        self.dictionary = Dictionary()
        self.train = self.tokenize(synthetic_text(train_lines, seed))
        self.valid = self.tokenize(synthetic_text(eval_lines, seed + 1))
        self.test = self.tokenize(synthetic_text(eval_lines, seed + 2))

    def tokenize(self, lines: list[str]) -> torch.Tensor:
        ids = []
        for line in lines:
            for word in line.split() + ["<eos>"]:
                ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.int64)


def shard(data: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of a token stream (equal shares; the remainder is dropped)."""
    size = data.size(0) // world
    return data.narrow(0, rank * size, size)


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    """Arrange a token stream into ``bsz`` columns (upstream's batchify)."""
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int, bptt: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def repackage_hidden(h):  # type: ignore[no-untyped-def]
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module (LSTM), and a decoder (upstream's, LSTM only)."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)
        self.nhid = nhid
        self.nlayers = nlayers

    def forward(self, input, hidden):  # type: ignore[no-untyped-def]
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


@torch.no_grad()
def evaluate(model: RNNModel, data_source: torch.Tensor, bsz: int, bptt: int) -> float:
    """Mean loss per token over ``data_source`` (upstream's evaluate; no dropout, so no random draw)."""
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(bsz)
    for i in range(0, data_source.size(0) - 1, bptt):
        data, targets = get_batch(data_source, i, bptt)
        output, hidden = model(data, hidden)
        hidden = repackage_hidden(hidden)
        total_loss += len(data) * F.nll_loss(output, targets).item()
    return total_loss / (len(data_source) - 1)


def final_line(steps: int, loss: float, test_loss: float, model: nn.Module) -> str:
    """The line the tests compare: steps, last loss, test loss, SHA-256 of the parameters."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return f"final step={steps} loss={loss:.6f} test_accuracy={test_loss:.4f} params_sha256={h.hexdigest()}"
