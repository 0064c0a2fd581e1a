"""The benchmark scripts on a CPU: argument checks, the shapes derived from the presets, and smoke
runs of their code paths on debug presets (no measurement). The GPU cases at the end run the real
shapes where a GPU is present. ``bench_model``'s are in ``test_bench_model.py``."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ttr.models.layers import LAYER_TYPES
from ttr.models.presets import get_preset, list_presets
from ttr.scripts import (
    bench_fused,
    bench_kernels,
    bench_model,
    bench_products,
    bench_stages,
    kernel_resources,
)

ROOT = Path(__file__).resolve().parents[1]
PRESETS_1_3B = [p for p in list_presets() if p.endswith("-1.3b")]


def test_every_mixer_has_a_kernel_shape_and_every_1_3b_preset_yields_shapes():
    assert set(bench_kernels.LAYER_OPS) == set(LAYER_TYPES)
    assert bench_kernels.default_presets() == PRESETS_1_3B == bench_model.default_presets()
    for preset in PRESETS_1_3B:
        shapes = bench_kernels.preset_shapes([preset])
        config = get_preset(preset)
        ops = {bench_kernels.LAYER_OPS[t](config).op for t in config.layer_types}
        assert ops <= {s.op for s in shapes}, preset
        assert all(preset in s.presets[0] for s in shapes)
        assert all(s.op in bench_kernels.rows() for s in shapes)


def test_preset_shapes_are_the_ones_the_presets_run():
    """GLA K = 64, V = 128, H = 16; SSD H = 64, P = 64, N = 128, one group (and the N = 64, 8 groups
    variant); the delta rules 16 heads of 128; SWA window 2048 and full attention, 16 heads of 128."""
    S = bench_kernels.Shape
    shapes = {(s.op, s.H, s.K, s.V, s.groups, s.window): s.presets for s in bench_kernels.preset_shapes()}
    assert set(shapes) == {
        ("gated_delta", 16, 128, 128, None, None), ("delta", 16, 128, 128, None, None),
        ("gla", 16, 64, 128, None, None), ("ssd", 64, 128, 64, 1, None), ("ssd", 64, 64, 64, 8, None),
        ("swa", 16, 128, 128, None, 2048), ("attn", 16, 128, 128, None, None),
    }
    assert shapes[("ssd", 64, 128, 64, 1, None)] == ("mamba2-1.3b", "gated_deltanet_h2-1.3b")
    assert shapes[("gated_delta", 16, 128, 128, None, None)] == (
        "gated_deltanet-1.3b", "gated_deltanet_h1-1.3b", "gated_deltanet_h2-1.3b")
    assert shapes[("swa", 16, 128, 128, None, 2048)] == ("gated_deltanet_h1-1.3b", "gated_deltanet_h2-1.3b")
    assert shapes[("ssd", 64, 64, 64, 8, None)][0].startswith("mamba2-1.3b with mamba_state_size=64")
    assert S("ssd", 64, 128, 64, groups=1).label() == "H=64 P=64 N=128 G=1"
    assert S("swa", 16, 128, 128, window=2048).label() == "H=16 D=128 W=2048"
    # the oracle's small shape keeps dims, window and the heads-per-group ratio
    assert S("ssd", 64, 64, 64, groups=8).small() == S("ssd", 8, 64, 64, groups=1)
    assert S("gla", 16, 64, 128).small() == S("gla", 4, 64, 128)


def test_bench_fused_conv_shapes_are_the_models_own():
    """bench_fused times the convs the models build: Gated DeltaNet's q and k with their per-head
    norm and its v, read as column blocks of the one q, k, v product the layer trains with,
    Mamba2's xBC with a bias, read as a column slice of its one input projection."""
    gdn, mamba = get_preset("gated_deltanet-1.3b"), get_preset("mamba2-1.3b")
    rows = {name: rest for name, *rest in bench_fused.preset_convs()}
    qk, v = gdn.num_heads * gdn.head_dim, int(gdn.num_heads * gdn.head_dim * gdn.expand_v)
    assert rows["gated_deltanet-1.3b convs.0, convs.1"] == [qk, gdn.head_dim, False, 2 * qk + v]
    assert rows["gated_deltanet-1.3b convs.2"] == [v, 0, False, 2 * qk + v]
    d, l2, bias, width = rows["mamba2-1.3b conv"]
    assert (l2, bias) == (0, mamba.mamba_conv_bias) and width > d > mamba.hidden_size


def test_plan_keeps_the_uniform_rows():
    todo = bench_kernels.plan("uniform", None, None, [2048, 16384], 16384)
    assert [(s.op, B, T) for s, B, T in todo[:2]] == [("gated_delta", 8, 2048), ("gated_delta", 1, 16384)]
    assert {(s.H, s.K, s.V) for s, _, _ in todo} == {(16, 128, 128)}
    assert {s.op for s, _, _ in todo} == set(bench_kernels.rows())
    both = bench_kernels.plan("all", ["ssd"], None, [4096], 16384)
    assert [(s.K, s.groups, B) for s, B, _ in both] == [(128, 1, 4), (64, 8, 4), (128, 1, 4)]


