"""Sharded checkpoints: resume is bitwise exact on real gloo ranks (fsdp=2), the HF export loads in
transformers with the sharded model's logits, and the latest/prune/RNG helpers (no process group)."""
import json
import random

import pytest
import torch
import torch.nn.functional as F

from parallel.checkpoint import (checkpoint_dir, latest_checkpoint, prune_checkpoints, rng_state,
                                 set_rng_state)
from tests import tiny
from tests.dist import run_ranks

BATCH, SEQ = 4, 12
ADAMW = dict(lr=1e-2, weight_decay=0.1)


# ----- latest / prune / RNG: pure, no process group ------------------------------------------
def _make(root, *names, finished=True):
    """Checkpoint-like folders; `finished`: with DCP's .metadata (written last) in each."""
    for n in names:
        (root / n).mkdir(parents=True)
        if finished:
            (root / n / ".metadata").write_text("")


def test_latest_picks_highest_finished_step_never_tmp(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    # a `.old` folder beside its step's own folder is the one being replaced: never taken
    _make(tmp_path, "step_000009", "step_000010", "step_000010.old", "step_000100.tmp", "other")
    (tmp_path / "step_000300").write_text("a file, not a checkpoint")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    _make(tmp_path, "step_1234567")  # past the padding width: ordered by number, not by name
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1234567"
    # a half-copied folder (no .metadata): 'auto' took it and every rank failed to read it
    _make(tmp_path, "step_2000000", finished=False)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1234567"
    assert checkpoint_dir(tmp_path, 123) == tmp_path / "step_000123"


def test_prune_keeps_newest_and_leaves_tmp_alone(tmp_path):
    _make(tmp_path, "step_000002", "step_000010", "step_000003", "step_000011.tmp")
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert removed == [tmp_path / "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000010",
                                                         "step_000011.tmp"]
    assert prune_checkpoints(tmp_path, keep_last=5) == []
    with pytest.raises(ValueError, match="keep_last must be an integer >= 1"):
        prune_checkpoints(tmp_path, keep_last=0)


def test_prune_also_deletes_what_a_cut_off_replace_left_aside(tmp_path):
    """A save of an existing step killed while it deleted the folder it moved aside left
    `step_N.old` beside `step_N`; pruning step N left that copy behind for good."""
    _make(tmp_path, "step_000002", "step_000003", "step_000004")
    _make(tmp_path, "step_000002.old", finished=False)  # half deleted: its .metadata went first
    assert prune_checkpoints(tmp_path, keep_last=2) == [tmp_path / "step_000002"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_a_save_killed_between_its_renames_resumes_from_the_folder_moved_aside(tmp_path, monkeypatch,
                                                                             capsys):
    """Saving a step again moves the old folder to `step_N.old`, then renames `step_N.tmp` to
    `step_N`. Killed in between, no `step_N` was left: 'auto' resumed from an earlier step (or
    from scratch) and pruning kept no copy of step N. The complete `.old` folder stands for the
    step, with a line saying so, until the step is saved again."""
    import pathlib

    from model import ModelArgs, Transformer
    from parallel.checkpoint import complete_checkpoints, load_sharded, save_sharded
    model = Transformer(ModelArgs())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    model(torch.randint(0, 32, (1, 5))).sum().backward()
    opt.step()
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    first_avg = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    _make(tmp_path, "step_000004")
    path = checkpoint_dir(tmp_path, 5)
    save_sharded(path, model, opt, extra={"v": 1})
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    rename = pathlib.Path.rename

    def killed_after_moving_aside(self, target):
        out = rename(self, target)
        if pathlib.Path(target).name.endswith(".old"):
            raise KeyboardInterrupt("killed between the renames")
        return out
    monkeypatch.setattr(pathlib.Path, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(path, model, opt, extra={"v": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000005.old",
                                                         "step_000005.tmp"]
    aside = tmp_path / "step_000005.old"
    assert latest_checkpoint(tmp_path) == aside
    assert prune_checkpoints(tmp_path, keep_last=1) == [tmp_path / "step_000004"]
    fresh = Transformer(ModelArgs())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), **ADAMW)
    capsys.readouterr()
    assert load_sharded(latest_checkpoint(tmp_path), fresh, fresh_opt) == {"v": 1}
    assert "step_000005.old: the save that was replacing it was cut off" in capsys.readouterr().out
    for n, p in fresh.named_parameters():
        assert torch.equal(p, first[n]), n
        assert torch.equal(fresh_opt.state[p]["exp_avg"], first_avg[n]), n
    # the step saved again: its own folder, the copy aside deleted
    save_sharded(path, model, opt, extra={"v": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005"]
    assert complete_checkpoints(tmp_path) == [(5, path)]
    assert load_sharded(path, fresh) == {"v": 2}
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_a_start_below_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """resume=never, or an older checkpoint, in a folder holding an earlier run's later
    checkpoints: pruning deleted the new run's checkpoint (the old ones had higher steps) and a
    later 'auto' resume took the old run's. Refused before any process group; and a resume
    value that names no finished checkpoint ('none') is refused there too."""
    from config import load_config
    from trainer.checkpointing import EXTRA_FILE, check_resume
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / ".metadata").write_text("")
        (root / f"step_{step:06d}" / EXTRA_FILE).write_text(json.dumps({"step": step}))
    cfg = lambda resume: load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}",  # noqa: E731
                                                               f"--checkpoint.resume={resume}"])
    check_resume(cfg("auto"))  # the latest: nothing later
    check_resume(cfg(str(root / "step_000006")))
    with pytest.raises(ValueError, match=r"resume='never' starts this run at step 0, but .* holds "
                                         r"later checkpoints of an earlier run \(step_000006 and 2 "
                                         r"more\).*new --run.dir"):
        check_resume(cfg("never"))
    with pytest.raises(ValueError, match=r"at step 4, .*\(step_000006\)"):
        check_resume(cfg(str(root / "step_000004")))
    with pytest.raises(ValueError, match="checkpoint.resume='none' is not a finished checkpoint"):
        check_resume(cfg("none"))
    empty = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path / 'new'}",
                                                  "--checkpoint.resume=never"])
    check_resume(empty)


