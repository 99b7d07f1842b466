"""Typed batches: what the generator sends (`Trajectory`, `Group`) and what the trainer runs on
(`PackedBatch`: padding-free packed sequences with explicit lengths, as in ReaLHF).

Typical trainer step (advantages are computed per group BEFORE micro-batching, so splitting a
step into micro-batches never changes the baseline):

    trajs = flatten_groups(groups)                                   # S trajectories
    adv_S = group_advantages(rewards_GN(groups), "group_mean").flatten()
    units = prompt_units(trajs, share, max_tokens)                   # a prompt's samples together
    bins = token_budget_bins([packed_tokens(trajs, u) for u in units], max_tokens)
    micro = [pack([trajs[i] for u in b for i in units[u]], ..., share) for b in bins]
    global_tokens = count_loss_tokens(micro)                         # then all-reduce over DP
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from model.transformer import check_parents, packed_positions


@dataclass
class Trajectory:
    """One sampled completion, exactly as the generator produced it (tokens in, tokens out).

    `logp_mu[k]` is the behaviour log-prob of `completion_ids[k]` under the (temperature-scaled)
    sampling distribution, and `token_versions[k]` the policy version that sampled it. Versions
    can differ within one completion when the generator swaps weights mid-sequence; the oldest
    one (`version`) is what staleness is measured by.
    """

    prompt_id: int
    sample_idx: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logp_mu: list[float]
    token_versions: list[int]
    reward: float
    finish_reason: str

    @classmethod
    def from_completion(cls, c, reward: float, prompt_id=None) -> "Trajectory":
        """One engine `Completion` (rollout.engine) with its reward; `prompt_id` defaults to its
        request id (the generator's requests are keyed by start index: a prompt may be in flight
        twice, across an epoch boundary)."""
        prompt_id = c.request_id if prompt_id is None else prompt_id
        return cls(prompt_id=prompt_id, sample_idx=c.sample_idx, prompt_ids=list(c.prompt_ids),
                   completion_ids=list(c.completion_ids), logp_mu=list(c.logp),
                   token_versions=list(c.token_versions), reward=float(reward),
                   finish_reason=c.finish_reason)

    def __post_init__(self) -> None:
        c = len(self.completion_ids)
        if c == 0 or len(self.prompt_ids) == 0:
            raise ValueError(
                f"Trajectory(prompt_id={self.prompt_id}, sample_idx={self.sample_idx}) needs a "
                f"non-empty prompt and completion, got {len(self.prompt_ids)} prompt and {c} "
                "completion tokens")
        if len(self.logp_mu) != c or len(self.token_versions) != c:
            raise ValueError(
                f"Trajectory(prompt_id={self.prompt_id}, sample_idx={self.sample_idx}): "
                f"logp_mu ({len(self.logp_mu)}) and token_versions ({len(self.token_versions)}) "
                f"must have one entry per completion token ({c})")

    @property
    def version(self) -> int:
        """The oldest policy version that sampled any token of this completion."""
        return min(self.token_versions)

    @property
    def num_tokens(self) -> int:
        """Length of the packed sequence (prompt + completion)."""
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        """Every field is a scalar or a flat list, so one level of copying is a full copy
        (`dataclasses.asdict` recurses: 0.5 ms per 8-sample group on the generator's shipping
        path, against 0.05 ms for this)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), list) else v
                for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(**d)


@dataclass
class Group:
    """The n samples of one prompt. They travel, wait and train together (the group baseline
    needs all of them), so the buffer never splits a group."""

    prompt_id: int
    trajectories: list[Trajectory]
    replica: int = -1  # the generator replica that made it (its gate gets a stale drop back)

    def __post_init__(self) -> None:
        if not self.trajectories:
            raise ValueError(f"Group(prompt_id={self.prompt_id}) has no trajectories")
        other = sorted({t.prompt_id for t in self.trajectories} - {self.prompt_id})
        if other:
            raise ValueError(
                f"Group(prompt_id={self.prompt_id}) holds trajectories of prompt ids {other}")

    @staticmethod
    def of_completions(completions, rewards, prompt_ids: dict | None = None) -> list[Group]:
        """Engine `Completion`s (rollout.engine) and their rewards as one group per request, in
        the order of each request's first completion, samples in index order. `prompt_ids` maps
        request ids to prompt ids where they differ (two requests of one prompt: two groups)."""
        by_request: dict[Any, list[Trajectory]] = {}
        for c, r in zip(completions, rewards, strict=True):
            pid = c.request_id if prompt_ids is None else prompt_ids[c.request_id]
            by_request.setdefault(c.request_id, []).append(Trajectory.from_completion(c, r, pid))
        return [Group(ts[0].prompt_id, sorted(ts, key=lambda t: t.sample_idx))
                for ts in by_request.values()]

    @property
    def min_version(self) -> int:
        """The oldest token version in the group: the group is as stale as its stalest token."""
        return min(t.version for t in self.trajectories)

    @property
    def num_samples(self) -> int:
        return len(self.trajectories)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "replica": self.replica,
                "trajectories": [t.to_dict() for t in self.trajectories]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Group:
        return cls(d["prompt_id"], [Trajectory.from_dict(t) for t in d["trajectories"]],
                   d.get("replica", -1))


