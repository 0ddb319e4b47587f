"""Chunked prefill in the real PrefillEngine (in-process, torch ops, float32): a prompt 8x the
chunk budget hands off the same KV (every layer, every token) and first token as the unchunked
run, both equal transformers, the frames pass decode's verifier, passes respect their budgets,
a job can start at a token offset whose KV is already in its pages, and cancellation or a
failure between chunks frees the pages."""

from __future__ import annotations

import pytest
import torch

from common.handoff.binding import prompt_digest
from common.handoff.codec import header_frame
from common.handoff.verifier import Expectation, HandoffVerifier
from common.model.loader import load_model
from common.model.registry import build_model
from common.ops.torch_ops import TorchOps
from common.pb.kvhandoff.v1 import handoff_pb2
from prefill_svc.engine import PrefillEngine
from tests.helpers.checkpoints import FAMILY_SPECS, make_checkpoint
from tests.helpers.prefill_runs import assemble, layout_of, pool_at_baseline, run_engine

SPEC = FAMILY_SPECS[0]  # llama3 rope scaling that bites past 128 positions; GQA 2
CHUNK = 24  # not a multiple of the page (16) nor of the frame (10)
N = 8 * CHUNK + 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, hf_model = make_checkpoint(SPEC, tmp_path_factory.mktemp("ckpt"))
    loaded = load_model(str(path))
    model = build_model(loaded.config, loaded.weights, TorchOps(), torch.device("cpu"),
                        torch.float32)
    return model, hf_model


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, SPEC.vocab, (n,), generator=gen).tolist()


def _hf(hf_model, ids: list[int]):
    """transformers' KV [L, n, Hkv, D] (post-RoPE, as the pages hold it) and greedy first token."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return k, v, int(out.logits[0, -1].argmax())


def _verify(model, ids: list[int], frames) -> int:
    """Decode's own verifier over the header the servicer would send and the engine's frames;
    -> the first token it accepts."""
    layout = layout_of(model)
    verifier = HandoffVerifier(Expectation("r0", len(ids), layout, "fp", 0, SPEC.vocab,
                                           nonce=bytes(16), prompt_digest=prompt_digest(ids)))
    verifier.on_frame(header_frame("r0", len(ids), handoff_pb2.HANDOFF_STATUS_OK, layout, "fp",
                                   nonce=bytes(16), digest=prompt_digest(ids)))
    for frame in frames:
        verifier.on_frame(frame)
    return verifier.finish()


def test_prompt_8x_the_chunk_equals_unchunked_and_transformers(models):
    model, hf_model = models
    ids = _prompt(N, seed=0)
    layout = layout_of(model)
    whole = run_engine(model, [ids], max_batch_tokens=4096, chunk=4096)
    chunked = run_engine(model, [ids], max_batch_tokens=4096, chunk=CHUNK)
    assert whole.counters.get("forward_passes") == 1
    assert chunked.counters.get("forward_passes") == 9  # 8 chunks of 24 and one of 5
    k0, v0 = assemble(whole.jobs[0].chunks, layout, N)
    k1, v1 = assemble(chunked.jobs[0].chunks, layout, N)
    torch.testing.assert_close(k1, k0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v1, v0, atol=1e-4, rtol=1e-4)
    hf_k, hf_v, hf_first = _hf(hf_model, ids)
    torch.testing.assert_close(k1, hf_k, atol=2e-4, rtol=2e-3)
    torch.testing.assert_close(v1, hf_v, atol=2e-4, rtol=2e-3)
    first = chunked.jobs[0].commit.first_token_id
    assert first == whole.jobs[0].commit.first_token_id == hf_first
    assert _verify(model, ids, chunked.jobs[0].frames) == first
    assert pool_at_baseline(chunked.pool)


def test_frames_go_chunk_major_layer_minor(models):
    """After chunk c's layer l is stored, the frames of chunk c's tokens for layer l."""
    model, _ = models
    ids = _prompt(50, seed=1)
    run = run_engine(model, [ids], max_batch_tokens=4096, chunk=20, frame_tokens=8)
    got = [(c.layer, c.token_start, c.token_end) for c in run.jobs[0].chunks]
    expected = []
    for start in range(0, 50, 20):
        end = min(start + 20, 50)
        for layer in range(model.config.num_layers):
            expected += [(layer, s, min(s + 8, end)) for s in range(start, end, 8)]
    assert got == expected
    assert [c.sequence_number for c in run.jobs[0].chunks] == list(range(len(expected)))
    assert run.jobs[0].commit.chunk_count == len(expected)


class RecordingModel:
    """The model, recording each pass's tokens per sequence."""

    def __init__(self, model) -> None:
        self.inner = model
        self.config, self.ops, self.device, self.dtype = (model.config, model.ops, model.device,
                                                          model.dtype)
        self.passes: list[list[int]] = []

    def prefill(self, batch, k_cache, v_cache, on_layer_stored=None):
        self.passes.append(torch.diff(batch.cu_seqlens).tolist())
        return self.inner.prefill(batch, k_cache, v_cache, on_layer_stored)