def test_a_crash_while_writing_the_complete_marker_or_the_metrics_leaves_the_old_file(
        tmp_path, monkeypatch):
    """COMPLETE and a resume's cut of metrics.jsonl are written to a temporary file, then
    renamed: written in place, a crash between the truncation and the write left an empty
    COMPLETE, on which every relaunch failed (JSONDecodeError), or lost the logged steps."""
    import pathlib

    from config import load_config
    from trainer.checkpointing import (already_complete_line, completed_steps, mark_complete,
                                       truncate_steps)
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={tmp_path}", "--trainer.max_steps=8"])
    metrics = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3))
    metrics.write_text(rows)
    mark_complete(cfg, 4)  # an earlier, shorter run in this folder
    write_text = pathlib.Path.write_text

    def crash(path, text, *args, **kwargs):  # opens (truncates) the file, half writes it, dies
        write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError("killed while writing")
    monkeypatch.setattr(pathlib.Path, "write_text", crash)
    with pytest.raises(OSError, match="killed"):
        mark_complete(cfg, 8)
    with pytest.raises(OSError, match="killed"):
        truncate_steps(metrics, 1)
    monkeypatch.undo()
    assert completed_steps(cfg) == 4 and already_complete_line(cfg) is None  # 4 < 8: train on
    assert metrics.read_text() == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["COMPLETE", "metrics.jsonl"]
    mark_complete(cfg, 8)
    truncate_steps(metrics, 1)
    assert completed_steps(cfg) == 8 and "already completed 8 steps" in already_complete_line(cfg)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1]


