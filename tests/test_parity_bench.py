"""The parity benchmark's CPU-checkable parts: arguments, the swap table, the report."""

from __future__ import annotations

import json

import pytest
import torch

from ttr.scripts import bench_parity, parity_report


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--families", "rwkv"], "--families"),
        (["--impls", "ttr,mine"], "--impls"),
        (["--op-errors", "1000"], "--op-errors must be in"),
        (["--op-errors", "-1"], "--op-errors must be in"),
        (["--op-errors", "10", "--families", "mamba2"], "--op-errors measures the fla families"),
        (["--impls", "swap_l2", "--families", "gla"], "--impls swap_l2 runs the delta rules"),
    ],
)
def test_arguments_are_checked_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_parity.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", sorted(bench_parity.FLA_OPS))
def test_swap_table_names_the_op_each_layer_calls(family, monkeypatch):
    """Each entry is the name the ttr layer module calls its op by and fla's op of that name, so the
    swap run and the op-error probe replace exactly the op that trains."""
    pytest.importorskip("fla")
    module, name, ttr_op, fla_op = bench_parity.layer_op(family)
    assert ttr_op.__module__.startswith("ttr.kernels.") and getattr(fla_op, "func", fla_op).__module__.startswith("fla.")
    # called with the arguments fla's own layer adds (GLA's keeps its state as [V, K])
    assert getattr(fla_op, "keywords", {}) == ({"state_v_first": True} if family == "gla" else {})
    config = bench_parity.ttr_config(family, "340m", 8192)
    monkeypatch.setattr(module, name, ttr_op)  # restored after the test
    bench_parity.swap_in_reference_kernels(config)
    swapped = getattr(module, name)
    assert getattr(swapped, "func", swapped) is getattr(fla_op, "func", fla_op)
    assert getattr(swapped, "keywords", {}) == getattr(fla_op, "keywords", {})


@pytest.mark.parametrize("family", bench_parity.L2_IN_KERNEL)
def test_swap_l2_moves_the_qk_norm_into_flas_op(family, monkeypatch):
    pytest.importorskip("fla")
    import inspect

    module, name, ttr_op, fla_op = bench_parity.layer_op(family)
    assert "use_qk_l2norm_in_kernel" in inspect.signature(fla_op).parameters
    monkeypatch.setattr(module, name, ttr_op)
    mixer = bench_parity.mixer_class(module)
    monkeypatch.setattr(mixer, "qk_l2_norm", True)  # restored after the test
    bench_parity.swap_in_reference_kernels(bench_parity.ttr_config(family, "340m", 8192), l2_in_kernel=True)
    swapped = getattr(module, name)
    assert swapped.func is fla_op and swapped.keywords == {"use_qk_l2norm_in_kernel": True}
    assert mixer.qk_l2_norm is False
    with pytest.raises(ValueError, match="gla"):
        bench_parity.swap_in_reference_kernels(bench_parity.ttr_config("gla", "340m", 8192), l2_in_kernel=True)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    args = type("A", (), dict(lr=1e-3, min_lr=1e-4, warmup=30, steps=1000))()
    assert bench_parity.lr_at(0, args) == pytest.approx(1e-3 / 30)
    assert bench_parity.lr_at(29, args) == pytest.approx(1e-3)
    assert bench_parity.lr_at(999, args) == pytest.approx(1e-4, rel=1e-3)


def test_report_compares_at_the_last_common_step_and_tables_the_op_errors(tmp_path):
    def run(impl, vals):
        return {"family": "gla", "impl": impl, "size": "340m", "reference": "fla 0.6.0 GLAForCausalLM",
                "partial": {"losses": [1.0], "val": vals}}

    (tmp_path / "gla.ttr.json").write_text(json.dumps(run("ttr", [[100, 5.0], [200, 4.04], [300, 3.9]])))
    (tmp_path / "gla.reference.json").write_text(json.dumps(run("reference", [[100, 5.1], [200, 4.0]])))
    err = lambda e: {"rel_err": e, "projection": 1.0}  # noqa: E731
    probe = {"family": "gla", "steps_trained": 100, "outputs": ["o", "dk"],
             "rows": [{"call": 0, "ttr": {"o": err(1.8e-3), "dk": err(1.9e-3)},
                       "reference": {"o": err(1.7e-3), "dk": err(2.0e-3)}}]}
    (tmp_path / "gla.operrors.json").write_text(json.dumps(probe))
    (tmp_path / "delta_net.operrors.json").write_text(json.dumps({"family": "delta_net", "rows": []}))
    table = parity_report.report([str(tmp_path)], None)
    assert "| gla | fla 0.6.0 GLAForCausalLM | 4.0400 | 4.0000 | 1.0100 at step 200 (meets <= 1.01) |  |  |" in table
    # the op-error probe is a table of its own, not a run; an empty one is left out
    assert "gla: the chunkwise op on the inputs of ttr's model trained 100 steps" in table
    assert "| layer call | o | dk |" in table and "| 0 | 1.8e-03 / 1.7e-03 | 1.9e-03 / 2.0e-03 |" in table
    assert "delta_net:" not in table


