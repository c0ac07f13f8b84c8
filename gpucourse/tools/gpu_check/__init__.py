"""`gpucourse gpu-check`: every GPU path the course has, run on this machine's GPU(s) and written up.

    command          the command: the one registry of checks (CHECKS), running them, the dated report, the CLI
    harness          what every check shares: paths, the time budget, the results file, a quiet launch
    backends         NCCL at one rank, gloo ranks sharing a GPU, NCCL refused beyond the GPUs, nn.DataParallel
    chapter_scripts  the chapters' scripts on the GPU (02, 03, 05, 07, 07b), at default sizes too
    capstone         the capstone GPT: MFU, eager against compiled, the dry run's memory against the allocator
    fp8              FP8 matrix products and an FP8 MLP in the capstone, beside chapter 07b's model
    gloo_cuda_segv   chapter 07's SIGSEGV reproduced, the collective named from faulthandler's stack
    notebooks        the chapters' notebooks executed with papermill
    graders          `gpucourse grade` for the GPU-relevant exercises
"""
from .backends import (check_data_parallel, check_gloo_ranks_share_a_gpu, check_nccl_one_rank,
                       check_nccl_refused_beyond_gpus, check_nccl_watchdog)
from .capstone import (CAPSTONE_VARIANTS, KERNEL_KINDS, check_capstone_compiled, check_capstone_mfu,
                       check_dryrun_memory, compile_seconds)
from .chapter_scripts import (check_bf16_autocast_ddp, check_cuda_trace, check_default_sizes, check_fsdp_memory,
                              check_pipeline_schedules, check_precision_recipes)
from .command import (CHECKS, EMPTY_ENV, NOT_CHECKED, GpuCheckError, Outcome, add_cli, environment, main,
                      read_results, run_check, write_report)
from .fp8 import E4M3_MAX, check_fp8, fp8_matmul, implied_gemm_fraction, use_fp8_forward
from .gloo_cuda_segv import SEGV_MODES, check_gloo_cuda_segv, faulthandler_stacks, innermost_distributed_call
from .graders import GRADED, check_graders
from .harness import DOCTOR_JOB, ROOT, SCRIPTS, job_devices, needs, seconds_left
from .notebooks import NOTEBOOK_MIN_S, check_notebooks
