"""task=language_model, with numbers: a byte-level GPT trains on a local text file (loss falls, every held-out
token counted once), and under FSDP2 reads nanoGPT's uint16 token files, resumes on another world size with every
training block seen exactly once, and exports one plain .pt file. Its bitwise resume after kill -9 (GPT, AdamW)
is test_streamed_data.py's, on a streamed corpus; the map-style sampler's, the image task's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_project_tests_pass,
    flags,
    metric_rows,
    readme_block,
    run,
    run_job,
)

# torchrun jobs: `make test-fast` leaves these out. One xdist worker runs them all, so that the module's
# reference run is made once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("language_model")]

BLOCK = 32
TRAIN_BLOCKS, HELD_OUT_BLOCKS = 128, 20
# 2 ranks x 4 blocks: 16 steps an epoch.
TINY_LM = dict(block_size=BLOCK, n_layer=2, n_head=2, n_embd=32, device="cpu", num_workers=0, lr=1e-2,
               warmup_steps=2, log_every=4, ckpt_every=4, keep_checkpoints=100)


def corpus(blocks: int, seed: int) -> bytes:
    """Text a byte-level model learns quickly: numbered lines of a few words."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    generator = np.random.default_rng(seed)
    lines = "".join(f"{index} {words[generator.integers(5)]} {words[generator.integers(5)]}.\n"
                    for index in range(blocks * BLOCK))
    return lines.encode()[:blocks * BLOCK + 1]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("text")
    (folder / "train.txt").write_bytes(corpus(TRAIN_BLOCKS, seed=0))
    (folder / "val.txt").write_bytes(corpus(HELD_OUT_BLOCKS, seed=1))
    return folder


@pytest.fixture(scope="module")
def lm_project(bake) -> Path:
    return bake(task="language_model", project_name="LM Training")


def launch(project: Path, nproc: int, **options: object) -> subprocess.CompletedProcess:
    result = run_job(project, flags(**TINY_LM, **options), nproc=nproc)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def uninterrupted(lm_project, text_dir, tmp_path_factory) -> tuple[Path, str]:
    ckpt_dir = tmp_path_factory.mktemp("lm-uninterrupted")
    # Evaluated every 6 steps, as a corpus of one long epoch is (nanoGPT's eval_interval), and the best kept.
    result = launch(lm_project, 2, data="text", data_dir=text_dir, batch_size=4, max_steps=16, ckpt_dir=ckpt_dir,
                    eval_every_steps=6, keep_best="loss:min", log_dir=ckpt_dir / "logs", sample_every=8)
    return ckpt_dir, result.stderr


def test_language_model_trains_on_a_text_file(uninterrupted):
    ckpt_dir, output = uninterrupted
    # Steps 6 and 12 close intervals and are judged; step 16, the run's end in mid-interval, is logged only: its
    # loss is the lowest, but --keep-best keeps step 12's.
    evaluations = re.findall(r"step (\d+) \| epoch \d \| eval loss ([\d.]+) .* tokens \(closing (.*)\)", output)
    assert [(int(step), closes) for step, _, closes in evaluations] == [
        (6, "an interval"), (12, "an interval"), (16, "the run")], output
    assert float(evaluations[2][1]) < float(evaluations[1][1]) < float(evaluations[0][1]), evaluations
    assert json.loads((ckpt_dir / "best.json").read_text())["step"] == 12
    assert [(row["step"], row["closes"]) for row in metric_rows(ckpt_dir / "logs") if row["kind"] == "eval"] == [
        (6, "interval"), (12, "interval"), (16, "run")]
    losses = {int(step): float(loss) for step, loss in re.findall(r"step (\d+) \| epoch \d+ \| loss ([\d.]+)", output)}
    assert sorted(losses) == [4, 8, 12, 16], output
    assert losses[16] < 0.7 * losses[4], losses  # from ln(256) = 5.5 towards the corpus's entropy
    assert re.search(r"\d+\.\d tokens/s", output), output
    # The whole held-out split, every token once, however the 2 ranks split it.
    evaluation = re.search(r"step 16 \| epoch \d \| eval loss ([\d.]+) \| perplexity ([\d.]+) on (\d+) held-out tokens",
                           output)
    assert evaluation, output
    assert int(evaluation[3]) == HELD_OUT_BLOCKS * BLOCK
    assert float(evaluation[2]) == pytest.approx(np.exp(float(evaluation[1])), rel=1e-3)


