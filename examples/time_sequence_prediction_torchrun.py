"""pytorch/examples' time_sequence_prediction/train.py in data-parallel form under plain torchrun
(the twin of time_sequence_prediction.py).

    torchrun --nproc_per_node 2 examples/time_sequence_prediction_torchrun.py

The upstream script (two LSTM cells and a linear layer in double precision, trained on sine waves
with ``torch.optim.LBFGS``, whose ``step(closure)`` calls the closure, a forward and a backward
pass, several times in one step and changes the parameters between calls; a test prediction 1000
samples into the future after each step) with what data parallelism needs: a gloo process group,
the model in DistributedDataParallel, each rank training on its slice of the training waves
(``chunk`` by rank). Also changed from upstream:

- LBFGS gets ``tolerance_change=0`` (see the comment there): its inner iterations then stop on
  conditions that read only the averaged gradients, never the rank's own loss, so every rank
  makes the same number of closure calls, hence of all-reduces;
- the waves are made in memory (time_sequence_prediction_data.py, upstream's generate_sine_wave.py
  by the same draws) with small defaults, ``--sequences 35 --length 100`` (upstream: 100 waves of
  1000 samples), and ``--steps`` defaults to 3 (upstream: 15);
- matplotlib's plots of the predictions are dropped; rank 0 prints the lines;
- rank 0 prints the final line ``final step=<n> loss=<last test loss> test_accuracy=n/a
  params_sha256=<digest>`` (time_sequence_prediction_data.final_line).
"""
from __future__ import print_function
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import numpy as np
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import time_sequence_prediction_data  # noqa: E402

class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future = 0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):# if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=3, help='steps to run')
    parser.add_argument('--sequences', type=int, default=35, help='sine waves (the first 3 are the test set)')
    parser.add_argument('--length', type=int, default=100, help='samples a wave')
    opt = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # set random seed to 0
    np.random.seed(0)
    torch.manual_seed(0)
    # load data and make training set
    data = time_sequence_prediction_data.sine_waves(opt.sequences, opt.length)
    input = torch.from_numpy(data[3:, :-1]).chunk(world_size)[rank]  # this rank's waves
    target = torch.from_numpy(data[3:, 1:]).chunk(world_size)[rank]
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    # build the model
    seq = Sequence()
    seq.double()
    seq = DistributedDataParallel(seq)
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    # tolerance_change=0: LBFGS ends its inner iterations when abs(loss - prev_loss) < tolerance_change,
    # and the loss the closure returns is this rank's own; ranks could then stop after different
    # numbers of closure calls, and their all-reduces would no longer pair up. With 0 that test never
    # holds, and the others read only the averaged gradients (identical on every rank) and counts.
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, tolerance_change=0)
    #begin to train
    for i in range(opt.steps):
        if rank == 0:
            print('STEP: ', i, flush=True)
        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            if rank == 0:
                print('loss:', loss.item(), flush=True)
            loss.backward()
            return loss
        optimizer.step(closure)
        # begin to predict, no need to track gradient here
        with torch.no_grad():
            future = 1000
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            if rank == 0:
                print('test loss:', loss.item(), flush=True)
            y = pred.detach().numpy()

    if rank == 0:
        print(time_sequence_prediction_data.final_line(opt.steps, loss.item(), seq.module), flush=True)
    dist.destroy_process_group()
