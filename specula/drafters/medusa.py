"""`medusa`: draft trees from Medusa heads on the target's last hidden state.

Alignment. The tree's root is the newest token, which the target picked itself
and has not processed yet. The newest token the target *has* processed is the
one before it; its final hidden state h (kept from the prefill, then from every
verification pass: the row of the last accepted node) is what the LM head turned
into the root. Medusa head k reads the same h and predicts the token k steps
after the root, so depth k of the tree holds head k's candidates.

Tree shape. A static tree of rank paths ("choices", Medusa's format): path
[i, j] is the node at depth 2 holding head 2's rank-j token under the depth-1
node holding head 1's rank-i token. Candidates at a depth do not depend on their
parent (Medusa heads all read the same h), so the tree is the product of
per-head top-k lists pruned to the listed paths. A heads directory may hold its
own tree in `medusa_choices.json` (written by `specula train medusa` and
`specula train medusa-tree` from measured head accuracies); it is used unless
choices are given, else the device's default (`DEFAULT_TREES`).

Acceptance. Candidates are deterministic (top-k by rank), so the tree carries no
draft distributions: the loop's Acceptor matches greedily at temperature 0 and
treats each candidate as a point-mass proposal at temperature > 0, which keeps
the output exactly the target's. Medusa's typical acceptance is available only
as the explicitly lossy `specula.acceptance_typical.TypicalAcceptor`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.heads.medusa_head import MedusaHeads
from specula.runtime.target import FeatureRequest, ForwardOutput, Target
from specula.runtime.weights import quantize_every_linear
from specula.sampling import SamplingParams
from specula.tree import DraftTree, check_rank_paths

CHOICES_FILE = "medusa_choices.json"
# A 15-candidate tree, from held-out rank accuracies of pycoder-25m's heads (docs/defaults.md).
DEFAULT_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
                   [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0]]
# The tree of heads that ship none (no medusa_choices.json), per device type (docs/defaults.md).
DEFAULT_TREES = {"cuda": DEFAULT_CHOICES, "cpu": [[0]]}


def default_choices(device: torch.device | str, num_heads: int) -> list[list[int]]:
    """The default tree for ``device``, cut to the heads at hand."""
    tree = DEFAULT_TREES["cuda" if torch.device(device).type == "cuda" else "cpu"]
    return [p for p in tree if len(p) <= num_heads]


def check_choices(choices, num_heads: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Validated rank paths sorted by (depth, ranks): one tree (`check_rank_paths`), within the heads and vocabulary."""
    paths = check_rank_paths(choices, "Medusa tree choices")
    deepest = max(map(len, paths))
    if num_heads is not None and deepest > num_heads:
        raise SpeculaError(f"the Medusa tree is {deepest} deep but there are only {num_heads} heads")
    if vocab_size is not None and max(max(p) for p in paths) >= vocab_size:
        raise SpeculaError(f"a Medusa tree rank is beyond the vocabulary of {vocab_size} tokens")
    return [list(p) for p in sorted(paths, key=lambda p: (len(p), p))]


def read_choices_file(path: str | Path) -> list[list[int]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpeculaError(f"cannot read Medusa tree choices {path}: {err}") from err
    return check_choices(data.get("choices") if isinstance(data, dict) else data)


def check_heads_fit(heads: MedusaHeads, hidden_size: int, vocab_size: int) -> None:
    """Heads must read the target's hidden size and predict over its vocabulary."""
    if heads.hidden_size != hidden_size:
        raise SpeculaError(f"Medusa heads of hidden size {heads.hidden_size} do not fit the target's {hidden_size}")
    if heads.vocab_size != vocab_size:
        raise SpeculaError(f"Medusa heads' vocabulary {heads.vocab_size} does not fit the target's {vocab_size}")


class MedusaDrafter:
    """Proposes the static Medusa candidate tree rooted at the newest token."""

    def __init__(self, target: Target, heads: MedusaHeads, choices: list[list[int]] | None = None,
                 name: str = "medusa"):
        check_heads_fit(heads, target.config.hidden_size, target.vocab_size)
        self.name = name
        self.features = FeatureRequest(final_hidden=True)
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval().attach(target)
        quantize_every_linear(self.heads, target.weights)  # drafting follows the target's weight format
        if choices is None:  # a tree given explicitly must fit the heads; the default is cut to them
            choices = default_choices(target.device, heads.num_heads)
        self.choices = check_choices(choices, heads.num_heads, heads.vocab_size)
        depth = torch.tensor([len(p) for p in self.choices])
        self._depth_index = (depth - 1).to(target.device)  # which head's list each node reads
        self._rank = torch.tensor([p[-1] for p in self.choices], device=target.device)
        index = {tuple(p): i + 1 for i, p in enumerate(self.choices)}  # node 0 is the root
        self._parents = [-1] + [index.get(tuple(p[:-1]), 0) for p in self.choices]
        self.max_depth = int(depth.max())
        # Nodes are in depth order, so the nodes of depth <= d are a prefix of them.
        self._count_to_depth = [1 + int((depth <= d).sum()) for d in range(self.max_depth + 1)]
        self._widest = int(self._rank.max()) + 1
        self.hidden: torch.Tensor | None = None  # h of the newest processed token [H]

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        self.hidden = target_out.hidden[-1]

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        self.hidden = target_out.hidden[-1]

    def fork(self) -> MedusaDrafter:
        other = copy.copy(self)  # the heads and the tree are shared; the state is the newest hidden state
        other.hidden = None
        return other

    @torch.no_grad()
    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        root = int(context[-1])
        depth = min(self.max_depth, max_depth)
        if depth <= 0:
            return DraftTree.root_only(root, device=context.device)
        count = self._count_to_depth[depth]
        logits = self.heads(self.hidden[None], num_heads=depth)[:, 0]  # [depth, V]
        best = torch.topk(torch.softmax(logits.float(), dim=-1), self._widest, dim=-1)  # [depth, widest]
        drafts = best.indices[self._depth_index[: count - 1], self._rank[: count - 1]]
        # A head's probability of its candidate (heads read the same h, so it ignores the parent).
        confidences = best.values[self._depth_index[: count - 1], self._rank[: count - 1]].cpu()
        tokens = torch.cat([torch.tensor([root], device=context.device), drafts.to(context.device)])
        return DraftTree(tokens, self._parents[:count], confidences=torch.cat([torch.ones(1), confidences]))


def build_medusa_drafter(target: Target, draft: str | Path | None, **options) -> MedusaDrafter:
    """The drafter for ``method="medusa"``: heads from ``draft``, tree from options, the directory or the default.

    Options: ``choices`` (rank paths). The EAGLE-2 tree options do not apply to Medusa's static tree.
    """
    if not draft:
        raise SpeculaError("method medusa needs --draft HEAD_DIR, Medusa heads trained for this target")
    flags = {"total_tokens": "--tree-total-tokens", "depth": "--tree-depth", "top_k": "--tree-top-k",
             "num_tokens": "--num-draft-tokens"}
    unsupported = sorted(flags.get(name, name) for name in set(options) - {"choices"})
    if unsupported:
        raise SpeculaError(f"method medusa drafts a static tree (--tree-choices); {', '.join(unsupported)} "
                           f"{'does' if len(unsupported) == 1 else 'do'} not apply to it")
    heads = MedusaHeads.from_pretrained(draft, dtype=target.dtype, device=target.device)
    choices = options.get("choices")
    if choices is None and (Path(draft) / CHOICES_FILE).is_file():
        choices = read_choices_file(Path(draft) / CHOICES_FILE)
    return MedusaDrafter(target, heads, choices)