def test_op_errors_runs_its_steps_on_cpu(monkeypatch):
    """The op-error probe's plumbing (train, capture the op's inputs and upstream gradient, rerun
    the ops, compare with float64) on the CPU: a debug model, ttr's op standing in for fla's."""
    import numpy as np
    import torch

    from ttr.models.layers import delta_net as module
    from ttr.models.presets import get_preset

    ttr_op = module.chunk_delta_rule
    monkeypatch.setattr(bench_parity, "layer_op", lambda family: (module, "chunk_delta_rule", ttr_op, ttr_op))
    monkeypatch.setattr(bench_parity, "ttr_config", lambda family, size, vocab: get_preset("delta_net-debug",
                                                                                            vocab_size=vocab))
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device_type, **k: autocast("cpu", **k))
    args = type("A", (), dict(size="debug", seed=0, op_errors=2, lr=1e-3, min_lr=1e-4, warmup=1, steps=10,
                              weight_decay=0.1, clip=1.0))()
    tokens = np.random.default_rng(0).integers(0, 256, size=(3, 1, 64))
    layers = get_preset("delta_net-debug", vocab_size=256).num_hidden_layers
    result = bench_parity.op_errors("delta_net", args, tokens, 256, n_layers=2)
    assert result["outputs"] == ["o", "dq", "dk", "dv", "dbeta"]
    assert [row["call"] for row in result["rows"]] == [0, layers - 1]  # the first and the last layer
    for row in result["rows"]:
        for impl in ("ttr", "reference"):
            for out in result["outputs"]:
                err = row[impl][out]
                assert 0 <= err["rel_err"] < 2e-2 and abs(err["projection"] - 1) < 2e-2


def test_report_lists_the_other_runs_against_the_reference(tmp_path):
    def run(impl, vals, label=None, seed=None):
        out = {"family": "delta_net", "impl": impl, "size": "340m", "reference": "fla 0.6.0 DeltaNetForCausalLM",
               "partial": {"losses": [1.0], "val": vals}}
        return dict(out, **({"label": label} if label else {}), **({"init_seed": seed} if seed is not None else {}))

    (tmp_path / "a.json").write_text(json.dumps(run("ttr", [[100, 4.2], [200, 3.6]])))
    (tmp_path / "b.json").write_text(json.dumps(run("reference", [[100, 4.0], [200, 3.5]])))
    (tmp_path / "c.json").write_text(json.dumps(run("ttr_refinit", [[100, 4.04]])))
    table = parity_report.report([str(tmp_path)], None)
    assert ("| delta_net | fla 0.6.0 DeltaNetForCausalLM | 3.6000 | 3.5000 | 1.0286 at step 200 (**misses** <= 1.01) | "
            "1.0100 | 1.0100 at step 100 (meets <= 1.01; 1 pair) |") in table
    assert "| delta_net | ttr_refinit | 4.0400 | 100 | 1.0100 |" in table
    # a second draw of ttr's weights: the ratio compares the means of the draws, with a standard error
    (tmp_path / "d.json").write_text(json.dumps(run("ttr", [[100, 4.1], [200, 3.466]], label="ttr.init1", seed=1)))
    table = parity_report.report([str(tmp_path)], None)
    assert ("| delta_net | fla 0.6.0 DeltaNetForCausalLM | 3.5330 (mean of 2 draws: 3.6000, 3.4660) | 3.5000 | "
            "1.0094 ± 0.0191 at step 200 (meets <= 1.01) |") in table
    assert "| delta_net | ttr.init1 | 3.4660 | 200 | 0.9903 |" in table
    # a repeat of the reference's draw (named by its file) is one sample of that draw, not a second
    # draw; the reference from ttr's second draw pairs with ttr's run of it
    (tmp_path / "delta_net.reference.repeat1.json").write_text(json.dumps(run("reference", [[100, 4.0], [200, 3.3]])))
    (tmp_path / "e.json").write_text(json.dumps(run("reference_ttrinit", [[100, 4.0], [200, 3.4]], "x", seed=1)))
    table = parity_report.report([str(tmp_path)], None)
    assert "| 3.4000 (mean of 1 draw: 3.4000 (2 runs)) | 1.0391 ± 0.0197 at step 200" in table
    assert "| 1.0100, 1.0250 | 1.0175 ± 0.0075 at step 100 (**misses** <= 1.01; 2 pairs) |" in table
    assert "| delta_net | reference.repeat1 | 3.3000 | 200 | 0.9706 |" in table