def test_rng_state_survives_json():
    torch.manual_seed(3)
    random.seed(4)
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(5), random.random())
    torch.manual_seed(99)
    random.seed(99)
    set_rng_state(state)
    got = (torch.rand(5), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


@pytest.mark.parametrize("role", ["split", "colocated"])
def test_a_trainer_rank_seeds_its_generators_from_trainer_seed(role, monkeypatch):
    """trainer.seed (run.seed added) was read by nothing: its help said it seeded the trainer's
    randomness, and two seeds gave bitwise the same run. A trainer rank now seeds torch and
    `random` from it before it builds its model (a resume then restores the saved states)."""
    import types
    import config
    import trainer.role
    from trainer.colocated import run_colocated

    class Built(Exception):
        pass

    def build(*args):
        drawn.append((torch.rand(3), random.random()))
        raise Built
    monkeypatch.setattr(trainer.role, "build_trainer_model", build)
    meshes = types.SimpleNamespace(dims=None, rank=0)
    drawn = []
    for seed in (5, 5, 6):
        cfg = config.Config()
        cfg.trainer.seed = seed
        torch.manual_seed(1000 + len(drawn))
        with pytest.raises(Built):
            if role == "split":
                trainer.role.start_trainer(cfg, meshes, None, None, None)
            else:
                run_colocated(cfg, meshes, None)
    torch.manual_seed(5)
    random.seed(5)
    assert torch.equal(drawn[0][0], torch.rand(3)) and drawn[0][1] == random.random()
    assert torch.equal(drawn[0][0], drawn[1][0]) and not torch.equal(drawn[0][0], drawn[2][0])


def test_single_process_save_replaces_same_step_and_loads(tmp_path):
    """No process group at all: one rank, plain tensors; saving a step twice replaces it."""
    from model import ModelArgs, Transformer
    from parallel.checkpoint import load_sharded, save_sharded
    model = Transformer(ModelArgs())
    path = checkpoint_dir(tmp_path, 5)
    save_sharded(path, model, extra={"v": 1})
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_sharded(path, model)  # same step again: replaces the folder, extra.json included
    fresh = Transformer(ModelArgs())
    assert load_sharded(path, fresh) == {}
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005"]
    with pytest.raises(ValueError, match="not a finished checkpoint"):
        load_sharded(tmp_path / "step_000006", fresh)


def test_saving_an_optimizer_before_its_first_step_leaves_it_fresh(tmp_path):
    """Every step so far skipped (non-finite): the save gave the live AdamW a zero state of step
    1, so the run's first real update was bias-corrected as its second (27% smaller than without
    the save). Now neither the live optimizer nor a resumed one has a state before its first
    step, and the next update equals the one of a run that never saved."""
    from model import ModelArgs, Transformer
    from parallel.checkpoint import load_sharded, save_sharded

    def update(model, opt):
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
        return [p.detach() - b for p, b in zip(model.parameters(), before)]

    def fresh():
        model = Transformer(ModelArgs())
        model.init_weights(seed=0)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fresh()
    want = update(*fresh())
    path = save_sharded(checkpoint_dir(tmp_path, 1), model, opt)
    assert not opt.state
    assert all(torch.allclose(a, b) for a, b in zip(update(model, opt), want))
    resumed, opt2 = fresh()
    load_sharded(path, resumed, opt2)
    assert not opt2.state
    assert all(torch.allclose(a, b) for a, b in zip(update(resumed, opt2), want))
    # a checkpoint after a step holds the optimizer's state, and loads it
    path = save_sharded(checkpoint_dir(tmp_path, 2), model, opt)
    again, opt3 = fresh()
    load_sharded(path, again, opt3)
    assert torch.equal(opt3.state[next(iter(again.parameters()))]["step"],
                       opt.state[next(iter(model.parameters()))]["step"])


# ----- resume and export on 2 gloo ranks (fsdp=2) ---------------------------------------------
def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, tiny.VOCAB, (BATCH, SEQ), generator=g) for _ in range(2)]


