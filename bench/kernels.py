"""Triton kernels on the GPU: bf16 correctness against the torch references, then bandwidth and
throughput tables against plain torch baselines (copy_, scaled_dot_product_attention).

    python bench/kernels.py [--quick] [--json OUT]

Without CUDA it prints "no CUDA device: skipping" and exits 0; with ``--quick`` and
TRITON_INTERPRET=1 it instead runs the correctness part at tiny shapes in fp16/fp32 (bf16 is
not reliable under the interpreter). Exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from common.kernels import decode_attention as dec
from common.kernels import pack_kv as pk
from common.kernels import prefill_attention as pf
from common.kernels import rmsnorm as rn
from common.kernels import rope as rp
from common.kernels import store_kv as sk

DEVICE = "cuda"  # the timed sections run here


# ----------------------------------------------------------------------------- inputs
def paged_pool(lens, page_size, hkv, d, dtype, device, spare=8, gen=None):
    """Shuffled pages, NaN in every slot no sequence wrote (page 0 is never handed out)."""
    need = [(n + page_size - 1) // page_size for n in lens]
    num_pages = sum(need) + spare
    k = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype, device=device)
    v = torch.full_like(k, float("nan"))
    perm = (1 + torch.randperm(num_pages - 1, generator=gen)).to(device)
    table = torch.zeros(len(lens), max(need), dtype=torch.int32, device=device)
    used = 0
    for b, (n, p) in enumerate(zip(lens, need, strict=True)):
        pages = perm[used : used + p]
        used += p
        table[b, :p] = pages.int()
        slots = (pages[:, None] * page_size + torch.arange(page_size, device=device)).flatten()
        k.view(-1, hkv, d)[slots[:n]] = torch.randn(n, hkv, d, device=device).to(dtype)
        v.view(-1, hkv, d)[slots[:n]] = torch.randn(n, hkv, d, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k, v, table, seq_lens


# ----------------------------------------------------------------------------- correctness
def _compare(name, out, ref, atol, rtol):
    out, ref = out.float(), ref.float()
    finite = ~ref.isnan()
    err = (out[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    ok = torch.equal(out.isnan(), ref.isnan())
    try:
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError:
        ok = False
    return {"kernel": name, "pass": bool(ok), "max_abs_err": err}


def check_all(device, dtype, hq, hkv, d, page_size, lens, hidden):
    """Each kernel against its reference on one ragged batch; a kernel that raises is a FAIL."""
    torch.manual_seed(0)
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    total = sum(lens)
    k_cache, v_cache, table, seq_lens = paged_pool(lens, page_size, hkv, d, dtype, device)
    qkv = torch.randn(total, hq + 2 * hkv, d, device=device).to(dtype)  # fused projection

    def store_kv():
        _, key, value = qkv.split([hq, hkv, hkv], dim=1)
        slots = torch.randperm(k_cache.shape[0] * page_size, device=device)[:total]
        slots[::5] = -1
        out = torch.stack([k_cache, v_cache])
        ref = out.clone()
        sk.store_kv(key, value, out[0], out[1], slots)
        sk.store_kv_reference(key, value, ref[0], ref[1], slots)
        return _compare("store_kv", out, ref, 0.0, 0.0)

    def rmsnorm():
        x = torch.randn(total, hidden, device=device).to(dtype)
        res = torch.randn_like(x)
        w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
        out, new_res = rn.rmsnorm(x, w, 1e-6, res)
        ref, ref_res = rn.rmsnorm_reference(x, w, 1e-6, res)
        row = _compare("rmsnorm", out, ref, tol, tol)
        row["pass"] &= torch.equal(new_res, ref_res)
        return row

    def rope():
        q, k, _ = qkv.clone().split([hq, hkv, hkv], dim=1)
        q_ref, k_ref = q.clone(), k.clone()
        cos_sin = rp.build_cos_sin(8192, d, 500000.0, device)
        pos = torch.randint(0, 8192, (total,), device=device)
        rp.rope(q, k, pos, cos_sin)
        rp.rope_reference(q_ref, k_ref, pos, cos_sin)
        return _compare("rope", torch.cat([q, k], 1), torch.cat([q_ref, k_ref], 1), tol, tol)

    def prefill_attention():
        q, k, v = qkv.split([hq, hkv, hkv], dim=1)  # strided views, as in the model
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        args = (q, k, v, cu.to(device), max(lens), d**-0.5)
        out, ref = pf.prefill_attention(*args), pf.prefill_attention_reference(*args)
        return _compare("prefill_attention", out, ref, tol, tol)

    def decode_attention():
        q = torch.randn(len(lens), hq, d, device=device).to(dtype)
        args = (q, k_cache, v_cache, table, seq_lens, d**-0.5)
        out, ref = dec.decode_attention(*args), dec.decode_attention_reference(*args)
        return _compare("decode_attention", out, ref, tol, tol)

    b = max(range(len(lens)), key=lambda i: lens[i])
    start = min(3, lens[b] - 1)
    n = lens[b] - start

    def pack_kv():
        args = (k_cache, v_cache, table[b], start, n)
        return _compare("pack_kv", pk.pack_kv(*args), pk.pack_kv_reference(*args), 0.0, 0.0)

    def unpack_kv():
        out, ref = torch.stack([k_cache, v_cache]), torch.stack([k_cache, v_cache])
        new = torch.randn(2, n, hkv, d, device=device).to(dtype)
        pk.unpack_kv(new, out[0], out[1], table[b], start)
        pk.unpack_kv_reference(new, ref[0], ref[1], table[b], start)
        row = _compare("unpack_kv", out, ref, 0.0, 0.0)
        row["pass"] &= torch.equal(pk.pack_kv(out[0], out[1], table[b], start, n), new)
        return row

    results = []
    for check in (store_kv, rmsnorm, rope, prefill_attention, decode_attention, pack_kv, unpack_kv):
        try:
            row = check()
        except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the rest
            row = {"kernel": check.__name__, "pass": False, "max_abs_err": float("nan")}
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["dtype"] = str(dtype).removeprefix("torch.")
        row["shape"] = f"Hq={hq} Hkv={hkv} D={d} page={page_size} lens={lens}"
        results.append(row)
    return results


def print_checks(results):
    print(f"{'kernel':<20}{'dtype':<10}{'result':<8}{'max abs err':<12}shape")
    for r in results:
        verdict = "PASS" if r["pass"] else "FAIL"
        line = f"{r['kernel']:<20}{r['dtype']:<10}{verdict:<8}{r['max_abs_err']:<12.3g}{r['shape']}"
        print(line + (f"\n    {r['error']}" if "error" in r else ""))


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median of CUDA-event times, L2 flushed before every rep, after warm-up calls."""

    def __init__(self, reps):
        self.reps = reps
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def __call__(self, fn):
        for _ in range(3):
            fn()
        events = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e-3  # seconds