def flatten_groups(groups: Sequence[Group]) -> list[Trajectory]:
    """Group-major list of trajectories: row g*n + j is sample j of group g."""
    return [t for g in groups for t in g.trajectories]


def rewards_GN(groups: Sequence[Group]) -> Tensor:
    """Rewards as a float32 [G, n] tensor (all groups must have the same size n)."""
    sizes = sorted({g.num_samples for g in groups})
    if len(sizes) != 1:
        raise ValueError(f"rewards_GN needs groups of equal size, got sizes {sizes}")
    return torch.tensor([[t.reward for t in g.trajectories] for g in groups], dtype=torch.float32)


@dataclass
class PackedBatch:
    """S sequences concatenated into one row of N tokens (no padding).

    Alignment: within each sequence `targets_N[i] = input_ids_N[i + 1]`; the last position of
    each sequence has no target (0, masked). `loss_mask_N[i]` is True iff the target at i is a
    completion token, so the per-target fields are defined only there:
    `logp_mu_N` (0 elsewhere), `adv_N` (the sequence's advantage, 0 elsewhere) and
    `versions_N` (the version that sampled the target, -1 elsewhere).

    Worked example: prompt [5, 6] and completion [7, 8] (logp_mu [-.1, -.2], versions [3, 4]):
        input_ids_N   5     6     7     8
        targets_N     6     7     8     0
        loss_mask_N   F     T     T     F
        logp_mu_N     0   -.1   -.2     0
        versions_N   -1     3     4    -1

    Shared prompts (`pack(..., share_prompts=True)`): the samples of one prompt need its forward
    only once. The prompt but its last token is packed once, as a sequence of its own, and each
    sample as a child of it (`seq_parents_S`, the model's mode (b)): the prompt's last token and
    the completion but its last, every target a completion token. Prompt [5, 6], completions
    [7, 8] and [9, 4]:
        input_ids_N    5  |  6   7  |  6   9        seq_lens_S [1, 2, 2], seq_parents_S [-1, 0, 0]
        targets_N      6  |  7   8  |  9   4
        loss_mask_N    F  |  T   T  |  T   T
    """

    input_ids_N: Tensor    # int64 [N]
    seq_lens_S: Tensor     # int64 [S], sums to N
    targets_N: Tensor      # int64 [N]
    loss_mask_N: Tensor    # bool  [N]
    logp_mu_N: Tensor      # float32 [N]
    adv_N: Tensor          # float32 [N]
    versions_N: Tensor     # int64 [N]
    seq_parents_S: Tensor  # int64 [S]: the sequence each one continues, -1 for none

    @property
    def num_tokens(self) -> int:
        return self.input_ids_N.numel()

    @property
    def position_ids_N(self) -> Tensor:
        """Position of each token as the model sees it: from 0 in each sequence, going on from
        the parent's length in a child."""
        parents = check_parents(self.seq_parents_S, len(self.seq_lens_S))
        return packed_positions(self.seq_lens_S, self.num_tokens, parents)[1][0]

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})


def pack(trajs: Sequence[Trajectory], advantages: Sequence[float] | Tensor,
         share_prompts: bool = False) -> PackedBatch:
    """Pack `trajs` into one `PackedBatch`; `advantages[s]` is broadcast over sequence s. With
    `share_prompts`, trajectories with the same prompt (of 2 tokens or more) share its forward
    (see `PackedBatch`); the rest, and every one without it, are packed whole."""
    adv_S = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if adv_S.numel() != len(trajs):
        raise ValueError(f"pack got {len(trajs)} trajectories but {adv_S.numel()} advantages")
    if not trajs:
        raise ValueError("pack needs at least one trajectory")
    cols: dict[str, list] = {k: [] for k in _COLUMNS}
    for members in _prompt_sets(trajs, share_prompts):
        if len(members) == 1:
            _add_whole(cols, trajs[members[0]], float(adv_S[members[0]]))
            continue
        parent = len(cols["lens"])
        _add_prefix(cols, trajs[members[0]].prompt_ids)
        for i in members:
            _add_child(cols, trajs[i], float(adv_S[i]), parent)
    dtypes = {"mask": torch.bool, "lmu": torch.float32, "adv": torch.float32}
    t = {k: torch.tensor(v, dtype=dtypes.get(k, torch.long)) for k, v in cols.items()}
    return PackedBatch(input_ids_N=t["ids"], seq_lens_S=t["lens"], targets_N=t["tgt"],
                       loss_mask_N=t["mask"], logp_mu_N=t["lmu"], adv_N=t["adv"],
                       versions_N=t["ver"], seq_parents_S=t["parents"])


_COLUMNS = ("ids", "tgt", "mask", "lmu", "ver", "adv", "lens", "parents")


