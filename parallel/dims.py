"""`ParallelDims`: the one object that owns every parallel degree, the rank map and the meshes.

Rank map (split mode), documented because launch scripts and weight sync rely on it:
    global ranks [0, N - G)  -> trainer mesh, shape (fsdp, tp), tp innermost (tp stays within a node)
    global ranks [N - G, N)  -> generator mesh, shape (dp, tp), tp innermost
The trainer comes first so that global rank 0 is trainer rank 0: it owns the off-policy buffer,
writes metrics and checkpoints. With G a multiple of the GPUs per node, the generator mesh fills
whole nodes at the end of the allocation.
Colocated mode: every rank is both trainer (fsdp x tp over all N) and generator (dp x tp over all N),
time-shared and synchronous; used when the model cannot be held twice.

    python -m parallel.dims --world 1024 --generator-ranks 256 --gen-tp 8 --trainer-tp 8
prints the rank map and per-mesh layouts without creating any process group.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import cached_property


FSDP_UNITS = ("auto", "layer", "model")


def resolve_fsdp_units(policy: str, device_type: str) -> str:
    """`parallel.fsdp_units`. "layer": one FSDP2 unit per decoder layer plus a root unit, each
    resharded after its forward and gathered again in backward, gradients reduce-scattered per
    micro-batch (least memory: ZeRO-3). "model": one unit for the whole model, gathered once per
    step and kept until the last micro-batch's backward, gradients accumulated unsharded and
    reduce-scattered once per step (peak = full parameters + full gradients, as ZeRO-2; 2
    collectives per step instead of 3 per unit and micro-batch). "auto" = "model" on CPU, where
    gloo collectives are slow and host memory is large (fsdp=2 train step 463 -> 419-438 ms,
    BENCHMARKS.md), "layer" on GPUs. Applied by parallel/sharding.py, costed by
    launch/cost_model.py."""
    if policy not in FSDP_UNITS:
        raise ValueError(f"fsdp_units must be 'auto', 'layer' or 'model', got {policy!r}")
    return policy if policy != "auto" else ("model" if device_type == "cpu" else "layer")


def vocab_checkpointable(vocab_size: int, trainer_tp: int, trainer_fsdp: int) -> bool:
    """Whether DCP can save and load the trainer's vocabulary-sharded embeddings and lm_head:
    trainer_tp divides vocab_size, or trainer_fsdp <= 2 (`ParallelDims._check_vocab`; the planner
    skips the other layouts)."""
    return trainer_tp == 1 or trainer_fsdp <= 2 or vocab_size % trainer_tp == 0


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    mode: str = "split"  # "split" | "colocated"
    generator_ranks: int = 1  # G (split); == world_size when colocated
    gen_tp: int = 1
    gen_dp: int = 1
    trainer_fsdp: int = 1
    trainer_tp: int = 1

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, pcfg, world_size: int) -> "ParallelDims":
        """From a *resolved* `config.ParallelConfig` (derived degrees already filled in)."""
        return cls(world_size=world_size, mode=pcfg.mode, generator_ranks=pcfg.generator_ranks,
                   gen_tp=pcfg.gen_tp, gen_dp=pcfg.gen_dp, trainer_fsdp=pcfg.trainer_fsdp,
                   trainer_tp=pcfg.trainer_tp)

    def describe(self) -> str:
        same = " (the same ranks)" if self.mode == "colocated" else ""
        return (f"world_size={self.world_size} mode={self.mode} generator_ranks={self.generator_ranks} "
                f"(gen_dp={self.gen_dp} x gen_tp={self.gen_tp}) trainer_ranks={self.trainer_ranks}"
                f"{same} (trainer_fsdp={self.trainer_fsdp} x trainer_tp={self.trainer_tp})")

    def _fail(self, problem: str, fix: str) -> None:
        raise ValueError(f"invalid parallel layout: {problem}. Factors: {self.describe()}. Fix: {fix}")

    def _validate(self) -> None:
        degrees = dict(world_size=self.world_size, generator_ranks=self.generator_ranks,
                       gen_tp=self.gen_tp, gen_dp=self.gen_dp, trainer_fsdp=self.trainer_fsdp,
                       trainer_tp=self.trainer_tp)
        bad = [k for k, v in degrees.items() if not isinstance(v, int) or v < 1]
        if bad:
            self._fail(f"degrees must be positive integers, got {bad}", "set every degree >= 1")
        if self.mode not in ("split", "colocated"):
            self._fail(f"unknown mode {self.mode!r}", "use --parallel.mode=split or colocated")
        if self.mode == "split" and self.generator_ranks >= self.world_size:
            self._fail(f"split mode needs generator_ranks < world_size (got {self.generator_ranks} >= "
                       f"{self.world_size})", "lower --parallel.generator_ranks or use mode=colocated")
        if self.mode == "colocated" and self.generator_ranks != self.world_size:
            self._fail("colocated mode puts the generator on every rank",
                       f"set --parallel.generator_ranks={self.world_size}")
        if self.gen_dp * self.gen_tp != self.generator_ranks:
            self._fail(f"gen_dp*gen_tp={self.gen_dp * self.gen_tp} != generator_ranks="
                       f"{self.generator_ranks}", "choose gen_tp dividing generator_ranks")
        if self.trainer_fsdp * self.trainer_tp != self.trainer_ranks:
            self._fail(f"trainer_fsdp*trainer_tp={self.trainer_fsdp * self.trainer_tp} != trainer ranks="
                       f"{self.trainer_ranks}", "choose trainer_tp dividing the trainer ranks")

    def check_model(self, num_heads: int, num_kv_heads: int, tied_embeddings: bool = False,
                    intermediate_size: int = 0, vocab_size: int = 0) -> None:
        """TP shards whole heads and the MLP's intermediate size evenly: every tp degree must
        divide both head counts and intermediate_size (an uneven split passed here and then
        broke every forward: the row-parallel down projection assumes equal shards). The
        vocabulary may split unevenly, except on a trainer with fsdp >= 3 (`_check_vocab`)."""
        sizes = {"num_heads": num_heads, "num_kv_heads": num_kv_heads}
        if intermediate_size:
            sizes["intermediate_size"] = intermediate_size
        divides = tp_fits_model(tuple(sizes.values()), tied=False)
        for name, tp, ranks in (("trainer_tp", self.trainer_tp, self.trainer_ranks),
                                ("gen_tp", self.gen_tp, self.generator_ranks)):
            if not divides(tp):  # the degrees this mesh takes too (they divide its ranks)
                fits = [d for d in range(1, num_kv_heads + 1) if divides(d) and ranks % d == 0]
                self._fail(f"{name}={tp} does not divide "
                           + " and ".join(f"{k}={v}" for k, v in sizes.items()),
                           f"pick {name} from {fits}")
            if tp > 1 and tied_embeddings:
                self._fail(f"{name}={tp} with tied input/output embeddings is not supported",
                           f"set {name}=1 (tied models are small) or untie the embeddings")
        self._check_vocab(vocab_size, divides)

    def _check_vocab(self, vocab_size: int, divides) -> None:
        """FSDP2 over a TP shard of uneven size (the embeddings and lm_head when trainer_tp does
        not divide vocab_size) stores chunks that torch's DTensor offsets disagree with from
        fsdp=3 on (parallel/layout.py's docstring): torch.distributed.checkpoint then refuses
        every save ("overlapping chunks") and resume (an AssertionError on the sizes), after the
        steps trained so far. fsdp <= 2 agrees for every size."""
        tp, fsdp = self.trainer_tp, self.trainer_fsdp
        if vocab_size and not vocab_checkpointable(vocab_size, tp, fsdp):
            fits = [d for d in range(1, tp + 1)
                    if vocab_size % d == 0 and divides(d) and self.trainer_ranks % d == 0]
            self._fail(f"trainer_tp={tp} does not divide vocab_size={vocab_size}, and with "
                       f"trainer_fsdp={fsdp} >= 3 the uneven vocabulary shards cannot be saved "
                       "or resumed by torch.distributed.checkpoint",
                       f"pick trainer_tp from {fits}, or a layout with trainer_fsdp <= 2")

    # ----- the rank map ------------------------------------------------------------------
    @property
    def trainer_ranks(self) -> int:
        return self.world_size if self.mode == "colocated" else self.world_size - self.generator_ranks

    @cached_property
    def trainer_rank_list(self) -> list[int]:
        return list(range(self.trainer_ranks))

    @cached_property
    def generator_rank_list(self) -> list[int]:
        if self.mode == "colocated":
            return list(range(self.world_size))
        return list(range(self.trainer_ranks, self.world_size))

    def is_trainer(self, rank: int) -> bool:
        return rank < self.trainer_ranks

    def is_generator(self, rank: int) -> bool:
        return self.mode == "colocated" or rank >= self.trainer_ranks

    def role(self, rank: int) -> str:
        if self.mode == "colocated":
            return "colocated"
        return "trainer" if self.is_trainer(rank) else "generator"

    def trainer_mesh_ranks(self) -> list[list[int]]:
        """[fsdp][tp] -> global rank."""
        r, tp = self.trainer_rank_list, self.trainer_tp
        return [r[i * tp:(i + 1) * tp] for i in range(self.trainer_fsdp)]

    def generator_mesh_ranks(self) -> list[list[int]]:
        """[dp][tp] -> global rank; each row is one generator replica."""
        r, tp = self.generator_rank_list, self.gen_tp
        return [r[i * tp:(i + 1) * tp] for i in range(self.gen_dp)]

    def trainer_coord(self, rank: int) -> tuple[int, int]:
        i = self.trainer_rank_list.index(rank)
        return divmod(i, self.trainer_tp)

    def generator_coord(self, rank: int) -> tuple[int, int]:
        i = self.generator_rank_list.index(rank)
        return divmod(i, self.gen_tp)

    def rank_map(self) -> str:
        """Human-readable rank map, compressed into ranges for large worlds."""
        lines = [self.describe()]
        lines.append(f"  trainer   mesh (fsdp={self.trainer_fsdp}, tp={self.trainer_tp}): "
                     f"{_ranges(self.trainer_rank_list)}")
        lines += _tp_groups(self.trainer_mesh_ranks(), "fsdp", "fsdp shards")
        lines.append(f"  generator mesh (dp={self.gen_dp}, tp={self.gen_tp}): "
                     f"{_ranges(self.generator_rank_list)}")
        lines += _tp_groups(self.generator_mesh_ranks(), "replica", "replicas")
        return "\n".join(lines)


def _tp_groups(rows: list, label: str, plural: str, shown: int = 4) -> list[str]:
    """rank_map's lines for the TP groups of one mesh: the first `shown`, then a count."""
    lines = [f"    {label} {i}: tp group {_ranges(row)}" for i, row in enumerate(rows[:shown])]
    if len(rows) > shown:
        lines.append(f"    ... {len(rows) - shown} more {plural}")
    return lines


def _ranges(ranks: list[int]) -> str:
    if not ranks:
        return "[]"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"[{ranks[0]}..{ranks[-1]}]"
    return str(ranks)


def main(argv=None) -> int:
    from config import int_at_least  # the launch tools' "argument --x: 0 is below 1"
    ap = argparse.ArgumentParser(description="Print the rank map and layouts without process groups.")
    ap.add_argument("--world", type=int_at_least(1), required=True)
    ap.add_argument("--mode", default="split", choices=["split", "colocated"])
    ap.add_argument("--generator-ranks", type=int_at_least(1), default=1)
    ap.add_argument("--gen-tp", type=int_at_least(1), default=1)
    ap.add_argument("--trainer-tp", type=int_at_least(1), default=1)
    ap.add_argument("--model", default="", help="HF folder; prints per-parameter boxes of rank 0s")
    a = ap.parse_args(argv)
    g = a.world if a.mode == "colocated" else a.generator_ranks
    t = a.world if a.mode == "colocated" else a.world - g
    try:
        if t < 1:
            choice = (f"choose 1..{a.world - 1}" if a.world > 1 else
                      "split mode needs --world 2 or more (a trainer rank and a generator rank)")
            raise ValueError(f"--generator-ranks {g} leaves no trainer ranks of --world {a.world}; "
                             f"{choice}, or use --mode colocated")
        _check_divides(("--gen-tp", a.gen_tp, "generator", g), ("--trainer-tp", a.trainer_tp, "trainer", t))
        dims = ParallelDims(a.world, a.mode, g, a.gen_tp, g // a.gen_tp, t // a.trainer_tp, a.trainer_tp)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.model:  # the layouts the runtime refuses (TP vs heads, MLP, tied embeddings) first
        from model.hf_io import load_model_args
        try:
            m = load_model_args(a.model)
            dims.check_model(m.num_heads, m.num_kv_heads, m.tie_word_embeddings,
                             m.intermediate_size, m.vocab_size)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(dims.rank_map())
    if a.model:
        from parallel.sharding import describe_layouts
        print(describe_layouts(dims, a.model))
    return 0


def _check_divides(*meshes: tuple) -> None:
    """ValueError naming the flag whose TP degree does not divide its mesh's ranks (the data
    parallel degree is their quotient), with the degrees that do."""
    for flag, tp, mesh, ranks in meshes:
        if ranks >= 1 and ranks % tp:
            ok = [d for d in range(1, ranks + 1) if ranks % d == 0]
            raise ValueError(f"{flag} {tp} does not divide the {ranks} {mesh} ranks (the data "
                             f"parallel degree is ranks / tp); choose {flag} from {ok}")


def tp_fits_model(sizes, tied: bool):
    """tp degree -> whether it splits a model evenly: it divides every size in `sizes` (head
    counts, the MLP's width; 0: none given) and, above 1, the model has untied embeddings."""
    return lambda tp: tp == 1 or (not tied and all(n % tp == 0 for n in sizes if n))


if __name__ == "__main__":
    sys.exit(main())