def copy_time(timer, nbytes):
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def decode_time(timer, batch, ctx, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16):
    pages = batch * ctx // page
    k_cache = torch.randn(pages + 1, page, hkv, d, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = (1 + torch.randperm(pages, device=DEVICE)).int().view(batch, -1)  # shuffled pages
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, hq, d, device=DEVICE, dtype=dtype)
    return timer(lambda: dec.decode_attention(q, k_cache, v_cache, table, seq_lens, d**-0.5))


def bench_decode(timer, quick):
    hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.bfloat16
    rows = []
    for batch in (1, 16, 64):
        for ctx in (1024, 8192) if quick else (1024, 8192, 32768):
            kv_bytes = 2 * batch * ctx * hkv * d * 2
            if 2.2 * kv_bytes > 0.8 * torch.cuda.mem_get_info()[0]:
                rows.append({"batch": batch, "context": ctx, "skipped": "memory"})
                continue
            t = decode_time(timer, batch, ctx, hq, hkv, d, page, dtype)
            t_copy = copy_time(timer, kv_bytes)
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "kv_bytes": kv_bytes,
                    "us": t * 1e6,
                    "GB/s": kv_bytes / t / 1e9,
                    "copy GB/s": kv_bytes / t_copy / 1e9,
                    "vs copy": t_copy / t,
                }
            )
    return rows


