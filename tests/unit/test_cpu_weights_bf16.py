"""bfloat16 on the cpu backend: every projection runs through its oneDNN prepacked copy, which is
then the only copy, at every row count (decode rows and prefill rows alike), and the model's
logits are as near the float32 torch reference as plain bfloat16 torch ops get (measured on
these checkpoints: both 3-16% of the logits' rms at most, within 1.25x of each other)."""

from __future__ import annotations

import pytest
import torch

from common.model.cpu_weights import packed_rows
from common.model.loader import load_model
from common.model.protocol import PrefillBatch
from common.model.registry import build_model
from common.ops.cpu_ops import CpuOps
from common.ops.torch_ops import TorchOps
from tests.helpers.checkpoints import SPECS, make_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="torch without oneDNN bfloat16 kernels on this CPU")
PAGE = 16


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """One whole-prompt pass into a fresh pool; the float32 logits of its last token [1, V]."""
    c, n = model.config, len(ids)
    pages = (n + PAGE - 1) // PAGE
    shape = (c.num_layers, pages, PAGE, c.num_kv_heads, c.head_dim)
    k = torch.zeros(shape, dtype=model.dtype)
    v = torch.zeros_like(k)
    batch = PrefillBatch(torch.tensor(ids), torch.arange(n), torch.arange(n),
                         torch.tensor([0, n], dtype=torch.int32), n)
    return model.prefill(batch, k, v)


def test_bf16_packed_copy_is_the_only_copy_and_serves_every_row_count(tmp_path):
    loaded = load_model(str(make_checkpoint(SPECS[0], tmp_path)[0]))
    model = build_model(loaded.config, loaded.weights, CpuOps(), torch.device("cpu"),
                        torch.bfloat16)
    name = "model.layers.0.mlp.up_proj"
    assert f"{name}.weight" not in model.w  # the prepacked copy replaced it
    weight = loaded.weights[f"{name}.weight"].to(torch.bfloat16)  # [N, K]
    for rows in (1, 7, 128, 300):
        x = torch.randn(rows, weight.shape[1]).to(torch.bfloat16)
        assert rows in packed_rows(weight)
        got = model._linear(x, name).float()
        expected = x.float() @ weight.float().t()
        torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(),
                                   rtol=0.02)


def test_float32_keeps_its_own_copy_for_one_row(tmp_path):
    loaded = load_model(str(make_checkpoint(SPECS[0], tmp_path)[0]))
    model = build_model(loaded.config, loaded.weights, CpuOps(), torch.device("cpu"),
                        torch.float32)
    weight = model.w["model.layers.0.mlp.up_proj.weight"]
    assert 1 not in packed_rows(weight) and 8 in packed_rows(weight)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_bf16_cpu_logits_as_near_the_float32_reference_as_plain_bf16(tmp_path, spec):
    loaded = load_model(str(make_checkpoint(spec, tmp_path)[0]))

    def model(ops, dtype):
        return build_model(loaded.config, loaded.weights, ops, torch.device("cpu"), dtype)
    fast, plain = model(CpuOps(), torch.bfloat16), model(TorchOps(), torch.bfloat16)
    reference = model(TorchOps(), torch.float32)
    for length in (1, 17, 200):
        ids = torch.randint(3, loaded.config.vocab_size, (length,),
                            generator=torch.Generator().manual_seed(length)).tolist()
        expected = _prefill_logits(reference, ids)
        scale = expected.pow(2).mean().sqrt().item()  # rms of the reference logits
        got_fast, got_plain = _prefill_logits(fast, ids), _prefill_logits(plain, ids)
        assert torch.isfinite(got_fast).all()
        fast_error = (got_fast - expected).abs().max().item() / scale
        plain_error = (got_plain - expected).abs().max().item() / scale
        assert fast_error <= 1.5 * plain_error + 0.02, (length, fast_error, plain_error)
