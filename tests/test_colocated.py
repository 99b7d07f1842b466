"""Colocated mode (trainer/colocated.py): every rank generates, then trains, on real gloo ranks
with a tiny random policy; the references are a one-rank run of the same seeds and split mode's
rules."""
import json
import os
import re
import threading

import pytest

from tests.dist import run_ranks
from tests.rl_model import make_rl_model

QUICK = ["--parallel.mode=colocated", "--trainer.prompts_per_step=2", "--generator.n_samples=2",
         "--generator.num_slots=4", "--generator.max_new_tokens=4", "--logging.tensorboard=false",
         "--logging.progress=false", "--reward.fn=tests.rl_model:length_reward",
         "--algo.kl_coef=0", "--eval.every_steps=0", "--parallel.warmup_timeout_s=120",
         "--generator.pack_weights=off"]


def _run(rank, world, folder, run_dir, args, slow_export_s=0.0):
    """run_colocated on this rank; each parameter of both models in full. `slow_export_s`: rank 0
    writes each Hugging Face file that much later (a large model's write)."""
    import torch
    from config import load_config
    from launch.preflight import preflight
    from parallel import checkpoint as C
    from parallel import mesh as M
    from parallel.dims import ParallelDims
    from trainer import colocated
    seen = {}
    if slow_export_s and rank == 0:
        save_file = C.save_file
        C.save_file = lambda *a, **k: threading.Event().wait(slow_export_s) or save_file(*a, **k)
    real_run = colocated.ColocatedWorker.run

    def run(worker, evaluator=None):  # keeps the worker, for its models
        seen["w"] = worker
        real_run(worker, evaluator)
    colocated.ColocatedWorker.run = run
    cfg = load_config(None, [*QUICK, f"--model.path={folder}", f"--run.dir={run_dir}", *args])
    cfg = cfg.resolve(world)
    dims = ParallelDims.from_config(cfg.parallel, world)
    colocated.run_colocated(cfg, M.build_meshes(dims, torch.device("cpu")), preflight(cfg, dims))
    full = {}
    for side, model in (("t", seen["w"].t_model), ("g", seen["w"].g_model)):
        for name, p in model.named_parameters():
            full[f"{side}/{name}"] = C._full_tensor(p.detach()).clone()
    return full


@pytest.mark.slow
def test_a_final_export_longer_than_the_step_timeout_completes(tmp_path):
    """Rank 0 writes the final export while rank 1 waits in its barrier: a write of 4 s, longer
    than the trainer mesh's 2 x parallel.timeout_s = 2 s, failed the finished run ("Timed out
    waiting 2000ms for recv operation"); it has the start-up budget now. One step, which is also
    the last: no step runs under the short timeout."""
    folder = make_rl_model(tmp_path / "m")
    run_dir = tmp_path / "run"
    run_ranks(_run, 2, folder, str(run_dir), ["--trainer.max_steps=1", "--parallel.timeout_s=1"],
              4.0, timeout=300)
    assert (run_dir / "COMPLETE").is_file()
    assert {"config.json", "model.safetensors"} <= set(os.listdir(run_dir / "hf_final"))
    assert not (run_dir / "hf_final.tmp").exists()


_calls = [0]


def stuck_from_step_2(item, completion_text, completion_ids) -> float:
    """A reward (`tests.test_colocated:stuck_from_step_2`) that hangs on rank 1 from its third
    completion on: rank 1's replica scores 2 a step, so step 2's rewards never come."""
    _calls[0] += 1
    if os.environ.get("RANK") == "1" and _calls[0] > 2:
        threading.Event().wait(120)  # the stuck reward; the test ends this process first
    return len(completion_ids) / 8.0


@pytest.mark.slow
def test_a_timed_out_exchange_names_the_step_and_the_late_rank(tmp_path):
    """Rank 1 is still scoring step 2 when rank 0 gives up waiting in the step's exchange: the
    error names the step, the rank it waited for and what that rank was doing, and the setting
    to raise. It was gloo's bare "Timed out waiting 3000ms for send operation to complete"."""
    folder = make_rl_model(tmp_path / "m")
    args = ["--trainer.max_steps=3", "--parallel.timeout_s=3", "--reward.timeout_s=100",
            "--reward.fn=tests.test_colocated:stuck_from_step_2"]
    with pytest.raises(Exception) as e:
        run_ranks(_run, 2, folder, str(tmp_path / "run"), args, timeout=300)
    want = (r"TimeoutError: colocated step 2: rank 0 waited \d+s for every rank's prompt groups "
            r"\(the step's exchange, an all-gather over the world\) and gave up; ranks not there: "
            r"rank 1: generating step 2 \(the rollout, then its rewards\)\. .*"
            r"must each finish within parallel\.timeout_s=3")
    assert re.search(want, str(e.value)), str(e.value)[-3000:]


@pytest.mark.slow
def test_two_ranks_train_as_one_and_generate_with_the_trainers_weights(tmp_path, monkeypatch):
    """Trainer FSDP over 2 ranks, generator TP over the same 2 (other boxes of every matrix):
    the same samples and, to fp32 rounding, the same weights as one rank of the same seeds; the
    generator's weights equal the trainer's exactly after the last reshard. Only the TP leader
    scores (the follower scored every completion again, for nothing)."""
    import torch
    folder = make_rl_model(tmp_path / "m")
    args = ["--trainer.max_steps=3", "--trainer.lr=1e-2", "--trainer.warmup_steps=0",
            "--trainer.prompts_per_step=4", "--generator.n_samples=4"]
    one = run_ranks(_run, 1, folder, str(tmp_path / "one"), args, timeout=300)[0]
    monkeypatch.setenv("TANDEM_TEST_REWARD_CALLS", str(tmp_path))
    two = run_ranks(_run, 2, folder, str(tmp_path / "two"),
                    [*args, "--parallel.gen_tp=2", "--reward.fn=tests.rl_model:counted_length_reward"],
                    timeout=300)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["0"]
    rows = [[json.loads(r) for r in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("one", "two")]
    assert len(rows[0]) == 3
    for a, b in zip(*rows):  # the same prompts, and samples of the same lengths (the reward)
        assert (a["prompt_ids"], a["reward_mean"]) == (b["prompt_ids"], b["reward_mean"])
    for r in rows[0] + rows[1]:  # split mode's split of the step: the batch (generated), training
        assert 0 < r["time_wait_batch_s"] and 0 < r["time_train_s"], r
        assert r["time_wait_batch_s"] + r["time_train_s"] <= r["time_step_s"], r
    params = [k[2:] for k in one if k.startswith("t/")]
    for rank in two:
        for name in params:
            assert torch.equal(rank["t/" + name], rank["g/" + name]), name
            torch.testing.assert_close(rank["t/" + name], one["t/" + name], rtol=0, atol=5e-5)
    assert max((one["t/" + n] - one["g/" + n]).abs().max() for n in params) == 0
