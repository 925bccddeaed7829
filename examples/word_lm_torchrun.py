"""pytorch/examples' word_language_model (LSTM) in data-parallel form, under plain torchrun (the twin of word_lm.py).

    torchrun --nproc_per_node 2 examples/word_lm_torchrun.py --epochs 4

Ported from pytorch/examples word_language_model/main.py (BSD-3-Clause): the hidden state carried
from batch to batch (reset before each epoch's batch loop, detached at each batch), dropout,
gradient clipping, an evaluation on the validation text every epoch, the learning rate divided by 4
in a module-level variable when the validation loss does not improve, the best validation loss kept.
Changed for data parallelism: DDP, each rank on its share of the training text, ``torch.optim.SGD``
with the module-level ``lr`` (upstream updates ``p.data`` by hand with the same rule), a generated
corpus (word_lm_common.py), small sizes. Rank 0 prints ``final step=<n> loss=<x>
test_accuracy=<test loss> params_sha256=<digest>``.
"""
import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import word_lm_common as wl  # noqa: E402

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
parser.add_argument("--train-lines", type=int, default=200, help="sentences of generated training text")
parser.add_argument("--step-times", action="store_true", help="rank 0 prints 'step N loss L time T cpu C' after every step (T: wall clock, C: this thread's CPU time, s; scripts/bench.py)")
args = parser.parse_args()

if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed)
device = torch.device("cpu")

corpus = wl.Corpus(args.seed, train_lines=args.train_lines)
eval_batch_size = 10
train_data = wl.batchify(wl.shard(corpus.train, rank, world), args.batch_size)
val_data = wl.batchify(corpus.valid, eval_batch_size)
test_data = wl.batchify(corpus.test, eval_batch_size)

ntokens = len(corpus.dictionary)
model = DistributedDataParallel(wl.RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout).to(device))
criterion = nn.NLLLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
batches = list(range(0, train_data.size(0) - 1, args.bptt))

lr = args.lr
best_val_loss = None
hidden = None
step = 0


def train(epoch):
    global hidden, step
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.module.init_hidden(args.batch_size)
    for batch, i in enumerate(batches):
        data, targets = wl.get_batch(train_data, i, args.bptt)
        optimizer.zero_grad()
        hidden = wl.repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        total_loss += loss.item()
        if rank == 0 and args.step_times:
            print(f"step {step} loss {loss.item():.4f} time {time.time():.6f} cpu {time.thread_time():.6f}", flush=True)
        if rank == 0 and batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | step {step} | {batch:5d}/{len(batches):5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}", flush=True)
            total_loss = 0
            start_time = time.time()
        step += 1
    return loss.item()


for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    last_loss = train(epoch)
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
    print(wl.final_line(step, last_loss, test_loss, model.module), flush=True)
dist.destroy_process_group()
