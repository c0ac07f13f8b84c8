"""Back-of-the-envelope cost models used throughout the course.

Everything here is arithmetic: no GPUs, no torch. The point is to predict a
number *before* measuring it, so that a measurement that disagrees with the
model tells you something. Sizes are in bytes, times in seconds.

One module a topic, in the order the chapters meet them; every public name is
re-exported here, so `from gpucourse.models import costs; costs.busbw(...)`:

    comms              nccl-tests' busbw, bytes on the wire, the alpha-beta model, interconnects (chapter 01)
    data_parallel      a DDP step's time and scaling efficiency (chapter 03)
    pipeline_parallel  bubbles, schedules replayed, activations held, stage costs (chapter 05)
    zero               ZeRO's model states and traffic, FSDP/HSDP's collectives (chapter 07), DiLoCo's (08d)
    precision          bytes per parameter by optimizer and recipe, FP8's speedup (chapters 07, 07b)
    flops              datasheet peaks, FLOPs per token, MFU and HFU (chapters 07b, 09)
    context_parallel   bytes per attention layer, the ring's overlap (chapter 10)
    expert_parallel    MoE capacity, all-to-all bytes, parameters, FLOPs, overlap (chapter 11)
    systems            a dry run's step on a named system (gpucourse dryrun)
"""
from .comms import (COLLECTIVES, INTERCONNECTS, AlphaBeta, Interconnect, algbw, busbw, busbw_factor,
                    bytes_moved_per_rank, collective_time, fit_alpha_beta)
from .context_parallel import (CONTEXT_PARALLEL, attention_shard_bytes, context_parallel_bytes,
                               hybrid_context_parallel_bytes, ring_overlap_block_tokens, ring_step_times)
from .data_parallel import (BACKWARD_FRACTION, DDPStep, ddp_step_from_bucket_times, ddp_step_time,
                            scaling_efficiency)
from .expert_parallel import (expert_parallel_all_to_all_bytes, moe_capacity, moe_flops_per_token, moe_overlap_time,
                              moe_params)
from .flops import (DTYPES, PEAK_DENSE_TFLOPS, RECOMPUTE, DevicePeak, hardware_flops_per_token, hfu, mfu,
                    model_flops_per_token, peak_flops)
from .pipeline_parallel import (dualpipev_bubble, pipeline_bubble_fraction, pipeline_bubble_ratio,
                                pipeline_order_from_torch, pipeline_peak_activations, pipeline_stage_costs,
                                simulate_pipeline)
from .precision import (MEASURED_RECIPES, OPTIMIZER_STATES, PRECISION_RECIPES, PRECISIONS, RECIPES,
                        low_precision_speedup, recipe_bytes_per_param, state_bytes_per_param)
from .systems import SYSTEMS, dryrun_step_time
from .zero import diloco_bytes, sharded_dp_comm_bytes, zero_comm_volume, zero_memory_bytes
