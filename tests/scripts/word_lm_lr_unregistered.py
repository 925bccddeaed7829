"""A deliberately broken port (for the tests of the exactly-once checks): examples/word_lm.py with the module-level learning rate and best validation loss not registered.

A respawned rank starts with the initial learning rate and no best loss, whatever its replicas
annealed: its updates differ and the replicas' parameters part.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import word_lm_common as wl  # noqa: E402

import ftrun  # ftrun

parser = argparse.ArgumentParser(description="word language model (LSTM), data parallel")
parser.add_argument("--emsize", type=int, default=16)
parser.add_argument("--nhid", type=int, default=16)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=4, metavar="N", help="columns per rank")
parser.add_argument("--bptt", type=int, default=12)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--log-interval", type=int, default=4, metavar="N")
parser.add_argument("--eval-pause", type=float, default=0.0, help="extra seconds each evaluation takes")
args = parser.parse_args()

if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
ft = ftrun.init(backend="gloo")  # ftrun
rank, world = ft.rank, ft.world_size  # ftrun
torch.manual_seed(args.seed)
device = torch.device("cpu")

corpus = wl.Corpus(args.seed)
eval_batch_size = 10
train_data = wl.batchify(wl.shard(corpus.train, rank, world), args.batch_size)
val_data = wl.batchify(corpus.valid, eval_batch_size)
test_data = wl.batchify(corpus.test, eval_batch_size)

ntokens = len(corpus.dictionary)
model = ft.wrap_model(wl.RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device), ddp=True)  # ftrun
criterion = nn.NLLLoss()
optimizer = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=args.lr))  # ftrun
batches = list(range(0, train_data.size(0) - 1, args.bptt))

lr = args.lr
best_val_loss = None
hidden = None


class Hidden:  # ftrun: the carried hidden state, this rank's own
    def state_dict(self):  # ftrun
        return {"h": hidden[0], "c": hidden[1]} if hidden is not None else {}  # ftrun

    def load_state_dict(self, state):  # ftrun
        global hidden  # ftrun
        hidden = (state["h"].clone(), state["c"].clone()) if state else None  # ftrun


class Annealing:  # ftrun: the module-level lr and the best validation loss, identical on every replica
    def state_dict(self):  # ftrun
        return {"lr": lr, "best_val_loss": -1.0 if best_val_loss is None else best_val_loss}  # ftrun

    def load_state_dict(self, state):  # ftrun
        global lr, best_val_loss  # ftrun
        lr, best_val_loss = state["lr"], None if state["best_val_loss"] < 0 else state["best_val_loss"]  # ftrun


ft.register("hidden", Hidden(), kind="rank")  # ftrun


def train(epoch):
    global hidden
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.module.init_hidden(args.batch_size)
    for step, i in ft.batches(batches):  # ftrun: the global step; a retried step gets its batch again
        batch = step.index  # ftrun
        data, targets = wl.get_batch(train_data, i, args.bptt)
        optimizer.zero_grad()
        hidden = wl.repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if not optimizer.step():  # ftrun: the update failed (a peer died): the step is retried
            continue  # ftrun
        total_loss += loss.item()
        if rank == 0 and batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | step {step} | {batch:5d}/{len(batches):5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}", flush=True)
            total_loss = 0
            start_time = time.time()
    return step + 1, loss.item()


for epoch in ft.epochs(1, args.epochs + 1):  # ftrun: a respawned rank starts in its replicas' epoch
    epoch_start_time = time.time()
    steps, last_loss = train(epoch)
    with ft.section("eval"):  # ftrun: not bounded by the step watchdog
        val_loss = wl.evaluate(model.module, val_data, eval_batch_size, args.bptt)
        time.sleep(args.eval_pause)
    if rank == 0:
        print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | valid loss {val_loss:5.2f} | "
              f"valid ppl {math.exp(val_loss):8.2f}", flush=True)
    if not best_val_loss or val_loss < best_val_loss:
        best_val_loss = val_loss
    else:
        lr /= 4.0

test_loss = wl.evaluate(model.module, test_data, eval_batch_size, args.bptt)
if rank == 0:
    print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}", flush=True)
    print(wl.final_line(steps, last_loss, test_loss, model.module), flush=True)
ft.finish()  # ftrun