def _full_params(model):
    from torch.distributed.tensor import DTensor
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _worker(rank, world, hf_dir, root, export_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from model.hf_io import load_model_args
    from parallel.checkpoint import export_hf, load_sharded, save_sharded
    from parallel.sharding import build_model, parallelize_trainer

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    group = mesh["fsdp"].get_group()  # spans every trainer rank here (tp=1)
    args = load_model_args(hf_dir)

    def build(path, seed=0):
        model = build_model(args, torch.device("cpu"), torch.float32, path=path, seed=seed,
                            parallelize=lambda m: parallelize_trainer(m, mesh))
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)

    def step(model, opt, ids_BT):
        rows = ids_BT.chunk(world)[rank]  # data parallel over fsdp
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        (loss / ids_BT[:, 1:].numel()).backward()  # global token count: FSDP sums gradients
        opt.step()
        opt.zero_grad()

    batch1, batch2 = _batches()
    model, opt = build(hf_dir)
    step(model, opt, batch1)
    extra = {"version": 1, "cursor": [3, 4], "buffer": [{"tokens": [1, 2], "reward": 0.5}]}
    save_sharded(checkpoint_dir(root, 1), model, opt, extra=extra, group=group)
    after_save = _full_params(model)
    step(model, opt, batch2)
    continued = _full_params(model)

    # A fresh model with *different* weights (random init) and an optimizer without state.
    model2, opt2 = build(None, seed=7)
    loaded_extra = load_sharded(latest_checkpoint(root), model2, opt2, group=group)
    loaded = _full_params(model2)
    step(model2, opt2, batch2)
    resumed = _full_params(model2)
    with torch.no_grad():
        logits = model2(batch1)
    export_hf(model2, export_dir, group=group)
    export_hf(model2, export_dir + "_sharded", group=group, max_shard_bytes=20_000)  # + index
    saved = {"saved." + n: t for n, t in after_save.items()} if rank == 0 else {}
    return {
        **saved,
        "extra_ok": torch.tensor(loaded_extra == extra),
        "load_exact": torch.tensor(all(torch.equal(loaded[n], t) for n, t in after_save.items())),
        "resume_exact": torch.tensor(all(torch.equal(resumed[n], t) for n, t in continued.items())),
        "moved": torch.tensor(any(not torch.equal(continued[n], t) for n, t in after_save.items())),
        "logits": logits,
    }


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("dcp")
    tiny.save_hf("llama3", base / "hf")
    results = run_ranks(_worker, 2, str(base / "hf"), str(base / "ckpt"), str(base / "export"))
    return base, results


@pytest.mark.slow
def test_resume_after_reload_is_bitwise_identical(sharded_run):
    base, results = sharded_run
    for res in results:
        assert res["extra_ok"], "extra.json did not round-trip"
        assert res["load_exact"], "loaded parameters differ from the saved ones"
        assert res["moved"], "the second step changed nothing: the test would prove nothing"
        assert res["resume_exact"], "the step after reload differs from continuing without it"
    names = sorted(p.name for p in (base / "ckpt").iterdir())
    assert names == ["step_000001"]  # the .tmp directory was renamed, not left behind
    assert json.loads((base / "ckpt" / "step_000001" / "extra.json").read_text())["version"] == 1


@pytest.mark.slow
def test_fsdp2_checkpoint_loads_into_one_process(sharded_run):
    """DCP reshards: the fsdp=2 checkpoint loads into a plain model + optimizer, no process group."""
    from model import Transformer, load_model_args
    from parallel.checkpoint import load_sharded
    base, results = sharded_run
    model = Transformer(load_model_args(base / "hf"))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    assert load_sharded(base / "ckpt" / "step_000001", model, opt)["cursor"] == [3, 4]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), results[0]["saved." + name]), name
        state = opt.state[p]
        assert float(state["step"]) == 1.0 and state["exp_avg"].shape == p.shape
        assert state["exp_avg"].abs().sum() > 0


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_same_logits(sharded_run):
    import transformers
    base, results = sharded_run
    assert sorted(p.name for p in base.iterdir() if p.name.startswith("export")) == [
        "export", "export_sharded"]  # no .tmp left behind
    assert (base / "export_sharded" / "model.safetensors.index.json").is_file()
    for export in (base / "export", base / "export_sharded"):
        assert json.loads((export / "config.json").read_text())["torch_dtype"] == "float32"
        # the weights as readable as the config (safetensors 0.8 alone writes them 0600)
        modes = {p.stat().st_mode for p in export.iterdir()}
        assert modes == {(export / "config.json").stat().st_mode}, modes
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
        with torch.no_grad():
            ref = hf.eval()(_batches()[0]).logits
        for res in results:
            torch.testing.assert_close(res["logits"], ref, rtol=1e-5,
                                       atol=1e-6 * float(ref.abs().max()))


