"""A deliberately broken port (a test of ftrun's exactly-once checks): examples/dcgan.py
(pytorch/examples' dcgan/main.py under ftrun) with netG and its optimizer not given to ftrun.

netG's gradients are averaged by hand (``ft.all_reduce_gradients(netG.parameters())`` after
``errG.backward()``) and a plain Adam updates it, skipped when that all-reduce fails. Fault-free it
trains as the port does (netG starts from the same seed on every rank; only its BatchNorm buffers,
never broadcast, stay each rank's own). After a fault nothing restores netG: a respawned rank
starts from netG's initial weights and Adam's empty state, and a survivor that already applied
``optimizerG.step()`` of a step applies it again when the step is computed again; its replicas
part, and ftrun should report a divergence.
"""
from __future__ import print_function
import argparse
import os
import random
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.parallel
import torch.backends.cudnn as cudnn
import torch.optim as optim
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dcgan_data  # noqa: E402

import ftrun  # ftrun


parser = argparse.ArgumentParser()
parser.add_argument('--nimages', type=int, default=128, help='number of synthetic training images')
parser.add_argument('--workers', type=int, help='number of data loading workers', default=0)
parser.add_argument('--batchSize', type=int, default=4, help='input batch size, per rank')
parser.add_argument('--imageSize', type=int, default=64, help='the height / width of the input image to network')
parser.add_argument('--nz', type=int, default=16, help='size of the latent z vector')
parser.add_argument('--ngf', type=int, default=8, help='number of generator filters')
parser.add_argument('--ndf', type=int, default=8, help='number of discriminator filters')
parser.add_argument('--niter', type=int, default=3, help='number of epochs to train for')
parser.add_argument('--lr', type=float, default=0.0002, help='learning rate, default=0.0002')
parser.add_argument('--beta1', type=float, default=0.5, help='beta1 for adam. default=0.5')
parser.add_argument('--dry-run', action='store_true', help='check a single training cycle works')
parser.add_argument('--ngpu', type=int, default=1, help='number of GPUs to use')
parser.add_argument('--netG', default='', help="path to netG (to continue training)")
parser.add_argument('--netD', default='', help="path to netD (to continue training)")
parser.add_argument('--outf', default=None, help='folder to output model checkpoints (default: none written)')
parser.add_argument('--manualSeed', type=int, default=1, help='manual seed')
parser.add_argument('--accel', action='store_true', default=False, help='enables accelerator')

opt = parser.parse_args()
print(opt)
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

ft = ftrun.init(backend="gloo")  # ftrun

if opt.outf is not None:
    os.makedirs(opt.outf, exist_ok=True)

print("Random Seed: ", opt.manualSeed)
random.seed(opt.manualSeed)
torch.manual_seed(opt.manualSeed)

cudnn.benchmark = True

if opt.accel and torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator()
else:
    device = torch.device("cpu")

print(f"Using device: {device}")

dataset = dcgan_data.dataset(opt.nimages, opt.imageSize, opt.manualSeed)
nc=3

sampler = DistributedSampler(dataset, num_replicas=ft.world_size, rank=ft.rank, seed=opt.manualSeed)  # ftrun
dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize,
                                         sampler=sampler, num_workers=int(opt.workers))

ngpu = int(opt.ngpu)
nz = int(opt.nz)
ngf = int(opt.ngf)
ndf = int(opt.ndf)


# custom weights initialization called on netG and netD
def weights_init(m):
    classname = m.__class__.__name__
    if classname.find('Conv') != -1:
        torch.nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find('BatchNorm') != -1:
        torch.nn.init.normal_(m.weight, 1.0, 0.02)
        torch.nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self, ngpu):
        super(Generator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is Z, going into a convolution
            nn.ConvTranspose2d(     nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            # state size. (ngf*8) x 4 x 4
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            # state size. (ngf*4) x 8 x 8
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            # state size. (ngf*2) x 16 x 16
            nn.ConvTranspose2d(ngf * 2,     ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            # state size. (ngf) x 32 x 32
            nn.ConvTranspose2d(    ngf,      nc, 4, 2, 1, bias=False),
            nn.Tanh()
            # state size. (nc) x 64 x 64
        )

    def forward(self, input):

        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)
        return output


netG = Generator(ngpu).to(device)
netG.apply(weights_init)
if opt.netG != '':
    netG.load_state_dict(torch.load(opt.netG))
print(netG)
# netG is not given to ftrun (the mistake this script makes)


class Discriminator(nn.Module):
    def __init__(self, ngpu):
        super(Discriminator, self).__init__()
        self.ngpu = ngpu
        self.main = nn.Sequential(
            # input is (nc) x 64 x 64
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf) x 32 x 32
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*2) x 16 x 16
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*4) x 8 x 8
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            # state size. (ndf*8) x 4 x 4
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        if (input.is_cuda or input.is_xpu) and self.ngpu > 1:
            output = nn.parallel.data_parallel(self.main, input, range(self.ngpu))
        else:
            output = self.main(input)

        return output.view(-1, 1).squeeze(1)


netD = Discriminator(ngpu).to(device)
netD.apply(weights_init)
if opt.netD != '':
    netD.load_state_dict(torch.load(opt.netD))
print(netD)
netD = ft.wrap_model(netD, name="netD", ddp=True)  # ftrun

criterion = nn.BCELoss()

torch.manual_seed(opt.manualSeed + ft.rank)  # ftrun: each rank draws its own noise
real_label = 1
fake_label = 0

# setup optimizer
optimizerD = ft.wrap_optimizer(optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999)), name="optimizerD")  # ftrun
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))  # not given to ftrun either

if opt.dry_run:
    opt.niter = 1

for epoch in ft.epochs(0, opt.niter):  # ftrun: a respawned rank starts in its replicas' epoch
    sampler.set_epoch(epoch)
    for step, data in ft.batches(dataloader):  # ftrun: a retried step gets its batch again
        i = step.index  # ftrun
        ############################
        # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
        ###########################
        # train with real
        netD.zero_grad()
        real_cpu = data[0].to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label,
                           dtype=real_cpu.dtype, device=device)

        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()

        # train with fake
        noise = torch.randn(batch_size, nz, 1, 1, device=device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        if not optimizerD.step():  # ftrun: the step failed; it is retried
            continue  # ftrun

        ############################
        # (2) Update G network: maximize log(D(G(z)))
        ###########################
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for generator cost
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        synced = ft.all_reduce_gradients(list(netG.parameters()))  # netG's gradients averaged by hand
        D_G_z2 = output.mean().item()
        if not synced:  # the all-reduce failed: the step is retried
            continue
        optimizerG.step()

        if ft.rank == 0:  # ftrun
            print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f'
                  % (epoch, opt.niter, i, len(dataloader),
                     errD.item(), errG.item(), D_x, D_G_z1, D_G_z2), flush=True)

        if opt.dry_run:
            break
    # do checkpointing
    if opt.outf is not None:
        with ft.section("save"):  # ftrun: not bounded by the step watchdog
            if ft.rank == 0:  # ftrun
                torch.save(netG.state_dict(), '%s/netG_epoch_%d.pth' % (opt.outf, epoch))
                torch.save(netD.module.state_dict(), '%s/netD_epoch_%d.pth' % (opt.outf, epoch))

if ft.rank == 0:  # ftrun
    print(dcgan_data.final_line(opt.niter * len(dataloader), errD.item(), netG, netD.module), flush=True)
ft.finish()  # ftrun
