"""pytorch/examples' time_sequence_prediction/train.py in data-parallel form under ftrun,
recoverable rank by rank.

    ftrun --worker_num 2 examples/time_sequence_prediction.py

time_sequence_prediction_torchrun.py (the upstream script with a gloo process group, DDP, each
rank on its slice of the waves, LBFGS with ``tolerance_change=0``; see its docstring) ported to the
worker library; every changed line says ``# ftrun``. Its step is one ``optimizer.step(closure)``
of LBFGS, which calls the closure (a forward pass and a backward pass, whose gradients are averaged
during the backward) up to 20 times and changes the parameters between calls: every all-reduce
of a step happens inside the optimizer's update. The wrapped optimizer's ``step(closure)`` returns
the closure's loss, or None when the step failed (it is then retried). A run with faults should
end with the parameters of the run without, and of the torchrun twin (bitwise). Rank 0 prints the
final line ``final step=<n> loss=<last test loss> test_accuracy=n/a params_sha256=<digest>``.
"""
from __future__ import print_function
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.optim as optim
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import time_sequence_prediction_data  # noqa: E402

import ftrun  # ftrun

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
    ft = ftrun.init(backend="gloo")  # ftrun
    rank, world_size = ft.rank, ft.world_size  # ftrun
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
    seq = ft.wrap_model(seq, ddp=True)  # ftrun
    criterion = nn.MSELoss()
    # use LBFGS as optimizer since we can load the whole data to train
    # tolerance_change=0: LBFGS ends its inner iterations when abs(loss - prev_loss) < tolerance_change,
    # and the loss the closure returns is this rank's own; ranks could then stop after different
    # numbers of closure calls, and their all-reduces would no longer pair up. With 0 that test never
    # holds, and the others read only the averaged gradients (identical on every rank) and counts.
    optimizer = ft.wrap_optimizer(optim.LBFGS(seq.parameters(), lr=0.8, tolerance_change=0))  # ftrun
    #begin to train
    for i in ft.steps(opt.steps):  # ftrun: a failed step is recovered and retried
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
        if optimizer.step(closure) is None:  # ftrun: the step failed; it is retried
            continue  # ftrun
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
    ft.finish()  # ftrun