def _checkpoints(root, extras: dict):
    from trainer.checkpointing import EXTRA_FILE
    for step, extra in extras.items():
        d = root / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / ".metadata").write_text("")
        (d / EXTRA_FILE).write_text(json.dumps({"step": step, **extra}))


def test_a_resume_refuses_settings_its_state_was_not_counted_in(tmp_path):
    """prompts_per_step, n_samples or the generator replicas changed between attempts: the
    generators' gates count groups in the old step size (the resumed run waited forever or
    overfilled the buffer), the buffer holds groups of the old size, the cursors belong to the old
    replicas; they failed late or hung. Refused before any process group, naming the keys; a
    checkpoint from before settings were saved is checked on its replicas; a buffer that no
    longer fits is refused naming algo.buffer_capacity. Colocated mode, which has no
    checkpoints, refuses to start over a run it would resume."""
    from config import load_config
    from trainer.checkpointing import check_resume
    settings = {"trainer.prompts_per_step": 4, "generator.n_samples": 4, "parallel.gen_dp": 1,
                "algo.max_staleness": 1}
    group = {"prompt_id": 0, "trajectories": [{"token_versions": [2]}] * 4}
    _checkpoints(tmp_path / "checkpoints", {2: {"settings": settings, "generators": {"0": {}},
                                                "buffer": {"groups": [group] * 8}}})
    cfg = lambda *o: load_config("configs/tiny_cpu.toml", [  # noqa: E731
        f"--run.dir={tmp_path}", "--trainer.prompts_per_step=4", "--generator.n_samples=4",
        "--parallel.generator_ranks=1", *o]).resolve(3)
    check_resume(cfg())
    with pytest.raises(ValueError, match=r"with trainer.prompts_per_step=2 \(the checkpoint's run: "
                                         r"4\).*Resume with --trainer.prompts_per_step=4"):
        check_resume(cfg("--trainer.prompts_per_step=2"))
    with pytest.raises(ValueError, match=r"generator.n_samples=8 \(the checkpoint's run: 4\)"):
        check_resume(cfg("--generator.n_samples=8"))
    with pytest.raises(ValueError, match=r"parallel.gen_dp=2 \(the checkpoint's run: 1\)"):
        check_resume(cfg("--parallel.generator_ranks=2"))
    # saved at max_staleness 1 (room for 2 steps, 32 samples), resumed at 0: room for 16
    with pytest.raises(ValueError, match=r"buffer holds 32 samples, more than "
                                         r"algo.buffer_capacity=16 .*--algo.buffer_capacity=32"):
        check_resume(cfg("--algo.max_staleness=0"))
    # a bigger buffer alone resumed, then dropped its 2 steps of groups as stale (or waited for
    # groups the gates would not start): the refusal names the staleness they need
    with pytest.raises(ValueError, match=r"with algo.max_staleness=0 \(the checkpoint's run: 1\): "
                                         r"its 8 buffered and in-flight "
                                         r"groups .* Resume with --algo.max_staleness=1 or more"):
        check_resume(cfg("--algo.max_staleness=0", "--algo.buffer_capacity=32"))
    check_resume(cfg("--algo.max_staleness=1"))
    with pytest.raises(ValueError, match=r"parallel.mode='colocated' has no checkpoints, but this "
                                         r"run would resume from .*step_000002"):
        check_resume(load_config("configs/tiny_cpu.toml", [
            f"--run.dir={tmp_path}", "--parallel.mode=colocated",
            "--checkpoint.every_steps=0"]).resolve(2))
    old = tmp_path / "old"
    _checkpoints(old / "checkpoints", {2: {"generators": {"0": {}, "1": {}}}})
    with pytest.raises(ValueError, match=r"parallel.gen_dp=1 \(the checkpoint's run: 2\)"):
        check_resume(cfg(f"--run.dir={old}"))


