"""``scripts/bench_model.py`` on a CPU: its arguments, the plain loop's rows on debug presets (no
measurement), the tables of alternatives (``--chunk-states``, ``--tuning``), the rounds, failures
and the time budget, the profiled step; the GPU case at the end trains a 1.3B preset."""

import json
import os
import subprocess

import pytest
import torch

from ttr.models.presets import list_presets
from ttr.scripts import bench_model

PRESETS_1_3B = [p for p in list_presets() if p.endswith("-1.3b")]


def test_bench_model_arguments_and_references(capsys):
    for argv, message in ((["--presets", "gla-7b"], "--presets: unknown"), (["--steps", "0"], "--steps"),
                          (["--loop", "scan"], "--loop")):
        with pytest.raises(SystemExit):
            bench_model.parse_args(argv + ["--device", "cpu"])
        assert message in capsys.readouterr().err, argv
    args = bench_model.parse_args(["--device", "cpu", "--no-references", "--isolate", "--lift-fla-guard"])
    assert args.preset_list == PRESETS_1_3B and not args.references and args.isolate
    assert (args.batch, args.seq_len) == (8, 4096)
    plain = {p: bench_model.has_reference(p) for p in PRESETS_1_3B}
    assert plain == {p: not p.startswith("gated_deltanet_h2") for p in PRESETS_1_3B}
    trainer = [p for p in PRESETS_1_3B if bench_model.has_reference(p, "trainer")]
    assert trainer == ["gated_deltanet-1.3b", "delta_net-1.3b", "gla-1.3b", "gated_deltanet_h1-1.3b"]
    # a child of --isolate gets the same settings back
    child = bench_model.parse_args(bench_model._child_argv(args, "gla-1.3b", "ttr", "r.json"))
    for key in ("batch", "seq_len", "steps", "warmup", "loop", "device", "lift_fla_guard", "tokenizer"):
        assert getattr(child, key) == getattr(args, key), key
    assert (child.one, child.result) == ("gla-1.3b:ttr", "r.json")


