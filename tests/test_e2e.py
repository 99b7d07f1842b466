"""train_rl.py end to end under torchrun on CPU: the metrics contract, TensorBoard, versions on
both meshes, the HF export, on-policy exactness at eta = 0, and a two-node launch on one machine."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.dist import Captured, free_port, run_captured
from tests.rl_model import make_rl_model
from trainer.metrics import CONTRACT_KEYS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--trainer.prompts_per_step=4", "--generator.n_samples=4", "--generator.num_slots=16",
         "--generator.max_new_tokens=6", "--checkpoint.every_steps=0", "--parallel.timeout_s=60",
         "--parallel.warmup_timeout_s=120", "--logging.console_every=1",
         "--reward.fn=tests.rl_model:length_reward", "--trainer.warmup_steps=0",
         "--eval.num_prompts=8"]


def torchrun(args, nproc=3, timeout=240, extra_env=None, torchrun_args=("--standalone",)):
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "--nproc-per-node",
           str(nproc), "train_rl.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return run_captured(cmd, timeout, cwd=ROOT, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    model = make_rl_model(tmp / "model")
    run_dir = tmp / "run"
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                     f"--run.dir={run_dir}", "--trainer.max_steps=4", "--algo.max_staleness=1", *QUICK,
                     "--checkpoint.every_steps=2", "--checkpoint.hf_export_every=2",
                     "--parallel.cpu_shm=false"])  # weights over gloo (eta = 0 below: shared memory)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "generator: weight sync by gloo point-to-point from trainer ranks [0, 1]" in proc.stdout
    return run_dir, model, proc


def test_metrics_have_every_contract_key_and_versions_advance(async_run):
    run_dir, _, proc = async_run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(CONTRACT_KEYS) <= set(r)
        assert r["staleness_max"] <= 1
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]  # trainer mesh
    # generator mesh: the versions it acknowledged applying advance too (async: may lag by eta)
    gen = [r["generator_version"] for r in rows]
    assert gen == sorted(gen) and gen[-1] >= 2
    assert all(g <= r["policy_version"] for g, r in zip(gen, rows))
    assert "step    4" in proc.stdout  # one console line per step, with the run's progress
    assert [ln.split(" | ")[-1].split(" eta ")[0] for ln in proc.stdout.splitlines()
            if ln.startswith("step ") and " | v" in ln] == ["1/4", "2/4", "3/4", "4/4"]
    assert (run_dir / "config.toml").is_file()


def test_async_checkpoint_and_periodic_hf_export(async_run):
    import transformers
    run_dir = async_run[0]
    extra = json.loads((run_dir / "checkpoints" / "step_000002" / "extra.json").read_text())
    assert extra["step"] == 2 and extra["version"] == 2
    gen = extra["generators"]["0"]  # the generator's half of the cut
    assert {"cursor", "started", "inflight"} <= set(gen)
    buffered, inflight = {g["prompt_id"] for g in extra["buffer"]["groups"]}, {pid for pid, _ in gen["inflight"]}
    assert not buffered & inflight  # a group is in the buffer or in flight at the cut, not both
    held = buffered | inflight
    trained = {pid for r in read_metrics(run_dir)[:2] for pid in r["prompt_ids"]}
    assert not held & trained  # buffered / in-flight prompts at the cut were not trained before it
    assert gen["started"] == len(trained) + len(held)  # every started prompt is accounted for
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(run_dir / "hf" / "step_000002"))
    assert hf.config.vocab_size == 17
    out = async_run[2].stdout  # each save and export is reported once, by the owner rank
    assert out.count(f"checkpoint of step 2 saved to {run_dir / 'checkpoints' / 'step_000002'} (") == 1
    assert out.count(f"exported the policy after step 2 to {run_dir / 'hf' / 'step_000002'} (") == 1


def test_held_out_evaluations_of_the_first_and_final_policy(async_run):
    """eval.every_steps (the preset's 100) past max_steps: version 0 and the final version, scored
    on generator rank 2 as they arrive; each equals a single-process greedy run of that policy."""
    from config import load_config
    from model import load_pretrained
    from model.tokenizer import load_tokenizer
    from rollout.evaluate import accuracy
    from rollout.role import load_eval_items
    from tests.rl_model import length_reward
    run_dir, model, proc = async_run
    recs = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompts"]) for r in recs] == [(0, 8), (4, 8)]
    cfg = load_config("configs/tiny_cpu.toml", QUICK)
    for rec, folder in zip(recs, (model, run_dir / "hf_final")):
        tok = load_tokenizer(folder)
        items = load_eval_items(cfg, tok)[0]
        policy = load_pretrained(folder, dtype="float32").eval()
        assert rec["reward_mean"] == pytest.approx(accuracy(policy, tok, items, length_reward, 6))
    assert "eval v0 | greedy reward" in proc.stdout and "eval v4 | greedy reward" in proc.stdout


def test_evaluating_a_model_folder_without_training(tmp_path):
    """The README's recipe (`--trainer.max_steps=0 --eval.every_steps=1`): one evaluation, of
    version 0, and no hf_final copy of the model it read (540 MB for SmolLM2, written before)."""
    from trainer.checkpointing import COMPLETE_FILE
    model = make_rl_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                     f"--run.dir={run_dir}", "--trainer.max_steps=0", "--eval.every_steps=1",
                     *QUICK])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    recs = [json.loads(ln) for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompts"]) for r in recs] == [(0, 8)]
    assert not (run_dir / "hf_final").exists() and not (run_dir / "hf_final.tmp").exists()
    assert proc.stdout.count(f"no step trained: the policy is {model} as it was loaded, so no "
                             "hf_final copy of it is written") == 1
    assert json.loads((run_dir / COMPLETE_FILE).read_text()) == {"steps": 0}


def test_a_finished_run_relaunched_does_nothing(async_run, monkeypatch, capsys):
    """Relaunching the same command (a requeued job) neither replays the last steps from the
    latest checkpoint nor rewrites the metrics or the final export. Every rank decides that alone,
    before any process group: rank 0 of the 3 runs here, in this process."""
    import train_rl
    from parallel import mesh
    run_dir, model, _ = async_run
    before = (run_dir / "metrics.jsonl").read_text(), (run_dir / "hf_final" / "config.json").stat().st_mtime_ns
    monkeypatch.setattr(mesh, "init_process_group", lambda *a, **k: pytest.fail("it started again"))
    for k, v in {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    rc = train_rl.main(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                        f"--run.dir={run_dir}", "--trainer.max_steps=4", "--algo.max_staleness=1",
                        *QUICK, "--checkpoint.every_steps=2", "--checkpoint.hf_export_every=2"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    assert f"run {run_dir} already completed 4 steps" in out.out
    after = (run_dir / "metrics.jsonl").read_text(), (run_dir / "hf_final" / "config.json").stat().st_mtime_ns
    assert after == before


def test_tensorboard_events_read_back(async_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(async_run[0] / "tb"))
    acc.Reload()
    assert {"reward_mean", "loss", "staleness_mean", "tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]


def test_final_hf_export_loads_in_transformers(async_run):
    import transformers
    from model import load_pretrained
    run_dir = async_run[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(run_dir / "hf_final"), dtype=torch.float32)
    ours = load_pretrained(run_dir / "hf_final", dtype="float32")
    ids = torch.tensor([[1, 5, 6, 14, 7, 15]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)
    # the export is the trained policy, not the starting one
    start = load_pretrained(async_run[1], dtype="float32")
    assert not torch.equal(start.model.norm.weight, ours.model.norm.weight)
    assert transformers.AutoTokenizer.from_pretrained(str(run_dir / "hf_final")) is not None


def test_eta_zero_is_on_policy(tmp_path):
    """On-policy to 1e-5: the generator samples with exactly the weights the trainer then scores
    (both FSDP shards, through shared memory, zero copy: the generator applies straight from the
    trainer's shards, parallel.ipc_buffers=0; the async run above sends them over gloo, and its
    held-out evaluations equal single-process runs of the same weights; the other runs stage)."""
    model = make_rl_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                     f"--run.dir={run_dir}", "--trainer.max_steps=3", "--algo.max_staleness=0",
                     "--trainer.lr=1e-2", "--parallel.ipc_buffers=0", *QUICK])
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert ("generator: weight sync by shared memory (parallel.cpu_shm) from trainer ranks [0, 1], "
            "applied straight from their memory") in proc.stdout
    for r in read_metrics(run_dir):
        assert r["staleness_max"] == 0
        assert abs(r["is_ratio_mean"] - 1.0) <= 1e-5, r


def test_two_nodes_on_one_machine(tmp_path):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on loopback) run one job: 4 ranks,
    3 FSDP trainer ranks spanning both 'nodes', 1 generator rank."""
    model = make_rl_model(tmp_path / "model")
    port = free_port()
    args = ["--config", "configs/tiny_cpu.toml", f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
            "--trainer.max_steps=2", "--logging.log_rank=0", *QUICK]
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "twonode"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", "2", "train_rl.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [Captured(cmd, cwd=ROOT, env=env) for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-5000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    stdout = "".join(o for o, _ in outs)
    assert "trainer   mesh (fsdp=3, tp=1): [0..2]" in stdout and "step    2 |" in stdout
    assert "generator:" not in stdout  # rank 3's set-up line: logging.log_rank=0 drops it


def test_a_tp_generator_replica_trains_and_only_its_leader_scores(tmp_path):
    """Split mode with one generator replica of TP 2 (ranks 1-2) through train_rl.py. Both ranks
    decode the same completions, and the leader alone sends them: the follower scored every one
    again with a reward runner of its own (a math reward's worker processes, twice the CPU)."""
    model = make_rl_model(tmp_path / "model")
    calls = tmp_path / "calls"
    calls.mkdir()
    run_dir = tmp_path / "run"
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}", f"--run.dir={run_dir}",
                     "--trainer.max_steps=2", "--parallel.generator_ranks=2", "--parallel.gen_tp=2",
                     "--logging.tensorboard=false", *QUICK,
                     "--reward.fn=tests.rl_model:counted_length_reward"],
                    extra_env={"TANDEM_TEST_REWARD_CALLS": str(calls)})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "generator mesh (dp=1, tp=2): [1, 2]" in proc.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert os.listdir(calls) == ["1"]  # the leader's
    scored = len((calls / "1").read_text().split())
    # every trained sample, and v0's and the final policy's 8 held-out prompts
    assert scored >= 2 * 4 * 4 + 2 * 8, scored
    evals = [json.loads(ln)["step"] for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 2]  # written once each, by the leader