# Greedy text (temperature 0) from a model drawn with its key-value cache and without, in one process.
CACHED_AND_NOT = """
import torch
from lm_training.sample import generate
from lm_training.task import GPT
torch.manual_seed(0)
model = GPT(256, 16, 2, 2, 32, 0.0)
prompt = list(b"1 alpha")
print(generate(model, prompt, 40, temperature=0) == generate(model, prompt, 40, temperature=0, cache=False))
"""


def test_text_from_a_checkpoint_is_the_same_from_ddp_and_fsdp2_and_with_or_without_the_cache(
        lm_project, text_dir, uninterrupted, tmp_path):
    ckpt_dir, _ = uninterrupted
    # Rank 0's text every --sample-every 8 steps, beside the run's logs.
    written = (ckpt_dir / "logs" / "samples.txt").read_text()
    assert re.findall(r"^--- step (\d+)$", written, re.M) == ["8", "16"], written
    # The same run under FSDP2 (on 2 CPU ranks its gradients add up as DDP's): its step-16/ folder of shards
    # gives the text the DDP file gives, for the same seed.
    launch(lm_project, 2, data="text", data_dir=text_dir, batch_size=4, max_steps=16, ckpt_dir=tmp_path / "fsdp2",
           strategy="fsdp2")

    def sample(checkpoint: Path, *more: str) -> subprocess.CompletedProcess:
        return run(["python", "-m", "lm_training.sample", str(checkpoint), "--prompt", "1 ", "--max-new-tokens", "48",
                    "--temperature", "0.8", "--top-k", "20", "--seed", "3", *more], cwd=lm_project)
    from_ddp, from_fsdp2 = sample(ckpt_dir), sample(tmp_path / "fsdp2" / "step-16")
    assert from_ddp.returncode == 0 and from_fsdp2.returncode == 0, from_ddp.stderr + from_fsdp2.stderr
    assert from_ddp.stdout == from_fsdp2.stdout and from_ddp.stdout.startswith("1 "), (from_ddp.stdout,
                                                                                        from_fsdp2.stdout)
    assert f"({ckpt_dir / 'step-16.pt'}, step 16: 48 tokens after a prompt of 2)" in from_ddp.stderr
    alphabet = set(corpus(TRAIN_BLOCKS, seed=0).decode())  # the trained model's 20 likeliest bytes are the corpus's
    assert set(from_ddp.stdout) <= alphabet, from_ddp.stdout  # (an untrained one's would be any of 256)
    assert sample(ckpt_dir, "--seed", "4").stdout != from_ddp.stdout
    cached = run(["python", "-c", CACHED_AND_NOT], cwd=lm_project)
    assert cached.returncode == 0 and cached.stdout.strip() == "True", cached.stderr
    # A checkpoint that is not there, or not readable: one line each.
    missing = sample(tmp_path / "nothing")
    assert missing.returncode == 1 and missing.stderr.strip() == (
        f"error: {tmp_path / 'nothing'} does not exist; pass a --ckpt-dir, step-<N>.pt or step-<N>/"), missing.stderr
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "step-4.pt").write_bytes(b"not a checkpoint")
    broken = sample(tmp_path / "broken" / "step-4.pt")
    assert broken.returncode == 1 and len(broken.stderr.strip().splitlines()) == 1, broken.stderr
    assert broken.stderr.startswith(f"error: {tmp_path / 'broken' / 'step-4.pt'} cannot be read ("), broken.stderr