def test_init_seed_names_the_run_and_leaves_the_data(tmp_path, monkeypatch):
    """A draw of the weights (--init-seed) trains on the very batches of the default run: the data
    cache's key is --seed's, so a second draw reads the first run's encoding; another --seed does not."""
    import numpy as np

    args = type("A", (), dict(seed=0, init_seed=None, steps=2, batch=1, seq_len=4, val_batches=1,
                              data_cache=str(tmp_path / "data.npz")))()
    assert (bench_parity.init_seed(args), bench_parity.run_label("ttr", args)) == (0, "ttr")
    encoded = []

    def encode(a, tokenizer):
        encoded.append(a.seed)
        return np.full((2, 1, 4), a.seed), np.zeros((1, 1, 4))

    monkeypatch.setattr(bench_parity, "_encode_data", encode)
    tokenizer = type("T", (), dict(vocab_size=8))()
    first, _ = bench_parity.build_data(args, tokenizer)
    args.init_seed = 3
    assert (bench_parity.init_seed(args), bench_parity.run_label("ttr", args)) == (3, "ttr.init3")
    again, _ = bench_parity.build_data(args, tokenizer)
    assert encoded == [0] and np.array_equal(first, again)
    args.seed = 1
    bench_parity.build_data(args, tokenizer)
    assert encoded == [0, 1]


def test_ttr_from_reference_starts_from_the_references_weights():
    """``--impls ttr_refinit``: ttr's model built from the reference's initial weights gives the
    reference's logits (HF Llama at a debug shape, fp32 on the CPU)."""
    import torch

    from ttr.models.presets import get_preset

    config = get_preset("transformer-debug", vocab_size=128)
    mine, ref = bench_parity.ttr_from_reference(config, seed=5, device="cpu")
    again, _ = bench_parity.ttr_from_reference(config, seed=5, device="cpu")
    other, _ = bench_parity.ttr_from_reference(config, seed=6, device="cpu")
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        logits = ref(ids).logits
        assert (mine(ids).logits - logits).abs().max() < 1e-4
        assert torch.equal(mine(ids).logits, again(ids).logits)
        assert (other(ids).logits - logits).abs().max() > 1e-3


def test_reference_from_ttr_holds_ttrs_draw():
    """``--impls reference_ttrinit``: the reference holding ttr's initial weights gives ttr's logits
    (HF Llama and HF Mamba2 at debug shapes, fp32 on the CPU), and every weight maps back unchanged."""
    import torch
    from transformers import AutoModelForCausalLM

    from ttr.models.convert import convert_state_dict
    from ttr.models.presets import get_preset

    for name in ("transformer-debug", "mamba2-debug"):
        config = get_preset(name, vocab_size=128)
        ref = bench_parity.reference_from_ttr(config, seed=7, device="cpu")
        torch.manual_seed(7)
        mine = AutoModelForCausalLM.from_config(config)
        back = convert_state_dict(ref.config.model_type, ref.state_dict())
        assert all(torch.equal(back[k].reshape(v.shape), v) for k, v in mine.state_dict().items())
        ids = torch.randint(0, 128, (2, 24))
        with torch.no_grad():
            assert (mine(ids).logits - ref(ids).logits).abs().max() < 1e-4, name


def test_grad_check_separates_errors_from_bf16_rounding():
    """On the same weights HF Llama and ttr's transformer agree in fp32 to float rounding; the bf16
    rows are reported against ttr's fp32 gradients, each side's own."""
    config = bench_parity.ttr_config("transformer", "debug", 512)
    batch = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    check = bench_parity.grad_check(config, batch, device="cpu")
    assert abs(check["loss_reference"] - check["loss_ttr"]) < 2e-2
    assert check["reference_fp32_vs_ttr_fp32"] < 1e-4
    for key in ("reference_bf16_vs_ttr_fp32", "ttr_bf16_vs_ttr_fp32", "grad_rel_err_all"):
        assert 0 < check[key] < 0.1, key
    assert check["grad_rel_err_max"] >= check["grad_rel_err_all"] and check["grad_worst"].startswith("model.")
