"""Prefill's last layer attends only for each prompt's last row, over its pages
(common/model/llama.py `_own_pages`): the logits match a pass that attends for every row, with
shuffled pages and several prompts in one batch; a batch whose KV stores are skipped
(kv_stored=False, slot -1, as the activation-peak measure runs) never reads the caches back."""

from __future__ import annotations

import pytest
import torch

from common.model.llama import LlamaModel, _own_pages
from common.model.loader import load_model
from common.model.protocol import PrefillBatch
from common.model.registry import build_model
from common.ops.select import make_ops
from tests.helpers.checkpoints import SPECS, make_checkpoint

PAGE = 16


class AllRows(LlamaModel):
    """The same model, its last layer attending for every row before the rows are picked."""

    def _layer(self, layer, x, residual, attend, keep=None):
        if keep is None:
            return super()._layer(layer, x, residual, attend)
        return super()._layer(layer, x, residual, lambda at, h, rows: attend(at, h)[rows], keep)


def _batch(lengths: list[int], pages: list[int]) -> PrefillBatch:
    """Prompts of these lengths, each on consecutive entries of pages (a shuffled list)."""
    slots, cursor = [], 0
    for n in lengths:
        own = pages[cursor:cursor + -(-n // PAGE)]
        cursor += len(own)
        slots += [own[t // PAGE] * PAGE + t % PAGE for t in range(n)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.randint(3, 200, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return PrefillBatch(ids, positions, torch.tensor(slots), cu, max(lengths))


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_last_rows_over_the_pages_give_the_logits_of_all_rows(tmp_path, kernels):
    loaded = load_model(str(make_checkpoint(SPECS[0], tmp_path)[0]))
    ops = make_ops(kernels, torch.device("cpu"))
    fast = build_model(loaded.config, loaded.weights, ops, torch.device("cpu"), torch.float32)
    full = AllRows(loaded.config, loaded.weights, ops, torch.device("cpu"), torch.float32)
    c = loaded.config
    pages = torch.randperm(40, generator=torch.Generator().manual_seed(2)).tolist()
    batch = _batch([1, 17, 53, 16], pages)
    table, lens = _own_pages(batch, PAGE)
    assert lens.tolist() == [1, 17, 53, 16]
    assert table[2, :4].tolist() == pages[3:7]  # the third prompt's pages, in order
    caches = [torch.full((c.num_layers, 40, PAGE, c.num_kv_heads, c.head_dim), float("nan"))
              for _ in range(4)]
    got = fast.prefill(batch, caches[0], caches[1])
    expected = full.prefill(batch, caches[2], caches[3])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_batch_that_stores_nothing_reads_nothing_back(tmp_path):
    loaded = load_model(str(make_checkpoint(SPECS[0], tmp_path)[0]))
    c = loaded.config
    model = build_model(loaded.config, loaded.weights, make_ops("cpu", torch.device("cpu")),
                        torch.device("cpu"), torch.float32)
    stored = _batch([33], list(range(3)))
    skipped = PrefillBatch(stored.token_ids, stored.positions,
                           torch.full_like(stored.slot_mapping, -1), stored.cu_seqlens,
                           stored.max_seqlen, kv_stored=False)
    scratch = torch.empty(c.num_layers, 1, 1, c.num_kv_heads, c.head_dim)  # one slot
    caches = [torch.zeros(c.num_layers, 3, PAGE, c.num_kv_heads, c.head_dim) for _ in range(2)]
    torch.testing.assert_close(model.prefill(skipped, scratch, scratch),
                               model.prefill(stored, *caches), atol=1e-5, rtol=1e-5)