def test_a_corpus_tokenized_by_its_own_bpe_trains_as_token_files_and_as_text(lm_project, text_dir, tmp_path):
    """prepare.py: a byte-level BPE trained on the corpus (no download), its ids written once as nanoGPT's uint16
    files; the model's vocabulary is the tokenizer's, and --data text reads with it too."""
    from tokenizers import Tokenizer

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for name in ("train.txt", "val.txt"):
        (corpus_dir / name).write_bytes((text_dir / name).read_bytes())
    prepared = run(["python", "-m", "lm_training.prepare", str(corpus_dir), "--vocab-size", "320"], cwd=lm_project)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    tokenizer = Tokenizer.from_file(str(corpus_dir / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 320 and tokenizer.token_to_id("<|endoftext|>") is not None
    ids = np.fromfile(corpus_dir / "train.bin", dtype=np.uint16)
    assert tokenizer.decode(ids.tolist()) == (text_dir / "train.txt").read_text()  # every byte, once
    assert len(ids) < 0.6 * len((text_dir / "train.txt").read_bytes())  # merges: fewer tokens than bytes
    assert f"wrote {len(ids):,} and " in prepared.stdout and "--tokenizer" in prepared.stdout, prepared.stdout
    tokenized = dict(data_dir=corpus_dir, tokenizer=corpus_dir / "tokenizer.json", batch_size=4, max_steps=4)
    launch(lm_project, 2, data="tokens", ckpt_dir=tmp_path / "tokens", **tokenized)
    assert torch.load(tmp_path / "tokens" / "step-4.pt", weights_only=True)["model"][
        "token_embedding.weight"].shape == (320, 32)
    as_text = launch(lm_project, 2, data="text", ckpt_dir=tmp_path / "text", **tokenized)
    held_out = len(tokenizer.encode((text_dir / "val.txt").read_text()).ids)
    assert f"on {(held_out - 1) // BLOCK * BLOCK} held-out tokens" in as_text.stderr, as_text.stderr[-2000:]
    refused = run(["python", "-m", "lm_training.prepare", str(corpus_dir), "--vocab-size", "100"], cwd=lm_project)
    assert refused.returncode == 1 and refused.stderr.strip() == (
        "error: --vocab-size must be from 257 (the bytes and <|endoftext|>) to 65536 (uint16 ids), got 100")


def test_fsdp2_token_files_resume_on_another_world_size_and_export(bake, text_dir, tmp_path):
    project = bake(task="language_model", strategy="fsdp2", project_name="LM FSDP", use_export="yes")
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    for split, name in (("train", "train.txt"), ("val", "val.txt")):  # nanoGPT's format: uint16 token ids
        np.frombuffer((text_dir / name).read_bytes(), dtype=np.uint8).astype(np.uint16).tofile(tokens / f"{split}.bin")
    data = dict(data="tokens", data_dir=tokens, vocab_size=256, sample_log=tmp_path / "samples",
                ckpt_dir=tmp_path / "ckpt")
    first = launch(project, 2, **data, batch_size=4, max_steps=16, stop_at_step=8)
    assert re.search(r"fsdp2: 3 groups", first.stderr), first.stderr  # one per block (2), and the root
    # Half the epoch on 2 ranks of 4 blocks, the other half on 1 rank of 8: the same 8 blocks a step.
    second = launch(project, 1, **data, batch_size=8, max_steps=16)
    assert f"resuming from {tmp_path / 'ckpt' / 'step-8'}" in second.stderr, second.stderr
    assert "on 640 held-out tokens" in second.stderr, second.stderr
    seen = [int(line) for log in (tmp_path / "samples").glob("rank-*.txt") for line in log.read_text().split()]
    assert sorted(seen) == list(range(TRAIN_BLOCKS)), "every training block exactly once in the epoch"

    exported = tmp_path / "model.pt"
    result = run(["python", "-m", "lm_fsdp.export", str(tmp_path / "ckpt"), str(exported)], cwd=project)
    assert result.returncode == 0, result.stderr
    weights = torch.load(exported, weights_only=True)
    assert weights["token_embedding.weight"].shape == (256, 32)
    assert sum("blocks." in name for name in weights) > 0 and not any(n.startswith("module.") for n in weights)
    # The README's loading lines, run as they are beside the export: the model rebuilt from model.json holds
    # model.safetensors' tensors, which are the .pt's, bit for bit.
    loading = readme_block(project, "python", "# Weights others can load", "docs/export.md")
    reloaded = run(["python", "-c", loading + "\nimport torch\ntorch.save(model.state_dict(), 'reloaded.pt')\n"],
                   cwd=tmp_path, PYTHONPATH=str(project))
    assert reloaded.returncode == 0, reloaded.stderr[-3000:]
    state = torch.load(tmp_path / "reloaded.pt", weights_only=True)
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in weights.items())


def test_language_model_project_is_lint_clean_and_its_smoke_tests_pass(lm_project):
    lint = run(["ruff", "check", "."], cwd=lm_project)
    assert lint.returncode == 0, lint.stdout
    assert_project_tests_pass(lm_project)  # with the language model's smoke_test_args
