"""A fault for the forensics tests that chapter 08b's hang script (scripts/08b_hangs.py) does not make.

    --mode rendezvous  every rank asks for one rank more than torchrun started: no process group ever forms
"""
import argparse
import os

import torch
import torch.distributed as dist

from gpucourse import runtime

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["rendezvous"], required=True)
args = parser.parse_args()

os.environ["WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) + 1)  # a rank that will never come
ctx = runtime.setup()
dist.all_reduce(torch.ones(4))
runtime.teardown()