def test_two_nodes_restart_after_a_rank_dies_and_resume(tmp_path):
    """A generator rank of the second 'node' dies after the step-2 checkpoint; with a store per
    rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as launch/tandem.sbatch sets) both
    agents restart their ranks, which resume and finish. The restart count is per agent (the
    other agent does not count a restart for a peer's failure): the link's store keys, prefixed
    by it, then differed between the nodes and no weights message arrived (both sides timed out);
    with the shared store the process group's keys differed too (connectFullMesh refused)."""
    model = make_rl_model(tmp_path / "model")
    port = free_port()
    args = ["--config", "configs/tiny_cpu.toml", f"--model.path={model}", f"--run.dir={tmp_path / 'run'}",
            "--trainer.max_steps=5", "--logging.log_rank=0", *QUICK, "--checkpoint.every_steps=2",
            "--algo.max_staleness=0", "--logging.tensorboard=false"]
    rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "twonode-restart", "--max-restarts", "1", "--monitor-interval", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", "2", "train_rl.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT_KILL": "rank=3,step=3",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = [Captured(cmd, cwd=ROOT, env=env) for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-5000:]
    stdout = "".join(o for o, _ in outs)
    assert "resumed from" in stdout and "step_000002" in stdout, stdout[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_colocated_mode_trains_on_two_ranks(tmp_path):
    """Every rank generates and trains (time-shared, on-policy): versions advance, IS = 1; the
    KL to the starting policy (the default reference) is 0 at the first step and grows after."""
    model = make_rl_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                     f"--run.dir={run_dir}", "--trainer.max_steps=3", "--parallel.mode=colocated",
                     "--trainer.lr=1e-2", "--algo.kl_coef=0.3", "--model.ref_path=", *QUICK,
                     "--checkpoint.hf_export_every=2"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = read_metrics(run_dir)
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(CONTRACT_KEYS) <= set(r) and r["staleness_max"] == 0
        assert abs(r["is_ratio_mean"] - 1.0) <= 1e-5, r  # the reshard is exact
    assert abs(rows[0]["kl"]) <= 1e-7 and rows[-1]["kl"] > 1e-4, [r["kl"] for r in rows]
    assert (run_dir / "hf_final" / "config.json").is_file()
    # the periodic export, as in split mode: the policy after step 2 (not the final one)
    from model import load_pretrained
    step2 = load_pretrained(run_dir / "hf" / "step_000002", dtype="float32")
    final = load_pretrained(run_dir / "hf_final", dtype="float32")
    assert not torch.equal(step2.model.norm.weight, final.model.norm.weight)
    assert not (run_dir / "hf" / "step_000003").exists()
    evals = [json.loads(ln)["step"] for ln in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 3]  # the starting and the final policy, on replica 0
    assert proc.stdout.count("exported the policy after step 2 to") == 1


def test_a_colocated_run_prints_its_reward_failures(tmp_path):
    """Split mode's generators print a line as reward failures grow; colocated ranks printed
    none, and a reward failing on every call showed only as its first traceback and a flat 0."""
    model = make_rl_model(tmp_path / "model")
    proc = torchrun(["--config", "configs/tiny_cpu.toml", f"--model.path={model}",
                     f"--run.dir={tmp_path / 'run'}", "--trainer.max_steps=1",
                     "--parallel.mode=colocated", *QUICK, "--eval.every_steps=0",
                     "--reward.fn=tests.rl_model:raising_reward"], nproc=1)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert ("replica 0: of 16 reward calls so far, 16 raised and 0 ran past reward.timeout_s=5.0 "
            "(scored 0.0)\n") in proc.stdout, proc.stdout[-3000:]
    assert "RuntimeError: the judge is down" in proc.stderr  # the first one's traceback


def test_two_nodes_a_rank_killed_on_one_ends_the_other_naming_it(tmp_path):
    """Node 0: trainer ranks 0-1; node 1: generator ranks 2-3 (two replicas). Rank 3 is killed at
    the end of its start-up (SIGKILL: it says nothing); node 1's agent ends rank 2, which died of
    the SIGTERM at once and silently too (launch/preemption.py). Node 0 learnt nothing: the
    trainer waited for the first groups until parallel.warmup_timeout_s (60 s here; later steps
    parallel.timeout_s) and failed with a time-out that did not name the cause. Rank 2 now
    records it in the job's store as it dies, and node 0's first rank reads it, says so and
    exits, its agent ending the other rank. (Rank 2 evaluates v0 on 2000 held-out prompts
    first, so that it ships no groups before it is ended: a step would end in a weight push to
    dead rank 3, which gloo refuses at once, "Connection closed by peer".)"""
    from tests.dist import two_nodes
    model = make_rl_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    args = ["--config", "configs/tiny_cpu.toml", *QUICK, f"--model.path={model}", f"--run.dir={run_dir}",
            "--trainer.max_steps=4", "--parallel.generator_ranks=2", "--logging.tensorboard=false",
            "--parallel.warmup_timeout_s=60", "--eval.num_prompts=2000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_FAULT_KILL": "rank=3,step=0"}
    errs, agents = two_nodes(args, env, 2, run_dir, timeout=40)  # well before the 60 s
    assert errs is not None, "node 0 did not end within 40 s of node 1's failure"
    assert all(a.returncode not in (0, None) for a in agents), errs
    # named by rank 0's reader of the record, or by its link, where rank 2's exit closed a
    # connection first (the record comes before that exit)
    assert ("the run failed on another node: rank 3 (host " in errs[0] and
            ", node 1) exited, and torchrun ended the other ranks of that node" in errs[0]), errs[0][-3000:]
    assert "TimeoutError" not in errs[0], errs[0][-3000:]
