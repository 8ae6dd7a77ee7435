"""Experiments as files, and the knobs peers have: a --config file, with the command line winning over it,
reproduces a run bit for bit; the best evaluated checkpoint outlives retention and is what export --best
writes; early stopping ends every rank at one step, also after a kill -9 mid-patience; a profile trace per
rank; activation checkpointing recomputes dropout's masks exactly and resumes bitwise."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import (
    assert_bitwise_equal,
    checkpoint,
    kill_a_worker_and_finish,
    main_in_this_process,
    run,
    run_job,
    start_job,
    tiny_run,
)

# 2 ranks of 8 on 160 fake samples: 10 steps an epoch, each epoch evaluated. The held-out loss falls epoch after
# epoch here, so `loss:max` makes the first evaluation (step 10) the best and every later one no better: with a
# patience of 2, training stops at the third (step 30), well before --epochs. Retention keeps one checkpoint,
# and the best besides.
EXPERIMENT = dict(fake_samples=160, num_workers=0, max_steps=None, epochs=20, log_every=7, keep_checkpoints=1,
                  keep_best="loss:max", early_stop_patience=2, activation_checkpointing="full")


@pytest.mark.slow
def test_a_config_file_reproduces_a_run_whose_best_checkpoint_is_kept_and_which_stops_early(
        full_project, baked_train, tmp_path, capsys):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    printed = main_in_this_process(baked_train, [*tiny_run(**EXPERIMENT, ckpt_dir=uninterrupted), "--print-config"],
                                   capsys)
    assert printed.returncode == 0 and "keep_best: loss:max\n" in printed.stdout, printed
    config = tmp_path / "experiment.yaml"
    config.write_text(printed.stdout)
    resolved = yaml.safe_load(printed.stdout)
    # The file alone, plus a profile of steps 2 and 3 (which changes no number: the bitwise check below).
    result = run_job(full_project, ["--config", str(config), "--profile-steps", "2:2", "--log-dir",
                                       str(tmp_path / "logs")])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "early stop: 2 evaluations without a better loss" in result.stderr, result.stderr[-4000:]
    for rank in (0, 1):
        trace = json.loads((tmp_path / "logs" / "profile" / f"trace-rank-{rank}.json").read_text())
        assert any(event.get("name", "").startswith("ProfilerStep") or event.get("ph") == "X"
                   for event in trace["traceEvents"]), f"rank {rank}: an empty trace"
    assert sorted(path.name for path in uninterrupted.glob("step-*")) == ["step-10.pt", "step-30.pt"]
    assert json.loads((uninterrupted / "best.json").read_text())["step"] == 10
    # What the run recorded is what the flags resolved to, every option (the profile's two flags aside; a config
    # leaves out --resume-changed-state, meant for one resume), and its config.yaml reads back the same.
    recorded = checkpoint(uninterrupted, 30)["options"]
    assert recorded.pop("resume_changed_state") is False
    assert {**recorded, "profile_steps": None, "log_dir": None} == resolved
    assert yaml.safe_load((uninterrupted / "config.yaml").read_text()) == recorded

    # The same file with --ckpt-dir given on the command line, which wins, and a checkpoint every 10 steps: at
    # each epoch's end, before its evaluation. A worker is killed after step 20's, and the resume evaluates step
    # 20 (no better: patience 1 of 2). Step 30's checkpoint is written before its evaluation too, and again after
    # it, to hold the early stop's count.
    job = start_job(full_project, ["--config", str(config), "--ckpt-dir", str(killed), "--ckpt-every", "10"],
                    max_restarts=1)
    output = kill_a_worker_and_finish(job, killed / "step-20.pt")
    assert output.count("early stop: 2 evaluations without a better loss") == 1, output[-4000:]
    assert sorted(path.name for path in killed.glob("step-*")) == ["step-10.pt", "step-30.pt"]
    expected, resumed = checkpoint(uninterrupted, 30), checkpoint(killed, 30)
    for state in (expected, resumed):
        state["options"].pop("ckpt_dir")
        state["options"].pop("ckpt_every")
    assert_bitwise_equal(resumed, expected)
    assert resumed["selection"] == {"metric": "loss", "mode": "max", "best_step": 10, "evaluations_since_best": 2,
                                    "best_value": expected["selection"]["best_value"]}

    exported = run(["python", "-m", "ddp_training.export", "--best", str(killed), str(tmp_path / "best.pt")],
                   cwd=full_project)
    assert exported.returncode == 0 and f"from {killed / 'step-10.pt'}" in exported.stdout, exported.stderr
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    for name, tensor in checkpoint(killed, 10)["model"].items():
        assert torch.equal(best[name], tensor), name


def test_a_config_files_bad_key_or_value_is_one_line(baked_train, tmp_path, capsys):
    for text, expected in [
        ("lrr: 0.1\n", "error: --config {path}: unknown option 'lrr'; did you mean 'lr'?"),
        ("lr: fast\n", "error: --config {path}: argument --lr: invalid float value: 'fast'"),
        ("compile: 1\n", "error: --config {path}: compile must be true or false, got 1"),
        ("- lr\n", "error: --config {path} must map option names to values (lr: 0.0003), not hold a list"),
        ("lr: [0.1\n", "error: --config {path} is not valid YAML: "),
        ("lr:\n", "error: --config {path}: lr needs a value"),
        ("profile_steps: 10:3\n", "error: --config {path}: profile_steps is text; quote it (profile_steps: '603')"),
        ("keep_best: loss:min\neval_every: 0\n", "error: --keep-best judges evaluations, which --eval-every 0"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        result = main_in_this_process(baked_train, [*tiny_run(ckpt_dir=tmp_path), "--config", str(path)], capsys)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 1 and len(errors) == 1, result.stderr
        assert errors[0].startswith(expected.format(path=path)), errors


def test_activation_checkpointing_recomputes_dropout_exactly(baked_module):
    parallel = baked_module("engine.parallel")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.calls = torch.nn.Linear(16, 16), 0

        def forward(self, x):
            self.calls += 1
            return torch.nn.functional.dropout(torch.relu(self.linear(x)), p=0.5, training=self.training)

    def gradients(which: str) -> tuple[list[torch.Tensor], list[int]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Sequential(Block(), Block(), Block(), Block()))
        parallel.checkpoint_activations(model, which)
        model(torch.randn(8, 16)).square().sum().backward()
        return [parameter.grad for parameter in model.parameters()], [block.calls for block in model[0]]

    # A block whose BatchNorm would count its running statistics twice (the recomputation is a forward too).
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(4)

    usage_error = baked_module("engine.errors").UsageError
    with pytest.raises(usage_error, match="block 0.1 holds BatchNorm 0.1.norm, whose running"):
        parallel.checkpoint_activations(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), Normed())),
                                        "full")
    plain, calls = gradients("none")
    assert calls == [1, 1, 1, 1]
    for which, recomputed in (("full", [2, 2, 2, 2]), ("every-2", [1, 2, 1, 2])):
        checkpointed, calls = gradients(which)
        assert calls == recomputed, (which, calls)  # the chosen blocks ran forward again in the backward pass
        for expected, actual in zip(plain, checkpointed, strict=True):
            assert torch.equal(actual, expected), which  # the same dropout masks, the same gradients
