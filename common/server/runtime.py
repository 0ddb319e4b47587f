"""Brings up a service's model, ops backend, capacity and pool from its ServiceConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.capacity import Capacity, plan_capacity
from common.config import ServiceConfig
from common.handoff.layout import KvLayout
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.loaded import LoadedModel
from common.model.loader import load_model
from common.model.protocol import CausalLM
from common.model.registry import build_model
from common.server.core_borrowing import CoreBorrowingConfig
from common.server.cpu_placement import (apply_cpu_placement, borrowable_cpus,
                                         check_cpu_affinity, format_cpu_list)
from common.server.torch_threads import in_passing_thread, keep_one_thread
from common.ops.select import make_ops, resolve_backend, triton_is_interpreted


@dataclass(frozen=True)
class Runtime:
    loaded: LoadedModel
    model: CausalLM
    pool: KvPool
    capacity: Capacity
    layout: KvLayout
    kernels: str
    cores: CoreBorrowingConfig  # torch threads of the engine, and what it may borrow


def build_runtime(config: ServiceConfig, log, max_pass_tokens: int = 0) -> Runtime:
    """Puts the process on its CPUs with its torch threads (config.cpu_affinity,
    torch_threads), loads weights, picks kernels, sizes the pool (after the weights are
    placed) and checks the start-up invariant; raises CapacityError / UnsupportedModelError
    with a clear message.

    max_pass_tokens: the most tokens one forward pass carries (prefill: its pass budget,
    which chunked prefill makes a bound whatever the prompt length); the activation peak is
    measured at that many. 0: PROFILE_TOKENS (decode, whose local prefill runs whole
    prompts)."""
    threads, cpus = apply_cpu_placement(config.torch_threads, config.cpu_affinity,
                                        config.borrow_cpus)
    borrowed = borrowable_cpus(config.cpu_affinity, config.borrow_cpus)
    own = check_cpu_affinity(config.cpu_affinity) if config.cpu_affinity else ()
    cores = CoreBorrowingConfig(threads, len(borrowed), config.busy_file, own_cpus=own,
                                borrowed_cpus=borrowed,
                                min_borrow_tokens=config.borrow_min_tokens)
    log.info("cpu_placement", torch_threads=threads, cpus=format_cpu_list(cpus),
             borrowed_cpus=format_cpu_list(borrowed) if cores.enabled else "")
    device = config.torch_device()
    dtype = config.torch_dtype()
    kernels = resolve_backend(config.kernels, device)
    if kernels == "triton" and device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--kernels triton without a CUDA device needs TRITON_INTERPRET=1 "
                             "(the CLI sets it); refusing to start")
    if kernels == "triton" and triton_is_interpreted(device):
        log.warning("triton_interpreted", message="Triton kernels run through the interpreter "
                    "on the CPU: correct but slow, for tests and debugging")
    loaded = load_model(config.model)
    ops = make_ops(kernels, device)
    model = build_model(loaded.config, loaded.weights, ops, device, dtype)
    peak = 0
    profile = profile_tokens(max_pass_tokens, loaded.config.max_position_embeddings)
    if device.type == "cuda" and config.pool_tokens == 0 and config.memory_fraction > 0:
        peak = measure_activation_peak(model, profile)
    capacity = plan_capacity(config, loaded.config, dtype, device, peak, profile)
    pool_config = PoolConfig(
        pool_tokens=capacity.pool_tokens, page_size=capacity.page_size,
        poison_freed=config.poison_freed_pages, scrub_freed=config.scrub_freed_pages,
        check_owners=config.check_page_owners)
    c = loaded.config
    pool = KvPool(pool_config, c.num_layers, c.num_kv_heads, c.head_dim, dtype, device)
    layout = KvLayout.from_model(c, dtype)
    log.info("runtime_ready", model=loaded.source, fingerprint=loaded.fingerprint,
             device=str(device), dtype=str(dtype).removeprefix("torch."), kernels=kernels,
             **capacity.describe())
    return Runtime(loaded, model, pool, capacity, layout, kernels, cores)


def build_service_runtime(config: ServiceConfig, log, max_pass_tokens: int = 0) -> Runtime:
    """build_runtime for a service: the calling thread (the event loop's) keeps one torch
    thread, and the weights load on a thread that ends with the load, so that the engine
    thread's team is the process's only one (common/server/torch_threads.py)."""
    default_threads = torch.get_num_threads()  # torch's own count, before this thread's goes

    def build() -> Runtime:
        torch.set_num_threads(default_threads)  # what --torch-threads 0 leaves in force
        return build_runtime(config, log, max_pass_tokens)

    keep_one_thread()
    return in_passing_thread(build)


PROFILE_TOKENS = 8192


def profile_tokens(max_pass_tokens: int, max_positions: int) -> int:
    """Tokens of the forward pass whose activation peak start-up measures: the pass budget
    (PROFILE_TOKENS when none is given), never more than the model's window."""
    return min(max_pass_tokens or PROFILE_TOKENS, max_positions)


def measure_activation_peak(model: CausalLM, num_tokens: int) -> int:
    """Peak extra device bytes of one prefill of num_tokens; KV stores are skipped (slot -1),
    so no pool is needed yet."""
    from common.model.llama import PrefillBatch

    device = model.device
    c = model.config
    k_scratch = torch.empty(c.num_layers, 1, 1, c.num_kv_heads, c.head_dim, dtype=model.dtype,
                            device=device)
    batch = PrefillBatch(
        token_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.arange(num_tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_seqlen=num_tokens, kv_stored=False)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model.prefill(batch, k_scratch, k_scratch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del k_scratch
    torch.cuda.empty_cache()
    return peak


def warm_up(runtime: Runtime) -> None:
    """A one-token prefill and one decode step on its own pages, so the first request does not
    pay for lazy init or kernel compiles (the CPU backend's compiled loops, say, where their
    on-disk cache cannot be written); the pages go back to the pool."""
    from common.model.protocol import DecodeBatch, PrefillBatch

    device = runtime.model.device
    pool = runtime.pool
    owner = "__warmup__"
    pages = pool.allocator.allocate(owner, 2)
    try:
        slots = pool.slots_for(pages, 0, 2)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def ints(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        allocator = pool.allocator
        allocator.check_write(owner, pages, 0)
        runtime.model.prefill(PrefillBatch(
            token_ids=longs([0]), positions=longs([0]), slot_mapping=longs(slots[:1]),
            cu_seqlens=ints([0, 1]), max_seqlen=1), pool.k, pool.v)
        allocator.mark_written(owner, 1)
        allocator.check_write(owner, pages, 1)
        allocator.mark_written(owner, 2)  # the step stores token 1 before it attends
        allocator.check_read(owner, pages, 2)
        runtime.model.decode(DecodeBatch(
            token_ids=longs([0]), positions=longs([1]), slot_mapping=longs(slots[1:]),
            page_table=ints([pages]), seq_lens=ints([2])), pool.k, pool.v)
    finally:
        pool.release(owner)