def prefill_times(timer, n, hq=32, hkv=8, d=128, dtype=torch.bfloat16):
    """-> (triton s, sdpa s, sdpa variant) for one causal sequence of n tokens; sdpa is the
    faster of enable_gqa=True and K/V repeated to Hq heads."""
    q = torch.randn(n, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(n, hkv, d, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    t = timer(lambda: pf.prefill_attention(q, k, v, cu, n, d**-0.5))
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, n, D]
    kr, vr = (x.repeat_interleave(hq // hkv, dim=1) for x in (ks, vs))
    sdpa = F.scaled_dot_product_attention
    variants = {"repeated kv": functools.partial(sdpa, qs, kr, vr, is_causal=True)}
    variants["enable_gqa"] = functools.partial(sdpa, qs, ks, vs, is_causal=True, enable_gqa=True)
    times = {}
    for name, fn in variants.items():
        try:
            times[name] = timer(fn)
        except (RuntimeError, TypeError):  # enable_gqa missing in this torch or backend
            pass
    best = min(times, key=times.get)
    return t, times[best], best


def bench_prefill(timer, quick):
    hq, d, rows = 32, 128, []
    for n in (1024, 4096) if quick else (1024, 2048, 4096, 8192, 16384):
        flops = 4 * hq * d * n * (n + 1) / 2  # causal: QK^T and PV over the lower triangle
        t, t_ref, how = prefill_times(timer, n, hq=hq, d=d)
        row = {"tokens": n, "us": t * 1e6, "TFLOP/s": flops / t / 1e12}
        row.update({"sdpa TFLOP/s": flops / t_ref / 1e12, "vs sdpa": t_ref / t, "sdpa": how})
        rows.append(row)
    return rows


def pack_times(timer, n, hkv=8, d=128, page=16, dtype=torch.bfloat16):
    """-> (pack seconds, unpack seconds, payload bytes): one request of n tokens, shuffled pages
    spread over a pool 4x larger than the request."""
    pages = n // page
    k_cache = torch.randn(4 * pages + 1, page, hkv, d, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = (1 + torch.randperm(4 * pages, device=DEVICE)[:pages]).int()
    buf = pk.pack_kv(k_cache, v_cache, table, 0, n)  # [2, n, Hkv, D]
    t_pack = timer(lambda: pk.pack_kv(k_cache, v_cache, table, 0, n))
    t_unpack = timer(lambda: pk.unpack_kv(buf, k_cache, v_cache, table, 0))
    return t_pack, t_unpack, buf.numel() * buf.element_size()


def bench_pack(timer, quick):
    rows = []
    for n in (4096,) if quick else (4096, 32768):
        t_pack, t_unpack, payload = pack_times(timer, n)
        t_copy = copy_time(timer, payload)
        moved = 2 * payload  # read + write, for the kernels and the copy alike
        for op, t in (("pack", t_pack), ("unpack", t_unpack)):
            row = {"op": op, "tokens": n, "us": t * 1e6, "GB/s": moved / t / 1e9}
            row.update({"copy GB/s": moved / t_copy / 1e9, "vs copy": t_copy / t})
            rows.append(row)
    return rows


def print_table(title, rows):
    print(f"\n== {title}")
    cols = list(dict.fromkeys(c for r in rows for c in r))
    print("".join(f"{c:>14}" for c in cols))
    for r in rows:
        cells = [r.get(c, "") for c in cols]
        print("".join(f"{x:>14.3g}" if isinstance(x, float) else f"{x!s:>14}" for x in cells))


# ----------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and reps")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    report: dict = {"torch": torch.__version__}
    if not torch.cuda.is_available():
        if not (args.quick and os.environ.get("TRITON_INTERPRET") == "1"):
            print(
                "no CUDA device: skipping (with --quick and TRITON_INTERPRET=1 the correctness "
                "checks run at tiny shapes under the Triton interpreter)"
            )
            return 0
        print("no CUDA device: correctness only, tiny shapes, Triton interpreter")
        checks = []
        for dtype in (torch.float32, torch.float16):
            checks += check_all(torch.device("cpu"), dtype, 4, 2, 64, 5, [1, 17, 40], 96)
        print_checks(checks)
        report["correctness"] = checks
    else:
        report["device"] = torch.cuda.get_device_name()
        print(f"device: {report['device']}, torch {torch.__version__}")
        lens = [1, 17, 300, 1000] if args.quick else [1, 17, 300, 1000, 4000]
        checks = check_all(torch.device("cuda"), torch.bfloat16, 32, 8, 128, 16, lens, 4096)
        checks += check_all(torch.device("cuda"), torch.bfloat16, 8, 2, 64, 5, [1, 70, 33], 96)
        print_checks(checks)
        report["correctness"] = checks
        timer = Timer(reps=10 if args.quick else 30)
        for key, title, fn in (
            ("decode", "paged decode attention (Hq=32 Hkv=8 D=128, page 16, bf16)", bench_decode),
            (
                "prefill",
                "causal prefill attention, one sequence (Hq=32 Hkv=8 D=128, bf16)",
                bench_prefill,
            ),
            ("pack", "pack/unpack one request (Hkv=8 D=128, page 16, bf16)", bench_pack),
        ):
            try:
                report[key] = fn(timer, args.quick)
            except Exception as exc:  # noqa: BLE001 - keep the other tables
                report[key] = [{"error": f"{type(exc).__name__}: {exc}"[:500]}]
            print_table(title, report[key])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["pass"] for r in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