def test_bench_kernels_arguments_are_checked_by_name(capsys):
    cases = [(["--ops", "lstm"], "--ops: unknown"), (["--stages", "--ops", "swa"], "--ops: unknown"),
             (["--presets", "gla-7b"], "--presets: unknown"), (["--seqlens", "4k"], "--seqlens"),
             (["--shapes", "odd"], "--shapes"), (["--ops", "simple_gla"], "no preset runs"),
             (["--stages", "--ops", "ssd", "--sweep", "wy_fwd"], "--sweep: unknown stages ['wy_fwd']"),
             (["--stages", "--ops", "ssd", "--sweep", "--sweep-top", "-1"], "--sweep-top must be 0"),
             (["--stages", "--ops", "gla", "--device", "cpu"], "--stages times CUDA kernels"),
             (["--profile", "--device", "cpu"], "--profile times CUDA kernels"),
             (["--chunk-states", "auto,kept"], "--chunk-states: unknown ['kept']"),
             (["--chunk-states", "keep,keep"], "--chunk-states: a choice given twice"),
             (["--chunk-states", "auto,keep", "--stages", "--ops", "ssd"], "not with --stages or --profile")]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            bench_kernels.main(argv)
        assert message in capsys.readouterr().err, argv


def test_bench_kernels_sweeps_the_named_stages_only():
    parser = bench_kernels.argparse.ArgumentParser()
    assert bench_stages.sweep_stages(parser, None, ["ssd"]) is None
    assert bench_stages.sweep_stages(parser, "all", ["delta"]) == set(bench_stages.SWEEPS["delta"]) > set(bench_stages.DELTA_SWEEP)
    assert bench_stages.sweep_stages(parser, "state_bwd,wy_fwd", ["ssd", "delta"]) == {"state_bwd", "wy_fwd"}


def test_every_capped_stage_is_swept_under_each_register_cap():
    """The register caps join each named stage's own alternatives (none of the shared lists grows)."""
    for op, stages in bench_stages.CAPPED_STAGES.items():
        for stage in stages:
            caps = [c["maxnreg"] for c in bench_stages.SWEEPS[op][stage] if set(c) == {"maxnreg"}]
            assert caps == list(bench_stages.REG_CAPS), (op, stage)
    assert all("maxnreg" not in c for c in bench_stages.DELTA_SWEEP["wy_fwd"])


