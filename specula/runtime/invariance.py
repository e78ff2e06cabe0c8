"""Row invariance: whether a k-token forward gives each row the very logits of one-token steps over its path.

A speculative method is greedy-equal to vanilla decoding only if the target's verify pass computes every row
bit for bit as vanilla's one-token step does (issue 39): otherwise a near-tie between two tokens can go one way
in the pass and the other in the step. `mismatched_rows` measures that on a target: one forward over a block
(a chain, or a tree with its ancestor mask), then, for each row, one-token steps over the tokens of its path
(the row's ancestors and itself, in block order), compared with `torch.equal`.
"""

from __future__ import annotations

import torch


def tree_block(parents: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(ancestor mask bool [n, n], depths [n]) of a tree given each node's parent (-1: the root), as a verify
    pass of that tree takes them."""
    mask, depths = torch.eye(len(parents), dtype=torch.bool), []
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return mask, depths


def block_paths(n: int, block_mask: torch.Tensor | None) -> list[list[int]]:
    """For each row of a block of n, the block rows it sees in order (its ancestors and itself): a chain's row i
    sees 0..i; a tree's row i the rows ``block_mask`` [n, n] marks."""
    if block_mask is None:
        return [list(range(i + 1)) for i in range(n)]
    return [torch.nonzero(block_mask[i]).flatten().tolist() for i in range(n)]


@torch.no_grad()
def mismatched_rows(target, tokens: torch.Tensor, block_mask: torch.Tensor | None = None,
                    depths: list[int] | None = None) -> list[int]:
    """Rows of one ``target.forward(tokens, block_mask, depths)`` after the committed prefix whose logits are not
    `torch.equal` to those of one-token steps over the row's path; leaves the committed prefix as it found it.

    tokens [n]; block_mask bool [n, n] (None: a causal chain); depths [n] (None: 0..n-1, a chain's)."""
    prefix = target.length
    block = target.forward(tokens, block_mask, depths).logits
    target.commit([])
    stepped: list[int] = []  # the block rows whose steps the cache holds after the prefix, in order
    mismatched = []
    for row, path in enumerate(block_paths(tokens.shape[0], block_mask)):
        shared = 0
        while shared < min(len(stepped), len(path) - 1) and stepped[shared] == path[shared]:
            shared += 1
        target.truncate(prefix + shared)
        del stepped[shared:]
        for i in path[shared:]:
            logits = target.forward(tokens[i:i + 1]).logits[0]
            target.commit()
            stepped.append(i)
        if not torch.equal(logits, block[row]):
            mismatched.append(row)
    target.truncate(prefix)
    return mismatched


def mismatched_blocks(target, chains: list[int], tree_parents: list[int], seed: int = 0,
                      prompt_length: int = 37) -> dict[str, list[int]]:
    """{block: rows whose logits differ from one-token steps} for random chains of each length in ``chains`` and a
    random tree of ``tree_parents`` (each node's parent, -1: the root) after a random prompt of ``prompt_length``
    tokens, on the target's device ({} = row-invariant there)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(3, target.vocab_size, (n,), generator=generator).to(target.device)

    target.prefill(tokens(prompt_length))
    found = {f"chain of {k}": mismatched_rows(target, tokens(k)) for k in chains}
    mask, depths = tree_block(tree_parents)
    found[f"tree of {len(tree_parents)}"] = mismatched_rows(target, tokens(len(tree_parents)),
                                                            mask.to(target.device), depths)
    return {block: rows for block, rows in found.items() if rows}