def test_an_explicit_resume_path_restarts_from_the_runs_own_checkpoints(tmp_path):
    """checkpoint.resume=<another run's checkpoint>: once this run saved its own (which record
    that origin), a restart or requeue of the same command was refused ('later checkpoints of an
    earlier run'); it now resumes from its latest own one, also after pruning removed the path."""
    import shutil
    from config import load_config
    from trainer.checkpointing import check_resume, origin_of, resume_path
    start = tmp_path / "other" / "checkpoints" / "step_000002"
    _checkpoints(tmp_path / "other" / "checkpoints", {2: {}})
    run = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.toml", [f"--run.dir={run}", f"--checkpoint.resume={start}"])
    assert resume_path(cfg) == start  # nothing of its own yet
    _checkpoints(run / "checkpoints", {4: {"origin": origin_of(start)}, 6: {"origin": origin_of(start)}})
    assert resume_path(cfg) == run / "checkpoints" / "step_000006"
    check_resume(cfg)
    shutil.rmtree(start)
    assert resume_path(cfg) == run / "checkpoints" / "step_000006"
    # checkpoints of another lineage are not this run's: refused as before
    unrelated = tmp_path / "run2"
    _checkpoints(unrelated / "checkpoints", {6: {"origin": "/elsewhere"}})
    _checkpoints(tmp_path / "third" / "checkpoints", {2: {}})
    with pytest.raises(ValueError, match="later checkpoints of an earlier run"):
        check_resume(load_config("configs/tiny_cpu.toml", [
            f"--run.dir={unrelated}",
            f"--checkpoint.resume={tmp_path / 'third' / 'checkpoints' / 'step_000002'}"]))


def test_a_resumed_optimizer_takes_the_configs_settings():
    """The optimizer's param_groups came back from the checkpoint: a changed trainer.lr was
    ignored (metrics logged the old one), and an FSDP run's fused AdamW resumed on a TP layout
    failed at its first step (fused kernels refuse plain tensors beside DTensors). The config's
    settings win; the schedule keeps its position."""
    from trainer.checkpointing import keep_config_hyperparameters
    from trainer.optim import lr_lambda
    def build(lr, fused):
        p = [torch.nn.Parameter(torch.ones(3))]
        opt = torch.optim.AdamW(p, lr=lr, betas=(0.9, 0.99), **({"fused": True} if fused else {"foreach": False}))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 4, 10, "cosine", 0.1))
    old, old_sched = build(1e-2, fused=True)
    for _ in range(3):
        old.param_groups[0]["params"][0].grad = torch.ones(3)
        old.step()
        old_sched.step()
    opt, sched = build(1e-3, fused=False)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.load_state_dict(old.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert opt.param_groups[0]["fused"] and opt.param_groups[0]["lr"] == pytest.approx(
        1e-2 * lr_lambda(3, 4, 10, "cosine", 0.1))  # the checkpoint's, before
    keep_config_hyperparameters(opt, sched, fresh)
    g = opt.param_groups[0]
    assert not g["fused"] and g["foreach"] is False and g["betas"] == (0.9, 0.99)
    assert g["lr"] == pytest.approx(1e-3 * lr_lambda(3, 4, 10, "cosine", 0.1))
    assert sched.get_last_lr() == [g["lr"]] and opt.state_dict()["state"][0]["step"] == 3
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    sched.step()
    assert g["lr"] == pytest.approx(1e-3 * lr_lambda(4, 4, 10, "cosine", 0.1))
    # the other way (TP to FSDP): a fused optimizer over a per-parameter one's state, whose step
    # counts the fused kernel wants on the parameters' device as float32
    fused, fused_sched = build(1e-3, fused=True)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in fused.param_groups]
    fused.load_state_dict(opt.state_dict())
    fused_sched.load_state_dict(sched.state_dict())
    keep_config_hyperparameters(fused, fused_sched, fresh)
    assert fused.param_groups[0]["fused"]
    step = fused.state_dict()["state"][0]["step"]
    assert step.dtype == torch.float32 and int(step) == 4
    fused.param_groups[0]["params"][0].grad = torch.ones(3)
    fused.step()