def test_ttr_bench_dry_run_lists_the_preset_rows(capsys):
    from ttr.__main__ import main

    assert main(["bench", "--dry-run", "--seqlens", "2048,16384", "--ops", "gla,ssd"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "gla H=16 K=64 V=128 8 x 2048: fla chunk_gla; gla-1.3b"
    assert out[2].startswith("ssd H=64 P=64 N=128 G=1 8 x 2048: fla chunk_simple_gla (B, C expanded beforehand); mamba2-1.3b")
    assert len(out) == 6


def test_ssd_reference_can_be_the_authors_kernel(capsys):
    """``--ssd-reference mamba_ssm`` times mamba_ssm's kernel on ttr's own inputs (no mapped copies),
    so every input gradient is compared; an unknown reference is refused by name."""
    assert bench_kernels.main(["--dry-run", "--seqlens", "4096", "--ops", "ssd", "--ssd-reference", "mamba_ssm"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ssd H=64 P=64 N=128 G=1 4 x 4096: mamba_ssm mamba_chunk_scan_combined (chunk 256); ")
    row = bench_kernels.rows("mamba_ssm")["ssd"]
    x = row.make_inputs(1, 8, bench_kernels.Shape("ssd", 4, 16, 8, groups=2), torch.float32, torch.device("cpu"))
    assert sorted(x) == ["A", "B", "C", "dt", "x"] and x["B"].shape == (1, 8, 2, 16)
    assert bench_kernels.rows()["ssd"].reference_name.startswith("fla chunk_simple_gla")
    with pytest.raises(SystemExit):
        bench_kernels.main(["--dry-run", "--ssd-reference", "ssm"])
    assert "--ssd-reference: invalid choice: 'ssm'" in capsys.readouterr().err
    if importlib.util.find_spec("mamba_ssm") is None:  # a run (not a listing) needs the kernel's sources
        with pytest.raises(SystemExit):
            bench_kernels.main(["--device", "cpu", "--ops", "ssd", "--ssd-reference", "mamba_ssm"])
        assert "--ssd-reference mamba_ssm: mamba_ssm.ops.triton.ssd_combined does not import" in capsys.readouterr().err


# bf16 inputs on the torch backend (which computes in fp32): the comparisons hold on a CPU too
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_kernels_smoke_on_cpu(monkeypatch, tmp_path):
    """The table and JSON of a CPU run: ttr and SDPA cells filled, attention equal to SDPA (the CPU
    backend is SDPA), the oracle errors small, a JSON row per (shape, T); with no time left every
    row is listed as skipped."""
    monkeypatch.setattr(bench_kernels, "ORACLE_T", 32)
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "torch")
    out = tmp_path / "k.json"
    argv = ["--device", "cpu", "--presets", "gated_deltanet_h2-debug", "--ops", "ssd,swa", "--tokens", "64",
            "--seqlens", "32", "--json", str(out), "--out", str(tmp_path / "k.md")]
    assert bench_kernels.main(argv + ["--no-fla"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["groups"], r["B"], r["T"]) for r in rows] == [("ssd", 1, 2, 32), ("ssd", 8, 2, 32),
                                                                     ("swa", None, 2, 32)]
    assert all(r["ttr_fwd_ms"] > 0 and r["ttr_fwd_bwd_ms"] > 0 and r["oracle_rel_err"] < 2e-2 for r in rows)
    assert "ref_fwd_ms" not in rows[0] and rows[2]["rel_err_vs_ref"] == 0.0
    table = (tmp_path / "k.md").read_text()
    assert "| swa | SDPA, band mask | H=2 D=32 W=16 | 2 x 32 |" in table
    assert "- ssd H=8 P=16 N=64 G=8: gated_deltanet_h2-debug with mamba_state_size=64" in table
    assert bench_kernels.main(argv + ["--time-budget", "0", "--no-oracle"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(r["skipped"] for r in rows)


def test_gpu_ms_times_the_kernels_once_the_host_is_ahead(monkeypatch):
    """``gpu_ms`` queues its calls behind a GPU sleep and reads the events only if the host queued
    them all while the GPU still slept (the start event had not run); else it doubles the sleep and
    times them again."""
    from ttr.scripts import bench_utils

    sleeps, queries = [], iter([True, True, False])  # the start event had run twice: the host was late

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            pass

        def query(self):
            return next(queries)

        def elapsed_time(self, end):
            return 40.0

    fake = SimpleNamespace(Event=Event, _sleep=sleeps.append, synchronize=lambda: None)
    monkeypatch.setattr(bench_utils.torch, "cuda", fake)
    calls = []
    assert bench_utils.gpu_ms(lambda: calls.append(1), calls=20, sleep_cycles=1000) == 2.0
    assert sleeps == [1000, 2000, 4000]
    assert len(calls) == 1 + 3 * 20  # one call before timing, then each try's 20


def test_peak_counts_the_gradients_the_step_writes(monkeypatch):
    """The peak's baseline is read with the previous call's gradients freed, so the step's own
    gradients count above it (a baseline that still held them under-counted by their size)."""
    from ttr.scripts import bench_utils

    x = {"a": torch.randn(3, requires_grad=True)}
    x["a"].grad = torch.ones(3)  # left by an earlier timing call
    seen = []

    def peak_mib(fn):
        seen.append(x["a"].grad)  # what the baseline would hold
        fn()
        return 0.0

    monkeypatch.setattr(bench_utils, "peak_mib", peak_mib)
    assert bench_kernels._peak(lambda a: (a * 2).sum(), x, torch.tensor(1.0)) == 0.0
    assert seen == [None]
    assert torch.equal(x["a"].grad, torch.full((3,), 2.0))


def test_bench_row_cells_give_both_ratios():
    """A row's cells: wall-clock and GPU times of both sides and the two ratios ttr / reference; a
    missing reference leaves its cells and ratios empty."""
    r = {"op": "ssd", "reference": "fla", "shape": "H=64", "B": 8, "T": 2048, "ttr_fwd_ms": 0.4, "ref_fwd_ms": 0.5,
         "ttr_fwd_bwd_ms": 1.5, "ref_fwd_bwd_ms": 2.25, "ttr_gpu_fwd_bwd_ms": 1.2, "ref_gpu_fwd_bwd_ms": 2.4}
    assert bench_kernels.format_row(r) == ("| ssd | fla | H=64 | 8 x 2048 | 0.400 | 0.500 | 1.500 | 2.250 | 0.67 | "
                                           "1.200 | 2.400 | 0.50 |  |  |  |  |")
    alone = {k: v for k, v in r.items() if not k.startswith("ref_")}
    assert bench_kernels.format_row(alone).endswith("| 0.400 |  | 1.500 |  |  | 1.200 |  |  |  |  |  |  |")


def test_bench_kernels_rounds_alternate_and_report_medians(monkeypatch):
    """`--rounds`: ttr and the reference are timed in turn, and each time is the median of its rounds;
    a reference that fails in a later round leaves ttr's numbers and its own error."""
    calls, ticks = [], iter(range(100))

    def fake_bench(fn, x, do, backward, device):
        calls.append((fn.__name__, backward))
        if fn.__name__ == "ref" and len(calls) > 8:
            raise RuntimeError("out of memory")
        return float(next(ticks))

    def ttr(**x):
        return x["a"]

    def ref(**x):
        return x["a"]

    row = bench_kernels.Row(ttr, ref, "the reference", lambda B, T, s, dtype, device: {"a": torch.ones(B, T, s.H, s.V)},
                            ttr)
    monkeypatch.setattr(bench_kernels, "_bench", fake_bench)
    monkeypatch.setattr(bench_kernels, "_peak", lambda fn, x, do: 1.0)
    shape = bench_kernels.Shape("ssd", 2, 4, 4)
    r = bench_kernels.measure(row, shape, 1, 8, torch.device("cpu"), rounds=3)
    assert calls[:8] == [("ttr", False), ("ttr", True), ("ref", False), ("ref", True)] * 2
    # ttr: three rounds (0, 1), (4, 5), (8, 9); the reference fails in its third round
    assert r["ttr_fwd_rounds_ms"] == [0.0, 4.0, 8.0] and r["ttr_fwd_bwd_ms"] == 5.0
    assert "ref_fwd_ms" not in r and r["errors"]["ref"] == "RuntimeError: out of memory"
    one = bench_kernels.measure(row, shape, 1, 8, torch.device("cpu"), rounds=1)
    assert "ttr_fwd_rounds_ms" not in one and one["ttr_fwd_ms"] >= 0
    # the turns are between two sides: without the reference, or when it fails at once, ttr is timed once
    calls.clear()
    alone = bench_kernels.measure(row, shape, 1, 8, torch.device("cpu"), references="none", rounds=3)
    assert calls == [("ttr", False), ("ttr", True)] and "ttr_fwd_rounds_ms" not in alone
    calls[:] = [None] * 8  # the fake reference now fails on its first call
    failing = bench_kernels.measure(row, shape, 1, 8, torch.device("cpu"), rounds=3)
    assert [c for c in calls[8:]] == [("ttr", False), ("ttr", True), ("ref", False)]
    assert "ttr_fwd_rounds_ms" not in failing and failing["errors"]["ref"] == "RuntimeError: out of memory"


def test_bench_profile_runs_on_cpu(monkeypatch, capsys):
    """`ttr bench --profile`'s per-row profile (a GPU tool) runs end to end on a tiny CPU row of the
    planned shapes (here an SSD layout with groups, as the presets' rows have): host time measured,
    kernel table formatted (empty without CUDA)."""
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "torch")
    shape = bench_kernels.Shape("ssd", 4, 16, 8, groups=2)
    report = bench_kernels.profile([(shape, 2, 32)], device="cpu", iters=1)
    head = report.splitlines()[0]
    assert head.startswith(f"ssd {shape.label()} 2 x 32: kernels 0.000 ms per fwd+bwd, host ")
    assert float(head.split("host ")[1].split(" ms")[0]) > 0
    assert "| kernel | launches per call | ms per call |" in report


def test_bench_profile_times_the_reference_on_the_same_inputs(monkeypatch):
    """`ttr bench --profile` profiles each row's reference after ttr's, on the same inputs; a reference
    that fails leaves its error line and ttr's block, and `--no-reference` ("none") or `--no-fla`
    ("sdpa", for an fla reference) leaves it out."""
    seen = []

    def ttr(**x):
        seen.append(("ttr", x["a"]))
        return x["a"] * 2

    def ref(**x):
        seen.append(("ref", x["a"]))
        return x["a"] * 3

    def broken(**x):
        raise RuntimeError("no kernel for this GPU")

    def make(B, T, s, dtype, device):
        return {"a": torch.ones(B, T, s.H, s.V)}

    shape = bench_kernels.Shape("ssd", 2, 4, 4)
    for reference, name in ((ref, "the reference"), (broken, "fla broken")):
        monkeypatch.setattr(bench_kernels, "rows", lambda *a, r=reference, n=name: {"ssd": bench_kernels.Row(
            ttr, r, n, make, ttr)})
        seen.clear()
        report = bench_kernels.profile([(shape, 2, 8)], device="cpu", iters=1, references="all")
        heads = [line for line in report.splitlines() if line.startswith("ssd ")]
        assert heads[0].startswith(f"ssd {shape.label()} 2 x 8: kernels ")
        if reference is ref:
            assert heads[1].startswith(f"ssd {shape.label()} 2 x 8, the reference: kernels ")
            assert {side for side, _ in seen} == {"ttr", "ref"} and len({id(a) for _, a in seen}) == 1
        else:
            assert heads[1] == f"ssd {shape.label()} 2 x 8, fla broken: RuntimeError: no kernel for this GPU"
        for references in ("none", "sdpa"):
            alone = bench_kernels.profile([(shape, 2, 8)], device="cpu", iters=1, references=references)
            assert (len([line for line in alone.splitlines() if line.startswith("ssd ")]) ==
                    (2 if references == "sdpa" and reference is ref else 1))


def test_bench_chunk_states_times_each_choice_in_turn_on_one_set_of_inputs(monkeypatch, tmp_path):
    """`ttr bench --chunk-states auto,keep` runs ttr's op under each TTR_CHUNK_STATES choice on the
    same inputs, the choices in turn and reversed every other round, TTR_CHUNK_STATES restored after;
    each choice's row has every round, and its output's difference from the first choice's."""
    calls = []

    def ttr(**x):
        calls.append((os.environ.get("TTR_CHUNK_STATES"), id(x["a"])))
        return x["a"] * (3 if os.environ.get("TTR_CHUNK_STATES") == "recompute" else 2)

    def make(B, T, s, dtype, device):
        return {"a": torch.ones(B, T, s.H, s.V)}

    monkeypatch.setattr(bench_kernels, "rows", lambda *a: {"ssd": bench_kernels.Row(ttr, None, "none", make, ttr)})
    monkeypatch.setenv("TTR_CHUNK_STATES", "auto")
    shape = bench_kernels.Shape("ssd", 2, 4, 4)
    table, found = bench_stages.chunk_states_table([(shape, 2, 8)], ["keep", "recompute"], "cpu", rounds=2)
    assert os.environ["TTR_CHUNK_STATES"] == "auto"
    assert len({a for _, a in calls}) == 1
    timed = [c for c, _ in calls[-4:]]
    assert timed == ["keep", "recompute", "recompute", "keep"]
    assert [(r["chunk_states"], len(r["rounds_ms"])) for r in found] == [("keep", 2), ("recompute", 2)]
    assert found[0]["diff_vs_first"] == 0 and found[1]["diff_vs_first"] == pytest.approx(0.5)
    assert "| ssd | H=2 P=4 N=4 G=None | 2 x 8 | keep |" in table
    out = tmp_path / "cs.json"
    assert bench_kernels.main(["--chunk-states", "keep,recompute", "--device", "cpu", "--ops", "ssd", "--seqlens",
                               "8", "--tokens", "16", "--shapes", "uniform", "--rounds", "1", "--json",
                               str(out)]) == 0
    assert [r["chunk_states"] for r in json.loads(out.read_text())["chunk_states"]] == ["keep", "recompute"]


def test_bench_rows_and_stages_are_checked_by_name():
    """Every row of the kernel table is one of the script's own; --stages covers the engine's
    pipelines and SSD's grouped stages."""
    assert list(bench_kernels.rows()) == ["gated_delta", "delta", "gla", "simple_gla", "ssd", "swa", "attn"]
    assert set(bench_stages.SWEEPS) <= set(bench_stages.STAGE_CALLS) <= set(bench_kernels.rows())


# the benchmark's inputs are bf16, which the interpreter loads as garbage: the closures run, their
# values are not what this test checks
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bench_stage_closures_run_under_the_interpreter(monkeypatch):
    """Every stage closure that `ttr bench --stages` times runs (tiny shapes, Triton interpreter)."""
    from ttr.kernels.common import index
    from ttr.kernels.utils import interpreter_active

    if not interpreter_active():
        pytest.skip("needs TRITON_INTERPRET=1 on a CPU machine")
    monkeypatch.setattr(bench_stages, "HEADS", 2)
    monkeypatch.setattr(bench_stages, "HEAD_DIM", 16)
    monkeypatch.setattr(bench_stages, "SSD_STAGE_SHAPE", bench_kernels.Shape("ssd", 2, 16, 16, groups=1))
    monkeypatch.setattr(bench_stages, "SSD_G8_STAGE_SHAPE", bench_kernels.Shape("ssd", 4, 16, 16, groups=2))
    monkeypatch.setattr(bench_stages, "GLA_STAGE_SHAPE", bench_kernels.Shape("gla", 2, 16, 32))
    assert [s.groups for s in bench_stages.stage_shapes("ssd")] == [1, 2]
    for name, stage_calls in bench_stages.STAGE_CALLS.items():
        for shape in bench_stages.stage_shapes(name):
            calls = stage_calls(1, 80, torch.device("cpu"), *([shape] if shape else []))
            swept = {bench_stages.SWEEP_ALIASES.get(s, s) for s in bench_stages.SWEEPS.get(name, {})}
            assert swept <= set(calls), swept - set(calls)
            for fn in calls.values():
                fn()
    # the totals leave out the stages the op does not run at this shape: here (80 tokens, the
    # interpreter's one "SM") DeltaNet's dq/dk stage walks, Gated DeltaNet's walks the states again
    assert bench_stages.delta_stage_calls(1, 80, False, torch.device("cpu")).off_path == {
        "wy_fwd_reuse", "state_fwd_again", "output_bwd_dqk"}
    assert bench_stages.delta_stage_calls(1, 80, True, torch.device("cpu")).off_path == {"wy_fwd_reuse"}
    # SSD's walk forms y at N = 16 on a full grid, so the output launch and the walk without y are off
    # its path (the backward's walk, which forms the same states, is on it)
    shape = bench_stages.SSD_STAGE_SHAPE
    assert bench_stages.ssd_stage_calls(1, 80, torch.device("cpu"), shape).off_path == {"ssd_output_fwd",
                                                                                          "state_fwd"}
    monkeypatch.setitem(index.TUNING, "ssd_output", {"walk": False})
    assert bench_stages.ssd_stage_calls(1, 80, torch.device("cpu"), shape).off_path == {"state_fwd_y"}


def test_stage_total_leaves_out_the_stages_off_the_ops_path(monkeypatch):
    """``time_stages`` sums the stages the op runs; a ``Stages``' off_path ones are listed, not summed."""
    import triton.testing

    from ttr.scripts.bench_utils import Stages, time_stages

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: fn())
    calls = Stages(a=lambda: 1.0, b=lambda: 10.0, c=lambda: 2.0)
    calls.off_path = frozenset({"b"})
    (line,) = time_stages(calls, "op 1x64")
    assert line == "stages op 1x64: a 1.000, b 10.000, c 2.000; total 3.000 (without b)"
    assert time_stages({"a": lambda: 1.0, "b": lambda: 10.0}, "plain")[0].endswith("; total 11.000")


def test_stage_sweep_lists_the_fastest_or_all(monkeypatch):
    """A sweep's line lists its alternatives fastest first, the five fastest by default and every one
    with ``top=0`` (``ttr bench --stages --sweep-top``); ``index.TUNING`` is as it was afterwards."""
    import triton.testing

    from ttr.kernels.common.index import TUNING
    from ttr.scripts.bench_utils import time_stages

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: fn())
    calls = {"s": lambda: TUNING.get("s", {}).get("x", 0.5)}
    sweep = {"s": [dict(x=x) for x in (3.0, 1.0, 6.0, 2.0, 5.0, 4.0)]}
    five = time_stages(calls, "op", sweep)[1]
    assert five == ("  sweep s op: default 0.500; 1.000 {'x': 1.0}; 2.000 {'x': 2.0}; 3.000 {'x': 3.0}; "
                    "4.000 {'x': 4.0}; 5.000 {'x': 5.0}")
    assert time_stages(calls, "op", sweep, top=0)[1] == five + "; 6.000 {'x': 6.0}"
    assert "s" not in TUNING
    # an override set before the sweep (another stage's, or the swept stage's own) is there after it
    monkeypatch.setitem(TUNING, "s", {"x": 0.25})
    monkeypatch.setitem(TUNING, "t", {"y": 1})
    assert time_stages(calls, "op", sweep)[0].startswith("stages op: s 0.250")
    assert TUNING["s"] == {"x": 0.25} and TUNING["t"] == {"y": 1}


def test_fla_guard_note(monkeypatch):
    """The note says when fla ran unguarded; without fla, lifting the guard is a no-op, not a crash."""
    from ttr.scripts import bench_utils

    assert bench_utils.fla_guard_note(True) == bench_utils.FLA_GUARD_NOTE
    assert "timing only" in bench_utils.FLA_GUARD_NOTE and "#640" in bench_utils.FLA_GUARD_NOTE
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # as if fla were not installed
    assert bench_utils.lift_fla_guard() is None and bench_utils.fla_guard_note(False) is None


def test_device_bench_plans_its_parts_within_the_budget(tmp_path):
    """scripts/device_bench.sh: the commands of each part (DRY_RUN=1), their shares of the budget,
    and an unknown part refused."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "DRY_RUN": "1"}
    run = lambda **kw: subprocess.run(["bash", "scripts/device_bench.sh"], cwd=ROOT, capture_output=True,  # noqa: E731
                                      text=True, env={**env, **kw})
    out = run().stdout.splitlines()
    # ttr's rows alone first, in a third of the kernels' share, then with the references
    assert out[0].startswith("== kernels-ttr (60 s): ttr.scripts.bench_kernels --shapes preset --seqlens "
                             "2048,4096,8192,16384 --no-reference --time-budget 40 ")
    assert out[1].startswith("== kernels (120 s): ttr.scripts.bench_kernels --shapes preset --seqlens "
                             "2048,4096,8192,16384 --lift-fla-guard --rounds 3 --time-budget 90 ")
    assert out[2].startswith("== model (510 s): ttr.scripts.bench_model --references --lift-fla-guard --batch 8 "
                             "--seq-len 4096 --steps 4 --warmup 1 --time-budget 450 ")
    out = run(PARTS="model", PRESETS="gla-1.3b", REFERENCES="0", ISOLATE="1", BUDGET_S="300").stdout
    assert "bench_model --presets gla-1.3b --no-references --isolate --batch 8" in out
    out = run(PARTS="kernels", REFERENCES="0").stdout
    # a row without a reference is timed once whatever --rounds says (bench_kernels.measure)
    assert "kernels-ttr" not in out and "--no-reference --rounds 3 --time-budget 150" in out
    assert "--rounds 5 " in run(PARTS="kernels", ROUNDS="5").stdout
    bad = run(PARTS="kernels,bogus")
    assert bad.returncode == 2 and "unknown part 'bogus'" in bad.stderr


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_bench_kernels_ssd_against_mamba_ssm_on_gpu(tmp_path):
    """ttr's SSD next to the authors' kernel at Mamba2-1.3B's shape: both timed, the output and every
    input gradient (x, dt, A, B, C) close."""
    pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")
    out = tmp_path / "k.json"
    assert bench_kernels.main(["--presets", "mamba2-1.3b", "--ops", "ssd", "--seqlens", "4096", "--rounds", "1",
                               "--ssd-reference", "mamba_ssm", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["groups"] for r in rows] == [1, 8]
    for r in rows:
        assert r["ttr_fwd_bwd_ms"] > 0 and r["ref_fwd_bwd_ms"] > 0 and not r.get("errors"), r
        assert r["rel_err_vs_ref"] < 2e-2, r


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_bench_kernels_preset_rows_on_gpu(tmp_path):
    """One preset row per op family on the GPU: ttr and the reference timed, their outputs and
    gradients close (fla's ungated DeltaNet and SDPA; the gated fla ops may be guarded on Hopper)."""
    pytest.importorskip("fla")
    out = tmp_path / "k.json"
    assert bench_kernels.main(["--presets", "delta_net-1.3b,gated_deltanet_h1-1.3b", "--ops", "delta,swa",
                               "--seqlens", "4096", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["delta", "swa"]
    for r in rows:
        assert r["ttr_fwd_bwd_ms"] > 0 and r["ref_fwd_bwd_ms"] > 0 and r["ttr_peak_mib"] > 0, r
        # the kernels alone take no longer than the wall clock from the first launch (within noise)
        for side in ("ttr", "ref"):
            assert 0 < r[f"{side}_gpu_fwd_bwd_ms"] < 1.1 * r[f"{side}_fwd_bwd_ms"], r
        assert r["rel_err_vs_ref"] < 2e-2 and r["oracle_rel_err"] < 2e-2, r


def test_bench_products_reads_the_clock_samples(tmp_path):
    """nvidia-smi's lines become (time, clock, power, reasons, limit); a phase takes the median of
    the samples inside it, or the last one before its end when it is shorter than the sampling."""
    from datetime import datetime, timedelta

    log = tmp_path / "smi.csv"
    log.write_text("2026/11/29 13:11:54.640, 1980 MHz, 123.25 W, 0x0000000000000000, 700.00 W\n"
                   "2026/11/29 13:11:55.642, 1605 MHz, 463.70 W, 0x0000000000000004, 700.00 W\n"
                   "[N/A]\n"
                   "2026/11/29 13:11:56.145, 1575 MHz, 699.48 W, 0x0000000000000004, 700.00 W\n"
                   "2026/11/29 13:11:56.646, 1545 MHz, 693.03 W, 0x0000000000000004, 700.00 W\n")
    samples = bench_products.smi_samples(str(log))
    assert [s[1] for s in samples] == [1980, 1605, 1575, 1545] and samples[0][4] == "700.00 W"

    def at(seconds):
        return datetime(2026, 11, 29, 13, 11) + timedelta(seconds=seconds)

    sustained = bench_products.phase_stats(samples, at(55.5), at(56.7))
    assert sustained == {"sm_mhz": 1575, "watts": 693.03, "reasons": ["0x0000000000000004"]}
    cool = bench_products.phase_stats(samples, at(54.9), at(54.91))  # no sample inside: the one before
    assert cool == {"sm_mhz": 1980, "watts": 123.25, "reasons": ["0x0000000000000000"]}
    assert bench_products.phase_stats(samples, at(50), at(51)) == {}
    with pytest.raises(SystemExit):
        bench_products.parse_args(["--seconds", "0"])


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_bench_products_on_gpu(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert bench_products.main(["--m", "4096", "--seconds", "0.5", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["cool", "sustained"]
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["calls"] > 0 for r in rows), rows
    assert "| sustained |" in capsys.readouterr().out


def test_kernel_resources_reads_the_hottest_loop():
    """The loop with the most instructions is found from its backward branch; its local-memory and
    warpgroup-matrix instructions are counted per iteration."""
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDL R2, [R1] ;",
        "        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;",
        "        /*0030*/                   LDL.64 R4, [R1+0x8] ;",
        "        /*0040*/                   STL [R1+0x10], R4 ;",
        "        /*0050*/               @P0 BRA 0x20 ;",
        "        /*0060*/                   LDL R6, [R1+0x20] ;",
        "        /*0070*/               @P1 BRA 0x60 ;",
        "        /*0080*/                   EXIT ;",
    ])
    assert kernel_resources.hottest_loop(sass) == dict(loop_instructions=4, loop_ldl=1, loop_stl=1, loop_gmma=1,
                                                       loop_hmma=0)
    assert kernel_resources.hottest_loop("        /*0000*/                   EXIT ;")["loop_instructions"] == 0


@pytest.mark.slow  # compiles every launch with ptxas: about two minutes on two cores
def test_kernel_resources_compiles_an_ops_launches(tmp_path):
    """The interpreter run records simple GLA's launches; each compiles for sm_90a with its
    registers, stack and shared memory read back; a second run reads the saved launches."""
    try:
        kernel_resources._tool("cuobjdump"), kernel_resources._tool("ptxas")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launches = tmp_path / "launches.json"
    cmd = [sys.executable, "-m", "ttr.scripts.kernel_resources", "--shapes", "uniform", "--ops", "simple_gla",
           "--seqlen", "64", "--launches", str(launches), "--json", str(tmp_path / "r.json")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"state_fwd_kernel", "state_scan_kernel", "output_fwd_kernel"} <= kernels, kernels
    for r in rows:
        assert "error" not in r and 0 < r["regs"] <= 255 and r["stack"] >= 0 and r["smem"] >= 0, r
    walk = next(r for r in rows if r["kernel"] == "state_fwd_kernel")
    assert walk["loop_instructions"] > 0 and walk["loop_gmma"] > 0, walk  # the chunk walk's dot is a wgmma
    # a saved capture is read, not captured again: only the one launch left in it is reported
    saved = json.loads(launches.read_text())
    # every launch carries the GPU launcher's marks: its tensors (fresh allocations) are aligned
    walk_launch = next(l for l in saved if l["kernel"] == "state_fwd_kernel")
    pointers = {n for n, t in walk_launch["signature"].items() if t.startswith("*")}
    assert pointers and pointers <= set(walk_launch["divisible"]), walk_launch
    launches.write_text(json.dumps([l for l in saved if l["kernel"] == "state_fwd_kernel"][:1]))
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert [r["kernel"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]] == ["state_fwd_kernel"]
    refused = subprocess.run(cmd, env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert refused.returncode == 2 and "without TRITON_INTERPRET" in refused.stderr


def test_kernel_resources_captures_the_convs_gpu_launches(monkeypatch):
    """The short convs' launches are recorded with the GPU's launch parameters (not the smaller
    blocks their launchers take under the interpreter), in a batch and packed; the backward's walk
    length is a runtime argument the GPU launcher does not specialize, so it is not marked; the
    interpreter's launch is its own again afterwards."""
    import triton.runtime.interpreter as interpreter

    from ttr.kernels.utils import interpreter_active

    if not interpreter_active():
        pytest.skip("records the interpreter's launches (TRITON_INTERPRET=1)")
    run = interpreter.InterpretedFunction.run
    # two small convs in the presets' form: q/k-like with the norm as a column block, v-like with a bias
    monkeypatch.setattr(bench_fused, "preset_convs", lambda: [("qk", 256, 128, False, 768), ("v", 256, 0, True, 256)])
    rows = kernel_resources.capture(["conv"], None, "preset", 64)
    assert interpreter.InterpretedFunction.run is run
    assert {r["shape"] for r in rows} == {"conv qk (L2 norm per 128)", "conv qk (L2 norm per 128) packed", "conv v",
                                          "conv v packed"}
    for r in rows:
        if r["kernel"] == "_conv_bwd_kernel":
            assert r["options"] == {"num_warps": 1, "maxnreg": 128} and r["constexprs"]["BD"] == 128, r
            assert r["signature"]["SEG"] == "i32" and "SEG" not in r["divisible"], r
        else:
            assert r["kernel"] == "_conv_fwd_kernel" and r["options"] == {"num_warps": 4}, r
            assert (r["constexprs"]["BT"], r["constexprs"]["BD"]) == (16, 256), r
    assert {r["constexprs"]["IS_VARLEN"] for r in rows} == {False, True}
    assert {r["constexprs"]["L2"] for r in rows} == {0, 128}


def test_kernel_resources_captures_under_launch_overrides(monkeypatch):
    """``--tuning``: the capture runs under ``index.TUNING`` holding the overrides, so the recorded
    launch is the overridden one (the WY forward's products on 2 warps instead of 4), a stage no
    launch read is named, and TUNING is as it was afterwards; a malformed override is one line
    naming the flag."""
    from ttr.kernels.common.index import TUNING
    from ttr.kernels.utils import interpreter_active

    for bad, says in (("{", "not JSON"), ('{"wy_fwd": 2}', "expected an object of stage name")):
        proc = subprocess.run([sys.executable, "-m", "ttr.scripts.kernel_resources", "--tuning", bad],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and "--tuning: " + says in proc.stderr and "Traceback" not in proc.stderr
    if not interpreter_active():
        pytest.skip("records the interpreter's launches (TRITON_INTERPRET=1)")
    monkeypatch.setitem(TUNING, "wy_bwd", {"num_warps": 8})
    before = {k: dict(v) for k, v in TUNING.items()}
    unread = []
    rows = kernel_resources.capture(["gated_delta"], None, "preset", 64,
                                    {"wy_fwd": {"num_warps": 2}, "wy_fwdd": {"num_warps": 8}}, unread=unread)
    assert TUNING == before and unread == ["wy_fwdd"]
    opts = {r["kernel"]: r["options"] for r in rows}
    # the overrides replace TUNING for the capture: wy_bwd's override outside it is not read there
    assert opts["wy_fwd_kernel"]["num_warps"] == 2 and "num_warps" not in opts["wy_bwd_kernel"], opts


def test_kernel_resources_specializes_arguments_as_the_gpu_launcher():
    """Aligned pointers and ints divisible by 16 are marked, an offset view and 17 are not, an int
    equal to 1 is a constant, as Triton's launcher specializes them on a GPU."""
    x = torch.zeros(4, 16)
    assert kernel_resources._specialize(x) == ("*fp32", True)
    assert kernel_resources._specialize(x[:, 1:]) == ("*fp32", False)
    assert kernel_resources._specialize(x.bfloat16()) == ("*bf16", True)
    assert kernel_resources._specialize(32) == ("i32", True)
    assert kernel_resources._specialize(17) == ("i32", False)
    assert kernel_resources._specialize(1) == (None, False)
    assert kernel_resources._specialize(2**40) == ("i64", True)
    assert kernel_resources._specialize(0.5) == ("fp32", False)


def test_bench_fused_projection_shapes_and_calls(monkeypatch):
    """bench_fused's proj section times the models' own projections (Gated DeltaNet's per-head
    gated o_norm and o_proj, its MLP's down_proj, Mamba2's gate-first grouped norm and out_proj),
    and its two calls of each agree while the fused one keeps the projection's input less."""
    gdn, mamba = get_preset("gated_deltanet-1.3b"), get_preset("mamba2-1.3b")
    specs = {s["name"]: s for s in bench_fused.preset_projections()}
    o = specs["gated_deltanet-1.3b o_norm + o_proj"]
    assert (o["d"], o["heads"], o["gated"], o["gate_first"], o["out"]) == (
        int(gdn.head_dim * gdn.expand_v), gdn.num_heads, True, False, gdn.hidden_size)
    assert specs["gated_deltanet-1.3b SwiGLU + down_proj"]["d"] == gdn.intermediate_size
    m = specs["mamba2-1.3b gated norm + out_proj"]
    assert (m["gated"], m["gate_first"], m["groups"], m["heads"]) == (True, True, mamba.mamba_n_groups, 1)
    monkeypatch.setenv("TTR_KERNEL_BACKEND", "triton")
    small = [dict(o, d=16, heads=4, out=24), dict(m, d=32, groups=2, out=24),
             dict(kind="mlp", name="mlp", d=40, out=24)]
    for spec in small:
        inputs, calls = bench_fused.projection_calls(spec, 32, torch.bfloat16, device="cpu")
        (fused, unfused), width = calls.values(), spec["d"] * spec.get("heads", 1)
        torch.testing.assert_close(fused().float(), unfused().float(), rtol=2e-2, atol=2e-2)
        saved = bench_fused.kept_mib(unfused, inputs) - bench_fused.kept_mib(fused, inputs)
        assert saved * 2**20 == 32 * width * 2, spec["name"]


@pytest.mark.parametrize("tokens", ["64", "0", "200"])
def test_activation_memory_tokens_are_whole_chunk_documents(capsys, tokens):
    """Two documents of whole 64-token chunks at both ledger lengths, or per-chunk tensors (SSD's
    C B^T) would count as fixed bytes: any other --tokens is refused by name before any work."""
    from ttr.scripts import activation_memory

    with pytest.raises(SystemExit):
        activation_memory.main(["mamba2-1.3b", "--tokens", tokens])
    assert "--tokens must be a positive multiple of 128" in capsys.readouterr().err