def _prompt_sets(trajs: Sequence[Trajectory], share: bool) -> list[list[int]]:
    """Indices of trajectories packed together: one set per distinct prompt of 2+ tokens when
    sharing (in order of first appearance), else one set per trajectory."""
    if not share:
        return [[i] for i in range(len(trajs))]
    sets: dict[Any, list[int]] = {}
    for i, t in enumerate(trajs):
        key = tuple(t.prompt_ids) if len(t.prompt_ids) > 1 else ("alone", i)
        sets.setdefault(key, []).append(i)
    return list(sets.values())


def prompt_units(trajs: Sequence[Trajectory], share: bool, max_tokens: int) -> list[list[int]]:
    """What micro-batching places whole: with `share`, the trajectories of one prompt (split,
    where they would pack to more than `max_tokens`, into runs that fit, each sharing the prompt
    again), else each trajectory alone. `packed_tokens` is what each unit costs."""
    units = []
    for members in _prompt_sets(trajs, share):
        run: list[int] = []
        for i in members:
            if run and packed_tokens(trajs, run + [i]) > max_tokens:
                units.append(run)
                run = []
            run.append(i)
        units.append(run)
    return units


def packed_tokens(trajs: Sequence[Trajectory], members: Sequence[int]) -> int:
    """Tokens `pack` makes of these trajectories of one prompt, shared (`group_tokens`)."""
    return group_tokens(len(trajs[members[0]].prompt_ids),
                        [len(trajs[i].completion_ids) for i in members], share=True)


def group_tokens(prompt_len: int, completion_lens: Sequence[int], share: bool) -> int:
    """Tokens `pack` makes of one prompt's samples: shared (2+ samples of a 2+-token prompt), the
    prompt but its last token once, then each sample's last prompt token and its completion but
    the last; else each sample whole. The planner counts a group with it too
    (`launch.cost_model.Workload.group_train_tokens`)."""
    if share and len(completion_lens) > 1 and prompt_len > 1:
        return prompt_len - 1 + sum(completion_lens)
    return sum(prompt_len + c for c in completion_lens)


def _add(cols: dict[str, list], parent: int, **rows) -> None:
    cols["lens"].append(len(rows["ids"]))
    cols["parents"].append(parent)
    for k, v in rows.items():
        cols[k] += v


def _add_whole(cols, t: Trajectory, adv: float) -> None:
    """Prompt + completion; position i predicts seq[i+1], i.e. completion token i + 1 - p for i
    in [p-1, p+c-2]."""
    p, c = len(t.prompt_ids), len(t.completion_ids)
    seq = list(t.prompt_ids) + list(t.completion_ids)
    _add(cols, -1, ids=seq, tgt=seq[1:] + [0], mask=[False] * (p - 1) + [True] * c + [False],
         lmu=[0.0] * (p - 1) + list(t.logp_mu) + [0.0],
         ver=[-1] * (p - 1) + list(t.token_versions) + [-1],
         adv=[0.0] * (p - 1) + [adv] * c + [0.0])


def _add_prefix(cols, prompt: list[int]) -> None:
    """A shared prompt but its last token: no loss targets."""
    n = len(prompt) - 1
    _add(cols, -1, ids=list(prompt[:-1]), tgt=list(prompt[1:]), mask=[False] * n, lmu=[0.0] * n,
         ver=[-1] * n, adv=[0.0] * n)


def _add_child(cols, t: Trajectory, adv: float, parent: int) -> None:
    """The prompt's last token and the completion but its last: each position predicts the
    next completion token."""
    c = len(t.completion_ids)
    _add(cols, parent, ids=[t.prompt_ids[-1]] + list(t.completion_ids[:-1]),
         tgt=list(t.completion_ids), mask=[True] * c, lmu=list(t.logp_mu),
         ver=list(t.token_versions), adv=[adv] * c)


def token_budget_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Dynamic micro-batching (AReaL): indices grouped so each bin holds <= max_tokens tokens.

    First-fit decreasing: longest first, each into the first bin with room. A sequence longer
    than the budget gets a bin of its own. Deterministic (ties keep input order); indices in each
    bin are ascending.

    >>> token_budget_bins([3, 8, 5, 2, 12], max_tokens=10)
    [[4], [1, 3], [0, 2]]
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def split_by_token_budget(trajs: Sequence[Trajectory], max_tokens: int) -> list[list[Trajectory]]:
    """`token_budget_bins` over trajectory lengths, returning the trajectories themselves.
    Use `token_budget_bins` directly when per-trajectory data (advantages) must follow."""
    bins = token_budget_bins([t.num_tokens for t in trajs], max_tokens)
    return [[trajs[i] for i in b] for b in bins]


def count_loss_tokens(batches: Iterable[PackedBatch]) -> int:
    """Loss tokens over all micro-batches of this rank. Sum it over data-parallel ranks too
    (all-reduce) before `losses.normalize`, so accumulation equals one big batch."""
    return int(sum(int(b.loss_mask_N.sum()) for b in batches))
