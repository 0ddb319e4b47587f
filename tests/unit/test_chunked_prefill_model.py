"""LlamaModel.prefill over chunks of a prompt (a PrefillBatch with a page table and context
lengths) stores the same KV in every layer and gives the same last-token logits as one
whole-prompt pass, and both equal transformers' logits.

The pages are shuffled and every slot starts as NaN, so a chunk that read a slot of a later
chunk (not yet stored) would give NaN logits.
"""

from __future__ import annotations

import pytest
import torch

from common.model.loader import load_model
from common.model.protocol import PrefillBatch
from common.model.registry import build_model
from common.ops.torch_ops import TorchOps
from common.ops.triton_ops import TritonOps
from tests.helpers.checkpoints import FAMILY_SPECS, SPECS, make_checkpoint

PAGE = 16


def _setup(spec, tmp_path, ops):
    path, hf_model = make_checkpoint(spec, tmp_path)
    loaded = load_model(str(path))
    model = build_model(loaded.config, loaded.weights, ops, torch.device("cpu"), torch.float32)
    return model, hf_model


def _pool(model, num_tokens: int, seed: int):
    """Caches [L, P, S, Hkv, D] of NaN and a shuffled page list holding num_tokens."""
    c = model.config
    pages_needed = (num_tokens + PAGE - 1) // PAGE
    num_pages = pages_needed + 3
    k = torch.full((c.num_layers, num_pages, PAGE, c.num_kv_heads, c.head_dim), float("nan"))
    pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    return k, k.clone(), pages[:pages_needed].tolist()


def _slots(pages: list[int], start: int, end: int) -> torch.Tensor:
    return torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(start, end)])


def prefill_whole(model, ids: list[int]):
    k, v, pages = _pool(model, len(ids), seed=1)
    n = len(ids)
    batch = PrefillBatch(torch.tensor(ids), torch.arange(n), _slots(pages, 0, n),
                         torch.tensor([0, n], dtype=torch.int32), n)
    logits = model.prefill(batch, k, v)
    return logits, _gather(k, pages, n), _gather(v, pages, n)


def prefill_chunked(model, ids: list[int], chunk: int):
    k, v, pages = _pool(model, len(ids), seed=2)
    n = len(ids)
    table = torch.tensor([pages], dtype=torch.int32)  # [1, max_pages]
    logits = None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        batch = PrefillBatch(
            torch.tensor(ids[start:end]), torch.arange(start, end), _slots(pages, start, end),
            torch.tensor([0, end - start], dtype=torch.int32), end - start,
            context_lens=torch.tensor([start], dtype=torch.int32), page_table=table)
        logits = model.prefill(batch, k, v)
    return logits, _gather(k, pages, n), _gather(v, pages, n)


def _gather(cache: torch.Tensor, pages: list[int], n: int) -> torch.Tensor:
    """-> [L, n, Hkv, D] the prompt's KV in token order."""
    return cache[:, pages].flatten(1, 2)[:, :n]


def _hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1:].float()


@pytest.mark.parametrize("spec", [FAMILY_SPECS[0], FAMILY_SPECS[-1]], ids=lambda s: s.name)
@pytest.mark.parametrize("chunk", [PAGE, 23])
def test_chunks_equal_one_pass_and_transformers(spec, chunk, tmp_path):
    """A prompt 8x the chunk (and a remainder); chunk 23 puts chunk edges inside pages."""
    model, hf_model = _setup(spec, tmp_path, TorchOps())
    ids = torch.randint(3, spec.vocab, (8 * chunk + 5,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    whole_logits, whole_k, whole_v = prefill_whole(model, ids)
    logits, k, v = prefill_chunked(model, ids, chunk)
    assert not k.isnan().any() and not v.isnan().any(), "a token's KV was never stored"
    torch.testing.assert_close(k, whole_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, whole_v, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, whole_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, _hf_last_logits(hf_model, ids), atol=2e-3, rtol=2e-3)
    assert logits.argmax(-1).item() == whole_logits.argmax(-1).item()


def test_triton_chunks_equal_one_pass(tmp_path):
    """The same through the Triton kernels (interpreted on the CPU)."""
    model, hf_model = _setup(SPECS[0], tmp_path, TritonOps())
    ids = torch.randint(3, SPECS[0].vocab, (8 * 12 + 3,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    whole_logits, whole_k, _ = prefill_whole(model, ids)
    logits, k, _ = prefill_chunked(model, ids, 12)
    torch.testing.assert_close(k, whole_k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, whole_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, _hf_last_logits(hf_model, ids), atol=2e-3, rtol=2e-3)


def test_page_table_without_context_lens_is_refused(tmp_path):
    model, _ = _setup(SPECS[0], tmp_path, TorchOps())
    k, v, pages = _pool(model, 4, seed=0)
    batch = PrefillBatch(torch.tensor([3, 4, 5, 6]), torch.arange(4), _slots(pages, 0, 4),
                         torch.tensor([0, 4], dtype=torch.int32), 4,
                         page_table=torch.tensor([pages], dtype=torch.int32))
    with pytest.raises(ValueError, match="come together"):
        model.prefill(batch, k, v)
