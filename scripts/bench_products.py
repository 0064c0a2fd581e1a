"""One matrix product's rate on a cool GPU and under sustained load, with the clock and power beside it.

A training step's products run below the rate a short benchmark of the same product gives: the
step keeps the tensor cores busy for most of a second at a time, the board reaches its power limit
and the driver lowers the SM clock. This times one bf16 product (by default a 1.3B preset's
2048-wide projection of 32,768 tokens, ``x @ W^T``) in two phases, each the median of its calls'
CUDA-event times:

  cool       ``--calls`` products back to back after an idle second;
  sustained  products back to back for ``--seconds``, the second half of them.

With ``nvidia-smi`` on the path its samples (every 100 ms) give each phase's SM clock, power draw
and the driver's active clock-event reasons (``0x4``: the software power cap): the median over the
sustained phase's second half, and for the cool phase the last sample before its end. ``--json``
writes the rows.

    python -m ttr.scripts.bench_products
    python -m ttr.scripts.bench_products --m 32768 --k 2048 --n 5632 --seconds 5 --json products.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime

import torch

QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active,power.limit"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ttr.scripts.bench_products", description=__doc__.split("\n")[0])
    p.add_argument("--m", type=int, default=32768, help="rows of x (tokens)")
    p.add_argument("--k", type=int, default=2048, help="columns of x and W (inputs)")
    p.add_argument("--n", type=int, default=2048, help="rows of W (outputs)")
    p.add_argument("--calls", type=int, default=20, help="products of the cool phase")
    p.add_argument("--seconds", type=float, default=4.0, help="length of the sustained phase")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    for name in ("m", "k", "n", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.seconds <= 0:
        p.error(f"--seconds must be positive, got {args.seconds}")
    return args


def timed(fn, calls: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    return events


def median_ms(events) -> float:
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def smi_samples(path: str) -> list[tuple[datetime, float, float, str, str]]:
    """``(time, SM MHz, watts, reasons, power limit)`` per line nvidia-smi wrote (lines it could not
    read are skipped)."""
    rows = []
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        try:
            rows.append((datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f"), float(cells[1].split()[0]),
                         float(cells[2].split()[0]), cells[3], cells[4]))
        except (IndexError, ValueError):
            continue
    return rows


def phase_stats(samples, start: datetime, end: datetime) -> dict:
    """The samples' median clock and power between ``start`` and ``end``, or (none there) the last
    sample before ``end``."""
    inside = [s for s in samples if start <= s[0] <= end] or [s for s in samples if s[0] <= end][-1:]
    if not inside:
        return {}
    return {"sm_mhz": statistics.median(s[1] for s in inside), "watts": statistics.median(s[2] for s in inside),
            "reasons": sorted({s[3] for s in inside})}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_products needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * args.k**-0.5
    product = lambda: torch.mm(x, w.t())  # noqa: E731
    flop = 2 * args.m * args.k * args.n
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False)
    smi = None
    if shutil.which("nvidia-smi"):
        smi = subprocess.Popen(["nvidia-smi", f"--id={torch.cuda.current_device()}", f"--query-gpu={QUERY}",
                                "--format=csv,noheader", "-lms", "100"], stdout=log, stderr=subprocess.DEVNULL)
    phases = []
    try:
        product()
        torch.cuda.synchronize()
        time.sleep(1.0)
        start = datetime.now()
        ms = median_ms(timed(product, args.calls))
        phases.append({"phase": "cool", "calls": args.calls, "ms": ms, "start": start, "end": datetime.now()})
        # the sustained phase's second half, in batches that keep the queue short
        t0, kept = time.monotonic(), []
        while time.monotonic() - t0 < args.seconds:
            half = time.monotonic() - t0 >= args.seconds / 2
            if half and not kept:
                start = datetime.now()
            batch = timed(product, 20)
            torch.cuda.synchronize()
            kept += batch if half else []
        if not kept:  # one batch outlasted the phase
            kept = batch
        phases.append({"phase": "sustained", "calls": len(kept), "ms": median_ms(kept), "start": start,
                       "end": datetime.now()})
    finally:
        if smi is not None:
            time.sleep(0.3)
            smi.terminate()
            smi.wait()
    log.close()
    samples = smi_samples(log.name) if smi is not None else []
    os.unlink(log.name)
    limit = samples[0][4] if samples else "unknown"
    print(f"{torch.cuda.get_device_name()} (power limit {limit}) | bf16 x [{args.m}, {args.k}] @ W^T [{args.k}, {args.n}]")
    print("| phase | calls | ms | TFLOP/s | SM MHz | W | clock-event reasons |")
    print("|---|---|---|---|---|---|---|")
    for p in phases:
        p["tflops"] = flop / p["ms"] / 1e9
        p.update(phase_stats(samples, p.pop("start"), p.pop("end")))
        print(f"| {p['phase']} | {p['calls']} | {p['ms']:.3f} | {p['tflops']:.0f} | {p.get('sm_mhz', '')} | "
              f"{p.get('watts', '')} | {' '.join(p.get('reasons', []))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "power_limit": limit, "shape": [args.m, args.k, args.n], "rows": phases}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
