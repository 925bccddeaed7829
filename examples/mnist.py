"""pytorch/examples' mnist/main.py in data-parallel form under ftrun, recoverable rank by rank.

    ftrun --worker_num 2 examples/mnist.py --epochs 2

mnist_torchrun.py (the upstream script with a process group, a DistributedSampler with set_epoch
and DDP) ported to the worker library; every changed line says ``# ftrun``. A run with faults ends
with the parameters of the run without, and of the torchrun twin (bitwise). Data: scikit-learn's
digits scaled to 28x28 (or MNIST IDX files with ``--data mnist:DIR``), see mnist_data.py. Rank 0 prints the final line
``final step=<n> loss=<x> test_accuracy=<y> params_sha256=<digest>``.

One line differs from upstream in both files: the test loader has its own generator. ``iter()`` of
a DataLoader draws a seed from torch's global generator, so upstream's test pass moves the stream
the next epoch's dropout draws from, and a rank replaced right after an epoch's last step could not
know that draw (``ftrun check`` found it; README "Porting a script").
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mnist_data  # noqa: E402

import ftrun  # ftrun


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, ft, model, device, train_loader, optimizer, epoch):  # ftrun
    model.train()
    for step, (data, target) in ft.batches(train_loader):  # ftrun: a retried step gets its batch again
        batch_idx = step.index  # ftrun
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and ft.rank == 0:  # ftrun
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.sampler),
                100. * batch_idx / len(train_loader), loss.item()), flush=True)
            if args.dry_run:
                break
    return loss.item()


def test(ft, model, device, test_loader):  # ftrun
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)
    if ft.rank == 0:  # ftrun
        print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
            test_loss, correct, len(test_loader.dataset),
            100. * correct / len(test_loader.dataset)), flush=True)
    return correct / len(test_loader.dataset)


def main():
    # Training settings
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
    parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                        help='input batch size for training, per rank (default: 64)')
    parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                        help='input batch size for testing (default: 1000)')
    parser.add_argument('--epochs', type=int, default=14, metavar='N',
                        help='number of epochs to train (default: 14)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--dry-run', action='store_true', default=False,
                        help='quickly check a single pass')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                        help='how many batches to wait before logging training status')
    parser.add_argument('--data', default='digits', help="'digits' (scikit-learn, 28x28) or 'mnist:DIR'")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    ft = ftrun.init(backend="gloo")  # ftrun
    torch.manual_seed(args.seed)
    device = torch.device("cpu")

    train_kwargs = {'batch_size': args.batch_size}
    test_kwargs = {'batch_size': args.test_batch_size}

    dataset1, dataset2 = mnist_data.datasets(args.data, args.seed)
    sampler = DistributedSampler(dataset1, num_replicas=ft.world_size, rank=ft.rank, seed=args.seed)  # ftrun
    train_loader = DataLoader(dataset1, sampler=sampler, **train_kwargs)
    test_loader = DataLoader(dataset2, generator=torch.Generator(), **test_kwargs)  # its own seed draws: the test pass leaves the global stream alone

    model = ft.wrap_model(Net().to(device))  # ftrun
    optimizer = ft.wrap_optimizer(optim.Adadelta(model.parameters(), lr=args.lr))  # ftrun

    scheduler = ft.register("scheduler", StepLR(optimizer, step_size=1, gamma=args.gamma))  # ftrun
    for epoch in ft.epochs(1, args.epochs + 1):  # ftrun: a respawned rank starts in its replicas' epoch
        sampler.set_epoch(epoch)
        loss = train(args, ft, model, device, train_loader, optimizer, epoch)  # ftrun
        with ft.section("test"):  # ftrun: not bounded by the step watchdog
            acc = test(ft, model, device, test_loader)  # ftrun
        scheduler.step()

    if ft.rank == 0:  # ftrun
        print(mnist_data.final_line(args.epochs * len(train_loader), loss, acc, model), flush=True)  # ftrun
    ft.finish()  # ftrun


if __name__ == '__main__':
    main()