def test_export_of_args_config_json_cannot_carry_writes_nothing(tmp_path):
    """A model whose args config.json cannot carry (Qwen3 without q/k norms: transformers would
    build them) is refused before the export writes a file: it left `hf.tmp` with the shards."""
    from model import ModelArgs, Transformer
    from parallel.checkpoint import export_hf
    model = Transformer(ModelArgs(arch="Qwen3ForCausalLM", vocab_size=32, hidden_size=16,
                                  intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="cannot export qk_norm=False with Qwen3ForCausalLM"):
        export_hf(model, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_the_interrupted_line_suggests_what_the_mode_allows(tmp_path):
    """Ctrl-C without a checkpoint: split mode is told to set checkpoint.every_steps; colocated
    mode, whose preflight refuses that setting, is told it has none (it was told to set it)."""
    from config import load_config
    from trainer.checkpointing import interrupted_line
    split = load_config(None, [f"--run.dir={tmp_path}"])
    assert interrupted_line(split).endswith("(set --checkpoint.every_steps=N to make a run "
                                            "resumable)")
    colocated = load_config(None, [f"--run.dir={tmp_path}", "--parallel.mode=colocated"])
    line = interrupted_line(colocated)
    assert "colocated mode has no checkpoints: parallel.mode=split can resume" in line
    assert "every_steps" not in line


def test_an_explicit_resume_of_a_step_cut_off_mid_replace_takes_its_old_copy(tmp_path):
    """checkpoint.resume=<run>/checkpoints/step_N where a save of step N again was cut off
    between its renames: 'auto' resumed from the `step_N.old` copy that stands for the step, but
    the path naming the step was refused as 'not a finished checkpoint folder'."""
    from config import load_config
    from trainer.checkpointing import check_resume, origin_of, resume_path, saved
    root = tmp_path / "checkpoints"
    _checkpoints(root, {4: {}, 6: {}})
    (root / "step_000006").rename(root / "step_000006.old")
    step6, aside = root / "step_000006", root / "step_000006.old"
    cfg = lambda resume: load_config("configs/tiny_cpu.toml", [  # noqa: E731
        f"--run.dir={tmp_path}", f"--checkpoint.resume={resume}"])
    assert resume_path(cfg("auto")) == aside
    assert resume_path(cfg(str(step6))) == aside
    check_resume(cfg(str(step6)))
    assert not saved(cfg("auto"), 6)  # a stop saves step 6 again, in its own folder
    with pytest.raises(ValueError, match="step_000005' is not a finished checkpoint folder"):
        check_resume(cfg(str(root / "step_000005")))
    with pytest.raises(ValueError, match="resume='' is not a finished checkpoint folder"):
        check_resume(cfg(""))  # no folder name to look for a copy of
    # the run's own checkpoints descend from the path as given: a restart resumes from them
    _checkpoints(root, {8: {"origin": origin_of(step6)}})
    assert resume_path(cfg(str(step6))) == root / "step_000008"


def test_a_log_line_cut_off_mid_write_is_dropped_on_resume(tmp_path, capsys):
    """A metrics.jsonl (or eval.jsonl) whose last write was cut off (a full disk; a node's crash
    on a network file system, which leaves NUL bytes) failed every resume with JSONDecodeError
    in truncate_steps. The torn lines are dropped, with a line naming the file."""
    from trainer.checkpointing import truncate_steps
    f = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 0.5}) for s in (1, 2, 3)]
    f.write_text("\n".join(rows) + '\n{"step": 4, "lo\x00\x00\n' + rows[0][:5])
    truncate_steps(f, 2)
    assert f.read_text() == rows[0] + "\n" + rows[1] + "\n"
    assert f"{f}: dropped 2 line(s) that are not whole JSON records" in capsys.readouterr().err
    truncate_steps(f, 2)
    assert f.read_text() == rows[0] + "\n" + rows[1] + "\n" and capsys.readouterr().err == ""