def test_bench_model_smoke_on_cpu(tmp_path):
    """Every row of a CPU run (no measurement): ttr and HF Llama side by side with their ratio,
    h2 without a reference, parameters equal to the reference's, MFU left empty without a GPU."""
    out = tmp_path / "m.json"
    assert bench_model.main(["--device", "cpu", "--presets", "transformer-debug,gated_deltanet_h2-debug",
                             "--batch", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0",
                             "--json", str(out), "--out", str(tmp_path / "m.md")]) == 0
    data = json.loads(out.read_text())
    rows = {(r["preset"], r["impl"]): r for r in data["rows"]}
    assert list(rows) == [("transformer-debug", "ttr"), ("transformer-debug", "reference"),
                          ("gated_deltanet_h2-debug", "ttr")]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows.values())
    mine, ref = rows["transformer-debug", "ttr"], rows["transformer-debug", "reference"]
    assert (mine["model"], ref["model"]) == ("ttr TTRForCausalLM", "HF LlamaForCausalLM")
    assert mine["params"] == ref["params"] and mine["flops_per_token"] == ref["flops_per_token"]
    assert data["settings"]["batch"] == 1
    table = (tmp_path / "m.md").read_text()
    ratio = mine["tokens_per_s"] / ref["tokens_per_s"]
    assert f"| HF LlamaForCausalLM | {ref['tokens_per_s']:,.0f} |  |  | {ratio:.2f} |" in table
    assert "| gated_deltanet_h2-debug |" in table and "| none |" in table
    # the decoding table of ttr's model alone
    assert bench_model.main(["--device", "cpu", "--presets", "gated_deltanet_h2-debug", "--no-train", "--decode",
                             "--prompt-len", "8", "--gen-len", "4", "--decode-batches", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["decode"]
    assert row["batch"] == 2 and row["tokens_per_s"] > 0 and list(row["memory_gib"]) == ["1", "2", "4"]


def test_bench_model_chunk_states_table(monkeypatch, tmp_path, capsys):
    """``--chunk-states``: one row per choice with every round's tokens/s, TTR_CHUNK_STATES set for
    each run and restored after; an unknown choice is refused by name."""
    out = tmp_path / "c.json"
    seen = []
    real_loop = bench_model.plain_loop

    def loop(*a, **k):
        seen.append(os.environ.get("TTR_CHUNK_STATES"))
        return real_loop(*a, **k)

    monkeypatch.setattr(bench_model, "plain_loop", loop)
    monkeypatch.setenv("TTR_CHUNK_STATES", "keep")
    assert bench_model.main(["--device", "cpu", "--presets", "delta_net-debug", "--no-train", "--chunk-states",
                             "recompute,auto", "--batch", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0",
                             "--json", str(out), "--out", str(tmp_path / "c.md")]) == 0
    assert seen == ["recompute", "auto", "recompute", "auto"] and os.environ["TTR_CHUNK_STATES"] == "keep"
    rows = json.loads(out.read_text())["chunk_states"]
    assert [(r["preset"], r["chunk_states"]) for r in rows] == [("delta_net-debug", "recompute"),
                                                                ("delta_net-debug", "auto")]
    assert all(len(r["tokens_per_s"]) == 2 and min(r["tokens_per_s"]) > 0 for r in rows)
    assert "| delta_net-debug | auto | " in (tmp_path / "c.md").read_text()
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--device", "cpu", "--chunk-states", "auto,always"])
    assert "--chunk-states: unknown ['always']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--device", "cpu", "--chunk-states", "auto,auto"])
    assert "--chunk-states: a choice given twice" in capsys.readouterr().err
    # a choice that runs out of memory is a row; the other choices still run
    def oom_when_kept(*a, **k):
        if os.environ["TTR_CHUNK_STATES"] == "keep":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real_loop(*a, **k)

    monkeypatch.setattr(bench_model, "plain_loop", oom_when_kept)
    args = bench_model.parse_args(["--device", "cpu", "--presets", "delta_net-debug", "--chunk-states", "keep,auto",
                                   "--batch", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0"])
    rows = []
    table = bench_model.chunk_states_table(args.preset_list, args, rows)
    assert [(r["chunk_states"], r["status"], len(r["tokens_per_s"])) for r in rows] == [("keep", "oom", 0),
                                                                                      ("auto", "ok", 2)]
    assert "| delta_net-debug | keep | out of memory |" in table


def test_bench_model_tuning_table(monkeypatch, tmp_path, capsys):
    """``--tuning``: one row per alternative with every round's tokens/s, ``index.TUNING`` holding
    exactly that alternative during its runs and restored after; an overridden stage that no launch
    read is named in its row; a malformed list is refused naming the flag."""
    from ttr.kernels.common import index

    out = tmp_path / "t.json"
    seen = []
    real_loop = bench_model.plain_loop

    def loop(*a, **k):
        seen.append({s: dict(v) for s, v in index.TUNING.items()})
        index.tuned("wy_bwd")  # a launch that reads this stage
        return real_loop(*a, **k)

    monkeypatch.setattr(bench_model, "plain_loop", loop)
    monkeypatch.setitem(index.TUNING, "overlap", {"enabled": False})
    alts = '[{}, {"wy_bwd": {"num_warps": 8}}, {"wy_bwdd": {"num_warps": 8}}]'
    assert bench_model.main(["--device", "cpu", "--presets", "delta_net-debug", "--no-train", "--tuning", alts,
                             "--alternate-rounds", "1", "--batch", "1", "--seq-len", "16", "--steps", "1",
                             "--warmup", "0", "--json", str(out), "--out", str(tmp_path / "t.md")]) == 0
    assert seen == [{}, {"wy_bwd": {"num_warps": 8}}, {"wy_bwdd": {"num_warps": 8}}]
    assert index.TUNING == {"overlap": {"enabled": False}}
    rows = json.loads(out.read_text())["tuning"]
    assert [(r["tuning"], r["unread"], len(r["tokens_per_s"])) for r in rows] == [
        ("{}", [], 1), ('{"wy_bwd":{"num_warps":8}}', [], 1), ('{"wy_bwdd":{"num_warps":8}}', ["wy_bwdd"], 1)]
    md = (tmp_path / "t.md").read_text()
    assert '| delta_net-debug | {"wy_bwdd":{"num_warps":8}} (no launch read wy_bwdd) |' in md
    for bad, says in (("[{}", "not JSON"), ("{}", "expected a non-empty JSON list"), ("[]", "expected a non-empty JSON list"),
                      ('[{"wy_bwd": 8}]', "alternative 0: expected an object")):
        with pytest.raises(SystemExit):
            bench_model.parse_args(["--device", "cpu", "--tuning", bad])
        err = capsys.readouterr().err
        assert "--tuning: " + says in err and "Traceback" not in err


def test_reading_stages_collects_the_stages_asked_for():
    from ttr.kernels.common import index

    with index.reading_stages() as outer:
        index.tuned("a", BK=1)
        with index.reading_stages() as inner:
            assert index.tuned("b", BK=2) == {"BK": 2}
    assert inner == {"b"} and outer == {"a", "b"} and index._READ is None


def test_bench_model_rounds_train_the_pair_in_turn(monkeypatch, tmp_path, capsys):
    """``--rounds``: a preset's models built side by side and trained in turn, each row the median of
    its rounds; a model that runs out of memory in a later round is a row, the other keeps its
    numbers; a pair that cannot be built side by side is measured one after the other."""
    order, speeds = [], iter([10.0, 1.0, 30.0, 3.0, 20.0, 2.0, 7.0, 5.0, 6.0])

    def loop(model, *a, **k):
        order.append(bench_model.model_name(model))
        tokens = next(speeds)
        return {"step_ms": 1000.0 / tokens, "tokens_per_s": tokens, "loss_first": 1.0, "loss_last": 0.5}

    monkeypatch.setattr(bench_model, "plain_loop", loop)
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--batch", "1", "--seq-len", "16", "--steps", "1", "--warmup", "0"]
    assert bench_model.main(argv + ["--presets", "transformer-debug,gated_deltanet_h2-debug", "--rounds", "3",
                                    "--json", str(out), "--out", str(tmp_path / "r.md")]) == 0
    assert order == ["ttr TTRForCausalLM", "HF LlamaForCausalLM"] * 3 + ["ttr TTRForCausalLM"] * 3
    data = json.loads(out.read_text())
    mine, ref, h2 = data["rows"]
    assert (mine["impl"], ref["impl"], h2["preset"]) == ("ttr", "reference", "gated_deltanet_h2-debug")
    assert mine["tokens_per_s_rounds"] == [10.0, 30.0, 20.0] and mine["tokens_per_s"] == 20.0
    assert ref["tokens_per_s"] == 2.0 and h2["tokens_per_s"] == 6.0 and data["settings"]["rounds"] == 3
    assert "| HF LlamaForCausalLM | 2 |  |  | 10.00 |" in (tmp_path / "r.md").read_text()

    def oom_later(model, *a, **k):
        if order and "Llama" in bench_model.model_name(model):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        order.append(bench_model.model_name(model))
        return {"step_ms": 1.0, "tokens_per_s": 1000.0, "loss_first": 1.0, "loss_last": 0.5}

    order.clear()
    monkeypatch.setattr(bench_model, "plain_loop", oom_later)
    args = bench_model.parse_args(argv + ["--presets", "transformer-debug", "--rounds", "2"])
    mine, ref = bench_model.measure_rounds("transformer-debug", ["ttr", "reference"], args)
    assert ref["status"] == "oom" and "2.00 GiB" in ref["error"]
    assert mine["status"] == "ok" and mine["tokens_per_s_rounds"] == [1000.0, 1000.0]

    real_build = bench_model.build

    def no_room(preset, impl, device):
        if impl == "reference":  # ttr's model holds the room the reference needs
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real_build(preset, impl, device)

    monkeypatch.setattr(bench_model, "build", no_room)
    monkeypatch.setattr(bench_model, "measure", lambda preset, impl, args: {"preset": preset, "impl": impl,
                                                                            "status": "ok"})
    rows = bench_model.measure_rounds("transformer-debug", ["ttr", "reference"], args)
    assert [r["impl"] for r in rows] == ["ttr", "reference"]
    assert all(r["rounds"].startswith("one after the other") for r in rows)
    for bad, message in ((["--rounds", "0"], "--rounds must be >= 1"), (["--rounds", "2", "--isolate"], "--rounds:")):
        with pytest.raises(SystemExit):
            bench_model.parse_args(argv + bad)
        assert message in capsys.readouterr().err


def test_bench_model_reports_oom_crashes_and_the_budget(monkeypatch, tmp_path):
    """Out of memory and a failed subprocess become rows; models past the time budget are skipped."""
    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(bench_model, "plain_loop", oom)
    args = bench_model.parse_args(["--device", "cpu", "--batch", "1", "--seq-len", "8"])
    row = bench_model.measure("mamba2-debug", "ttr", args)
    assert row["status"] == "oom" and "64.00 GiB" in row["error"]
    assert "| out of memory |" in bench_model.format_table([row], [])

    def crashed(*a, **k):
        return subprocess.CompletedProcess(a, -6, "", "Fatal Python error: Aborted\n")

    monkeypatch.setattr(bench_model.subprocess, "run", crashed)
    row = bench_model.measure_isolated("gla-debug", "reference", args, timeout=5)
    assert row == {"preset": "gla-debug", "impl": "reference", "status": "error",
                   "error": "exit -6: Fatal Python error: Aborted"}
    out = tmp_path / "m.json"
    assert bench_model.main(["--device", "cpu", "--presets", "gla-debug", "--time-budget", "0",
                             "--json", str(out)]) == 0
    assert [r["status"] for r in json.loads(out.read_text())["rows"]] == ["skipped", "skipped"]


@pytest.mark.gpu
@pytest.mark.whole_gpu
def test_bench_model_runs_a_preset_on_gpu(tmp_path):
    """A 1.3B preset trains in the plain loop on the GPU (short sequences): tokens/s, MFU and peak
    memory filled in; the isolated child returns the same kind of row."""
    out = tmp_path / "m.json"
    argv = ["--presets", "gla-1.3b", "--batch", "1", "--seq-len", "2048", "--steps", "2", "--warmup", "1",
            "--no-references", "--json", str(out)]
    assert bench_model.main(argv) == 0
    assert bench_model.main(argv + ["--isolate", "--json", str(tmp_path / "i.json")]) == 0
    for path in (out, tmp_path / "i.json"):
        (row,) = json.loads(path.read_text())["rows"]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_gib"] > 1, row


def test_step_breakdown_sorts_kernels_by_kind_of_work():
    """Kernels of a step go to their kind: ttr's Triton kernels by their module, cuBLAS, SDPA and
    PyTorch's own by name; what no kernel covers is the time the GPU waited."""
    import ttr.kernels.gla  # noqa: F401  (its kernels, and the shared chunkwise ones, are loaded)
    import ttr.kernels.loss  # noqa: F401
    import ttr.kernels.norm  # noqa: F401
    from ttr.scripts.bench_utils import kernel_kind, step_breakdown, triton_kernel_kinds

    kinds = triton_kernel_kinds()
    assert kinds["_rms_norm_fwd_kernel"] == "ttr norm" and kinds["_ce_fwd_bwd_kernel"] == "ttr loss"
    assert kinds["state_fwd_kernel"] == "ttr mixer op"
    for name, kind in (("nvjet_tst_192x192_64x3_1x2_h_bz_coopA_TNT", "matmul"),
                       ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
                       ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
                       ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
                        "optimizer"),
                       ("Memcpy DtoD (Device -> Device)", "copies and casts"),
                       ("void at::native::vectorized_elementwise_kernel<4, silu_kernel>", "PyTorch elementwise and "
                        "reductions"),
                       ("_rms_norm_bwd_kernel", "ttr norm")):
        assert kernel_kind(name, kinds) == kind, name
    rows = step_breakdown([("gemm_a", 2, 6.0), ("_rms_norm_fwd_kernel", 4, 1.0), ("gemm_b", 1, 2.0)], 10.0, kinds)
    assert rows == [("matmul", 8.0, 0.8), ("ttr norm", 1.0, 0.1), ("no kernel running", 1.0, 0.1)]


def test_bench_model_profile_on_cpu(tmp_path, capsys):
    """``--profile`` adds each row's profiled step (on a CPU: no CUDA kernels, only the step's time)
    and its table; the trainer loop refuses it by name."""
    out = tmp_path / "m.json"
    assert bench_model.main(["--device", "cpu", "--presets", "gla-debug", "--no-references", "--batch", "1",
                             "--seq-len", "16", "--steps", "1", "--warmup", "0", "--profile",
                             "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    prof = row["profile"]
    assert prof["step_ms"] > 0 and prof["kinds"][-1][0] == "no kernel running"
    # the step's products by shape: the LM head's [tokens, hidden] x [hidden, vocab] among them
    # (gla-debug: hidden 64, vocab 8192)
    heads = [r for r in prof["products"] if r["op"] == "mm" and (r["m"], r["k"], r["n"]) == (16, 64, 8192)]
    assert heads and heads[0]["calls"] >= 1 and heads[0]["tflops"] > 0
    assert all(r["ms"] > 0 and r["op"] in ("mm", "addmm", "addmm_") for r in prof["products"])
    out = capsys.readouterr().out
    assert "gla-debug, ttr TTRForCausalLM: one profiled step" in out
    assert "Its matrix products by shape" in out
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--device", "cpu", "--profile", "--loop", "trainer"])
    assert "--profile: profiles the plain loop only" in capsys.readouterr().err
