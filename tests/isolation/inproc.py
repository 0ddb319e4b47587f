"""An in-process decode engine on a tiny random model, fed by an in-process prefill through the
engine's public API (reserve, write, begin, release), for page-hygiene tests without gRPC.

The harness records every event each request emits; `hooks[request_id](seq, event)` runs on the
engine thread just before an event is recorded, so a test can tamper with a Sequence at an exact
point of its life (the engine reads the tampered state on its next step).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.counters import Counters
from common.kvpool.kv_cache import KvPool, PoolConfig
from common.model.config import ModelConfig
from common.model.llama import LlamaModel, PrefillBatch
from common.ops.select import make_ops
from common.ops.torch_ops import TorchOps
from common.sampling import SamplingConfig
from decode_svc.engine import DecodeEngine
from decode_svc.sequence import Event, FailedEvent, FinishedEvent, Sequence, TokenEvent

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "eos_token_id": 1,
}


def tiny_model(seed: int = 0, device: str = "cpu") -> LlamaModel:
    """A random 2-layer GQA Llama in float32: torch reference ops on the CPU, Triton on CUDA."""
    config = ModelConfig.from_hf_dict(TINY_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": rand(config.vocab_size, h, std=1.0),
         "model.norm.weight": torch.ones(h), "lm_head.weight": rand(config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        w |= {f"{a}.q_proj.weight": rand(q, h), f"{a}.k_proj.weight": rand(kv, h),
              f"{a}.v_proj.weight": rand(kv, h), f"{a}.o_proj.weight": rand(h, q),
              f"{p}.mlp.gate_proj.weight": rand(i, h), f"{p}.mlp.up_proj.weight": rand(i, h),
              f"{p}.mlp.down_proj.weight": rand(h, i), f"{p}.input_layernorm.weight": torch.ones(h),
              f"{p}.post_attention_layernorm.weight": torch.ones(h)}
    target = torch.device(device)
    ops = TorchOps() if target.type == "cpu" else make_ops("auto", target)
    return LlamaModel(config, w, ops, target, torch.float32)


def make_pool(model: LlamaModel, config: PoolConfig) -> KvPool:
    c = model.config
    return KvPool(config, c.num_layers, c.num_kv_heads, c.head_dim, model.dtype, model.device)


class RecordingLog:
    """Stands in for the structlog logger; keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def _add(self, level: str, event: str, **fields) -> None:
        self.records.append((level, event, fields))

    def info(self, event: str, **fields) -> None:
        self._add("info", event, **fields)

    def warning(self, event: str, **fields) -> None:
        self._add("warning", event, **fields)

    def error(self, event: str, **fields) -> None:
        self._add("error", event, **fields)

    def exception(self, event: str, **fields) -> None:
        self._add("exception", event, **fields)

    def events(self, name: str) -> list[dict]:
        return [fields for _, event, fields in self.records if event == name]


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    end: FinishedEvent | FailedEvent | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Harness:
    """One model, a prefill pool and a running DecodeEngine over a decode pool."""

    def __init__(self, decode_pool: PoolConfig, max_batch: int = 16, seed: int = 0,
                 device: str = "cpu") -> None:
        self.model = tiny_model(seed, device)
        self.prefill_pool = make_pool(self.model, PoolConfig(
            pool_tokens=512, page_size=decode_pool.page_size, poison_freed=True))
        self.pool = make_pool(self.model, decode_pool)
        self.log = RecordingLog()
        self.counters = Counters()
        self.engine = DecodeEngine(self.model, self.pool, max_batch, 1000, self.log, self.counters)
        self.outcomes: dict[str, Outcome] = {}
        self.hooks: dict[str, Callable[[Sequence, Event], None]] = {}
        self._ids = itertools.count()
        self.engine.start()

    def close(self) -> None:
        self.engine.stop()

    def prefill(self, prompt: list[int]) -> tuple[int, list[torch.Tensor], torch.Tensor]:
        """-> (greedy first token, per-layer KV [2, n, Hkv, D], logits [vocab])."""
        pool, n = self.prefill_pool, len(prompt)
        owner = f"prefill-{next(self._ids)}"
        pages = pool.allocator.allocate(owner, n)
        try:
            d = self.model.device
            batch = PrefillBatch(
                token_ids=torch.tensor(prompt, device=d), positions=torch.arange(n, device=d),
                slot_mapping=torch.tensor(pool.slots_for(pages, 0, n), device=d),
                cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=d), max_seqlen=n)
            logits = self.model.prefill(batch, pool.k, pool.v)[0]
            table = torch.tensor(pages, dtype=torch.int32, device=d)
            kv = [self.model.ops.pack_kv(pool.k[layer], pool.v[layer], table, 0, n).cpu()
                  for layer in range(self.model.config.num_layers)]
        finally:
            pool.release(owner)
        return int(torch.argmax(logits)), kv, logits

    def submit(self, request_id: str, prompt: list[int], max_tokens: int,
               hook: Callable[[Sequence, Event], None] | None = None) -> Sequence:
        """Reserves, writes the prompt's KV and joins the batch, as the servicer does."""
        first, kv, _ = self.prefill(prompt)
        reserved: list = []
        granted = threading.Event()
        self.engine.reserve(request_id, len(prompt) + max_tokens - 1,
                            lambda result: (reserved.append(result), granted.set()))
        if not granted.wait(timeout=120):
            raise TimeoutError(f"{request_id}: no reservation")
        if not isinstance(reserved[0], list):
            raise reserved[0]
        for layer, layer_kv in enumerate(kv):
            self.engine.write(request_id, layer, 0, layer_kv)
        outcome = self.outcomes[request_id] = Outcome()
        if hook is not None:
            self.hooks[request_id] = hook
        seq = Sequence(request_id, len(prompt), [*prompt, first], max_tokens, SamplingConfig(),
                       frozenset(), lambda event: self._record(seq, outcome, event))
        self.engine.begin(seq)
        return seq

    def _record(self, seq: Sequence, outcome: Outcome, event: Event) -> None:
        hook = self.hooks.get(seq.request_id)
        if hook is not None:
            hook(seq, event)
        if isinstance(event, TokenEvent):
            outcome.tokens.append(event.token_id)
        else:
            outcome.end = event
            outcome.done.set()

    def wait(self, request_id: str, timeout: float = 120) -> Outcome:
        outcome = self.outcomes[request_id]
        if not outcome.done.wait(timeout):
            raise TimeoutError(f"{request_id} did not end; tokens so far {outcome.tokens}")
        return outcome

    def solo(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy tokens of prompt run alone (nothing else in the engine)."""
        request_id = f"solo-{next(self._ids)}"
        self.submit(request_id, prompt, max_tokens)
        outcome = self.wait(request_id)
        assert isinstance(outcome.end, FinishedEvent), outcome.end
        return outcome.tokens

    def drain(self, timeout: float = 60) -> None:
        """Returns once every command queued so far has run (the inbox is processed in order)."""
        done = threading.Event()
        name = f"__drain-{next(self._ids)}__"
        self.engine.reserve(name, 0, lambda _: done.set())
        if not done.wait(timeout):
            raise TimeoutError("the engine did not drain")
        self.engine.release(name)

    def pages_free(self) -> tuple[int, int]:
        """(free, total) decode pages once the queued commands have run."""
        self.drain()
        self.drain()  # the first drain's own release has run too
        snap = self.pool.allocator.snapshot()
        return snap.pages_free, snap.pages_total