def test_passes_keep_their_budgets_and_jobs_share_them(models):
    """A 100-token prompt and two short ones under a 40-token pass and 16-token chunks: no
    pass over 40 tokens, no job over 16 in one; the short prompts finish while the long one is
    still running; each output equals its solo run."""
    model, _ = models
    layout = layout_of(model)
    prompts = [_prompt(100, seed=2), _prompt(7, seed=3), _prompt(30, seed=4)]
    recording = RecordingModel(model)
    order: list[int] = []
    run = run_engine(recording, prompts, max_batch_tokens=40, chunk=16,
                     on_frame=lambda i, f, job: f.WhichOneof("frame") == "commit"
                     and order.append(i))
    assert all(sum(p) <= 40 and max(p) <= 16 for p in recording.passes), recording.passes
    assert recording.passes[0] == [16, 7, 16]  # all three admitted into the first pass
    assert order == [1, 2, 0]
    for i, prompt in enumerate(prompts):
        solo = run_engine(model, [prompt], max_batch_tokens=4096, chunk=4096)
        k, v = assemble(run.jobs[i].chunks, layout, len(prompt))
        k0, v0 = assemble(solo.jobs[0].chunks, layout, len(prompt))
        torch.testing.assert_close(k, k0, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, v0, atol=1e-4, rtol=1e-4)
        assert run.jobs[i].commit.first_token_id == solo.jobs[0].commit.first_token_id
    assert pool_at_baseline(run.pool)


def test_a_job_can_start_where_its_pages_already_hold_kv(models):
    """computed_tokens = 77: the pages hold tokens [0, 77) when the job is admitted (as a
    prefix-cache hit would leave them); the engine computes only the rest, and the handoff
    still carries every (layer, token), equal to the full run."""
    model, _ = models
    layout = layout_of(model)
    ids = _prompt(N, seed=5)
    full = run_engine(model, [ids], max_batch_tokens=4096, chunk=4096)
    k_ref, v_ref = assemble(full.jobs[0].chunks, layout, N)
    prefix = 77
    recording = RecordingModel(model)

    class PrefilledEngine(PrefillEngine):
        def _reserve(self, job):
            super()._reserve(job)
            table = torch.tensor(self.pool.allocator.page_table(job.request_id),
                                 dtype=torch.int32)
            for layer in range(layout.num_layers):
                kv = torch.stack([k_ref[layer, :prefix], v_ref[layer, :prefix]])
                self.model.ops.unpack_kv(kv, self.pool.k[layer], self.pool.v[layer], table, 0)

    run = run_engine(recording, [ids], max_batch_tokens=4096, chunk=CHUNK,
                     engine_cls=PrefilledEngine, computed=[prefix])
    assert sum(sum(p) for p in recording.passes) == N - prefix  # only the rest is computed
    k, v = assemble(run.jobs[0].chunks, layout, N)
    torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)
    assert run.jobs[0].commit.first_token_id == full.jobs[0].commit.first_token_id
    assert _verify(model, ids, run.jobs[0].frames) == run.jobs[0].commit.first_token_id


def test_computed_tokens_at_the_prompt_length_is_aborted(models):
    model, _ = models
    run = run_engine(model, [_prompt(20, seed=6)], max_batch_tokens=4096, chunk=8,
                     computed=[20])
    assert run.jobs[0].commit.status == handoff_pb2.HANDOFF_STATUS_ABORTED
    assert "computed_tokens 20" in run.jobs[0].commit.reason
    assert pool_at_baseline(run.pool)


def test_a_job_cancelled_between_chunks_gets_nothing_more(models):
    """Cancelled during its first chunk: no frame of a later chunk, no commit, pages freed;
    the other job of the engine completes."""
    model, _ = models
    prompts = [_prompt(100, seed=7), _prompt(30, seed=8)]

    def cancel_first(i, frame, job):
        if i == 0:
            job.cancelled.set()

    run = run_engine(model, prompts, max_batch_tokens=4096, chunk=16, on_frame=cancel_first)
    assert run.jobs[0].commit is None
    assert max(c.token_end for c in run.jobs[0].chunks) <= 16
    assert run.jobs[1].commit.status == handoff_pb2.HANDOFF_STATUS_OK
    assert pool_at_baseline(run.pool)


def test_a_failure_in_a_later_chunk_aborts_the_job_and_frees_its_pages(models):
    model, _ = models

    class FailsThirdPass(RecordingModel):
        def prefill(self, batch, k_cache, v_cache, on_layer_stored=None):
            if len(self.passes) == 2:
                raise RuntimeError("device lost")
            return super().prefill(batch, k_cache, v_cache, on_layer_stored)

    run = run_engine(FailsThirdPass(model), [_prompt(100, seed=9)], max_batch_tokens=4096,
                     chunk=16)
    commit = run.jobs[0].commit
    assert commit.status == handoff_pb2.HANDOFF_STATUS_ABORTED and "device lost" in commit.reason
    assert commit.chunk_count == len(run.jobs[0].chunks)
    assert pool_at_baseline(run.pool)


def test_a_released_sender_ends_the_job_between_chunks(models):
    """The stream went away (its sender released) during the first chunk, before the engine saw
    a cancel: no later frame and no commit (a commit would claim chunks that were never sent),
    pages freed; the other job completes."""
    model, _ = models
    prompts = [_prompt(100, seed=10), _prompt(30, seed=11)]

    def release_first(i, frame, job):
        if i == 0:
            job.sender.release(False)

    run = run_engine(model, prompts, max_batch_tokens=4096, chunk=16, on_frame=release_first)
    assert len(run.jobs[0].chunks) == 1 and run.jobs[0].commit is None
    assert run.jobs[1].commit.status == handoff_pb2.HANDOFF_STATUS_OK
    assert pool_at_baseline(run.pool)
